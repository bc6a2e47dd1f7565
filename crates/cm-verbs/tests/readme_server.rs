//! The server of the README and the crate docs (`examples/server.rs`), run as written on
//! the real kernel (soft-RoCE in the VM) against a client whose RTUs nftables drops.
//! Without a device it records a skip.
#![cfg(feature = "rdma")]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use cm_testkit::{addresses, CmMadRule};

#[allow(dead_code)]
#[path = "../examples/server.rs"]
mod example;

#[test]
fn the_readme_shows_the_example_as_it_is() {
    let readme = include_str!("../README.md");
    assert!(readme.contains(include_str!("../examples/server.rs")));
    assert!(include_str!("../examples/server.rs").lines().count() <= 25);
}

#[test]
fn the_readme_server_rescues_a_lost_rtu() {
    const TEST: &str = "the_readme_server_rescues_a_lost_rtu";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some(rule) = CmMadRule::drop_rtus(TEST, "readme_rtu", addrs.addr_a) else {
        return;
    };
    let addr = SocketAddr::new(addrs.addr_a, 7515);
    let server = std::thread::spawn(move || example::serve(addr, 1));
    let mut client = common::endpoint();
    let wait = Some(Duration::from_secs(30));
    // The server may not listen yet: retry a refused connect for a while.
    let mut attempts = 0;
    let conn = loop {
        let conn = client
            .connect(addr, common::from(addrs.addr_b))
            .expect("connect");
        match client.established(conn, wait) {
            Ok(_) => break conn,
            Err(e) if attempts < 50 => {
                attempts += 1;
                eprintln!("connect attempt {attempts}: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("connect: {e}"),
        }
    };
    client.send(conn, b"readme").expect("send");
    assert_eq!(client.recv(conn, wait).expect("echo"), b"readme");
    // The server echoes until the client leaves.
    client.disconnect(conn).expect("disconnect");
    server.join().expect("server thread").expect("serve");
    assert!(rule.hits().expect("counter") >= 1, "the RTU was dropped");
}
