//! RDMA connections whose notify path needs no application code. An [`Endpoint`] owns
//! a CM event channel, one reader per device context and the notify pump: a COMM_EST,
//! or a receive completing on an accepted connection whose RTU is late or lost, is
//! forwarded with `rdma_notify` before the application hears of either, and each
//! connection is reported established exactly once, with how it got there
//! ([`EstablishedVia`]). It runs over any [`Transport`]: `rdma::RdmaTransport` (feature
//! `rdma`) or cm-mock's simulated fabric; `async_endpoint::AsyncEndpoint` is the
//! tokio flavour (feature `tokio`).
//!
//! # The server a user writes
//!
//! With the `rdma` feature (`examples/server.rs`; it runs on the real kernel in CI):
//!
#![cfg_attr(feature = "rdma", doc = "```no_run")]
#![cfg_attr(feature = "rdma", doc = include_str!("../examples/server.rs"))]
#![cfg_attr(feature = "rdma", doc = "```")]
//!
//! # What a running service sees
//!
//! - Each connection counts what its messages carried ([`ConnectionInfo::traffic`],
//!   [`Endpoint::traffic`]: messages and bytes each way, readable until its close is
//!   reported). RNR NAKs and transport retries, which verbs report only once exhausted
//!   (as the completion error that closes the connection), are counted per port by the
//!   device: with the `rdma` feature, `sys::CmId::port_counters` on a connection's id
//!   ([`Endpoint::cm_id`]).
//! - The setup path and every close are `tracing` events at debug level inside a `conn`
//!   span, each naming its connection; warnings (a queue that failed, a request refused
//!   because its setup failed) at warn. With no tracing subscriber in the process they
//!   reach a `log` logger (tracing's log bridge). Nothing is built for them unless a
//!   subscriber or logger wants debug.
//!
//! # Lower level
//!
//! For code that owns its loop (the endpoint is built on the pump; in this project the
//! real-device bench's pump path and the device tests drive these directly). A server
//! wants [`Endpoint`].
//!
//! - [`NotifyPump`] maps QP numbers to CM ids, forwards `IBV_EVENT_COMM_EST` with
//!   `notify`, and treats a receive completion on a not-yet-established passive
//!   connection as the same trigger (soft-RoCE never raises COMM_EST). Every outcome is
//!   a typed [`PumpEvent`]; nothing is swallowed.
//! - [`EventLoop`] waits on the CM event channel and the device's asynchronous events,
//!   runs the pump and hands CM events to the application in order.
//! - With the `rdma` feature, [`rdma::PollWaiter`] waits on real descriptors (`poll(2)`)
//!   and [`rdma::Shutdown`] stops a running loop from another thread.
//!
//! Generic over the `cm-core` traits: it runs on the real backend (`cm-sys`) and on the
//! simulated fabric (`cm-mock`) alike.
//!
//! ```
//! use cm_verbs::core::{AsyncEvent, AsyncEventType, CmEventType, CmId, NotifyError, NotifyOutcome, QpNum};
//! use cm_verbs::{NotifyPump, Progress, PumpEvent, Role, Trigger};
//!
//! /// Stands for an accepted id whose RTU is lost: the kernel forces it once, then EISCONN.
//! struct Accepted(std::cell::Cell<bool>);
//! impl CmId for Accepted {
//!     fn notify(&self, _: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
//!         Ok(if self.0.replace(true) { NotifyOutcome::AlreadyEstablished } else { NotifyOutcome::Established })
//!     }
//!     fn qp_num(&self) -> Option<QpNum> { Some(QpNum(0x2a)) }
//! }
//!
//! let mut pump = NotifyPump::new();
//! pump.register(Accepted(Default::default()), Role::Passive)?;
//! // soft-RoCE raises no COMM_EST: the first receive completion is the trigger.
//! assert_eq!(
//!     pump.on_receive_completion(QpNum(0x2a)),
//!     Some(PumpEvent::Forced { qp: QpNum(0x2a), trigger: Trigger::ReceiveCompletion })
//! );
//! // A COMM_EST raised later still reaches the CM, which answers EISCONN: harmless.
//! let late = pump.on_async_event(AsyncEvent::qp(AsyncEventType::CommEst, QpNum(0x2a)));
//! assert!(matches!(late, PumpEvent::AlreadyEstablished { .. }));
//! // The ESTABLISHED event the CM then delivers is fed back; the connection is settled.
//! pump.on_cm_event(CmEventType::Established, Some(QpNum(0x2a)));
//! assert_eq!(pump.progress(QpNum(0x2a)), Some(Progress::Established));
//! # Ok::<(), cm_verbs::RegisterError>(())
//! ```
#![forbid(unsafe_code)]

/// The domain types and backend traits the API names (`cm-core`), so that one dependency line is enough.
pub use cm_core as core;
pub use cm_core::{
    AsyncEvent, AsyncEventType, CmError, ConnectionParams, CqKind, NotifyError, NotifyOutcome,
    QpNum, QueueCaps, RejectReason, SharedCaps, Transport, WcStatus, WorkCompletion,
};
/// The simulated fabric (cm-mock's `sim`: `SimPair`, `SimTransport`, faults), with the
/// `sim` feature: test a server written against [`Endpoint`] with no device.
#[cfg(feature = "sim")]
pub use cm_mock::sim;
/// The real backend (`cm-sys`), with the `rdma` feature.
#[cfg(feature = "rdma")]
pub use cm_sys as sys;

#[cfg(feature = "tokio")]
pub mod async_endpoint;
#[cfg(all(feature = "tokio", feature = "rdma"))]
pub mod async_loop;
#[cfg(any(feature = "rdma", test))]
mod device_events;
mod endpoint;
mod event_loop;
pub mod handle;
mod pump;
mod qp_table;
#[cfg(feature = "rdma")]
pub mod rdma;
#[cfg(feature = "rdma")]
mod rdma_transport;
#[cfg(feature = "rdma")]
mod removal_retry;
mod tracing_gate;
mod wake;

pub use endpoint::{
    CloseReason, ConnError, ConnState, ConnTimes, ConnectOptions, ConnectionId, ConnectionInfo,
    Endpoint, EndpointOptions, EndpointStats, EndpointWaker, EstablishedVia, Event, ListenOptions,
    ListenerId, PrivateData, QpErrorDetail, Traffic, APPLICATION_WR_ID, CLOSED_BACKLOG,
    DEFERRED_DESTROY_MAX, ENDPOINT_EVENT_BACKLOG, FLUSH_GRACE, PASS_BATCH,
};
pub use event_loop::{BackendLoop, Control, EventLoop, Exit, LoopEvent, Ready, Waiter};
pub use pump::{
    notify_failure_is_final, NotifyPump, Progress, PumpCounters, PumpEvent, RegisterError,
    Registration, Role, Trigger, EARLY_TRIGGERS,
};
