//! [`SimTransport`]: the simulated fabric as a [`Transport`], so that code written
//! against a connection API over the trait (cm-verbs' `Endpoint`) runs on the
//! simulation unchanged.
//!
//! One transport per node: it reads the node's device (asynchronous events and every
//! receive completion), as the real backend reads one device context once. Sends carry
//! their bytes; receives land in the buffers the connection posted, in order.
//!
//! This file holds the transport and its bookkeeping (QP lookup, collecting
//! completions); [`calls`] is its [`Transport`] implementation, [`queues`] a QP's
//! queues, [`shared`] the queues a device context's connections share (an SRQ, its
//! pool, two completion queues), [`qp_slots`] the QP number table, [`registration`] the
//! fabric's count of registered bytes and [`one_sided`] the sim-only calls that post
//! one-sided work (RDMA READ and WRITE) on an id's QP.
//!
//! [`Transport`]: cm_core::Transport

use std::collections::VecDeque;
use std::fmt;
use std::num::NonZeroU16;

use cm_core::{CmError, CqKind, QpNum, WorkCompletion};

use super::fabric::Fabric;
use super::tables::Slots;
use super::{NodeId, SimChannel, SimDevice, SimFabric, SimIdKey, SimNode, SimSide};
use crate::sim::SimCmId;
use one_sided::OneSided;
use qp_slots::{QpSlots, NO_SLOT};
use queues::{Pool, Queues};
pub(crate) use registration::Registered;
pub use shared::SimShared;
use shared::{shared_slot, SharedQueues};

mod calls;
mod one_sided;
mod qp_slots;
mod queues;
mod registration;
mod shared;

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
/// simulated packets), in sixteen bytes, as a scale run holds one per connection and
/// side ([`QueueCaps::validate`] bounds the depths to 16384). Registered bytes are
/// counted in [`SimStats::registered_buffers`] until it drops.
///
/// [`QueueCaps::validate`]: cm_core::QueueCaps::validate
/// [`SimStats::registered_buffers`]: crate::sim::SimStats::registered_buffers
#[derive(Debug)]
pub struct SimBuffers {
    /// Where the registered bytes go back.
    fabric: SimFabric,
    recv_depth: NonZeroU16,
    send_depth: u16,
    buffer_size: u32,
}

// Sixteen bytes per connection and side: checked when compiling.
const _: () = assert!(std::mem::size_of::<SimBuffers>() == 16);

impl SimBuffers {
    /// Bytes of the buffer area: receive buffers, then send buffers.
    fn bytes(&self) -> u64 {
        (u64::from(self.recv_depth.get()) + u64::from(self.send_depth))
            * u64::from(self.buffer_size)
    }
}

impl Drop for SimBuffers {
    fn drop(&mut self) {
        self.fabric.inner.registered.sub_buffers(self.bytes());
    }
}

/// Appends the first `len` bytes of a landed payload to `out` (zeroes past its end: a
/// length-only send carries no bytes, and the receiver sees a fresh buffer's zeroes).
fn append_landed(out: &mut Vec<u8>, data: Vec<u8>, len: usize) {
    let start = out.len();
    if start == 0 {
        // The landed payload's own memory, not a copy of it.
        *out = data;
        out.truncate(len);
    } else {
        out.extend_from_slice(&data[..len.min(data.len())]);
    }
    out.resize(start + len, 0);
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
/// bytes plus four per QP number of the fabric from its own first (a QP on shared
/// queues, [`SimShared`], only the four); what a QP has in
/// flight (payloads, completions) lives in a part it holds only meanwhile, from a small
/// pool of warm ones. A QP's state goes when its id is destroyed on the fabric, and its slot serves
/// the next QP created.
///
/// [`Transport`]: cm_core::Transport
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
    /// One-sided work posted and not yet on its QP's send queue, and the QPs a refused
    /// piece put in the error state.
    one_sided: OneSided,
    /// The shared queue sets ([`SimShared`]), few: one per device context.
    shared: Slots<SharedQueues>,
    /// The last SRQ handle number given out.
    srq_handles: u32,
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
            one_sided: OneSided::default(),
            shared: Slots::default(),
            srq_handles: 0,
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
        if reading && (!self.tokens.is_empty() || self.one_sided.waiting()) {
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
        if shared_slot(slot).is_some() {
            return Err(CmError::InvalidArgument {
                op,
                reason: "the QP is on shared queues",
            });
        }
        let queues = self.queues.get_mut(slot).ok_or(CmError::InvalidArgument {
            op,
            reason: "the QP was not created by this transport",
        })?;
        Ok((qp, queues, &mut self.pool))
    }

    /// Queues a send completion with `status` for `wr_id` on the id's QP (`None`: the
    /// id has none, refused) and marks its queues ready.
    fn complete_send(
        &mut self,
        qp: Option<QpNum>,
        wr_id: u64,
        status: cm_core::WcStatus,
    ) -> Result<(), CmError> {
        let (qp, queues, pool) = self.queues_of(qp, "ibv_post_send")?;
        queues.busy(pool).send.push_back(WorkCompletion {
            wr_id,
            qp,
            kind: CqKind::Send,
            status,
            byte_len: 0,
        });
        let token = queues.token;
        self.tokens.push_back(token);
        Ok(())
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
            if let Some(set) = shared_slot(slot).and_then(|set| self.shared.get_mut(set)) {
                set.arrive(completion.qp, data, completion.byte_len);
                if let Some(event) = set.land(&mut self.tokens) {
                    fabric.raise_async_event(set.node(), event);
                }
                continue;
            }
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
        self.one_sided.forget(&self.destroyed);
        for qp in self.destroyed.drain(..) {
            if let Some(slot) = self.by_qp.get_mut(qp) {
                match shared_slot(*slot) {
                    Some(set) => {
                        if let Some(set) = self.shared.get_mut(set) {
                            set.detach(qp);
                        }
                    }
                    None => drop(self.queues.take(*slot)),
                }
                *slot = NO_SLOT;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimCmEvent, SimConfig, SimPair};
    use cm_core::{CmEvent, QueueCaps, Transport};
    use std::time::Duration;

    const PORT: u16 = 7471;

    fn next_event(transport: &mut SimTransport, fabric: &crate::sim::SimFabric) -> SimCmEvent {
        fabric.run_until(|_| transport.channel.queued() > 0);
        transport.next_cm_event().unwrap().expect("an event")
    }

    /// One connection between two transports, through the trait: (server, client,
    /// server id, client id).
    pub(super) fn connected(
        caps: &QueueCaps,
    ) -> (SimPair, SimTransport, SimTransport, SimCmId, SimCmId) {
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
        client.connect(&active, b"", &Default::default()).unwrap();
        let request = next_event(&mut server, &pair.fabric);
        let passive = server.event_id(&request).unwrap();
        request.ack().unwrap();
        let device = server.open_device(&passive).unwrap();
        server.create_qp(&passive, &device, 2, caps).unwrap();
        server.accept(&passive, b"", &Default::default()).unwrap();
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
