//! Wake-up requests coalesced into one byte on a socket: a request writes a byte only
//! if none is pending, so the socket never fills and a request never blocks.
//!
//! The waiter empties the socket first and settles the flag after. The other order
//! loses wake-ups: a request between the settle and the read would see the flag clear,
//! write its byte and set the flag; the read would take the byte, and the flag would
//! stay set with the socket empty, so every later request would be coalesced into a
//! wake-up that never comes (the intermittent hang of an endpoint's driver, found on
//! the real kernel; the loom model `a_request_during_the_drain_is_never_lost` fails on
//! that order). In this order a request during the drain is folded into the wake-up
//! under way (the waiter has not looked at anything yet), and a byte written after the
//! read is seen by the next wait.

use super::sync::{AtomicBool, Ordering};

/// Whether a wake-up byte is pending.
#[derive(Debug)]
pub(crate) struct WakeFlag {
    pending: AtomicBool,
}

impl WakeFlag {
    /// No request pending.
    pub(crate) fn new() -> Self {
        WakeFlag {
            pending: AtomicBool::new(false),
        }
    }

    /// A request: whether it must write the byte (no other request's byte is pending).
    pub(crate) fn request(&self) -> bool {
        !self.pending.swap(true, Ordering::AcqRel)
    }

    /// Whether a request is pending (for tests).
    #[cfg(all(test, feature = "rdma"))]
    pub(crate) fn is_pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// The waiter has emptied the socket: whether a request was pending. Call it only
    /// after the socket's read (see the module's documentation).
    pub(crate) fn settle(&self) -> bool {
        self.pending.swap(false, Ordering::AcqRel)
    }
}
