//! `cmnotify`, the command-line tool of the notify path, and the library behind it.
//!
//! [`sim_run::run`] plays a server and a client on the simulated fabric, both the real
//! mode's own ([`session`]: one `cm_verbs::Endpoint` each, over the simulated transport
//! instead of librdmacm), and reports how every connection became established (by RTU,
//! or rescued by notify) or failed:
//!
//! ```
//! use cm_tools::sim_run::{run, SimRun};
//!
//! // Every RTU is lost; the client sends at once; the pump forwards COMM_EST.
//! let report = run(&SimRun { connections: 10, rtu_loss: 1.0, ..SimRun::default() });
//! assert_eq!(report.established(), 10);
//! assert_eq!(report.forced(), 10);
//! assert_eq!(report.invariant_violations(), 0);
//!
//! // The same without the pump: every server side ends UNREACHABLE.
//! let report = run(&SimRun { connections: 10, rtu_loss: 1.0, pump: false, ..SimRun::default() });
//! assert_eq!(report.unreachable(), 10);
//! ```
//!
//! [`ladder`] draws one traced connection as a ladder diagram (SVG, or text).
//!
//! With the `rdma` feature, `rdma_run` runs the same server or client on real devices
//! through librdmacm, ucmatose-style (server with `-s`, client with `-a`), with cmtime-style
//! per-step timings.
#![forbid(unsafe_code)]

pub mod ladder;
#[cfg(feature = "rdma")]
pub mod rdma_run;
pub mod report;
pub mod session;
pub mod sim_run;
pub mod stats;
pub mod steps;
