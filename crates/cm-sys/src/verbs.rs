//! The minimal data path tests and benches need: registered memory, SEND/RECV, polling.

use std::ops::Range;
use std::ptr::NonNull;

use cm_core::{CmError, QpNum, WcOpcode, WcStatus};

use crate::ffi;

/// Queue sizes of [`crate::CmId::create_qp`] (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive.
    pub max_recv_sge: u32,
    /// Bytes a send may carry inline.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    /// 16 sends and 16 receives of one SGE each, no inline data.
    fn default() -> Self {
        QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        }
    }
}

/// A handle to memory registered with [`crate::CmId::register_memory`]; usable only
/// with the id that registered it (the id owns the memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryRegion {
    /// Address of the owning id's shared state, to refuse use with another id.
    pub(crate) owner: usize,
    pub(crate) index: usize,
    pub(crate) len: usize,
}

/// Where a peer's registered memory is, for RDMA READ and WRITE: its address, remote
/// key and length, as the peer sent them (typically in a message). Plain data: a wrong
/// one makes the work request fail (remote access error), nothing worse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteMemory {
    /// The remote virtual address of its first byte.
    pub addr: u64,
    /// The remote key the peer registered it with.
    pub rkey: u32,
    /// Its length in bytes.
    pub len: u64,
}

impl RemoteMemory {
    /// The 20 bytes that carry it in a message (address, key, length; little-endian).
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut out = [0; 20];
        out[..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        out[12..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Reads [`RemoteMemory::to_bytes`]'s form; `None` unless `bytes` is 20 long.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let bytes: &[u8; 20] = bytes.try_into().ok()?;
        let (addr, rest) = bytes.split_at(8);
        let (rkey, len) = rest.split_at(4);
        Some(RemoteMemory {
            addr: u64::from_le_bytes(addr.try_into().ok()?),
            rkey: u32::from_le_bytes(rkey.try_into().ok()?),
            len: u64::from_le_bytes(len.try_into().ok()?),
        })
    }

    /// The part `range` of it (offsets within it); `None` when `range` is not inside.
    pub fn slice(&self, range: Range<u64>) -> Option<Self> {
        (range.start <= range.end && range.end <= self.len).then_some(RemoteMemory {
            addr: self.addr + range.start,
            rkey: self.rkey,
            len: range.end - range.start,
        })
    }
}

impl MemoryRegion {
    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A heap buffer and its `ibv_mr`, owned by an id and deregistered after its QP.
pub(crate) struct RegisteredMemory {
    mr: NonNull<ffi::ibv_mr>,
    buffer: NonNull<u8>,
    len: usize,
}

impl RegisteredMemory {
    /// Allocates `len` zeroed bytes and registers them on `pd` for local write.
    ///
    /// # Safety
    /// `pd` is a live protection domain that outlives the returned value.
    pub(crate) unsafe fn register(
        pd: *mut rdma_sys::ibv_pd,
        len: usize,
        remote: bool,
    ) -> Result<Self, CmError> {
        let buffer = allocate_zeroed(len)?;
        // SAFETY: `pd` is live (caller); the buffer is a live allocation of `len.max(1)`
        // bytes that stays allocated until `deregister`.
        let registered = unsafe { Self::register_over(pd, buffer, len.max(1), remote) };
        registered
            .map(|memory| RegisteredMemory { len, ..memory })
            .inspect_err(|_| {
                // SAFETY: the buffer came from allocate_zeroed(len) and was not registered.
                unsafe { Self::reclaim(buffer, len) };
            })
    }

    /// Registers the `len` bytes at `buffer` on `pd`, for local write (and remote read
    /// and write with `remote`); the bytes stay the caller's.
    ///
    /// # Safety
    /// `pd` is a live protection domain and `buffer..buffer + len` live memory, both
    /// outliving the registration (until `deregister` or `deregister_only`).
    pub(crate) unsafe fn register_over(
        pd: *mut rdma_sys::ibv_pd,
        buffer: NonNull<u8>,
        len: usize,
        remote: bool,
    ) -> Result<Self, CmError> {
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if remote {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        let access = access as i32;
        // SAFETY: as the caller guarantees.
        let mr = unsafe { ffi::ibv_reg_mr(pd, buffer.as_ptr().cast(), len, access) };
        match NonNull::new(mr) {
            Some(mr) => Ok(RegisteredMemory { mr, buffer, len }),
            None => Err(CmError::from_errno("ibv_reg_mr", ffi::last_errno())),
        }
    }

    /// Deregisters memory registered with [`RegisteredMemory::register_over`], leaving
    /// the bytes to their owner; the errno when `ibv_dereg_mr` fails (the registration
    /// may then still be in place).
    ///
    /// # Safety
    /// No work request may use the memory any more.
    pub(crate) unsafe fn deregister_only(self) -> Result<(), CmError> {
        // SAFETY: the MR is live and no work request can reference it (caller).
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        crate::id::verbs_result("ibv_dereg_mr", ret)
    }

    /// Frees a buffer of [`allocate_zeroed`].
    ///
    /// # Safety
    /// `buffer` came from [`allocate_zeroed`]`(len)`, not freed.
    unsafe fn reclaim(buffer: NonNull<u8>, len: usize) {
        let layout = registered_layout(len).expect("the layout it was allocated with");
        // SAFETY: forwarded from the caller: allocated with this very layout.
        unsafe { std::alloc::dealloc(buffer.as_ptr(), layout) }
    }

    /// Deregisters and frees.
    ///
    /// If `ibv_dereg_mr` fails the registration may still be in place and the device
    /// may still access the memory: the buffer is then leaked, never freed, and the
    /// error returned.
    ///
    /// # Safety
    /// No QP can use the memory any more (its QP is destroyed).
    pub(crate) unsafe fn deregister(self) -> Result<(), CmError> {
        // SAFETY: the MR is live and no work request can reference it (caller).
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        // SAFETY: forwarded: allocated in `register` with this length.
        unsafe { self.release_after(ret) }
    }

    /// Frees the buffer if `dereg_ret` (what `ibv_dereg_mr` returned: 0 or an errno)
    /// says the registration is gone; otherwise leaks it and reports the errno.
    ///
    /// # Safety
    /// The buffer is this value's, allocated in `register`, not freed.
    unsafe fn release_after(self, dereg_ret: i32) -> Result<(), CmError> {
        if dereg_ret != 0 {
            // The MR may still map the buffer: it stays allocated for good.
            return Err(CmError::from_errno(
                "ibv_dereg_mr",
                if dereg_ret > 0 { dereg_ret } else { libc::EIO },
            ));
        }
        // SAFETY: allocated in `register` with this length; the device no longer
        // accesses it.
        unsafe { Self::reclaim(self.buffer, self.len) };
        Ok(())
    }

    /// The usable length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The scatter/gather entry for `range` (checked by the caller to be in bounds).
    /// An SGE carries at most `u32::MAX` bytes: a longer range is refused (truncating
    /// it would send or receive less than asked).
    pub(crate) fn sge(
        &self,
        op: &'static str,
        range: Range<usize>,
    ) -> Result<ffi::ibv_sge, CmError> {
        let length = u32::try_from(range.len()).map_err(|_| CmError::InvalidArgument {
            op,
            reason: "a scatter/gather entry carries at most 4 GiB - 1 bytes",
        })?;
        // SAFETY: the MR is live while `self` is; lkey is set at registration.
        let lkey = unsafe { (*self.mr.as_ptr()).lkey };
        Ok(ffi::ibv_sge {
            addr: self.buffer.as_ptr() as u64 + range.start as u64,
            length,
            lkey,
        })
    }

    /// What a peer needs to reach `range` of this memory with RDMA READ/WRITE.
    pub(crate) fn remote(&self, range: Range<usize>) -> RemoteMemory {
        // SAFETY: the MR is live while `self` is; rkey is set at registration.
        let rkey = unsafe { (*self.mr.as_ptr()).rkey };
        RemoteMemory {
            addr: self.buffer.as_ptr() as u64 + range.start as u64,
            rkey,
            len: range.len() as u64,
        }
    }

    /// Copies `data` in at `offset` (bounds checked by the caller).
    pub(crate) fn write(&self, offset: usize, data: &[u8]) {
        debug_assert!(offset + data.len() <= self.len);
        // SAFETY: in bounds of the live allocation; raw copies (no Rust reference to the
        // buffer exists), so the device writing concurrently is not a Rust aliasing
        // violation, only unspecified content.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.buffer.as_ptr().add(offset),
                data.len(),
            )
        };
    }

    /// Copies `range` out (bounds checked by the caller).
    pub(crate) fn read(&self, range: Range<usize>) -> Vec<u8> {
        debug_assert!(range.end <= self.len);
        let mut out = vec![0u8; range.len()];
        // SAFETY: in bounds of the live allocation; raw copy, as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.buffer.as_ptr().add(range.start),
                out.as_mut_ptr(),
                range.len(),
            )
        };
        out
    }
}

/// The layout of registered memory of `len` bytes: at least one (so that the pointer is
/// a real allocation), aligned to the page. Registration pins whole pages: an aligned
/// buffer shares none with other heap data, and a transfer crosses a page boundary only
/// where the buffer's own offsets do (soft-iWARP on Linux 6.1 placed only the bytes
/// before a page boundary of a 21-byte RDMA WRITE into a buffer that straddled one).
fn registered_layout(len: usize) -> Option<std::alloc::Layout> {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096);
    std::alloc::Layout::from_size_align(len.max(1), page).ok()
}

/// Allocates zeroed registered memory of `len` bytes ([`registered_layout`]); a length
/// no allocation can have is ENOMEM, not an abort.
fn allocate_zeroed(len: usize) -> Result<NonNull<u8>, CmError> {
    let no_memory = CmError::Os {
        op: "ibv_reg_mr",
        errno: cm_core::Errno(libc::ENOMEM),
    };
    let layout = registered_layout(len).ok_or(no_memory.clone())?;
    // SAFETY: the layout has a non-zero size.
    let buffer = unsafe { std::alloc::alloc_zeroed(layout) };
    NonNull::new(buffer).ok_or(no_memory)
}

/// One work completion (`struct ibv_wc`), copied out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Completion {
    /// The work request id given when posting.
    pub wr_id: u64,
    /// The QP the work request was on.
    pub qp_num: QpNum,
    /// What completed (`enum ibv_wc_opcode`, decoded; only meaningful on success).
    pub opcode: WcOpcode,
    /// How it completed (`enum ibv_wc_status`, decoded).
    pub status: WcStatus,
    /// Bytes received (receive completions).
    pub byte_len: u32,
}

impl Completion {
    /// Whether the work request succeeded.
    pub fn is_success(&self) -> bool {
        self.status.is_success()
    }

    /// Whether this completes a receive.
    pub fn is_recv(&self) -> bool {
        self.opcode.is_recv()
    }

    /// libibverbs' text for the status (`ibv_wc_status_str`).
    pub fn status_str(&self) -> &'static str {
        self.status.as_str()
    }
}

/// `ibv_wc` entries polled per `ibv_poll_cq` call (on the stack).
const POLL_CHUNK: usize = 16;

/// Polls up to `max` completions from `cq`, appending them to `out`; returns how many.
///
/// # Safety
/// `cq` is a live completion queue, not destroyed during the call.
pub(crate) unsafe fn poll_cq_into(
    cq: *mut ffi::ibv_cq,
    out: &mut Vec<Completion>,
    max: usize,
) -> Result<usize, CmError> {
    if cq.is_null() {
        return Err(CmError::InvalidArgument {
            op: "ibv_poll_cq",
            reason: "no completion queue",
        });
    }
    // SAFETY: ibv_wc is integers and a union of integers: all zeroes is valid.
    let mut wcs: [ffi::ibv_wc; POLL_CHUNK] = unsafe { std::mem::zeroed() };
    let mut total = 0;
    while total < max {
        let want = (max - total).min(POLL_CHUNK);
        // SAFETY: live CQ (caller); `wcs` has room for `want` <= POLL_CHUNK entries.
        let n = unsafe { ffi::ibv_poll_cq(cq, want as i32, wcs.as_mut_ptr()) };
        // ibv_poll_cq sets no errno: a negative return is the error itself.
        let n = usize::try_from(n).map_err(|_| poll_error(n))?;
        out.extend(wcs.iter().take(n.min(want)).map(Completion::from_wc));
        total += n.min(want);
        if n < want {
            break;
        }
    }
    Ok(total)
}

/// The error for a negative `ibv_poll_cq` return: `-errno` when the provider gives one,
/// EIO for a bare -1.
fn poll_error(ret: i32) -> CmError {
    let errno = match ret.checked_neg() {
        Some(errno) if errno > 1 => errno,
        _ => libc::EIO,
    };
    CmError::Os {
        op: "ibv_poll_cq",
        errno: cm_core::Errno(errno),
    }
}

impl Completion {
    fn from_wc(wc: &ffi::ibv_wc) -> Completion {
        Completion {
            wr_id: wc.wr_id,
            qp_num: QpNum(wc.qp_num),
            opcode: WcOpcode::from_raw(wc.opcode),
            status: WcStatus::from_raw(wc.status),
            byte_len: wc.byte_len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_no_allocation_can_have_are_enomem_not_an_abort() {
        for len in [usize::MAX, isize::MAX as usize + 1, usize::MAX / 2 + 7] {
            match allocate_zeroed(len) {
                Err(CmError::Os { errno, .. }) => assert_eq!(errno.0, libc::ENOMEM),
                other => panic!("{len}: {other:?}"),
            }
        }
        let buffer = allocate_zeroed(0).expect("one byte");
        assert_eq!(buffer.as_ptr() as usize % 4096, 0, "page-aligned");
        // SAFETY: allocate_zeroed(0) gives one zeroed byte; reclaimed as such below.
        assert_eq!(unsafe { *buffer.as_ptr() }, 0);
        // SAFETY: a fake registration wrapping the real buffer; the MR pointer is never
        // dereferenced by release_after.
        let memory = RegisteredMemory {
            mr: NonNull::dangling(),
            buffer,
            len: 0,
        };
        // SAFETY: the buffer is the value's, from allocate_zeroed(0).
        assert_eq!(unsafe { memory.release_after(0) }, Ok(()));
    }

    #[test]
    fn a_failed_deregistration_is_reported_and_keeps_the_buffer() {
        let buffer = allocate_zeroed(8).expect("8 bytes");
        // SAFETY: as above: the MR is never dereferenced.
        let memory = RegisteredMemory {
            mr: NonNull::dangling(),
            buffer,
            len: 8,
        };
        // SAFETY: the buffer is the value's. On failure it must stay allocated: reading
        // it afterwards is sound only because it is leaked, not freed.
        let result = unsafe { memory.release_after(libc::EBUSY) };
        assert_eq!(result.map_err(|e| e.errno()), Err(libc::EBUSY));
        // SAFETY: the buffer was leaked by the failed release, so it is still allocated.
        assert_eq!(unsafe { *buffer.as_ptr() }, 0);
        // SAFETY: still ours; freed here as register would have.
        unsafe { RegisteredMemory::reclaim(buffer, 8) };
        // A negative return has no errno to keep: EIO.
        let memory = RegisteredMemory {
            mr: NonNull::dangling(),
            buffer: allocate_zeroed(1).expect("1 byte"),
            len: 1,
        };
        // SAFETY: the buffer is the value's; leaked on failure (1 byte, in a test).
        let result = unsafe { memory.release_after(-1) };
        assert_eq!(result.map_err(|e| e.errno()), Err(libc::EIO));
    }

    #[test]
    fn a_range_longer_than_an_sge_carries_is_refused_not_truncated() {
        // A fake region: the length check comes before anything is dereferenced.
        let memory = RegisteredMemory {
            mr: NonNull::dangling(),
            buffer: NonNull::dangling(),
            len: usize::MAX,
        };
        let too_long = 0..u32::MAX as usize + 1;
        assert!(matches!(
            memory.sge("ibv_post_send", too_long),
            Err(CmError::InvalidArgument { .. })
        ));
        // RegisteredMemory has no Drop: the dangling buffer is never freed.
    }

    #[test]
    fn status_texts_are_libibverbs_own_for_every_number() {
        for raw in (0..64).chain([0x7fff_ffff, u32::MAX]) {
            assert_eq!(
                WcStatus::from_raw(raw).to_string(),
                ffi::wc_status_str(raw),
                "status {raw}"
            );
        }
    }

    #[test]
    fn completions_decode_the_opcodes_libibverbs_defines() {
        use rdma_sys::ibv_wc_opcode as op;
        for (raw, opcode) in [
            (op::IBV_WC_SEND, WcOpcode::Send),
            (op::IBV_WC_RDMA_WRITE, WcOpcode::RdmaWrite),
            (op::IBV_WC_RDMA_READ, WcOpcode::RdmaRead),
            (op::IBV_WC_COMP_SWAP, WcOpcode::CompSwap),
            (op::IBV_WC_FETCH_ADD, WcOpcode::FetchAdd),
            (op::IBV_WC_BIND_MW, WcOpcode::BindMw),
            (op::IBV_WC_LOCAL_INV, WcOpcode::LocalInv),
            (op::IBV_WC_TSO, WcOpcode::Tso),
            (op::IBV_WC_RECV, WcOpcode::Recv),
            (op::IBV_WC_RECV_RDMA_WITH_IMM, WcOpcode::RecvRdmaWithImm),
            (op::IBV_WC_TM_ADD, WcOpcode::TmAdd),
            (op::IBV_WC_TM_RECV, WcOpcode::TmRecv),
            (op::IBV_WC_DRIVER3, WcOpcode::Driver3),
        ] {
            // SAFETY: ibv_wc is integers and a union of integers: all zeroes is valid.
            let mut wc: ffi::ibv_wc = unsafe { std::mem::zeroed() };
            wc.opcode = raw;
            wc.status = 5;
            let completion = Completion::from_wc(&wc);
            assert_eq!(completion.opcode, opcode);
            assert_eq!(completion.status, WcStatus::WrFlushErr);
            assert!(!completion.is_success());
            assert_eq!(completion.is_recv(), raw & op::IBV_WC_RECV != 0);
        }
    }

    #[test]
    fn a_negative_poll_return_is_its_own_errno_and_a_bare_minus_one_is_eio() {
        assert_eq!(poll_error(-libc::EINVAL).errno(), libc::EINVAL);
        assert_eq!(poll_error(-1).errno(), libc::EIO);
        assert_eq!(poll_error(i32::MIN).errno(), libc::EIO);
    }
}
