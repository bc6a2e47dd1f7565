//! The id's minimal data path: memory registered for its QP, SEND/RECV, and its
//! completion queues (polled and re-armed).

use std::ops::Range;
use std::ptr;
use std::sync::{Arc, PoisonError};

use cm_core::CmError;

use super::{verbs_result, CmId};
use crate::cq::CqKind;
use crate::ffi;
use crate::verbs::{Completion, MemoryRegion, RegisteredMemory, RemoteMemory};

impl CmId {
    /// Registers `len` zeroed bytes with the device for local read/write, for this id's
    /// QP. The memory lives as long as the id (after its QP is destroyed).
    pub fn register_memory(&self, len: usize) -> Result<MemoryRegion, CmError> {
        self.register(len, false)
    }

    /// Registers `len` zeroed bytes that the peer may also read and write with RDMA
    /// READ/WRITE ([`CmId::remote_memory`] says where they are). The memory lives as
    /// long as the id.
    pub fn register_remote_memory(&self, len: usize) -> Result<MemoryRegion, CmError> {
        self.register(len, true)
    }

    /// What the peer needs to reach `range` of `region` with RDMA READ/WRITE.
    pub fn remote_memory(
        &self,
        region: &MemoryRegion,
        range: Range<usize>,
    ) -> Result<RemoteMemory, CmError> {
        self.with_region("remote_memory", region, &range, |memory| {
            Ok(memory.remote(range.clone()))
        })
    }

    /// `ibv_post_send` of one signalled RDMA WRITE of `range` of the region into the
    /// peer's `remote` memory (at most its length), completing with `wr_id` on the
    /// send queue.
    pub fn post_rdma_write(
        &self,
        region: &MemoryRegion,
        range: Range<usize>,
        remote: RemoteMemory,
        wr_id: u64,
    ) -> Result<(), CmError> {
        let opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        self.post_send_wr(
            "ibv_post_send (RDMA WRITE)",
            opcode,
            region,
            range,
            Some(remote),
            wr_id,
        )
    }

    /// `ibv_post_send` of one signalled RDMA READ of the peer's `remote` memory into
    /// `range` of the region (at most the remote length), completing with `wr_id` on
    /// the send queue.
    pub fn post_rdma_read(
        &self,
        region: &MemoryRegion,
        range: Range<usize>,
        remote: RemoteMemory,
        wr_id: u64,
    ) -> Result<(), CmError> {
        let opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
        self.post_send_wr(
            "ibv_post_send (RDMA READ)",
            opcode,
            region,
            range,
            Some(remote),
            wr_id,
        )
    }

    /// One signalled work request on the send queue: `opcode` over `range` of the
    /// region, and the peer's `remote` memory for a one-sided one.
    fn post_send_wr(
        &self,
        op: &'static str,
        opcode: ffi::ibv_wr_opcode::Type,
        region: &MemoryRegion,
        range: Range<usize>,
        remote: Option<RemoteMemory>,
        wr_id: u64,
    ) -> Result<(), CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        self.with_region(op, region, &range, |memory| {
            self.post_send_locked(op, opcode, memory, range.clone(), remote, wr_id)
        })
    }

    /// [`CmId::post_send_wr`] on `memory`, `range` in bounds; the caller holds the ops
    /// lock.
    pub(super) fn post_send_locked(
        &self,
        op: &'static str,
        opcode: ffi::ibv_wr_opcode::Type,
        memory: &RegisteredMemory,
        range: Range<usize>,
        remote: Option<RemoteMemory>,
        wr_id: u64,
    ) -> Result<(), CmError> {
        if remote.is_some_and(|remote| range.len() as u64 > remote.len) {
            return Err(CmError::InvalidArgument {
                op,
                reason: "longer than the remote memory",
            });
        }
        let qp = self.qp_ptr(op)?;
        let mut sge = memory.sge(op, range)?;
        // SAFETY: ibv_send_wr is integers, pointers and unions of those: all zeroes is
        // valid.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = opcode;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        if let Some(remote) = remote {
            wr.wr.rdma.remote_addr = remote.addr;
            wr.wr.rdma.rkey = remote.rkey;
        }
        let mut bad = ptr::null_mut();
        // SAFETY: live QP (the ops lock excludes its destruction); the WR and SGE are
        // valid for the call (the provider copies them); the local memory is registered
        // and stays so while work requests may use it; the remote side checks its own.
        let ret = unsafe { ffi::ibv_post_send(qp, &mut wr, &mut bad) };
        // ibv_post_send returns the errno itself.
        verbs_result(op, ret)
    }

    /// `ibv_post_recv` of one receive into `range` (in bounds) of `memory`; the caller
    /// holds the ops lock.
    pub(super) fn post_recv_locked(
        &self,
        memory: &RegisteredMemory,
        range: Range<usize>,
        wr_id: u64,
    ) -> Result<(), CmError> {
        const OP: &str = "ibv_post_recv";
        let qp = self.qp_ptr(OP)?;
        let mut sge = memory.sge(OP, range)?;
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: as post_send_locked: live QP, WR valid for the call, memory registered
        // while work requests may use it.
        let ret = unsafe { ffi::ibv_post_recv(qp, &mut wr, &mut bad) };
        verbs_result(OP, ret)
    }

    fn register(&self, len: usize, remote: bool) -> Result<MemoryRegion, CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        // SAFETY: live id, read under the ops lock.
        let pd = unsafe { (*self.inner.as_ptr()).pd };
        if pd.is_null() {
            return Err(CmError::InvalidArgument {
                op: "ibv_reg_mr",
                reason: "the id is not bound to a device yet",
            });
        }
        // SAFETY: `pd` is the device's PD, alive while the id is; the id outlives the
        // region (regions are deregistered in IdInner's Drop).
        let region = unsafe { RegisteredMemory::register(pd, len, remote) }?;
        let mut regions = self
            .inner
            .regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let handle = MemoryRegion {
            owner: Arc::as_ptr(&self.inner) as usize,
            index: regions.len(),
            len,
        };
        regions.push(region);
        Ok(handle)
    }

    fn with_region<T>(
        &self,
        op: &'static str,
        region: &MemoryRegion,
        range: &Range<usize>,
        f: impl FnOnce(&RegisteredMemory) -> Result<T, CmError>,
    ) -> Result<T, CmError> {
        if region.owner != Arc::as_ptr(&self.inner) as usize {
            return Err(CmError::InvalidArgument {
                op,
                reason: "the memory region belongs to another id",
            });
        }
        let regions = self
            .inner
            .regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Checked against the memory itself, not the handle: a handle outliving its id
        // could name a region of a later id at the same address.
        let memory = regions.get(region.index).ok_or(CmError::InvalidArgument {
            op,
            reason: "unknown memory region",
        })?;
        if range.start > range.end || range.end > memory.len() {
            return Err(CmError::InvalidArgument {
                op,
                reason: "range outside the memory region",
            });
        }
        f(memory)
    }

    /// Copies `data` into the region at `offset`.
    ///
    /// Do not write into bytes a posted receive may be filling: their content is then
    /// unspecified (the call stays memory-safe).
    pub fn write_memory(
        &self,
        region: &MemoryRegion,
        offset: usize,
        data: &[u8],
    ) -> Result<(), CmError> {
        let range = offset..offset.saturating_add(data.len());
        self.with_region("write_memory", region, &range, |memory| {
            memory.write(offset, data);
            Ok(())
        })
    }

    /// Copies `range` of the region out.
    pub fn read_memory(
        &self,
        region: &MemoryRegion,
        range: Range<usize>,
    ) -> Result<Vec<u8>, CmError> {
        self.with_region("read_memory", region, &range, |memory| {
            Ok(memory.read(range.clone()))
        })
    }

    /// `ibv_post_send` of one signalled SEND of `range` of the region.
    pub fn post_send(
        &self,
        region: &MemoryRegion,
        range: Range<usize>,
        wr_id: u64,
    ) -> Result<(), CmError> {
        let opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        self.post_send_wr("ibv_post_send", opcode, region, range, None, wr_id)
    }

    /// `ibv_post_recv` of one receive into `range` of the region.
    pub fn post_recv(
        &self,
        region: &MemoryRegion,
        range: Range<usize>,
        wr_id: u64,
    ) -> Result<(), CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        self.with_region("ibv_post_recv", region, &range, |memory| {
            self.post_recv_locked(memory, range.clone(), wr_id)
        })
    }

    /// Polls the send completion queue: up to `max` completions (at most 64 per call;
    /// `max` 0: an empty vector).
    pub fn poll_send_cq(&self, max: usize) -> Result<Vec<Completion>, CmError> {
        let mut out = Vec::with_capacity(max.min(64));
        self.poll_cq(CqKind::Send, &mut out, max.min(64))?;
        Ok(out)
    }

    /// Polls the receive completion queue: up to `max` completions (at most 64 per call).
    pub fn poll_recv_cq(&self, max: usize) -> Result<Vec<Completion>, CmError> {
        let mut out = Vec::with_capacity(max.min(64));
        self.poll_cq(CqKind::Recv, &mut out, max.min(64))?;
        Ok(out)
    }

    /// Polls one of the QP's completion queues (`ibv_poll_cq`), appending up to `max`
    /// completions to `out`; returns how many were appended (0: the queue is empty, or
    /// `max` is 0). Nothing is allocated when `out` has room for them.
    pub fn poll_cq(
        &self,
        which: CqKind,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> Result<usize, CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let cq = self.cq_ptr("ibv_poll_cq", which)?;
        // SAFETY: the QP's live CQ; the ops lock excludes its destruction (only the
        // last owner destroys it).
        unsafe { crate::verbs::poll_cq_into(cq, out, max) }
    }

    /// Arms one of the QP's completion queues (`ibv_req_notify_cq(cq, 0)`): its next
    /// completion raises one completion event on its channel. Only the CQs of
    /// [`CmId::create_qp_on`] have a channel that reports it.
    pub fn arm_cq(&self, which: CqKind) -> Result<(), CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let cq = self.cq_ptr("ibv_req_notify_cq", which)?;
        // SAFETY: the QP's live CQ, as in poll_cq.
        let ret = unsafe { ffi::ibv_req_notify_cq(cq, 0) };
        verbs_result("ibv_req_notify_cq", ret)
    }

    /// The QP's send or receive CQ; callers hold the ops lock.
    fn cq_ptr(&self, op: &'static str, which: CqKind) -> Result<*mut ffi::ibv_cq, CmError> {
        let qp = self.qp_ptr(op)?;
        // SAFETY: live QP (qp_ptr); its CQ pointers are set at creation and never change.
        let cq = unsafe {
            match which {
                CqKind::Send => (*qp).send_cq,
                CqKind::Recv => (*qp).recv_cq,
            }
        };
        if cq.is_null() {
            return Err(CmError::InvalidArgument {
                op,
                reason: "the QP has no such completion queue",
            });
        }
        Ok(cq)
    }

    /// The live QP; callers hold the ops lock.
    pub(super) fn qp_ptr(&self, op: &'static str) -> Result<*mut ffi::ibv_qp, CmError> {
        // SAFETY: live id; `qp` is written only by create_qp under the ops lock, which
        // the caller holds.
        let qp = unsafe { (*self.inner.as_ptr()).qp };
        if qp.is_null() {
            Err(CmError::InvalidArgument {
                op,
                reason: "the id has no QP",
            })
        } else {
            Ok(qp)
        }
    }
}
