//! Body of the `handle_ops` fuzz target (and of cm-verbs' handle property test): the
//! connection handles on both nodes of the simulated fabric, each driven by a tokio
//! task, under a plan read from the input. Clients connect, send a few messages and
//! then read the echoes, leave at once, or drop their handle; the server serves each
//! accepted connection in a task of its own, its receives now and then cancelled after
//! one look; every RTU lost or none.
//!
//! Checked: every connection established on the server's side is accepted (with no RTU
//! lost: every connection), none is refused; every message is received at most once
//! and in order, all of them for a client that waited for its echoes; every accepted
//! connection says how it was established; once every call has ended the handles keep
//! nothing (no waiter, timer or held connection) and the endpoint holds no connection
//! and no queued event.
//!
//! Both drivers are tasks of one runtime: a thread driver beside a task driver lets
//! virtual time run ahead of unread events (an open defect), so it is not mixed in yet.

use cm_verbs::handle::{Connection, EndpointHandle, HandleStats, Listener};
use cm_verbs::sim::{FaultAction, FaultRule, MsgKind, SimConfig, SimTransport, SimTransports};
use cm_verbs::{ConnError, ConnectOptions, Endpoint, EndpointOptions, ListenOptions};

use crate::input::Input;

// Explicit path: cm-verbs' property test includes this file with `#[path]`.
#[path = "../../crates/cm-verbs/tests/support/poll_once.rs"]
mod poll_once;

use poll_once::poll_once_and_drop;

type Addr = <SimTransport as cm_verbs::Transport>::Addr;

/// How a client leaves once its messages are sent.
#[derive(Debug, Clone, Copy)]
pub enum Leaving {
    /// Reads every echo, then closes.
    AfterEchoes,
    /// Closes at once (a DREQ right behind its last message).
    AtOnce,
    /// Drops its handle at once.
    Dropped,
}

/// One client's plan.
#[derive(Debug, Clone)]
pub struct Client {
    /// Messages it sends once established (1 to 3).
    pub messages: usize,
    /// How it leaves.
    pub leaving: Leaving,
}

/// At most this many clients in one run.
const MAX_CLIENTS: usize = 5;

/// Reads a plan from the input and runs it ([`check`]): a byte of set-up (RTUs lost,
/// how often a receive is cancelled), eight bytes of seed, then a byte per client.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let setup = input.u8();
    let lose_rtus = setup & 1 == 1;
    let cancel_every = usize::from(setup >> 1) % 3;
    // Half the runs with both endpoints on (the default) shared queues, half with
    // queues of each connection's own.
    let shared = setup & 0x80 != 0;
    let seed = u64::from(input.u32()) << 32 | u64::from(input.u32());
    let mut plans = Vec::new();
    while plans.len() < MAX_CLIENTS && (plans.is_empty() || !input.is_empty()) {
        let byte = input.u8();
        let leaving = match (byte / 3) % 3 {
            0 => Leaving::AfterEchoes,
            1 => Leaving::AtOnce,
            _ => Leaving::Dropped,
        };
        plans.push(Client {
            messages: 1 + usize::from(byte % 3),
            leaving,
        });
    }
    let options = if shared {
        EndpointOptions::default()
    } else {
        EndpointOptions::own_queues()
    };
    check(plans, lose_rtus, cancel_every, seed, options);
}

fn message(client: usize, n: usize) -> Vec<u8> {
    format!("client {client} message {n}").into_bytes()
}

/// One client's life.
async fn run_client(
    handle: EndpointHandle<SimTransport>,
    addr: Addr,
    index: usize,
    plan: Client,
) -> Result<(), ConnError> {
    let conn = handle.connect(addr, ConnectOptions::default())?;
    conn.established().await?;
    for n in 0..plan.messages {
        conn.send(&message(index, n)).await?;
    }
    match plan.leaving {
        Leaving::AfterEchoes => {
            for n in 0..plan.messages {
                assert_eq!(conn.recv().await?, message(index, n), "echo in order");
            }
            conn.close()
        }
        Leaving::AtOnce => conn.close(),
        Leaving::Dropped => Ok(()),
    }
}

/// One accepted connection: echoes until it ends; what it received. Every `cancel_every`
/// receives, a receive is started and dropped first.
async fn serve(conn: Connection<SimTransport>, cancel_every: usize) -> Vec<Vec<u8>> {
    let mut received = Vec::new();
    loop {
        // A receive given up after one look: what it answered is kept (the message it
        // returned is its), what it did not answer stays for the next receive.
        let looked = if cancel_every > 0 && received.len() % cancel_every == 0 {
            poll_once_and_drop(conn.recv())
        } else {
            std::task::Poll::Pending
        };
        let answer = match looked {
            std::task::Poll::Ready(answer) => answer,
            std::task::Poll::Pending => conn.recv().await,
        };
        match answer {
            Ok(message) => {
                let _ = conn.send(&message).await; // the peer may be gone already
                received.push(message);
            }
            Err(_) => return received,
        }
    }
}

/// Accepts connections, each served in a task of its own, until nothing can happen on
/// the fabric any more.
async fn accept_all(
    listener: Listener<SimTransport>,
    cancel_every: usize,
) -> Vec<(cm_verbs::EstablishedVia, Vec<Vec<u8>>)> {
    let mut served = tokio::task::JoinSet::new();
    loop {
        let conn = match listener.accept().await {
            Ok(conn) => conn,
            Err(ConnError::Cm(cm_verbs::CmError::Idle { .. })) => break,
            Err(error) => panic!("accept: {error}"),
        };
        let via = conn
            .established_via()
            .expect("an accepted connection was established");
        served.spawn(async move { (via, serve(conn, cancel_every).await) });
    }
    let mut all = Vec::new();
    while let Some(done) = served.join_next().await {
        all.push(done.expect("server task"));
    }
    all
}

pub fn check(
    plans: Vec<Client>,
    lose_rtus: bool,
    cancel_every: usize,
    seed: u64,
    options: EndpointOptions,
) {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), seed);
    if lose_rtus {
        fabric.add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    }
    let addr = server.addr(7495);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let (server, served, outcomes) = runtime.block_on(async {
        let server =
            EndpointHandle::spawn_tokio(Endpoint::with_options(server, options)).expect("server");
        let client =
            EndpointHandle::spawn_tokio(Endpoint::with_options(client, options)).expect("client");
        let listener = server
            .listen(addr, ListenOptions::default())
            .expect("listen");
        let accepting = tokio::spawn(accept_all(listener, cancel_every));
        let mut clients = tokio::task::JoinSet::new();
        for (index, plan) in plans.iter().cloned().enumerate() {
            clients.spawn(run_client(client.clone(), addr, index, plan));
        }
        let mut outcomes = Vec::new();
        while let Some(done) = clients.join_next().await {
            outcomes.push(done.expect("client task"));
        }
        let served = accepting.await.expect("acceptor");
        (server, served, outcomes)
    });
    for outcome in &outcomes {
        assert!(outcome.is_ok(), "{outcome:?}");
    }
    // With every RTU lost, a client that leaves before its first message lands never
    // got established on the server's side; every other connection was, and is
    // accepted.
    if !lose_rtus {
        assert_eq!(served.len(), plans.len(), "every connection accepted");
    }
    assert_eq!(server.accepts_refused(), 0);
    // Each served connection's messages are one client's, a prefix of what it sent, in
    // order; all of them when the client waited for the echoes.
    let mut seen = vec![false; plans.len()];
    for (_, received) in &served {
        let Some(first) = received.first() else {
            continue;
        };
        let index = (0..plans.len())
            .find(|&i| *first == message(i, 0))
            .expect("a client's first message");
        assert!(!seen[index], "client {index} served twice");
        seen[index] = true;
        let sent: Vec<Vec<u8>> = (0..plans[index].messages)
            .map(|n| message(index, n))
            .collect();
        assert!(
            sent.starts_with(received),
            "client {index}: {received:?} of {sent:?}"
        );
    }
    for (index, plan) in plans.iter().enumerate() {
        if matches!(plan.leaving, Leaving::AfterEchoes) {
            assert!(seen[index], "client {index} waited for its echoes");
        }
    }
    if lose_rtus {
        let counters = server.with_endpoint(|ep| ep.counters());
        assert!(
            counters.forced <= plans.len() as u64,
            "established at most once each: {counters:?}"
        );
    }
    assert_eq!(server.stats(), HandleStats::default(), "nothing kept");
    let endpoint = server.with_endpoint(|ep| ep.stats());
    assert_eq!(endpoint.connections, 0, "{endpoint:?}");
    assert_eq!(endpoint.queued(), 0, "{endpoint:?}");
}
