//! Connection handles on the real kernel (soft-RoCE in the VM), every RTU to the
//! server dropped: several threads serving one device through one shared endpoint, and
//! the tokio example's server (a task per connection) as written, the application's
//! one-sided work beside the notify path, and manual accept (private data both ways, a
//! reject). Without a device each test records a skip.
#![cfg(all(feature = "rdma", feature = "tokio"))]

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use cm_testkit::{addresses, CmMadRule};
use cm_verbs::handle::EndpointHandle;
use cm_verbs::rdma::RdmaTransport;
use cm_verbs::sys::RemoteMemory;
use cm_verbs::{
    CloseReason, ConnError, Endpoint, ListenOptions, PrivateData, QueueCaps, RejectReason,
    APPLICATION_WR_ID,
};

#[allow(dead_code)]
#[path = "../examples/tokio_server.rs"]
mod example;

const WAIT: Option<Duration> = common::WAIT;

/// Where each thread of a test is: a test that hangs then says where, instead of being
/// killed silently by the VM's limit.
#[derive(Clone, Default)]
struct Steps(Arc<Mutex<BTreeMap<String, &'static str>>>);

impl Steps {
    fn mark(&self, who: &str, step: &'static str) {
        self.0.lock().unwrap().insert(who.to_owned(), step);
    }
}

/// Each thread of this process: its name, its state and where the kernel has it waiting
/// (`wchan`, and its kernel stack where readable: root in the VM), so a hang says
/// whether it waits in user space (a futex) or in the kernel.
fn threads_of_this_process() -> String {
    let read = |path: std::path::PathBuf| std::fs::read_to_string(path).unwrap_or_default();
    let mut out = String::from("  threads:\n");
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for task in tasks.flatten() {
        let dir = task.path();
        let stat = read(dir.join("stat"));
        // The state is the first field after the parenthesised name.
        let state = stat
            .rsplit_once(')')
            .map_or("?", |(_, rest)| rest.trim_start());
        let state = state.split_whitespace().next().unwrap_or("?");
        out += &format!(
            "    {} {}: state {state}, wchan {}\n",
            task.file_name().to_string_lossy(),
            read(dir.join("comm")).trim(),
            read(dir.join("wchan")).trim()
        );
        for line in read(dir.join("stack")).lines() {
            out += &format!("      {line}\n");
        }
    }
    out
}

/// Watches a test: unless `done` is set within `limit`, prints every thread's step and
/// whether each endpoint's lock still answers (straight to stderr: the test harness
/// captures `eprintln!`), removes `rule` if the test still holds it (the exit skips its
/// drop), then ends the process as failed.
fn watchdog(
    test: &'static str,
    limit: Duration,
    steps: Steps,
    endpoints: Vec<(&'static str, EndpointHandle<RdmaTransport>)>,
    rule: Weak<CmMadRule>,
) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    let finished = Arc::clone(&done);
    std::thread::spawn(move || {
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            if finished.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut out = format!("{test}: no end after {limit:?}; where each thread is:\n");
        for (who, step) in steps.0.lock().unwrap().iter() {
            out += &format!("  {who}: {step}\n");
        }
        for (name, endpoint) in endpoints {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(endpoint.with_endpoint(|ep| format!("{:?}", ep.stats())));
            });
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(stats) => out += &format!("  {name} endpoint: lock answers, {stats}\n"),
                Err(_) => out += &format!("  {name} endpoint: lock held (no answer in 5 s)\n"),
            }
        }
        out += &threads_of_this_process();
        let _ = std::io::stderr().write_all(out.as_bytes());
        // The exit skips every drop: the RTU drop would outlive the test and take the
        // RTUs of every test after it. (Weak: a test that ended dropped its rule itself.)
        if let Some(rule) = rule.upgrade() {
            rule.remove();
        }
        std::process::exit(101);
    });
    done
}

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
    let rule = Arc::new(rule);
    // One endpoint on the server's device, shared by every serving thread; the clients
    // on the other device.
    let server = EndpointHandle::spawn_thread(common::endpoint()).expect("server endpoint");
    let client = EndpointHandle::spawn_thread(common::endpoint()).expect("client endpoint");
    let steps = Steps::default();
    // Every call below has its own 60 s limit: four minutes means one hangs.
    let done = watchdog(
        TEST,
        Duration::from_secs(240),
        steps.clone(),
        vec![("server", server.clone()), ("client", client.clone())],
        Arc::downgrade(&rule),
    );
    let servers: Vec<_> = (0..THREADS)
        .map(|n| {
            let addr = SocketAddr::new(addrs.addr_a, 7531 + n);
            let listener = server
                .listen(addr, ListenOptions::default())
                .expect("listen");
            let steps = steps.clone();
            std::thread::spawn(move || {
                let who = format!("serving thread {n}");
                steps.mark(&who, "accept");
                let conn = listener.blocking_accept(WAIT).expect("accept");
                eprintln!("{who}: accepted {}", conn.id());
                steps.mark(&who, "established");
                let via = conn.blocking_established(WAIT).expect("established");
                steps.mark(&who, "recv");
                let message = conn.blocking_recv(WAIT).expect("message");
                steps.mark(&who, "send");
                conn.blocking_send(&message, WAIT).expect("echo");
                eprintln!("{who}: echoed");
                // Until the client leaves.
                steps.mark(&who, "recv until the client leaves");
                let end = loop {
                    if let Err(end) = conn.blocking_recv(WAIT) {
                        break end;
                    }
                };
                eprintln!("{who}: {end}");
                steps.mark(&who, "dropping the connection and the listener");
                drop((conn, listener));
                steps.mark(&who, "done");
                via
            })
        })
        .collect();
    let clients: Vec<_> = (0..THREADS)
        .map(|n| {
            let client = client.clone();
            let dst = SocketAddr::new(addrs.addr_a, 7531 + n);
            let src = addrs.addr_b;
            let steps = steps.clone();
            std::thread::spawn(move || {
                let who = format!("client thread {n}");
                steps.mark(&who, "connect");
                let conn = client.connect(dst, common::from(src)).expect("connect");
                steps.mark(&who, "established");
                conn.blocking_established(WAIT).expect("client established");
                eprintln!("{who}: established");
                let message = format!("thread {n}").into_bytes();
                steps.mark(&who, "send");
                conn.blocking_send(&message, WAIT).expect("send");
                steps.mark(&who, "recv");
                assert_eq!(conn.blocking_recv(WAIT).expect("echo"), message);
                steps.mark(&who, "close");
                conn.close().expect("close");
                eprintln!("{who}: closed");
                steps.mark(&who, "done");
            })
        })
        .collect();
    for client in clients {
        client.join().expect("client thread");
    }
    for (n, thread) in servers.into_iter().enumerate() {
        let via = thread.join().expect("server thread");
        eprintln!("serving thread {n}: established via {via:?}");
        common::assert_rescued(via, &format!("thread {n}'s connection"));
    }
    steps.mark("test thread", "reading the counters");
    common::assert_rtus_dropped(&rule, u64::from(THREADS));
    let counters = server.with_endpoint(|ep| ep.counters());
    done.store(true, Ordering::SeqCst);
    assert_eq!(
        counters.forced,
        common::forced(u64::from(THREADS)),
        "{counters:?}"
    );
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
    common::assert_rtus_dropped(&rule, CLIENTS as u64);
    assert_eq!(
        forced,
        common::forced(CLIENTS as u64),
        "every connection rescued once"
    );
}

/// The application's own memory and one-sided work beside the notify path: the server
/// (its RTU dropped, rescued by notify) registers memory the peer may write and read
/// and sends where it is; the client RDMA-WRITEs into it and READs it back, each work
/// request completing to the application alone; the endpoint's messages go on.
#[test]
fn one_sided_work_of_the_application_beside_the_notify_path() {
    const TEST: &str = "one_sided_work_of_the_application_beside_the_notify_path";
    const PAYLOAD: &[u8] = b"written by RDMA WRITE";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some(rule) = CmMadRule::drop_rtus(TEST, "handles_one_sided", addrs.addr_a) else {
        return;
    };
    let caps = QueueCaps {
        work_depth: 4,
        ..QueueCaps::default()
    };
    let addr = SocketAddr::new(addrs.addr_a, 7536);
    let server = EndpointHandle::spawn_thread(common::endpoint()).expect("server endpoint");
    let client = EndpointHandle::spawn_thread(common::endpoint()).expect("client endpoint");
    let options = ListenOptions {
        caps,
        ..ListenOptions::default()
    };
    let listener = server.listen(addr, options).expect("listen");
    let serving = std::thread::spawn(move || {
        let conn = listener.blocking_accept(WAIT).expect("accept");
        let via = conn.blocking_established(WAIT).expect("established");
        assert_eq!(conn.blocking_recv(WAIT).expect("hello"), b"hello");
        let (region, remote) = conn
            .with_id(|id| {
                let region = id.register_remote_memory(4096)?;
                Ok::<_, cm_verbs::CmError>((region, id.remote_memory(&region, 0..4096)?))
            })
            .expect("a live connection")
            .expect("remote memory");
        conn.blocking_send(&remote.to_bytes(), WAIT).expect("where");
        assert_eq!(conn.blocking_recv(WAIT).expect("done"), b"done");
        let written = conn
            .with_id(|id| id.read_memory(&region, 0..PAYLOAD.len()))
            .expect("a live connection")
            .expect("read");
        (via, written)
    });
    let mut options = common::from(addrs.addr_b);
    options.caps = caps;
    let conn = client.connect(addr, options).expect("connect");
    conn.blocking_established(WAIT).expect("client established");
    // The first message rescues the server's connection.
    conn.blocking_send(b"hello", WAIT).expect("hello");
    let remote =
        RemoteMemory::from_bytes(&conn.blocking_recv(WAIT).expect("where")).expect("20 bytes");
    let local = conn
        .with_id(|id| id.register_memory(4096))
        .expect("a live connection")
        .expect("local memory");
    let post =
        |what: &str, wr: u64, f: &dyn Fn(&cm_verbs::sys::CmId) -> Result<(), cm_verbs::CmError>| {
            conn.with_id(f).expect("a live connection").expect(what);
            let done = conn.blocking_work_completed(WAIT).expect(what);
            assert!(done.is_success(), "{what}: {done:?}");
            assert_eq!(done.wr_id, APPLICATION_WR_ID | wr, "{what}");
        };
    post("RDMA WRITE", 1, &|id| {
        id.write_memory(&local, 0, PAYLOAD)?;
        id.post_rdma_write(&local, 0..PAYLOAD.len(), remote, APPLICATION_WR_ID | 1)
    });
    post("RDMA READ", 2, &|id| {
        id.post_rdma_read(
            &local,
            1024..1024 + PAYLOAD.len(),
            remote,
            APPLICATION_WR_ID | 2,
        )
    });
    let read = conn
        .with_id(|id| id.read_memory(&local, 1024..1024 + PAYLOAD.len()))
        .expect("a live connection")
        .expect("read");
    assert_eq!(read, PAYLOAD, "read back what was written");
    // The endpoint's own messages still go: the sends of the work did not count as its.
    conn.blocking_send(b"done", WAIT).expect("done");
    let (via, written) = serving.join().expect("server thread");
    assert_eq!(
        written, PAYLOAD,
        "the server's memory holds what the client wrote"
    );
    common::assert_rescued(via, "the server's connection");
    common::assert_rtus_dropped(&rule, 1);
    conn.close().expect("close");
}

/// Whether `data` starts with `prefix`: the kernel pads private data with zeros to the
/// CM message's room (REQ 56 bytes, REP 196, REJ 148).
fn starts_with(data: Option<&PrivateData>, prefix: &[u8]) -> bool {
    data.is_some_and(|d| d.as_bytes().starts_with(prefix))
}

/// Manual accept through the handles: the server reads the client's REQ private data
/// and address and answers with private data of its own in the REP (its RTU dropped:
/// the connection is rescued by notify), each side's connection shows the other's; a
/// second request is rejected with private data the client reads from its close.
#[test]
fn manual_accept_answers_with_private_data_both_ways_and_rejects_on_the_real_kernel() {
    const TEST: &str =
        "manual_accept_answers_with_private_data_both_ways_and_rejects_on_the_real_kernel";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some(rule) = CmMadRule::drop_rtus(TEST, "handles_requests", addrs.addr_a) else {
        return;
    };
    let addr = SocketAddr::new(addrs.addr_a, 7541);
    let server = EndpointHandle::spawn_thread(common::endpoint()).expect("server endpoint");
    let client = EndpointHandle::spawn_thread(common::endpoint()).expect("client endpoint");
    let options = ListenOptions {
        auto_accept: false,
        ..ListenOptions::default()
    };
    let listener = server.listen(addr, options).expect("listen");
    let serving = std::thread::spawn(move || {
        let request = listener.blocking_next_request(WAIT).expect("first request");
        eprintln!("server: {request:?}");
        assert!(
            starts_with(Some(request.private_data()), b"credits 16"),
            "{request:?}"
        );
        assert_eq!(
            request.peer_addr().map(|a| a.ip()),
            Some(addrs.addr_b),
            "{request:?}"
        );
        let conn = request
            .accept(&PrivateData::from(b"rkey 0x1234"))
            .expect("accept");
        let second = listener
            .blocking_next_request(WAIT)
            .expect("second request");
        second
            .reject(&PrivateData::from(b"full, retry later"))
            .expect("reject");
        let via = conn.blocking_established(WAIT).expect("established");
        assert_eq!(conn.blocking_recv(WAIT).expect("hello"), b"hello");
        (via, conn.peer_private_data().cloned())
    });
    let mut options = common::from(addrs.addr_b);
    options.private_data = PrivateData::from(b"credits 16");
    let conn = client.connect(addr, options).expect("connect");
    conn.blocking_established(WAIT).expect("client established");
    assert!(
        starts_with(conn.peer_private_data(), b"rkey 0x1234"),
        "{:?}",
        conn.peer_private_data()
    );
    let second = client
        .connect(addr, common::from(addrs.addr_b))
        .expect("connect");
    match second.blocking_established(WAIT) {
        Err(ConnError::Closed {
            reason:
                CloseReason::Rejected {
                    reason,
                    private_data,
                },
            ..
        }) => {
            assert_eq!(reason, RejectReason::Consumer);
            assert!(
                private_data.as_bytes().starts_with(b"full, retry later"),
                "{private_data:?}"
            );
        }
        other => panic!("expected a consumer reject, got {other:?}"),
    }
    // The first message rescues the server's connection.
    conn.blocking_send(b"hello", WAIT).expect("hello");
    let (via, peer) = serving.join().expect("server thread");
    common::assert_rescued(via, "the server's connection");
    assert!(starts_with(peer.as_ref(), b"credits 16"), "{peer:?}");
    common::assert_rtus_dropped(&rule, 1);
    conn.close().expect("close");
}
