//! [`SimTransport`]: the simulated fabric as a [`Transport`], so that code written
//! against a connection API over the trait (cm-verbs' `Endpoint`) runs on the
//! simulation unchanged.
//!
//! One transport per node: it reads the node's device (asynchronous events and every
//! receive completion), as the real backend reads one device context once. Sends carry
//! their bytes; receives land in the buffers the connection posted, in order.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::num::NonZeroU16;
use std::time::Duration;

use cm_core::{
    AsyncEvent, AsyncEventSource, CmError, CmEventSource, CqKind, QpNum, QueueCaps, Transport,
    WorkCompletion,
};

use super::fabric::Fabric;
use super::tables::{Chunked, Slots};
use super::{NodeId, SimChannel, SimCmEvent, SimCmId, SimDevice, SimIdKey, SimNode, SimSide};

/// An address on the simulated fabric: a node and a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimAddr {
    /// The node.
    pub node: NodeId,
    /// The port (the RDMA CM service).
    pub port: u16,
}

/// The device reader of a [`SimTransport`] (the node has one device).
#[derive(Debug)]
pub struct SimDeviceReader {
    node: NodeId,
}

/// A connection's buffers on the simulation: the sizes only (payloads travel with the
/// simulated packets), in eight bytes, as a scale run holds one per connection and
/// side ([`QueueCaps::validate`] bounds the depths to 16384).
#[derive(Debug)]
pub struct SimBuffers {
    recv_depth: NonZeroU16,
    send_depth: u16,
    buffer_size: u32,
}

/// A QP's state on the transport, kept small because a scale run holds one per
/// connection and side: the compact run of posted receives inline, everything else
/// (payloads, completions, receives posted out of order) in a [`Busy`] that only QPs
/// with something outstanding hold.
#[derive(Debug)]
struct Queues {
    token: u64,
    /// Everything beyond the compact state; `None` while it would be empty, as an idle
    /// connection's is.
    busy: Option<Box<Busy>>,
    /// The first receives of the posted FIFO, as a run: `len` work request ids from
    /// `first`, each the next modulo `wrap` (the receive depth). The connection API
    /// posts slot numbers as ids and reposts each slot as it is read, so its posted
    /// receives stay one such run however long it runs.
    run: Run,
}

// An idle QP costs its transport 24 bytes in the slot table: checked when compiling.
const _: () = assert!(std::mem::size_of::<Option<Queues>>() == 24);

/// A run of posted receive ids `first, first + 1, …` modulo `wrap`.
#[derive(Debug, Clone, Copy)]
struct Run {
    len: u32,
    first: u16,
    /// The QP's receive depth (at most 16384 by [`QueueCaps::validate`]); never 0, which
    /// also lets `Option<Queues>` take no room of its own.
    wrap: NonZeroU16,
}

impl Run {
    /// Whether `wr_id` can go at the end of the run.
    fn continues(&self, wr_id: u64) -> bool {
        let wrap = u64::from(self.wrap.get());
        wr_id < wrap
            && self.len < u32::MAX
            && (self.len == 0 || wr_id == (u64::from(self.first) + u64::from(self.len)) % wrap)
    }

    /// Appends `wr_id`, which [`Run::continues`] the run.
    fn push(&mut self, wr_id: u64) {
        if self.len == 0 {
            // Below `wrap`, a u16: checked by `continues`.
            self.first = wr_id as u16;
        }
        self.len += 1;
    }

    /// Takes the first id of a non-empty run.
    fn pop(&mut self) -> u64 {
        let wr_id = self.first;
        self.first = ((u32::from(wr_id) + 1) % u32::from(self.wrap.get())) as u16;
        self.len -= 1;
        u64::from(wr_id)
    }
}

/// The parts of a QP's state that are empty while the connection is idle.
#[derive(Debug, Default)]
struct Busy {
    /// Posted receives after the run, in order: ids that did not continue it (or came
    /// while some were already here).
    posted: VecDeque<u64>,
    /// Payloads that arrived with no receive posted (the real QP would RNR-retry them).
    unposted: VecDeque<(Vec<u8>, u32)>,
    landed: HashMap<u64, Vec<u8>>,
    recv: VecDeque<WorkCompletion>,
    send: VecDeque<WorkCompletion>,
}

impl Busy {
    /// Entries a pooled [`Busy`] keeps room for in each queue: what a connection with
    /// a few messages in flight needs, no more, so the pool stays small.
    const POOLED_ROOM: usize = 16;

    fn is_empty(&self) -> bool {
        self.posted.is_empty()
            && self.unposted.is_empty()
            && self.landed.is_empty()
            && self.recv.is_empty()
            && self.send.is_empty()
    }

    /// Gives back room beyond [`Busy::POOLED_ROOM`] of an empty one, before pooling it.
    fn trim(&mut self) {
        self.posted.shrink_to(Self::POOLED_ROOM);
        self.unposted.shrink_to(Self::POOLED_ROOM);
        self.landed.shrink_to(Self::POOLED_ROOM);
        self.recv.shrink_to(Self::POOLED_ROOM);
        self.send.shrink_to(Self::POOLED_ROOM);
    }
}

impl Queues {
    fn new(token: u64, recv_depth: NonZeroU16) -> Self {
        Queues {
            token,
            busy: None,
            run: Run {
                len: 0,
                first: 0,
                wrap: recv_depth,
            },
        }
    }

    /// The busy part, taken from `pool` (or allocated) when the QP had none.
    fn busy(&mut self, pool: &mut Pool) -> &mut Busy {
        self.busy.get_or_insert_with(|| pool.take())
    }

    /// Appends a posted receive to the FIFO: to the run while it continues it and
    /// nothing follows it.
    fn post(&mut self, wr_id: u64, pool: &mut Pool) {
        let behind = self.busy.as_ref().is_some_and(|b| !b.posted.is_empty());
        if !behind && self.run.continues(wr_id) {
            self.run.push(wr_id);
        } else {
            self.busy(pool).posted.push_back(wr_id);
        }
    }

    /// Takes the first posted receive; when that empties the run, the ids waiting
    /// behind it that form a run become the new one.
    fn take_posted(&mut self) -> Option<u64> {
        let wr_id = if self.run.len > 0 {
            self.run.pop()
        } else {
            self.busy.as_mut()?.posted.pop_front()?
        };
        if self.run.len == 0 {
            if let Some(busy) = self.busy.as_mut() {
                while let Some(&next) = busy.posted.front() {
                    if !self.run.continues(next) {
                        break;
                    }
                    busy.posted.pop_front();
                    self.run.push(next);
                }
            }
        }
        Some(wr_id)
    }

    /// Puts the busy part back in `pool` once it is empty, so that an idle connection
    /// holds nothing beyond its [`Queues`] and a busy one reuses a warm allocation.
    fn settle(&mut self, pool: &mut Pool) {
        if self.busy.as_ref().is_some_and(|b| b.is_empty()) {
            if let Some(busy) = self.busy.take() {
                pool.give(busy);
            }
        }
    }
}

/// Empty [`Busy`] parts kept for reuse, so that a connection going busy and idle in
/// turn (every message) allocates nothing once warm.
#[derive(Debug, Default)]
struct Pool {
    /// Boxed because a part moves between a QP and the pool as it is: neither way
    /// allocates.
    #[allow(clippy::vec_box)]
    parts: Vec<Box<Busy>>,
}

impl Pool {
    /// Parts kept at most: enough for the connections that carry traffic at one time
    /// in the benches, small next to the QPs themselves.
    const MAX: usize = 64;

    /// A pooled part, or a new one.
    fn take(&mut self) -> Box<Busy> {
        self.parts.pop().unwrap_or_default()
    }

    /// Keeps an empty part for reuse (trimmed), or drops it when the pool is full.
    fn give(&mut self, mut busy: Box<Busy>) {
        if self.parts.len() < Self::MAX {
            busy.trim();
            self.parts.push(busy);
        }
    }
}

/// No slot: the QP is not this transport's (or was freed).
const NO_SLOT: u32 = u32::MAX;

/// QP number → slot, as a table from the first QP number set: the QPs the fabric
/// numbered before it (the other nodes') take no room.
#[derive(Debug, Default)]
struct QpSlots {
    /// The QP number of entry 0.
    base: u32,
    slots: Chunked<u32>,
}

impl QpSlots {
    /// The slot of `qp` ([`NO_SLOT`]: none).
    fn get(&self, qp: QpNum) -> u32 {
        qp.0.checked_sub(self.base)
            .and_then(|index| self.slots.get(index as usize))
            .copied()
            .unwrap_or(NO_SLOT)
    }

    fn get_mut(&mut self, qp: QpNum) -> Option<&mut u32> {
        let index = qp.0.checked_sub(self.base)?;
        self.slots.get_mut(index as usize)
    }

    fn set(&mut self, qp: QpNum, slot: u32) {
        if self.slots.len() == 0 {
            self.base = qp.0;
        } else if qp.0 < self.base {
            // Below the first: the table starts over from `qp` (QPs are numbered in
            // creation order, so this does not happen on one fabric).
            let mut slots = Chunked::default();
            for _ in qp.0..self.base {
                slots.push(NO_SLOT);
            }
            for &old in self.slots.iter() {
                slots.push(old);
            }
            self.slots = slots;
            self.base = qp.0;
        }
        let index = (qp.0 - self.base) as usize;
        while self.slots.len() <= index {
            self.slots.push(NO_SLOT);
        }
        if let Some(entry) = self.slots.get_mut(index) {
            *entry = slot;
        }
    }

    /// Every entry, from the first QP number set.
    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = &u32> {
        self.slots.iter()
    }
}

/// The QP number of the id the transport last looked up, valid while the fabric
/// destroys no id: the connection API posts a connection's receives (and arms its
/// queues) one call after another, and those then take no lock.
#[derive(Debug, Clone, Copy)]
struct QpHint {
    key: SimIdKey,
    qp: QpNum,
    /// The fabric's count of destroyed ids when `qp` was read.
    ids_destroyed: u64,
}

/// The simulated fabric seen from one node, as a [`Transport`]. `Send`: an endpoint over
/// it can move to another thread, or into a task spawned on a multi-threaded runtime.
///
/// Built for scale runs: an idle QP (receives posted, nothing in flight) costs it 24
/// bytes plus four per QP number of the fabric from its own first; what a QP has in
/// flight (payloads, completions) lives in a part it holds only meanwhile, from a small
/// pool of warm ones. A QP's state goes when its id is destroyed on the fabric, and its slot serves
/// the next QP created.
pub struct SimTransport {
    node: SimNode,
    channel: SimChannel,
    device: SimDevice,
    /// Every QP's state, in a dense slot (reused once the QP is destroyed).
    queues: Slots<Queues>,
    /// QP number → slot in `queues` ([`NO_SLOT`] for the other nodes' QPs). The fabric
    /// numbers QPs densely, so a table beats a hash map: four bytes per QP of the
    /// fabric from this transport's first, no hashing.
    by_qp: QpSlots,
    /// The node's destroyed QPs, read from the fabric (kept for its room).
    destroyed: Vec<QpNum>,
    /// Empty [`Busy`] parts to reuse.
    pool: Pool,
    tokens: VecDeque<u64>,
    qp_hint: Option<QpHint>,
    on_step: Option<Box<dyn FnMut() + Send>>,
    /// The device's arrival counter when its completions were last collected
    /// (`u64::MAX`: never): while it stays there, none came since.
    collected_at: u64,
}

impl fmt::Debug for SimTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimTransport")
            .field("node", &self.node.id())
            .finish_non_exhaustive()
    }
}

impl SimTransport {
    /// A transport on `node`, with a channel of its own.
    pub fn new(node: &SimNode) -> Self {
        Self::on_side(SimSide::new(node.clone()))
    }

    /// A transport on one side of a [`super::SimPair`] (its node, channel and device).
    pub fn on_side(side: SimSide) -> Self {
        side.node
            .fabric()
            .lock()
            .watch_destroyed_qps(side.node.id());
        SimTransport {
            node: side.node,
            channel: side.channel,
            device: side.device,
            queues: Slots::default(),
            by_qp: QpSlots::default(),
            destroyed: Vec::new(),
            pool: Pool::default(),
            tokens: VecDeque::new(),
            qp_hint: None,
            on_step: None,
            collected_at: u64::MAX,
        }
    }

    /// The node.
    pub fn node(&self) -> &SimNode {
        &self.node
    }

    /// The address of `port` on this node.
    pub fn addr(&self, port: u16) -> SimAddr {
        SimAddr {
            node: self.node.id(),
            port,
        }
    }

    /// Runs `hook` before every step of virtual time a wait takes: the place to drive
    /// the other side of a test (another endpoint's non-blocking poll) while this one
    /// blocks. `Send`, so that the transport is: an endpoint shared with the hook goes
    /// in an `Arc<Mutex<_>>`.
    ///
    /// The hook runs inside a call on the endpoint that owns this transport (its wait),
    /// so it must not lock that endpoint, only the other side: a `Mutex` would deadlock
    /// (try_lock, as the fuzz target's hooks do, when both sides drive each other).
    pub fn on_step(&mut self, hook: impl FnMut() + Send + 'static) {
        self.on_step = Some(Box::new(hook));
    }

    /// Whether the channel, or the device when the caller reads it (`reading`), has
    /// something: a device whose reader was given back (or never opened) is not waited
    /// on, as `poll(2)` would not watch its descriptors. One look at the fabric.
    fn ready(&self, reading: bool) -> bool {
        if reading && !self.tokens.is_empty() {
            return true;
        }
        self.channel
            .queued_or_pending(reading.then_some(&self.device))
    }

    /// The id's QP number, its state, and the pool its busy part comes from and goes
    /// back to.
    fn queues(
        &mut self,
        id: &SimCmId,
        op: &'static str,
    ) -> Result<(QpNum, &mut Queues, &mut Pool), CmError> {
        let qp = self.qp_of(id);
        self.queues_of(qp, op)
    }

    /// The id's QP number ([`cm_core::CmId::qp_num`]), from the hint when it holds.
    fn qp_of(&mut self, id: &SimCmId) -> Option<QpNum> {
        let fabric = self.node.fabric();
        if !id.fabric.same(fabric) {
            return cm_core::CmId::qp_num(id);
        }
        if let Some(hint) = self.qp_hint {
            if hint.key == id.key && hint.ids_destroyed == fabric.ids_destroyed() {
                return Some(hint.qp);
            }
        }
        let (qp, ids_destroyed) = id.with(|f| (f.id_qp(id.key), f.ids_destroyed()));
        self.hint(id, qp, ids_destroyed);
        qp
    }

    /// Keeps `qp` (read with the fabric's count of destroyed ids) as the hint for `id`.
    fn hint(&mut self, id: &SimCmId, qp: Option<QpNum>, ids_destroyed: u64) {
        if let Some(qp) = qp {
            self.qp_hint = Some(QpHint {
                key: id.key,
                qp,
                ids_destroyed,
            });
        }
    }

    /// [`SimTransport::queues`] for a QP number the caller already read from the fabric
    /// (`None`: the id has no QP).
    fn queues_of(
        &mut self,
        qp: Option<QpNum>,
        op: &'static str,
    ) -> Result<(QpNum, &mut Queues, &mut Pool), CmError> {
        let qp = qp.ok_or(CmError::InvalidArgument {
            op,
            reason: "the id has no QP",
        })?;
        let slot = self.by_qp.get(qp);
        let queues = self.queues.get_mut(slot).ok_or(CmError::InvalidArgument {
            op,
            reason: "the QP was not created by this transport",
        })?;
        Ok((qp, queues, &mut self.pool))
    }

    /// Moves every receive completion of the node into its QP's queue, then runs
    /// `also` on the fabric: all under one lock (the connection API reads completions
    /// on every pass).
    fn collect_completions<R>(&mut self, also: impl FnOnce(&mut Fabric) -> R) -> R {
        let mut fabric = self.device.fabric.lock();
        let mut payload = Vec::new();
        while let Some(completion) = fabric.poll_cq_data(self.device.node, &mut payload) {
            let data = std::mem::take(&mut payload);
            let slot = self.by_qp.get(completion.qp);
            let Some(queues) = self.queues.get_mut(slot) else {
                continue;
            };
            queues
                .busy(&mut self.pool)
                .unposted
                .push_back((data, completion.byte_len));
            if Self::land(queues, completion.qp) {
                self.tokens.push_back(queues.token);
            }
        }
        also(&mut fabric)
    }

    /// Lands waiting payloads in posted receives; whether any landed.
    fn land(queues: &mut Queues, qp: QpNum) -> bool {
        let mut landed = false;
        while queues.busy.as_ref().is_some_and(|b| !b.unposted.is_empty()) {
            let Some(wr_id) = queues.take_posted() else {
                break;
            };
            let Some(busy) = queues.busy.as_mut() else {
                break;
            };
            let Some((data, byte_len)) = busy.unposted.pop_front() else {
                break;
            };
            busy.landed.insert(wr_id, data);
            busy.recv.push_back(WorkCompletion {
                wr_id,
                qp,
                kind: CqKind::Recv,
                status: cm_core::WcStatus::Success,
                byte_len,
            });
            landed = true;
        }
        landed
    }

    /// Frees the slots of the node's QPs destroyed since the last call, so that new
    /// QPs reuse them: the connection API never destroys a simulated id itself, but
    /// code that does (or destroys the channel) gets the memory back. The node keeps
    /// one list, read by whichever transport asks first: with two transports on one
    /// node (which also share its completions), one may miss the other's.
    fn free_destroyed(&mut self) {
        let node = self.node.id();
        self.node
            .fabric()
            .lock()
            .take_destroyed_qps(node, &mut self.destroyed);
        for qp in self.destroyed.drain(..) {
            if let Some(slot) = self.by_qp.get_mut(qp) {
                self.queues.take(*slot);
                *slot = NO_SLOT;
            }
        }
    }
}

impl Transport for SimTransport {
    type Addr = SimAddr;
    type Id = SimCmId;
    type Event = SimCmEvent;
    type Device = SimDeviceReader;
    type DeviceKey = NodeId;
    type Buffers = SimBuffers;

    fn create_id(&mut self) -> Result<SimCmId, CmError> {
        Ok(self.channel.create_id())
    }

    fn id_key(&self, id: &SimCmId) -> usize {
        let key = id.key();
        (key.generation as usize) << 32 | key.index as usize
    }

    fn next_cm_event(&mut self) -> Result<Option<SimCmEvent>, CmError> {
        self.channel.try_next_event()
    }

    fn event_id(&self, event: &SimCmEvent) -> Option<SimCmId> {
        Some(event.id())
    }

    fn event_listener(&self, event: &SimCmEvent) -> Option<SimCmId> {
        event.listen_id()
    }

    fn set_id_context(&mut self, id: &SimCmId, context: u32) -> bool {
        id.set_context(context)
    }

    fn event_context(&self, event: &SimCmEvent) -> Option<u32> {
        event.context()
    }

    fn bind(&mut self, id: &SimCmId, addr: SimAddr) -> Result<(), CmError> {
        if addr.node != self.node.id() {
            return Err(CmError::Os {
                op: "rdma_bind_addr",
                errno: cm_core::Errno(99 /* EADDRNOTAVAIL */),
            });
        }
        id.bind(addr.port)
    }

    fn listen(&mut self, id: &SimCmId, _backlog: u16) -> Result<(), CmError> {
        id.listen()
    }

    /// Destroys the id on the fabric, as the real backend's last handle does: a
    /// listener's port is free again, and requests to it are refused.
    fn release_id(&mut self, id: SimCmId) {
        // Refused only while an event of the id is unacknowledged (none is, for a
        // listener: its requests' events name the new ids): the id then stays.
        let _ = id.destroy();
    }

    fn resolve_addr(
        &mut self,
        id: &SimCmId,
        _src: Option<SimAddr>,
        dst: SimAddr,
        _timeout: Duration,
    ) -> Result<(), CmError> {
        id.resolve_addr(dst.node, dst.port)
    }

    fn resolve_route(&mut self, id: &SimCmId, _timeout: Duration) -> Result<(), CmError> {
        id.resolve_route()
    }

    fn connect(&mut self, id: &SimCmId, private_data: &[u8]) -> Result<(), CmError> {
        id.connect(private_data).map(drop)
    }

    fn accept(&mut self, id: &SimCmId, private_data: &[u8]) -> Result<(), CmError> {
        id.accept(private_data)
    }

    fn reject(&mut self, id: &SimCmId, private_data: &[u8]) -> Result<(), CmError> {
        id.reject(private_data)
    }

    fn disconnect(&mut self, id: &SimCmId) -> Result<(), CmError> {
        id.disconnect()
    }

    fn local_addr(&self, id: &SimCmId) -> Option<SimAddr> {
        id.node().map(|node| SimAddr { node, port: 0 })
    }

    fn peer_addr(&self, _id: &SimCmId) -> Option<SimAddr> {
        None
    }

    fn device_key(&self, id: &SimCmId) -> Option<NodeId> {
        id.node()
    }

    fn open_device(&mut self, id: &SimCmId) -> Result<SimDeviceReader, CmError> {
        let node = id.node().ok_or(CmError::Gone {
            op: "open_device",
            what: "id",
        })?;
        Ok(SimDeviceReader { node })
    }

    fn next_async_event(
        &mut self,
        _device: &mut SimDeviceReader,
    ) -> Result<Option<AsyncEvent>, CmError> {
        self.device.try_next_async_event()
    }

    fn next_cq_event(&mut self, _device: &mut SimDeviceReader) -> Result<Option<u64>, CmError> {
        let mark = self.device.arrivals();
        if mark != self.collected_at {
            self.collect_completions(|_| ());
            self.collected_at = mark;
        }
        Ok(self.tokens.pop_front())
    }

    fn create_qp(
        &mut self,
        id: &SimCmId,
        device: &SimDeviceReader,
        token: u64,
        caps: &QueueCaps,
    ) -> Result<QpNum, CmError> {
        caps.validate()?;
        // Checked by `validate`: 1 to 16384.
        let recv_depth = u16::try_from(caps.recv_depth)
            .ok()
            .and_then(NonZeroU16::new)
            .ok_or(CmError::InvalidArgument {
                op: "create_qp",
                reason: "receive depth out of range",
            })?;
        let (qp, ids_destroyed) = id.with(|f| {
            if f.id_node(id.key) != Some(device.node) {
                return Err(CmError::InvalidArgument {
                    op: "create_qp",
                    reason: "the device reader belongs to another node",
                });
            }
            Ok((f.create_qp(id.key)?, f.ids_destroyed()))
        })?;
        if id.fabric.same(self.node.fabric()) {
            // The receives are posted next.
            self.hint(id, Some(qp), ids_destroyed);
        }
        self.free_destroyed();
        let slot = self.queues.put(Queues::new(token, recv_depth));
        self.by_qp.set(qp, slot);
        Ok(qp)
    }

    fn register_buffers(&mut self, _id: &SimCmId, caps: &QueueCaps) -> Result<SimBuffers, CmError> {
        caps.validate()?;
        let out_of_range = || CmError::InvalidArgument {
            op: "register_buffers",
            reason: "queue depth out of range",
        };
        Ok(SimBuffers {
            recv_depth: u16::try_from(caps.recv_depth)
                .ok()
                .and_then(NonZeroU16::new)
                .ok_or_else(out_of_range)?,
            send_depth: u16::try_from(caps.send_depth).map_err(|_| out_of_range())?,
            buffer_size: caps.buffer_size,
        })
    }

    fn post_recv(
        &mut self,
        id: &SimCmId,
        buffers: &SimBuffers,
        slot: u32,
        wr_id: u64,
    ) -> Result<(), CmError> {
        if slot >= u32::from(buffers.recv_depth.get()) {
            return Err(CmError::InvalidArgument {
                op: "ibv_post_recv",
                reason: "no such receive buffer",
            });
        }
        let (qp, queues, pool) = self.queues(id, "ibv_post_recv")?;
        queues.post(wr_id, pool);
        let token = queues.token;
        if Self::land(queues, qp) {
            self.tokens.push_back(token);
        }
        Ok(())
    }

    fn post_send(
        &mut self,
        id: &SimCmId,
        buffers: &SimBuffers,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError> {
        if slot >= u32::from(buffers.send_depth) || data.len() > buffers.buffer_size as usize {
            return Err(CmError::InvalidArgument {
                op: "ibv_post_send",
                reason: "no such send buffer, or the message does not fit it",
            });
        }
        let qp = id.with(|f| {
            f.post_send_data(id.key, data)?;
            Ok::<_, CmError>(f.id_qp(id.key))
        })?;
        let (qp, queues, pool) = self.queues_of(qp, "ibv_post_send")?;
        queues.busy(pool).send.push_back(WorkCompletion {
            wr_id,
            qp,
            kind: CqKind::Send,
            status: cm_core::WcStatus::Success,
            byte_len: 0,
        });
        let token = queues.token;
        self.tokens.push_back(token);
        Ok(())
    }

    fn read_recv(
        &mut self,
        id: &SimCmId,
        _buffers: &SimBuffers,
        slot: u32,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CmError> {
        let (_, queues, pool) = self.queues(id, "read_recv")?;
        let data = queues
            .busy
            .as_mut()
            .and_then(|busy| busy.landed.remove(&u64::from(slot)))
            .unwrap_or_default();
        queues.settle(pool);
        if out.is_empty() {
            // The landed payload's own memory, not a copy of it.
            let mut data = data;
            data.truncate(len);
            *out = data;
        } else {
            out.extend_from_slice(&data[..len.min(data.len())]);
        }
        // A length-only send carries no bytes: the receiver sees zeroes, as in a fresh
        // buffer.
        out.resize(len, 0);
        Ok(())
    }

    fn arm_cq(&mut self, id: &SimCmId, _kind: CqKind) -> Result<(), CmError> {
        self.queues(id, "ibv_req_notify_cq").map(drop)
    }

    fn poll_cq(
        &mut self,
        id: &SimCmId,
        kind: CqKind,
        out: &mut Vec<WorkCompletion>,
        max: usize,
    ) -> Result<usize, CmError> {
        // As on a device, a completion is in its queue once it landed, whether or not
        // the completion channel was read since (busy polling polls queues first). The
        // id's QP is read under the same lock when the id is of this fabric.
        let qp = if id.fabric.same(&self.device.fabric) {
            self.collect_completions(|f| f.id_qp(id.key))
        } else {
            self.collect_completions(|_| ());
            cm_core::CmId::qp_num(id)
        };
        let (_, queues, pool) = self.queues_of(qp, "ibv_poll_cq")?;
        let Some(busy) = queues.busy.as_mut() else {
            return Ok(0);
        };
        let queue = match kind {
            CqKind::Recv => &mut busy.recv,
            CqKind::Send => &mut busy.send,
        };
        let n = max.min(queue.len());
        out.extend(queue.drain(..n));
        queues.settle(pool);
        Ok(n)
    }

    fn now(&self) -> Duration {
        self.node.fabric().now()
    }

    fn wait(
        &mut self,
        devices: &[SimDeviceReader],
        timeout: Option<Duration>,
    ) -> Result<bool, CmError> {
        let reading = !devices.is_empty();
        let fabric = self.node.fabric();
        // In the fabric's nanoseconds (saturating, as `SimFabric::advance` counts).
        let deadline = timeout.map(|t| {
            let t = u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
            fabric.lock().now_nanos().saturating_add(t)
        });
        loop {
            if self.ready(reading) {
                return Ok(true);
            }
            if let Some(hook) = self.on_step.as_mut() {
                hook();
                if self.ready(reading) {
                    return Ok(true);
                }
            }
            // The next action, or the deadline: one lock.
            let mut locked = fabric.lock();
            match (locked.next_due(), deadline) {
                (Some(due), Some(deadline)) if due > deadline => {
                    locked.set_now(deadline);
                    return Ok(false);
                }
                (Some(_), _) => {
                    locked.step();
                }
                (None, Some(deadline)) => {
                    locked.set_now(deadline);
                    return Ok(false);
                }
                (None, None) => return Err(CmError::Idle { op: "wait" }),
            }
        }
    }

    fn wait_step(
        &mut self,
        devices: &[SimDeviceReader],
        timeout: Option<Duration>,
    ) -> Result<bool, CmError> {
        if self.ready(!devices.is_empty()) {
            return Ok(true);
        }
        let fabric = self.node.fabric();
        let mut locked = fabric.lock();
        let deadline = timeout.map(|t| {
            let t = u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
            locked.now_nanos().saturating_add(t)
        });
        match (locked.next_due(), deadline) {
            (Some(due), Some(deadline)) if due > deadline => Ok(false),
            (Some(_), _) => {
                locked.step();
                Ok(true)
            }
            (None, _) => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimConfig, SimPair, SplitMix64};
    use cm_core::CmEvent;

    /// The posted receives answer exactly as a plain FIFO of ids, whatever mix of runs,
    /// out-of-order slots and ids beyond the depth is posted.
    #[test]
    fn posted_receives_keep_their_order_in_every_form() {
        let mut rng = SplitMix64::new(5);
        let mut pool = Pool::default();
        for depth in [1u16, 2, 5, 16] {
            let mut queues = Queues::new(7, NonZeroU16::new(depth).unwrap());
            let mut model = VecDeque::new();
            for _ in 0..20_000 {
                if rng.chance(0.5) {
                    let next = model
                        .back()
                        .map_or(0, |&last: &u64| last.wrapping_add(1) % u64::from(depth));
                    let wr_id = match rng.up_to(9) {
                        0 => rng.up_to(u64::from(depth) * 2),
                        1 => u64::MAX - rng.up_to(1),
                        _ => next,
                    };
                    queues.post(wr_id, &mut pool);
                    model.push_back(wr_id);
                } else {
                    assert_eq!(queues.take_posted(), model.pop_front());
                }
            }
            while let Some(wr_id) = model.pop_front() {
                assert_eq!(queues.take_posted(), Some(wr_id));
            }
            assert_eq!(queues.take_posted(), None);
            queues.settle(&mut pool);
            assert!(queues.busy.is_none(), "emptied, the busy part goes back");
        }
    }

    /// The connection API's pattern (slots posted in order, each reposted as it is
    /// read) stays a run: no busy part at rest, however many messages went through.
    #[test]
    fn reposting_slots_in_order_stays_a_run() {
        let mut pool = Pool::default();
        let mut queues = Queues::new(0, NonZeroU16::new(4).unwrap());
        for slot in 0..4 {
            queues.post(slot, &mut pool);
        }
        for message in 0..10 {
            assert_eq!(queues.take_posted(), Some(message % 4));
            queues.post(message % 4, &mut pool);
            assert!(queues.busy.is_none());
        }
        assert_eq!(queues.run.len, 4);
    }

    const PORT: u16 = 7471;

    fn next_event(transport: &mut SimTransport, fabric: &crate::sim::SimFabric) -> SimCmEvent {
        fabric.run_until(|_| transport.channel.queued() > 0);
        transport.next_cm_event().unwrap().expect("an event")
    }

    /// One connection between two transports, through the trait: (server, client,
    /// server id, client id).
    fn connected(caps: &QueueCaps) -> (SimPair, SimTransport, SimTransport, SimCmId, SimCmId) {
        let pair = SimPair::new(SimConfig::default(), 3);
        let mut server = SimTransport::on_side(pair.server.clone());
        let mut client = SimTransport::on_side(pair.client.clone());
        let listener = server.create_id().unwrap();
        server.bind(&listener, server.addr(PORT)).unwrap();
        server.listen(&listener, 8).unwrap();
        let active = client.create_id().unwrap();
        let timeout = Duration::from_millis(100);
        client
            .resolve_addr(&active, None, server.addr(PORT), timeout)
            .unwrap();
        next_event(&mut client, &pair.fabric).ack().unwrap();
        client.resolve_route(&active, timeout).unwrap();
        next_event(&mut client, &pair.fabric).ack().unwrap();
        let device = client.open_device(&active).unwrap();
        client.create_qp(&active, &device, 1, caps).unwrap();
        client.connect(&active, b"").unwrap();
        let request = next_event(&mut server, &pair.fabric);
        let passive = server.event_id(&request).unwrap();
        request.ack().unwrap();
        let device = server.open_device(&passive).unwrap();
        server.create_qp(&passive, &device, 2, caps).unwrap();
        server.accept(&passive, b"").unwrap();
        next_event(&mut client, &pair.fabric).ack().unwrap();
        (pair, server, client, passive, active)
    }

    /// Messages land in the posted buffers in order, and once read the receiving QP
    /// holds no busy part.
    #[test]
    fn messages_land_in_order_and_leave_the_qp_idle() {
        let caps = QueueCaps {
            recv_depth: 2,
            ..QueueCaps::default()
        };
        let (pair, mut server, mut client, passive, active) = connected(&caps);
        let (server_buffers, client_buffers) = (
            server.register_buffers(&passive, &caps).unwrap(),
            client.register_buffers(&active, &caps).unwrap(),
        );
        for slot in 0..2 {
            server
                .post_recv(&passive, &server_buffers, slot, u64::from(slot))
                .unwrap();
        }
        let mut device = SimDeviceReader {
            node: pair.server.node.id(),
        };
        for (n, message) in [&b"one"[..], b"two", b"three"].into_iter().enumerate() {
            client
                .post_send(&active, &client_buffers, 0, message, 9)
                .unwrap();
            let mut sent = Vec::new();
            assert_eq!(
                client.poll_cq(&active, CqKind::Send, &mut sent, 8).unwrap(),
                1
            );
            pair.fabric.run_until_idle();
            assert_eq!(server.next_cq_event(&mut device).unwrap(), Some(2));
            let mut completions = Vec::new();
            server
                .poll_cq(&passive, CqKind::Recv, &mut completions, 8)
                .unwrap();
            let slot = (n % 2) as u32;
            assert_eq!(completions.len(), 1);
            assert_eq!(completions[0].wr_id, u64::from(slot));
            let mut out = Vec::new();
            server
                .read_recv(&passive, &server_buffers, slot, message.len(), &mut out)
                .unwrap();
            assert_eq!(out, message);
            server
                .post_recv(&passive, &server_buffers, slot, u64::from(slot))
                .unwrap();
            for transport in [&server, &client] {
                let idle = transport.by_qp.iter().filter(|&&s| s != NO_SLOT);
                for &slot in idle {
                    let queues = transport.queues.get(slot).unwrap();
                    assert!(queues.busy.is_none(), "message {n}: a busy part kept");
                }
            }
        }
    }

    /// The QP number hinted for the last id holds only until an id is destroyed: a
    /// call on a destroyed id answers as it would without the hint.
    #[test]
    fn a_destroyed_id_is_not_answered_from_the_hint() {
        let caps = QueueCaps::default();
        let (_pair, mut server, _client, passive, _active) = connected(&caps);
        let device = server.open_device(&passive).unwrap();
        let buffers = server.register_buffers(&passive, &caps).unwrap();
        let id = server.create_id().unwrap();
        server.bind(&id, server.addr(100)).unwrap();
        server.create_qp(&id, &device, 5, &caps).unwrap();
        server.post_recv(&id, &buffers, 0, 0).unwrap();
        assert_eq!(server.qp_hint.map(|h| h.key), Some(id.key()));
        id.destroy().unwrap();
        let refused = server.post_recv(&id, &buffers, 1, 1);
        assert!(
            matches!(refused, Err(CmError::InvalidArgument { reason, .. }) if reason == "the id has no QP"),
            "{refused:?}"
        );
        // Another id's destruction also ends the hint; the live one is looked up again.
        server.post_recv(&passive, &buffers, 0, 0).unwrap();
        let other = server.create_id().unwrap();
        other.destroy().unwrap();
        server.post_recv(&passive, &buffers, 1, 1).unwrap();
        server.arm_cq(&passive, CqKind::Recv).unwrap();
    }

    /// A destroyed QP's slot is freed by the sweep and reused: creating and destroying
    /// QPs in turn does not grow the transport.
    #[test]
    fn destroyed_qps_give_their_slots_back() {
        let caps = QueueCaps::default();
        let (_pair, mut server, _client, passive, _active) = connected(&caps);
        let device = server.open_device(&passive).unwrap();
        let mut ids = Vec::new();
        for round in 0..50u64 {
            for port in 0..4 {
                let id = server.create_id().unwrap();
                server.bind(&id, server.addr(100 + port)).unwrap();
                server.create_qp(&id, &device, round, &caps).unwrap();
                ids.push(id);
            }
            for id in ids.drain(..) {
                id.destroy().unwrap();
            }
        }
        // The last round's QPs go when the next QP is created.
        let live = server.by_qp.iter().filter(|&&s| s != NO_SLOT).count();
        assert_eq!(live, 1 + 4);
        assert_eq!(server.queues.len(), 1 + 4);
        // The connection's QP was never destroyed: it is still found.
        server.arm_cq(&passive, CqKind::Recv).unwrap();
    }
}
