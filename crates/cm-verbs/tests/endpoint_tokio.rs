//! The connection API on tokio and the real kernel (soft-RoCE in the VM): a server
//! written with `AsyncEndpoint` rescues a connection whose RTU nftables drops, and a
//! dropped `accept` future loses nothing. Without a device the test records a skip.
#![cfg(all(feature = "tokio", feature = "rdma"))]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use cm_testkit::{addresses, report, CmMadRule};
use cm_verbs::async_endpoint::AsyncEndpoint;
use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{EstablishedVia, ListenOptions};

const WAIT: Option<Duration> = Some(Duration::from_secs(30));

#[test]
fn an_async_server_rescues_a_lost_rtu_and_a_cancelled_accept_loses_nothing() {
    const TEST: &str = "an_async_server_rescues_a_lost_rtu_and_a_cancelled_accept_loses_nothing";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some(_rule) = CmMadRule::drop_rtus(TEST, "endpoint_tokio", addrs.addr_a) else {
        return;
    };
    let listen = SocketAddr::new(addrs.addr_a, 7514);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut server =
            AsyncEndpoint::new(RdmaTransport::new().expect("transport")).expect("register");
        server
            .endpoint()
            .listen(listen, ListenOptions::default())
            .expect("listen");
        // An accept cancelled before anyone connects: nothing is lost by dropping it.
        let cancelled = tokio::time::timeout(Duration::from_millis(50), server.accept()).await;
        assert!(cancelled.is_err(), "nobody connected yet");

        let src = addrs.addr_b;
        let client = std::thread::spawn(move || {
            let mut client = common::endpoint();
            let conn = common::connected(&mut client, src, listen);
            client.send(conn, b"over tokio").expect("send");
            let echo = client.recv(conn, WAIT).expect("echo");
            client.disconnect(conn).expect("disconnect");
            echo
        });
        let conn = tokio::time::timeout(Duration::from_secs(30), server.accept())
            .await
            .expect("accepted in time")
            .expect("accept");
        let via = server.endpoint().info(conn).expect("info").established;
        report(&format!("endpoint (tokio): established via {via:?}"));
        assert!(matches!(via, Some(EstablishedVia::Notify(_))), "{via:?}");
        let message = server.recv(conn).await.expect("message");
        server.endpoint().send(conn, &message).expect("echo");
        assert_eq!(client.join().expect("client thread"), b"over tokio");
        assert_eq!(server.endpoint().counters().forced, 1);
    });
}
