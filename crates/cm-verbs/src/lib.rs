//! The notify pump and event loop: verbs asynchronous events forwarded to the RDMA CM
//! automatically, so that every connection is reported ESTABLISHED exactly once even
//! when the RTU is late or lost.
//!
//! - [`NotifyPump`] maps QP numbers to CM ids, forwards `IBV_EVENT_COMM_EST` with
//!   `notify`, and treats a receive completion on a not-yet-established passive
//!   connection as the same trigger (soft-RoCE never raises COMM_EST). Every outcome is
//!   a typed [`PumpEvent`]; nothing is swallowed.
//! - [`EventLoop`] waits on the CM event channel and the device's asynchronous events,
//!   runs the pump and hands CM events to the application in order.
//!
//! Generic over the `cm-core` traits: it runs on the real backend (`cm-sys`) and on the
//! simulated fabric (`cm-mock`) alike.
#![forbid(unsafe_code)]

mod event_loop;
mod pump;

pub use event_loop::{Control, EventLoop, Exit, LoopEvent, Ready, Waiter};
pub use pump::{NotifyPump, Progress, PumpCounters, PumpEvent, RegisterError, Role, Trigger};
