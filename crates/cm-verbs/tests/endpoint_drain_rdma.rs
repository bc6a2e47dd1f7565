//! Graceful close on the real kernel (soft-RoCE in the VM): a client sends a burst to a
//! slow reader and closes at once. The reader has queues of its own and a receive
//! depth of 2, so most of the burst waits in the client's send queue, retried on RNR.
//! With `close_gracefully` every message is delivered, then the server sees the
//! disconnect; with the forced close (`disconnect`) `rdma_disconnect` moves the QP to
//! the error state, which flushes what had not been delivered: fewer arrive. Without a
//! device the test records a skip.
#![cfg(feature = "rdma")]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use cm_testkit::{addresses, report};
use cm_verbs::{CloseReason, ConnError, ListenOptions, QueueCaps};

const BURST: usize = 16;
const SIZE: usize = 4096;

/// A client on its own thread sends [`BURST`] messages of [`SIZE`] bytes to `to` and
/// closes, gracefully or not, then runs until the connection is gone.
fn burst_then_close(src: IpAddr, to: SocketAddr, graceful: bool) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut client = common::endpoint();
        let conn = client.connect(to, common::from(src)).expect("connect");
        client
            .established(conn, common::WAIT)
            .expect("client established");
        for n in 0..BURST {
            client.send(conn, &[n as u8; SIZE]).expect("send");
        }
        if graceful {
            client.close_gracefully(conn).expect("close");
        } else {
            client.disconnect(conn).expect("disconnect");
        }
        let until = Instant::now() + Duration::from_secs(30);
        while client.stats().connections > 0 {
            assert!(Instant::now() < until, "the close never completed");
            match client.next_event(Some(Duration::from_millis(10))) {
                Ok(_) | Err(ConnError::Timeout) => {}
                Err(error) => panic!("client: {error}"),
            }
        }
    })
}

/// Accepts one connection and counts the messages it delivers before its close,
/// reading slowly.
fn count_until_closed(server: &mut cm_verbs::Endpoint<cm_verbs::rdma::RdmaTransport>) -> usize {
    let conn = server.accept(common::WAIT).expect("accept");
    let mut got = 0;
    loop {
        std::thread::sleep(Duration::from_millis(20));
        match server.recv(conn, common::WAIT) {
            Ok(data) => {
                assert_eq!(data, vec![got as u8; SIZE], "in order");
                got += 1;
            }
            Err(ConnError::Closed {
                reason: CloseReason::Disconnected,
                ..
            }) => return got,
            Err(error) => panic!("server: {error}"),
        }
    }
}

#[test]
fn a_graceful_close_delivers_the_burst_sent_before_it() {
    const TEST: &str = "a_graceful_close_delivers_the_burst_sent_before_it";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let mut server = common::endpoint_own_queues();
    let listen = SocketAddr::new(addrs.addr_a, 7524);
    let options = ListenOptions {
        caps: QueueCaps {
            recv_depth: 2,
            ..QueueCaps::default()
        },
        ..ListenOptions::default()
    };
    server.listen(listen, options).expect("listen");
    let mut delivered = Vec::new();
    for graceful in [true, false] {
        let client = burst_then_close(addrs.addr_b, listen, graceful);
        delivered.push(count_until_closed(&mut server));
        client.join().expect("the client thread");
    }
    report(&format!(
        "{TEST}: {BURST} messages of {SIZE} B then a close: {} delivered with close_gracefully, {} with disconnect",
        delivered[0], delivered[1]
    ));
    assert_eq!(delivered[0], BURST);
    assert!(delivered[1] < BURST, "the forced close lost what waited");
}
