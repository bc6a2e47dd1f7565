//! Behaviour of the simulated fabric itself: handshake, retransmissions, faults,
//! event-channel accounting, determinism, scale.

use std::time::Duration;

use cm_core::{
    errno, AsyncEvent, AsyncEventSource, AsyncEventType, CmError, CmEventType, CmId, IbCmState,
    NotifyError, NotifyOutcome, QpNum,
};
use cm_mock::sim::{
    FaultAction, FaultOdds, FaultRule, MsgKind, SimCmId, SimConfig, SimPair, SimSide,
};

const PORT: u16 = 18515;

/// The pair with a listener on [`PORT`].
fn pair(config: SimConfig, seed: u64) -> SimPair {
    let p = SimPair::new(config, seed);
    p.listen(PORT).unwrap();
    p
}

/// Starts `n` connections: resolves, creates QPs, connects, and lets the passive side
/// accept every request. Returns (active, passive) ids. The active side has not read its
/// CONNECT_RESPONSE yet (no RTU sent).
fn start(p: &mut SimPair, n: usize) -> Vec<(SimCmId, SimCmId)> {
    start_lossy(p, n)
        .into_iter()
        .map(|(a, b)| (a, b.expect("every REQ reached the passive side")))
        .collect()
}

/// Like [`start`], for fabrics that may lose REQs: the passive id may be missing.
fn start_lossy(p: &mut SimPair, n: usize) -> Vec<(SimCmId, Option<SimCmId>)> {
    let server_node = p.server.node.clone();
    let actives: Vec<SimCmId> = (0..n)
        .map(|_| {
            let id = p.client.channel.create_id();
            id.resolve_addr(server_node.id(), PORT).unwrap();
            id
        })
        .collect();
    p.fabric.advance(Duration::from_millis(1));
    assert_eq!(p.client.drain().len(), n);
    for id in &actives {
        id.resolve_route().unwrap();
    }
    p.fabric.advance(Duration::from_millis(1));
    assert_eq!(p.client.drain().len(), n);
    for id in &actives {
        id.create_qp().unwrap();
        id.connect(&[]).unwrap();
    }
    p.fabric.advance(Duration::from_millis(1));
    let mut passives = vec![None; n];
    for (id, kind, _) in p.server.drain() {
        assert_eq!(kind, CmEventType::ConnectRequest);
        id.create_qp().unwrap();
        id.accept(&[]).unwrap();
        let conn = id.conn().unwrap().0 as usize;
        passives[conn % n] = Some(id);
    }
    p.fabric.advance(Duration::from_millis(1));
    actives.into_iter().zip(passives).collect()
}

#[test]
fn a_side_has_input_while_its_channel_or_its_device_holds_something() {
    let mut p = SimPair::new(SimConfig::default(), 21);
    assert!(!p.client.has_input());
    let id = p.client.channel.create_id();
    id.resolve_addr(p.server.node.id(), PORT).unwrap();
    p.fabric.run_until_idle();
    assert!(p.client.has_input(), "ADDR_RESOLVED on the channel");
    assert_eq!(p.client.drain().len(), 1);
    assert!(!p.client.has_input());
    let fatal = AsyncEvent::qp(AsyncEventType::QpFatal, QpNum(0x11));
    p.client.device.raise(fatal);
    assert!(p.client.has_input(), "an asynchronous event on the device");
    assert!(!p.server.has_input(), "the other side's device");
    assert_eq!(p.client.device.try_next_async_event(), Ok(Some(fatal)));
    assert!(!p.client.has_input());
}

#[test]
fn clean_handshake_gives_one_established_per_side_and_kernel_states() {
    let mut p = SimPair::new(SimConfig::default(), 1);
    let listener = p.listen(PORT).unwrap();
    let conns = start(&mut p, 1);
    let (active, passive) = &conns[0];
    // The delayed MRA: REP received, nothing sent yet, waiting for the application.
    assert_eq!(active.ib_state().unwrap(), Some(IbCmState::MraRepSent));
    assert_eq!(passive.ib_state().unwrap(), Some(IbCmState::RepSent));
    let active_events = p.client.drain();
    assert_eq!(active_events.len(), 1);
    assert_eq!(active_events[0].1, CmEventType::Established);
    p.fabric.advance(Duration::from_millis(1));
    let passive_events = p.server.drain();
    assert_eq!(passive_events.len(), 1);
    assert_eq!(passive_events[0].1, CmEventType::Established);
    assert_eq!(active.ib_state().unwrap(), Some(IbCmState::Established));
    assert_eq!(passive.ib_state().unwrap(), Some(IbCmState::Established));
    // Nothing more ever happens: no retransmission is pending.
    p.fabric.run_until_idle();
    assert!(p.server.drain().is_empty() && p.client.drain().is_empty());
    assert_eq!(p.fabric.stats().retransmissions, 0);
    assert!(listener.is_alive());
}

#[test]
fn lost_rtu_is_recovered_by_rep_retransmission_after_the_cm_response_timeout() {
    let mut p = pair(SimConfig::default().traced(), 2);
    p.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop).nth(0));
    let conns = start(&mut p, 1);
    p.client.drain();
    p.fabric.advance(Duration::from_secs(1));
    assert!(p.server.drain().is_empty());
    assert_eq!(conns[0].1.ib_state().unwrap(), Some(IbCmState::RepSent));
    p.fabric.advance(Duration::from_secs(4));
    let events = p.server.drain();
    assert_eq!(events.len(), 1, "{}", p.fabric.trace().unwrap());
    assert_eq!(events[0].1, CmEventType::Established);
    assert_eq!(p.fabric.stats().sent_of(MsgKind::Rep), 2);
    assert_eq!(p.fabric.stats().sent_of(MsgKind::Rtu), 2);
}

#[test]
fn all_rtus_lost_gives_unreachable_after_sixteen_reps_then_notify_is_einval() {
    let mut p = pair(SimConfig::soft_roce(), 3);
    p.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    let conns = start(&mut p, 1);
    p.client.drain();
    p.fabric.run_until_idle();
    let events = p.server.drain();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].1, CmEventType::Unreachable);
    assert_eq!(events[0].2, -errno::ETIMEDOUT);
    assert_eq!(p.fabric.stats().sent_of(MsgKind::Rep), 16);
    // 16 sends, each followed by the ~4.3 s timeout.
    let expected = Duration::from_nanos(16 * (4_096 << 20));
    assert!(p.fabric.now() >= expected);
    assert_eq!(
        conns[0].1.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
}

#[test]
fn slow_active_application_gets_the_passive_side_to_mra_rep_rcvd() {
    let mut p = pair(SimConfig::default(), 4);
    let conns = start(&mut p, 1);
    // The active application does not read its channel for 5 s: the REP is resent and
    // answered by the delayed MRA.
    p.fabric.advance(Duration::from_secs(5));
    assert_eq!(conns[0].1.ib_state().unwrap(), Some(IbCmState::MraRepRcvd));
    assert_eq!(p.fabric.stats().sent_of(MsgKind::Mra), 1);
    p.client.drain();
    p.fabric.advance(Duration::from_millis(1));
    let events = p.server.drain();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].1, CmEventType::Established);
}

#[test]
fn unacked_events_block_destroy_and_drop_acks() {
    let mut p = pair(SimConfig::default(), 5);
    let id = p.client.channel.create_id();
    id.resolve_addr(cm_mock::sim::NodeId(0), PORT).unwrap();
    p.fabric.advance(Duration::from_millis(1));
    let event = p.client.next_event().unwrap().unwrap();
    assert_eq!(id.unacked_events().unwrap(), 1);
    assert_eq!(
        id.destroy(),
        Err(CmError::UnackedEvents {
            op: "rdma_destroy_id",
            unacked: 1
        })
    );
    drop(event);
    assert_eq!(id.unacked_events().unwrap(), 0);
    id.destroy().unwrap();
    assert_eq!(
        id.notify(AsyncEventType::CommEst),
        Err(NotifyError::UnknownId)
    );
    assert!(matches!(id.connect(&[]), Err(CmError::Gone { .. })));
    let stats = p.fabric.stats();
    assert_eq!(stats.events_delivered, stats.events_acked);
}

#[test]
fn events_of_a_destroyed_id_are_discarded_and_migration_moves_pending_events() {
    let mut p = pair(SimConfig::default(), 6);
    let mut other = SimSide::new(p.client.node.clone());
    let a = p.client.channel.create_id();
    let b = p.client.channel.create_id();
    a.resolve_addr(cm_mock::sim::NodeId(0), PORT).unwrap();
    b.resolve_addr(cm_mock::sim::NodeId(0), PORT).unwrap();
    p.fabric.advance(Duration::from_millis(1));
    a.destroy().unwrap();
    b.migrate(&other.channel).unwrap();
    assert!(p.client.next_event().unwrap().is_none());
    let moved = other.drain();
    assert_eq!(moved.len(), 1);
    assert_eq!(moved[0].0, b);
    assert_eq!(p.fabric.stats().events_discarded, 1);
}

#[test]
fn same_seed_same_trace_different_seed_different_trace() {
    let run = |seed: u64| {
        let mut p = pair(SimConfig::default().traced(), seed);
        for kind in MsgKind::ALL {
            p.fabric.set_fault_odds(
                kind,
                FaultOdds {
                    drop: 0.2,
                    duplicate: 0.1,
                    delay: 0.1,
                    max_delay: Duration::from_millis(3),
                    reorder: 0.1,
                },
            );
        }
        let conns = start_lossy(&mut p, 8);
        p.client.drain();
        for (active, _) in &conns {
            let _ = active.post_send(8);
        }
        p.fabric.run_until_idle();
        p.server.drain();
        p.fabric.trace().unwrap()
    };
    let a = run(11);
    assert_eq!(a, run(11));
    assert_ne!(a, run(12));
    assert!(a.to_string().contains("REQ"));
}

#[test]
fn comm_est_is_raised_once_and_not_in_soft_roce_mode() {
    for (config, expected) in [(SimConfig::default(), 1), (SimConfig::soft_roce(), 0)] {
        let mut p = pair(config, 7);
        p.fabric
            .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
        let conns = start(&mut p, 1);
        p.client.drain();
        conns[0].0.post_send(16).unwrap();
        conns[0].0.post_send(16).unwrap();
        p.fabric.advance(Duration::from_millis(1));
        let node = p.fabric.node(cm_mock::sim::NodeId(0)).unwrap();
        let mut device = node.device();
        let mut comm_est = 0;
        while let Some(event) = device.try_next_async_event().unwrap() {
            assert_eq!(event.event_type, AsyncEventType::CommEst);
            assert_eq!(event.qp_num(), conns[0].1.qp_num());
            comm_est += 1;
        }
        assert_eq!(comm_est, expected);
        let first = device.poll_cq().unwrap();
        assert_eq!(Some(first.qp), conns[0].1.qp_num());
        assert_eq!(first.byte_len, 16);
        assert!(device.poll_cq().is_some() && device.poll_cq().is_none());
        assert_eq!(
            conns[0].1.notify(AsyncEventType::CommEst),
            Ok(NotifyOutcome::Established)
        );
    }
}

#[test]
fn no_listener_rejects_and_bad_calls_are_typed_errors() {
    let mut p = pair(SimConfig::default(), 8);
    let id = p.client.channel.create_id();
    assert!(matches!(id.connect(&[]), Err(CmError::Os { .. })));
    assert!(matches!(id.accept(&[]), Err(CmError::Os { .. })));
    assert!(matches!(id.create_qp(), Err(CmError::Os { .. })));
    assert!(matches!(id.post_send(1), Err(CmError::Os { .. })));
    assert!(matches!(
        id.resolve_addr(cm_mock::sim::NodeId(99), 1),
        Err(CmError::InvalidArgument { .. })
    ));
    id.resolve_addr(cm_mock::sim::NodeId(0), PORT + 1).unwrap();
    p.fabric.advance(Duration::from_millis(1));
    id.resolve_route().unwrap();
    p.fabric.advance(Duration::from_millis(1));
    p.client.drain();
    id.create_qp().unwrap();
    id.connect(&[]).unwrap();
    p.fabric.advance(Duration::from_millis(1));
    let events = p.client.drain();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].1, CmEventType::Rejected);
    assert_eq!(events[0].2, 8);
}

#[test]
fn hundred_thousand_connections_with_ten_percent_rtu_loss_all_establish_exactly_once() {
    check_scale(100_000);
}

fn check_scale(n: usize) {
    let mut p = pair(SimConfig::default(), 9);
    p.fabric.set_fault_odds(MsgKind::Rtu, FaultOdds::drop(0.1));
    let conns = start(&mut p, n);
    let active_events = p.client.drain();
    assert!(active_events
        .iter()
        .all(|e| e.1 == CmEventType::Established));
    for (active, _) in &conns {
        active.post_send(64).unwrap();
    }
    p.fabric.advance(Duration::from_millis(1));
    let node = p.fabric.node(cm_mock::sim::NodeId(0)).unwrap();
    let mut device = node.device();
    let mut forced = 0;
    while let Some(event) = device.try_next_async_event().unwrap() {
        let qp = event.qp_num().unwrap();
        let index = (qp.0 as usize - 0x11 - n) % n;
        let passive = &conns[index].1;
        assert_eq!(passive.qp_num(), Some(qp));
        assert_eq!(
            passive.notify(AsyncEventType::CommEst),
            Ok(NotifyOutcome::Established)
        );
        forced += 1;
    }
    p.fabric.run_until_idle();
    let passive_events = p.server.drain();
    assert_eq!(passive_events.len(), n);
    assert!(passive_events
        .iter()
        .all(|e| e.1 == CmEventType::Established));
    let stats = p.fabric.stats();
    assert_eq!(stats.forced_establishes, forced);
    assert!(forced > 0);
    assert_eq!(stats.events_delivered, stats.events_acked);
}

#[test]
fn disconnect_follows_the_kernel_and_destroy_tells_the_peer() {
    let mut p = pair(SimConfig::default(), 10);
    // No IB CM id: EINVAL. Any IB CM state: 0, sending what the state allows.
    let fresh = p.client.channel.create_id();
    assert!(matches!(fresh.disconnect(), Err(CmError::Os { .. })));
    let conns = start(&mut p, 2);
    let (active, passive) = &conns[0];
    passive.disconnect().unwrap();
    assert_eq!(passive.ib_state().unwrap(), Some(IbCmState::RepSent));
    // Destroying the active id before it read its REP: REJ (consumer defined).
    active.destroy().unwrap();
    p.fabric.advance(Duration::from_millis(1));
    let events = p.server.drain();
    assert_eq!(events.len(), 1);
    assert_eq!((events[0].1, events[0].2), (CmEventType::Rejected, 28));
    assert_eq!(passive.ib_state().unwrap(), Some(IbCmState::Idle));
    // The second connection: established, then the active side disconnects.
    let (active, passive) = &conns[1];
    p.client.drain();
    p.fabric.advance(Duration::from_millis(1));
    p.server.drain();
    active.disconnect().unwrap();
    p.fabric.advance(Duration::from_millis(1));
    let events = p.server.drain();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].1, CmEventType::Disconnected);
    passive.disconnect().unwrap();
    p.fabric.run_until_idle();
    let active_events: Vec<CmEventType> = p.client.drain().iter().map(|e| e.1).collect();
    assert_eq!(
        active_events,
        [CmEventType::Disconnected, CmEventType::TimewaitExit]
    );
    let passive_events: Vec<CmEventType> = p.server.drain().iter().map(|e| e.1).collect();
    assert_eq!(passive_events, [CmEventType::TimewaitExit]);
    assert_eq!(active.ib_state().unwrap(), Some(IbCmState::Idle));
}

#[test]
fn duplicated_data_completes_once_and_rules_pick_the_nth_message_of_a_connection() {
    let mut p = pair(SimConfig::default(), 12);
    p.fabric
        .add_fault(FaultRule::new(MsgKind::Data, FaultAction::Duplicate));
    // Only the first RTU of connection 1 is lost.
    p.fabric.add_fault(
        FaultRule::new(MsgKind::Rtu, FaultAction::Drop)
            .on_conn(cm_mock::sim::ConnId(1))
            .nth(0),
    );
    let conns = start(&mut p, 3);
    p.client.drain();
    p.fabric.advance(Duration::from_millis(1));
    let established: Vec<_> = p.server.drain().into_iter().map(|e| e.0).collect();
    assert_eq!(established.len(), 2);
    assert!(!established.contains(&conns[1].1));
    assert_eq!(conns[1].1.ib_state().unwrap(), Some(IbCmState::RepSent));
    conns[0].0.post_send(8).unwrap();
    p.fabric.advance(Duration::from_millis(1));
    let mut device = p.fabric.node(cm_mock::sim::NodeId(0)).unwrap().device();
    assert!(device.poll_cq().is_some());
    assert!(
        device.poll_cq().is_none(),
        "the duplicate must not complete again"
    );
    assert_eq!(p.fabric.stats().duplicated, 1);
    // The REP retransmission brings the resent RTU through.
    p.fabric.advance(Duration::from_secs(5));
    assert_eq!(p.server.drain().len(), 1);
    assert_eq!(conns[1].1.ib_state().unwrap(), Some(IbCmState::Established));
}

#[test]
fn trace_is_off_by_default_and_prints_every_step_of_a_forced_establish() {
    let untraced = pair(SimConfig::default(), 13);
    assert!(untraced.fabric.trace().is_none());

    let mut p = pair(SimConfig::default().traced(), 13);
    p.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    let conns = start(&mut p, 1);
    p.client.drain();
    conns[0].0.post_send(4).unwrap();
    p.fabric.advance(Duration::from_millis(1));
    assert_eq!(
        conns[0].1.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::Established)
    );
    p.fabric.advance(Duration::from_millis(1));
    let text = p.fabric.trace().unwrap().to_string();
    for needle in [
        "conn0 REQ node1 -> node0",
        "conn0 REP node0 -> node1",
        "conn0 RTU dropped",
        "IB_CM_REP_SENT",
        "IB_CM_MRA_REP_SENT -> IB_CM_ESTABLISHED",
        "node0 async communication established on QP",
        "notify(communication established) = Ok(Established)",
        "IB_CM_REP_SENT -> IB_CM_ESTABLISHED",
        "event RDMA_CM_EVENT_ESTABLISHED status 0",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    // Timestamps are virtual and never go backwards.
    let trace = p.fabric.take_trace().unwrap();
    assert!(trace.entries.windows(2).all(|w| w[0].at <= w[1].at));
    assert!(p.fabric.trace().unwrap().is_empty());
}
