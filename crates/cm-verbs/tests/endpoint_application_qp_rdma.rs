//! The application's own data path beside the endpoint's notify path, on the real
//! kernel (soft-RoCE in the VM), every RTU to the server dropped: the server makes its
//! own QP and completion queues on the request's id, registers a buffer of its own
//! (`register_buffer`, borrowed while registered), accepts, reads
//! its own receive queue and tells the endpoint of the receive (`Endpoint::received`,
//! its one line for the notify path), and is established by notify; it then RDMA-READs
//! the client's memory, whose address came in that first message, and answers with a
//! SEND of its own. The endpoint never reads the server's queues and refuses its own
//! `send` there. A second test does the same with the client on its own QP too, made
//! once its route is resolved (`ConnectOptions::application_qp`). Without a device (or
//! nft) the test records a skip.
#![cfg(feature = "rdma")]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cm_testkit::{addresses, report, skip, Addresses, CmMadRule, MadAction, RTU_ATTRIBUTE};
use cm_verbs::handle::EndpointHandle;
use cm_verbs::sys::{BorrowedRegion, CmId, Completion, QpCaps, RemoteMemory};
use cm_verbs::{
    AsyncEventType, ConnError, ConnectOptions, EstablishedVia, Event, ListenOptions, PrivateData,
    Trigger,
};

const WAIT: Option<Duration> = Some(Duration::from_secs(30));
/// What the client exposes for the server to read.
const CLIENT_BYTES: &[u8] = b"the client's registered bytes, read by the server";
/// The server's answer, a SEND from its own memory.
const ANSWER: &[u8] = b"read";

/// Polls `poll` until it yields a completion, for at most [`WAIT`].
fn next_completion(
    what: &str,
    mut poll: impl FnMut() -> Result<Vec<Completion>, cm_verbs::CmError>,
) -> Completion {
    let deadline = Instant::now() + WAIT.unwrap();
    loop {
        if let Some(completion) = poll().expect(what).into_iter().next() {
            assert!(completion.is_success(), "{what}: {completion:?}");
            return completion;
        }
        assert!(Instant::now() < deadline, "no {what} completion");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The client: an endpoint connection from `src` whose first message says where its
/// registered bytes are; returns the server's answer.
fn run_client(listen: SocketAddr, src: std::net::IpAddr) -> Vec<u8> {
    let mut client = common::endpoint();
    let options = ConnectOptions {
        source: Some(SocketAddr::new(src, 0)),
        ..ConnectOptions::default()
    };
    let conn = client.connect(listen, options).expect("connect");
    client.established(conn, WAIT).expect("client established");
    // Memory the server may read, and where it is, in the first message.
    let id = client.cm_id(conn).expect("the client's id");
    let region = id
        .register_remote_memory(CLIENT_BYTES.len())
        .expect("register");
    id.write_memory(&region, 0, CLIENT_BYTES).expect("write");
    let remote = id
        .remote_memory(&region, 0..CLIENT_BYTES.len())
        .expect("remote memory");
    client.send(conn, &remote.to_bytes()).expect("send");
    let answer = client.recv(conn, WAIT).expect("the server's answer");
    client.disconnect(conn).expect("disconnect");
    answer
}

/// The server's QP (librdmacm's completion queues) made on `id` before the request is
/// accepted.
fn own_qp(id: &CmId) {
    id.create_qp(&QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        ..QpCaps::default()
    })
    .expect("the application's QP");
}

/// The server's own buffer (256 bytes, the test's) registered for its QP, one receive
/// posted into it.
fn own_memory<'b>(id: &CmId, buffer: &'b mut [u8]) -> BorrowedRegion<'b> {
    let memory = id
        .register_buffer(buffer, false)
        .expect("register the server's buffer");
    memory.post_recv(0..64, 1).expect("post a receive");
    memory
}

/// Where in the server's buffer the client's bytes land.
const READ_INTO: std::ops::Range<usize> = 64..64 + CLIENT_BYTES.len();

/// On the server's own QP: RDMA READ of the client's memory named by the first
/// message (`len` bytes at the start of `memory`) into [`READ_INTO`], then the answer
/// as a SEND.
fn read_and_answer(id: &CmId, memory: &BorrowedRegion<'_>, len: usize) {
    let message = memory.read(0..len).unwrap();
    let remote = RemoteMemory::from_bytes(&message).expect("the client's memory");
    memory
        .post_rdma_read(READ_INTO, remote, 2)
        .expect("RDMA READ");
    assert_eq!(next_completion("RDMA READ", || id.poll_send_cq(4)).wr_id, 2);
    memory.write(128, ANSWER).unwrap();
    memory
        .post_send(128..128 + ANSWER.len(), 3)
        .expect("SEND the answer");
    assert_eq!(next_completion("SEND", || id.poll_send_cq(4)).wr_id, 3);
}

/// Whether `via` is a rescue by notify: on the stock device the receive is the
/// trigger; on one that raises COMM_EST the QP's event may come first (the pump
/// forwards it for any QP it knows).
fn rescued(via: Option<EstablishedVia>) -> bool {
    matches!(
        via,
        Some(EstablishedVia::Notify(
            Trigger::ReceiveCompletion | Trigger::AsyncEvent(AsyncEventType::CommEst)
        ))
    )
}

/// The test's addresses with every RTU to the server (`addr_a`) dropped while the rule
/// lives; `None` (reported as skipped) without a device or an nft.
fn addresses_without_rtus(test: &str, table: &str) -> Option<(Addresses, CmMadRule)> {
    let addrs = addresses(test)?;
    let Some(nft) = CmMadRule::nft_from_env() else {
        skip(test, "CMNOTIFY_NFT names no nft to drop RTUs with");
        return None;
    };
    let rule = CmMadRule::install(&nft, table, addrs.addr_a, RTU_ATTRIBUTE, MadAction::Drop)
        .expect("drop every RTU to the server");
    Some((addrs, rule))
}

#[test]
fn a_server_on_its_own_qp_is_rescued_and_reads_its_client() {
    serve_on_own_qp(
        "a_server_on_its_own_qp_is_rescued_and_reads_its_client",
        7531,
        run_client,
    );
}

/// Both sides on their own QPs: the client's made after `Event::RouteResolved`
/// (`ConnectOptions::application_qp`), its memory registered from its own buffer; the
/// server's as above.
#[test]
fn both_sides_on_their_own_qps_the_server_rescued() {
    serve_on_own_qp(
        "both_sides_on_their_own_qps_the_server_rescued",
        7533,
        run_own_qp_client,
    );
}

/// The client of [`both_sides_on_their_own_qps_the_server_rescued`]: its QP made on its
/// id once the route is resolved, a buffer of its own holding the bytes the server
/// reads, the receive for the answer and the first message; returns the answer.
fn run_own_qp_client(listen: SocketAddr, src: std::net::IpAddr) -> Vec<u8> {
    const ANSWER_AT: std::ops::Range<usize> = 64..128;
    const MESSAGE_AT: usize = 128;
    let mut client = common::endpoint();
    let options = ConnectOptions {
        source: Some(SocketAddr::new(src, 0)),
        application_qp: true,
        ..ConnectOptions::default()
    };
    let conn = client.connect(listen, options).expect("connect");
    match client.next_event(WAIT).expect("the route") {
        Event::RouteResolved { conn: resolved } => assert_eq!(resolved, conn),
        other => panic!("expected the route resolved, got {other:?}"),
    }
    let id = client.cm_id(conn).expect("the client's id").clone();
    own_qp(&id);
    let mut buffer = vec![0u8; 256];
    let memory = id.register_buffer(&mut buffer, true).expect("register");
    memory.write(0, CLIENT_BYTES).unwrap();
    memory
        .post_recv(ANSWER_AT, 1)
        .expect("the answer's receive");
    client.connect_application_qp(conn).expect("the REQ");
    assert_eq!(
        client.established(conn, WAIT).expect("client established"),
        EstablishedVia::Handshake
    );
    assert!(client.has_application_qp(conn).unwrap());
    let remote = memory
        .remote_memory(0..CLIENT_BYTES.len())
        .unwrap()
        .to_bytes();
    memory.write(MESSAGE_AT, &remote).unwrap();
    memory
        .post_send(MESSAGE_AT..MESSAGE_AT + remote.len(), 2)
        .expect("the first message");
    assert_eq!(next_completion("SEND", || id.poll_send_cq(4)).wr_id, 2);
    let answer = next_completion("the answer", || id.poll_recv_cq(4));
    let len = answer.byte_len as usize;
    let text = memory.read(ANSWER_AT.start..ANSWER_AT.start + len).unwrap();
    client.disconnect(conn).expect("disconnect");
    drop(memory);
    text
}

/// The server of the tests above: its own QP, memory and receive on the request's id,
/// every RTU to it dropped, the receive told to the endpoint; rescued by notify, it
/// reads the client's memory and answers. `client` runs on a thread.
fn serve_on_own_qp(test: &str, port: u16, client: fn(SocketAddr, std::net::IpAddr) -> Vec<u8>) {
    let table = format!("application_qp_{port}");
    let Some((addrs, _rtu_drop)) = addresses_without_rtus(test, &table) else {
        return;
    };
    let listen = SocketAddr::new(addrs.addr_a, port);
    let mut server = common::endpoint();
    let options = ListenOptions {
        auto_accept: false,
        ..ListenOptions::default()
    };
    server.listen(listen, options).expect("listen");

    let client = std::thread::spawn(move || client(listen, addrs.addr_b));

    let conn = match server.next_event(WAIT).expect("a request") {
        Event::Request { conn, .. } => conn,
        other => panic!("expected a request, got {other:?}"),
    };
    // The server's own QP (librdmacm's completion queues), memory and receive.
    let id = server.cm_id(conn).expect("the request's id").clone();
    own_qp(&id);
    let mut buffer = vec![0u8; 256];
    let memory = own_memory(&id, &mut buffer);
    server
        .accept_request(conn, &PrivateData::empty())
        .expect("accept with the application's QP");
    assert!(server.has_application_qp(conn).unwrap());

    // The client's first message lands in the server's receive queue; with the RTU
    // lost only the notify path establishes the connection.
    let received = next_completion("receive", || id.poll_recv_cq(4));
    assert_eq!(received.wr_id, 1);
    server.received(conn).expect("the receive, to the endpoint");
    let accepted = server.accept(WAIT).expect("established");
    assert_eq!(accepted, conn);
    let via = server.info(conn).unwrap().established;
    assert!(
        rescued(via),
        "rescued by notify, with no notify code in the application: {via:?}"
    );
    // The endpoint's own data path is not this connection's.
    assert!(matches!(
        server.send(conn, b"x"),
        Err(ConnError::WrongState { .. })
    ));

    read_and_answer(&id, &memory, received.byte_len as usize);
    // Deregistered, the buffer is the server's own again, the client's bytes in it.
    drop(memory);
    assert_eq!(&buffer[READ_INTO], CLIENT_BYTES);

    assert_eq!(client.join().expect("the client thread"), ANSWER);
    match server.next_event(WAIT).expect("the close") {
        Event::Closed { conn: closed, .. } => assert_eq!(closed, conn),
        other => panic!("expected the close, got {other:?}"),
    }
    report(&format!(
        "{test}: server on its own QP established via {via:?}, read {} bytes of the client's \
         memory with RDMA READ into a buffer of its own, answered with its own SEND",
        READ_INTO.len()
    ));
}

/// The same through connection handles (the thread driver): the QP made in
/// `Request::with_id`, the receive passed to `Connection::received`.
#[test]
fn a_handle_server_on_its_own_qp_is_rescued_and_reads_its_client() {
    const TEST: &str = "a_handle_server_on_its_own_qp_is_rescued_and_reads_its_client";
    let Some((addrs, _rtu_drop)) = addresses_without_rtus(TEST, "application_qp_handles") else {
        return;
    };
    let listen = SocketAddr::new(addrs.addr_a, 7532);
    let server = EndpointHandle::spawn_thread(common::endpoint()).expect("server endpoint");
    let options = ListenOptions {
        auto_accept: false,
        ..ListenOptions::default()
    };
    let listener = server.listen(listen, options).expect("listen");
    let client = std::thread::spawn(move || run_client(listen, addrs.addr_b));

    let request = listener.blocking_next_request(WAIT).expect("a request");
    let id = request
        .with_id(|id| {
            own_qp(id);
            id.clone()
        })
        .expect("the request's id");
    let mut buffer = vec![0u8; 256];
    let memory = own_memory(&id, &mut buffer);
    let conn = request
        .accept(&PrivateData::empty())
        .expect("accept with the application's QP");
    let received = next_completion("receive", || id.poll_recv_cq(4));
    conn.received().expect("the receive, to the endpoint");
    let via = conn.blocking_established(WAIT).expect("established");
    assert!(rescued(Some(via)), "{via:?}");
    assert!(matches!(
        conn.blocking_send(b"x", WAIT),
        Err(ConnError::WrongState { .. })
    ));
    read_and_answer(&id, &memory, received.byte_len as usize);
    drop(memory);
    assert_eq!(&buffer[READ_INTO], CLIENT_BYTES);
    assert_eq!(client.join().expect("the client thread"), ANSWER);
    report(&format!(
        "{TEST}: handle server on its own QP established via {via:?}, read {} bytes",
        READ_INTO.len()
    ));
}
