//! Reading events races the id's accessors (soft-RoCE in the test VM: `cargo xtask vm`).
//!
//! `rdma_get_cm_event` writes the fields of the id an event is about (address and
//! route, device context, protection domain) while another thread may read them through
//! the id's accessors. One thread resolves ids and reads their events; another calls
//! the accessors in a loop and checks what they see is consistent: once the id is bound
//! to a device (`device_key`), its protection domain is there too (`register_memory`,
//! `create_qp` succeed). Without a device the test records a skip and returns.
//!
//! Under ThreadSanitizer (nightly, with the standard library rebuilt instrumented):
//! `RUSTFLAGS=-Zsanitizer=thread cargo +nightly test -Zbuild-std
//! --target x86_64-unknown-linux-gnu -p cm-sys --test fields_race`. librdmacm itself is
//! not instrumented: TSan checks this crate's side of the locking (the Rust reads and
//! every lock), not the C library's writes.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cm_core::CmEventType;
use cm_sys::{CmId, EventChannel, QpCaps};
use common::{addresses, listener_on, RESOLVE_TIMEOUT, WAIT};

/// Ids resolved one after the other while the accessor thread runs.
const ROUNDS: usize = 40;

/// What the accessor thread checks on one id, once: after it saw the id on a device.
fn check_bound(id: &CmId) {
    let key = id.device_key().expect("bound");
    let region = id.register_memory(8);
    assert!(region.is_ok(), "bound to {key:?} but no PD: {region:?}");
    let events = id.async_events().expect("async events of a bound id");
    assert_eq!(events.device_key(), key);
    let qp = id.create_qp(&QpCaps::default());
    assert!(qp.is_ok(), "bound to {key:?} but no QP: {qp:?}");
}

#[test]
fn event_reads_and_id_accessors_do_not_race() {
    let Some(setup) = addresses("event_reads_and_id_accessors_do_not_race") else {
        return;
    };
    let listen_channel = EventChannel::new().expect("channel");
    let listener = listener_on(&listen_channel, setup.addr_a, 4);
    let target = listener.local_addr().expect("listener address");
    let channel = EventChannel::new().expect("channel");

    let current: Arc<Mutex<Option<CmId>>> = Arc::new(Mutex::new(None));
    let stop = Arc::new(AtomicBool::new(false));
    let looks = Arc::new(AtomicUsize::new(0));
    let bound_seen = Arc::new(AtomicUsize::new(0));
    let accessor = {
        let (current, stop, looks, bound_seen) = (
            Arc::clone(&current),
            Arc::clone(&stop),
            Arc::clone(&looks),
            Arc::clone(&bound_seen),
        );
        std::thread::spawn(move || {
            let mut checked: Option<CmId> = None;
            while !stop.load(Ordering::Acquire) {
                let Some(id) = current.lock().unwrap().clone() else {
                    std::thread::yield_now();
                    continue;
                };
                let _ = id.local_addr();
                let _ = id.peer_addr();
                if id.device_key().is_some() && checked.as_ref() != Some(&id) {
                    check_bound(&id);
                    bound_seen.fetch_add(1, Ordering::AcqRel);
                    checked = Some(id);
                }
                looks.fetch_add(1, Ordering::AcqRel);
            }
        })
    };

    for round in 0..ROUNDS {
        let id = channel.create_id().expect("id");
        *current.lock().unwrap() = Some(id.clone());
        id.resolve_addr(
            Some(SocketAddr::new(setup.addr_b, 0)),
            target,
            RESOLVE_TIMEOUT,
        )
        .expect("resolve_addr");
        let event = channel
            .next_event_timeout(WAIT)
            .expect("read")
            .unwrap_or_else(|| panic!("round {round}: no address event"));
        if event.event_type() != CmEventType::AddrResolved {
            // The first resolution after boot can time out: next round.
            assert_eq!(event.event_type(), CmEventType::AddrError, "{event:?}");
            continue;
        }
        event.ack().expect("ack");
        id.resolve_route(RESOLVE_TIMEOUT).expect("resolve_route");
        let event = channel
            .next_event_timeout(WAIT)
            .expect("read")
            .unwrap_or_else(|| panic!("round {round}: no route event"));
        assert_eq!(event.event_type(), CmEventType::RouteResolved, "{event:?}");
        event.ack().expect("ack");
        assert_eq!(id.peer_addr(), Some(target));
    }
    stop.store(true, Ordering::Release);
    accessor.join().expect("the accessor thread's checks");
    assert!(looks.load(Ordering::Acquire) > 0);
    assert!(
        bound_seen.load(Ordering::Acquire) > 0,
        "the accessor thread never saw a bound id"
    );
}
