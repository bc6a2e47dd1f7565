//! API misuse on the simulated fabric is refused with typed errors, or cannot be
//! written at all (acknowledging twice: `CmEvent::ack` takes the event by value, see
//! the compile_fail examples in `cm_core::decode`).

use std::time::Duration;

use cm_core::{
    AsyncEventSource, AsyncEventType, CmError, CmEvent, CmEventSource, CmEventType, CmId,
    NotifyError, NotifyOutcome,
};
use cm_mock::sim::{
    FaultAction, FaultRule, MsgKind, SimCmEvent, SimCmId, SimConfig, SimPair, SimSide,
};

const PORT: u16 = 4791;

/// A listener on the server and an active id on the client.
struct Pair {
    sim: SimPair,
    active: SimCmId,
}

fn next(side: &mut SimSide) -> SimCmEvent {
    side.next_event()
        .expect("a live channel")
        .expect("an event is pending")
}

/// A listener on the server and an active id on the client with its REQ delivered.
fn connecting(rules: &[FaultRule]) -> Pair {
    let mut sim = SimPair::new(SimConfig::default(), 3);
    for rule in rules {
        sim.fabric.add_fault(*rule);
    }
    sim.listen(PORT).unwrap();
    let active = sim.connect(PORT).unwrap();
    sim.drive(SimPair::STEP);
    Pair { sim, active }
}

/// Accepts the pending request; returns the passive id (REP sent, RTU lost).
fn accepted(pair: &mut Pair) -> SimCmId {
    let request = next(&mut pair.sim.server);
    assert_eq!(request.event_type(), CmEventType::ConnectRequest);
    let passive = request.id();
    request.ack().unwrap();
    pair.sim.accept(&passive).unwrap();
    passive
}

#[test]
fn notify_on_a_destroyed_id_is_unknown_id() {
    let mut pair = connecting(&[FaultRule::new(MsgKind::Rtu, FaultAction::Drop)]);
    let passive = accepted(&mut pair);
    passive.destroy().unwrap();
    assert_eq!(
        passive.notify(AsyncEventType::CommEst),
        Err(NotifyError::UnknownId)
    );
    assert_eq!(NotifyError::UnknownId.errno(), cm_core::errno::ENOENT);
    // Every other call on it is refused as gone, never as something else.
    for result in [
        passive.accept(b""),
        passive.disconnect(),
        passive.destroy(),
        passive.post_send(1),
        passive.migrate(&pair.sim.server.channel),
    ] {
        assert!(
            matches!(result, Err(CmError::Gone { what: "id", .. })),
            "{result:?}"
        );
    }
    assert!(matches!(passive.create_qp(), Err(CmError::Gone { .. })));
}

#[test]
fn destroying_an_id_with_an_unacknowledged_event_is_refused_until_the_ack() {
    let mut pair = connecting(&[]);
    let request = next(&mut pair.sim.server);
    let passive = request.id();
    assert_eq!(passive.unacked_events(), Ok(1));
    assert_eq!(
        passive.destroy(),
        Err(CmError::UnackedEvents {
            op: "rdma_destroy_id",
            unacked: 1
        })
    );
    assert!(passive.is_alive());
    // Acknowledging after the refused destroy is fine; then the destroy goes through.
    request.ack().unwrap();
    assert_eq!(passive.unacked_events(), Ok(0));
    passive.destroy().unwrap();
    assert!(!passive.is_alive());
}

#[test]
fn an_event_dropped_after_its_id_is_destroyed_cannot_happen_and_acks_count_once() {
    let mut pair = connecting(&[]);
    let request = next(&mut pair.sim.server);
    let passive = request.id();
    // The only order the API allows: ack (here by dropping), then destroy.
    drop(request);
    passive.destroy().unwrap();
    let stats = pair.sim.fabric.stats();
    assert_eq!(stats.events_acked, stats.events_delivered);
}

#[test]
fn destroying_a_channel_with_an_unacknowledged_event_is_refused() {
    let mut pair = connecting(&[]);
    let request = next(&mut pair.sim.server);
    assert_eq!(
        pair.sim.server.channel.destroy(),
        Err(CmError::UnackedEvents {
            op: "rdma_destroy_event_channel",
            unacked: 1
        })
    );
    assert!(!pair.sim.server.channel.is_destroyed());
    // The held event is still usable: its channel is still there.
    assert_eq!(request.event_type(), CmEventType::ConnectRequest);
    request.ack().unwrap();
    pair.sim.server.channel.destroy().unwrap();
    assert!(pair.sim.server.channel.is_destroyed());
}

#[test]
fn a_destroyed_channel_refuses_reads_migrations_and_a_second_destroy() {
    let mut pair = connecting(&[]);
    let spare = pair.sim.server.node.create_channel();
    spare.destroy().unwrap();
    let mut reader = spare.clone();
    assert!(matches!(
        reader.try_next_event(),
        Err(CmError::Gone {
            what: "channel",
            ..
        })
    ));
    assert!(matches!(
        spare.destroy(),
        Err(CmError::Gone {
            what: "channel",
            ..
        })
    ));
    // Migrating a live id to the closed channel is refused; the id stays where it was.
    let passive = accepted(&mut pair);
    assert!(matches!(
        passive.migrate(&spare),
        Err(CmError::Gone {
            what: "channel",
            ..
        })
    ));
    assert!(passive.is_alive());
    passive.migrate(&pair.sim.server.channel).unwrap();
    // An id created on the closed channel is born destroyed.
    let orphan = spare.create_id();
    assert!(!orphan.is_alive());
    assert!(matches!(orphan.bind(PORT + 1), Err(CmError::Gone { .. })));
    assert_eq!(
        orphan.notify(AsyncEventType::CommEst),
        Err(NotifyError::UnknownId)
    );
}

#[test]
fn destroying_a_channel_destroys_its_live_ids_and_the_peer_is_told() {
    let mut pair = connecting(&[FaultRule::new(MsgKind::Rtu, FaultAction::Drop)]);
    let passive = accepted(&mut pair);
    let established = next(&mut pair.sim.client);
    assert_eq!(established.event_type(), CmEventType::Established);
    established.ack().unwrap();
    pair.sim.server.channel.destroy().unwrap();
    assert!(!passive.is_alive());
    assert_eq!(
        passive.notify(AsyncEventType::CommEst),
        Err(NotifyError::UnknownId)
    );
    pair.sim.fabric.run_until_idle();
    // The passive id was in REP_SENT: its destroy sent a REJ, which the established
    // active side reports as REJECTED (cm_rej_handler in ESTABLISHED).
    let rejected = next(&mut pair.sim.client);
    assert_eq!(rejected.event_type(), CmEventType::Rejected);
    rejected.ack().unwrap();
    pair.active.destroy().unwrap();
}

#[test]
fn comm_est_for_a_destroyed_id_is_refused_not_established() {
    let mut pair = connecting(&[FaultRule::new(MsgKind::Rtu, FaultAction::Drop)]);
    let passive = accepted(&mut pair);
    next(&mut pair.sim.client).ack().unwrap();
    pair.active.post_send(8).unwrap();
    pair.sim.fabric.advance(Duration::from_millis(1));
    let mut device = pair.sim.server.node.device();
    let comm_est = device.try_next_async_event().unwrap().unwrap();
    assert_eq!(comm_est.event_type, AsyncEventType::CommEst);
    assert_eq!(comm_est.qp_num(), passive.qp_num());
    // The application destroys the id before forwarding the COMM_EST.
    passive.destroy().unwrap();
    assert_eq!(
        passive.notify(AsyncEventType::CommEst),
        Err(NotifyError::UnknownId)
    );
    pair.sim.fabric.run_until_idle();
    while let Some(event) = pair.sim.server.channel.try_next_event().unwrap() {
        assert_ne!(event.event_type(), CmEventType::Established);
    }
}

#[test]
fn notify_twice_forces_once_then_answers_already_established() {
    let mut pair = connecting(&[FaultRule::new(MsgKind::Rtu, FaultAction::Drop)]);
    let passive = accepted(&mut pair);
    assert_eq!(
        passive.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::Established)
    );
    assert_eq!(
        passive.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    pair.sim.fabric.run_until_idle();
    let mut established = 0;
    while let Some(event) = pair.sim.server.channel.try_next_event().unwrap() {
        established += u32::from(event.event_type() == CmEventType::Established);
    }
    assert_eq!(established, 1);
}
