//! The simulation's state and its rules: the IB CM state machine, the wire, the QPs.
//! Everything here runs under one `RefCell` borrow; the handles in `mod.rs` are thin.

use std::collections::VecDeque;
use std::time::Duration;

use cm_core::kernel_model::{ib_cm_notify, notify_delivers_established, LapState};
use cm_core::{
    errno, AsyncEvent, AsyncEventType, CmError, CmEventType, CmIdState, Errno, IbCmState,
    NotifyError, NotifyOutcome, QpNum,
};

use super::rng::SplitMix64;
use super::schedule::Schedule;
use super::tables::{Chunked, ReqTable, Slots};
use super::trace::{Trace, TraceEntry, TraceEvent};
use super::types::{
    ConnId, DeviceKind, FaultAction, FaultOdds, FaultRule, MsgKind, NodeId, RecvCompletion,
    SimConfig, SimIdKey, SimStats,
};

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
/// allocates nothing and the id and message tables need no drop pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Private {
    start: usize,
    len: usize,
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
        self.last = Private {
            start: self.bytes.len(),
            len: data.len(),
        };
        self.bytes.extend_from_slice(data);
        self.last
    }

    fn get(&self, private: Private) -> &[u8] {
        &self.bytes[private.start..private.start + private.len]
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
}

#[derive(Debug, Default)]
struct Node {
    kind: DeviceKind,
    going_down: bool,
    async_events: VecDeque<AsyncEvent>,
    /// Receive completions, each with the payload the sender gave (empty for
    /// length-only sends).
    completions: VecDeque<(RecvCompletion, Private)>,
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
    peer: Option<QpNum>,
    got_first_packet: bool,
    alive: bool,
}

/// One CM id: the rdma_cm id and its IB CM id together.
///
/// Laid out in order (`repr(C)`): the fields that nearly every event reads or writes
/// come first and, with the slot's generation, fill the slot's first cache line; the
/// ones only a few calls need (addresses, private data, retry count) follow on the
/// second. A run that outgrows the caches then pulls in one line per id per event.
#[derive(Debug)]
#[repr(C)]
struct IdData {
    node: NodeId,
    /// The channel's index (`u32`: ids are many, channels few).
    channel: u32,
    /// Events handed out and not yet acknowledged.
    unacked: u32,
    /// Bumped to cancel the pending timer.
    timer_gen: u32,
    conn: MaybeConn,
    qp: Option<QpNum>,
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
    // The second cache line.
    /// Created by a connection request (passive ids): `remote` is the REQ's sender,
    /// whose duplicate-REQ entry goes when this id does.
    from_req: bool,
    lap: LapState,
    retries_left: u32,
    port: u16,
    /// Where `resolve_addr` points.
    dst: Option<(NodeId, u16)>,
    remote_qp: Option<QpNum>,
    /// The private data of our REQ/REP (for retransmissions); the peer's REP data on the
    /// active side once the REP arrived.
    private: Private,
    peer_private: Private,
}

/// An optional connection number in four bytes (`u32::MAX`, never handed out, is
/// none): with it the hot half of [`IdData`] fits one cache line.
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

/// A slot of the id table: two cache lines, aligned so the hot half of [`IdData`] is
/// exactly one.
#[derive(Debug, Default)]
#[repr(C, align(64))]
struct IdSlot {
    generation: u32,
    data: Option<IdData>,
}

#[derive(Debug, Default, Clone, Copy)]
struct ConnRecord {
    /// Messages of each kind sent so far on the connection (fault rules' `nth`).
    sent: [u32; 8],
}

/// The whole simulated fabric.
#[derive(Debug)]
pub(crate) struct Fabric {
    pub(crate) config: SimConfig,
    now: u64,
    queue: Schedule<Action>,
    /// The messages in flight.
    wire: Slots<Message>,
    /// The private data the messages, events and ids refer to.
    privates: PrivateBytes,
    rng: SplitMix64,
    nodes: Vec<Node>,
    channels: Vec<Channel>,
    ids: Chunked<IdSlot>,
    free_ids: Vec<u32>,
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
            config,
            now: 0,
            queue: Schedule::default(),
            wire: Slots::default(),
            privates: PrivateBytes::default(),
            rng: SplitMix64::new(seed),
            nodes: Vec::new(),
            channels: Vec::new(),
            ids: Chunked::default(),
            free_ids: Vec::new(),
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

    pub(crate) fn set_going_down(&mut self, node: NodeId, going_down: bool) -> Result<(), CmError> {
        let n = self
            .nodes
            .get_mut(node.0 as usize)
            .ok_or(CmError::InvalidArgument {
                op: "set_going_down",
                reason: "no such node",
            })?;
        n.going_down = going_down;
        Ok(())
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
            qp: None,
            conn: MaybeConn::NONE,
            port: 0,
            dst: None,
            remote: None,
            remote_qp: None,
            timer_gen: 0,
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

    // ----- the wire ----------------------------------------------------------------

    fn send(&mut self, msg: Message) {
        let kind = msg.kind;
        let conn = msg.conn;
        self.stats.sent[kind.index()] += 1;
        if msg.retransmit {
            self.stats.retransmissions += 1;
        }
        self.record(|| TraceEvent::Sent {
            kind,
            conn,
            from: msg.from,
            to: msg.to,
            retransmit: msg.retransmit,
        });
        let nth = match conn {
            Some(c) => {
                let record = self
                    .conns
                    .get_mut(c.0 as usize)
                    .expect("a connection's record");
                let n = record.sent[kind.index()];
                record.sent[kind.index()] = n.saturating_add(1);
                n
            }
            None => 0,
        };
        let mut fault = self
            .rules
            .iter()
            .find(|r| r.matches(kind, conn, nth))
            .map(|r| r.action);
        if fault.is_none() && self.any_odds {
            fault = self.draw_fault(kind);
        }
        let latency = nanos(self.config.wire_latency);
        match fault {
            None => {
                let slot = self.wire.put(msg);
                self.schedule(latency, Action::Deliver(slot));
            }
            Some(action) => {
                self.record(|| TraceEvent::Fault { kind, conn, action });
                match action {
                    FaultAction::Drop => self.stats.dropped += 1,
                    FaultAction::Duplicate => {
                        self.stats.duplicated += 1;
                        let mut copy = msg.clone();
                        copy.copy = true;
                        let (slot, copy) = (self.wire.put(msg), self.wire.put(copy));
                        self.schedule(latency, Action::Deliver(slot));
                        self.schedule(latency.saturating_mul(2), Action::Deliver(copy));
                    }
                    FaultAction::Delay(extra) => {
                        self.stats.delayed += 1;
                        let slot = self.wire.put(msg);
                        self.schedule_irregular(
                            latency.saturating_add(nanos(extra)),
                            Action::Deliver(slot),
                        );
                    }
                    FaultAction::Reorder => {
                        self.stats.delayed += 1;
                        let extra = self.rng.up_to(nanos(self.config.reorder_window));
                        let slot = self.wire.put(msg);
                        self.schedule_irregular(
                            latency.saturating_add(extra),
                            Action::Deliver(slot),
                        );
                    }
                }
            }
        }
    }

    fn draw_fault(&mut self, kind: MsgKind) -> Option<FaultAction> {
        let odds = self.odds[kind.index()];
        if odds.is_zero() {
            return None;
        }
        if self.rng.chance(odds.drop) {
            Some(FaultAction::Drop)
        } else if self.rng.chance(odds.duplicate) {
            Some(FaultAction::Duplicate)
        } else if self.rng.chance(odds.delay) {
            let d = self.rng.up_to(nanos(odds.max_delay));
            Some(FaultAction::Delay(Duration::from_nanos(d)))
        } else if self.rng.chance(odds.reorder) {
            Some(FaultAction::Reorder)
        } else {
            None
        }
    }

    /// Builds the message `kind` from id `key` to its peer.
    fn to_peer(&self, key: SimIdKey, kind: MsgKind) -> Option<Message> {
        let id = self.id(key)?;
        let (peer_node, peer) = id.remote?;
        let mut msg = Message::new(kind, id.conn.get(), id.node, peer_node);
        msg.src = MaybeKey(key);
        msg.dst = MaybeKey(peer);
        Some(msg)
    }

    fn send_to_peer(&mut self, key: SimIdKey, kind: MsgKind, value: i32) {
        if let Some(mut msg) = self.to_peer(key, kind) {
            msg.value = value;
            self.send(msg);
        }
    }

    fn send_req(&mut self, key: SimIdKey, retransmit: bool) {
        let Some(id) = self.id(key) else { return };
        let Some((to, port)) = id.dst else { return };
        let mut msg = Message::new(MsgKind::Req, id.conn.get(), id.node, to);
        msg.src = MaybeKey(key);
        msg.qp = id.qp.unwrap_or(QpNum(0));
        msg.port = port;
        msg.private = id.private;
        msg.retransmit = retransmit;
        self.send(msg);
    }

    fn send_rep(&mut self, key: SimIdKey, retransmit: bool) {
        let Some(mut msg) = self.to_peer(key, MsgKind::Rep) else {
            return;
        };
        let Some(id) = self.id(key) else { return };
        msg.qp = id.qp.unwrap_or(QpNum(0));
        msg.private = id.private;
        msg.retransmit = retransmit;
        self.send(msg);
    }

    fn resend(&mut self, key: SimIdKey, kind: MsgKind) {
        match kind {
            MsgKind::Req => self.send_req(key, true),
            MsgKind::Rep => self.send_rep(key, true),
            other => {
                if let Some(mut msg) = self.to_peer(key, other) {
                    msg.retransmit = true;
                    self.send(msg);
                }
            }
        }
    }

    // ----- the clock ---------------------------------------------------------------

    pub(crate) fn next_due(&self) -> Option<u64> {
        self.queue.next_due()
    }

    pub(crate) fn set_now(&mut self, at: u64) {
        self.now = self.now.max(at);
    }

    pub(crate) fn now_nanos(&self) -> u64 {
        self.now
    }

    /// Runs the earliest scheduled action; `false` when there is none.
    pub(crate) fn step(&mut self) -> bool {
        let Some((at, action)) = self.queue.pop() else {
            return false;
        };
        self.now = self.now.max(at);
        match action {
            Action::Deliver(slot) => {
                if let Some(msg) = self.wire.take(slot) {
                    self.deliver(msg);
                }
            }
            Action::Timer { id, gen } => self.on_timer(id, gen),
            Action::AddrResolved(key) => {
                let resolved = self.id_mut(key).is_some_and(|id| {
                    let querying = id.cm_state == CmIdState::AddrQuery;
                    if querying {
                        id.cm_state = CmIdState::AddrResolved;
                        id.device = true;
                    }
                    querying
                });
                if resolved {
                    let ev = QueuedKind::Event(CmEventType::AddrResolved);
                    self.push_event(key, None, ev, 0, Private::default());
                }
            }
            Action::RouteResolved(key) => {
                let resolved = self.id_mut(key).is_some_and(|id| {
                    let querying = id.cm_state == CmIdState::RouteQuery;
                    if querying {
                        id.cm_state = CmIdState::RouteResolved;
                    }
                    querying
                });
                if resolved {
                    let ev = QueuedKind::Event(CmEventType::RouteResolved);
                    self.push_event(key, None, ev, 0, Private::default());
                }
            }
            Action::EstablishWork(key) => {
                // The kernel's work handler re-checks the state: a DREQ (or anything
                // else) that moved the id on suppresses the event.
                if self.id(key).and_then(|id| id.ib) == Some(IbCmState::Established) {
                    let ev = QueuedKind::Event(CmEventType::Established);
                    self.queue_cm_event(key, ev, 0, Private::default());
                }
            }
        }
        true
    }

    fn on_timer(&mut self, key: SimIdKey, gen: u32) {
        let timeouts = (
            self.config.cm_response_timeout,
            self.config.mra_service_timeout,
        );
        let Some(id) = self.id_mut(key) else { return };
        if id.timer_gen != gen {
            return;
        }
        let (retrying, retries_left, ib) = (id.retrying, id.retries_left, id.ib);
        let timeout = nanos(if id.mra_timeout {
            timeouts.1
        } else {
            timeouts.0
        });
        match retrying {
            None => {
                // TIMEWAIT is over.
                if ib == Some(IbCmState::Timewait) {
                    self.set_ib(key, IbCmState::Idle);
                    let ev = QueuedKind::Event(CmEventType::TimewaitExit);
                    self.queue_cm_event(key, ev, 0, Private::default());
                }
            }
            Some(kind) if retries_left > 0 => {
                id.retries_left -= 1;
                self.resend(key, kind);
                self.schedule(timeout, Action::Timer { id: key, gen });
            }
            Some(kind) => {
                id.retrying = None;
                match kind {
                    MsgKind::Req | MsgKind::Rep => {
                        // REQ_ERROR / REP_ERROR: the IB CM id goes back to IDLE (the
                        // kernel leaves a user-space QP alone).
                        self.set_ib(key, IbCmState::Idle);
                        let ev = QueuedKind::Event(CmEventType::Unreachable);
                        self.queue_cm_event(key, ev, -errno::ETIMEDOUT, Private::default());
                    }
                    _ => {
                        // DREQ_ERROR: TIMEWAIT, DISCONNECTED with -ETIMEDOUT.
                        self.enter_timewait(key);
                        self.disconnected(key, -errno::ETIMEDOUT);
                    }
                }
            }
        }
    }

    /// DREQ received / DREP received / DREQ timed out: one DISCONNECTED, moving the
    /// rdma_cm id from CONNECT to DISCONNECT (a second one finds DISCONNECT and is
    /// filtered).
    fn disconnected(&mut self, key: SimIdKey, status: i32) {
        let Some(id) = self.id_mut(key) else { return };
        if id.cm_state == CmIdState::Connect {
            id.cm_state = CmIdState::Disconnect;
            let ev = QueuedKind::Event(CmEventType::Disconnected);
            self.push_event(key, None, ev, status, Private::default());
        }
    }

    fn ignore(&mut self, msg: &Message, reason: &'static str) {
        self.stats.ignored += 1;
        let (kind, conn) = (msg.kind, msg.conn);
        self.record(|| TraceEvent::Ignored { kind, conn, reason });
    }

    fn deliver(&mut self, msg: Message) {
        self.stats.delivered[msg.kind.index()] += 1;
        let (kind, conn, to) = (msg.kind, msg.conn, msg.to);
        self.record(|| TraceEvent::Delivered { kind, conn, to });
        if msg.kind == MsgKind::Data {
            return self.deliver_data(msg);
        }
        if msg.kind == MsgKind::Req {
            return self.deliver_req(msg);
        }
        let Some(dst) = msg.dst.get().filter(|k| self.is_alive(*k)) else {
            return self.ignore(&msg, "no such id");
        };
        let state = self.id(dst).and_then(|id| id.ib);
        use IbCmState as S;
        match (msg.kind, state) {
            (MsgKind::Mra, Some(S::ReqSent)) if msg.value == MsgKind::Req.index() as i32 => {
                self.set_ib(dst, S::MraReqRcvd);
                self.extend_retry(dst);
            }
            (MsgKind::Mra, Some(S::RepSent)) if msg.value == MsgKind::Rep.index() as i32 => {
                self.set_ib(dst, S::MraRepRcvd);
                self.extend_retry(dst);
            }
            (MsgKind::Rep, Some(S::ReqSent | S::MraReqRcvd)) => self.rep_received(dst, msg),
            // A duplicate REP: the passive side did not get our RTU (resend it) or is
            // waiting for us (tell it so with the delayed MRA).
            (MsgKind::Rep, Some(S::Established)) => self.send_to_peer(dst, MsgKind::Rtu, 0),
            (MsgKind::Rep, Some(S::MraRepSent)) => {
                self.send_to_peer(dst, MsgKind::Mra, MsgKind::Rep.index() as i32)
            }
            (MsgKind::Rtu, Some(S::RepSent | S::MraRepRcvd)) => {
                self.cancel_timer(dst);
                self.set_ib(dst, S::Established);
                let ev = QueuedKind::Event(CmEventType::Established);
                self.queue_cm_event(dst, ev, 0, Private::default());
            }
            (MsgKind::Rtu, Some(S::Established)) => {
                self.stats.late_rtus += 1;
                self.ignore(&msg, "late RTU: already ESTABLISHED (counted as duplicate)");
            }
            (MsgKind::Dreq, Some(S::RepSent | S::MraRepRcvd | S::DreqSent | S::Established)) => {
                self.cancel_timer(dst);
                self.set_ib(dst, S::DreqRcvd);
                self.disconnected(dst, 0);
            }
            (MsgKind::Dreq, Some(S::Timewait)) => self.send_to_peer(dst, MsgKind::Drep, 0),
            (MsgKind::Drep, Some(S::DreqSent | S::DreqRcvd)) => {
                self.enter_timewait(dst);
                self.disconnected(dst, 0);
            }
            (MsgKind::Rej, Some(state)) => self.rej_received(dst, state, msg),
            _ => self.ignore(&msg, "the id's state does not take this message"),
        }
    }

    /// cm_rej_handler: back to IDLE while connecting (TIMEWAIT for a stale-connection
    /// REJ), TIMEWAIT once the REP was received or the connection established; the RDMA
    /// CM reports REJECTED (status = the reason) and librdmacm moves the QP to error.
    fn rej_received(&mut self, key: SimIdKey, state: IbCmState, msg: Message) {
        use IbCmState as S;
        let lap = self.id(key).map_or(LapState::Uninit, |id| id.lap);
        let timewait = match state {
            S::ReqSent
            | S::MraReqRcvd
            | S::RepSent
            | S::MraRepRcvd
            | S::ReqRcvd
            | S::MraReqSent => msg.value == REJ_STALE_CONN,
            S::DreqSent | S::RepRcvd | S::MraRepSent => true,
            S::Established if lap == LapState::Uninit => true,
            _ => return self.ignore(&msg, "the id's state does not take a REJ"),
        };
        self.cancel_timer(key);
        if timewait {
            self.enter_timewait(key);
        } else {
            self.set_ib(key, S::Idle);
        }
        let qp = self.id(key).and_then(|id| id.qp);
        self.set_qp_state(qp, QpState::Error);
        let ev = QueuedKind::Event(CmEventType::Rejected);
        self.queue_cm_event(key, ev, msg.value, msg.private);
    }

    fn deliver_req(&mut self, msg: Message) {
        let Some(src) = msg.src.get() else {
            return self.ignore(&msg, "REQ without sender");
        };
        if let Some(existing) = self.remote_reqs.get(msg.from, src) {
            // A retried REQ: answer with the delayed MRA if the application has not
            // accepted yet, else ignore it.
            match self.id(existing).and_then(|id| id.ib) {
                Some(IbCmState::MraReqSent) => {
                    self.send_to_peer(existing, MsgKind::Mra, MsgKind::Req.index() as i32)
                }
                Some(IbCmState::Timewait) => {
                    self.send_to_peer(existing, MsgKind::Rej, REJ_STALE_CONN)
                }
                _ => self.ignore(&msg, "duplicate REQ"),
            }
            return;
        }
        let listener = self
            .listener((msg.to, msg.port))
            .filter(|l| self.id(*l).and_then(|id| id.ib) == Some(IbCmState::Listen));
        let Some(listener) = listener else {
            let mut rej = Message::new(MsgKind::Rej, msg.conn, msg.to, msg.from);
            rej.dst = MaybeKey(src);
            rej.value = REJ_INVALID_SERVICE_ID;
            self.send(rej);
            return;
        };
        let channel = self.id(listener).map_or(0, |l| l.channel as usize);
        let key = self.create_id(channel);
        if let Some(id) = self.id_mut(key) {
            id.device = true;
            id.cm_state = CmIdState::Connect;
            id.conn = MaybeConn::new(msg.conn);
            id.port = msg.port;
            id.remote = Some((msg.from, src));
            id.remote_qp = Some(msg.qp);
            id.from_req = true;
        }
        self.remote_reqs.insert(msg.from, src, key);
        self.set_ib(key, IbCmState::ReqRcvd);
        let ev = QueuedKind::Event(CmEventType::ConnectRequest);
        self.push_event(key, Some(listener), ev, 0, msg.private);
        if self.config.delayed_mra {
            self.set_ib(key, IbCmState::MraReqSent);
        }
    }

    fn rep_received(&mut self, key: SimIdKey, msg: Message) {
        self.cancel_timer(key);
        if let Some(id) = self.id_mut(key) {
            id.remote = Some((msg.from, msg.src.get().unwrap_or(key)));
            id.remote_qp = Some(msg.qp);
            id.peer_private = msg.private;
        }
        self.set_ib(key, IbCmState::RepRcvd);
        if self.config.delayed_mra {
            self.set_ib(key, IbCmState::MraRepSent);
        }
        // librdmacm turns this into QP transitions + RTU + ESTABLISHED when the
        // application reads it.
        self.queue_cm_event(key, QueuedKind::ConnectResponse, 0, Private::default());
    }

    fn deliver_data(&mut self, msg: Message) {
        if msg.copy {
            // RC transport: the packet sequence number check discards the copy.
            return self.ignore(&msg, "duplicate packet (RC sequence check)");
        }
        let Some(qp) = self.qp(msg.qp) else {
            return self.ignore(&msg, "no such QP");
        };
        if !qp.alive || qp.state != QpState::Rts {
            return self.ignore(&msg, "QP not ready to receive");
        }
        let (node, owner, first) = (qp.node, qp.owner, !qp.got_first_packet);
        if let Some(qp) = self.qp_mut(msg.qp) {
            qp.got_first_packet = true;
        }
        let completion = RecvCompletion {
            qp: msg.qp,
            byte_len: msg.value.max(0) as u32,
        };
        self.nodes[node.0 as usize]
            .completions
            .push_back((completion, msg.private));
        self.stats.recv_completions += 1;
        let qpn = msg.qp;
        self.record(|| TraceEvent::RecvCompletion { node, qp: qpn });
        let cm_waiting = matches!(
            self.id(owner).and_then(|id| id.ib),
            Some(IbCmState::RepSent | IbCmState::MraRepRcvd)
        );
        if first && cm_waiting && self.config.comm_est {
            let event = AsyncEvent::qp(AsyncEventType::CommEst, msg.qp);
            self.nodes[node.0 as usize].async_events.push_back(event);
            self.stats.comm_est_raised += 1;
            self.record(|| TraceEvent::AsyncEvent { node, event });
        }
    }

    // ----- verbs -------------------------------------------------------------------

    pub(crate) fn next_async_event(&mut self, node: NodeId) -> Option<AsyncEvent> {
        self.nodes
            .get_mut(node.0 as usize)?
            .async_events
            .pop_front()
    }

    pub(crate) fn poll_cq(&mut self, node: NodeId) -> Option<RecvCompletion> {
        self.nodes
            .get_mut(node.0 as usize)?
            .completions
            .pop_front()
            .map(|(completion, _)| completion)
    }

    /// The next receive completion and its payload, appended to `out`.
    pub(crate) fn poll_cq_data(
        &mut self,
        node: NodeId,
        out: &mut Vec<u8>,
    ) -> Option<RecvCompletion> {
        let (completion, payload) = self
            .nodes
            .get_mut(node.0 as usize)?
            .completions
            .pop_front()?;
        out.extend_from_slice(self.privates.get(payload));
        Some(completion)
    }

    /// Whether the node's device has asynchronous events or completions waiting.
    pub(crate) fn device_pending(&self, node: NodeId) -> bool {
        self.nodes
            .get(node.0 as usize)
            .is_some_and(|n| !n.async_events.is_empty() || !n.completions.is_empty())
    }

    pub(crate) fn raise_async_event(&mut self, node: NodeId, event: AsyncEvent) {
        if let Some(n) = self.nodes.get_mut(node.0 as usize) {
            n.async_events.push_back(event);
            self.record(|| TraceEvent::AsyncEvent { node, event });
        }
    }

    pub(crate) fn create_qp(&mut self, key: SimIdKey) -> Result<QpNum, CmError> {
        const OP: &str = "rdma_create_qp";
        let qpn = QpNum(FIRST_QPN + self.qps.len() as u32);
        let id = self.live(key, OP)?;
        if !id.device {
            return Err(os(OP, errno::EINVAL));
        }
        if id.qp.is_some() {
            return Err(os(OP, errno::EBUSY));
        }
        id.qp = Some(qpn);
        let node = id.node;
        self.qps.push(Qp {
            node,
            owner: key,
            state: QpState::Init,
            peer: None,
            got_first_packet: false,
            alive: true,
        });
        Ok(qpn)
    }

    pub(crate) fn post_send(&mut self, key: SimIdKey, len: u32) -> Result<(), CmError> {
        self.post_send_payload(key, len, Private::default())
    }

    /// A SEND carrying `data` (stored once, like private data: the store grows with
    /// every distinct payload, which suits tests, not long soaks).
    pub(crate) fn post_send_data(&mut self, key: SimIdKey, data: &[u8]) -> Result<(), CmError> {
        let len = u32::try_from(data.len()).map_err(|_| os("ibv_post_send", errno::EINVAL))?;
        self.live(key, "ibv_post_send")?;
        let payload = self.privates.store(data);
        self.post_send_payload(key, len, payload)
    }

    fn post_send_payload(
        &mut self,
        key: SimIdKey,
        len: u32,
        payload: Private,
    ) -> Result<(), CmError> {
        const OP: &str = "ibv_post_send";
        let id = self.live(key, OP)?;
        let (conn, node) = (id.conn.get(), id.node);
        let qpn = id.qp.ok_or(os(OP, errno::EINVAL))?;
        let qp = self.qp(qpn).ok_or(os(OP, errno::EINVAL))?;
        if !qp.alive || qp.state != QpState::Rts {
            return Err(os(OP, errno::EINVAL));
        }
        let peer = qp.peer.ok_or(os(OP, errno::EINVAL))?;
        let to = self.qp(peer).map_or(node, |q| q.node);
        let mut msg = Message::new(MsgKind::Data, conn, node, to);
        msg.qp = peer;
        msg.value = i32::try_from(len).unwrap_or(i32::MAX);
        msg.private = payload;
        self.send(msg);
        Ok(())
    }

    pub(crate) fn qp_state(&self, key: SimIdKey) -> Option<QpState> {
        let qp = self.id(key)?.qp?;
        self.qp(qp).filter(|q| q.alive).map(|q| q.state)
    }

    // ----- rdma_cm calls -----------------------------------------------------------

    pub(crate) fn bind(&mut self, key: SimIdKey, port: u16) -> Result<(), CmError> {
        const OP: &str = "rdma_bind_addr";
        let id = self.live(key, OP)?;
        if id.cm_state != CmIdState::Idle {
            return Err(os(OP, errno::EINVAL));
        }
        id.cm_state = CmIdState::AddrBound;
        id.device = true;
        id.port = port;
        Ok(())
    }

    pub(crate) fn listen(&mut self, key: SimIdKey) -> Result<(), CmError> {
        const OP: &str = "rdma_listen";
        let id = self.live(key, OP)?;
        if id.cm_state != CmIdState::AddrBound {
            return Err(os(OP, errno::EINVAL));
        }
        let at = (id.node, id.port);
        if self.listener(at).is_some() {
            return Err(os(OP, EADDRINUSE));
        }
        if let Some(id) = self.id_mut(key) {
            id.cm_state = CmIdState::Listen;
        }
        self.listeners.push((at, key));
        self.set_ib(key, IbCmState::Listen);
        Ok(())
    }

    pub(crate) fn resolve_addr(
        &mut self,
        key: SimIdKey,
        to: NodeId,
        port: u16,
    ) -> Result<(), CmError> {
        const OP: &str = "rdma_resolve_addr";
        if !self.node_exists(to) {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "no such node",
            });
        }
        let delay = nanos(self.config.resolve_delay);
        let id = self.live(key, OP)?;
        if !matches!(id.cm_state, CmIdState::Idle | CmIdState::AddrBound) {
            return Err(os(OP, errno::EINVAL));
        }
        id.cm_state = CmIdState::AddrQuery;
        id.dst = Some((to, port));
        self.schedule(delay, Action::AddrResolved(key));
        Ok(())
    }

    pub(crate) fn resolve_route(&mut self, key: SimIdKey) -> Result<(), CmError> {
        const OP: &str = "rdma_resolve_route";
        let delay = nanos(self.config.resolve_delay);
        let id = self.live(key, OP)?;
        if id.cm_state != CmIdState::AddrResolved {
            return Err(os(OP, errno::EINVAL));
        }
        id.cm_state = CmIdState::RouteQuery;
        self.schedule(delay, Action::RouteResolved(key));
        Ok(())
    }

    pub(crate) fn connect(&mut self, key: SimIdKey, private: &[u8]) -> Result<ConnId, CmError> {
        const OP: &str = "rdma_connect";
        let conn = ConnId(self.conns.len() as u32);
        let private = self.privates.store(private);
        let id = self.live(key, OP)?;
        if id.cm_state != CmIdState::RouteResolved {
            return Err(os(OP, errno::EINVAL));
        }
        if id.qp.is_none() {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "the simulated fabric needs a QP before connect (rdma_create_qp)",
            });
        }
        id.cm_state = CmIdState::Connect;
        id.conn = MaybeConn::new(Some(conn));
        id.private = private;
        self.conns.push(ConnRecord::default());
        self.set_ib(key, IbCmState::ReqSent);
        self.send_req(key, false);
        self.start_retry(key, MsgKind::Req);
        Ok(conn)
    }

    pub(crate) fn accept(&mut self, key: SimIdKey, private: &[u8]) -> Result<(), CmError> {
        const OP: &str = "rdma_accept";
        let private = self.privates.store(private);
        let id = self.live(key, OP)?;
        if !matches!(id.ib, Some(IbCmState::ReqRcvd | IbCmState::MraReqSent)) {
            return Err(os(OP, errno::EINVAL));
        }
        let qp = id.qp.ok_or(CmError::InvalidArgument {
            op: OP,
            reason: "the simulated fabric needs a QP before accept (rdma_create_qp)",
        })?;
        id.private = private;
        let peer = id.remote_qp;
        // librdmacm moves the QP to RTR and RTS before it sends the REP.
        if let Some(q) = self.qp_mut(qp) {
            q.peer = peer;
            q.state = QpState::Rts;
        }
        self.set_ib(key, IbCmState::RepSent);
        self.send_rep(key, false);
        self.start_retry(key, MsgKind::Rep);
        Ok(())
    }

    pub(crate) fn reject(&mut self, key: SimIdKey, private: &[u8]) -> Result<(), CmError> {
        const OP: &str = "rdma_reject";
        let id = self.live(key, OP)?;
        if !matches!(id.ib, Some(IbCmState::ReqRcvd | IbCmState::MraReqSent)) {
            return Err(os(OP, errno::EINVAL));
        }
        if let Some(mut msg) = self.to_peer(key, MsgKind::Rej) {
            msg.value = REJ_CONSUMER_DEFINED;
            msg.private = self.privates.store(private);
            self.send(msg);
        }
        self.cancel_timer(key);
        self.set_ib(key, IbCmState::Idle);
        Ok(())
    }

    pub(crate) fn disconnect(&mut self, key: SimIdKey) -> Result<(), CmError> {
        const OP: &str = "rdma_disconnect";
        let id = self.live(key, OP)?;
        let (ib, qp) = (id.ib, id.qp);
        if ib.is_none() {
            return Err(os(OP, errno::EINVAL));
        }
        // librdmacm moves the QP to the error state first.
        self.set_qp_state(qp, QpState::Error);
        // DREQ from ESTABLISHED, else DREP from DREQ_RCVD, else nothing: the kernel's
        // rdma_disconnect ignores both sends' errors and returns 0.
        match ib {
            Some(IbCmState::Established) => {
                self.set_ib(key, IbCmState::DreqSent);
                self.send_to_peer(key, MsgKind::Dreq, 0);
                self.start_retry(key, MsgKind::Dreq);
            }
            Some(IbCmState::DreqRcvd) => {
                self.send_to_peer(key, MsgKind::Drep, 0);
                self.enter_timewait(key);
            }
            _ => {}
        }
        Ok(())
    }

    pub(crate) fn destroy(&mut self, key: SimIdKey) -> Result<(), CmError> {
        const OP: &str = "rdma_destroy_id";
        let id = self.live(key, OP)?;
        if id.unacked > 0 {
            return Err(CmError::UnackedEvents {
                op: OP,
                unacked: id.unacked as usize,
            });
        }
        let (ib, qp, node, port) = (id.ib, id.qp, id.node, id.port);
        let from_req = id.remote.filter(|_| id.from_req);
        // What ib_destroy_cm_id tells the peer, by state.
        use IbCmState as S;
        match ib {
            Some(S::Established) => self.send_to_peer(key, MsgKind::Dreq, 0),
            Some(S::DreqRcvd) => self.send_to_peer(key, MsgKind::Drep, 0),
            Some(S::ReqSent | S::MraReqRcvd) => self.send_to_peer_or_req(key, REJ_TIMEOUT),
            Some(
                S::ReqRcvd
                | S::MraReqSent
                | S::RepSent
                | S::MraRepRcvd
                | S::RepRcvd
                | S::MraRepSent,
            ) => self.send_to_peer(key, MsgKind::Rej, REJ_CONSUMER_DEFINED),
            _ => {}
        }
        if ib == Some(S::Listen) && self.listener((node, port)) == Some(key) {
            self.listeners.retain(|&(at, _)| at != (node, port));
        }
        if let Some(from) = from_req {
            self.remote_reqs.remove(from.0, from.1);
        }
        if let Some(q) = qp.and_then(|q| self.qp_mut(q)) {
            q.alive = false;
        }
        let slot = self
            .ids
            .get_mut(key.index as usize)
            .expect("a live id's slot");
        slot.data = None;
        slot.generation = slot.generation.wrapping_add(1);
        self.free_ids.push(key.index);
        Ok(())
    }

    /// REJ to the peer; an active id whose peer is not known yet (REQ_SENT) addresses
    /// the REJ by its own id, which the passive side's duplicate-REQ table knows.
    fn send_to_peer_or_req(&mut self, key: SimIdKey, reason: i32) {
        if self.id(key).is_some_and(|id| id.remote.is_some()) {
            self.send_to_peer(key, MsgKind::Rej, reason);
        } else if let Some(id) = self.id(key) {
            if let Some((to, _)) = id.dst {
                let mut msg = Message::new(MsgKind::Rej, id.conn.get(), id.node, to);
                msg.src = MaybeKey(key);
                msg.value = reason;
                // The passive id, if the REQ got there (as in the kernel, a REJ
                // overtaking its REQ finds no id and is dropped).
                msg.dst = MaybeKey::new(self.remote_reqs.get(id.node, key));
                self.send(msg);
            }
        }
    }

    pub(crate) fn channel_closed(&self, channel: usize) -> bool {
        self.channels.get(channel).is_none_or(|c| c.closed)
    }

    /// `rdma_destroy_event_channel`. Closing the channel's file makes the kernel destroy
    /// every id still on it (ucma_close), each telling its peer as `destroy` does. Refused
    /// while events of those ids are unacknowledged: their memory belongs to the channel.
    pub(crate) fn destroy_channel(&mut self, channel: usize) -> Result<(), CmError> {
        const OP: &str = "rdma_destroy_event_channel";
        if self.channel_closed(channel) {
            return Err(CmError::Gone {
                op: OP,
                what: "channel",
            });
        }
        let mut keys = Vec::new();
        let mut unacked = 0;
        for (index, slot) in self.ids.iter().enumerate() {
            if let Some(id) = slot
                .data
                .as_ref()
                .filter(|id| id.channel as usize == channel)
            {
                unacked += id.unacked as usize;
                keys.push(SimIdKey {
                    index: index as u32,
                    generation: slot.generation,
                });
            }
        }
        if unacked > 0 {
            return Err(CmError::UnackedEvents { op: OP, unacked });
        }
        for key in keys {
            self.destroy(key)?;
        }
        let closed = &mut self.channels[channel];
        closed.closed = true;
        self.stats.events_discarded += closed.queue.len() as u64;
        closed.queue.clear();
        Ok(())
    }

    pub(crate) fn migrate(&mut self, key: SimIdKey, channel: usize) -> Result<(), CmError> {
        const OP: &str = "rdma_migrate_id";
        if self.channel_closed(channel) {
            return Err(CmError::Gone {
                op: OP,
                what: "channel",
            });
        }
        let id = self.live(key, OP)?;
        if id.unacked > 0 {
            return Err(CmError::UnackedEvents {
                op: OP,
                unacked: id.unacked as usize,
            });
        }
        let old = id.channel as usize;
        id.channel = channel as u32;
        if old != channel {
            // Pending events follow the id (linear in the old queue, like the kernel).
            let queue = std::mem::take(&mut self.channels[old].queue);
            let (moving, staying): (VecDeque<_>, VecDeque<_>) =
                queue.into_iter().partition(|e| e.id == key);
            self.channels[old].queue = staying;
            self.channels[channel].queue.extend(moving);
        }
        Ok(())
    }

    pub(crate) fn notify(
        &mut self,
        key: SimIdKey,
        event: AsyncEventType,
    ) -> Result<NotifyOutcome, NotifyError> {
        let result = self.notify_inner(key, event);
        let conn = self.id(key).and_then(|id| id.conn.get());
        self.record(|| TraceEvent::Notify {
            id: key,
            conn,
            event,
            result,
        });
        result
    }

    fn notify_inner(
        &mut self,
        key: SimIdKey,
        event: AsyncEventType,
    ) -> Result<NotifyOutcome, NotifyError> {
        // ucma: a destroyed id's handle is unknown to the kernel.
        let Some(id) = self.id(key) else {
            return Err(NotifyError::UnknownId);
        };
        // ucma: no device bound yet; rdma_notify: no IB CM id attached.
        if !id.device {
            return Err(NotifyError::WrongState);
        }
        let Some(state) = id.ib else {
            return Err(NotifyError::WrongState);
        };
        let node = &self.nodes[id.node.0 as usize];
        if node.kind == DeviceKind::Iwarp {
            return Ok(NotifyOutcome::Established);
        }
        if event == AsyncEventType::CommEst && node.going_down {
            return Err(NotifyError::NoDevice);
        }
        let result = ib_cm_notify(state, id.lap, event);
        if result.is_ok() && notify_delivers_established(state, event) {
            self.cancel_timer(key);
            self.set_ib(key, IbCmState::Established);
            self.stats.forced_establishes += 1;
            let delay = nanos(self.config.establish_work_delay);
            self.schedule(delay, Action::EstablishWork(key));
        }
        result
    }

    // ----- event channels ----------------------------------------------------------

    pub(crate) fn next_event(&mut self, channel: usize) -> Option<ReadEvent> {
        loop {
            let queued = self.channels.get_mut(channel)?.queue.pop_front()?;
            if !self.is_alive(queued.id) {
                self.stats.events_discarded += 1;
                continue;
            }
            let (event_type, status, private) = match queued.kind {
                QueuedKind::Event(t) => (t, queued.status, queued.private),
                QueuedKind::ConnectResponse => self.process_connect_response(queued.id),
            };
            let id = self.id_mut(queued.id)?;
            id.unacked += 1;
            let qp = id.qp;
            self.stats.events_delivered += 1;
            return Some(ReadEvent {
                id: queued.id,
                listen_id: queued.listen_id,
                event_type,
                status,
                qp,
                private: self.privates.get(private).into(),
            });
        }
    }

    /// What librdmacm does with CONNECT_RESPONSE: QP to RTR and RTS, send the RTU
    /// (ucma accept), and report ESTABLISHED with the REP's private data.
    fn process_connect_response(&mut self, key: SimIdKey) -> (CmEventType, i32, Private) {
        let Some(id) = self.id_mut(key) else {
            return (
                CmEventType::ConnectError,
                -errno::EINVAL,
                Private::default(),
            );
        };
        let ready = matches!(id.ib, Some(IbCmState::RepRcvd | IbCmState::MraRepSent));
        if !ready || id.cm_state != CmIdState::Connect {
            return (
                CmEventType::ConnectError,
                -errno::EINVAL,
                Private::default(),
            );
        }
        let private = std::mem::take(&mut id.peer_private);
        let (qp, peer) = (id.qp, id.remote_qp);
        if let Some(q) = qp.and_then(|q| self.qp_mut(q)) {
            q.peer = peer;
            q.state = QpState::Rts;
        }
        self.send_to_peer(key, MsgKind::Rtu, 0);
        self.set_ib(key, IbCmState::Established);
        let conn = self.id(key).and_then(|id| id.conn.get());
        self.record(|| TraceEvent::CmEvent {
            id: key,
            conn,
            event: CmEventType::Established,
            status: 0,
        });
        (CmEventType::Established, 0, private)
    }

    pub(crate) fn ack(&mut self, key: SimIdKey) {
        if let Some(id) = self.id_mut(key) {
            id.unacked = id.unacked.saturating_sub(1);
        }
        self.stats.events_acked += 1;
    }

    pub(crate) fn channel_len(&self, channel: usize) -> usize {
        self.channels.get(channel).map_or(0, |c| c.queue.len())
    }

    // ----- inspection --------------------------------------------------------------

    pub(crate) fn ib_state(&self, key: SimIdKey) -> Result<Option<IbCmState>, CmError> {
        self.id(key).map(|id| id.ib).ok_or(gone("ib_state"))
    }

    pub(crate) fn cm_state(&self, key: SimIdKey) -> Result<CmIdState, CmError> {
        self.id(key).map(|id| id.cm_state).ok_or(gone("cm_state"))
    }

    pub(crate) fn id_qp(&self, key: SimIdKey) -> Option<QpNum> {
        self.id(key)?.qp
    }

    pub(crate) fn id_conn(&self, key: SimIdKey) -> Option<ConnId> {
        self.id(key)?.conn.get()
    }

    pub(crate) fn id_node(&self, key: SimIdKey) -> Option<NodeId> {
        self.id(key).map(|id| id.node)
    }

    pub(crate) fn id_unacked(&self, key: SimIdKey) -> Option<u32> {
        self.id(key).map(|id| id.unacked)
    }

    pub(crate) fn force_ib_state(
        &mut self,
        key: SimIdKey,
        state: IbCmState,
    ) -> Result<(), CmError> {
        let id = self.live(key, "force_ib_state")?;
        id.device = true;
        self.cancel_timer(key);
        self.set_ib(key, state);
        Ok(())
    }

    pub(crate) fn set_lap_state(&mut self, key: SimIdKey, lap: LapState) -> Result<(), CmError> {
        self.live(key, "set_lap_state")?.lap = lap;
        Ok(())
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
