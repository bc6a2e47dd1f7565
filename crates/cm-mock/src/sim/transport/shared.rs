//! Queues every connection on one device context shares ([`Transport::create_shared`]):
//! one shared receive queue (SRQ) with its pool of receive buffers, a pool of send
//! buffers, and a send and a receive completion queue, as the real device has them.
//!
//! A QP on shared queues keeps nothing of its own on the transport: its entry in the
//! QP-number table names the set ([`ON_SHARED`] and the set's slot) instead of a
//! [`Queues`](super::queues::Queues) slot, so it costs less than an idle QP with its
//! own queues. A SEND arriving at any of the set's QPs takes the first receive posted
//! on the SRQ; with none posted it waits, in arrival order across the QPs (the real
//! QP would RNR-retry it), until one is. Completions name their QP.
//!
//! Notifications are armed as on a device: a completion queue that gets a completion
//! while armed raises one completion event with the set's token, then stays quiet until
//! [`Transport::arm_shared_cq`] (arming reports only completions that come after it).
//! The SRQ limit ([`Transport::arm_shared_limit`]) is checked as a receive is taken, as
//! rxe does: once fewer than the limit are left posted, the node's device raises one
//! `IBV_EVENT_SRQ_LIMIT_REACHED` and the limit is disarmed.
//!
//! [`Transport::create_shared`]: cm_core::Transport::create_shared
//! [`Transport::arm_shared_cq`]: cm_core::Transport::arm_shared_cq
//! [`Transport::arm_shared_limit`]: cm_core::Transport::arm_shared_limit

use std::collections::{HashMap, VecDeque};

use cm_core::{
    errno, AsyncEvent, AsyncEventType, CmError, CqKind, Errno, EventElement, QpNum, QueueCaps,
    SharedCaps, WcStatus, WorkCompletion,
};

use super::qp_slots::NO_SLOT;
use super::{SimDeviceReader, SimTransport};
use crate::sim::tables::Slots;
use crate::sim::{NodeId, Setup, SimCmId, SimFabric};

/// A QP-number table entry with this bit set (other than [`NO_SLOT`]) names a QP on
/// shared queues; the other bits are the set's slot.
pub(super) const ON_SHARED: u32 = 1 << 31;

/// The slot of the shared queues a QP-number table entry names, if it names some.
pub(super) fn shared_slot(entry: u32) -> Option<u32> {
    (entry != NO_SLOT && entry & ON_SHARED != 0).then_some(entry & !ON_SHARED)
}

/// Shared queues of a [`SimTransport`] ([`Transport::create_shared`]): the handle the
/// connection layer keeps and passes back; the queues themselves live on the
/// transport, until [`Transport::release_shared`]. A handle is only good on the
/// transport that made it.
///
/// [`Transport::create_shared`]: cm_core::Transport::create_shared
/// [`Transport::release_shared`]: cm_core::Transport::release_shared
#[derive(Debug)]
pub struct SimShared {
    slot: u32,
    handle: u32,
}

impl SimShared {
    /// The number naming the shared receive queue in its asynchronous events
    /// ([`EventElement::Srq`] of `IBV_EVENT_SRQ_LIMIT_REACHED`).
    pub fn srq_handle(&self) -> u32 {
        self.handle
    }
}

/// A SEND that came with no receive posted on the shared queue.
#[derive(Debug)]
struct Waiting {
    qp: QpNum,
    data: Vec<u8>,
    byte_len: u32,
}

/// One set of shared queues on the transport.
#[derive(Debug)]
pub(super) struct SharedQueues {
    handle: u32,
    token: u64,
    node: NodeId,
    caps: SharedCaps,
    /// Receives posted on the SRQ, in order: (receive buffer, work request id).
    posted: VecDeque<(u32, u64)>,
    /// Payloads that arrived with no receive posted, in arrival order.
    waiting: VecDeque<Waiting>,
    /// Payloads landed in receive buffers and not read yet, by buffer.
    landed: HashMap<u32, Vec<u8>>,
    recv: VecDeque<WorkCompletion>,
    send: VecDeque<WorkCompletion>,
    /// Whether each completion queue's notification is armed: send, receive.
    armed: [bool; 2],
    /// The SRQ limit while armed (0: disarmed).
    limit: u32,
    /// QPs on these queues, not yet seen destroyed.
    qps: u32,
    /// Where the pool's registered bytes go back when the queues go.
    fabric: SimFabric,
}

impl Drop for SharedQueues {
    fn drop(&mut self) {
        self.fabric
            .inner
            .registered
            .sub_pool(pool_bytes(&self.caps));
    }
}

/// Bytes of the pool of checked `caps`.
fn pool_bytes(caps: &SharedCaps) -> u64 {
    caps.pool_len().map_or(0, |len| len as u64)
}

fn invalid(op: &'static str, reason: &'static str) -> CmError {
    CmError::InvalidArgument { op, reason }
}

const fn cq_index(kind: CqKind) -> usize {
    match kind {
        CqKind::Send => 0,
        CqKind::Recv => 1,
    }
}

impl SharedQueues {
    /// Queues `completion` on its completion queue; an armed queue raises one event.
    pub(super) fn complete(&mut self, completion: WorkCompletion, tokens: &mut VecDeque<u64>) {
        let index = cq_index(completion.kind);
        match completion.kind {
            CqKind::Send => self.send.push_back(completion),
            CqKind::Recv => self.recv.push_back(completion),
        }
        if std::mem::take(&mut self.armed[index]) {
            tokens.push_back(self.token);
        }
    }

    /// A SEND's payload arrived at `qp`, one of these queues' QPs.
    pub(super) fn arrive(&mut self, qp: QpNum, data: Vec<u8>, byte_len: u32) {
        self.waiting.push_back(Waiting { qp, data, byte_len });
    }

    /// Lands waiting payloads in posted receives, oldest with oldest; the SRQ limit
    /// event, when a receive taken left fewer than the armed limit posted.
    pub(super) fn land(&mut self, tokens: &mut VecDeque<u64>) -> Option<AsyncEvent> {
        let mut event = None;
        while !self.waiting.is_empty() {
            let Some((slot, wr_id)) = self.posted.pop_front() else {
                break;
            };
            let Some(message) = self.waiting.pop_front() else {
                break;
            };
            // A message longer than the buffer fails the receive (the real QP would
            // also go to the error state: not modelled).
            let fits = message.byte_len <= self.caps.buffer_size;
            if fits {
                self.landed.insert(slot, message.data);
            } else {
                self.landed.remove(&slot);
            }
            let completion = WorkCompletion {
                wr_id,
                qp: message.qp,
                kind: CqKind::Recv,
                status: if fits {
                    WcStatus::Success
                } else {
                    WcStatus::LocLenErr
                },
                byte_len: if fits { message.byte_len } else { 0 },
            };
            self.complete(completion, tokens);
            if self.limit > 0 && self.posted.len() < self.limit as usize {
                self.limit = 0;
                event = Some(AsyncEvent {
                    event_type: AsyncEventType::SrqLimitReached,
                    element: EventElement::Srq(self.handle),
                });
            }
        }
        if self.waiting.is_empty() && self.waiting.capacity() > 64 {
            self.waiting.shrink_to(64);
        }
        event
    }

    /// `qp`, one of these queues' QPs, was destroyed: what waited for it goes (its
    /// completions already queued stay, as on a device until they are polled).
    pub(super) fn detach(&mut self, qp: QpNum) {
        self.qps = self.qps.saturating_sub(1);
        self.waiting.retain(|w| w.qp != qp);
    }

    /// The node whose device raises the queues' events.
    pub(super) fn node(&self) -> NodeId {
        self.node
    }
}

/// The live set `shared` names in `sets`.
fn set_of<'a>(
    sets: &'a mut Slots<SharedQueues>,
    shared: &SimShared,
    op: &'static str,
) -> Result<&'a mut SharedQueues, CmError> {
    sets.get_mut(shared.slot)
        .filter(|set| set.handle == shared.handle)
        .ok_or(invalid(op, "the shared queues were released"))
}

impl SimTransport {
    /// [`Transport::create_shared`](cm_core::Transport::create_shared).
    pub(super) fn shared_create(
        &mut self,
        id: &SimCmId,
        device: &SimDeviceReader,
        token: u64,
        caps: &SharedCaps,
    ) -> Result<SimShared, CmError> {
        const OP: &str = "ibv_create_srq";
        caps.validate()?;
        let node = id
            .with(|f| f.id_node(id.key))
            .ok_or(CmError::Gone { op: OP, what: "id" })?;
        if node != device.node {
            return Err(invalid(OP, "the device reader belongs to another node"));
        }
        self.srq_handles = self.srq_handles.wrapping_add(1);
        let handle = self.srq_handles;
        let fabric = self.node.fabric().clone();
        fabric.inner.registered.add_pool(pool_bytes(caps));
        let slot = self.shared.put(SharedQueues {
            handle,
            token,
            node,
            caps: *caps,
            posted: VecDeque::new(),
            waiting: VecDeque::new(),
            landed: HashMap::new(),
            recv: VecDeque::new(),
            send: VecDeque::new(),
            armed: [true; 2],
            limit: 0,
            qps: 0,
            fabric,
        });
        // The pool's registration takes its time once, whatever uses it.
        self.node.fabric().charge_setup(Setup::Register);
        Ok(SimShared { slot, handle })
    }

    /// [`Transport::create_qp_shared`](cm_core::Transport::create_qp_shared).
    pub(super) fn shared_create_qp(
        &mut self,
        id: &SimCmId,
        shared: &SimShared,
        caps: &QueueCaps,
    ) -> Result<QpNum, CmError> {
        const OP: &str = "rdma_create_qp";
        caps.validate()?;
        let node = set_of(&mut self.shared, shared, OP)?.node;
        let (qp, ids_destroyed) = id.with(|f| {
            if f.id_node(id.key) != Some(node) {
                return Err(invalid(OP, "the shared queues belong to another node"));
            }
            Ok((f.create_qp(id.key)?, f.ids_destroyed()))
        })?;
        if id.fabric.same(self.node.fabric()) {
            self.hint(id, Some(qp), ids_destroyed);
        }
        self.free_destroyed();
        if let Some(set) = self.shared.get_mut(shared.slot) {
            set.qps += 1;
        }
        self.by_qp.set(qp, ON_SHARED | shared.slot);
        // The QP's setup time passes; no registration: the pool is registered.
        id.fabric.charge_setup(Setup::CreateQp);
        Ok(qp)
    }

    /// [`Transport::post_shared_recv`](cm_core::Transport::post_shared_recv).
    pub(super) fn shared_post_recv(
        &mut self,
        shared: &SimShared,
        slot: u32,
        wr_id: u64,
    ) -> Result<(), CmError> {
        const OP: &str = "ibv_post_srq_recv";
        let set = set_of(&mut self.shared, shared, OP)?;
        if slot >= set.caps.recv_slots {
            return Err(invalid(OP, "no such receive buffer"));
        }
        if set.posted.len() >= set.caps.recv_slots as usize {
            // The queue is as deep as the pool.
            return Err(CmError::Os {
                op: OP,
                errno: Errno(errno::ENOMEM),
            });
        }
        set.posted.push_back((slot, wr_id));
        if let Some(event) = set.land(&mut self.tokens) {
            let node = set.node;
            self.node.fabric().lock().raise_async_event(node, event);
        }
        Ok(())
    }

    /// [`Transport::post_shared_send`](cm_core::Transport::post_shared_send).
    pub(super) fn shared_post_send(
        &mut self,
        id: &SimCmId,
        shared: &SimShared,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError> {
        const OP: &str = "ibv_post_send";
        let set = set_of(&mut self.shared, shared, OP)?;
        if slot >= set.caps.send_slots || data.len() > set.caps.buffer_size as usize {
            return Err(invalid(
                OP,
                "no such send buffer, or the message does not fit it",
            ));
        }
        // After the one-sided work posted before it.
        self.take_one_sided();
        let qp = self.qp_of(id).ok_or(invalid(OP, "the id has no QP"))?;
        if shared_slot(self.by_qp.get(qp)) != Some(shared.slot) {
            return Err(invalid(OP, "the id's QP is not on these shared queues"));
        }
        // On a QP a refused piece of one-sided work put in the error state, it flushes
        // and carries nothing; a QP the fabric refuses (not connected, disconnected)
        // refuses the post, as with the QP's own queues.
        let status = if self.one_sided.errored(qp) {
            WcStatus::WrFlushErr
        } else {
            id.with(|f| f.post_send_data(id.key, data))?;
            WcStatus::Success
        };
        let completion = WorkCompletion {
            wr_id,
            qp,
            kind: CqKind::Send,
            status,
            byte_len: 0,
        };
        let set = set_of(&mut self.shared, shared, OP)?;
        set.complete(completion, &mut self.tokens);
        Ok(())
    }

    /// [`Transport::read_shared_recv`](cm_core::Transport::read_shared_recv).
    pub(super) fn shared_read_recv(
        &mut self,
        shared: &SimShared,
        slot: u32,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CmError> {
        const OP: &str = "read_shared_recv";
        let set = set_of(&mut self.shared, shared, OP)?;
        if slot >= set.caps.recv_slots || len > set.caps.buffer_size as usize {
            return Err(invalid(OP, "no such receive buffer, or longer than it"));
        }
        let data = set.landed.remove(&slot).unwrap_or_default();
        super::append_landed(out, data, len);
        Ok(())
    }

    /// [`Transport::arm_shared_cq`](cm_core::Transport::arm_shared_cq).
    pub(super) fn shared_arm_cq(
        &mut self,
        shared: &SimShared,
        kind: CqKind,
    ) -> Result<(), CmError> {
        let set = set_of(&mut self.shared, shared, "ibv_req_notify_cq")?;
        set.armed[cq_index(kind)] = true;
        Ok(())
    }

    /// [`Transport::poll_shared_cq`](cm_core::Transport::poll_shared_cq).
    pub(super) fn shared_poll_cq(
        &mut self,
        shared: &SimShared,
        kind: CqKind,
        out: &mut Vec<WorkCompletion>,
        max: usize,
    ) -> Result<usize, CmError> {
        const OP: &str = "ibv_poll_cq";
        set_of(&mut self.shared, shared, OP)?;
        // As with a QP's own queues: what landed is in the queue, read or not.
        self.take_one_sided();
        self.collect_completions(|_| ());
        let set = set_of(&mut self.shared, shared, OP)?;
        let queue = match kind {
            CqKind::Send => &mut set.send,
            CqKind::Recv => &mut set.recv,
        };
        let n = max.min(queue.len());
        out.extend(queue.drain(..n));
        Ok(n)
    }

    /// [`Transport::arm_shared_limit`](cm_core::Transport::arm_shared_limit).
    pub(super) fn shared_arm_limit(
        &mut self,
        shared: &SimShared,
        limit: u32,
    ) -> Result<(), CmError> {
        const OP: &str = "ibv_modify_srq";
        let set = set_of(&mut self.shared, shared, OP)?;
        if limit >= set.caps.recv_slots {
            return Err(invalid(OP, "the SRQ limit must be below its receive count"));
        }
        set.limit = limit;
        Ok(())
    }

    /// [`Transport::release_shared`](cm_core::Transport::release_shared): the queues
    /// go, and their pool's bytes with them. QPs still on them (none, when the caller
    /// destroyed them first) are cut off: what arrives for them is dropped.
    pub(super) fn shared_release(&mut self, shared: SimShared) {
        self.free_destroyed();
        let Ok(set) = set_of(&mut self.shared, &shared, "ibv_destroy_srq") else {
            return;
        };
        if set.qps > 0 {
            self.by_qp.clear_entries(ON_SHARED | shared.slot);
        }
        self.shared.take(shared.slot);
    }
}
