//! The queues a device context's connections share (`Transport::create_shared`) on the
//! simulated fabric, driven through the trait as the connection layer drives them: one
//! shared receive queue taking every QP's messages in arrival order, messages waiting
//! for a receive when none is posted, completion events armed once per arming, the SRQ
//! limit event, the send completion queue, and the registered bytes of both modes.

use std::time::Duration;

use cm_core::{
    AsyncEventType, CmError, CmEvent, CmEventType, CqKind, EventElement, QpNum, QueueCaps,
    SharedCaps, Transport, WcStatus, WorkCompletion,
};
use cm_mock::sim::{
    SimBuffers, SimCmEvent, SimCmId, SimConfig, SimDeviceReader, SimFabric, SimShared,
    SimTransport, SimTransports,
};

const PORT: u16 = 7471;
/// The shared completion queues' token.
const TOKEN: u64 = 0x5eed;

/// Small shared queues: 8 receives, 4 sends, 64-byte messages, no limit.
const CAPS: SharedCaps = SharedCaps {
    recv_slots: 8,
    send_slots: 4,
    buffer_size: 64,
    limit: 0,
    ready_qps: 0,
};

/// Connections whose server sides share one set of queues: the client's QPs have
/// their own queues and buffers (receives posted on every slot, wr_id = slot).
struct Shared {
    fabric: SimFabric,
    server: SimTransport,
    client: SimTransport,
    device: SimDeviceReader,
    shared: SimShared,
    passive: Vec<SimCmId>,
    active: Vec<SimCmId>,
    client_buffers: Vec<SimBuffers>,
    /// The server side's QP of each connection.
    qps: Vec<QpNum>,
}

/// The next CM event of `transport` of type `kind`, running the fabric until it comes;
/// events of other types are acknowledged and passed over.
fn next_of(transport: &mut SimTransport, fabric: &SimFabric, kind: CmEventType) -> SimCmEvent {
    loop {
        match transport.next_cm_event().unwrap() {
            Some(event) if event.event_type() == kind => return event,
            Some(other) => other.ack().unwrap(),
            None => assert!(fabric.step(), "no {kind:?} came"),
        }
    }
}

/// `connections` connections made by hand through the trait, every server side on one
/// set of shared queues of `caps`; the fabric run until idle.
fn connect(connections: usize, caps: SharedCaps, config: SimConfig) -> Shared {
    let SimTransports {
        fabric,
        mut server,
        mut client,
    } = SimTransports::new(config, 3);
    let listener = server.create_id().unwrap();
    server.bind(&listener, server.addr(PORT)).unwrap();
    server.listen(&listener, 64).unwrap();
    let own = QueueCaps::default();
    let timeout = Duration::from_millis(100);
    let (mut device, mut shared, mut client_device) = (None, None, None);
    let mut set = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for n in 0..connections as u64 {
        let active = client.create_id().unwrap();
        client
            .resolve_addr(&active, None, server.addr(PORT), timeout)
            .unwrap();
        next_of(&mut client, &fabric, CmEventType::AddrResolved)
            .ack()
            .unwrap();
        client.resolve_route(&active, timeout).unwrap();
        next_of(&mut client, &fabric, CmEventType::RouteResolved)
            .ack()
            .unwrap();
        let client_device =
            client_device.get_or_insert_with(|| client.open_device(&active).unwrap());
        client.create_qp(&active, client_device, n, &own).unwrap();
        let buffers = client.register_buffers(&active, &own).unwrap();
        for slot in 0..own.recv_depth {
            client
                .post_recv(&active, &buffers, slot, u64::from(slot))
                .unwrap();
        }
        client.connect(&active, b"", &Default::default()).unwrap();
        let request = next_of(&mut server, &fabric, CmEventType::ConnectRequest);
        let passive = server.event_id(&request).unwrap();
        request.ack().unwrap();
        let device = device.get_or_insert_with(|| server.open_device(&passive).unwrap());
        let shared = shared.get_or_insert_with(|| {
            server
                .create_shared(&passive, device, TOKEN, &caps)
                .unwrap()
        });
        let qp = server.create_qp_shared(&passive, shared, &own).unwrap();
        server.accept(&passive, b"", &Default::default()).unwrap();
        next_of(&mut client, &fabric, CmEventType::Established)
            .ack()
            .unwrap();
        set.0.push(passive);
        set.1.push(active);
        set.2.push(buffers);
        set.3.push(qp);
    }
    fabric.run_until_idle();
    while let Some(event) = server.next_cm_event().unwrap() {
        event.ack().unwrap();
    }
    Shared {
        fabric,
        server,
        client,
        device: device.unwrap(),
        shared: shared.unwrap(),
        passive: set.0,
        active: set.1,
        client_buffers: set.2,
        qps: set.3,
    }
}

impl Shared {
    /// Connection `n`'s client sends `data`, and the fabric runs until it arrived.
    fn send(&mut self, n: usize, data: &[u8]) {
        self.client
            .post_send(&self.active[n], &self.client_buffers[n], 0, data, 0)
            .unwrap();
        self.fabric.run_until_idle();
    }

    /// Connection `n`'s server side sends `data` from shared send buffer `slot`
    /// (wr_id = slot).
    fn send_shared(&mut self, n: usize, slot: u32, data: &[u8]) {
        self.server
            .post_shared_send(&self.passive[n], &self.shared, slot, data, u64::from(slot))
            .unwrap();
    }

    /// Every completion on the shared queue of `kind`.
    fn poll(&mut self, kind: CqKind) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        self.server
            .poll_shared_cq(&self.shared, kind, &mut out, 64)
            .unwrap();
        out
    }

    /// The first `len` bytes of shared receive buffer `slot`.
    fn read(&mut self, slot: u32, len: u32) -> Vec<u8> {
        let mut out = Vec::new();
        self.server
            .read_shared_recv(&self.shared, slot, len as usize, &mut out)
            .unwrap();
        out
    }

    /// Every completion event token waiting on the server's device.
    fn tokens(&mut self) -> Vec<u64> {
        let mut tokens = Vec::new();
        while let Some(token) = self.server.next_cq_event(&mut self.device).unwrap() {
            tokens.push(token);
        }
        tokens
    }

    /// The SRQ limit events waiting on the server's device (other events passed over).
    fn limit_events(&mut self) -> Vec<EventElement> {
        let mut events = Vec::new();
        while let Some(event) = self.server.next_async_event(&mut self.device).unwrap() {
            if event.event_type == AsyncEventType::SrqLimitReached {
                events.push(event.element);
            }
        }
        events
    }

    /// Posts shared receive buffers `slots`, each with wr_id 100 + slot.
    fn post(&mut self, slots: std::ops::Range<u32>) {
        for slot in slots {
            self.server
                .post_shared_recv(&self.shared, slot, 100 + u64::from(slot))
                .unwrap();
        }
    }
}

fn recv(wr_id: u64, qp: QpNum, byte_len: u32) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        qp,
        kind: CqKind::Recv,
        status: WcStatus::Success,
        byte_len,
    }
}

fn is_invalid<T: std::fmt::Debug>(result: Result<T, CmError>) -> bool {
    matches!(result, Err(CmError::InvalidArgument { .. }))
}

/// Two connections' messages land in the one shared receive queue, in arrival order,
/// each completion naming the QP it came for, each payload in its receive's buffer.
#[test]
fn two_connections_receive_through_one_shared_queue() {
    let mut s = connect(2, CAPS, SimConfig::default());
    assert_ne!(s.qps[0], s.qps[1]);
    s.post(0..4);
    s.send(0, b"first");
    s.send(1, b"second");
    s.send(0, b"third");
    let (a, b) = (s.qps[0], s.qps[1]);
    assert_eq!(
        s.poll(CqKind::Recv),
        [recv(100, a, 5), recv(101, b, 6), recv(102, a, 5)]
    );
    assert_eq!(s.read(0, 5), b"first");
    assert_eq!(s.read(1, 6), b"second");
    assert_eq!(s.read(2, 5), b"third");
    assert!(s.poll(CqKind::Recv).is_empty(), "each completes once");
    // A QP on shared queues has no queues of its own.
    let mut none = Vec::new();
    assert!(is_invalid(s.server.poll_cq(
        &s.passive[0],
        CqKind::Recv,
        &mut none,
        8
    )));
    // The last receive posted is still there for the next message.
    s.send(1, b"fourth");
    assert_eq!(s.poll(CqKind::Recv), [recv(103, b, 6)]);
}

/// A message that finds no receive posted waits (the real QP RNR-retries) and lands,
/// in arrival order, as receives are posted: nothing is lost.
#[test]
fn a_message_with_no_receive_posted_waits_for_one() {
    let mut s = connect(2, CAPS, SimConfig::default());
    s.send(1, b"early");
    s.send(0, b"later");
    assert!(s.poll(CqKind::Recv).is_empty());
    assert!(s.tokens().is_empty(), "no completion, no event");
    s.post(5..6);
    assert_eq!(s.poll(CqKind::Recv), [recv(105, s.qps[1], 5)]);
    assert_eq!(s.tokens(), [TOKEN]);
    assert_eq!(s.read(5, 5), b"early");
    s.post(2..3);
    assert_eq!(s.poll(CqKind::Recv), [recv(102, s.qps[0], 5)]);
    assert_eq!(s.read(2, 5), b"later");
    assert_eq!(s.fabric.stats().ignored, 0);
}

/// Once fewer receives than the armed limit are posted, the device raises one
/// SRQ_LIMIT_REACHED naming the queue; the limit is then disarmed until armed again.
#[test]
fn the_limit_event_comes_once_below_the_limit() {
    let mut s = connect(2, CAPS, SimConfig::default());
    s.post(0..4);
    s.server.arm_shared_limit(&s.shared, 3).unwrap();
    s.send(0, b"a");
    s.poll(CqKind::Recv);
    assert!(s.limit_events().is_empty(), "3 left: not below 3");
    s.send(1, b"b");
    s.poll(CqKind::Recv);
    let handle = EventElement::Srq(s.shared.srq_handle());
    assert_eq!(s.limit_events(), [handle]);
    s.send(0, b"c");
    s.poll(CqKind::Recv);
    assert!(s.limit_events().is_empty(), "disarmed once raised");
    // Armed again: the next receive taken below the limit raises it again, also when
    // the message waited and lands as the receive is posted.
    s.server.arm_shared_limit(&s.shared, 2).unwrap();
    s.send(1, b"d");
    s.send(1, b"e");
    s.post(4..5);
    assert_eq!(s.poll(CqKind::Recv).len(), 2);
    assert_eq!(s.limit_events(), [handle]);
    // 0 disarms.
    s.post(5..8);
    s.server.arm_shared_limit(&s.shared, 0).unwrap();
    s.send(0, b"f");
    s.send(0, b"g");
    s.poll(CqKind::Recv);
    assert!(s.limit_events().is_empty());
}

/// Slots, sizes and limits out of range are refused with InvalidArgument, and nothing
/// completes for them.
#[test]
fn bad_slots_and_sizes_are_invalid_arguments() {
    let mut s = connect(1, CAPS, SimConfig::default());
    let (server, shared, passive) = (&mut s.server, &s.shared, &s.passive[0]);
    assert!(is_invalid(server.post_shared_recv(
        shared,
        CAPS.recv_slots,
        0
    )));
    assert!(is_invalid(server.post_shared_send(
        passive,
        shared,
        CAPS.send_slots,
        b"x",
        0
    )));
    assert!(is_invalid(
        server.post_shared_send(passive, shared, 0, &[0; 65], 0)
    ));
    let mut out = Vec::new();
    assert!(is_invalid(server.read_shared_recv(
        shared,
        CAPS.recv_slots,
        1,
        &mut out
    )));
    assert!(is_invalid(server.read_shared_recv(shared, 0, 65, &mut out)));
    assert!(is_invalid(server.arm_shared_limit(shared, CAPS.recv_slots)));
    for bad in [
        SharedCaps {
            recv_slots: 0,
            ..CAPS
        },
        SharedCaps { limit: 8, ..CAPS },
        SharedCaps {
            buffer_size: 0,
            ..CAPS
        },
        SharedCaps {
            ready_qps: cm_core::MAX_READY_QPS + 1,
            ..CAPS
        },
    ] {
        assert!(is_invalid(
            server.create_shared(passive, &s.device, 1, &bad)
        ));
    }
    // An id with no QP, or a QP with queues of its own, does not send on shared ones.
    let other = server.create_id().unwrap();
    assert!(is_invalid(
        server.post_shared_send(&other, shared, 0, b"x", 0)
    ));
    // The queue holds as many receives as the pool has buffers.
    s.post(0..8);
    assert!(matches!(
        s.server.post_shared_recv(&s.shared, 0, 0),
        Err(CmError::Os { errno, .. }) if errno.0 == cm_core::errno::ENOMEM
    ));
    assert!(s.poll(CqKind::Send).is_empty());
    assert!(s.poll(CqKind::Recv).is_empty());
    assert!(out.is_empty());
}

/// A message longer than the shared buffers fails its receive (LOC_LEN_ERR) and
/// delivers nothing; the next one lands.
#[test]
fn a_message_longer_than_the_buffers_fails_its_receive() {
    let mut s = connect(1, CAPS, SimConfig::default());
    s.post(0..2);
    s.send(0, &[7; 65]);
    s.send(0, b"fits");
    let done = s.poll(CqKind::Recv);
    assert_eq!(done.len(), 2);
    assert_eq!((done[0].status, done[0].byte_len), (WcStatus::LocLenErr, 0));
    assert_eq!(done[1], recv(101, s.qps[0], 4));
    assert_eq!(s.read(1, 4), b"fits");
}

/// Sends from the shared pool complete on the shared send queue, each naming its QP,
/// and reach the peer.
#[test]
fn sends_complete_on_the_shared_send_queue() {
    let mut s = connect(2, CAPS, SimConfig::default());
    for (n, data) in [&b"to zero"[..], b"to one"].into_iter().enumerate() {
        s.server
            .post_shared_send(&s.passive[n], &s.shared, n as u32, data, 40 + n as u64)
            .unwrap();
    }
    let sent: Vec<_> = s
        .poll(CqKind::Send)
        .into_iter()
        .map(|c| (c.wr_id, c.qp, c.kind, c.status))
        .collect();
    assert_eq!(
        sent,
        [
            (40, s.qps[0], CqKind::Send, WcStatus::Success),
            (41, s.qps[1], CqKind::Send, WcStatus::Success)
        ]
    );
    assert!(s.poll(CqKind::Recv).is_empty());
    s.fabric.run_until_idle();
    for (n, expected) in [&b"to zero"[..], b"to one"].into_iter().enumerate() {
        let mut got = Vec::new();
        s.client
            .poll_cq(&s.active[n], CqKind::Recv, &mut got, 8)
            .unwrap();
        assert_eq!(got.len(), 1);
        let mut data = Vec::new();
        s.client
            .read_recv(
                &s.active[n],
                &s.client_buffers[n],
                0,
                got[0].byte_len as usize,
                &mut data,
            )
            .unwrap();
        assert_eq!(data, expected);
    }
}

/// Each shared completion queue raises one event with the token when it gets a
/// completion while armed (it is created armed), then none until it is armed again.
#[test]
fn the_token_fires_once_per_arming() {
    let mut s = connect(1, CAPS, SimConfig::default());
    s.tokens();
    s.post(0..8);
    s.send(0, b"1");
    s.send(0, b"2");
    assert_eq!(s.tokens(), [TOKEN], "two completions, one event");
    s.send(0, b"3");
    assert!(s.tokens().is_empty(), "disarmed");
    assert_eq!(s.poll(CqKind::Recv).len(), 3, "the completions are there");
    s.server.arm_shared_cq(&s.shared, CqKind::Recv).unwrap();
    assert!(s.tokens().is_empty(), "arming alone raises nothing");
    s.send(0, b"4");
    assert_eq!(s.tokens(), [TOKEN]);
    // The send queue is armed on its own.
    s.send_shared(0, 0, b"x");
    assert_eq!(s.tokens(), [TOKEN]);
    s.send_shared(0, 1, b"y");
    assert!(s.tokens().is_empty());
    s.server.arm_shared_cq(&s.shared, CqKind::Send).unwrap();
    s.send_shared(0, 2, b"z");
    assert_eq!(s.tokens(), [TOKEN]);
    assert_eq!(s.poll(CqKind::Send).len(), 3);
}

/// A QP's error flushes its own sends on the shared send queue, and a disconnected QP
/// refuses them; the receives posted on the shared queue belong to it, not to a QP,
/// and serve the connection still up.
#[test]
fn one_qps_error_flushes_its_sends_but_not_the_shared_receives() {
    let mut s = connect(3, CAPS, SimConfig::default());
    s.post(0..2);
    // A refused one-sided work request puts QP 0 in the error state.
    s.server
        .post_one_sided_refused(&s.passive[0], 8, 1)
        .unwrap();
    let (passive, shared) = (&s.passive, &s.shared);
    s.server
        .post_shared_send(&passive[0], shared, 0, b"x", 2)
        .unwrap();
    s.server
        .post_shared_send(&passive[1], shared, 1, b"y", 3)
        .unwrap();
    let statuses: Vec<_> = s
        .poll(CqKind::Send)
        .into_iter()
        .map(|c| (c.wr_id, c.qp, c.status))
        .collect();
    let (a, b) = (s.qps[0], s.qps[1]);
    assert_eq!(
        statuses,
        [
            (1, a, WcStatus::RemAccessErr),
            (2, a, WcStatus::WrFlushErr),
            (3, b, WcStatus::Success)
        ]
    );
    // Connection 1 disconnects: its QP refuses sends and flushes one-sided work, as a
    // QP with its own queues does; the shared receives are not flushed.
    s.server.disconnect(&s.passive[1]).unwrap();
    s.fabric.run_until_idle();
    assert!(s
        .server
        .post_shared_send(&s.passive[1], &s.shared, 2, b"z", 4)
        .is_err());
    s.server.post_one_sided(&s.passive[1], 8, 5).unwrap();
    let flushed: Vec<_> = s
        .poll(CqKind::Send)
        .into_iter()
        .map(|c| (c.wr_id, c.qp, c.status))
        .collect();
    assert_eq!(flushed, [(5, b, WcStatus::WrFlushErr)]);
    assert!(s.poll(CqKind::Recv).is_empty(), "no receive flushed");
    s.send(2, b"still");
    s.send(2, b"there");
    let c = s.qps[2];
    assert_eq!(s.poll(CqKind::Recv), [recv(100, c, 5), recv(101, c, 5)]);
}

/// A destroyed QP's waiting messages go with it; released queues cut off the QPs still
/// on them, and their slot's next queues get none of their traffic.
#[test]
fn destroyed_qps_and_released_queues_take_their_traffic_with_them() {
    let mut s = connect(2, CAPS, SimConfig::default());
    s.send(0, b"orphan");
    s.send(1, b"kept");
    s.poll(CqKind::Recv);
    s.passive[0].destroy().unwrap();
    // The next QP created sweeps the destroyed ones.
    let spare = s.server.create_id().unwrap();
    s.server.bind(&spare, s.server.addr(PORT + 1)).unwrap();
    s.server
        .create_qp_shared(&spare, &s.shared, &QueueCaps::default())
        .unwrap();
    s.post(0..2);
    assert_eq!(s.poll(CqKind::Recv), [recv(100, s.qps[1], 4)]);
    assert_eq!(s.read(0, 4), b"kept");

    // Released while connection 1 and the spare QP are still on them.
    let Shared {
        fabric,
        mut server,
        mut client,
        device,
        shared,
        active,
        client_buffers,
        ..
    } = s;
    let pool = CAPS.pool_len().unwrap() as u64;
    assert_eq!(fabric.stats().registered_pools, pool);
    let old = shared.srq_handle();
    server.release_shared(&device, shared);
    assert_eq!(fabric.stats().registered_pools, 0);
    let again = server.create_shared(&spare, &device, TOKEN, &CAPS).unwrap();
    assert_ne!(again.srq_handle(), old);
    server.post_shared_recv(&again, 0, 0).unwrap();
    client
        .post_send(&active[1], &client_buffers[1], 0, b"lost", 0)
        .unwrap();
    fabric.run_until_idle();
    let mut out = Vec::new();
    server
        .poll_shared_cq(&again, CqKind::Recv, &mut out, 8)
        .unwrap();
    assert!(out.is_empty(), "{out:?}");
    let stats = fabric.stats();
    assert_eq!(
        (stats.registered_pools, stats.registered_pools_peak),
        (pool, pool)
    );
}

/// Registered bytes: each connection's own buffers count until they drop, a shared
/// pool once however many QPs use it, until released; registration time is charged
/// once per pool, QP creation once per QP.
#[test]
fn registered_bytes_per_connection_and_shared() {
    const CONNECTIONS: u32 = 100;
    let (create_qp_cost, register_cost) = (Duration::from_millis(5), Duration::from_millis(2));
    let config = SimConfig {
        create_qp_cost,
        register_cost,
        ..SimConfig::default()
    };
    let SimTransports {
        fabric, mut server, ..
    } = SimTransports::new(config, 9);
    let ids: Vec<_> = (0..CONNECTIONS)
        .map(|n| {
            let id = server.create_id().unwrap();
            server.bind(&id, server.addr(1 + n as u16)).unwrap();
            id
        })
        .collect();
    let device = server.open_device(&ids[0]).unwrap();
    let own = QueueCaps::default();
    let area = own.area_len().unwrap() as u64;
    let buffers: Vec<_> = ids
        .iter()
        .map(|id| server.register_buffers(id, &own).unwrap())
        .collect();
    let stats = fabric.stats();
    assert_eq!(stats.registered_buffers, area * u64::from(CONNECTIONS));
    drop(buffers);
    let stats = fabric.stats();
    assert_eq!(
        (stats.registered_buffers, stats.registered_buffers_peak),
        (0, area * u64::from(CONNECTIONS))
    );

    let caps = SharedCaps::default();
    let pool = caps.pool_len().unwrap() as u64;
    let before = fabric.now();
    let shared = server.create_shared(&ids[0], &device, 1, &caps).unwrap();
    assert_eq!(fabric.now(), before + register_cost, "one registration");
    for id in &ids {
        let before = fabric.now();
        server.create_qp_shared(id, &shared, &own).unwrap();
        assert_eq!(
            fabric.now(),
            before + create_qp_cost,
            "a QP, no registration"
        );
    }
    let stats = fabric.stats();
    assert_eq!(stats.registered_pools, pool);
    // The default pool (5 MiB) against 128 KiB per connection.
    let per_connection = stats.registered_buffers_peak / u64::from(CONNECTIONS);
    let shared_per_connection = stats.registered_pools_peak / u64::from(CONNECTIONS);
    assert!(
        shared_per_connection * 2 < per_connection,
        "{shared_per_connection} vs {per_connection} bytes per connection"
    );
    for id in &ids {
        id.destroy().unwrap();
    }
    server.release_shared(&device, shared);
    let stats = fabric.stats();
    assert_eq!(
        (stats.registered_pools, stats.registered_pools_peak),
        (0, pool)
    );
}

/// A transport dropped with shared queues still held gives their bytes back.
#[test]
fn a_dropped_transport_gives_its_pools_back() {
    let SimTransports {
        fabric, mut server, ..
    } = SimTransports::new(SimConfig::default(), 2);
    let id = server.create_id().unwrap();
    server.bind(&id, server.addr(1)).unwrap();
    let device = server.open_device(&id).unwrap();
    let _shared = server.create_shared(&id, &device, 1, &CAPS).unwrap();
    assert_eq!(
        fabric.stats().registered_pools,
        CAPS.pool_len().unwrap() as u64
    );
    drop(server);
    assert_eq!(fabric.stats().registered_pools, 0);
}
