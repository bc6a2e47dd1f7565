//! Plain data of the simulation: identifiers, configuration, fault rules, statistics.

use core::fmt;
use std::time::Duration;

use cm_core::QpNum;

/// A node of the simulated fabric (one host with one RDMA device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node{}", self.0)
    }
}

/// A connection: numbered in the order `connect` is called, from 0. Both ids of the
/// connection (active and passive) carry it, and fault rules name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u32);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conn{}", self.0)
    }
}

/// A CM id of the fabric: slot index plus generation, so a handle to a destroyed id
/// never reaches the id that reuses its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SimIdKey {
    /// The slot.
    pub index: u32,
    /// The slot's generation when the id was created.
    pub generation: u32,
}

impl fmt::Display for SimIdKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "id{}", self.index)?;
        if self.generation != 0 {
            write!(f, ".{}", self.generation)?;
        }
        Ok(())
    }
}

/// The kind of a message on the simulated wire: the IB CM MADs and QP data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MsgKind {
    /// Connection request (active → passive).
    Req,
    /// Message receipt acknowledgement: "I got your REQ/REP, give me more time".
    Mra,
    /// Connection reject.
    Rej,
    /// Connection reply (passive → active).
    Rep,
    /// Ready to use (active → passive): completes the handshake.
    Rtu,
    /// Disconnect request.
    Dreq,
    /// Disconnect reply.
    Drep,
    /// A data packet on a QP (one SEND).
    Data,
}

impl MsgKind {
    /// Every kind, in index order.
    pub const ALL: [MsgKind; 8] = [
        MsgKind::Req,
        MsgKind::Mra,
        MsgKind::Rej,
        MsgKind::Rep,
        MsgKind::Rtu,
        MsgKind::Dreq,
        MsgKind::Drep,
        MsgKind::Data,
    ];

    /// Position in [`MsgKind::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The protocol's name ("REQ", "RTU", "data").
    pub const fn name(self) -> &'static str {
        match self {
            MsgKind::Req => "REQ",
            MsgKind::Mra => "MRA",
            MsgKind::Rej => "REJ",
            MsgKind::Rep => "REP",
            MsgKind::Rtu => "RTU",
            MsgKind::Dreq => "DREQ",
            MsgKind::Drep => "DREP",
            MsgKind::Data => "data",
        }
    }
}

impl fmt::Display for MsgKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a fault does to a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultAction {
    /// The message is lost.
    Drop,
    /// The message arrives this much later than it would.
    Delay(Duration),
    /// The message arrives twice (the copy one wire latency after the original). A
    /// duplicated data packet completes once: RC's sequence check discards the copy.
    Duplicate,
    /// The message is held back by a random extra delay up to
    /// [`SimConfig::reorder_window`], so messages sent after it can overtake it.
    Reorder,
}

impl fmt::Display for FaultAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultAction::Drop => f.write_str("dropped"),
            FaultAction::Delay(d) => write!(f, "delayed {d:?}"),
            FaultAction::Duplicate => f.write_str("duplicated"),
            FaultAction::Reorder => f.write_str("reordered"),
        }
    }
}

/// A deterministic fault: applies to messages of `kind` (on connection `conn` when
/// given), to the `nth` such message of that connection when given (0 = the first, a
/// retransmission counts as a new message), else to all of them.
///
/// "Drop the first RTU of connection 3": `FaultRule::new(MsgKind::Rtu, FaultAction::Drop)
/// .on_conn(ConnId(3)).nth(0)`. "Drop all RTUs": `FaultRule::new(MsgKind::Rtu,
/// FaultAction::Drop)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FaultRule {
    /// Which messages.
    pub kind: MsgKind,
    /// Only on this connection.
    pub conn: Option<ConnId>,
    /// Only the nth message of `kind` on a connection (0-based).
    pub nth: Option<u32>,
    /// What happens to it.
    pub action: FaultAction,
}

impl FaultRule {
    /// A rule for every message of `kind`.
    pub const fn new(kind: MsgKind, action: FaultAction) -> Self {
        FaultRule {
            kind,
            conn: None,
            nth: None,
            action,
        }
    }

    /// Restricts the rule to one connection.
    pub const fn on_conn(mut self, conn: ConnId) -> Self {
        self.conn = Some(conn);
        self
    }

    /// Restricts the rule to the `nth` message of its kind on a connection (0 = first).
    pub const fn nth(mut self, nth: u32) -> Self {
        self.nth = Some(nth);
        self
    }

    pub(crate) fn matches(&self, kind: MsgKind, conn: Option<ConnId>, nth: u32) -> bool {
        self.kind == kind
            && self.conn.is_none_or(|c| Some(c) == conn)
            && self.nth.is_none_or(|n| n == nth)
    }
}

/// Random faults for one message kind, drawn from the fabric's seeded generator. Each
/// probability is in `[0, 1]`; at most one fault applies to a message (checked in the
/// order drop, duplicate, delay, reorder).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FaultOdds {
    /// Probability that the message is lost.
    pub drop: f64,
    /// Probability that it arrives twice.
    pub duplicate: f64,
    /// Probability that it is delayed by a random time up to `max_delay`.
    pub delay: f64,
    /// The longest random delay.
    pub max_delay: Duration,
    /// Probability that it is reordered ([`FaultAction::Reorder`]).
    pub reorder: f64,
}

impl FaultOdds {
    /// Only losses, with probability `p`.
    pub const fn drop(p: f64) -> Self {
        FaultOdds {
            drop: p,
            duplicate: 0.0,
            delay: 0.0,
            max_delay: Duration::ZERO,
            reorder: 0.0,
        }
    }

    pub(crate) fn is_zero(&self) -> bool {
        self.drop <= 0.0 && self.duplicate <= 0.0 && self.delay <= 0.0 && self.reorder <= 0.0
    }
}

/// What kind of device a node has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DeviceKind {
    /// InfiniBand or RoCE (soft-RoCE included): notify goes to the IB CM.
    #[default]
    InfiniBand,
    /// An iWARP RNIC, as the kernel and soft-iWARP behave: notify is a no-op returning 0
    /// for any event once the id has a CM id (and ids report that notify forces
    /// nothing); the passive side is established as it accepts, with no RTU (the
    /// MPA exchange, played with the same messages, on a reliable wire: the REP is not
    /// retried, no RTU is sent); a peer's reject arrives as REJECTED with status
    /// `-ECONNRESET`.
    Iwarp,
}

/// The fabric's timing and behaviour. [`SimConfig::default`] is kernel-like: CM response
/// timeout 4.096 µs × 2^20 (~4.3 s), 15 retries (16 sends), COMM_EST raised.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// One-way latency of every message.
    pub wire_latency: Duration,
    /// Time before an unanswered REQ, REP or DREQ is sent again (CMA_CM_RESPONSE_TIMEOUT
    /// 20: 4.096 µs × 2^20).
    pub cm_response_timeout: Duration,
    /// How many times an unanswered REQ, REP or DREQ is resent (CMA_MAX_CM_RETRIES 15).
    pub max_cm_retries: u32,
    /// The timeout an MRA asks for (CMA_CM_MRA_SETTING 24: 4.096 µs × 2^24, ~68.7 s):
    /// after an MRA, the REQ/REP is resent this much later instead.
    pub mra_service_timeout: Duration,
    /// The RDMA CM's delayed MRA: on REQ/REP receipt the id moves to MRA_REQ_SENT /
    /// MRA_REP_SENT without sending anything, and sends the MRA only when a duplicate
    /// REQ/REP shows the peer is retrying (modern kernels). `false`: REQ_RCVD/REP_RCVD.
    pub delayed_mra: bool,
    /// Delay of the work item that delivers ESTABLISHED after a forced establish.
    pub establish_work_delay: Duration,
    /// How long an id stays in TIMEWAIT before TIMEWAIT_EXIT.
    pub timewait: Duration,
    /// How long address and route resolution each take.
    pub resolve_delay: Duration,
    /// Whether the first packet reaching a QP whose CM is REP_SENT/MRA_REP_RCVD raises
    /// `IBV_EVENT_COMM_EST`. `false` is soft-RoCE, which never raises it.
    pub comm_est: bool,
    /// The largest extra delay of a [`FaultAction::Reorder`].
    pub reorder_window: Duration,
    /// Whether to record a [`crate::sim::Trace`] (off: no cost).
    pub trace: bool,
    /// The most CONNECT_REQUESTs a listener may have queued unread: the kernel's
    /// `net.rdma_ucm.max_backlog` sysctl (default 1024). A listen backlog of 0, or one
    /// above this, is this ([`SimCmId::listen`], which gives none, is not limited). A
    /// REQ that finds its listener's backlog used up is dropped without a reply
    /// ([`SimStats::reqs_dropped_backlog`]) and comes back with the peer's REQ retry,
    /// [`SimConfig::cm_response_timeout`] later.
    ///
    /// [`SimCmId::listen`]: crate::sim::SimCmId::listen
    pub max_backlog: u32,
    /// The device of every node [`SimFabric::add_node`] adds (and so of both sides of
    /// [`SimPair`] and [`SimTransports`]): InfiniBand/RoCE by default.
    ///
    /// [`SimFabric::add_node`]: crate::sim::SimFabric::add_node
    /// [`SimPair`]: crate::sim::SimPair
    /// [`SimTransports`]: crate::sim::SimTransports
    pub device_kind: DeviceKind,
    /// Virtual time an application spends creating a QP (`rdma_create_qp` with its
    /// completion queues): [`SimCmId::create_qp`] and the transport's `create_qp` let
    /// it pass, handling the messages and timers due meanwhile, as
    /// [`SimFabric::advance`] does. Zero (the default): no time passes.
    ///
    /// The fabric has one clock, so the time passes for every node, and no other
    /// application acts during it; only the fabric (wire, CM timers) does.
    ///
    /// [`SimCmId::create_qp`]: crate::sim::SimCmId::create_qp
    /// [`SimFabric::advance`]: crate::sim::SimFabric::advance
    pub create_qp_cost: Duration,
    /// Virtual time the transport's `register_buffers` takes (allocating and
    /// registering a connection's buffers), let pass as [`SimConfig::create_qp_cost`].
    /// Zero (the default): no time passes.
    pub register_cost: Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            wire_latency: Duration::from_micros(10),
            cm_response_timeout: Duration::from_nanos(4_096 << 20),
            max_cm_retries: 15,
            mra_service_timeout: Duration::from_nanos(4_096 << 24),
            delayed_mra: true,
            establish_work_delay: Duration::from_micros(50),
            timewait: Duration::from_millis(100),
            resolve_delay: Duration::from_micros(20),
            comm_est: true,
            reorder_window: Duration::from_micros(100),
            trace: false,
            max_backlog: 1024,
            device_kind: DeviceKind::InfiniBand,
            create_qp_cost: Duration::ZERO,
            register_cost: Duration::ZERO,
        }
    }
}

impl SimConfig {
    /// Kernel-like defaults on a soft-RoCE device: no COMM_EST is ever raised.
    pub fn soft_roce() -> Self {
        SimConfig {
            comm_est: false,
            ..SimConfig::default()
        }
    }

    /// The same configuration with the trace on.
    pub fn traced(mut self) -> Self {
        self.trace = true;
        self
    }
}

/// A receive completion: a SEND arrived on a QP (what `ibv_poll_cq` reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecvCompletion {
    /// The receiving QP.
    pub qp: QpNum,
    /// Bytes received.
    pub byte_len: u32,
}

/// Counters of everything the fabric did, for assertions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Messages sent per kind (index [`MsgKind::index`]), retransmissions included.
    pub sent: [u64; 8],
    /// Messages delivered per kind.
    pub delivered: [u64; 8],
    /// Messages lost to a fault.
    pub dropped: u64,
    /// Messages duplicated by a fault.
    pub duplicated: u64,
    /// Messages delayed or reordered by a fault.
    pub delayed: u64,
    /// Messages that reached no live id or QP, or an id in a state that ignores them.
    pub ignored: u64,
    /// RTUs that arrived after the passive side was already ESTABLISHED (counted and
    /// dropped, as the kernel does).
    pub late_rtus: u64,
    /// REQ/REP/DREQ retransmissions.
    pub retransmissions: u64,
    /// Forced establishes (notify returned 0 and queued the work item).
    pub forced_establishes: u64,
    /// COMM_EST asynchronous events raised.
    pub comm_est_raised: u64,
    /// Receive completions produced.
    pub recv_completions: u64,
    /// CM events queued on a channel.
    pub events_queued: u64,
    /// CM events handed to the application.
    pub events_delivered: u64,
    /// CM events acknowledged.
    pub events_acked: u64,
    /// Queued CM events thrown away because their id was destroyed before they were read.
    pub events_discarded: u64,
    /// REQs dropped without a reply because their listener's backlog was used up
    /// ([`SimConfig::max_backlog`]).
    pub reqs_dropped_backlog: u64,
    /// CM events still queued unread on an id's channel when the id was destroyed,
    /// summed over every destroy: the kernel's `rdma_destroy_id` walks its channel's
    /// whole list of unread events to drop the id's own, so a server that destroys
    /// ids while thousands of events wait pays for each of them each time.
    pub events_walked_by_destroy: u64,
    /// Ids destroyed (`rdma_destroy_id`, or their channel's destruction).
    pub ids_destroyed: u64,
    /// Bytes of per-connection buffer areas registered now (the transport's
    /// `register_buffers`, `(recv_depth + send_depth) * buffer_size` each, given back
    /// when its `SimBuffers` drops), over every node.
    pub registered_buffers: u64,
    /// The most [`SimStats::registered_buffers`] ever was.
    pub registered_buffers_peak: u64,
    /// Bytes of shared pools registered now (the transport's `create_shared`,
    /// `SharedCaps::pool_len` each, given back by `release_shared`), over every node.
    pub registered_pools: u64,
    /// The most [`SimStats::registered_pools`] ever was.
    pub registered_pools_peak: u64,
}

impl SimStats {
    /// Messages of `kind` sent.
    pub const fn sent_of(&self, kind: MsgKind) -> u64 {
        self.sent[kind.index()]
    }

    /// Messages of `kind` delivered.
    pub const fn delivered_of(&self, kind: MsgKind) -> u64 {
        self.delivered[kind.index()]
    }
}
