//! The caller's own memory registered for an id's QP ([`BorrowedRegion`]): the buffer
//! stays the caller's, borrowed for as long as the registration lasts.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::ptr::NonNull;

use cm_core::CmError;

use super::CmId;
use crate::ffi;
use crate::verbs::{RegisteredMemory, RemoteMemory};

/// A buffer of the caller's registered with the device for one id's QP
/// ([`CmId::register_buffer`]), for as long as `'buf`: the buffer is borrowed mutably
/// while registered, so nothing else reads or writes it behind the device's back, and
/// it is the caller's again once the region is dropped (deregistered). The region
/// holds its id, and with it the protection domain the registration is on.
///
/// Its work requests go to its id's QP; their completions arrive on the id's queues as
/// any other. A region dropped while a work request still uses it makes that request
/// fail (the device no longer reaches the memory), never touch the buffer.
///
/// The buffer cannot be used while it is registered:
///
/// ```compile_fail
/// # fn demo(id: &cm_sys::CmId) -> Result<(), cm_core::CmError> {
/// let mut buffer = vec![0u8; 64];
/// let region = id.register_buffer(&mut buffer, false)?;
/// buffer[0] = 1; // the device may be writing it: refused at compile time
/// drop(region);
/// # Ok(()) }
/// ```
pub struct BorrowedRegion<'buf> {
    id: CmId,
    memory: ManuallyDrop<RegisteredMemory>,
    _buffer: PhantomData<&'buf mut [u8]>,
}

// SAFETY: the region's raw pointers (its MR, the caller's buffer) are reached by no other
// value: the buffer is borrowed mutably for 'buf, and `&mut [u8]` is Send. libibverbs
// may be called from any thread, and the CmId it holds is Send. Not Sync: `write`
// copies into the buffer through `&self`.
unsafe impl Send for BorrowedRegion<'_> {}

impl std::fmt::Debug for BorrowedRegion<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BorrowedRegion")
            .field("id", &self.id)
            .field("len", &self.memory.len())
            .finish()
    }
}

impl CmId {
    /// Registers `buffer` for this id's QP, for local write and, with `remote`, for the
    /// peer's RDMA READ and WRITE ([`BorrowedRegion::remote_memory`]); the buffer is
    /// borrowed until the region is dropped.
    ///
    /// [`CmError::InvalidArgument`] for an empty buffer or an id with no protection
    /// domain yet (make its QP first: the region is on the QP's PD); the errno of
    /// `ibv_reg_mr` otherwise.
    pub fn register_buffer<'buf>(
        &self,
        buffer: &'buf mut [u8],
        remote: bool,
    ) -> Result<BorrowedRegion<'buf>, CmError> {
        const OP: &str = "ibv_reg_mr";
        let start = NonNull::new(buffer.as_mut_ptr()).filter(|_| !buffer.is_empty());
        let start = start.ok_or(CmError::InvalidArgument {
            op: OP,
            reason: "an empty buffer",
        })?;
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        // SAFETY: live id, read under the ops lock.
        let pd = unsafe { (*self.inner.as_ptr()).pd };
        if pd.is_null() {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "the id has no protection domain yet: make its QP first",
            });
        }
        // SAFETY: the PD is the id's QP's, alive while the id is, which the region
        // holds; the buffer is borrowed mutably for the region's whole life.
        let memory = unsafe { RegisteredMemory::register_over(pd, start, buffer.len(), remote) }?;
        Ok(BorrowedRegion {
            id: self.clone(),
            memory: ManuallyDrop::new(memory),
            _buffer: PhantomData,
        })
    }
}

impl BorrowedRegion<'_> {
    /// The buffer's length in bytes.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Whether the buffer is empty (never: an empty one is refused).
    pub fn is_empty(&self) -> bool {
        self.memory.len() == 0
    }

    /// The id whose QP the region serves.
    pub fn id(&self) -> &CmId {
        &self.id
    }

    fn check(&self, op: &'static str, range: &Range<usize>) -> Result<(), CmError> {
        if range.start > range.end || range.end > self.memory.len() {
            return Err(CmError::InvalidArgument {
                op,
                reason: "range outside the memory region",
            });
        }
        Ok(())
    }

    /// Copies `range` of the buffer out (what a receive or an RDMA READ left there).
    pub fn read(&self, range: Range<usize>) -> Result<Vec<u8>, CmError> {
        self.check("read", &range)?;
        Ok(self.memory.read(range))
    }

    /// Copies `data` into the buffer at `offset` (what a SEND or RDMA WRITE will carry).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), CmError> {
        self.check("write", &(offset..offset.saturating_add(data.len())))?;
        self.memory.write(offset, data);
        Ok(())
    }

    /// What the peer needs to reach `range` of the buffer with RDMA READ/WRITE (a region
    /// registered with `remote`).
    pub fn remote_memory(&self, range: Range<usize>) -> Result<RemoteMemory, CmError> {
        self.check("remote_memory", &range)?;
        Ok(self.memory.remote(range))
    }

    /// `ibv_post_recv` on the id's QP of one receive into `range` of the buffer.
    pub fn post_recv(&self, range: Range<usize>, wr_id: u64) -> Result<(), CmError> {
        self.check("ibv_post_recv", &range)?;
        let ops = self.id.inner.lock_ops();
        let _fields = ops.fields();
        self.id.post_recv_locked(&self.memory, range, wr_id)
    }

    /// `ibv_post_send` on the id's QP of one signalled SEND of `range` of the buffer.
    pub fn post_send(&self, range: Range<usize>, wr_id: u64) -> Result<(), CmError> {
        let opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        self.post("ibv_post_send", opcode, range, None, wr_id)
    }

    /// One signalled RDMA READ of the peer's `remote` memory into `range` of the buffer
    /// (at most the remote length).
    pub fn post_rdma_read(
        &self,
        range: Range<usize>,
        remote: RemoteMemory,
        wr_id: u64,
    ) -> Result<(), CmError> {
        let opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_READ;
        self.post(
            "ibv_post_send (RDMA READ)",
            opcode,
            range,
            Some(remote),
            wr_id,
        )
    }

    /// One signalled RDMA WRITE of `range` of the buffer into the peer's `remote` memory
    /// (at most its length).
    pub fn post_rdma_write(
        &self,
        range: Range<usize>,
        remote: RemoteMemory,
        wr_id: u64,
    ) -> Result<(), CmError> {
        let opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        self.post(
            "ibv_post_send (RDMA WRITE)",
            opcode,
            range,
            Some(remote),
            wr_id,
        )
    }

    fn post(
        &self,
        op: &'static str,
        opcode: ffi::ibv_wr_opcode::Type,
        range: Range<usize>,
        remote: Option<RemoteMemory>,
        wr_id: u64,
    ) -> Result<(), CmError> {
        self.check(op, &range)?;
        let ops = self.id.inner.lock_ops();
        let _fields = ops.fields();
        self.id
            .post_send_locked(op, opcode, &self.memory, range, remote, wr_id)
    }
}

impl Drop for BorrowedRegion<'_> {
    fn drop(&mut self) {
        // SAFETY: taken once, here. Work requests still using it fail from now on
        // (the registration is gone), which is what dropping it while they run means.
        let memory = unsafe { ManuallyDrop::take(&mut self.memory) };
        // SAFETY: as above; the buffer is the caller's and is not freed here.
        if unsafe { memory.deregister_only() }.is_err() {
            // The device may still reach the buffer, which goes back to its owner as
            // this borrow ends: no safe way on, so none is taken.
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::BorrowedRegion;

    /// A region can move to the thread that posts and reads it; only one thread holds it.
    #[test]
    fn a_borrowed_region_moves_between_threads() {
        fn moves<T: Send>() {}
        moves::<BorrowedRegion<'static>>();
    }
}
