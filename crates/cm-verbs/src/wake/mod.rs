//! The two lock-free wake protocols of the crate, each a few atomics, written once and
//! model-checked with loom (`cargo xtask ci` runs the models: `--cfg cm_loom`, see
//! CONTRIBUTING.md):
//!
//! - [`LockGate`]: calls that want the handles' lock, and the thread driver that holds
//!   it while it waits in the transport (`poll(2)`); a call that comes while the driver
//!   waits ends the wait, so it never waits for the lock forever.
//! - [`WakeFlag`]: the coalescing of wake-up requests into one byte on the wake-up
//!   socket; no request is lost, however they interleave with the waiter's drain.
//!
//! The mailbox of a device's asynchronous events (`crate::device_events`), filled by
//! another endpoint under the hub's lock, flagged for its owner's lock-free look and
//! woken through a [`WakeFlag`], is modelled with them: no event routed to an endpoint
//! is missed, however the routing interleaves with its wait.
//!
//! What the rest of the handles do (a call registering its waker, the driver routing
//! news, a call's registration removed when it ends) happens under one mutex and is
//! tested deterministically instead.

mod gate;
#[cfg(any(feature = "rdma", all(test, cm_loom)))]
mod wake_flag;

#[cfg(all(test, cm_loom))]
mod models;

pub(crate) use gate::LockGate;
#[cfg(any(feature = "rdma", all(test, cm_loom)))]
pub(crate) use wake_flag::WakeFlag;

/// The atomics: std's, or loom's when the models run.
pub(crate) mod sync {
    #[cfg(cm_loom)]
    pub(crate) use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    #[cfg(not(cm_loom))]
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
}
