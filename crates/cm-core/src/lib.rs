//! Domain types and backend traits for the RDMA connection manager's notify path.
//!
//! When a passive side has accepted a connection (REP sent) and data arrives before the
//! active side's RTU, the device raises `IBV_EVENT_COMM_EST`; forwarding it with
//! `rdma_notify` forces the connection to ESTABLISHED. This crate holds everything about
//! that path that needs no I/O, no FFI and no clock:
//!
//! - the ABI enums, decoded totally ([`AsyncEventType`], [`CmEventType`], [`IbCmState`],
//!   [`CmIdState`]): unknown numbers become `Unknown(n)`, never undefined behaviour;
//! - the notify contract ([`NotifyOutcome`], [`NotifyError`], [`notify_result_from_errno`]):
//!   EISCONN is success;
//! - the kernel's notify table as a pure function ([`kernel_model::ib_cm_notify`]);
//! - the routing policy ([`RoutingPolicy`]): which async events go to the CM;
//! - the backend traits ([`CmId`], [`CmEvent`], [`CmEventSource`], [`AsyncEventSource`],
//!   [`CmBackend`]) implemented by the real backend (`cm-sys`) and the simulated fabric
//!   (`cm-mock`).
//!
//! ```
//! use cm_core::{notify_result_from_errno, errno, AsyncEvent, AsyncEventType, NotifyOutcome,
//!               QpNum, Route, RoutingPolicy};
//!
//! // A COMM_EST on QP 0x11 goes to the CM; a CQ error stays with the application.
//! let comm_est = AsyncEvent::qp(AsyncEventType::CommEst, QpNum(0x11));
//! assert_eq!(
//!     RoutingPolicy::default().route(&comm_est),
//!     Route::Notify { qp: QpNum(0x11), event: AsyncEventType::CommEst }
//! );
//! // rdma_notify failing with EISCONN means the RTU won the race: success.
//! assert_eq!(notify_result_from_errno(errno::EISCONN), Ok(NotifyOutcome::AlreadyEstablished));
//! assert_eq!(AsyncEventType::from_raw(4).to_string(), "communication established");
//! ```
#![forbid(unsafe_code)]

mod backend;
mod cm_event;
mod completion;
mod conn_params;
pub mod decode;
mod error;
mod event;
mod id_options;
pub mod kernel_model;
mod routing;
mod state;
mod transport;

use core::fmt;

pub use backend::{AsyncEventSource, CmBackend, CmEvent, CmEventSource, CmId, DeviceTransport};
pub use cm_event::CmEventType;
pub use completion::{WcOpcode, WcStatus};
pub use conn_params::ConnectionParams;
pub use error::{errno, notify_result_from_errno, CmError, Errno, NotifyError, NotifyOutcome};
pub use event::{AsyncEvent, AsyncEventType, EventElement, EventObject};
pub use id_options::{IdOption, IdOptions, PortSpace};
pub use routing::{Route, RoutingPolicy};
pub use state::{CmIdState, IbCmState};
pub use transport::{
    CqKind, QueueCaps, RejectReason, SharedCaps, Transport, WorkCompletion, MAX_READY_QPS,
};

/// A queue pair number (24 bits on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QpNum(pub u32);

impl fmt::Display for QpNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QP {:#x}", self.0)
    }
}
