//! API misuse on the real backend. Most of it cannot be written at all: the types rule
//! it out, which the first test pins down (it fails to compile if a signature loosens).
//! The rest needs an RDMA device (soft-RoCE in the test VM: `cargo xtask vm`); without
//! one those tests record a skip per the project's protocol and return.
//!
//! | misuse                                   | on cm-sys                                            |
//! |------------------------------------------|------------------------------------------------------|
//! | acknowledge an event twice               | impossible: `CmEvent::ack(self)` consumes the event  |
//! | use an event after acknowledging it      | impossible: same                                     |
//! | notify / ack on a destroyed id           | impossible: an id is destroyed with its last handle, |
//! |                                          | and every event holds its id                         |
//! | use an event after its channel is gone   | impossible: the event's id holds the channel         |
//! | migrate to a closed channel              | impossible: `migrate` borrows a live `EventChannel`  |
//! | migrate with an unacknowledged event     | refused: `CmError::UnackedEvents` (device.rs)        |
//! | notify with any event number, any state  | a typed `NotifyError`, errno kept                    |

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use cm_core::{AsyncEventType, CmError, CmEventType, NotifyError, NotifyOutcome};
use cm_sys::{CmEvent, CmId, EventChannel};

const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

#[test]
fn misuse_the_types_rule_out_stays_ruled_out() {
    // Acknowledging consumes the event: no second ack, no use after the ack.
    let _ack: fn(CmEvent) -> Result<(), CmError> = CmEvent::ack;
    let _trait_ack: fn(CmEvent) -> Result<(), CmError> = <CmEvent as cm_core::CmEvent>::ack;
    // An event lends its id; the id cannot outlive the borrow without a clone that
    // keeps it alive.
    let _id: for<'a> fn(&'a CmEvent) -> Option<&'a CmId> = CmEvent::id;
    // Migration and id creation borrow a live channel: a closed one cannot be named.
    // Migration borrows the id mutably: no other thread can notify through this handle
    // meanwhile (other handles are refused at run time).
    let _migrate: fn(&mut CmId, &EventChannel) -> Result<(), CmError> = CmId::migrate;
    let _create: fn(&EventChannel) -> Result<CmId, CmError> = EventChannel::create_id;
    // notify answers the notify contract, never a panic or a raw integer.
    let _notify: fn(&CmId, AsyncEventType) -> Result<NotifyOutcome, NotifyError> = CmId::notify;
    // Events and ids move to the thread that handles them (the pump's thread).
    fn send<T: Send>() {}
    send::<CmEvent>();
    send::<CmId>();
}

/// The two test addresses, or `None` after recording a skip.
fn setup(test: &str) -> Option<(IpAddr, IpAddr)> {
    cm_testkit::addresses(test).map(|a| (a.addr_a, a.addr_b))
}

/// A listener on `a`, and an id on `channel` resolving from `b` to it, with its
/// (unacknowledged) ADDR_RESOLVED event. ADDR_ERROR right after boot is retried.
fn resolved(channel: &EventChannel, a: IpAddr, b: IpAddr) -> (CmId, CmId, CmEvent) {
    let listen_channel = EventChannel::new().expect("channel");
    let listener = listen_channel.create_id().expect("listener");
    listener.bind_addr(SocketAddr::new(a, 0)).expect("bind");
    listener.listen(4).expect("listen");
    let target = listener.local_addr().expect("listener address");
    for _ in 0..5 {
        let id = channel.create_id().expect("id");
        id.resolve_addr(Some(SocketAddr::new(b, 0)), target, RESOLVE_TIMEOUT)
            .expect("resolve_addr");
        let event = channel
            .next_event_timeout(RESOLVE_TIMEOUT * 2)
            .expect("rdma_get_cm_event")
            .expect("an address resolution event");
        if event.event_type() == CmEventType::AddrResolved {
            return (listener, id, event);
        }
        assert_eq!(event.event_type(), CmEventType::AddrError);
    }
    panic!("address resolution kept failing");
}

#[test]
fn an_unacknowledged_event_keeps_its_id_and_channel_usable() {
    let test = "an_unacknowledged_event_keeps_its_id_and_channel_usable";
    let Some((a, b)) = setup(test) else { return };
    let channel = EventChannel::new().expect("channel");
    let (_listener, id, event) = resolved(&channel, a, b);
    // The application lets go of its handles while the event is out: nothing is
    // destroyed under the event.
    drop(id);
    drop(channel);
    let id = event.id().expect("ADDR_RESOLVED names its id");
    assert_eq!(id.unacked_events(), 1);
    assert_eq!(
        id.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
    let elsewhere = EventChannel::new().expect("channel");
    match id.clone().migrate(&elsewhere) {
        Err(CmError::UnackedEvents { unacked: 1, .. }) => {}
        other => panic!("migrate with an unacknowledged event: {other:?}"),
    }
    // The last handle of the id goes with the acknowledgement, which must not hang.
    event.ack().expect("ack");
}

#[test]
fn notify_with_any_event_number_on_a_non_connecting_id_is_wrong_state() {
    let test = "notify_with_any_event_number_on_a_non_connecting_id_is_wrong_state";
    let Some((a, b)) = setup(test) else { return };
    let channel = EventChannel::new().expect("channel");
    let (_listener, id, event) = resolved(&channel, a, b);
    event.ack().expect("ack");
    for raw in [0, 4, 6, 11, 20, 21, 0x7fff_ffff, u32::MAX] {
        let event = AsyncEventType::from_raw(raw);
        assert_eq!(
            id.notify(event),
            Err(NotifyError::WrongState),
            "notify({event}) on an id that is not connecting"
        );
    }
}
