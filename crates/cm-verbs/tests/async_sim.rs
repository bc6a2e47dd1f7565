//! The async connection API over the simulated fabric: a tokio server written once,
//! for any transport, runs in a unit test with no device, every RTU lost, and each
//! connection is rescued by the endpoint's notify path.
#![cfg(all(feature = "tokio", feature = "sim"))]

use std::sync::{Arc, Mutex};

use cm_verbs::async_endpoint::{AsyncEndpoint, AsyncWait};
use cm_verbs::sim::{
    FaultAction, FaultRule, MsgKind, SimConfig, SimPair, SimTransport, SimTransports,
};
use cm_verbs::{ConnError, ConnectOptions, Endpoint, EstablishedVia, Event, ListenOptions};

/// The server under test, as an application writes it: accept, read one message, echo
/// it; how each connection was established.
async fn echo_server<T: AsyncWait>(
    server: &mut AsyncEndpoint<T>,
    connections: usize,
) -> Result<Vec<EstablishedVia>, ConnError> {
    let mut vias = Vec::new();
    for _ in 0..connections {
        let conn = server.accept().await?;
        vias.push(server.endpoint().info(conn)?.established.expect("accepted"));
        let message = server.recv(conn).await?;
        server.endpoint().send(conn, &message)?;
    }
    Ok(vias)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

const CLIENTS: usize = 3;

/// The clients of [`serve_clients`]: one endpoint, and the echoes it heard.
struct Clients {
    endpoint: Arc<Mutex<Endpoint<SimTransport>>>,
    echoes: Arc<Mutex<Vec<Vec<u8>>>>,
}

/// A fabric losing every RTU: the server's transport, whose wait drives the clients
/// (each connection sends one message once established and leaves once it is echoed),
/// and the clients.
fn every_rtu_lost(seed: u64) -> (SimTransport, Clients) {
    let SimTransports {
        fabric,
        server: mut transport,
        client,
    } = SimTransports::new(SimConfig::default(), seed);
    fabric.add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    // The clients: one endpoint, driven whenever the server's wait moves the fabric.
    let clients = Arc::new(Mutex::new(Endpoint::new(client)));
    let echoes = Arc::new(Mutex::new(Vec::new()));
    let (driven, heard) = (Arc::clone(&clients), Arc::clone(&echoes));
    transport.on_step(move || {
        let mut clients = driven.lock().unwrap();
        while let Some(event) = clients.poll().expect("client poll") {
            match event {
                Event::Established { conn, .. } => clients.send(conn, b"hello").expect("send"),
                Event::Received { conn, data } => {
                    heard.lock().unwrap().push(data);
                    clients.disconnect(conn).expect("disconnect");
                }
                _ => {}
            }
        }
    });
    let clients = Clients {
        endpoint: clients,
        echoes,
    };
    (transport, clients)
}

/// Listens on `transport`, connects [`CLIENTS`] clients, runs [`echo_server`] for them
/// and then the fabric until every echo is in: how each connection was established.
async fn serve_clients(
    transport: SimTransport,
    clients: &Clients,
) -> Result<Vec<EstablishedVia>, ConnError> {
    let mut server = AsyncEndpoint::new(transport)?;
    let addr = server.endpoint().transport().addr(7471);
    server.endpoint().listen(addr, ListenOptions::default())?;
    for _ in 0..CLIENTS {
        clients
            .endpoint
            .lock()
            .unwrap()
            .connect(addr, ConnectOptions::default())?;
    }
    let vias = echo_server(&mut server, CLIENTS).await?;
    // The last echo reaches its client as the fabric moves on.
    while clients.echoes.lock().unwrap().len() < CLIENTS {
        match server.next_event().await {
            Ok(_) => {}
            // Nothing left anywhere: every echo is in.
            Err(ConnError::Cm(cm_verbs::CmError::Idle { .. })) => break,
            Err(error) => return Err(error),
        }
    }
    Ok(vias)
}

/// Every connection rescued by notify, every client echoed.
fn check(vias: &[EstablishedVia], clients: &Clients) {
    assert_eq!(vias.len(), CLIENTS);
    assert!(
        vias.iter().all(|v| matches!(v, EstablishedVia::Notify(_))),
        "every RTU lost, every connection rescued by notify: {vias:?}"
    );
    assert_eq!(
        *clients.echoes.lock().unwrap(),
        vec![b"hello".to_vec(); CLIENTS]
    );
}

#[test]
fn the_async_server_rescues_every_connection_on_the_simulated_fabric() {
    let (transport, clients) = every_rtu_lost(31);
    let vias = runtime().block_on(serve_clients(transport, &clients));
    check(&vias.expect("the server"), &clients);
}

#[test]
fn the_async_server_runs_as_a_spawned_task() {
    // `tokio::spawn` takes only `Send` futures: the endpoint, its transport and the
    // wait hook (which shares the clients' endpoint) move into the task.
    let (transport, clients) = every_rtu_lost(33);
    let clients = Arc::new(clients);
    let in_task = Arc::clone(&clients);
    let vias = runtime().block_on(async move {
        tokio::spawn(async move { serve_clients(transport, &in_task).await })
            .await
            .expect("the server task")
    });
    check(&vias.expect("the server"), &clients);
}

#[test]
fn a_wait_with_nothing_pending_anywhere_is_refused_rather_than_hanging() {
    let SimPair { server, .. } = SimPair::new(SimConfig::default(), 32);
    let answer = runtime().block_on(async {
        let mut server = AsyncEndpoint::new(SimTransport::on_side(server))?;
        let addr = server.endpoint().transport().addr(7471);
        server.endpoint().listen(addr, ListenOptions::default())?;
        server.accept().await
    });
    assert!(
        matches!(answer, Err(ConnError::Cm(cm_verbs::CmError::Idle { .. }))),
        "{answer:?}"
    );
}
