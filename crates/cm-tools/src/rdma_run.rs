//! `cmnotify --backend rdma`: real connections through librdmacm, in the style of
//! rdma-core's `ucmatose`, timed per step like `cmtime`, written on the connection API
//! only: one [`cm_verbs::Endpoint`] over [`cm_verbs::rdma::RdmaTransport`] owns the CM
//! channel, the device readers, the notify pump and every connection, and the run is a
//! `match` on the events [`Endpoint::next_event`](cm_verbs::Endpoint::next_event) yields.
//! The server and the client are [`crate::session`]'s, the same code the simulated mode
//! runs over its fabric.
//!
//! - Server (`-s`): listens on `-b`, accepts `-c` connections (refuses any beyond),
//!   one QP each, receives posted before the REP. The endpoint forwards COMM_EST and a
//!   receive completing on a connection not yet established with `rdma_notify` (unless
//!   `--no-pump`). With `-C 0` (the default) it echoes every message it receives and lets
//!   the client disconnect (rping clients, cmnotify clients); with `-C N` it behaves
//!   like a ucmatose server: sends N messages once a connection is established, waits
//!   for N back (and its own to complete), then disconnects.
//! - Client (`-a`): `-c` connections from `-b`, each resolved, connected, sending `-C`
//!   messages (default 1) of `-S` bytes once established; once its messages are sent
//!   and as many have come back, it disconnects. `-C 0` connects, establishes and
//!   disconnects without data (what an `rping -s` server accepts without the RDMA
//!   READ/WRITE protocol). An address resolution that fails is retried on a new
//!   connection (up to 5 attempts).
//!
//! Nothing waits forever once a connection exists: connect and establish have the
//! endpoint's deadlines, and an established connection without progress for 30 s is
//! given up. When the device goes away (or fails), the run stops, tears everything down
//! and reports it.

mod report;
mod session;
mod shards;

use std::net::IpAddr;
use std::process::ExitCode;
use std::time::Duration;

pub use crate::steps::{Span, Step, StepStats};
pub use report::{human, PumpJson, RealReport};
pub use session::run;
pub use shards::MAX_ENDPOINTS;

/// What a real-device run does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RealRun {
    /// Passive side (listen and accept) instead of the client.
    pub server: bool,
    /// Server: the address to listen on (any address when `None`). Client: the source
    /// address.
    pub bind: Option<IpAddr>,
    /// Client: the server's address.
    pub address: Option<IpAddr>,
    /// The server's port.
    pub port: u16,
    /// Connections to open (client) or accept (server).
    pub connections: u32,
    /// Whether the notify pump runs.
    pub pump: bool,
    /// Print JSON instead of the human summary.
    pub json: bool,
    /// Messages each side sends per connection (see the module documentation); `None`:
    /// 1 for the client, 0 (echo) for the server.
    pub messages: Option<u32>,
    /// Bytes per message the run sends first (echoes copy what they received).
    pub message_size: usize,
    /// Where to write the first connection's endpoint timeline on CLOCK_MONOTONIC
    /// (`--timeline`, for [`crate::ladder::kernel`]).
    pub timeline: Option<std::path::PathBuf>,
    /// Each connection with queues and buffers of its own (`--own-queues`) instead of
    /// its device's shared queues.
    pub own_queues: bool,
    /// QPs made ahead of requests on each device's shared queues (`--ready-qps`;
    /// `None`: the default).
    pub ready_qps: Option<u32>,
    /// `rdma_set_option` choices (`--tos`, `--ack-timeout`).
    pub id_options: cm_verbs::core::IdOptions,
    /// Endpoints, each driven by its own thread (`--endpoints`): endpoint `i` listens on
    /// (server) or connects to (client) port `port + i`, with its share of the
    /// connections.
    pub endpoints: u32,
}

impl Default for RealRun {
    /// A client of one connection to 127.0.0.1:7471 sending one 100-byte message.
    fn default() -> Self {
        RealRun {
            server: false,
            bind: None,
            address: None,
            port: 7471,
            connections: 1,
            pump: true,
            json: false,
            messages: None,
            message_size: DEFAULT_MESSAGE_SIZE,
            timeline: None,
            own_queues: false,
            ready_qps: None,
            id_options: cm_verbs::core::IdOptions::default(),
            endpoints: 1,
        }
    }
}

impl RealRun {
    /// The messages per connection in effect.
    pub fn messages(&self) -> u32 {
        self.messages.unwrap_or(if self.server { 0 } else { 1 })
    }
}

/// ucmatose's default message size.
pub const DEFAULT_MESSAGE_SIZE: usize = 100;
/// The largest message size `--size` takes.
pub const MAX_MESSAGE_SIZE: usize = 4096;
/// The most messages per connection: the send queue depth.
pub const MAX_MESSAGES: u32 = crate::session::SEND_SLOTS;

/// The kernel's timeout of one address or route resolution.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// Address resolution attempts per connection: the first one after the devices come up
/// can time out while the neighbour entry is being resolved.
const RESOLVE_ATTEMPTS: u32 = 5;
/// How long a connection may take from connect (client) or accept (server) to
/// established before it is closed as timed out (the endpoint's deadline; without it a
/// passive side whose RTU is lost waits ~69 s of REP retries).
const ESTABLISH_TIMEOUT: Duration = Duration::from_secs(30);
/// The most client connections in setup at once: thousands started together would
/// wait on each other past their establish deadline (10,000 at once in the VM: 30
/// established in 30 s, the rest timed out).
const CONNECT_WINDOW: usize = 512;

/// The whole tool: runs, prints, and turns the outcome into an exit status (0: every
/// connection established, exchanged and torn down; 1: some failed, or the device went
/// away; 2: no RDMA device). Diagnostics go to stderr, one line each.
pub fn main(config: &RealRun) -> ExitCode {
    let report = match run(config) {
        Ok(report) => report,
        Err(e) if e.is_no_device() => {
            // The error's text starts with "no RDMA device".
            eprintln!("cmnotify: {e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("cmnotify: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(message) = crate::report::emit(config.json, &report, || human(&report)) {
        eprintln!("cmnotify: {message}");
        return ExitCode::FAILURE;
    }
    if let Some(why) = &report.aborted {
        eprintln!("cmnotify: {why}");
        return ExitCode::FAILURE;
    }
    if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_defaults_depend_on_the_role() {
        let client = RealRun::default();
        assert_eq!(client.messages(), 1);
        let server = RealRun {
            server: true,
            ..RealRun::default()
        };
        assert_eq!(server.messages(), 0, "the server echoes by default");
        let ucmatose_like = RealRun {
            messages: Some(10),
            ..server
        };
        assert_eq!(ucmatose_like.messages(), 10);
        let caps = crate::session::queue_caps(ucmatose_like.message_size);
        assert!(caps.buffer_size as usize >= DEFAULT_MESSAGE_SIZE);
    }

    #[test]
    fn the_client_refuses_to_run_without_an_address() {
        let error = run(&RealRun::default()).unwrap_err();
        assert!(
            matches!(error, cm_core::CmError::InvalidArgument { .. }),
            "{error}"
        );
    }

    #[test]
    fn without_a_device_the_run_says_so_in_one_line() {
        if std::path::Path::new("/dev/infiniband/rdma_cm").exists() {
            eprintln!("an RDMA CM device exists: the no-device path is not reachable here");
            return;
        }
        let client = RealRun {
            address: Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)),
            ..RealRun::default()
        };
        let error = run(&client).unwrap_err();
        assert!(error.is_no_device(), "{error}");
        let text = error.to_string();
        assert!(text.starts_with("no RDMA device"), "{text}");
        assert!(!text.contains('\n'), "{text}");
    }
}
