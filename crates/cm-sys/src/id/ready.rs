//! Handing a QP made ahead of its request ([`crate::ready_qps`]) to an id.

use std::sync::atomic::Ordering;

use cm_core::{CmError, QpNum};

use super::{check, verbs_result, CmId};
use crate::ffi;
use crate::ready_qps::ReadyQp;

impl CmId {
    /// Gives `ready` to the id as librdmacm's `rdma_create_qp` gives the QP it makes:
    /// moved to INIT with the id's attributes (`rdma_init_qp_attr`: port, P_Key index,
    /// access flags), then named `id->qp` (and its PD `id->pd`), so that accept, notify,
    /// disconnect and `rdma_destroy_qp` treat it as their own. On an error the QP is
    /// destroyed and the id left without one. The caller holds the ops lock.
    ///
    /// # Safety
    /// `ready` is on queues of the id's device that outlive the QP (the caller has the
    /// id hold them).
    pub(super) unsafe fn adopt_locked(&self, ready: ReadyQp) -> Result<QpNum, CmError> {
        let id = self.inner.as_ptr();
        // SAFETY: ibv_qp_attr is integers and small structs; all zeroes is valid.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        let mut mask = 0;
        // SAFETY: live id bound to a device (the caller checked); `attr` and `mask` are
        // valid for the call.
        check("rdma_init_qp_attr", unsafe {
            ffi::rdma_init_qp_attr(id, &mut attr, &mut mask)
        })?;
        // SAFETY: a live QP nobody else uses; `attr` valid for the call.
        let ret = unsafe { ffi::ibv_modify_qp(ready.as_ptr(), &mut attr, mask) };
        verbs_result("ibv_modify_qp", ret)?;
        let qp = ready.into_raw();
        // SAFETY: live id, its fields written under the ops lock as rdma_create_qp writes
        // them; from here `rdma_destroy_qp` (the id's drop) destroys the QP.
        let qp_num = unsafe {
            (*id).pd = (*qp.as_ptr()).pd;
            (*id).qp = qp.as_ptr();
            (*qp.as_ptr()).qp_num
        };
        self.inner.qp_num.store(qp_num, Ordering::Release);
        Ok(QpNum(qp_num))
    }
}
