//! `rdma_set_option` on an id: the options of level `RDMA_OPTION_ID`; and the RNR NAK
//! timer of its QP, which no option sets.

use std::ffi::c_void;

use cm_core::{CmError, ConnectionParams, IdOption};

use super::{check, verbs_result, CmId};
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

    /// Sets the RNR NAK timer of the id's QP (`ibv_modify_qp` with only
    /// `IBV_QP_MIN_RNR_TIMER`: allowed for an RC QP in RTR and RTS, which keep their
    /// state). [`CmError::InvalidArgument`] for a timer above 31 or an id without a QP
    /// (nothing is called); the device's errno otherwise.
    pub fn set_min_rnr_timer(&self, timer: u8) -> Result<(), CmError> {
        const OP: &str = "ibv_modify_qp";
        if timer > ConnectionParams::MAX_MIN_RNR_TIMER {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "min_rnr_timer above 31",
            });
        }
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let qp = self.qp_ptr(OP)?;
        // SAFETY: ibv_qp_attr is integers and small structs; all zeroes is valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.min_rnr_timer = timer;
        // One low bit: it fits a C int.
        let mask = i32::try_from(ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0).unwrap_or(i32::MAX);
        // SAFETY: the id's live QP (destroyed only with the id, whose ops lock is held);
        // `attr` is valid for the call, which reads only the masked field.
        let ret = unsafe { ffi::ibv_modify_qp(qp, &mut attr, mask) };
        verbs_result(OP, ret)
    }
}
