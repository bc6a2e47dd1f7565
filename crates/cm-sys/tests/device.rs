//! The measured facts of the spec, on a real RDMA device (soft-RoCE in the test VM:
//! `cargo xtask vm`). Without a device every test records a skip and returns.
//!
//! Addresses: `CMNOTIFY_ADDR_A` (listener side) and `CMNOTIFY_ADDR_B` (connecting side),
//! set by the VM's /init (10.77.1.1 and 10.77.1.2 on two soft-RoCE devices over a veth).
//! Every wait is bounded by [`WAIT`].

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use cm_core::{AsyncEventType, CmError, CmEventType, NotifyError, NotifyOutcome};
use cm_sys::{CmEvent, CmId, ConnParams, EventChannel, QpCaps};

/// The bound of every wait in these tests.
const WAIT: Duration = Duration::from_secs(10);

/// The two addresses of the test setup.
struct Setup {
    addr_a: IpAddr,
    addr_b: IpAddr,
}

/// Records a skip per the project's protocol.
fn skip(test: &str, reason: &str) {
    let line = format!("{test}: skipped: no RDMA device ({reason})");
    if let Ok(path) = std::env::var("CMNOTIFY_SKIP_LOG") {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("cannot open CMNOTIFY_SKIP_LOG {path}: {e}"));
        writeln!(file, "{line}").expect("write skip log");
    }
    eprintln!("{line}");
}

/// The setup, or `None` after recording a skip.
fn setup(test: &str) -> Option<Setup> {
    if !Path::new("/dev/infiniband/rdma_cm").exists() {
        skip(test, "/dev/infiniband/rdma_cm does not exist");
        return None;
    }
    let has_device = std::fs::read_dir("/sys/class/infiniband")
        .map(|mut entries| entries.next().is_some())
        .unwrap_or(false);
    if !has_device {
        skip(test, "/sys/class/infiniband is empty");
        return None;
    }
    let addr = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
    match (addr("CMNOTIFY_ADDR_A"), addr("CMNOTIFY_ADDR_B")) {
        (Some(addr_a), Some(addr_b)) => Some(Setup { addr_a, addr_b }),
        _ => {
            skip(
                test,
                "a device exists but CMNOTIFY_ADDR_A/CMNOTIFY_ADDR_B name no test addresses",
            );
            None
        }
    }
}

/// The next event on `channel`, which must be `expected`.
fn expect_event(channel: &EventChannel, expected: CmEventType) -> CmEvent {
    let event = channel
        .next_event_timeout(WAIT)
        .expect("rdma_get_cm_event")
        .unwrap_or_else(|| panic!("no {expected} within {WAIT:?}"));
    assert_eq!(
        event.event_type(),
        expected,
        "status {} of {:?}",
        event.status(),
        event
    );
    assert_eq!(event.status(), 0, "{event:?}");
    event
}

/// Polls `poll` until it yields a completion, for at most [`WAIT`].
fn wait_completion(
    what: &str,
    mut poll: impl FnMut() -> Result<Vec<cm_sys::Completion>, CmError>,
) -> cm_sys::Completion {
    let deadline = Instant::now() + WAIT;
    loop {
        let completions = poll().expect("ibv_poll_cq");
        if let Some(completion) = completions.first() {
            assert_eq!(completions.len(), 1, "one work request, one completion");
            return *completion;
        }
        assert!(
            Instant::now() < deadline,
            "no {what} completion within {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The kernel's timeout of one address or route resolution attempt.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// A new id on `channel` whose address resolution from `src` to `dst` succeeded, with
/// its ADDR_RESOLVED event (not yet acknowledged).
///
/// The first resolution after the devices come up can time out (the neighbour entry is
/// still being resolved), so an ADDR_ERROR is retried with a fresh id, the whole bounded
/// by [`WAIT`].
fn addr_resolved_id(channel: &EventChannel, src: IpAddr, dst: SocketAddr) -> (CmId, CmEvent) {
    let deadline = Instant::now() + WAIT;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let id = channel.create_id().expect("id");
        id.resolve_addr(Some(SocketAddr::new(src, 0)), dst, RESOLVE_TIMEOUT)
            .expect("resolve_addr");
        let event = next_event_within(channel, RESOLVE_TIMEOUT * 2);
        match event.event_type() {
            CmEventType::AddrResolved => {
                if attempt > 1 {
                    eprintln!("resolved {dst} on attempt {attempt}");
                }
                assert_eq!(event.id(), Some(&id));
                return (id, event);
            }
            CmEventType::AddrError if Instant::now() < deadline => {
                eprintln!(
                    "attempt {attempt}: ADDR_ERROR (status {}) resolving {dst}; retrying",
                    event.status()
                );
            }
            other => panic!("resolving {dst}: {other} (status {})", event.status()),
        }
    }
}

/// A new id on `channel`, resolved (address and route) from `src` to `dst`.
fn resolved_id(channel: &EventChannel, src: IpAddr, dst: SocketAddr) -> CmId {
    let (id, event) = addr_resolved_id(channel, src, dst);
    event.ack().expect("ack");
    id.resolve_route(RESOLVE_TIMEOUT).expect("resolve_route");
    expect_event(channel, CmEventType::RouteResolved)
        .ack()
        .expect("ack");
    id
}

/// The next event on `channel` within `timeout`, whatever it is.
fn next_event_within(channel: &EventChannel, timeout: Duration) -> CmEvent {
    channel
        .next_event_timeout(timeout)
        .expect("rdma_get_cm_event")
        .unwrap_or_else(|| panic!("no event within {timeout:?}"))
}

#[test]
fn notify_on_a_fresh_id_is_wrong_state() {
    let Some(_setup) = setup("notify_on_a_fresh_id_is_wrong_state") else {
        return;
    };
    let channel = EventChannel::new().expect("channel");
    let id = channel.create_id().expect("id");
    assert_eq!(id.qp_num(), None);
    assert_eq!(id.local_addr(), None);
    assert_eq!(
        id.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
    assert!(matches!(
        id.async_events(),
        Err(CmError::InvalidArgument { .. })
    ));
}

#[test]
fn notify_on_a_bound_id_is_wrong_state() {
    let Some(setup) = setup("notify_on_a_bound_id_is_wrong_state") else {
        return;
    };
    let channel = EventChannel::new().expect("channel");
    let id = channel.create_id().expect("id");
    id.bind_addr(SocketAddr::new(setup.addr_a, 0))
        .expect("bind");
    let local = id.local_addr().expect("bound address");
    assert_eq!(local.ip(), setup.addr_a);
    assert_ne!(local.port(), 0, "the CM picks a port");
    assert_eq!(
        id.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
}

#[test]
fn notify_on_a_listener_is_wrong_state() {
    let Some(setup) = setup("notify_on_a_listener_is_wrong_state") else {
        return;
    };
    let channel = EventChannel::new().expect("channel");
    let id = channel.create_id().expect("id");
    id.bind_addr(SocketAddr::new(setup.addr_a, 0))
        .expect("bind");
    id.listen(4).expect("listen");
    assert_eq!(
        id.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
    // Nothing is pending on the channel: the non-blocking read answers None.
    channel.set_nonblocking(true).expect("O_NONBLOCK");
    assert!(channel.is_nonblocking().expect("flags"));
    assert!(channel.try_next_event().expect("read").is_none());
}

#[test]
fn resolve_events_arrive_on_the_channel_an_id_migrated_to() {
    let Some(setup) = setup("resolve_events_arrive_on_the_channel_an_id_migrated_to") else {
        return;
    };
    let first = EventChannel::new().expect("channel");
    let second = EventChannel::new().expect("channel");
    let listen_channel = EventChannel::new().expect("channel");
    let listener = listen_channel.create_id().expect("listener");
    listener
        .bind_addr(SocketAddr::new(setup.addr_a, 0))
        .expect("bind");
    listener.listen(4).expect("listen");
    let target = listener.local_addr().expect("listener address");

    let (id, resolved) = addr_resolved_id(&first, setup.addr_b, target);
    assert_eq!(id.unacked_events(), 1);
    // librdmacm would wait for the unacknowledged event: refused instead.
    match id.migrate(&second) {
        Err(CmError::UnackedEvents { unacked: 1, .. }) => {}
        other => panic!("migrate with an unacked event: {other:?}"),
    }
    resolved.ack().expect("ack");
    assert_eq!(id.unacked_events(), 0);
    id.migrate(&second).expect("migrate");

    id.resolve_route(RESOLVE_TIMEOUT).expect("resolve_route");
    let routed = expect_event(&second, CmEventType::RouteResolved);
    assert_eq!(routed.id(), Some(&id));
    assert!(first.try_next_event().expect("read").is_none());
    assert_eq!(id.peer_addr(), Some(target));
    // Address resolution bound the id to a device, but it is not connecting.
    assert_eq!(
        id.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
}

#[test]
fn loopback_connection_establishes_then_notify_is_already_established() {
    let Some(setup) = setup("loopback_connection_establishes_then_notify_is_already_established")
    else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let client_channel = EventChannel::new().expect("client channel");

    let listener = server_channel.create_id().expect("listener");
    listener
        .bind_addr(SocketAddr::new(setup.addr_a, 0))
        .expect("bind");
    listener.listen(4).expect("listen");
    let server_addr = listener.local_addr().expect("listener address");

    // Active side: resolve, QP, connect.
    let client = resolved_id(&client_channel, setup.addr_b, server_addr);
    let client_qp = client.create_qp(&QpCaps::default()).expect("client QP");
    assert_eq!(client.qp_num(), Some(client_qp));
    let client_mem = client.register_memory(64).expect("client memory");
    client
        .post_recv(&client_mem, 32..64, 2)
        .expect("client post_recv");
    client
        .connect(&ConnParams {
            private_data: b"hello",
            ..ConnParams::default()
        })
        .expect("connect");

    // Passive side: the request carries a new id and the listener.
    let request = expect_event(&server_channel, CmEventType::ConnectRequest);
    assert_eq!(request.listener(), Some(&listener));
    // The CM hands over the REQ's whole private data field (56 bytes), zero-padded.
    let private_data = request.private_data();
    assert!(private_data.starts_with(b"hello"), "{private_data:?}");
    assert!(
        private_data[5..].iter().all(|&b| b == 0),
        "{private_data:?}"
    );
    let server = request.id().expect("new id").clone();
    assert_ne!(server, listener);
    // librdmacm accounts the request to the listener: migrating it now would wait.
    assert_eq!(listener.unacked_events(), 1);
    assert_eq!(server.unacked_events(), 0);
    let other_channel = EventChannel::new().expect("channel");
    assert!(matches!(
        listener.migrate(&other_channel),
        Err(CmError::UnackedEvents { unacked: 1, .. })
    ));
    request.ack().expect("ack");
    assert_eq!(listener.unacked_events(), 0);
    let server_qp = server.create_qp(&QpCaps::default()).expect("server QP");
    let server_mem = server.register_memory(64).expect("server memory");
    server
        .post_recv(&server_mem, 0..32, 1)
        .expect("server post_recv");
    server.accept(&ConnParams::default()).expect("accept");

    // ESTABLISHED on both sides (the client's comes first: reading its REP sends the RTU).
    let established = expect_event(&client_channel, CmEventType::Established);
    assert_eq!(established.qp_num(), Some(client_qp));
    established.ack().expect("ack");
    let established = expect_event(&server_channel, CmEventType::Established);
    assert_eq!(established.qp_num(), Some(server_qp));
    assert_eq!(established.id(), Some(&server));
    established.ack().expect("ack");

    // The spec's measured fact: after ESTABLISHED, notify is EISCONN on either side.
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    assert_eq!(
        client.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    // From another thread, through a clone, as the notify pump does.
    let pump_handle = server.clone();
    let from_thread = std::thread::spawn(move || pump_handle.notify(AsyncEventType::CommEst))
        .join()
        .expect("notify thread");
    assert_eq!(from_thread, Ok(NotifyOutcome::AlreadyEstablished));
    // Through the trait object the pump uses.
    let handle: &dyn cm_core::CmId = &server;
    assert_eq!(
        handle.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    assert_eq!(handle.qp_num(), Some(server_qp));

    // Asynchronous events read without blocking: nothing pending (soft-RoCE raises no
    // COMM_EST), so EAGAIN answers None.
    let device_events = server.async_events().expect("async events");
    device_events.set_nonblocking(true).expect("O_NONBLOCK");
    assert!(device_events.is_nonblocking().expect("flags"));
    let mut drained = 0;
    while let Some(event) = device_events.try_next_event().expect("ibv_get_async_event") {
        assert_ne!(event.event_type, AsyncEventType::CommEst, "{event}");
        drained += 1;
        assert!(drained < 100, "async events never run dry");
    }
    assert!(device_events
        .next_event_timeout(Duration::from_millis(20))
        .expect("poll")
        .is_none());

    // Data both ways.
    client.write_memory(&client_mem, 0, b"ping").expect("write");
    client.post_send(&client_mem, 0..4, 10).expect("post_send");
    let sent = wait_completion("client send", || client.poll_send_cq(4));
    assert!(sent.is_success(), "{}", sent.status_str());
    assert_eq!(
        (sent.wr_id, sent.qp_num, sent.is_recv()),
        (10, client_qp, false)
    );
    let received = wait_completion("server receive", || server.poll_recv_cq(4));
    assert!(received.is_success(), "{}", received.status_str());
    assert_eq!(
        (
            received.wr_id,
            received.qp_num,
            received.byte_len,
            received.is_recv()
        ),
        (1, server_qp, 4, true)
    );
    assert_eq!(
        server.read_memory(&server_mem, 0..4).expect("read"),
        b"ping"
    );

    server
        .write_memory(&server_mem, 32, b"pong!")
        .expect("write");
    server
        .post_send(&server_mem, 32..37, 11)
        .expect("post_send");
    let sent = wait_completion("server send", || server.poll_send_cq(4));
    assert!(sent.is_success(), "{}", sent.status_str());
    let received = wait_completion("client receive", || client.poll_recv_cq(4));
    assert_eq!((received.wr_id, received.byte_len), (2, 5));
    assert_eq!(
        client.read_memory(&client_mem, 32..37).expect("read"),
        b"pong!"
    );
    // Out-of-range access is refused, not performed.
    assert!(matches!(
        server.read_memory(&server_mem, 60..70),
        Err(CmError::InvalidArgument { .. })
    ));
    assert_eq!(server_mem.len(), 64);
    // A region of one id is refused by another.
    assert!(matches!(
        server.post_recv(&client_mem, 0..4, 3),
        Err(CmError::InvalidArgument { .. })
    ));

    // Teardown: each side must see DISCONNECTED and answer with its own disconnect, or the
    // other side's destroy waits out the CM's DREQ timeout.
    client.disconnect().expect("client disconnect");
    expect_event(&server_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
    server.disconnect().expect("server disconnect");
    expect_event(&client_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
    // Disconnected: notify is refused again.
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
}

#[test]
fn a_dropped_connect_request_rejects_the_connection() {
    let Some(setup) = setup("a_dropped_connect_request_rejects_the_connection") else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let client_channel = EventChannel::new().expect("client channel");
    let listener = server_channel.create_id().expect("listener");
    listener
        .bind_addr(SocketAddr::new(setup.addr_a, 0))
        .expect("bind");
    listener.listen(4).expect("listen");

    let client = resolved_id(
        &client_channel,
        setup.addr_b,
        listener.local_addr().expect("listener address"),
    );
    client.create_qp(&QpCaps::default()).expect("client QP");
    client.connect(&ConnParams::default()).expect("connect");

    // The application ignores the request: the event (acked on drop) was the new id's
    // last owner, so the id is destroyed and the kernel rejects the REQ.
    drop(expect_event(&server_channel, CmEventType::ConnectRequest));
    let event = client_channel
        .next_event_timeout(WAIT)
        .expect("read")
        .expect("an answer to the REQ");
    assert!(
        event.event_type().is_connect_failure(),
        "{:?} (status {})",
        event.event_type(),
        event.status()
    );
}

/// An nftables table dropping every CM RTU MAD addressed to one IP in the INPUT hook
/// (never OUTPUT: see the VM spec). Deleted on drop.
struct RtuDrop {
    nft: String,
}

impl RtuDrop {
    const TABLE: &'static str = "cmnotify_sys";

    fn install(nft: &str, to: IpAddr) -> RtuDrop {
        let guard = RtuDrop {
            nft: nft.to_string(),
        };
        guard.run(&["add", "table", "inet", Self::TABLE]);
        guard.run(&[
            "add",
            "chain",
            "inet",
            Self::TABLE,
            "input",
            "{ type filter hook input priority 0; }",
        ]);
        // RoCEv2 (UDP 4791), BTH opcode UD SEND_ONLY, MAD class CM, attribute RTU.
        let rule = format!(
            "ip daddr {to} udp dport 4791 @th,64,8 0x64 @th,232,8 0x07 @th,352,16 0x0014 \
             counter drop"
        );
        let mut args = vec!["add", "rule", "inet", Self::TABLE, "input"];
        args.extend(rule.split(' '));
        guard.run(&args);
        guard
    }

    fn run(&self, args: &[&str]) -> String {
        let output = std::process::Command::new(&self.nft)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{} {args:?}: {e}", self.nft));
        assert!(
            output.status.success(),
            "{} {args:?}: {}",
            self.nft,
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// How many RTUs the rule dropped.
    fn dropped(&self) -> u64 {
        let listing = self.run(&["list", "table", "inet", Self::TABLE]);
        let after = listing
            .split("counter packets ")
            .nth(1)
            .unwrap_or_else(|| panic!("no counter in {listing}"));
        after
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("bad counter in {listing}"))
    }
}

impl Drop for RtuDrop {
    fn drop(&mut self) {
        let _ = std::process::Command::new(&self.nft)
            .args(["delete", "table", "inet", Self::TABLE])
            .status();
    }
}

#[test]
fn notify_forces_established_when_the_rtu_is_lost() {
    let test = "notify_forces_established_when_the_rtu_is_lost";
    let Some(setup) = setup(test) else {
        return;
    };
    let Ok(nft) = std::env::var("CMNOTIFY_NFT") else {
        skip(
            test,
            "a device exists but CMNOTIFY_NFT names no nft to drop the RTU",
        );
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let client_channel = EventChannel::new().expect("client channel");
    let listener = server_channel.create_id().expect("listener");
    listener
        .bind_addr(SocketAddr::new(setup.addr_a, 0))
        .expect("bind");
    listener.listen(4).expect("listen");
    let client = resolved_id(
        &client_channel,
        setup.addr_b,
        listener.local_addr().expect("listener address"),
    );
    client.create_qp(&QpCaps::default()).expect("client QP");
    let client_mem = client.register_memory(16).expect("client memory");

    let rtu_drop = RtuDrop::install(&nft, setup.addr_a);
    client.connect(&ConnParams::default()).expect("connect");
    let request = expect_event(&server_channel, CmEventType::ConnectRequest);
    let server = request.id().expect("new id").clone();
    request.ack().expect("ack");
    let server_qp = server.create_qp(&QpCaps::default()).expect("server QP");
    let server_mem = server.register_memory(16).expect("server memory");
    server.post_recv(&server_mem, 0..16, 1).expect("post_recv");
    server.accept(&ConnParams::default()).expect("accept");

    // The active side is established (its RTU is sent, and dropped) and sends at once.
    expect_event(&client_channel, CmEventType::Established)
        .ack()
        .expect("ack");
    client
        .write_memory(&client_mem, 0, b"early")
        .expect("write");
    client.post_send(&client_mem, 0..5, 7).expect("post_send");

    // The passive QP (RTS since accept) completes the receive while its id is still in
    // REP_SENT: no ESTABLISHED has arrived.
    let received = wait_completion("server receive", || server.poll_recv_cq(4));
    assert!(received.is_success(), "{}", received.status_str());
    assert_eq!((received.qp_num, received.byte_len), (server_qp, 5));
    assert!(rtu_drop.dropped() > 0, "the RTU was not dropped");
    if let Some(event) = server_channel.try_next_event().expect("read") {
        panic!("the passive side got {event:?} without its RTU");
    }

    // Forwarding the trigger forces the connection to ESTABLISHED: exactly one event.
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::Established)
    );
    let established = expect_event(&server_channel, CmEventType::Established);
    assert_eq!(established.id(), Some(&server));
    established.ack().expect("ack");
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    drop(rtu_drop);
    if let Some(event) = server_channel
        .next_event_timeout(Duration::from_millis(200))
        .expect("read")
    {
        panic!("a second event after the forced establish: {event:?}");
    }

    client.disconnect().expect("client disconnect");
    expect_event(&server_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
    server.disconnect().expect("server disconnect");
    expect_event(&client_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
}
