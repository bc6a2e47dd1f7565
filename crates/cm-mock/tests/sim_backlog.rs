//! The listen backlog as the kernel keeps it (each CONNECT_REQUEST queued unread takes
//! one, reading it gives it back, a REQ finding none left is dropped without a reply and
//! comes back with the peer's REQ retry), and the virtual time an application's
//! connection setup takes (`SimConfig::create_qp_cost`, `SimConfig::register_cost`).

use std::time::Duration;

use cm_core::{CmEvent, CmEventType, IbCmState, QueueCaps, Transport};
use cm_mock::sim::{MsgKind, SimCmId, SimConfig, SimPair, SimTransport};

const PORT: u16 = 4791;

/// A listener on the server's channel, bound to `port`, with `backlog`.
fn listener(pair: &SimPair, port: u16, backlog: u32) -> SimCmId {
    let id = pair.server.channel.create_id();
    id.bind(port).unwrap();
    id.listen_with_backlog(backlog).unwrap();
    id
}

/// `n` client ids with address and route resolved and a QP each, ready to connect to
/// [`PORT`] (nothing sent yet).
fn prepared(pair: &mut SimPair, n: usize) -> Vec<SimCmId> {
    let to = pair.server.node.id();
    let ids: Vec<SimCmId> = (0..n)
        .map(|_| {
            let id = pair.client.channel.create_id();
            id.resolve_addr(to, PORT).unwrap();
            id
        })
        .collect();
    pair.fabric.advance(SimPair::STEP);
    assert_eq!(pair.client.drain().len(), n);
    for id in &ids {
        id.resolve_route().unwrap();
    }
    pair.fabric.advance(SimPair::STEP);
    assert_eq!(pair.client.drain().len(), n);
    for id in &ids {
        id.create_qp().unwrap();
    }
    ids
}

/// The connection numbers of `ids`, in order.
fn conns(ids: &[(SimCmId, CmEventType, i32)]) -> Vec<u32> {
    ids.iter()
        .map(|(id, kind, _)| {
            assert_eq!(*kind, CmEventType::ConnectRequest);
            id.conn().expect("a request's connection").0
        })
        .collect()
}

#[test]
fn requests_past_the_backlog_are_dropped_and_come_back_with_the_retry() {
    let config = SimConfig::default();
    let (timeout, latency) = (config.cm_response_timeout, config.wire_latency);
    let mut pair = SimPair::new(config, 1);
    let listener = listener(&pair, PORT, 3);
    let actives = prepared(&mut pair, 5);
    let sent_at = pair.fabric.now();
    for id in &actives {
        id.connect(&[]).unwrap();
    }
    pair.fabric.advance(SimPair::STEP);

    // The server reads nothing: three requests wait, two REQs were dropped unanswered.
    let stats = pair.fabric.stats();
    assert_eq!(pair.server.channel.queued(), 3);
    assert_eq!(stats.delivered_of(MsgKind::Req), 5);
    assert_eq!(stats.reqs_dropped_backlog, 2);
    assert_eq!(stats.sent_of(MsgKind::Rej), 0);
    assert_eq!(stats.sent_of(MsgKind::Mra), 0);
    assert_eq!(stats.ignored, 0);
    assert_eq!(listener.backlog_left(), Some(0));
    for id in &actives[3..] {
        assert_eq!(id.ib_state().unwrap(), Some(IbCmState::ReqSent));
    }
    assert_eq!(pair.client.channel.queued(), 0, "nothing told the clients");

    // Reading the requests gives the backlog back.
    assert_eq!(conns(&pair.server.drain()), [0, 1, 2]);
    assert_eq!(listener.backlog_left(), Some(3));

    // Nothing is resent before the REQ timeout, and nothing arrives before the resent
    // REQs do, a wire latency later.
    let resent_at = sent_at + timeout;
    pair.fabric
        .advance(resent_at - pair.fabric.now() - Duration::from_nanos(1));
    assert_eq!(pair.fabric.stats().retransmissions, 0);
    pair.fabric.advance(latency);
    assert_eq!(pair.fabric.stats().retransmissions, 5);
    assert_eq!(pair.fabric.stats().delivered_of(MsgKind::Req), 5);
    assert_eq!(pair.server.channel.queued(), 0);

    // Then the dropped ones are queued, the read ones are duplicates answered with the
    // delayed MRA.
    pair.fabric.advance(Duration::from_nanos(1));
    let stats = pair.fabric.stats();
    assert_eq!(stats.delivered_of(MsgKind::Req), 10);
    assert_eq!(stats.reqs_dropped_backlog, 2);
    assert_eq!(stats.sent_of(MsgKind::Mra), 3);
    assert_eq!(pair.server.channel.queued(), 2);
    assert_eq!(listener.backlog_left(), Some(1));
    assert_eq!(conns(&pair.server.drain()), [3, 4]);
    assert_eq!(listener.backlog_left(), Some(3));
}

#[test]
fn the_backlog_is_capped_by_max_backlog() {
    assert_eq!(SimConfig::default().max_backlog, 1024);
    let default = SimPair::new(SimConfig::default(), 2);
    assert_eq!(listener(&default, 1, 0).backlog_left(), Some(1024));
    assert_eq!(listener(&default, 2, 5000).backlog_left(), Some(1024));
    // The raw listen without a backlog is not limited.
    assert_eq!(default.listen(3).unwrap().backlog_left(), Some(u32::MAX));
    assert_eq!(default.server.channel.create_id().backlog_left(), None);

    let config = SimConfig {
        max_backlog: 2,
        ..SimConfig::default()
    };
    let mut pair = SimPair::new(config, 2);
    let capped = listener(&pair, PORT, 100);
    assert_eq!(capped.backlog_left(), Some(2));
    assert_eq!(listener(&pair, 1, 0).backlog_left(), Some(2));
    assert_eq!(listener(&pair, 3, 1).backlog_left(), Some(1));

    for id in prepared(&mut pair, 4) {
        id.connect(&[]).unwrap();
    }
    pair.fabric.advance(SimPair::STEP);
    assert_eq!(pair.server.channel.queued(), 2);
    assert_eq!(pair.fabric.stats().reqs_dropped_backlog, 2);
}

#[test]
fn the_transport_listens_with_its_backlog_and_reading_gives_it_back() {
    let mut pair = SimPair::new(SimConfig::default(), 3);
    let mut server = SimTransport::on_side(pair.server.clone());
    let listener = server.create_id().unwrap();
    server.bind(&listener, server.addr(PORT)).unwrap();
    server.listen(&listener, 2).unwrap();
    assert_eq!(listener.backlog_left(), Some(2));
    for id in prepared(&mut pair, 3) {
        id.connect(&[]).unwrap();
    }
    pair.fabric.advance(SimPair::STEP);
    assert_eq!(pair.fabric.stats().reqs_dropped_backlog, 1);

    let request = server.next_cm_event().unwrap().expect("a request");
    assert_eq!(request.event_type(), CmEventType::ConnectRequest);
    assert_eq!(server.event_listener(&request), Some(listener.clone()));
    assert_eq!(listener.backlog_left(), Some(1));
    let passive = server.event_id(&request).unwrap();
    request.ack().unwrap();

    // With the default (zero) costs, setting up takes no virtual time.
    let before = pair.fabric.now();
    let caps = QueueCaps::default();
    let device = server.open_device(&passive).unwrap();
    server.create_qp(&passive, &device, 1, &caps).unwrap();
    server.register_buffers(&passive, &caps).unwrap();
    assert_eq!(pair.fabric.now(), before);
}

#[test]
fn setup_costs_pass_virtual_time_while_requests_keep_arriving() {
    let (create_qp_cost, register_cost) = (Duration::from_millis(5), Duration::from_millis(2));
    let config = SimConfig {
        create_qp_cost,
        register_cost,
        ..SimConfig::default()
    };
    let mut pair = SimPair::new(config, 4);
    let mut server = SimTransport::on_side(pair.server.clone());
    let listener = server.create_id().unwrap();
    server.bind(&listener, server.addr(PORT)).unwrap();
    server.listen(&listener, 1).unwrap();

    // The raw id's create_qp pays the cost too: three QPs, three costs.
    let start = pair.fabric.now();
    let actives = prepared(&mut pair, 3);
    assert_eq!(
        pair.fabric.now() - start,
        SimPair::STEP * 2 + create_qp_cost * 3
    );

    actives[0].connect(&[]).unwrap();
    pair.fabric.advance(SimPair::STEP);
    let request = server.next_cm_event().unwrap().expect("a request");
    let passive = server.event_id(&request).unwrap();
    request.ack().unwrap();
    assert_eq!(listener.backlog_left(), Some(1));

    // Two more REQs on the wire while the server creates the QP: the first takes the
    // backlog and is queued, the second is dropped.
    actives[1].connect(&[]).unwrap();
    actives[2].connect(&[]).unwrap();
    let (before, activity) = (pair.fabric.now(), server.activity());
    let caps = QueueCaps::default();
    let device = server.open_device(&passive).unwrap();
    server.create_qp(&passive, &device, 1, &caps).unwrap();
    assert_eq!(pair.fabric.now(), before + create_qp_cost);
    assert_ne!(server.activity(), activity);
    let stats = pair.fabric.stats();
    assert_eq!(stats.delivered_of(MsgKind::Req), 3);
    assert_eq!(stats.reqs_dropped_backlog, 1);
    assert_eq!(pair.server.channel.queued(), 1);
    assert_eq!(listener.backlog_left(), Some(0));

    let before = pair.fabric.now();
    server.register_buffers(&passive, &caps).unwrap();
    assert_eq!(pair.fabric.now(), before + register_cost);

    // A refused create_qp (the id has a QP already) costs nothing.
    let before = pair.fabric.now();
    assert!(server.create_qp(&passive, &device, 2, &caps).is_err());
    assert_eq!(pair.fabric.now(), before);
}
