//! notify's answer in every one of the 16 IB CM states, for every event number: ids are
//! driven into each state by the handshake where it can reach it (and by the test hook
//! for the SIDR states), then checked against the table of docs/notify-semantics.md, written out here.

use std::time::Duration;

use cm_core::kernel_model::LapState;
use cm_core::{AsyncEventType, CmEvent, CmEventType, CmId, IbCmState, NotifyError, NotifyOutcome};
use cm_mock::sim::{
    DeviceKind, FaultAction, FaultRule, MsgKind, NodeId, SimCmId, SimConfig, SimFabric, SimPair,
    SimSide,
};

const PORT: u16 = 7471;
const MS: Duration = Duration::from_millis(1);

/// The IB CM table of docs/notify-semantics.md, independent of the code under test.
fn documented(state: IbCmState, event: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
    match (event, state) {
        (AsyncEventType::CommEst, IbCmState::RepSent | IbCmState::MraRepRcvd) => {
            Ok(NotifyOutcome::Established)
        }
        (AsyncEventType::CommEst, IbCmState::Established) => Ok(NotifyOutcome::AlreadyEstablished),
        (AsyncEventType::PathMig, IbCmState::Established) => Ok(NotifyOutcome::Established),
        _ => Err(NotifyError::WrongState),
    }
}

/// The fabric of one check: a server and a client, a listener on the server.
type World = SimPair;

fn world(config: SimConfig) -> World {
    let w = SimPair::new(config, 99);
    w.listen(PORT).unwrap();
    w
}

/// The types of every pending event of `side`, each acknowledged.
fn drain(side: &mut SimSide) -> Vec<CmEventType> {
    side.drain()
        .into_iter()
        .map(|(_, event, _)| event)
        .collect()
}

fn established(w: &mut World) -> (SimCmId, SimCmId) {
    let pair = w.connect_until_rep(PORT).unwrap();
    assert_eq!(drain(&mut w.client), [CmEventType::Established]);
    w.fabric.advance(MS);
    assert_eq!(drain(&mut w.server), [CmEventType::Established]);
    pair
}

/// Drives an id into `state` through the protocol (or the test hook for SIDR states).
/// Returns the world, the id, and whether the id lives on the server channel.
fn reach(state: IbCmState) -> (World, SimCmId, bool) {
    let no_mra = SimConfig {
        delayed_mra: false,
        ..SimConfig::default()
    };
    use IbCmState as S;
    let (w, id, server) = match state {
        S::Idle => {
            let mut w = world(SimConfig::default());
            w.fabric
                .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
            let (_, passive) = w.connect_until_rep(PORT).unwrap();
            drain(&mut w.client);
            w.fabric.run_until_idle();
            assert_eq!(drain(&mut w.server), [CmEventType::Unreachable]);
            (w, passive, true)
        }
        S::Listen => {
            let w = SimPair::new(SimConfig::default(), 99);
            let id = w.listen(PORT).unwrap();
            (w, id, true)
        }
        S::ReqSent => {
            let mut w = world(SimConfig::default());
            let id = w.connect(PORT).unwrap();
            (w, id, false)
        }
        S::ReqRcvd => {
            let mut w = world(no_mra);
            w.connect(PORT).unwrap();
            let id = w.request().unwrap();
            (w, id, true)
        }
        S::MraReqSent => {
            let mut w = world(SimConfig::default());
            w.connect(PORT).unwrap();
            let id = w.request().unwrap();
            (w, id, true)
        }
        S::MraReqRcvd => {
            // The passive application sits on the request past the REQ timeout.
            let mut w = world(SimConfig::default());
            let id = w.connect(PORT).unwrap();
            w.request().unwrap();
            w.fabric.advance(Duration::from_secs(5));
            (w, id, false)
        }
        S::RepSent => {
            let mut w = world(SimConfig::default());
            let (_, passive) = w.connect_until_rep(PORT).unwrap();
            (w, passive, true)
        }
        S::RepRcvd => {
            let mut w = world(no_mra);
            let (active, _) = w.connect_until_rep(PORT).unwrap();
            (w, active, false)
        }
        S::MraRepSent => {
            let mut w = world(SimConfig::default());
            let (active, _) = w.connect_until_rep(PORT).unwrap();
            (w, active, false)
        }
        S::MraRepRcvd => {
            // The active application sits on the REP past the REP timeout.
            let mut w = world(SimConfig::default());
            let (_, passive) = w.connect_until_rep(PORT).unwrap();
            w.fabric.advance(Duration::from_secs(5));
            (w, passive, true)
        }
        S::Established => {
            let mut w = world(SimConfig::default());
            let (_, passive) = established(&mut w);
            (w, passive, true)
        }
        S::DreqSent => {
            let mut w = world(SimConfig::default());
            let (active, _) = established(&mut w);
            active.disconnect().unwrap();
            (w, active, false)
        }
        S::DreqRcvd => {
            let mut w = world(SimConfig::default());
            let (active, passive) = established(&mut w);
            active.disconnect().unwrap();
            w.fabric.advance(MS);
            assert_eq!(drain(&mut w.server), [CmEventType::Disconnected]);
            (w, passive, true)
        }
        S::Timewait => {
            let mut w = world(SimConfig::default());
            let (active, passive) = established(&mut w);
            active.disconnect().unwrap();
            w.fabric.advance(MS);
            drain(&mut w.server);
            passive.disconnect().unwrap();
            w.fabric.advance(MS);
            assert_eq!(drain(&mut w.client), [CmEventType::Disconnected]);
            (w, active, false)
        }
        S::SidrReqSent | S::SidrReqRcvd => {
            let mut w = world(SimConfig::default());
            let (_, passive) = established(&mut w);
            passive.force_ib_state(state).unwrap();
            (w, passive, true)
        }
    };
    assert_eq!(
        id.ib_state().unwrap(),
        Some(state),
        "could not drive an id into {state}"
    );
    (w, id, server)
}

/// Every event number worth trying: all known ones and a few unknown ones. COMM_EST
/// last, since it may change the state.
fn event_numbers() -> Vec<AsyncEventType> {
    let mut events: Vec<AsyncEventType> = (0..=24u32)
        .chain([63, 255, 1 << 20, u32::MAX])
        .filter(|&n| n != 4)
        .map(AsyncEventType::from_raw)
        .collect();
    events.push(AsyncEventType::CommEst);
    events
}

fn check_state(w: &mut World, id: &SimCmId, server: bool, state: IbCmState, how: &str) {
    for event in event_numbers() {
        let expected = documented(state, event);
        let got = id.notify(event);
        assert_eq!(
            got,
            expected,
            "{how}: notify({event}, #{}) in {state}: expected {expected:?}, got {got:?}",
            event.as_raw()
        );
        if event != AsyncEventType::CommEst {
            assert_eq!(
                id.ib_state().unwrap(),
                Some(state),
                "{how}: {event} changed the state"
            );
        }
    }
    // Exactly one ESTABLISHED follows a forced establish; nothing follows otherwise
    // (an active id that got its REP still has its CONNECT_RESPONSE to read, which
    // librdmacm turns into its one ESTABLISHED).
    w.fabric.advance(MS);
    let channel = if server { &mut w.server } else { &mut w.client };
    let events = drain(channel);
    let forced = documented(state, AsyncEventType::CommEst) == Ok(NotifyOutcome::Established);
    let rep_pending = !server && matches!(state, IbCmState::RepRcvd | IbCmState::MraRepSent);
    let established = events
        .iter()
        .filter(|e| **e == CmEventType::Established)
        .count();
    assert_eq!(
        established,
        usize::from(forced) + usize::from(rep_pending),
        "{how}: ESTABLISHED events after notify in {state}: {events:?}"
    );
    assert_eq!(w.fabric.stats().forced_establishes, u64::from(forced));
    if forced {
        assert_eq!(id.ib_state().unwrap(), Some(IbCmState::Established));
        assert_eq!(
            id.notify(AsyncEventType::CommEst),
            Ok(NotifyOutcome::AlreadyEstablished)
        );
    }
}

#[test]
fn every_state_reached_by_the_handshake_answers_per_the_table() {
    assert_eq!(IbCmState::ALL.len(), 16);
    for &state in IbCmState::ALL {
        let (mut w, id, server) = reach(state);
        check_state(&mut w, &id, server, state, "reached");
    }
}

#[test]
fn every_state_set_directly_answers_per_the_table() {
    for &state in IbCmState::ALL {
        let mut w = world(SimConfig::default());
        let (_, passive) = w.connect_until_rep(PORT).unwrap();
        passive.force_ib_state(state).unwrap();
        check_state(&mut w, &passive, true, state, "forced");
    }
}

#[test]
fn rdma_cm_level_checks_come_before_the_table() {
    let mut w = world(SimConfig::default());
    // No device: EINVAL. Bound to a device but no IB CM id: EINVAL.
    let fresh = w.client.channel.create_id();
    assert_eq!(
        fresh.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
    let bound = w.client.channel.create_id();
    bound.bind(1).unwrap();
    assert_eq!(
        bound.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
    // Destroyed: the kernel no longer knows the handle.
    bound.destroy().unwrap();
    assert_eq!(
        bound.notify(AsyncEventType::CommEst),
        Err(NotifyError::UnknownId)
    );
    // Device going down: ENODEV for COMM_EST, the table for the rest.
    let (_, passive) = w.connect_until_rep(PORT).unwrap();
    w.fabric
        .node(NodeId(0))
        .unwrap()
        .set_going_down(true)
        .unwrap();
    assert_eq!(
        passive.notify(AsyncEventType::CommEst),
        Err(NotifyError::NoDevice)
    );
    assert_eq!(
        passive.notify(AsyncEventType::PathMig),
        Err(NotifyError::WrongState)
    );
    w.fabric
        .node(NodeId(0))
        .unwrap()
        .set_going_down(false)
        .unwrap();
    assert_eq!(
        passive.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::Established)
    );
}

#[test]
fn path_mig_depends_on_the_lap_state() {
    let mut w = world(SimConfig::default());
    let (_, passive) = established(&mut w);
    for (lap, expected) in [
        (LapState::Uninit, Ok(NotifyOutcome::Established)),
        (LapState::Idle, Ok(NotifyOutcome::Established)),
        (LapState::Busy, Err(NotifyError::WrongState)),
    ] {
        passive.set_lap_state(lap).unwrap();
        assert_eq!(passive.notify(AsyncEventType::PathMig), expected, "{lap:?}");
    }
    w.fabric.advance(MS);
    assert!(
        drain(&mut w.server).is_empty(),
        "PATH_MIG produces no CM event"
    );
}

#[test]
fn iwarp_notify_is_a_no_op_returning_zero_for_any_event() {
    let fabric = SimFabric::new(SimConfig::default(), 1);
    let node = fabric.add_node_with(DeviceKind::Iwarp);
    let channel = node.create_channel();
    let listener = channel.create_id();
    listener.bind(PORT).unwrap();
    listener.listen().unwrap();
    for raw in [0, 4, 6, 11, 999] {
        assert_eq!(
            listener.notify(AsyncEventType::from_raw(raw)),
            Ok(NotifyOutcome::Established)
        );
    }
    assert_eq!(listener.ib_state().unwrap(), Some(IbCmState::Listen));
}

/// An iWARP pair plays the MPA exchange: the passive side is established as it accepts
/// (no RTU is sent, so dropping every RTU changes nothing), ids say notify forces
/// nothing, and a reject arrives as REJECTED with -ECONNRESET and the private data.
#[test]
fn iwarp_establishes_at_accept_with_no_rtu_and_rejects_with_econnreset() {
    let config = SimConfig {
        device_kind: DeviceKind::Iwarp,
        ..SimConfig::default()
    };
    let mut w = world(config);
    w.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    let (active, passive) = w.connect_until_rep(PORT).unwrap();
    assert!(!active.notify_forces() && !passive.notify_forces());
    w.fabric.advance(MS);
    assert_eq!(drain(&mut w.server), [CmEventType::Established]);
    assert_eq!(drain(&mut w.client), [CmEventType::Established]);
    w.fabric.advance(Duration::from_secs(100));
    assert_eq!(drain(&mut w.server), [], "no REP retries, no UNREACHABLE");
    assert_eq!(w.fabric.stats().sent[MsgKind::Rtu.index()], 0, "no RTU");

    let _refused = w.connect(PORT).unwrap();
    let request = w.request().unwrap();
    request.reject(b"full").unwrap();
    w.fabric.advance(MS);
    let rejected = w.client.expect_event(CmEventType::Rejected).unwrap();
    assert_eq!(rejected.status(), -104, "-ECONNRESET");
    assert_eq!(
        cm_core::RejectReason::from_status(rejected.status()),
        cm_core::RejectReason::Consumer
    );
    assert!(rejected.private_data().starts_with(b"full"));
}
