//! `rdma_set_option` on an id: the options of level `RDMA_OPTION_ID`.

use std::ffi::c_void;

use cm_core::{CmError, IdOption};

use super::{check, CmId};
use crate::ffi;

impl CmId {
    /// `rdma_set_option(id, RDMA_OPTION_ID, ..)`: the value as the kernel reads it (a
    /// `u8` for the type of service and the ACK timeout, an `int` for the flags).
    ///
    /// [`CmError::InvalidArgument`] for an ACK timeout above 31 (nothing is called);
    /// the kernel's errno otherwise: EINVAL for an address option once the id is bound,
    /// or an ACK timeout on an id whose QP type is not RC.
    pub fn set_option(&self, option: IdOption) -> Result<(), CmError> {
        option.validate()?;
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let mut byte: u8 = 0;
        let mut flag: libc::c_int = 0;
        let (value, len): (*mut c_void, usize) = match option {
            IdOption::TypeOfService(v) | IdOption::AckTimeout(v) => {
                byte = v;
                ((&mut byte as *mut u8).cast(), std::mem::size_of::<u8>())
            }
            IdOption::ReuseAddr(on) | IdOption::Ipv6Only(on) => {
                flag = libc::c_int::from(on);
                (
                    (&mut flag as *mut libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>(),
                )
            }
        };
        // SAFETY: live id; `value` points at `len` readable bytes on this stack frame,
        // which outlives the call (the kernel copies them).
        let ret = unsafe {
            ffi::rdma_set_option(
                self.inner.as_ptr(),
                IdOption::LEVEL_ID,
                option.name(),
                value,
                len,
            )
        };
        // Both are read through `value`'s pointer above.
        let _ = (byte, flag);
        check("rdma_set_option", ret)
    }
}
