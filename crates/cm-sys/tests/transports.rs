//! Where the kernel's answers depend on the device's transport (docs/notify-semantics.md,
//! "iWARP"): each test reads the transport of the devices it runs on and checks that
//! transport's answers. The VM runs them on soft-RoCE (InfiniBand's CM) and, after
//! `rdma-devices siw`, on soft-iWARP. Without a device each records a skip.
//!
//! iWARP sets a connection up with the MPA exchange over TCP: there is no RTU to lose,
//! and the kernel's `rdma_notify` passes the event to the IB CM only for InfiniBand
//! channel adapters (RoCE's node type too); for an iWARP id it answers 0 and does nothing.

mod common;

use std::time::Duration;

use cm_core::{AsyncEventType, CmEventType, DeviceTransport, NotifyError, NotifyOutcome};
use cm_core::{RejectReason, WcStatus};
use cm_sys::{CmId, ConnParams, EventChannel, QpCaps};
use common::{addresses, event_within, expect_event, report, wait_completion, Addresses};

/// [`common::requested`], accepted with one receive posted on the server's side, ESTABLISHED
/// read on both sides.
fn connected(addrs: &Addresses) -> (EventChannel, CmId, CmId, EventChannel, CmId) {
    let (server_channel, listener, server, client_channel, client) = common::requested(addrs);
    server.create_qp(&QpCaps::default()).expect("server QP");
    let memory = server.register_memory(64).expect("server memory");
    server.post_recv(&memory, 0..64, 1).expect("post_recv");
    server.accept(&ConnParams::default()).expect("accept");
    // On iWARP the passive side is established by the MPA exchange alone: no data, no
    // notify.
    common::expect_established(&server_channel, &client_channel);
    (server_channel, listener, server, client_channel, client)
}

#[test]
fn notify_answers_as_the_devices_transport_says() {
    const TEST: &str = "notify_answers_as_the_devices_transport_says";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    // A fresh id has no transport CM id yet: EINVAL on every transport.
    let channel = EventChannel::new().expect("channel");
    let fresh = channel.create_id().expect("id");
    assert_eq!(fresh.transport(), None, "not bound to a device yet");
    assert_eq!(
        fresh.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );

    let (server_channel, listener, server, client_channel, client) = connected(&addrs);
    let transport = server.transport().expect("bound to a device");
    assert_eq!(listener.transport(), Some(transport));
    assert_eq!(
        transport == DeviceTransport::Iwarp,
        cm_testkit::iwarp(),
        "the id's transport and the device's node type agree"
    );
    assert_eq!(
        cm_core::CmId::notify_forces(&server),
        transport == DeviceTransport::InfiniBand
    );
    if transport == DeviceTransport::InfiniBand {
        // Measured in device.rs and the conformance suite; the contrast here.
        assert_eq!(
            listener.notify(AsyncEventType::CommEst),
            Err(NotifyError::WrongState)
        );
        assert_eq!(
            server.notify(AsyncEventType::CommEst),
            Ok(NotifyOutcome::AlreadyEstablished)
        );
        client.disconnect().expect("disconnect");
        expect_event(&server_channel, CmEventType::Disconnected)
            .ack()
            .expect("ack");
        report(&format!(
            "{TEST}: {transport:?}: notify EINVAL on a listener, EISCONN once established"
        ));
        return;
    }
    // Where InfiniBand answers EINVAL (a listener, the active side) or EISCONN (an
    // established id), iWARP answers 0 for every event: nothing was forced.
    for (who, id) in [
        ("listener", &listener),
        ("server", &server),
        ("client", &client),
    ] {
        for event in [AsyncEventType::CommEst, AsyncEventType::PathMig] {
            assert_eq!(
                id.notify(event),
                Ok(NotifyOutcome::Established),
                "{who}: notify({event})"
            );
        }
    }
    // ... and no second ESTABLISHED follows.
    for (who, channel) in [("server", &server_channel), ("client", &client_channel)] {
        let next = event_within(channel, Duration::from_millis(500));
        assert!(
            next.is_none(),
            "{who}: nothing after a notify, got {:?}",
            next.map(|e| e.event_type())
        );
    }

    // The client's orderly close: the server's posted receive flushes and DISCONNECTED
    // comes (their order is the kernel's: recorded, not assumed).
    client.disconnect().expect("disconnect");
    let flushed = wait_completion("the flushed receive", || server.poll_recv_cq(4));
    assert_eq!(flushed.status, WcStatus::WrFlushErr);
    expect_event(&server_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::Established),
        "after the disconnect"
    );
    report(&format!(
        "{TEST}: iWARP: notify answers 0 on a listener, both sides and after DISCONNECTED \
         (EINVAL on a fresh id); no ESTABLISHED follows; the peer's close flushed the \
         server's receive"
    ));
}

#[test]
fn a_reject_reads_as_the_peer_applications_with_its_private_data() {
    const TEST: &str = "a_reject_reads_as_the_peer_applications_with_its_private_data";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let (_server_channel, _listener, refused, client_channel, _client) = common::requested(&addrs);
    refused.reject(b"full, retry later").expect("reject");
    // (Not `expect_event`: that wants status 0.)
    let rejected = event_within(&client_channel, common::WAIT).expect("REJECTED");
    assert_eq!(rejected.event_type(), CmEventType::Rejected);
    let status = rejected.status();
    // The IB CM's consumer reason (28); on iWARP the MPA reject's -ECONNRESET.
    let expected = if cm_testkit::iwarp() { -104 } else { 28 };
    assert_eq!(status, expected, "REJECTED's status");
    assert_eq!(RejectReason::from_status(status), RejectReason::Consumer);
    assert!(
        rejected.private_data().starts_with(b"full, retry later"),
        "{:?}",
        rejected.private_data()
    );
    rejected.ack().expect("ack");
    report(&format!(
        "{TEST}: REJECTED status {status} with the peer's private data"
    ));
}
