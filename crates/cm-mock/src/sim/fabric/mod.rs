//! The simulation's state and its rules: the IB CM state machine, the wire, the QPs.
//! Everything here runs under one lock of the fabric's `Mutex`; the handles in `sim/mod.rs`
//! are thin. Nothing here holds a handle or runs code of the caller, so a call never
//! takes the lock again (or drops an event, which would) while it holds it.
//!
//! This file holds the records (messages, queued events, QPs, nodes, channels), the
//! [`Fabric`] that owns them and its bookkeeping; [`id_record`] is one id's compact
//! record and [`id_table`] the table of them, [`maybe`] the compact optional numbers,
//! [`packing`] how a scheduled action is packed, [`timers`] the ids' timers and
//! [`arrivals`] the counters read without the lock; [`wire`] sends and delivers
//! messages (faults, the clock, the IB CM's answers to each message) and [`calls`] is
//! what the handles call (verbs, rdma_cm calls, event channels, inspection).

use std::collections::HashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use cm_core::{AsyncEvent, CmError, CmEventType, CmIdState, Errno, IbCmState, QpNum};

use super::rng::SplitMix64;
use super::schedule::Schedule;
use super::tables::{Chunked, ReqTable};
use super::trace::{Trace, TraceEntry, TraceEvent};
use super::types::{
    ConnId, DeviceKind, FaultOdds, FaultRule, MsgKind, NodeId, RecvCompletion, SimConfig, SimIdKey,
    SimStats,
};

mod arrivals;
mod calls;
mod id_record;
mod id_table;
mod maybe;
mod packing;
mod timers;
mod wire;

pub(crate) use arrivals::Arrivals;
use id_record::{IdData, IdExtras, IdSlot, IdState, Place};
pub(crate) use maybe::MaybeQp;
use maybe::{MaybeConn, MaybeKey};

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
/// allocates nothing, and a packed message or an id's extras hold eight bytes.
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

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A message on the wire. One flat struct for every kind keeps the code simple; in
/// flight it is packed into the schedule (see [`Action`]'s [`Packed`]), so its size
/// matters only while it is handled.
#[derive(Debug, Clone)]
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
    /// CM private data.
    private: Private,
    /// A data message's bytes (`None` for length-only sends and for a duplicate, which
    /// is never delivered): they travel with the message and land in the receiving
    /// node's completion queue.
    payload: Option<Box<[u8]>>,
    retransmit: bool,
    /// The second copy of a duplicated message.
    copy: bool,
}

// An id slot and a QP (two each per connection) stay small: checked when compiling.
const _: () = assert!(std::mem::size_of::<IdSlot>() <= 44);
const _: () = assert!(std::mem::size_of::<Qp>() <= 16);

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
            payload: None,
            retransmit: false,
            copy: false,
        }
    }
}

/// What the clock triggers. Most pending actions are timers and messages in flight,
/// a few per connection in a scale run, so the schedule keeps them packed.
#[derive(Debug)]
enum Action {
    /// The message arrives.
    Deliver(Message),
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
    /// The device was removed: addresses resolved from the node find no device.
    removed: bool,
    /// The device raised DEVICE_FATAL: nothing it sends leaves any more.
    fatal: bool,
    /// QPs the node may still create (`None`: no limit); at 0 `rdma_create_qp` answers
    /// ENOMEM, as the kernel does once pinned memory passes RLIMIT_MEMLOCK.
    qp_budget: Option<u32>,
    async_events: VecDeque<AsyncEvent>,
    /// Receive completions, each with the payload the sender gave (`None` for
    /// length-only sends).
    completions: VecDeque<(RecvCompletion, Option<Box<[u8]>>)>,
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

/// A QP, sixteen bytes (a scale run holds two per connection).
#[derive(Debug)]
struct Qp {
    node: NodeId,
    /// The slot of the id that created it: that id while `alive` (destroying the id is
    /// what ends the QP), so the slot's generation need not be kept.
    owner: u32,
    state: QpState,
    peer: MaybeQp,
    got_first_packet: bool,
    alive: bool,
}

/// Messages of each kind sent so far on a connection (fault rules' `nth`), a byte
/// each: they are few on nearly every connection. One count that would reach
/// [`ConnRecord::SPILLED`] moves the connection's counts to the fabric's
/// `spilled_counts`, and every byte becomes the mark.
#[derive(Debug, Default, Clone, Copy)]
struct ConnRecord {
    sent: [u8; 8],
}

impl ConnRecord {
    /// Marks a connection whose counts are in `spilled_counts`.
    const SPILLED: u8 = u8::MAX;
}

impl Fabric {
    /// Counts a message of `kind` sent on `conn`; how many were sent before it.
    fn count_sent(&mut self, conn: ConnId, kind: MsgKind) -> u32 {
        let record = self
            .conns
            .get_mut(conn.0 as usize)
            .expect("a connection's record");
        let k = kind.index();
        let n = record.sent[k];
        if n == ConnRecord::SPILLED {
            let counts = self.spilled_counts.entry(conn.0).or_default();
            let n = counts[k];
            counts[k] = n.saturating_add(1);
            return n;
        }
        if n + 1 < ConnRecord::SPILLED {
            record.sent[k] = n + 1;
        } else {
            let mut counts = record.sent.map(u32::from);
            counts[k] += 1;
            self.spilled_counts.insert(conn.0, counts);
            record.sent = [ConnRecord::SPILLED; 8];
        }
        u32::from(n)
    }
}

/// A listening id and its backlog, as ucma keeps them: each CONNECT_REQUEST queued
/// for the application takes one, reading it gives it back, and a REQ arriving when
/// none is left is dropped without a reply (ucma answers ENOMEM, and the IB CM keeps
/// quiet so that the peer's retry may find room).
#[derive(Debug, Clone, Copy)]
struct Listener {
    /// (node, port) listened on.
    at: (NodeId, u16),
    /// The listening id's port space: a REQ of another space does not reach it.
    space: cm_core::PortSpace,
    key: SimIdKey,
    /// CONNECT_REQUESTs that may still be queued unread.
    backlog: u32,
}

/// The whole simulated fabric.
#[derive(Debug)]
pub(crate) struct Fabric {
    /// Shared with the handles, which read it without the lock.
    pub(crate) arrivals: Arc<Arrivals>,
    pub(crate) config: SimConfig,
    now: u64,
    /// Timers and messages in flight, packed.
    queue: Schedule<Action>,
    /// The private data the messages, events and ids refer to.
    privates: PrivateBytes,
    rng: SplitMix64,
    nodes: Vec<Node>,
    channels: Vec<Channel>,
    ids: Chunked<IdSlot>,
    /// By id slot: the rare parts of live ids, for the few that have them.
    id_extras: HashMap<u32, IdExtras>,
    free_ids: Vec<u32>,
    qps: Chunked<Qp>,
    conns: Chunked<ConnRecord>,
    /// By connection: the full counts of the connections whose record overflowed.
    spilled_counts: HashMap<u32, [u32; 8]>,
    /// The listening ids; a handful at most, so a list.
    listeners: Vec<Listener>,
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
            privates: PrivateBytes::default(),
            rng: SplitMix64::new(seed),
            nodes: Vec::new(),
            channels: Vec::new(),
            ids: Chunked::default(),
            id_extras: HashMap::new(),
            free_ids: Vec::new(),
            qps: Chunked::default(),
            conns: Chunked::default(),
            spilled_counts: HashMap::new(),
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
        self.arrivals.bump_activity();
        self.queue.push_fixed(self.now, delay, action);
    }

    /// Schedules `action` after a delay that varies from message to message (random
    /// or per-rule fault delays), so it does not claim a lane of its own.
    fn schedule_irregular(&mut self, delay: u64, action: Action) {
        self.arrivals.bump_activity();
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

    /// Whether `node`'s device was removed.
    pub(crate) fn device_removed(&self, node: NodeId) -> bool {
        self.nodes.get(node.0 as usize).is_some_and(|n| n.removed)
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
    /// destroyed), and COMM_EST notifies and address resolutions from the node answer
    /// ENODEV from now on.
    pub(crate) fn remove_device(&mut self, node: NodeId) -> Result<usize, CmError> {
        self.set_going_down(node, true)?;
        self.node_mut(node, "remove_device")?.removed = true;
        Ok(self.tell_device_ids(node, CmEventType::DeviceRemoval))
    }

    /// Queues `event` to every id bound to `node`'s device; returns how many.
    pub(crate) fn tell_device_ids(&mut self, node: NodeId, event: CmEventType) -> usize {
        let keys: Vec<SimIdKey> = self
            .ids
            .iter()
            .enumerate()
            .filter_map(|(index, slot)| {
                let id = slot.data.as_ref()?;
                let on_node = self.node_of(index as u32, id.place) == node;
                (on_node && id.state.has(IdState::DEVICE)).then_some(SimIdKey {
                    index: index as u32,
                    generation: slot.generation,
                })
            })
            .collect();
        for &key in &keys {
            self.push_event(key, None, QueuedKind::Event(event), 0, Private::default());
        }
        keys.len()
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

    /// The id listening on `at` in `space`.
    fn listener(&self, at: (NodeId, u16), space: cm_core::PortSpace) -> Option<SimIdKey> {
        self.listeners
            .iter()
            .find_map(|l| (l.at == at && l.space == space).then_some(l.key))
    }

    /// Takes one of the listener's backlog for a CONNECT_REQUEST about to be queued
    /// (ucma's `atomic_add_unless(&ctx->backlog, -1, 0)`); `false` when none is left.
    fn take_backlog(&mut self, listener: SimIdKey) -> bool {
        let Some(l) = self.listeners.iter_mut().find(|l| l.key == listener) else {
            return false;
        };
        let taken = l.backlog > 0;
        l.backlog = l.backlog.saturating_sub(1);
        taken
    }

    /// Gives one back once a CONNECT_REQUEST leaves its channel (read, or discarded);
    /// nothing when the listener is gone, as its backlog went with it.
    fn give_backlog(&mut self, listener: SimIdKey) {
        if let Some(l) = self.listeners.iter_mut().find(|l| l.key == listener) {
            l.backlog = l.backlog.saturating_add(1);
        }
    }

    fn set_ib(&mut self, key: SimIdKey, to: IbCmState) {
        let Some(id) = self.id_mut(key) else { return };
        let from = id.state.ib();
        id.state.set_ib(Some(to));
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
            QueuedKind::Event(CmEventType::TimewaitExit) => id.state.cm() == CmIdState::Disconnect,
            _ => id.state.cm() == CmIdState::Connect,
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
        let (channel, conn) = (self.channel_of(key.index, id.place), id.conn.get());
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
    use super::{ConnRecord, Fabric, PrivateBytes};
    use crate::sim::{ConnId, MsgKind, SimChannel, SimConfig, SimFabric, SimPair};
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

    #[test]
    fn sent_counts_stay_exact_past_a_byte() {
        let mut fabric = Fabric::new(SimConfig::default(), 1);
        fabric.conns.push(ConnRecord::default());
        fabric.conns.push(ConnRecord::default());
        let (conn, other) = (ConnId(0), ConnId(1));
        for n in 0..600 {
            assert_eq!(fabric.count_sent(conn, MsgKind::Req), n);
            if n % 100 == 0 {
                assert_eq!(fabric.count_sent(conn, MsgKind::Rep), n / 100);
            }
        }
        assert_eq!(fabric.count_sent(conn, MsgKind::Rep), 6);
        assert_eq!(fabric.count_sent(conn, MsgKind::Rtu), 0);
        assert_eq!(fabric.count_sent(other, MsgKind::Req), 0);
        assert_eq!(fabric.spilled_counts.len(), 1);
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
