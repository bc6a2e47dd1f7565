//! Connection handles on the simulated fabric: the tokio example's server (a task per
//! connection) as written, blocking threads per connection, cancellation, sends that
//! wait for a buffer, and what dropping a handle frees.
#![cfg(all(feature = "tokio", feature = "sim", feature = "rdma"))]

#[path = "support/poll_once.rs"]
mod poll_once;

use std::time::Duration;

use poll_once::poll_once_and_drop;

use cm_verbs::handle::{Connection, EndpointHandle, Listener};
use cm_verbs::sim::{FaultAction, FaultRule, MsgKind, SimConfig, SimTransport, SimTransports};
use cm_verbs::{
    ConnError, ConnectOptions, Endpoint, EndpointOptions, EstablishedVia, ListenOptions, QueueCaps,
};

#[allow(dead_code)]
#[path = "../examples/tokio_server.rs"]
mod example;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A server and a client endpoint on one simulated fabric, every RTU dropped.
fn pair_losing_rtus(seed: u64) -> (SimTransport, SimTransport) {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), seed);
    fabric.add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    (server, client)
}

/// Who drives the handles of a test.
enum Driver {
    Tokio,
    Thread,
}

/// Handles on both sides, driven by `driver`, and the server listening on `addr`.
fn listening(
    server: SimTransport,
    client: SimTransport,
    addr: <SimTransport as cm_verbs::Transport>::Addr,
    driver: Driver,
) -> (
    EndpointHandle<SimTransport>,
    EndpointHandle<SimTransport>,
    Listener<SimTransport>,
) {
    listening_with(server, client, addr, driver, EndpointOptions::default())
}

/// [`listening`] with the server's endpoint made with `server_options`.
fn listening_with(
    server: SimTransport,
    client: SimTransport,
    addr: <SimTransport as cm_verbs::Transport>::Addr,
    driver: Driver,
    server_options: EndpointOptions,
) -> (
    EndpointHandle<SimTransport>,
    EndpointHandle<SimTransport>,
    Listener<SimTransport>,
) {
    let spawn = |transport, options| match driver {
        Driver::Tokio => EndpointHandle::spawn_tokio(Endpoint::with_options(transport, options)),
        Driver::Thread => EndpointHandle::spawn_thread(Endpoint::with_options(transport, options)),
    };
    let server = spawn(server, server_options).expect("server");
    let client = spawn(client, EndpointOptions::default()).expect("client");
    let listener = server
        .listen(addr, ListenOptions::default())
        .expect("listen");
    (server, client, listener)
}

/// Connects, sends each message and reads its echo; the echoes.
async fn echo_client(
    client: EndpointHandle<SimTransport>,
    addr: <SimTransport as cm_verbs::Transport>::Addr,
    messages: Vec<Vec<u8>>,
) -> Result<Vec<Vec<u8>>, ConnError> {
    let conn = client.connect(addr, ConnectOptions::default())?;
    conn.established().await?;
    let mut echoes = Vec::new();
    for message in messages {
        conn.send(&message).await?;
        echoes.push(conn.recv().await?);
    }
    conn.close()?;
    Ok(echoes)
}

#[test]
fn the_tokio_example_rescues_every_connection_each_in_its_own_task() {
    const CLIENTS: usize = 8;
    let (server, client) = pair_losing_rtus(41);
    let addr = server.addr(7471);
    let (echoes, counters, rescued_via) = runtime().block_on(async {
        let (server, client, listener) = listening(server, client, addr, Driver::Tokio);
        let serving = tokio::spawn(example::serve(listener, CLIENTS));
        let mut clients = tokio::task::JoinSet::new();
        for n in 0..CLIENTS {
            let messages = (0..3).map(|i| format!("client {n} message {i}").into_bytes());
            clients.spawn(echo_client(client.clone(), addr, messages.collect()));
        }
        let mut echoes = Vec::new();
        while let Some(done) = clients.join_next().await {
            echoes.push(done.expect("client task").expect("client"));
        }
        serving.await.expect("server task").expect("serve");
        let counters = server.with_endpoint(|ep| ep.counters());
        (
            echoes,
            counters,
            server.with_endpoint(|ep| ep.connection_count()),
        )
    });
    assert_eq!(echoes.len(), CLIENTS);
    for echo in &echoes {
        assert_eq!(echo.len(), 3, "every message echoed");
    }
    assert_eq!(
        counters.forced, CLIENTS as u64,
        "every lost RTU rescued by notify, once: {counters:?}"
    );
    assert_eq!(rescued_via, 0, "every connection freed once its task ended");
}

#[test]
fn blocking_threads_each_serve_a_connection_of_one_shared_endpoint() {
    const CLIENTS: usize = 4;
    let (server, client) = pair_losing_rtus(42);
    let addr = server.addr(7472);
    let (server, client, listener) = listening(server, client, addr, Driver::Thread);
    let acceptor = std::thread::spawn(move || {
        let mut threads = Vec::new();
        for _ in 0..CLIENTS {
            let conn = listener.blocking_accept(None).expect("accept");
            threads.push(std::thread::spawn(move || {
                let via = conn.blocking_established(None).expect("established");
                while let Ok(message) = conn.blocking_recv(None) {
                    conn.blocking_send(&message, None).expect("echo");
                }
                via
            }));
        }
        threads
            .into_iter()
            .map(|t| t.join().expect("server thread"))
            .collect::<Vec<_>>()
    });
    let clients: Vec<_> = (0..CLIENTS)
        .map(|n| {
            let client = client.clone();
            std::thread::spawn(move || {
                let conn = client
                    .connect(addr, ConnectOptions::default())
                    .expect("connect");
                conn.blocking_established(None).expect("established");
                let message = format!("thread {n}").into_bytes();
                conn.blocking_send(&message, None).expect("send");
                let echo = conn.blocking_recv(None).expect("echo");
                assert_eq!(echo, message);
                conn.close().expect("close");
            })
        })
        .collect();
    for client in clients {
        client.join().expect("client thread");
    }
    let vias = acceptor.join().expect("acceptor");
    assert_eq!(vias.len(), CLIENTS);
    for via in vias {
        assert!(matches!(via, EstablishedVia::Notify(_)), "rescued: {via:?}");
    }
    assert_eq!(
        server.with_endpoint(|ep| ep.counters()).forced,
        CLIENTS as u64
    );
}

#[test]
fn a_receive_dropped_before_its_message_loses_nothing() {
    let (server, client) = pair_losing_rtus(43);
    let addr = server.addr(7473);
    runtime().block_on(async {
        let (_server, client, listener) = listening(server, client, addr, Driver::Tokio);
        let out = client
            .connect(addr, ConnectOptions::default())
            .expect("connect");
        out.established().await.expect("client established");
        // The first message is the trigger that rescues the lost RTU.
        out.send(b"first").await.expect("send");
        let conn = listener.accept().await.expect("accept");
        assert_eq!(conn.recv().await.expect("first"), b"first");
        // Receives dropped before anything came, many times over.
        for _ in 0..100 {
            assert!(poll_once_and_drop(conn.recv()).is_pending());
        }
        out.send(b"second").await.expect("send");
        // A receive given up while the message is on its way.
        assert!(poll_once_and_drop(conn.recv()).is_pending());
        let second = conn.recv().await.expect("second");
        assert_eq!(second, b"second", "the message waited for the next receive");
    });
}

/// The reader has queues of its own: its receives are posted again only as it reads,
/// so the stream is held back end to end (on shared queues a reader this far behind
/// would end the connection past its receive depth instead).
#[test]
fn send_waits_for_a_free_buffer_and_keeps_the_order() {
    const MESSAGES: usize = 200;
    let (server, client) = pair_losing_rtus(44);
    let addr = server.addr(7474);
    let caps = QueueCaps {
        send_depth: 2,
        ..QueueCaps::default()
    };
    runtime().block_on(async {
        let own = EndpointOptions::own_queues();
        let (_server, client, listener) = listening_with(server, client, addr, Driver::Tokio, own);
        let options = ConnectOptions {
            caps,
            ..ConnectOptions::default()
        };
        let out = client.connect(addr, options).expect("connect");
        out.established().await.expect("established");
        let sender = tokio::spawn(async move {
            let mut refused = 0;
            for i in 0..MESSAGES {
                let message = (i as u32).to_be_bytes();
                if let Err(ConnError::SendQueueFull(_)) = out.try_send(&message) {
                    refused += 1;
                    out.send(&message).await.expect("send waits for a buffer");
                }
            }
            (out, refused)
        });
        let conn = listener.accept().await.expect("accept");
        for i in 0..MESSAGES {
            let message = conn.recv().await.expect("message");
            assert_eq!(message, (i as u32).to_be_bytes(), "in order");
        }
        let (_out, refused) = sender.await.expect("sender");
        assert!(
            refused > 0,
            "two buffers for {MESSAGES} messages: try_send met a full queue"
        );
    });
}

#[test]
fn dropping_handles_frees_every_connection_and_listener() {
    let (server, client) = pair_losing_rtus(45);
    let addr = server.addr(7475);
    runtime().block_on(async {
        let (server, client, listener) = listening(server, client, addr, Driver::Tokio);
        let outs: Vec<Connection<SimTransport>> = (0..3)
            .map(|_| {
                client
                    .connect(addr, ConnectOptions::default())
                    .expect("connect")
            })
            .collect();
        for out in &outs {
            out.established().await.expect("established");
            out.send(b"hello").await.expect("send");
        }
        // One accepted and dropped, its clone first; two left in the listener's queue.
        let conn = listener.accept().await.expect("accept");
        let clone = conn.clone();
        drop(conn);
        assert_eq!(clone.recv().await.expect("still open"), b"hello");
        drop(clone);
        let closed = outs[0].recv().await;
        assert!(
            matches!(closed, Err(ConnError::Closed { .. })),
            "the peer saw it go: {closed:?}"
        );
        // Wait until the other two are in the listener's queue, then drop the listener.
        while server.with_endpoint(|ep| ep.counters()).forced < 3 {
            tokio::task::yield_now().await;
        }
        drop(listener);
        for out in &outs[1..] {
            let closed = out.recv().await;
            assert!(
                matches!(closed, Err(ConnError::Closed { .. })),
                "{closed:?}"
            );
        }
        assert_eq!(server.with_endpoint(|ep| ep.connection_count()), 0);
        assert_eq!(server.with_endpoint(|ep| ep.listener_count()), 0);
        let stats = server.with_endpoint(|ep| ep.stats());
        assert_eq!(stats.queued(), 0, "nothing kept: {stats:?}");
    });
}

#[test]
fn a_blocking_receive_on_an_idle_fabric_times_out() {
    let (server, client) = pair_losing_rtus(47);
    let addr = server.addr(7477);
    let (_server, client, listener) = listening(server, client, addr, Driver::Thread);
    let out = client
        .connect(addr, ConnectOptions::default())
        .expect("connect");
    out.blocking_established(None).expect("established");
    out.blocking_send(b"x", None).expect("send");
    let conn = listener.blocking_accept(None).expect("accept");
    assert_eq!(conn.blocking_recv(None).expect("x"), b"x");
    assert_eq!(
        conn.blocking_recv(Some(Duration::from_millis(5))),
        Err(ConnError::Timeout)
    );
}

#[test]
fn the_readme_shows_the_tokio_example_as_it_is_in_at_most_twenty_lines_of_logic() {
    let example = include_str!("../examples/tokio_server.rs");
    assert!(include_str!("../README.md").contains(example));
    // The server's logic: `serve`'s body, comments and blank lines aside.
    let body: Vec<&str> = example
        .lines()
        .skip_while(|line| !line.contains("async fn serve"))
        .skip_while(|line| !line.starts_with('{'))
        .skip(1)
        .take_while(|line| !line.starts_with('}'))
        .filter(|line| !line.trim().is_empty() && !line.trim_start().starts_with("//"))
        .collect();
    assert!(!body.is_empty(), "serve found");
    assert!(body.len() <= 20, "{} lines: {body:#?}", body.len());
}

#[test]
fn calls_end_when_the_driver_s_runtime_is_gone_instead_of_hanging() {
    let (server, client) = pair_losing_rtus(48);
    let addr = server.addr(7478);
    let runtime = runtime();
    let (server, _client, listener) =
        runtime.block_on(async { listening(server, client, addr, Driver::Tokio) });
    drop(runtime);
    let answer = listener.blocking_accept(None);
    assert!(
        matches!(&answer, Err(e) if e.ends_endpoint()),
        "the endpoint is over: {answer:?}"
    );
    drop(server);
}
