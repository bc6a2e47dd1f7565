//! The tokio event loop on a real device: a passive side driven entirely by
//! `AsyncEventLoop::next` accepts a connection and sees it established and disconnected.
//! Runs inside the soft-RoCE VM; without a device it records a skip.
#![cfg(all(feature = "tokio", feature = "rdma"))]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use cm_core::{CmError, CmEventType};
use cm_sys::{ConnParams, EventChannel, QpCaps};
use cm_testkit::{addresses, skip};
use cm_verbs::async_loop::AsyncEventLoop;
use cm_verbs::{LoopEvent, NotifyPump, Role};

const WAIT: Duration = Duration::from_secs(20);
const PORT: u16 = 7499;

/// The active side, on its own thread with blocking calls: connect, wait for ESTABLISHED,
/// then answer the server's disconnect.
fn client(src: IpAddr, dst: SocketAddr) -> Result<(), CmError> {
    let channel = EventChannel::new()?;
    let id = loop {
        let id = channel.create_id()?;
        id.resolve_addr(Some(SocketAddr::new(src, 0)), dst, Duration::from_secs(2))?;
        let event = channel
            .next_event_timeout(WAIT)?
            .expect("an address resolution event");
        let resolved = event.event_type() == CmEventType::AddrResolved;
        event.ack()?;
        if resolved {
            break id;
        }
    };
    id.resolve_route(Duration::from_secs(2))?;
    let event = channel.next_event_timeout(WAIT)?.expect("ROUTE_RESOLVED");
    assert_eq!(event.event_type(), CmEventType::RouteResolved);
    event.ack()?;
    id.create_qp(&QpCaps::default())?;
    id.connect(&ConnParams::default())?;
    for expected in [CmEventType::Established, CmEventType::Disconnected] {
        let event = channel.next_event_timeout(WAIT)?.expect("a CM event");
        assert_eq!(event.event_type(), expected);
        event.ack()?;
    }
    id.disconnect()
}

#[test]
fn async_loop_accepts_and_sees_established_then_disconnected() {
    const TEST: &str = "async_loop_accepts_and_sees_established_then_disconnected";
    let channel = match EventChannel::new() {
        Ok(channel) => channel,
        Err(e) if e.is_no_device() => return skip(TEST, &e.to_string()),
        Err(e) => panic!("rdma_create_event_channel: {e}"),
    };
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let (addr_a, addr_b) = (addrs.addr_a, addrs.addr_b);
    let listener = channel.create_id().expect("rdma_create_id");
    listener
        .bind_addr(SocketAddr::new(addr_a, PORT))
        .expect("rdma_bind_addr");
    listener.listen(4).expect("rdma_listen");
    let device = listener.async_events().expect("the bound id has a device");

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .expect("a tokio runtime");
    let active = std::thread::spawn(move || client(addr_b, SocketAddr::new(addr_a, PORT)));
    let seen = runtime.block_on(async {
        let mut events =
            AsyncEventLoop::new(channel, device, NotifyPump::new()).expect("registered");
        let mut seen = Vec::new();
        let mut passive = None;
        while !seen.contains(&CmEventType::Disconnected) {
            let next = tokio::time::timeout(WAIT, events.next())
                .await
                .expect("an event within the bound")
                .expect("no loop error")
                .expect("the loop yields while its descriptors live");
            let LoopEvent::Cm(event) = next else {
                continue;
            };
            let kind = event.event_type();
            seen.push(kind);
            match kind {
                CmEventType::ConnectRequest => {
                    let id = event.id().expect("a request carries its id").clone();
                    event.ack().expect("ack");
                    id.create_qp(&QpCaps::default()).expect("rdma_create_qp");
                    id.accept(&ConnParams::default()).expect("rdma_accept");
                    events
                        .pump()
                        .register(id.clone(), Role::Passive)
                        .expect("a new QP registers");
                    passive = Some(id);
                }
                CmEventType::Established => {
                    event.ack().expect("ack");
                    passive
                        .as_ref()
                        .expect("accepted")
                        .disconnect()
                        .expect("rdma_disconnect");
                }
                _ => event.ack().expect("ack"),
            }
        }
        // The pump saw ESTABLISHED, then DISCONNECTED unregistered the connection.
        assert!(events.pump().is_empty());
        seen
    });
    active.join().expect("client thread").expect("client side");
    assert_eq!(
        seen,
        [
            CmEventType::ConnectRequest,
            CmEventType::Established,
            CmEventType::Disconnected
        ]
    );
}
