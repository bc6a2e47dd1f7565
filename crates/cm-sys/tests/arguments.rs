//! No public call panics on any argument: the extremes of every length, count and
//! timeout, on a real device (soft-RoCE in the test VM: `cargo xtask vm`). Without a
//! device every test records a skip and returns.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use cm_core::{CmError, CmEventType};
use cm_sys::{ConnParams, CqKind, EventChannel, QpCaps};
use common::{addresses, listener_on, resolved_to};

#[test]
fn the_longest_timeout_waits_for_the_event_instead_of_panicking() {
    let Some(setup) = addresses("the_longest_timeout_waits_for_the_event_instead_of_panicking")
    else {
        return;
    };
    let listen_channel = EventChannel::new().expect("channel");
    let listener = listener_on(&listen_channel, setup.addr_a, 4);
    let target = listener.local_addr().expect("listener address");
    let channel = EventChannel::new().expect("channel");
    let id = channel.create_id().expect("id");
    // librdmacm's timeout saturates; the resolution answers long before it.
    id.resolve_addr(
        Some(SocketAddr::new(setup.addr_b, 0)),
        target,
        Duration::MAX,
    )
    .expect("resolve_addr");
    let event = channel
        .next_event_timeout(Duration::MAX)
        .expect("read")
        .expect("an unbounded wait ends with an event");
    assert!(
        matches!(
            event.event_type(),
            CmEventType::AddrResolved | CmEventType::AddrError
        ),
        "{event:?}"
    );
    event.ack().expect("ack");
    let device = listener.async_events().expect("async events");
    // Nothing pending: the zero wait answers at once, in either mode.
    assert_eq!(
        device.next_event_timeout(Duration::ZERO).expect("read"),
        None
    );
    device.set_nonblocking(true).expect("O_NONBLOCK");
    assert!(device.is_nonblocking().expect("mode"));
    assert_eq!(device.try_next_event().expect("read"), None);
    device.set_nonblocking(false).expect("blocking");
    assert!(!device.is_nonblocking().expect("mode"));
    assert_eq!(device.try_next_event().expect("read"), None);
}

#[test]
fn extreme_lengths_counts_and_backlogs_are_typed_answers() {
    let Some(setup) = addresses("extreme_lengths_counts_and_backlogs_are_typed_answers") else {
        return;
    };
    let channel = EventChannel::new().expect("channel");
    for backlog in [i32::MIN, -1, 0, i32::MAX] {
        let id = channel.create_id().expect("id");
        id.bind_addr(SocketAddr::new(setup.addr_a, 0))
            .expect("bind");
        // The kernel clamps the backlog: any value is an answer, never a panic.
        let _ = id.listen(backlog);
    }
    let listener = listener_on(&channel, setup.addr_a, 4);
    let client_channel = EventChannel::new().expect("channel");
    let id = resolved_to(&listener, &client_channel, setup.addr_b);
    // No allocation can have usize::MAX bytes: ENOMEM, not an abort.
    for len in [usize::MAX, isize::MAX as usize] {
        match id.register_memory(len) {
            Err(CmError::Os { errno, .. }) => assert_eq!(errno.0, libc::ENOMEM),
            other => panic!("register_memory({len}): {other:?}"),
        }
    }
    // Without a QP, polling and arming are refused.
    let mut out = Vec::new();
    assert!(matches!(
        id.poll_cq(CqKind::Recv, &mut out, usize::MAX),
        Err(CmError::InvalidArgument { .. })
    ));
    assert!(matches!(
        id.arm_cq(CqKind::Send),
        Err(CmError::InvalidArgument { .. })
    ));
    // Queue depths beyond a C int are refused before reaching the device.
    let cc = cm_sys::CompletionChannel::new(&id).expect("completion channel");
    let huge = QpCaps {
        max_send_wr: u32::MAX,
        ..QpCaps::default()
    };
    assert!(matches!(
        id.create_qp_on(&huge, &cc, 0),
        Err(CmError::InvalidArgument { .. })
    ));
    id.create_qp(&QpCaps::default()).expect("QP");
    // max 0: nothing; max usize::MAX: whatever is there (nothing), no panic.
    for max in [0, 1, usize::MAX] {
        assert_eq!(id.poll_cq(CqKind::Recv, &mut out, max).expect("poll"), 0);
        assert_eq!(id.poll_cq(CqKind::Send, &mut out, max).expect("poll"), 0);
        assert!(id.poll_send_cq(max).expect("poll").is_empty());
        assert!(id.poll_recv_cq(max).expect("poll").is_empty());
    }
    id.arm_cq(CqKind::Recv).expect("arm librdmacm's CQ");
    // Private data longer than the 8-bit length field: refused.
    let long = [0u8; 256];
    assert!(matches!(
        id.connect(&ConnParams {
            private_data: &long,
            ..ConnParams::default()
        }),
        Err(CmError::InvalidArgument { .. })
    ));
    assert!(matches!(
        id.reject(&long),
        Err(CmError::InvalidArgument { .. })
    ));
    let region = id.register_memory(16).expect("memory");
    assert!(matches!(
        id.write_memory(&region, usize::MAX, &[1, 2]),
        Err(CmError::InvalidArgument { .. })
    ));
    assert!(matches!(
        id.read_memory(&region, std::ops::Range { start: 8, end: 4 }),
        Err(CmError::InvalidArgument { .. })
    ));
    assert!(matches!(
        id.post_recv(&region, 0..usize::MAX, 1),
        Err(CmError::InvalidArgument { .. })
    ));
}
