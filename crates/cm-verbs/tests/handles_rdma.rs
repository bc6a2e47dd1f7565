//! Connection handles on the real kernel (soft-RoCE in the VM), every RTU to the
//! server dropped: several threads serving one device through one shared endpoint, and
//! the tokio example's server (a task per connection) as written. Without a device each
//! test records a skip.
#![cfg(all(feature = "rdma", feature = "tokio"))]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use cm_testkit::{addresses, CmMadRule};
use cm_verbs::handle::EndpointHandle;
use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{Endpoint, EstablishedVia, ListenOptions};

#[allow(dead_code)]
#[path = "../examples/tokio_server.rs"]
mod example;

const WAIT: Option<Duration> = common::WAIT;

#[test]
fn threads_serving_one_device_each_get_their_rescue() {
    const TEST: &str = "threads_serving_one_device_each_get_their_rescue";
    const THREADS: u16 = 2;
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some(rule) = CmMadRule::drop_rtus(TEST, "handles_threads", addrs.addr_a) else {
        return;
    };
    // One endpoint on the server's device, shared by every serving thread; the clients
    // on the other device.
    let server = EndpointHandle::spawn_thread(common::endpoint()).expect("server endpoint");
    let client = EndpointHandle::spawn_thread(common::endpoint()).expect("client endpoint");
    let servers: Vec<_> = (0..THREADS)
        .map(|n| {
            let addr = SocketAddr::new(addrs.addr_a, 7531 + n);
            let listener = server
                .listen(addr, ListenOptions::default())
                .expect("listen");
            std::thread::spawn(move || {
                let conn = listener.blocking_accept(WAIT).expect("accept");
                let via = conn.blocking_established(WAIT).expect("established");
                let message = conn.blocking_recv(WAIT).expect("message");
                conn.blocking_send(&message, WAIT).expect("echo");
                // Until the client leaves.
                while conn.blocking_recv(WAIT).is_ok() {}
                via
            })
        })
        .collect();
    let clients: Vec<_> = (0..THREADS)
        .map(|n| {
            let client = client.clone();
            let dst = SocketAddr::new(addrs.addr_a, 7531 + n);
            let src = addrs.addr_b;
            std::thread::spawn(move || {
                let conn = client.connect(dst, common::from(src)).expect("connect");
                conn.blocking_established(WAIT).expect("client established");
                let message = format!("thread {n}").into_bytes();
                conn.blocking_send(&message, WAIT).expect("send");
                assert_eq!(conn.blocking_recv(WAIT).expect("echo"), message);
                conn.close().expect("close");
            })
        })
        .collect();
    for client in clients {
        client.join().expect("client thread");
    }
    for (n, thread) in servers.into_iter().enumerate() {
        let via = thread.join().expect("server thread");
        eprintln!("serving thread {n}: established via {via:?}");
        assert!(
            matches!(via, EstablishedVia::Notify(_)),
            "thread {n}'s connection rescued by notify: {via:?}"
        );
    }
    assert!(rule.hits().expect("counter") >= u64::from(THREADS));
    let counters = server.with_endpoint(|ep| ep.counters());
    assert_eq!(counters.forced, u64::from(THREADS), "{counters:?}");
}

#[test]
fn the_tokio_example_serves_each_connection_in_its_task_on_the_real_kernel() {
    const TEST: &str = "the_tokio_example_serves_each_connection_in_its_task_on_the_real_kernel";
    const CLIENTS: usize = 3;
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some(rule) = CmMadRule::drop_rtus(TEST, "handles_tokio", addrs.addr_a) else {
        return;
    };
    let addr = SocketAddr::new(addrs.addr_a, 7535);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let forced = runtime.block_on(async {
        let transport = RdmaTransport::new().expect("transport");
        let server = EndpointHandle::spawn_tokio(Endpoint::new(transport)).expect("server");
        let transport = RdmaTransport::new().expect("transport");
        let client = EndpointHandle::spawn_tokio(Endpoint::new(transport)).expect("client");
        let listener = server
            .listen(addr, ListenOptions::default())
            .expect("listen");
        let serving = tokio::spawn(example::serve(listener, CLIENTS));
        let mut clients = tokio::task::JoinSet::new();
        for n in 0..CLIENTS {
            let conn = client
                .connect(addr, common::from(addrs.addr_b))
                .expect("connect");
            clients.spawn(async move {
                let within = Duration::from_secs(60);
                tokio::time::timeout(within, conn.established())
                    .await
                    .expect("in time")
                    .expect("established");
                let message = format!("task {n}").into_bytes();
                conn.send(&message).await.expect("send");
                let echo = tokio::time::timeout(within, conn.recv())
                    .await
                    .expect("in time")
                    .expect("echo");
                assert_eq!(echo, message);
                conn.close().expect("close");
            });
        }
        while let Some(done) = clients.join_next().await {
            done.expect("client task");
        }
        tokio::time::timeout(Duration::from_secs(60), serving)
            .await
            .expect("the server ends")
            .expect("server task")
            .expect("serve");
        server.with_endpoint(|ep| ep.counters()).forced
    });
    assert!(rule.hits().expect("counter") >= CLIENTS as u64);
    assert_eq!(forced, CLIENTS as u64, "every connection rescued once");
}
