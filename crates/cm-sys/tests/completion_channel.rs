//! Completion channels on a real device (soft-RoCE in the test VM: `cargo xtask vm`):
//! a SEND raises a completion event carrying the CQ's token, events are acknowledged in
//! batches and flushed before the CQs are destroyed, one channel serves several ids of
//! a device. Without a device every test records a skip and returns.

mod common;

use std::net::IpAddr;
use std::os::fd::AsFd;

use cm_core::{CmError, CmEventType};
use cm_sys::{
    poll_readable, CmId, Completion, CompletionChannel, ConnParams, CqKind, EventChannel,
    MemoryRegion, QpCaps,
};
use common::{addresses, expect_event, listener_on, report, resolved_to, wait_completion, WAIT};

/// Bytes of each message.
const MESSAGE: usize = 32;

/// One connection across the veth: the active side on librdmacm's CQs, the passive side
/// with its QP on a completion channel (made by `passive_qp`).
struct Conn {
    active: CmId,
    active_mem: MemoryRegion,
    passive: CmId,
    passive_mem: MemoryRegion,
}

/// Connects from `addr_b` to `listener` (on `server_channel`), creating the passive QP
/// with `passive_qp` and posting `receives` receives on it before accepting.
fn connect(
    listener: &CmId,
    server_channel: &EventChannel,
    addr_b: IpAddr,
    caps: &QpCaps,
    receives: u64,
    passive_qp: impl FnOnce(&CmId) -> Result<cm_core::QpNum, CmError>,
) -> Conn {
    let client_channel = EventChannel::new().expect("client channel");
    let active = resolved_to(listener, &client_channel, addr_b);
    active.create_qp(caps).expect("active QP");
    let active_mem = active.register_memory(MESSAGE).expect("active memory");
    active.connect(&ConnParams::default()).expect("connect");

    let request = expect_event(server_channel, CmEventType::ConnectRequest);
    let passive = request.id().expect("new id").clone();
    request.ack().expect("ack");
    passive_qp(&passive).expect("passive QP");
    let passive_mem = passive
        .register_memory(MESSAGE * receives.max(1) as usize)
        .expect("passive memory");
    for slot in 0..receives {
        let start = slot as usize * MESSAGE;
        passive
            .post_recv(&passive_mem, start..start + MESSAGE, slot)
            .expect("post_recv");
    }
    passive.accept(&ConnParams::default()).expect("accept");
    expect_event(&client_channel, CmEventType::Established)
        .ack()
        .expect("ack");
    expect_event(server_channel, CmEventType::Established)
        .ack()
        .expect("ack");
    Conn {
        active,
        active_mem,
        passive,
        passive_mem,
    }
}

impl Conn {
    /// One SEND from the active side, its send completion reaped.
    fn send(&self, wr_id: u64) {
        self.active
            .write_memory(&self.active_mem, 0, &wr_id.to_ne_bytes())
            .expect("write");
        self.active
            .post_send(&self.active_mem, 0..MESSAGE, wr_id)
            .expect("post_send");
        let sent = wait_completion("send", || self.active.poll_send_cq(4));
        assert!(sent.is_success(), "{}", sent.status_str());
    }
}

/// Waits (bounded by [`WAIT`]) for the channel to become readable and reads one token.
fn next_token(channel: &CompletionChannel) -> u64 {
    let ready = poll_readable(&[channel.as_fd()], Some(WAIT)).expect("poll");
    assert!(ready.is_ready(0), "no completion event within {WAIT:?}");
    channel
        .try_next()
        .expect("ibv_get_cq_event")
        .expect("a readable channel has an event")
}

/// Re-arms the passive receive CQ and polls it until empty (the standard pattern).
fn rearm_and_drain(id: &CmId, out: &mut Vec<Completion>) -> usize {
    id.arm_cq(CqKind::Recv).expect("arm");
    let mut total = 0;
    loop {
        let n = id.poll_cq(CqKind::Recv, out, 8).expect("poll_cq");
        total += n;
        if n == 0 {
            return total;
        }
    }
}

#[test]
fn a_send_makes_the_channel_readable_and_yields_the_token() {
    let Some(setup) = addresses("a_send_makes_the_channel_readable_and_yields_the_token") else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let listener = listener_on(&server_channel, setup.addr_a, 4);
    let channel = CompletionChannel::new(&listener).expect("completion channel");
    assert_eq!(Some(channel.device_key()), listener.device_key());
    // Nothing pending on a fresh channel: the read does not wait.
    assert_eq!(channel.try_next().expect("read"), None);

    let conn = connect(
        &listener,
        &server_channel,
        setup.addr_b,
        &QpCaps::default(),
        1,
        |id| id.create_qp_on(&QpCaps::default(), &channel, 0xfeed),
    );
    assert_eq!(conn.passive.device_key(), Some(channel.device_key()));
    assert_ne!(conn.active.device_key(), conn.passive.device_key());
    // A second QP on the id is refused (librdmacm would leak the first).
    assert!(matches!(
        conn.passive.create_qp_on(&QpCaps::default(), &channel, 1),
        Err(CmError::InvalidArgument { .. })
    ));

    conn.send(42);
    assert_eq!(next_token(&channel), 0xfeed);
    let mut out = Vec::with_capacity(8);
    assert_eq!(rearm_and_drain(&conn.passive, &mut out), 1);
    let received = out[0];
    assert!(received.is_success(), "{}", received.status_str());
    assert!(received.is_recv());
    assert_eq!(received.wr_id, 0);
    assert_eq!(received.byte_len as usize, MESSAGE);
    assert_eq!(Some(received.qp_num), conn.passive.qp_num());
    let data = conn
        .passive
        .read_memory(&conn.passive_mem, 0..8)
        .expect("read");
    assert_eq!(data, 42u64.to_ne_bytes());
    // The one event is consumed; the send CQ had nothing.
    assert_eq!(channel.try_next().expect("read"), None);
    let mut sends = Vec::new();
    assert_eq!(
        conn.passive
            .poll_cq(CqKind::Send, &mut sends, 8)
            .expect("poll"),
        0
    );
}

#[test]
fn channels_take_the_next_completion_vector_and_each_signals_its_own_cqs() {
    let Some(setup) =
        addresses("channels_take_the_next_completion_vector_and_each_signals_its_own_cqs")
    else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let listener = listener_on(&server_channel, setup.addr_a, 4);
    let first = CompletionChannel::new(&listener).expect("first channel");
    let second = CompletionChannel::new(&listener).expect("second channel");
    let vectors = first.device_vectors();
    report(&format!(
        "completion vectors: device has {vectors}, channels on {} and {}",
        first.vector(),
        second.vector()
    ));
    assert!(first.vector() < vectors && second.vector() < vectors);
    assert_eq!(
        second.vector(),
        (first.vector() + 1) % vectors,
        "the next vector"
    );
    // The QP's CQs on the second channel's vector: its completions signal there only.
    let conn = connect(
        &listener,
        &server_channel,
        setup.addr_b,
        &QpCaps::default(),
        1,
        |id| id.create_qp_on(&QpCaps::default(), &second, 0xbeef),
    );
    conn.send(7);
    assert_eq!(next_token(&second), 0xbeef);
    assert_eq!(first.try_next().expect("read"), None);
    let mut out = Vec::with_capacity(8);
    assert_eq!(rearm_and_drain(&conn.passive, &mut out), 1);
    assert!(out[0].is_success(), "{}", out[0].status_str());
}

#[test]
fn many_events_then_dropping_the_id_does_not_hang() {
    let Some(setup) = addresses("many_events_then_dropping_the_id_does_not_hang") else {
        return;
    };
    const SENDS: u64 = 100;
    let server_channel = EventChannel::new().expect("server channel");
    let listener = listener_on(&server_channel, setup.addr_a, 4);
    let channel = CompletionChannel::new(&listener).expect("completion channel");
    let caps = QpCaps {
        max_recv_wr: SENDS as u32,
        ..QpCaps::default()
    };
    let conn = connect(
        &listener,
        &server_channel,
        setup.addr_b,
        &QpCaps::default(),
        SENDS,
        |id| id.create_qp_on(&caps, &channel, 9),
    );
    let mut received = Vec::with_capacity(SENDS as usize);
    let mut events = 0;
    while (received.len() as u64) < SENDS {
        conn.send(received.len() as u64);
        assert_eq!(next_token(&channel), 9);
        events += 1;
        rearm_and_drain(&conn.passive, &mut received);
    }
    assert_eq!(events, SENDS, "one event per armed completion");
    assert!(received.iter().all(Completion::is_success));
    let ids: Vec<u64> = received.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, (0..SENDS).collect::<Vec<_>>());
    // 100 events: 96 acknowledged in batches, 4 outstanding. Destroying the CQs waits
    // for those 4: they must be acknowledged first, or this drop never returns.
    let Conn {
        active, passive, ..
    } = conn;
    drop(passive);
    // The channel outlives the CQs it served and closes after them.
    drop(channel);
    drop(active);
}

#[test]
fn one_channel_serves_two_ids_and_tokens_tell_their_cqs_apart() {
    let Some(setup) = addresses("one_channel_serves_two_ids_and_tokens_tell_their_cqs_apart")
    else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let listener = listener_on(&server_channel, setup.addr_a, 4);
    let first = connect(
        &listener,
        &server_channel,
        setup.addr_b,
        &QpCaps::default(),
        1,
        |id| id.create_qp(&QpCaps::default()),
    );
    // The channel is made from the first connection's id and used by the second.
    let channel = CompletionChannel::new(&first.passive).expect("completion channel");
    let second = connect(
        &listener,
        &server_channel,
        setup.addr_b,
        &QpCaps::default(),
        1,
        |id| id.create_qp_on(&QpCaps::default(), &channel, 2),
    );
    let third = connect(
        &listener,
        &server_channel,
        setup.addr_b,
        &QpCaps::default(),
        2,
        |id| id.create_qp_on(&QpCaps::default(), &channel, 3),
    );
    // A channel on the other device is refused.
    let other_device = CompletionChannel::new(&second.active).expect("channel on device B");
    assert_ne!(other_device.device_key(), channel.device_key());
    let fresh = EventChannel::new()
        .expect("channel")
        .create_id()
        .expect("id");
    assert_eq!(fresh.device_key(), None);
    assert!(matches!(
        CompletionChannel::new(&fresh),
        Err(CmError::InvalidArgument { .. })
    ));
    assert_eq!(
        first
            .passive
            .async_events()
            .expect("async events")
            .device_key(),
        channel.device_key()
    );

    let mut out = Vec::new();
    third.send(30);
    assert_eq!(next_token(&channel), 3);
    assert_eq!(rearm_and_drain(&third.passive, &mut out), 1);
    second.send(20);
    assert_eq!(next_token(&channel), 2);
    assert_eq!(rearm_and_drain(&second.passive, &mut out), 1);
    assert_eq!(
        out.iter().map(|c| c.qp_num).collect::<Vec<_>>(),
        vec![
            third.passive.qp_num().unwrap(),
            second.passive.qp_num().unwrap()
        ]
    );
    // The first connection's CQs are librdmacm's: its traffic raises nothing here.
    first.send(10);
    let received = wait_completion("first receive", || first.passive.poll_recv_cq(4));
    assert!(received.is_success());
    assert_eq!(channel.try_next().expect("read"), None);
    // The id the channel was made from goes first; the channel keeps the device.
    drop(first);
    third.send(31);
    assert_eq!(next_token(&channel), 3);
}

#[test]
fn a_channel_of_another_device_is_refused() {
    let Some(setup) = addresses("a_channel_of_another_device_is_refused") else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let listener = listener_on(&server_channel, setup.addr_a, 4);
    let client_channel = EventChannel::new().expect("client channel");
    let active = resolved_to(&listener, &client_channel, setup.addr_b);
    let on_a = CompletionChannel::new(&listener).expect("channel on device A");
    assert!(matches!(
        active.create_qp_on(&QpCaps::default(), &on_a, 1),
        Err(CmError::InvalidArgument { .. })
    ));
    assert_eq!(active.qp_num(), None);
    let on_b = CompletionChannel::new(&active).expect("channel on device B");
    active
        .create_qp_on(&QpCaps::default(), &on_b, 1)
        .expect("same device");
    assert!(active.qp_num().is_some());
}
