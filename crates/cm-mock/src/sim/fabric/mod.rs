//! The simulation's state and its rules: the IB CM state machine, the wire, the QPs.
//! Everything here runs under one lock of the fabric's `Mutex`; the handles in `sim/mod.rs`
//! are thin. Nothing here holds a handle or runs code of the caller, so a call never
//! takes the lock again (or drops an event, which would) while it holds it.
//!
//! This file holds the records (messages, queued events, ids, QPs, nodes, channels),
//! the [`Fabric`] that owns them, its bookkeeping and its timers; [`wire`] sends and
//! delivers messages (faults, the clock, the IB CM's answers to each message) and
//! [`calls`] is what the handles call (verbs, rdma_cm calls, event channels,
//! inspection).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cm_core::kernel_model::LapState;
use cm_core::{AsyncEvent, CmError, CmEventType, CmIdState, Errno, IbCmState, QpNum};

use super::rng::SplitMix64;
use super::schedule::Schedule;
use super::tables::{Chunked, ReqTable, Slots};
use super::trace::{Trace, TraceEntry, TraceEvent};
use super::types::{
    ConnId, DeviceKind, FaultOdds, FaultRule, MsgKind, NodeId, RecvCompletion, SimConfig, SimIdKey,
    SimStats,
};

mod calls;
mod wire;

/// The first QP number handed out (QPs 0 and 1 are special in verbs).
const FIRST_QPN: u32 = 0x11;
/// REJ reason: no listener for the service id (IB_CM_REJ_INVALID_SERVICE_ID).
pub(crate) const REJ_INVALID_SERVICE_ID: i32 = 8;
/// REJ reason: the application rejected (IB_CM_REJ_CONSUMER_DEFINED).
pub(crate) const REJ_CONSUMER_DEFINED: i32 = 28;
/// REJ reason sent when an id with a REQ outstanding is destroyed (IB_CM_REJ_TIMEOUT).
pub(crate) const REJ_TIMEOUT: i32 = 1;
/// REJ reason for a retried REQ of a connection in TIMEWAIT (IB_CM_REJ_STALE_CONN).
pub(crate) const REJ_STALE_CONN: i32 = 10;
/// EADDRINUSE, for a second listener on a port.
const EADDRINUSE: i32 = 98;

/// Private data of a CM message, queued event or id: a handle into the fabric's
/// [`PrivateBytes`]. Copying it is free and it owns no heap memory, so sending a REQ
/// allocates nothing and the id and message tables need no drop pass. Eight bytes: an
/// id holds two.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Private {
    start: u32,
    len: u32,
}

/// The bytes of every private data the fabric was handed (`connect`, `accept`,
/// `reject`), appended once; a call repeating the previous call's bytes (the same
/// `connect` on every id) reuses them, so the store grows only with distinct data.
#[derive(Debug, Default)]
struct PrivateBytes {
    bytes: Vec<u8>,
    last: Private,
}

impl PrivateBytes {
    fn store(&mut self, data: &[u8]) -> Private {
        if data.is_empty() {
            return Private::default();
        }
        if self.get(self.last) == data {
            return self.last;
        }
        // Only distinct CM private data is kept (at most 196 bytes a call).
        self.last = Private {
            start: u32::try_from(self.bytes.len()).expect("less than 4 GiB of private data"),
            len: data.len() as u32,
        };
        self.bytes.extend_from_slice(data);
        self.last
    }

    fn get(&self, private: Private) -> &[u8] {
        let start = private.start as usize;
        &self.bytes[start..start + private.len as usize]
    }
}

impl Fabric {
    /// Keeps a data message's payload until it is read; its handle.
    fn store_payload(&mut self, data: &[u8]) -> Private {
        if data.is_empty() {
            return Private::default();
        }
        let slot = self.payloads.put(data.into());
        Private {
            start: slot,
            // The caller checked that it fits.
            len: data.len() as u32,
        }
    }

    /// Frees the payload of data message `msg` when it goes without being delivered
    /// (a duplicate shares the original's, and is never delivered).
    fn discard_payload(&mut self, msg: &Message) {
        if msg.kind == MsgKind::Data && !msg.copy {
            self.take_payload(msg.private);
        }
    }

    /// Takes a payload out of the store.
    fn take_payload(&mut self, payload: Private) -> Option<Box<[u8]>> {
        if payload.len == 0 {
            return None;
        }
        self.payloads.take(payload.start)
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A message on the wire. One flat struct for every kind keeps the queue simple; 64
/// bytes, aligned, so a message in flight is one cache line.
#[derive(Debug, Clone)]
#[repr(align(64))]
pub(crate) struct Message {
    kind: MsgKind,
    conn: Option<ConnId>,
    from: NodeId,
    to: NodeId,
    /// The sending id (REQ: the active id).
    src: MaybeKey,
    /// The receiving id (not known for a REQ).
    dst: MaybeKey,
    /// REQ/REP: the sender's QP; data: the receiving QP.
    qp: QpNum,
    /// REQ: the service (port) asked for.
    port: u16,
    /// REJ: the reason; MRA: the kind acknowledged (as index); data: the length.
    value: i32,
    private: Private,
    retransmit: bool,
    /// The second copy of a duplicated message.
    copy: bool,
}

// A message in flight is one cache line; an id slot (two per connection) stays well
// under two: checked when compiling.
const _: () = assert!(std::mem::size_of::<Message>() == 64);
const _: () = assert!(std::mem::size_of::<IdSlot>() <= 100);

impl Message {
    fn new(kind: MsgKind, conn: Option<ConnId>, from: NodeId, to: NodeId) -> Self {
        Message {
            kind,
            conn,
            from,
            to,
            src: MaybeKey::NONE,
            dst: MaybeKey::NONE,
            qp: QpNum(0),
            port: 0,
            value: 0,
            private: Private::default(),
            retransmit: false,
            copy: false,
        }
    }
}

/// What the clock triggers. Small on purpose: most pending actions are timers, and a
/// scale run keeps a few per connection queued, so a message waits in the fabric's
/// `wire` and the action only names its slot.
#[derive(Debug)]
enum Action {
    /// The message in this slot of the wire arrives.
    Deliver(u32),
    /// The retransmission (or timewait) timer of an id; stale when `gen` differs.
    Timer {
        id: SimIdKey,
        gen: u32,
    },
    AddrResolved(SimIdKey),
    RouteResolved(SimIdKey),
    /// The deferred work item of a forced establish.
    EstablishWork(SimIdKey),
}

/// A CM event waiting in a channel.
#[derive(Debug, Clone)]
pub(crate) struct QueuedEvent {
    pub(crate) id: SimIdKey,
    pub(crate) listen_id: Option<SimIdKey>,
    pub(crate) kind: QueuedKind,
    pub(crate) status: i32,
    pub(crate) private: Private,
}

/// A real event, or librdmacm's internal CONNECT_RESPONSE that becomes ESTABLISHED
/// (after the QP transitions and the RTU) when the application reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueuedKind {
    Event(CmEventType),
    ConnectResponse,
}

/// An event handed out by `next_event`.
#[derive(Debug, Clone)]
pub(crate) struct ReadEvent {
    pub(crate) id: SimIdKey,
    pub(crate) listen_id: Option<SimIdKey>,
    pub(crate) event_type: CmEventType,
    pub(crate) status: i32,
    pub(crate) qp: Option<QpNum>,
    pub(crate) private: Box<[u8]>,
    /// What the id's owner keeps with it (`set_context`), if anything.
    pub(crate) context: Option<u32>,
}

#[derive(Debug, Default)]
struct Node {
    kind: DeviceKind,
    going_down: bool,
    /// QPs the node may still create (`None`: no limit); at 0 `rdma_create_qp` answers
    /// ENOMEM, as the kernel does once pinned memory passes RLIMIT_MEMLOCK.
    qp_budget: Option<u32>,
    async_events: VecDeque<AsyncEvent>,
    /// Receive completions, each with the payload the sender gave (empty for
    /// length-only sends).
    completions: VecDeque<(RecvCompletion, Private)>,
    /// The node's QPs destroyed since a transport last asked (see
    /// `take_destroyed_qps`); `None` while no transport watches, so that bare fabric
    /// use keeps nothing.
    destroyed_qps: Option<Vec<QpNum>>,
}

#[derive(Debug)]
struct Channel {
    node: NodeId,
    queue: VecDeque<QueuedEvent>,
    /// `rdma_destroy_event_channel` ran: its ids are destroyed, its queue discarded.
    closed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QpState {
    Init,
    /// RTR and RTS alike: librdmacm moves a QP through RTR to RTS in one go.
    Rts,
    Error,
}

#[derive(Debug)]
struct Qp {
    node: NodeId,
    owner: SimIdKey,
    state: QpState,
    peer: MaybeQp,
    got_first_packet: bool,
    alive: bool,
}

/// One CM id: the rdma_cm id and its IB CM id together. Compact (a scale run holds two
/// per connection): the fields are laid out by the compiler, and the slot is not
/// padded to cache lines.
#[derive(Debug)]
struct IdData {
    node: NodeId,
    /// The channel's index (`u32`: ids are many, channels few).
    channel: u32,
    /// Events handed out and not yet acknowledged.
    unacked: u32,
    /// Bumped to cancel the pending timer.
    timer_gen: u32,
    /// What the id's owner keeps with it (rdma_cm's `id->context`; `u32::MAX`: none).
    context: u32,
    conn: MaybeConn,
    qp: MaybeQp,
    /// The peer id, once known.
    remote: Option<(NodeId, SimIdKey)>,
    cm_state: CmIdState,
    /// The IB CM id's state; `None` until connect/accept/listen attaches one.
    ib: Option<IbCmState>,
    /// Bound to the node's device (bind, resolve, or created by a connection request).
    device: bool,
    /// Which message the timer resends (`None`: the timer is the TIMEWAIT timer).
    retrying: Option<MsgKind>,
    /// The retransmission timeout is the MRA's service timeout (an MRA arrived), not the
    /// CM response timeout.
    mra_timeout: bool,
    /// Created by a connection request (passive ids): `remote` is the REQ's sender,
    /// whose duplicate-REQ entry goes when this id does.
    from_req: bool,
    lap: LapState,
    retries_left: u32,
    port: u16,
    /// Where `resolve_addr` points.
    dst: Option<(NodeId, u16)>,
    remote_qp: MaybeQp,
    /// The private data of our REQ/REP (for retransmissions); the peer's REP data on the
    /// active side once the REP arrived.
    private: Private,
    peer_private: Private,
}

/// An optional connection number in four bytes (`u32::MAX`, never handed out, is
/// none), half an `Option<ConnId>`: every id has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MaybeConn(u32);

impl MaybeConn {
    const NONE: MaybeConn = MaybeConn(u32::MAX);

    fn new(conn: Option<ConnId>) -> Self {
        conn.map_or(MaybeConn::NONE, |c| MaybeConn(c.0))
    }

    fn get(self) -> Option<ConnId> {
        (self != MaybeConn::NONE).then_some(ConnId(self.0))
    }
}

/// An optional QP number in four bytes (`u32::MAX`, never handed out, is none): half
/// an `Option<QpNum>`, and every id and QP has one or two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MaybeQp(u32);

impl MaybeQp {
    pub(crate) const NONE: MaybeQp = MaybeQp(u32::MAX);

    pub(crate) fn new(qp: Option<QpNum>) -> Self {
        qp.map_or(MaybeQp::NONE, |q| MaybeQp(q.0))
    }

    pub(crate) fn get(self) -> Option<QpNum> {
        (self != MaybeQp::NONE).then_some(QpNum(self.0))
    }
}

/// An optional id key in eight bytes (slot `u32::MAX`, never handed out, is none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MaybeKey(SimIdKey);

impl MaybeKey {
    const NONE: MaybeKey = MaybeKey(SimIdKey {
        index: u32::MAX,
        generation: 0,
    });

    fn new(key: Option<SimIdKey>) -> Self {
        key.map_or(MaybeKey::NONE, MaybeKey)
    }

    fn get(self) -> Option<SimIdKey> {
        (self.0.index != u32::MAX).then_some(self.0)
    }
}

/// A slot of the id table.
#[derive(Debug, Default)]
struct IdSlot {
    generation: u32,
    data: Option<IdData>,
}

#[derive(Debug, Default, Clone, Copy)]
struct ConnRecord {
    /// Messages of each kind sent so far on the connection (fault rules' `nth`).
    sent: [u32; 8],
}

/// Arrival counters: each counts what came to a channel (CM events, its close) or to
/// a node's device (asynchronous events, receive completions), bumped under the lock and
/// read without it, so that a reader that found its queue empty looks again only once
/// something came. Channels and nodes share the counters by index (modulo their half):
/// two that share one only look more often.
#[derive(Debug)]
pub(crate) struct Arrivals([AtomicU64; 2 * Arrivals::HALF]);

impl Default for Arrivals {
    fn default() -> Self {
        Arrivals(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl Arrivals {
    const HALF: usize = 32;

    /// The counter of `channel`.
    pub(crate) fn channel(&self, channel: usize) -> u64 {
        self.0[channel % Self::HALF].load(Ordering::Acquire)
    }

    /// The counter of `node`'s device.
    pub(crate) fn node(&self, node: NodeId) -> u64 {
        self.0[Self::HALF + node.0 as usize % Self::HALF].load(Ordering::Acquire)
    }

    /// Called under the fabric's lock (no two bumps race).
    fn bump(&self, index: usize) {
        let counter = &self.0[index];
        counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Release);
    }

    fn bump_channel(&self, channel: usize) {
        self.bump(channel % Self::HALF);
    }

    fn bump_node(&self, node: NodeId) {
        self.bump(Self::HALF + node.0 as usize % Self::HALF);
    }
}

/// The whole simulated fabric.
#[derive(Debug)]
pub(crate) struct Fabric {
    /// Shared with the handles, which read it without the lock.
    pub(crate) arrivals: Arc<Arrivals>,
    pub(crate) config: SimConfig,
    now: u64,
    queue: Schedule<Action>,
    /// The messages in flight.
    wire: Slots<Message>,
    /// The private data the messages, events and ids refer to.
    privates: PrivateBytes,
    /// The payloads of data messages on the wire or waiting in a completion queue (a
    /// data message's `private` names its slot here when its length is not 0). Freed
    /// once read, polled, or the message lost: unlike CM private data, every payload
    /// differs, and a scale run sends millions.
    payloads: Slots<Box<[u8]>>,
    rng: SplitMix64,
    nodes: Vec<Node>,
    channels: Vec<Channel>,
    ids: Chunked<IdSlot>,
    free_ids: Vec<u32>,
    /// Ids destroyed so far: an id's QP number stays what it was read as while this
    /// does (it is set once, and cleared only with the id).
    ids_destroyed: u64,
    qps: Chunked<Qp>,
    conns: Chunked<ConnRecord>,
    /// (node, port) → listening id; a handful at most, so a list.
    listeners: Vec<((NodeId, u16), SimIdKey)>,
    /// (active node, active id) → passive id: detects duplicate REQs.
    remote_reqs: ReqTable,
    rules: Vec<FaultRule>,
    odds: [FaultOdds; 8],
    any_odds: bool,
    pub(crate) trace: Option<Trace>,
    pub(crate) stats: SimStats,
}

fn os(op: &'static str, e: i32) -> CmError {
    CmError::Os {
        op,
        errno: Errno(e),
    }
}

fn gone(op: &'static str) -> CmError {
    CmError::Gone { op, what: "id" }
}

impl Fabric {
    pub(crate) fn new(config: SimConfig, seed: u64) -> Self {
        let trace = config.trace.then(Trace::default);
        Fabric {
            arrivals: Arc::default(),
            config,
            now: 0,
            queue: Schedule::default(),
            wire: Slots::default(),
            privates: PrivateBytes::default(),
            payloads: Slots::default(),
            rng: SplitMix64::new(seed),
            nodes: Vec::new(),
            channels: Vec::new(),
            ids: Chunked::default(),
            free_ids: Vec::new(),
            ids_destroyed: 0,
            qps: Chunked::default(),
            conns: Chunked::default(),
            listeners: Vec::new(),
            remote_reqs: ReqTable::default(),
            rules: Vec::new(),
            odds: [FaultOdds::default(); 8],
            any_odds: false,
            trace,
            stats: SimStats::default(),
        }
    }

    // ----- bookkeeping -------------------------------------------------------------

    pub(crate) fn now(&self) -> Duration {
        Duration::from_nanos(self.now)
    }

    fn record(&mut self, event: impl FnOnce() -> TraceEvent) {
        if let Some(trace) = &mut self.trace {
            trace.entries.push(TraceEntry {
                at: Duration::from_nanos(self.now),
                event: event(),
            });
        }
    }

    /// Schedules `action` after a configured delay (one that recurs).
    fn schedule(&mut self, delay: u64, action: Action) {
        self.queue.push_fixed(self.now, delay, action);
    }

    /// Schedules `action` after a delay that varies from message to message (random
    /// or per-rule fault delays), so it does not claim a lane of its own.
    fn schedule_irregular(&mut self, delay: u64, action: Action) {
        self.queue.push_at(self.now.saturating_add(delay), action);
    }

    pub(crate) fn pending(&self) -> usize {
        self.queue.len()
    }

    pub(crate) fn add_node(&mut self, kind: DeviceKind) -> NodeId {
        self.nodes.push(Node {
            kind,
            ..Node::default()
        });
        NodeId((self.nodes.len() - 1) as u32)
    }

    pub(crate) fn node_exists(&self, node: NodeId) -> bool {
        (node.0 as usize) < self.nodes.len()
    }

    /// The node `node` names, for the call `op`.
    fn node_mut(&mut self, node: NodeId, op: &'static str) -> Result<&mut Node, CmError> {
        self.nodes
            .get_mut(node.0 as usize)
            .ok_or(CmError::InvalidArgument {
                op,
                reason: "no such node",
            })
    }

    pub(crate) fn set_qp_budget(
        &mut self,
        node: NodeId,
        budget: Option<u32>,
    ) -> Result<(), CmError> {
        self.node_mut(node, "set_qp_budget")?.qp_budget = budget;
        Ok(())
    }

    pub(crate) fn set_going_down(&mut self, node: NodeId, going_down: bool) -> Result<(), CmError> {
        self.node_mut(node, "set_going_down")?.going_down = going_down;
        Ok(())
    }

    /// The node's device goes away, as `rdma link delete` does: every id bound to it
    /// gets RDMA_CM_EVENT_DEVICE_REMOVAL (the kernel then waits for the ids to be
    /// destroyed), and COMM_EST notifies answer ENODEV from now on.
    pub(crate) fn remove_device(&mut self, node: NodeId) -> Result<usize, CmError> {
        self.set_going_down(node, true)?;
        let keys: Vec<SimIdKey> = self
            .ids
            .iter()
            .enumerate()
            .filter_map(|(index, slot)| {
                let id = slot.data.as_ref()?;
                (id.node == node && id.device).then_some(SimIdKey {
                    index: index as u32,
                    generation: slot.generation,
                })
            })
            .collect();
        for &key in &keys {
            let event = QueuedKind::Event(CmEventType::DeviceRemoval);
            self.push_event(key, None, event, 0, Private::default());
        }
        Ok(keys.len())
    }

    pub(crate) fn add_channel(&mut self, node: NodeId) -> usize {
        self.channels.push(Channel {
            node,
            queue: VecDeque::new(),
            closed: false,
        });
        self.channels.len() - 1
    }

    pub(crate) fn channel_node(&self, channel: usize) -> NodeId {
        self.channels[channel].node
    }

    pub(crate) fn add_rule(&mut self, rule: FaultRule) {
        self.rules.push(rule);
    }

    pub(crate) fn clear_rules(&mut self) {
        self.rules.clear();
    }

    pub(crate) fn set_odds(&mut self, kind: MsgKind, odds: FaultOdds) {
        self.odds[kind.index()] = odds;
        self.any_odds = self.odds.iter().any(|o| !o.is_zero());
    }

    /// The id listening on `at`.
    fn listener(&self, at: (NodeId, u16)) -> Option<SimIdKey> {
        self.listeners
            .iter()
            .find_map(|&(on, key)| (on == at).then_some(key))
    }

    fn id(&self, key: SimIdKey) -> Option<&IdData> {
        let slot = self.ids.get(key.index as usize)?;
        if slot.generation == key.generation {
            slot.data.as_ref()
        } else {
            None
        }
    }

    fn id_mut(&mut self, key: SimIdKey) -> Option<&mut IdData> {
        let slot = self.ids.get_mut(key.index as usize)?;
        if slot.generation == key.generation {
            slot.data.as_mut()
        } else {
            None
        }
    }

    fn live(&mut self, key: SimIdKey, op: &'static str) -> Result<&mut IdData, CmError> {
        self.id_mut(key).ok_or_else(|| gone(op))
    }

    pub(crate) fn is_alive(&self, key: SimIdKey) -> bool {
        self.id(key).is_some()
    }

    pub(crate) fn create_id(&mut self, channel: usize) -> SimIdKey {
        let data = IdData {
            node: self.channels[channel].node,
            channel: channel as u32,
            device: false,
            cm_state: CmIdState::Idle,
            ib: None,
            qp: MaybeQp::NONE,
            conn: MaybeConn::NONE,
            port: 0,
            dst: None,
            remote: None,
            remote_qp: MaybeQp::NONE,
            timer_gen: 0,
            context: u32::MAX,
            retrying: None,
            retries_left: 0,
            mra_timeout: false,
            private: Private::default(),
            peer_private: Private::default(),
            unacked: 0,
            from_req: false,
            lap: LapState::Uninit,
        };
        if let Some(index) = self.free_ids.pop() {
            let slot = self
                .ids
                .get_mut(index as usize)
                .expect("a freed slot exists");
            slot.data = Some(data);
            SimIdKey {
                index,
                generation: slot.generation,
            }
        } else {
            self.ids.push(IdSlot {
                generation: 0,
                data: Some(data),
            });
            SimIdKey {
                index: (self.ids.len() - 1) as u32,
                generation: 0,
            }
        }
    }

    fn set_ib(&mut self, key: SimIdKey, to: IbCmState) {
        let Some(id) = self.id_mut(key) else { return };
        let from = id.ib.replace(to);
        let conn = id.conn.get();
        if from != Some(to) {
            self.record(|| TraceEvent::State {
                id: key,
                conn,
                from,
                to,
            });
        }
    }

    /// Queues a CM event on the id's channel, subject to the RDMA CM's filter: IB CM
    /// events reach the application only while the id is connecting (RDMA_CM_CONNECT),
    /// TIMEWAIT_EXIT only while it is disconnecting.
    fn queue_cm_event(&mut self, key: SimIdKey, kind: QueuedKind, status: i32, private: Private) {
        let Some(id) = self.id(key) else { return };
        let wanted = match kind {
            QueuedKind::Event(CmEventType::TimewaitExit) => id.cm_state == CmIdState::Disconnect,
            _ => id.cm_state == CmIdState::Connect,
        };
        if wanted {
            self.push_event(key, None, kind, status, private);
        }
    }

    fn push_event(
        &mut self,
        key: SimIdKey,
        listen_id: Option<SimIdKey>,
        kind: QueuedKind,
        status: i32,
        private: Private,
    ) {
        let Some(id) = self.id(key) else { return };
        let (channel, conn) = (id.channel as usize, id.conn.get());
        self.arrivals.bump_channel(channel);
        self.channels[channel].queue.push_back(QueuedEvent {
            id: key,
            listen_id,
            kind,
            status,
            private,
        });
        self.stats.events_queued += 1;
        if let QueuedKind::Event(event) = kind {
            self.record(|| TraceEvent::CmEvent {
                id: key,
                conn,
                event,
                status,
            });
        }
    }

    // ----- timers ------------------------------------------------------------------

    fn cancel_timer(&mut self, key: SimIdKey) {
        if let Some(id) = self.id_mut(key) {
            id.timer_gen = id.timer_gen.wrapping_add(1);
            id.retrying = None;
        }
    }

    fn start_retry(&mut self, key: SimIdKey, kind: MsgKind) {
        let timeout = nanos(self.config.cm_response_timeout);
        let retries = self.config.max_cm_retries;
        let Some(id) = self.id_mut(key) else { return };
        id.timer_gen = id.timer_gen.wrapping_add(1);
        id.retrying = Some(kind);
        id.retries_left = retries;
        id.mra_timeout = false;
        let gen = id.timer_gen;
        self.schedule(timeout, Action::Timer { id: key, gen });
    }

    /// An MRA: the peer needs more time; the pending message's timeout becomes the
    /// MRA's service timeout (for this and later retries).
    fn extend_retry(&mut self, key: SimIdKey) {
        let timeout = nanos(self.config.mra_service_timeout);
        let Some(id) = self.id_mut(key) else { return };
        id.timer_gen = id.timer_gen.wrapping_add(1);
        id.mra_timeout = true;
        let gen = id.timer_gen;
        self.schedule(timeout, Action::Timer { id: key, gen });
    }

    fn enter_timewait(&mut self, key: SimIdKey) {
        self.set_ib(key, IbCmState::Timewait);
        let timewait = nanos(self.config.timewait);
        let Some(id) = self.id_mut(key) else { return };
        id.timer_gen = id.timer_gen.wrapping_add(1);
        id.retrying = None;
        let gen = id.timer_gen;
        self.schedule(timewait, Action::Timer { id: key, gen });
    }

    fn set_qp_state(&mut self, qp: Option<QpNum>, state: QpState) {
        if let Some(qp) = qp.and_then(|q| self.qp_mut(q)) {
            if qp.alive {
                qp.state = state;
            }
        }
    }

    fn qp_mut(&mut self, qp: QpNum) -> Option<&mut Qp> {
        let index = qp.0.checked_sub(FIRST_QPN)? as usize;
        self.qps.get_mut(index)
    }

    fn qp(&self, qp: QpNum) -> Option<&Qp> {
        let index = qp.0.checked_sub(FIRST_QPN)? as usize;
        self.qps.get(index)
    }
}

#[cfg(test)]
mod tests {
    use super::PrivateBytes;
    use crate::sim::{SimChannel, SimConfig, SimFabric, SimPair};
    use cm_core::{CmEvent, CmEventSource, CmEventType};

    #[test]
    fn private_bytes_store_once_and_reuse_a_repeat() {
        let mut store = PrivateBytes::default();
        let empty = store.store(b"");
        let a = store.store(b"hello");
        let again = store.store(b"hello");
        let b = store.store(b"bye");
        assert_eq!(store.get(empty), b"");
        assert_eq!((store.get(a), store.get(b)), (&b"hello"[..], &b"bye"[..]));
        assert_eq!(a, again);
        assert_eq!(store.bytes.len(), 8);
    }

    fn next(channel: &mut SimChannel, fabric: &SimFabric) -> crate::sim::SimCmEvent {
        fabric.run_until(|_| channel.queued() > 0);
        channel.try_next_event().unwrap().expect("an event")
    }

    /// Private data travels with REQ (CONNECT_REQUEST), REP (ESTABLISHED on the active
    /// side) and REJ (REJECTED), whatever other calls stored in between.
    #[test]
    fn private_data_reaches_the_peer_events() {
        let pair = SimPair::new(SimConfig::default(), 3);
        pair.listen(7).unwrap();
        let SimPair {
            fabric,
            server,
            client,
        } = pair;
        let (mut server_events, mut client_events) = (server.channel, client.channel);
        let mut actives = Vec::new();
        for data in [&b"first"[..], b"second"] {
            let id = client_events.create_id();
            id.resolve_addr(server.node.id(), 7).unwrap();
            let resolved = next(&mut client_events, &fabric);
            resolved.ack().unwrap();
            id.resolve_route().unwrap();
            next(&mut client_events, &fabric).ack().unwrap();
            id.create_qp().unwrap();
            id.connect(data).unwrap();
            let request = next(&mut server_events, &fabric);
            assert_eq!(request.event_type(), CmEventType::ConnectRequest);
            assert_eq!(request.private_data(), data);
            actives.push((id, request));
        }
        let (_, accepted) = actives.remove(0);
        let passive = accepted.id();
        accepted.ack().unwrap();
        passive.create_qp().unwrap();
        passive.accept(b"welcome").unwrap();
        let established = next(&mut client_events, &fabric);
        assert_eq!(established.event_type(), CmEventType::Established);
        assert_eq!(established.private_data(), b"welcome");
        established.ack().unwrap();
        let (_, refused) = actives.remove(0);
        let passive = refused.id();
        refused.ack().unwrap();
        passive.reject(b"full").unwrap();
        let rejected = next(&mut client_events, &fabric);
        assert_eq!(rejected.event_type(), CmEventType::Rejected);
        assert_eq!(rejected.private_data(), b"full");
    }
}
