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

use std::collections::HashMap;
use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cm_core::kernel_model::LapState;
use cm_core::{AsyncEvent, CmError, CmEventType, CmIdState, Errno, IbCmState, QpNum};

use super::rng::SplitMix64;
use super::schedule::{Packed, Packer, Schedule, Unpacker};
use super::tables::{Chunked, ReqTable};
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

// The first byte of a packed action: the variant in the low three bits; for a message,
// its kind in the next three, and its two flags.
const ACTION_DELIVER: u8 = 0;
const ACTION_TIMER: u8 = 1;
const ACTION_ADDR_RESOLVED: u8 = 2;
const ACTION_ROUTE_RESOLVED: u8 = 3;
const ACTION_ESTABLISH_WORK: u8 = 4;
const MSG_RETRANSMIT: u8 = 1 << 6;
const MSG_COPY: u8 = 1 << 7;
// The second byte of a packed message: which of its optional fields follow.
const HAS_CONN: u8 = 1;
const HAS_SRC: u8 = 1 << 1;
const HAS_DST: u8 = 1 << 2;
const HAS_QP: u8 = 1 << 3;
const HAS_PORT: u8 = 1 << 4;
const HAS_VALUE: u8 = 1 << 5;
const HAS_PRIVATE: u8 = 1 << 6;
const HAS_PAYLOAD: u8 = 1 << 7;

/// An id key: its generation, then its slot relative to the lane's previous one.
fn pack_key(out: &mut Packer, key: SimIdKey) {
    out.varint(u64::from(key.generation));
    out.near(key.index);
}

fn unpack_key(input: &mut Unpacker<'_>) -> SimIdKey {
    let generation = input.varint() as u32;
    SimIdKey {
        index: input.near(),
        generation,
    }
}

/// An action naming only an id: its variant, then the key; a generation below 31 goes
/// in the first byte's five spare bits (as generation + 1).
fn pack_id_action(out: &mut Packer, tag: u8, key: SimIdKey) {
    match u8::try_from(key.generation) {
        Ok(generation) if generation < 31 => {
            out.byte(tag | (generation + 1) << 3);
            out.near(key.index);
        }
        _ => {
            out.byte(tag);
            pack_key(out, key);
        }
    }
}

fn unpack_id_action(input: &mut Unpacker<'_>, first: u8) -> SimIdKey {
    match first >> 3 {
        0 => unpack_key(input),
        small => SimIdKey {
            index: input.near(),
            generation: u32::from(small - 1),
        },
    }
}

impl Packed for Action {
    fn pack(self, out: &mut Packer) {
        match self {
            Action::Deliver(msg) => pack_message(out, msg),
            Action::Timer { id, gen } => {
                // The usual timer: a first-generation id, few timers so far.
                if id.generation == 0 && gen < 31 {
                    out.byte(ACTION_TIMER | (gen as u8 + 1) << 3);
                    out.near(id.index);
                } else {
                    out.byte(ACTION_TIMER);
                    pack_key(out, id);
                    out.varint(u64::from(gen));
                }
            }
            Action::AddrResolved(id) => pack_id_action(out, ACTION_ADDR_RESOLVED, id),
            Action::RouteResolved(id) => pack_id_action(out, ACTION_ROUTE_RESOLVED, id),
            Action::EstablishWork(id) => pack_id_action(out, ACTION_ESTABLISH_WORK, id),
        }
    }

    fn unpack(input: &mut Unpacker<'_>) -> Self {
        let first = input.byte();
        match first & 7 {
            ACTION_DELIVER => Action::Deliver(unpack_message(input, first)),
            ACTION_TIMER => match first >> 3 {
                0 => {
                    let id = unpack_key(input);
                    let gen = input.varint() as u32;
                    Action::Timer { id, gen }
                }
                small => Action::Timer {
                    id: SimIdKey {
                        index: input.near(),
                        generation: 0,
                    },
                    gen: u32::from(small - 1),
                },
            },
            ACTION_ADDR_RESOLVED => Action::AddrResolved(unpack_id_action(input, first)),
            ACTION_ROUTE_RESOLVED => Action::RouteResolved(unpack_id_action(input, first)),
            _ => Action::EstablishWork(unpack_id_action(input, first)),
        }
    }
}

/// A message as a header byte, a byte of which fields follow, and those fields as
/// varints; a payload without its trailing zero bytes (messages are often padded with
/// zeros to a fixed size), restored when it is read back.
fn pack_message(out: &mut Packer, msg: Message) {
    let mut first = ACTION_DELIVER | (msg.kind.index() as u8) << 3;
    if msg.retransmit {
        first |= MSG_RETRANSMIT;
    }
    if msg.copy {
        first |= MSG_COPY;
    }
    let present = [
        msg.conn.is_some(),
        msg.src != MaybeKey::NONE,
        msg.dst != MaybeKey::NONE,
        msg.qp.0 != 0,
        msg.port != 0,
        msg.value != 0,
        msg.private != Private::default(),
        msg.payload.is_some(),
    ];
    // Bit i of `fields` says field i is there (HAS_CONN is bit 0, …, HAS_PAYLOAD bit 7).
    let fields = present
        .iter()
        .enumerate()
        .fold(0u8, |fields, (bit, &on)| fields | u8::from(on) << bit);
    out.byte(first);
    out.byte(fields);
    out.varint(u64::from(msg.from.0));
    out.varint(u64::from(msg.to.0));
    if let Some(conn) = msg.conn {
        out.varint(u64::from(conn.0));
    }
    if fields & HAS_SRC != 0 {
        pack_key(out, msg.src.0);
    }
    if fields & HAS_DST != 0 {
        pack_key(out, msg.dst.0);
    }
    if fields & HAS_QP != 0 {
        out.varint(u64::from(msg.qp.0));
    }
    if fields & HAS_PORT != 0 {
        out.varint(u64::from(msg.port));
    }
    if fields & HAS_VALUE != 0 {
        // Zigzag: small negative values take one byte too.
        let value = msg.value;
        out.varint(u64::from(((value << 1) ^ (value >> 31)) as u32));
    }
    if fields & HAS_PRIVATE != 0 {
        out.varint(u64::from(msg.private.start));
        out.varint(u64::from(msg.private.len));
    }
    if let Some(payload) = &msg.payload {
        let kept = payload
            .iter()
            .rposition(|&b| b != 0)
            .map_or(0, |last| last + 1);
        out.varint(payload.len() as u64);
        out.varint(kept as u64);
        out.bytes(&payload[..kept]);
    }
}

fn unpack_message(input: &mut Unpacker<'_>, first: u8) -> Message {
    let fields = input.byte();
    let kind = MsgKind::ALL[usize::from(first >> 3 & 7)];
    let from = NodeId(input.varint() as u32);
    let to = NodeId(input.varint() as u32);
    let conn = (fields & HAS_CONN != 0).then(|| ConnId(input.varint() as u32));
    let mut msg = Message::new(kind, conn, from, to);
    msg.retransmit = first & MSG_RETRANSMIT != 0;
    msg.copy = first & MSG_COPY != 0;
    if fields & HAS_SRC != 0 {
        msg.src = MaybeKey(unpack_key(input));
    }
    if fields & HAS_DST != 0 {
        msg.dst = MaybeKey(unpack_key(input));
    }
    if fields & HAS_QP != 0 {
        msg.qp = QpNum(input.varint() as u32);
    }
    if fields & HAS_PORT != 0 {
        msg.port = input.varint() as u16;
    }
    if fields & HAS_VALUE != 0 {
        let zigzag = input.varint() as u32;
        msg.value = (zigzag >> 1) as i32 ^ -((zigzag & 1) as i32);
    }
    if fields & HAS_PRIVATE != 0 {
        msg.private = Private {
            start: input.varint() as u32,
            len: input.varint() as u32,
        };
    }
    if fields & HAS_PAYLOAD != 0 {
        let len = input.varint() as usize;
        let kept = input.varint() as usize;
        let mut payload = vec![0; len].into_boxed_slice();
        input.bytes(&mut payload[..kept]);
        msg.payload = Some(payload);
    }
    msg
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

/// One CM id: the rdma_cm id and its IB CM id together. Compact (a scale run holds two
/// per connection): numbers in four bytes or fewer, the states and flags in two, and
/// what few ids have (private data, a LAP state, numbers too large for their field) in
/// the fabric's side table [`IdExtras`].
#[derive(Debug)]
struct IdData {
    /// The node and the channel.
    place: Place,
    /// Events handed out and not yet acknowledged ([`IdData::SPILLED`]: in the extras).
    unacked: u8,
    /// Retransmissions left ([`IdData::SPILLED`]: in the extras).
    retries_left: u8,
    /// Bumped to cancel the pending timer.
    timer_gen: u32,
    /// What the id's owner keeps with it (rdma_cm's `id->context`; `u32::MAX`: none).
    context: u32,
    conn: MaybeConn,
    qp: MaybeQp,
    remote_qp: MaybeQp,
    /// The local port, then where `resolve_addr` points, then the peer id once known.
    peer: Peer,
    state: IdState,
}

impl IdData {
    /// A small number's field holds this when the number is in the id's extras.
    const SPILLED: u8 = u8::MAX;

    fn new(place: Place) -> Self {
        IdData {
            place,
            unacked: 0,
            timer_gen: 0,
            context: u32::MAX,
            conn: MaybeConn::NONE,
            qp: MaybeQp::NONE,
            remote_qp: MaybeQp::NONE,
            retries_left: 0,
            peer: Peer::NONE,
            state: IdState::NEW,
        }
    }

    /// The local port (`bind`), while the id has no peer: only `listen` reads it, and
    /// an id that resolved an address or has a peer can no longer listen.
    fn port(&self) -> u16 {
        if self.peer.node == u32::MAX {
            self.peer.tag as u16
        } else {
            0
        }
    }

    fn set_port(&mut self, port: u16) {
        if self.peer.node == u32::MAX {
            self.peer.tag = u32::from(port);
        }
    }

    /// The peer id, once known (the REQ's sender on the passive side, the REP's on the
    /// active side).
    fn remote(&self) -> Option<(NodeId, SimIdKey)> {
        (self.peer.node != u32::MAX && self.peer.index != u32::MAX).then_some((
            NodeId(self.peer.node),
            SimIdKey {
                index: self.peer.index,
                generation: self.peer.tag,
            },
        ))
    }

    fn set_remote(&mut self, node: NodeId, key: SimIdKey) {
        self.peer = Peer {
            node: node.0,
            index: key.index,
            tag: key.generation,
        };
    }

    /// Where `resolve_addr` points, until the peer id is known: an active id addresses
    /// its REQs (and a REJ sent before the REP) by it, and after the REP only its peer.
    fn dst(&self) -> Option<(NodeId, u16)> {
        (self.peer.node != u32::MAX && self.peer.index == u32::MAX)
            .then_some((NodeId(self.peer.node), self.peer.tag as u16))
    }

    fn set_dst(&mut self, node: NodeId, port: u16) {
        self.peer = Peer {
            node: node.0,
            index: u32::MAX,
            tag: u32::from(port),
        };
    }
}

/// An id's node (high half) and channel index plus one (low half) in four bytes, or
/// [`Place::SPILLED`] with both in the id's extras: nodes and channels are few. Never
/// 0, so that a free slot needs no flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Place(NonZeroU32);

impl Place {
    const SPILLED: Place = Place(NonZeroU32::MAX);

    /// The compact form of (`node`, `channel`), if both fit.
    fn new(node: NodeId, channel: usize) -> Option<Place> {
        let node = u16::try_from(node.0).ok().filter(|&n| n < u16::MAX)?;
        let channel = u16::try_from(channel + 1).ok().filter(|&c| c < u16::MAX)?;
        let place = u32::from(node) << 16 | u32::from(channel);
        NonZeroU32::new(place).map(Place)
    }

    /// The node and channel of a compact place.
    fn get(self) -> (NodeId, usize) {
        let place = self.0.get();
        (NodeId(place >> 16), (place & 0xffff) as usize - 1)
    }
}

/// An id's peer in twelve bytes: nothing (`node` is `u32::MAX`, `tag` the local port), the address
/// `resolve_addr` gave (`index` is `u32::MAX`, `tag` the port), or the peer id (`index`
/// and `tag` its key). One field serves both: an id resolves its address only before
/// it connects, and learns its peer only after.
#[derive(Debug, Clone, Copy)]
struct Peer {
    node: u32,
    index: u32,
    tag: u32,
}

impl Peer {
    const NONE: Peer = Peer {
        node: u32::MAX,
        index: u32::MAX,
        tag: 0,
    };
}

/// An id's states and flags in sixteen bits: the IB CM state (five bits, 31: none),
/// the rdma_cm state (four), the message the timer resends (four, 15: none, the
/// TIMEWAIT timer), and three flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct IdState(u16);

impl IdState {
    const IB_NONE: u16 = 31;
    const RETRY_SHIFT: u32 = 9;
    const RETRY_NONE: u16 = 15;
    /// Bound to the node's device (bind, resolve, or created by a connection request).
    const DEVICE: u16 = 1 << 13;
    /// The retransmission timeout is the MRA's service timeout (an MRA arrived), not
    /// the CM response timeout.
    const MRA_TIMEOUT: u16 = 1 << 14;
    /// Created by a connection request (passive ids): the peer is the REQ's sender,
    /// whose duplicate-REQ entry goes when this id does.
    const FROM_REQ: u16 = 1 << 15;
    /// No IB CM id, rdma_cm IDLE, no timer, no flag.
    const NEW: IdState = IdState(Self::IB_NONE | Self::RETRY_NONE << Self::RETRY_SHIFT);

    /// The IB CM id's state; `None` until connect/accept/listen attaches one.
    fn ib(self) -> Option<IbCmState> {
        IbCmState::from_raw(u32::from(self.0 & 31))
    }

    fn set_ib(&mut self, ib: Option<IbCmState>) {
        let raw = ib.map_or(Self::IB_NONE, |s| s.as_raw() as u16);
        self.0 = self.0 & !31 | raw;
    }

    fn cm(self) -> CmIdState {
        CmIdState::from_raw(u32::from(self.0 >> 5 & 15)).unwrap_or(CmIdState::Idle)
    }

    fn set_cm(&mut self, cm: CmIdState) {
        self.0 = self.0 & !(15 << 5) | (cm.as_raw() as u16) << 5;
    }

    /// Which message the timer resends (`None`: the timer is the TIMEWAIT timer).
    fn retrying(self) -> Option<MsgKind> {
        MsgKind::ALL
            .get(usize::from(self.0 >> Self::RETRY_SHIFT & 15))
            .copied()
    }

    fn set_retrying(&mut self, kind: Option<MsgKind>) {
        let raw = kind.map_or(Self::RETRY_NONE, |k| k.index() as u16);
        self.0 = self.0 & !(15 << Self::RETRY_SHIFT) | raw << Self::RETRY_SHIFT;
    }

    fn has(self, flag: u16) -> bool {
        self.0 & flag != 0
    }

    fn set(&mut self, flag: u16, on: bool) {
        if on {
            self.0 |= flag;
        } else {
            self.0 &= !flag;
        }
    }
}

/// What few ids have, kept aside so that the rest pay nothing for it: CM private data
/// and a LAP state other than the usual none.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct IdExtras {
    /// The private data of our REQ/REP (for retransmissions).
    private: Private,
    /// The peer's REP data on the active side, once the REP arrived.
    peer_private: Private,
    lap: LapState,
    /// The node and channel, when its [`Place`] is [`Place::SPILLED`].
    place: Option<(NodeId, usize)>,
    /// The unacknowledged events, when they pass the compact field.
    unacked: u32,
    /// The retransmissions left, when they pass the compact field.
    retries_left: u32,
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
    /// Ids destroyed so far: an id's QP number stays what it was read as while this
    /// does (it is set once, and cleared only with the id).
    ids_destroyed: u64,
    qps: Chunked<Qp>,
    conns: Chunked<ConnRecord>,
    /// By connection: the full counts of the connections whose record overflowed.
    spilled_counts: HashMap<u32, [u32; 8]>,
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
            privates: PrivateBytes::default(),
            rng: SplitMix64::new(seed),
            nodes: Vec::new(),
            channels: Vec::new(),
            ids: Chunked::default(),
            id_extras: HashMap::new(),
            free_ids: Vec::new(),
            ids_destroyed: 0,
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
                let on_node = self.node_of(index as u32, id.place) == node;
                (on_node && id.state.has(IdState::DEVICE)).then_some(SimIdKey {
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
        let node = self.channels[channel].node;
        let place = Place::new(node, channel);
        let data = IdData::new(place.unwrap_or(Place::SPILLED));
        let key = if let Some(index) = self.free_ids.pop() {
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
        };
        if place.is_none() {
            self.update_extras(key.index, |extras| extras.place = Some((node, channel)));
        }
        key
    }

    /// The node and channel of id slot `index`, whose place is `place`.
    fn place_of(&self, index: u32, place: Place) -> (NodeId, usize) {
        if place == Place::SPILLED {
            if let Some(spilled) = self.extras(index).place {
                return spilled;
            }
        }
        place.get()
    }

    /// The node of id slot `index`, whose place is `place`.
    fn node_of(&self, index: u32, place: Place) -> NodeId {
        self.place_of(index, place).0
    }

    /// The channel of id slot `index`, whose place is `place`.
    fn channel_of(&self, index: u32, place: Place) -> usize {
        self.place_of(index, place).1
    }

    /// Moves live id `key` to `channel`, on the same node.
    fn set_channel(&mut self, key: SimIdKey, channel: usize) {
        let Some(id) = self.id(key) else { return };
        let node = self.node_of(key.index, id.place);
        let place = Place::new(node, channel);
        if let Some(id) = self.id_mut(key) {
            id.place = place.unwrap_or(Place::SPILLED);
        }
        let spilled = place.is_none().then_some((node, channel));
        self.update_extras(key.index, |extras| extras.place = spilled);
    }

    /// A small count of id slot `index` (`compact`, its field), or the extras' `full`.
    fn count_of(compact: u8, full: impl FnOnce() -> u32) -> u32 {
        if compact == IdData::SPILLED {
            full()
        } else {
            u32::from(compact)
        }
    }

    /// The unacknowledged events of live id slot `index` (`compact`: its field).
    fn unacked_of(&self, index: u32, compact: u8) -> u32 {
        Self::count_of(compact, || self.extras(index).unacked)
    }

    /// The retransmissions left of live id slot `index` (`compact`: its field).
    fn retries_of(&self, index: u32, compact: u8) -> u32 {
        Self::count_of(compact, || self.extras(index).retries_left)
    }

    /// Sets a small count of live id `key`: its field (`field`) when it fits, else the
    /// extras (`full`).
    fn set_count(
        &mut self,
        key: SimIdKey,
        value: u32,
        field: fn(&mut IdData) -> &mut u8,
        full: fn(&mut IdExtras) -> &mut u32,
    ) {
        let Some(id) = self.id_mut(key) else { return };
        let compact = u8::try_from(value).ok().filter(|&v| v != IdData::SPILLED);
        let was = std::mem::replace(field(id), compact.unwrap_or(IdData::SPILLED));
        if compact.is_none() || was == IdData::SPILLED {
            let spilled = if compact.is_none() { value } else { 0 };
            self.update_extras(key.index, |extras| *full(extras) = spilled);
        }
    }

    /// One more event of live id `key` handed out (`up`), or one acknowledged.
    fn count_unacked(&mut self, key: SimIdKey, up: bool) {
        let Some(id) = self.id_mut(key) else { return };
        // The usual case: the count stays in its field.
        if up && id.unacked < IdData::SPILLED - 1 {
            id.unacked += 1;
        } else if !up && id.unacked != IdData::SPILLED {
            id.unacked = id.unacked.saturating_sub(1);
        } else {
            let compact = id.unacked;
            let unacked = self.unacked_of(key.index, compact);
            let unacked = if up {
                unacked + 1
            } else {
                unacked.saturating_sub(1)
            };
            self.set_count(key, unacked, |id| &mut id.unacked, |e| &mut e.unacked);
        }
    }

    fn set_retries(&mut self, key: SimIdKey, value: u32) {
        self.set_count(
            key,
            value,
            |id| &mut id.retries_left,
            |e| &mut e.retries_left,
        );
    }

    /// The rare parts of live id slot `index` (all defaults when it has none).
    fn extras(&self, index: u32) -> IdExtras {
        if self.id_extras.is_empty() {
            return IdExtras::default();
        }
        self.id_extras.get(&index).copied().unwrap_or_default()
    }

    /// Changes the rare parts of live id slot `index`; defaults take no entry.
    fn update_extras(&mut self, index: u32, change: impl FnOnce(&mut IdExtras)) {
        let mut extras = self.extras(index);
        change(&mut extras);
        if extras != IdExtras::default() {
            self.id_extras.insert(index, extras);
        } else if !self.id_extras.is_empty() {
            self.id_extras.remove(&index);
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

    // ----- timers ------------------------------------------------------------------

    fn cancel_timer(&mut self, key: SimIdKey) {
        if let Some(id) = self.id_mut(key) {
            id.timer_gen = id.timer_gen.wrapping_add(1);
            id.state.set_retrying(None);
        }
    }

    fn start_retry(&mut self, key: SimIdKey, kind: MsgKind) {
        let timeout = nanos(self.config.cm_response_timeout);
        let retries = self.config.max_cm_retries;
        let Some(id) = self.id_mut(key) else { return };
        id.timer_gen = id.timer_gen.wrapping_add(1);
        id.state.set_retrying(Some(kind));
        id.state.set(IdState::MRA_TIMEOUT, false);
        let gen = id.timer_gen;
        self.set_retries(key, retries);
        self.schedule(timeout, Action::Timer { id: key, gen });
    }

    /// An MRA: the peer needs more time; the pending message's timeout becomes the
    /// MRA's service timeout (for this and later retries).
    fn extend_retry(&mut self, key: SimIdKey) {
        let timeout = nanos(self.config.mra_service_timeout);
        let Some(id) = self.id_mut(key) else { return };
        id.timer_gen = id.timer_gen.wrapping_add(1);
        id.state.set(IdState::MRA_TIMEOUT, true);
        let gen = id.timer_gen;
        self.schedule(timeout, Action::Timer { id: key, gen });
    }

    fn enter_timewait(&mut self, key: SimIdKey) {
        self.set_ib(key, IbCmState::Timewait);
        let timewait = nanos(self.config.timewait);
        let Some(id) = self.id_mut(key) else { return };
        id.timer_gen = id.timer_gen.wrapping_add(1);
        id.state.set_retrying(None);
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
    use super::{Action, ConnRecord, Fabric, MaybeKey, Message, Private, PrivateBytes, Schedule};
    use crate::sim::{
        ConnId, MsgKind, NodeId, SimChannel, SimConfig, SimFabric, SimIdKey, SimPair,
    };
    use cm_core::QpNum;
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

    /// Every field of a message and every action come back from a lane as they went
    /// in: extreme values, negative ones, payloads with and without trailing zeros.
    #[test]
    fn actions_come_back_from_a_lane_unchanged() {
        let key = |index, generation| SimIdKey { index, generation };
        let mut full = Message::new(
            MsgKind::Rej,
            Some(ConnId(u32::MAX - 1)),
            NodeId(3),
            NodeId(u32::MAX),
        );
        full.src = MaybeKey(key(u32::MAX - 1, u32::MAX));
        full.dst = MaybeKey(key(0, 7));
        full.qp = QpNum(u32::MAX);
        full.port = u16::MAX;
        full.value = i32::MIN;
        full.private = Private {
            start: u32::MAX,
            len: 196,
        };
        full.retransmit = true;
        full.copy = true;
        let mut data = Message::new(MsgKind::Data, None, NodeId(0), NodeId(1));
        data.value = i32::MAX;
        let mut actions = vec![
            Action::Deliver(full),
            Action::Deliver(Message::new(MsgKind::Rtu, None, NodeId(0), NodeId(0))),
            Action::Timer {
                id: key(5, 6),
                gen: u32::MAX,
            },
            Action::AddrResolved(key(u32::MAX - 1, 0)),
            Action::RouteResolved(key(1, 2)),
            Action::EstablishWork(key(3, 4)),
            Action::Timer {
                id: key(9, 0),
                gen: 30,
            },
            Action::Timer {
                id: key(0, 0),
                gen: 31,
            },
            Action::EstablishWork(key(u32::MAX - 1, 31)),
        ];
        for payload in [&b"padded\0\0\0"[..], b"\0\0", b"x", &[7; 20_000]] {
            let mut msg = data.clone();
            msg.value = -1;
            msg.payload = Some(payload.into());
            actions.push(Action::Deliver(msg));
        }
        let expected: Vec<String> = actions.iter().map(|a| format!("{a:?}")).collect();
        let mut schedule = Schedule::default();
        for (n, action) in actions.into_iter().enumerate() {
            schedule.push_fixed(n as u64 * 1_000_000_007, 10, action);
        }
        let back: Vec<String> = std::iter::from_fn(|| schedule.pop())
            .map(|(_, a)| format!("{a:?}"))
            .collect();
        assert_eq!(back, expected);
    }

    /// Nodes, channels and counts too large for an id's compact fields go to its
    /// extras and come back exact; the extras empty again once they fit.
    #[test]
    fn large_id_numbers_stay_exact() {
        let mut fabric = Fabric::new(SimConfig::default(), 1);
        let nodes: Vec<NodeId> = (0..70_000)
            .map(|_| fabric.add_node(Default::default()))
            .collect();
        let far = nodes[69_999];
        let near = fabric.add_channel(nodes[1]);
        let channels: Vec<usize> = (0..66_000).map(|_| fabric.add_channel(far)).collect();
        let key = fabric.create_id(channels[65_999]);
        assert_eq!(fabric.id_node(key), Some(far));
        let id = fabric.id(key).unwrap();
        assert_eq!(fabric.channel_of(key.index, id.place), channels[65_999]);
        // A move keeps the node, whatever the channel's.
        fabric.migrate(key, near).unwrap();
        let id = fabric.id(key).unwrap();
        assert_eq!(fabric.place_of(key.index, id.place), (far, near));
        for _ in 0..70_000 {
            fabric.count_unacked(key, true);
        }
        assert_eq!(fabric.id_unacked(key), Some(70_000));
        assert!(fabric.destroy(key).is_err());
        fabric.set_retries(key, 100_000);
        let id = fabric.id(key).unwrap();
        assert_eq!(fabric.retries_of(key.index, id.retries_left), 100_000);
        fabric.set_retries(key, 3);
        let id = fabric.id(key).unwrap();
        assert_eq!(fabric.retries_of(key.index, id.retries_left), 3);
        for _ in 0..70_001 {
            fabric.count_unacked(key, false);
        }
        assert_eq!(fabric.id_unacked(key), Some(0));
        let small = fabric.create_id(near);
        assert_eq!(fabric.id_node(small), Some(nodes[1]));
        fabric.migrate(key, small_channel(&fabric, small)).unwrap();
        fabric.destroy(key).unwrap();
        assert!(fabric.id_extras.is_empty());
        // A channel past the compact field on a small node: compact again once moved.
        let last = (0..66_000).map(|_| fabric.add_channel(nodes[1])).last();
        let key = fabric.create_id(last.unwrap());
        assert_eq!(fabric.id_extras.len(), 1);
        fabric.migrate(key, near).unwrap();
        assert!(fabric.id_extras.is_empty());
        assert_eq!(small_channel(&fabric, key), near);
        assert_eq!(fabric.id_node(key), Some(nodes[1]));
    }

    fn small_channel(fabric: &Fabric, key: SimIdKey) -> usize {
        let id = fabric.id(key).unwrap();
        fabric.channel_of(key.index, id.place)
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
