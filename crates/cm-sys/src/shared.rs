//! Queues every connection on one device context may share ([`SharedQueues`]): a
//! protection domain of their own, one shared receive queue (SRQ), one registered pool
//! of receive and send buffers, and a send and a receive completion queue on a
//! [`CompletionChannel`]. An id puts its RC QP on them with
//! [`CmId::create_qp_shared`] and sends from the pool with [`CmId::post_shared_send`].
//!
//! Lifetimes: the queues are one reference-counted core. The [`SharedQueues`] handle
//! holds it, and so does every id whose QP is on it, until that QP is destroyed; the
//! core holds the device context open. So the handle, the ids and the channel may be
//! dropped in any order: the last owner tears the core down, its QPs already gone.

use std::mem::ManuallyDrop;
use std::ops::Range;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use crate::ffi::{
    ibv_alloc_pd, ibv_create_srq, ibv_dealloc_pd, ibv_destroy_srq, ibv_device_attr, ibv_modify_srq,
    ibv_pd, ibv_post_srq_recv, ibv_query_device, ibv_srq_attr, ibv_srq_attr_mask,
    ibv_srq_init_attr,
};
use cm_core::{CmError, SharedCaps};

use crate::cq::{CompletionChannel, CqKind, DeviceKey, OwnedCq};
use crate::device::DeviceRef;
use crate::ffi;
use crate::id::{verbs_result, CmId};
use crate::ready_qps::{ReadyQp, ReadyQpStats, ReadyQps};
use crate::verbs::{poll_cq_into, Completion, RegisteredMemory};

/// Which part of the pool a buffer is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Area {
    /// The receive buffers (first in the pool).
    Recv,
    /// The send buffers (after the receive buffers).
    Send,
}

/// Where each buffer of a pool lies: `recv_slots` receive buffers, then `send_slots`
/// send buffers, each `buffer_size` bytes. Checked once ([`SharedCaps::validate`]), so
/// no offset computed here can overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    caps: SharedCaps,
}

impl Layout {
    /// The first `len` bytes of buffer `slot` of `area`; a slot past the area or a
    /// length past the buffer is [`CmError::InvalidArgument`].
    fn range(
        &self,
        op: &'static str,
        area: Area,
        slot: u32,
        len: usize,
    ) -> Result<Range<usize>, CmError> {
        let (slots, first) = match area {
            Area::Recv => (self.caps.recv_slots, 0),
            Area::Send => (self.caps.send_slots, self.caps.recv_slots as usize),
        };
        if slot >= slots {
            return Err(CmError::InvalidArgument {
                op,
                reason: "no such buffer slot",
            });
        }
        if len > self.caps.buffer_size as usize {
            return Err(CmError::InvalidArgument {
                op,
                reason: "longer than a buffer of the shared pool",
            });
        }
        // Below pool_len, which validate() proved addressable.
        let start = (first + slot as usize) * self.caps.buffer_size as usize;
        Ok(start..start + len)
    }
}

/// An owned protection domain (`ibv_alloc_pd`), deallocated on drop.
struct ProtectionDomain(NonNull<ibv_pd>);

impl ProtectionDomain {
    /// `ibv_alloc_pd` on `device`'s context.
    fn alloc(device: &DeviceRef) -> Result<Self, CmError> {
        // SAFETY: the context is open while `device` is (the caller holds it).
        let pd = unsafe { ibv_alloc_pd(device.context().as_ptr()) };
        NonNull::new(pd)
            .map(ProtectionDomain)
            .ok_or_else(|| CmError::from_errno("ibv_alloc_pd", ffi::last_errno()))
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: everything created on the PD (SRQ, MR, QPs) is gone before it: the
        // core drops its fields in that order and every QP holds the core. A failure
        // (EBUSY) leaves the PD allocated: a leak, never a dangling use.
        let _ = unsafe { ibv_dealloc_pd(self.0.as_ptr()) };
    }
}

/// An owned shared receive queue (`ibv_create_srq`), destroyed on drop.
struct SharedReceiveQueue(NonNull<ffi::ibv_srq>);

impl SharedReceiveQueue {
    /// `ibv_create_srq` of `max_wr` receives of one scatter/gather entry on `pd`.
    fn create(pd: &ProtectionDomain, max_wr: u32) -> Result<Self, CmError> {
        let mut attr = ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ibv_srq_attr {
                max_wr,
                max_sge: 1,
                srq_limit: 0,
            },
        };
        // SAFETY: live PD; `attr` is valid for the call (libibverbs writes the actual
        // sizes back into it).
        let srq = unsafe { ibv_create_srq(pd.0.as_ptr(), &mut attr) };
        NonNull::new(srq)
            .map(SharedReceiveQueue)
            .ok_or_else(|| CmError::from_errno("ibv_create_srq", ffi::last_errno()))
    }
}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        // SAFETY: no QP uses the SRQ any more (each held the core until it was
        // destroyed). Its asynchronous events are acknowledged as they are read
        // (`AsyncEvents`), so the destroy does not wait on one of ours.
        let _ = unsafe { ibv_destroy_srq(self.0.as_ptr()) };
    }
}

/// The registered pool, deregistered on drop (before the SRQ whose receives point
/// into it and the PD it is registered on).
struct Pool(ManuallyDrop<RegisteredMemory>);

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and never used after. No QP can use the memory:
        // every QP on the shared queues held the core until it was destroyed. A failed
        // deregistration leaks the buffer.
        let _ = unsafe { ManuallyDrop::take(&mut self.0).deregister() };
    }
}

/// The shared queues themselves, owned by the [`SharedQueues`] handle and by every id
/// whose QP is on them.
pub(crate) struct SharedCore {
    // Fields drop in declaration order, which is the teardown order: the memory, the
    // SRQ, the CQs (each acknowledging its events), the PD, then the device context.
    pool: Pool,
    srq: SharedReceiveQueue,
    send_cq: OwnedCq,
    recv_cq: OwnedCq,
    pd: ProtectionDomain,
    layout: Layout,
    device: Arc<DeviceRef>,
}

// SAFETY: the PD, SRQ, CQs and MR are used only through libibverbs calls that are thread
// safe (providers lock their queues), and are freed only when the last owner drops the
// core. The buffer is only read and written with raw copies (`RegisteredMemory::read`,
// `write`), so concurrent copies and device writes give unspecified bytes, never a
// Rust aliasing violation.
unsafe impl Send for SharedCore {}
// SAFETY: see Send; every method takes `&self` and no field changes after creation.
unsafe impl Sync for SharedCore {}

impl SharedCore {
    /// The PD QPs on the shared queues are created on.
    pub(crate) fn pd(&self) -> *mut ibv_pd {
        self.pd.0.as_ptr()
    }

    /// The SRQ QPs on the shared queues receive from.
    pub(crate) fn srq(&self) -> *mut ffi::ibv_srq {
        self.srq.0.as_ptr()
    }

    /// One of the two completion queues.
    pub(crate) fn cq(&self, which: CqKind) -> *mut ffi::ibv_cq {
        match which {
            CqKind::Send => self.send_cq.as_ptr(),
            CqKind::Recv => self.recv_cq.as_ptr(),
        }
    }

    /// The device context the queues are on.
    pub(crate) fn device_key(&self) -> DeviceKey {
        DeviceKey::of(self.device.context())
    }

    /// Copies `data` into send buffer `slot` and posts one signalled SEND of it on `qp`.
    ///
    /// # Safety
    /// `qp` is a live QP created on these shared queues (its id holds the core), not
    /// destroyed during the call.
    pub(crate) unsafe fn post_send(
        &self,
        qp: *mut ffi::ibv_qp,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError> {
        const OP: &str = "ibv_post_send";
        let memory = &self.pool.0;
        let range = self.layout.range(OP, Area::Send, slot, data.len())?;
        memory.write(range.start, data);
        let mut sge = memory.sge(OP, range)?;
        // SAFETY: ibv_send_wr is integers, pointers and unions of those: all zeroes is
        // valid.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = ptr::null_mut();
        // SAFETY: live QP (caller) on this core's PD, so the pool's lkey is valid for
        // it; the WR and SGE are valid for the call (the provider copies them); the
        // memory lives as long as the QP (the QP's id holds the core).
        let ret = unsafe { ffi::ibv_post_send(qp, &mut wr, &mut bad) };
        verbs_result(OP, ret)
    }
}

/// A device context's shared queues: a protection domain of their own, a shared
/// receive queue (SRQ), a send and a receive completion queue on a
/// [`CompletionChannel`], and one registered pool of `recv_slots + send_slots` buffers
/// of `buffer_size` bytes (receive buffers first, then send buffers).
///
/// Ids put their QPs on them with [`CmId::create_qp_shared`]: every QP's receives come
/// from the SRQ and every completion (each naming its QP number) from the two CQs.
/// Dropping the handle keeps the queues as long as such a QP exists; the queues keep
/// the device context open.
///
/// `Send + Sync`: every method takes `&self`.
pub struct SharedQueues {
    // Before the core: the QPs made ahead go first.
    ready: ReadyQps,
    core: Arc<SharedCore>,
}

impl std::fmt::Debug for SharedQueues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedQueues")
            .field("device", &self.core.device_key())
            .field("caps", &self.core.layout.caps)
            .finish()
    }
}

impl SharedQueues {
    /// Creates the queues on the device `id` is bound to, their CQs on `channel` (of
    /// the same device), both armed and reporting `token`. Nothing is posted yet, and
    /// no SRQ limit is armed ([`SharedQueues::arm_limit`]; `caps.limit` is not read).
    ///
    /// The send CQ has room for twice the send buffers (the QPs' one-sided work
    /// completes there too), at most the device's `max_cqe`; the receive CQ one entry
    /// per receive buffer. [`CmError::InvalidArgument`] for sizes
    /// [`SharedCaps::validate`] refuses, an id not bound to a device yet, or a channel
    /// on another device; the verbs' errno otherwise.
    pub fn new(
        id: &CmId,
        channel: &CompletionChannel,
        token: u64,
        caps: &SharedCaps,
    ) -> Result<SharedQueues, CmError> {
        const OP: &str = "ibv_create_srq";
        caps.validate()?;
        let len = caps.pool_len().ok_or(CmError::InvalidArgument {
            op: OP,
            reason: "buffer pool larger than the address space",
        })?;
        let context = id.device_context(OP)?;
        if DeviceKey::of(context) != channel.device_key() {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "the completion channel is on another device",
            });
        }
        // Our own hold on the context: the queues outlive the id that found the device.
        let device = DeviceRef::take(context)?;
        let context = device.context();
        let max_cqe = max_cqe(&device)?;
        // Created in dependency order; on an error the locals drop in reverse, so
        // nothing is left behind.
        let pd = ProtectionDomain::alloc(&device)?;
        let srq = SharedReceiveQueue::create(&pd, caps.recv_slots)?;
        // Both fit an int: validate() caps each count at 65536.
        let send_depth = (caps.send_slots as i32 * 2).min(max_cqe.max(1));
        // SAFETY: the context is the channel's (checked), held open by `device`, which
        // the core drops after its CQs.
        let send_cq = unsafe { OwnedCq::create(context, channel.core(), send_depth, token) }?;
        // SAFETY: as above.
        let recv_cq =
            unsafe { OwnedCq::create(context, channel.core(), caps.recv_slots as i32, token) }?;
        for cq in [&send_cq, &recv_cq] {
            // SAFETY: live CQ created above, not shared yet.
            let ret = unsafe { ffi::ibv_req_notify_cq(cq.as_ptr(), 0) };
            verbs_result("ibv_req_notify_cq", ret)?;
        }
        // SAFETY: live PD, which the core deallocates only after the pool.
        let pool = Pool(ManuallyDrop::new(unsafe {
            RegisteredMemory::register(pd.0.as_ptr(), len, false)
        }?));
        let core = Arc::new(SharedCore {
            pool,
            srq,
            send_cq,
            recv_cq,
            pd,
            layout: Layout { caps: *caps },
            device,
        });
        Ok(SharedQueues {
            ready: ReadyQps::new(&core, caps.ready_qps),
            core,
        })
    }

    /// A QP made ahead with `max_send_wr` send work requests, if one is ready; the
    /// first call starts the pool ([`SharedCaps::ready_qps`]) at that depth.
    pub(crate) fn take_ready(&self, max_send_wr: u32) -> Option<ReadyQp> {
        self.ready.take(max_send_wr)
    }

    /// Starts the pool of QPs made ahead ([`SharedCaps::ready_qps`]) at `max_send_wr`
    /// send work requests before any is asked for (a server that knows its
    /// connections' depth when it starts listening); nothing if it started already.
    pub fn prepare_ready(&self, max_send_wr: u32) {
        self.ready.begin(max_send_wr);
    }

    /// What the QPs made ahead did: ready now, taken by accepts, or why the pool is off.
    pub fn ready_qps(&self) -> ReadyQpStats {
        self.ready.stats()
    }

    pub(crate) fn core(&self) -> &Arc<SharedCore> {
        &self.core
    }

    /// The sizes the queues were made with.
    pub fn caps(&self) -> SharedCaps {
        self.core.layout.caps
    }

    /// The device the queues are on.
    pub fn device_key(&self) -> DeviceKey {
        self.core.device_key()
    }

    /// The SRQ's handle, as the device's asynchronous events about it name it
    /// (`EventElement::Srq`: `SRQ_LIMIT_REACHED`, `SRQ_ERR`).
    pub fn srq_handle(&self) -> u32 {
        // SAFETY: live SRQ while the core is; `handle` is set at creation.
        unsafe { (*self.core.srq()).handle }
    }

    /// A completion queue's handle, as the device's asynchronous events about it name it
    /// (`EventElement::Cq`: `CQ_ERR`).
    pub fn cq_handle(&self, which: CqKind) -> u32 {
        // SAFETY: live CQ while the core is; `handle` is set at creation.
        unsafe { (*self.core.cq(which)).handle }
    }

    /// `ibv_post_srq_recv` of receive buffer `slot` (0..recv_slots), completing with
    /// `wr_id` on the receive CQ, on whichever QP a message arrives.
    ///
    /// Do not post a slot that is still posted: two receives would fill one buffer.
    pub fn post_recv(&self, slot: u32, wr_id: u64) -> Result<(), CmError> {
        const OP: &str = "ibv_post_srq_recv";
        let layout = &self.core.layout;
        let range = layout.range(OP, Area::Recv, slot, layout.caps.buffer_size as usize)?;
        let mut sge = self.core.pool.0.sge(OP, range)?;
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: live SRQ; the WR and SGE are valid for the call (the provider copies
        // them); the memory is registered on the SRQ's PD and outlives every QP that
        // can fill it.
        let ret = unsafe { ibv_post_srq_recv(self.core.srq(), &mut wr, &mut bad) };
        verbs_result(OP, ret)
    }

    /// Copies the first `len` bytes of receive buffer `slot` out (`len` at most the
    /// buffer size).
    pub fn read_recv(&self, slot: u32, len: usize) -> Result<Vec<u8>, CmError> {
        let range = self.core.layout.range("read_recv", Area::Recv, slot, len)?;
        Ok(self.core.pool.0.read(range))
    }

    /// Polls one of the completion queues (`ibv_poll_cq`), appending up to `max`
    /// completions to `out` (each names its QP); returns how many.
    pub fn poll_cq(
        &self,
        which: CqKind,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> Result<usize, CmError> {
        // SAFETY: the core's live CQ, destroyed only with the core, which `self` holds.
        unsafe { poll_cq_into(self.core.cq(which), out, max) }
    }

    /// Arms one of the completion queues (`ibv_req_notify_cq(cq, 0)`): its next
    /// completion raises one completion event on the channel.
    pub fn arm_cq(&self, which: CqKind) -> Result<(), CmError> {
        // SAFETY: the core's live CQ, as in poll_cq.
        let ret = unsafe { ffi::ibv_req_notify_cq(self.core.cq(which), 0) };
        verbs_result("ibv_req_notify_cq", ret)
    }

    /// Arms the SRQ's limit event (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): the device
    /// raises `IBV_EVENT_SRQ_LIMIT_REACHED` once, when taking a receive leaves fewer
    /// than `limit` posted (with `limit` posted, the next message does it); arm again
    /// after each event. 0 disarms it.
    pub fn arm_limit(&self, limit: u32) -> Result<(), CmError> {
        let mut attr = ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        let mask = ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as i32;
        // SAFETY: live SRQ; `attr` is valid for the call and only its limit is read.
        let ret = unsafe { ibv_modify_srq(self.core.srq(), &mut attr, mask) };
        verbs_result("ibv_modify_srq", ret)
    }
}

/// The device's largest completion queue (`ibv_query_device`'s `max_cqe`).
fn max_cqe(device: &DeviceRef) -> Result<i32, CmError> {
    // SAFETY: ibv_device_attr is integers and arrays of them: all zeroes is valid.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the context is open while `device` is; `attr` is valid for the call.
    let ret = unsafe { ibv_query_device(device.context().as_ptr(), &mut attr) };
    verbs_result("ibv_query_device", ret)?;
    Ok(attr.max_cqe)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            caps: SharedCaps {
                recv_slots: 4,
                send_slots: 2,
                buffer_size: 100,
                limit: 0,
                ready_qps: 0,
            },
        }
    }

    #[test]
    fn receive_buffers_come_first_then_send_buffers() {
        let layout = layout();
        assert_eq!(layout.range("t", Area::Recv, 0, 100), Ok(0..100));
        assert_eq!(layout.range("t", Area::Recv, 3, 7), Ok(300..307));
        assert_eq!(layout.range("t", Area::Send, 0, 5), Ok(400..405));
        assert_eq!(layout.range("t", Area::Send, 1, 100), Ok(500..600));
        assert_eq!(layout.range("t", Area::Send, 1, 0), Ok(500..500));
    }

    #[test]
    fn slots_and_lengths_past_the_pool_are_refused_not_clamped() {
        let layout = layout();
        for (area, slot, len) in [
            (Area::Recv, 4, 1),
            (Area::Send, 2, 1),
            (Area::Send, u32::MAX, 1),
            (Area::Recv, 0, 101),
            (Area::Send, 1, usize::MAX),
        ] {
            assert!(
                matches!(
                    layout.range("t", area, slot, len),
                    Err(CmError::InvalidArgument { op: "t", .. })
                ),
                "{area:?} {slot} {len}"
            );
        }
    }
}
