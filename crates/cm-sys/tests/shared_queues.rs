//! Queues shared by a device context's connections ([`SharedQueues`]) on a real device
//! (soft-RoCE in the test VM: `cargo xtask vm`): two accepted connections' QPs on one
//! SRQ, one buffer pool and one pair of CQs; every completion names its own
//! connection's QP; answers leave through the shared send pool; the SRQ limit event
//! reaches the device's asynchronous events; the queues outlive whatever they were made
//! from. Without a device every test records a skip and returns.

mod common;

use std::net::IpAddr;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use cm_core::{AsyncEventType, CmError, CmEventType, EventElement, SharedCaps};
use cm_sys::{
    poll_readable, AsyncEvents, CmId, Completion, CompletionChannel, ConnParams, CqKind,
    EventChannel, MemoryRegion, QpCaps, SharedQueues,
};
use common::{addresses, expect_event, listener_on, report, resolved_to, wait_completion, WAIT};

/// The token both shared CQs report.
const TOKEN: u64 = 0x5ead;

/// Bytes of every buffer of the pool, and of each client's two buffers.
const MESSAGE: usize = 64;

/// A pool small enough to reach the SRQ limit with a few messages.
const CAPS: SharedCaps = SharedCaps {
    recv_slots: 8,
    send_slots: 4,
    buffer_size: MESSAGE as u32,
    limit: 0,
    ready_qps: 0,
};

/// Send queue depth of each QP on the shared queues.
const SEND_DEPTH: u32 = 4;

/// How long the limit event is given to show up when it must not: rxe raises it while
/// it takes the receive, before the receive's completion, which is already read then.
const NO_EVENT_WAIT: Duration = Duration::from_millis(500);

fn is_invalid<T: std::fmt::Debug>(result: Result<T, CmError>) -> bool {
    matches!(result, Err(CmError::InvalidArgument { .. }))
}

/// A client connected to the listener, on a QP made the ordinary way (librdmacm's CQs),
/// with one receive posted for the server's answer; and the server's accepted id, its QP
/// on the shared queues.
struct Client {
    _channel: EventChannel,
    active: CmId,
    memory: MemoryRegion,
    passive: CmId,
}

impl Client {
    /// Connects from `addr_b`; the server puts the accepted id's QP on `shared` before
    /// it accepts.
    fn connect(
        listener: &CmId,
        server_channel: &EventChannel,
        addr_b: IpAddr,
        shared: &SharedQueues,
    ) -> Client {
        let channel = EventChannel::new().expect("client channel");
        let active = resolved_to(listener, &channel, addr_b);
        active.create_qp(&QpCaps::default()).expect("client QP");
        // [0, MESSAGE): what it sends; [MESSAGE, 2 * MESSAGE): the answer.
        let memory = active.register_memory(2 * MESSAGE).expect("client memory");
        active
            .post_recv(&memory, MESSAGE..2 * MESSAGE, 1)
            .expect("post_recv");
        active.connect(&ConnParams::default()).expect("connect");

        let request = expect_event(server_channel, CmEventType::ConnectRequest);
        let passive = request.id().expect("new id").clone();
        request.ack().expect("ack");
        let qp = passive
            .create_qp_shared(shared, SEND_DEPTH)
            .expect("QP on the shared queues");
        assert_eq!(passive.qp_num(), Some(qp));
        assert!(
            is_invalid(passive.create_qp_shared(shared, SEND_DEPTH)),
            "a second QP on the id is refused"
        );
        passive.accept(&ConnParams::default()).expect("accept");
        expect_event(&channel, CmEventType::Established)
            .ack()
            .expect("ack");
        expect_event(server_channel, CmEventType::Established)
            .ack()
            .expect("ack");
        Client {
            _channel: channel,
            active,
            memory,
            passive,
        }
    }

    /// One SEND of `data` from the client, its send completion reaped.
    fn send(&self, data: &[u8]) {
        self.active
            .write_memory(&self.memory, 0, data)
            .expect("write");
        self.active
            .post_send(&self.memory, 0..data.len(), 7)
            .expect("post_send");
        let sent = wait_completion("client send", || self.active.poll_send_cq(4));
        assert!(sent.is_success(), "{}", sent.status_str());
    }

    /// The server's answer, as the client received it.
    fn answer(&self) -> Vec<u8> {
        let received = wait_completion("answer", || self.active.poll_recv_cq(4));
        assert!(received.is_success(), "{}", received.status_str());
        let end = MESSAGE + received.byte_len as usize;
        self.active
            .read_memory(&self.memory, MESSAGE..end)
            .expect("read")
    }
}

/// The shared CQs as an event loop reads them: wait for the channel, take its events
/// (each must carry [`TOKEN`]), re-arm both CQs, poll.
struct SharedReader<'a> {
    shared: &'a SharedQueues,
    channel: &'a CompletionChannel,
}

impl SharedReader<'_> {
    /// The next `n` completions of `which` (within [`WAIT`]).
    fn next(&self, which: CqKind, n: usize) -> Vec<Completion> {
        let deadline = Instant::now() + WAIT;
        let mut out = Vec::with_capacity(n);
        loop {
            let want = n - out.len();
            self.shared.poll_cq(which, &mut out, want).expect("poll");
            if out.len() == n {
                return out;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "{which:?}: {} of {n} within {WAIT:?}",
                out.len()
            );
            let ready = poll_readable(&[self.channel.as_fd()], Some(left)).expect("poll");
            if ready.is_ready(0) {
                while let Some(token) = self.channel.try_next().expect("ibv_get_cq_event") {
                    assert_eq!(token, TOKEN);
                }
                for cq in [CqKind::Send, CqKind::Recv] {
                    self.shared.arm_cq(cq).expect("arm");
                }
            }
        }
    }
}

/// Whether the device reports SRQ_LIMIT_REACHED about the SRQ `srq` within `within`
/// (other events are printed and passed over).
fn limit_reached(events: &AsyncEvents, srq: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(event) = events.next_event_timeout(left).expect("async event") else {
            return false;
        };
        if event.event_type == AsyncEventType::SrqLimitReached {
            assert_eq!(event.element, EventElement::Srq(srq), "{event}");
            return true;
        }
        eprintln!("passed over: {event}");
    }
}

#[test]
fn two_connections_share_one_srq_pool_and_cq_pair() {
    let Some(setup) = addresses("two_connections_share_one_srq_pool_and_cq_pair") else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let listener = listener_on(&server_channel, setup.addr_a, 4);
    let device_events = listener.async_events().expect("async events");
    let channel = CompletionChannel::new(&listener).expect("completion channel");
    assert!(is_invalid(SharedQueues::new(
        &listener,
        &channel,
        TOKEN,
        &SharedCaps { limit: 8, ..CAPS }
    )));
    let shared = SharedQueues::new(&listener, &channel, TOKEN, &CAPS).expect("shared queues");
    assert_eq!(shared.device_key(), channel.device_key());
    assert_eq!(shared.caps(), CAPS);
    for slot in 0..CAPS.recv_slots {
        shared
            .post_recv(slot, u64::from(slot))
            .expect("post_srq_recv");
    }
    assert!(is_invalid(shared.post_recv(CAPS.recv_slots, 0)));
    assert!(is_invalid(shared.read_recv(CAPS.recv_slots, 1)));
    assert!(is_invalid(shared.read_recv(0, MESSAGE + 1)));
    // Nothing completed yet: no completion event.
    assert_eq!(channel.try_next().expect("read"), None);

    let clients =
        [0, 1].map(|_| Client::connect(&listener, &server_channel, setup.addr_b, &shared));
    let qps = clients
        .each_ref()
        .map(|c| c.passive.qp_num().expect("passive QP"));
    assert_ne!(qps[0], qps[1]);
    // Shared queues of device A for an id of device B, and a channel of device B.
    assert!(is_invalid(clients[0].active.create_qp_shared(&shared, 1)));
    let other_device = CompletionChannel::new(&clients[0].active).expect("channel on B");
    assert!(is_invalid(SharedQueues::new(
        &listener,
        &other_device,
        TOKEN,
        &CAPS
    )));
    // Only an id whose QP is on these queues sends from their pool.
    assert!(is_invalid(
        clients[0].active.post_shared_send(&shared, 0, b"x", 0)
    ));
    assert!(is_invalid(listener.post_shared_send(&shared, 0, b"x", 0)));
    let passive = &clients[0].passive;
    assert!(is_invalid(passive.post_shared_send(
        &shared,
        CAPS.send_slots,
        b"x",
        0
    )));
    assert!(is_invalid(passive.post_shared_send(
        &shared,
        0,
        &[0; MESSAGE + 1],
        0
    )));

    // One message from each client: both on the one receive CQ, each naming its own
    // connection's QP, its bytes in the SRQ buffer its completion names.
    let message = |i: usize| format!("hello from client {i}").into_bytes();
    for (i, client) in clients.iter().enumerate() {
        client.send(&message(i));
    }
    // The client's send completed, so the message is in: the receive CQ, armed at
    // creation, has raised its completion event, with the token.
    let ready = poll_readable(&[channel.as_fd()], Some(WAIT)).expect("poll");
    assert!(ready.is_ready(0), "no completion event within {WAIT:?}");
    assert_eq!(channel.try_next().expect("ibv_get_cq_event"), Some(TOKEN));
    shared.arm_cq(CqKind::Recv).expect("arm");
    let reader = SharedReader {
        shared: &shared,
        channel: &channel,
    };
    let received = reader.next(CqKind::Recv, 2);
    let mut seen = [false; 2];
    for completion in &received {
        assert!(completion.is_success(), "{}", completion.status_str());
        assert!(completion.is_recv());
        let i = qps
            .iter()
            .position(|qp| *qp == completion.qp_num)
            .unwrap_or_else(|| panic!("a completion of no server QP: {completion:?}"));
        assert!(!seen[i], "two completions for connection {i}");
        seen[i] = true;
        let slot = u32::try_from(completion.wr_id).expect("a slot");
        let bytes = shared
            .read_recv(slot, completion.byte_len as usize)
            .expect("read_recv");
        assert_eq!(bytes, message(i), "connection {i}, slot {slot}");
        // Re-posted as an endpoint does once the message is copied out.
        shared.post_recv(slot, u64::from(slot)).expect("re-post");
    }

    // An answer to each through the shared send pool, completing on the one send CQ.
    let answer = |i: usize| format!("answer to client {i}").into_bytes();
    for (i, client) in clients.iter().enumerate() {
        let slot = i as u32;
        client
            .passive
            .post_shared_send(&shared, slot, &answer(i), 100 + i as u64)
            .expect("post_shared_send");
    }
    let sent = reader.next(CqKind::Send, 2);
    for completion in &sent {
        assert!(completion.is_success(), "{}", completion.status_str());
        let i = (completion.wr_id - 100) as usize;
        assert_eq!(completion.qp_num, qps[i], "{completion:?}");
    }
    for (i, client) in clients.iter().enumerate() {
        assert_eq!(client.answer(), answer(i), "client {i}");
    }

    // The SRQ limit: the device raises the event when taking a receive leaves fewer
    // than `limit` posted. Armed just below the 8 posted, the next message leaves 7:
    // not below, no event; the one after leaves 6: the event, naming the SRQ.
    shared
        .arm_limit(CAPS.recv_slots - 1)
        .expect("ibv_modify_srq");
    clients[0].send(b"third");
    let third = reader.next(CqKind::Recv, 1)[0];
    assert_eq!(third.qp_num, qps[0]);
    assert!(
        !limit_reached(&device_events, shared.srq_handle(), NO_EVENT_WAIT),
        "SRQ_LIMIT_REACHED with the limit still posted"
    );
    clients[1].send(b"fourth");
    let fourth = reader.next(CqKind::Recv, 1)[0];
    assert_eq!(fourth.qp_num, qps[1]);
    assert!(
        limit_reached(&device_events, shared.srq_handle(), WAIT),
        "no SRQ_LIMIT_REACHED within {WAIT:?}"
    );
    assert_eq!(
        shared.read_recv(u32::try_from(fourth.wr_id).expect("slot"), 6),
        Ok(b"fourth".to_vec())
    );

    // Torn down handle first: the QPs keep the queues until their ids are destroyed.
    drop(shared);
    drop(channel);
    drop(listener);
    drop(clients);
}

#[test]
fn shared_queues_outlive_the_id_and_channel_they_were_made_from() {
    let Some(setup) = addresses("shared_queues_outlive_the_id_and_channel_they_were_made_from")
    else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let listener = listener_on(&server_channel, setup.addr_a, 4);
    let channel = CompletionChannel::new(&listener).expect("completion channel");
    let shared = SharedQueues::new(&listener, &channel, TOKEN, &CAPS).expect("shared queues");
    drop(listener);
    drop(channel);
    drop(server_channel);
    // The queues hold the device context and the channel's core: still usable.
    for slot in 0..CAPS.recv_slots {
        shared
            .post_recv(slot, u64::from(slot))
            .expect("post_srq_recv");
    }
    shared.arm_limit(1).expect("ibv_modify_srq");
    let mut out = Vec::new();
    assert_eq!(shared.poll_cq(CqKind::Recv, &mut out, 8), Ok(0));
    assert_eq!(shared.read_recv(0, MESSAGE).map(|b| b.len()), Ok(MESSAGE));
    // Destroyed with receives still posted: nothing waits, nothing leaks into a hang.
    drop(shared);
}

/// QPs made ahead ([`SharedCaps::ready_qps`]): the first QP asked of the queues is made
/// on its request and starts the pool at its send depth; once the pool is full, the
/// next accepts take ready QPs (in RTS once accepted, carrying messages both ways) and
/// the pool fills again; a QP of another depth is made on its request. Dropping the
/// queues' handle stops the pool with connections still on the queues.
#[test]
fn accepts_take_qps_made_ahead_and_the_pool_refills() {
    const TEST: &str = "accepts_take_qps_made_ahead_and_the_pool_refills";
    let Some(setup) = addresses(TEST) else {
        return;
    };
    const READY: u32 = 2;
    let caps = SharedCaps {
        ready_qps: READY,
        ..CAPS
    };
    let server_channel = EventChannel::new().expect("server channel");
    let listener = listener_on(&server_channel, setup.addr_a, 8);
    let channel = CompletionChannel::new(&listener).expect("completion channel");
    let shared = SharedQueues::new(&listener, &channel, TOKEN, &caps).expect("shared queues");
    for slot in 0..CAPS.recv_slots {
        shared.post_recv(slot, u64::from(slot)).expect("post");
    }
    let full = |taken: u64| {
        let deadline = Instant::now() + WAIT;
        loop {
            let stats = shared.ready_qps();
            assert_eq!(stats.off, None, "{stats:?}");
            assert_eq!(stats.taken, taken, "{stats:?}");
            if stats.ready == READY as usize {
                return;
            }
            assert!(Instant::now() < deadline, "pool not full: {stats:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    assert_eq!(
        shared.ready_qps().ready,
        0,
        "nothing made before a first QP"
    );
    let first = Client::connect(&listener, &server_channel, setup.addr_b, &shared);
    full(0);
    let ahead = [0, 1].map(|_| Client::connect(&listener, &server_channel, setup.addr_b, &shared));
    assert_eq!(shared.ready_qps().taken, 2);
    full(2);
    let reader = SharedReader {
        shared: &shared,
        channel: &channel,
    };
    for (i, client) in ahead.iter().enumerate() {
        let state = client.passive.query_qp().expect("ibv_query_qp").state;
        assert_eq!(state, cm_sys::QpState::Rts, "QP made ahead, accepted");
        client.send(format!("ahead {i}").as_bytes());
        let received = reader.next(CqKind::Recv, 1)[0];
        assert!(received.is_success(), "{}", received.status_str());
        assert_eq!(Some(received.qp_num), client.passive.qp_num());
        let slot = u32::try_from(received.wr_id).expect("slot");
        assert_eq!(
            shared.read_recv(slot, received.byte_len as usize),
            Ok(format!("ahead {i}").into_bytes())
        );
        shared.post_recv(slot, received.wr_id).expect("re-post");
        client
            .passive
            .post_shared_send(&shared, i as u32, b"answer", 7)
            .expect("post_shared_send");
        assert!(reader.next(CqKind::Send, 1)[0].is_success());
        assert_eq!(client.answer(), b"answer");
    }
    // Another send depth: made on the request, the pool untouched.
    let other = resolved_to(
        &listener,
        &EventChannel::new().expect("channel"),
        setup.addr_a,
    );
    other
        .create_qp_shared(&shared, SEND_DEPTH + 1)
        .expect("a QP of another depth");
    assert_eq!(shared.ready_qps().taken, 2);
    report(&format!("{TEST}: {:?}", shared.ready_qps()));
    drop(shared);
    drop((first, ahead, other));
}

/// A server that knows its connections' send depth starts the pool of QPs made ahead
/// before any request (`SharedQueues::prepare_ready`): it fills with nothing asked of
/// it, the first accept takes a ready QP, and a second call changes nothing.
#[test]
fn a_pool_prepared_ahead_fills_before_the_first_request() {
    const TEST: &str = "a_pool_prepared_ahead_fills_before_the_first_request";
    let Some(setup) = addresses(TEST) else {
        return;
    };
    let caps = SharedCaps {
        ready_qps: 2,
        ..CAPS
    };
    let server_channel = EventChannel::new().expect("server channel");
    let listener = listener_on(&server_channel, setup.addr_a, 8);
    let channel = CompletionChannel::new(&listener).expect("completion channel");
    let shared = SharedQueues::new(&listener, &channel, TOKEN, &caps).expect("shared queues");
    shared.prepare_ready(SEND_DEPTH);
    shared.prepare_ready(SEND_DEPTH + 1);
    let deadline = Instant::now() + WAIT;
    while shared.ready_qps().ready < 2 {
        assert_eq!(shared.ready_qps().off, None);
        assert!(Instant::now() < deadline, "{:?}", shared.ready_qps());
        std::thread::sleep(Duration::from_millis(5));
    }
    for slot in 0..CAPS.recv_slots {
        shared.post_recv(slot, u64::from(slot)).expect("post");
    }
    let first = Client::connect(&listener, &server_channel, setup.addr_b, &shared);
    assert_eq!(
        shared.ready_qps().taken,
        1,
        "the first accept took a QP made ahead, at the prepared depth"
    );
    let state = first.passive.query_qp().expect("ibv_query_qp").state;
    assert_eq!(state, cm_sys::QpState::Rts);
    report(&format!("{TEST}: {:?}", shared.ready_qps()));
    drop(shared);
    drop(first);
}
