//! Body of the `endpoint_ops` fuzz target (and of cm-verbs' endpoint property test):
//! cm-verbs' `Endpoint` on both nodes of the simulated fabric, driven by an arbitrary
//! sequence of application calls and faults.
//!
//! A server endpoint listens (one listener accepting on its own, one reporting each
//! request for `accept_request`/`reject_request`), with busy polling on in about half
//! the runs (its waiting calls spin on the receive queues of connections not yet
//! established); a client endpoint connects. Each
//! operation is four bytes (kind and three arguments), so every byte string is a run
//! and a run shrinks by whole operations: connect, answer a request, send, recv,
//! established, accept, disconnect, next_event, poll until nothing is left, process,
//! advance virtual time, a fault rule on the wire (RTU loss or delay above all), a
//! device event (DEVICE_FATAL, a port event, a QP error or a COMM_EST on a known QP),
//! device removal, notify off, close or open a listener, post one-sided work (RDMA
//! READ/WRITE, now and then one the peer refuses) on a connection's QP through
//! `cm_id`, take its completions. The connections' `work_depth` is 0 to 8. Waiting calls wait zero or a
//! few virtual milliseconds (never `None`: on an idle fabric that is an error), and
//! while one endpoint waits the other handles its inputs, as a peer process would.
//!
//! Checked after every operation, on both endpoints:
//! - nothing panics, and `process`/`poll` never fail on the simulated fabric;
//! - every queue of `stats()` within its documented bound (the ready, accept and
//!   deadline queues against the most connections, closes and events held so far);
//! - each connection reported established at most once per side (an
//!   `Event::Established`, or `accept` returning it; `established` and `recv` take the
//!   event too, and asking `established` again is no second report), with the side's
//!   role, and no message or completed send reported before it;
//! - a handle closed by an `Event::Closed`, a `recv` answering `ConnError::Closed`, an
//!   accepted `disconnect` or a `reject_request` names nothing from then on: every call
//!   answers `UnknownConnection` at once and no event names it; a handle that once
//!   answered `UnknownConnection` never comes back;
//! - the application's one-sided work (posted with `APPLICATION_WR_ID`, never more
//!   than `work_depth` of it not taken) completes once, in posting order per
//!   connection, or its connection's close is reported and nothing completes after the
//!   close; a failed completion is the last one taken and closes its connection, and
//!   the close it caused is answered only once it and every completion before it were
//!   taken; while the connection lives, work posted completes once the endpoint handled
//!   its inputs (and at the end of the run); no completion taken as work is an
//!   endpoint message's, and no work completion is reported as a completed send.
//!
//! This file holds the operations, the set-up and the run; `decode` reads them from
//! the input, `world` is what they act on, `calls` the application's calls and the
//! checks of their answers, `work` the application's one-sided work and its checks,
//! `invariants` what is checked after each.

use std::time::Duration;

use cm_mock::sim::{FaultAction, MsgKind, SimConfig, SimTransport};
use cm_verbs::{Endpoint, QueueCaps, SharedCaps};

use crate::input::Input;
use world::World;

// Explicit paths: cm-verbs' endpoint property test includes this file with `#[path]`,
// under which rustc would look for the submodules beside it, not in `endpoint_ops/`.
#[path = "endpoint_ops/calls.rs"]
mod calls;
#[path = "endpoint_ops/decode.rs"]
mod decode;
#[path = "endpoint_ops/invariants.rs"]
mod invariants;
#[path = "endpoint_ops/work.rs"]
mod work;
#[path = "endpoint_ops/world.rs"]
mod world;

/// The ports a client may connect to: one accepting on its own, one reporting
/// requests, one nobody listens on (at first).
const PORTS: [u16; 3] = [7471, 7472, 7473];
/// Operations read from one input.
const MAX_OPS: usize = 128;
/// Connections the client may start in one run: enough for the queues' stale entries
/// to pass the 64 their compaction allows.
const MAX_CONNECTS: usize = 128;
/// Events one drain may take before the endpoint counts as reporting forever.
const MAX_DRAIN: usize = 1 << 14;
/// The buffer size of every connection: small, so that a longer message is refused.
const BUFFER: u32 = 64;

type SimEndpoint = Endpoint<SimTransport>;

/// Which endpoint an operation acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Who {
    /// The listening endpoint (node 0).
    Server,
    /// The connecting endpoint (node 1).
    Client,
}

/// What a device operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceOp {
    /// `IBV_EVENT_DEVICE_FATAL`.
    Fatal,
    /// The device is removed (`rdma link delete`).
    Remove,
    /// A port event (active or error), for the application to see.
    Port(bool),
    /// `IBV_EVENT_QP_FATAL` on a known connection's QP.
    QpFatal(u8),
    /// `IBV_EVENT_COMM_EST` on a known connection's QP.
    CommEst(u8),
}

/// One operation of a run; `pick` bytes choose among the handles the side has seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The client connects `count` times to `PORTS[port]`.
    Connect {
        /// Index into the ports.
        port: u8,
        /// How many connections.
        count: u8,
        /// A connect deadline of this many milliseconds.
        timeout_ms: Option<u8>,
        /// Private data longer than a REQ has room for (a typed error).
        too_long: bool,
    },
    /// The server answers a reported request.
    Answer {
        /// Which request.
        pick: u8,
        /// Accept (else reject).
        accept: bool,
        /// Private data longer than the REP or REJ has room for.
        too_long: bool,
    },
    /// A message of `len` bytes (more than [`BUFFER`] is refused).
    Send {
        /// Which endpoint.
        who: Who,
        /// Which connection.
        pick: u8,
        /// The message length.
        len: u8,
    },
    /// Up to `count` pieces of one-sided work on a connection's QP (through
    /// `Endpoint::cm_id`), while the work not taken stays within its `work_depth`.
    Work {
        /// Which endpoint.
        who: Who,
        /// Which connection.
        pick: u8,
        /// How many pieces at most.
        count: u8,
        /// The last piece is refused by the peer (a remote access error).
        refused: bool,
        /// Each piece moves `len` x 256 bytes.
        len: u8,
    },
    /// `take_work_completion` up to `count` times.
    TakeWork {
        /// Which endpoint.
        who: Who,
        /// Which connection.
        pick: u8,
        /// How many completions at most.
        count: u8,
        /// The endpoint handles its inputs first: then every piece posted on a live
        /// connection must be there.
        process: bool,
    },
    /// `recv` with a zero or small timeout.
    Recv {
        /// Which endpoint.
        who: Who,
        /// Which connection.
        pick: u8,
        /// The timeout's code ([`wait`]).
        wait: u8,
    },
    /// `established` with a zero or small timeout.
    Established {
        /// Which endpoint.
        who: Who,
        /// Which connection.
        pick: u8,
        /// The timeout's code ([`wait`]).
        wait: u8,
    },
    /// `accept` on the server with a zero or small timeout.
    Accept {
        /// The timeout's code ([`wait`]).
        wait: u8,
    },
    /// `disconnect`.
    Disconnect {
        /// Which endpoint.
        who: Who,
        /// Which connection.
        pick: u8,
    },
    /// `next_event` up to `count` times.
    NextEvent {
        /// Which endpoint.
        who: Who,
        /// The timeout's code ([`wait`]).
        wait: u8,
        /// How many events at most.
        count: u8,
    },
    /// `poll` until it reports nothing.
    Drain {
        /// Which endpoint.
        who: Who,
    },
    /// `process`.
    Process {
        /// Which endpoint.
        who: Who,
    },
    /// Virtual time moves on by 2^`exp` µs, both endpoints handling what it brings.
    Advance {
        /// The exponent.
        exp: u8,
    },
    /// A fault rule on the wire.
    Fault {
        /// The message kind (the RTU half the time).
        kind: MsgKind,
        /// What happens to it.
        action: FaultAction,
        /// Only the nth such message of a connection.
        nth: Option<u32>,
    },
    /// Something happens to a node's device.
    Device {
        /// Whose device.
        who: Who,
        /// What.
        what: DeviceOp,
    },
    /// `set_notify`.
    SetNotify {
        /// Which endpoint.
        who: Who,
        /// On or off.
        on: bool,
    },
    /// `close_listener` on one of the listeners opened so far.
    CloseListener {
        /// Which listener.
        pick: u8,
    },
    /// `listen` again on `PORTS[port]` (a bound port is a typed error).
    Listen {
        /// Index into the ports.
        port: u8,
        /// Report requests instead of accepting them.
        manual: bool,
        /// An establish deadline of this many milliseconds.
        timeout_ms: Option<u8>,
    },
}

/// The fabric and endpoint set-up a run starts from.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    /// The fabric's timing and COMM_EST.
    pub config: SimConfig,
    /// The fabric's seed.
    pub seed: u64,
    /// Every connection's queues.
    pub caps: QueueCaps,
    /// The first listener's establish deadline.
    pub establish_timeout: Option<Duration>,
    /// The server's busy polling (its waiting calls spin on the receive queues of the
    /// connections not yet established, then on every source).
    pub busy_poll: Option<Duration>,
    /// Both endpoints' shared queues; `None`: queues of each connection's own.
    pub shared_queues: Option<SharedCaps>,
}

/// The set-up (first four bytes) and the operations (four bytes each) of an input.
pub fn decode(data: &[u8]) -> (Setup, Vec<Op>) {
    let mut input = Input::new(data);
    let setup = Setup::decode(&mut input);
    let mut ops = Vec::new();
    while !input.is_empty() && ops.len() < MAX_OPS {
        ops.push(Op::decode(&mut input));
    }
    (setup, ops)
}

/// Runs one arbitrary input; panics when an invariant breaks.
pub fn run(data: &[u8]) {
    let (setup, ops) = decode(data);
    run_ops(&setup, &ops);
}

/// Runs `ops` from `setup`; panics, naming the operation, when an invariant breaks.
pub fn run_ops(setup: &Setup, ops: &[Op]) {
    let mut world = World::new(setup);
    for (index, op) in ops.iter().enumerate() {
        world.at = format!("op #{index} {op:?}");
        world.op(*op);
        world.check();
    }
    world.at = "the final drain".into();
    world.advance(20);
    // The work first: a close that failed work caused is still answered by
    // `take_work_completion` before a drain reports it.
    world.take_all_work();
    for who in [Who::Server, Who::Client] {
        world.drain(who);
    }
    world.check();
}

/// A timeout from its code: zero half the time, else 1 to 16 virtual milliseconds.
fn wait(code: u8) -> Option<Duration> {
    if code & 1 == 0 {
        Some(Duration::ZERO)
    } else {
        Some(Duration::from_millis(1 << ((code >> 1) % 5)))
    }
}
