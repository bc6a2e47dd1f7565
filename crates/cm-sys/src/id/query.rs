//! `ibv_query_qp` on the id's QP: the attributes the CM set from the connection
//! parameters, to check what the kernel really applied; and the counters of the port
//! the id runs on.

use cm_core::{CmError, DeviceTransport};

use super::{verbs_result, CmId};
use crate::{ffi, PortCounters};

/// The state of a QP (`enum ibv_qp_state`), decoded totally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// `IBV_QPS_RESET`.
    Reset,
    /// `IBV_QPS_INIT`.
    Init,
    /// `IBV_QPS_RTR`: ready to receive.
    Rtr,
    /// `IBV_QPS_RTS`: ready to send (an established connection).
    Rts,
    /// `IBV_QPS_SQD`: send queue drained.
    Sqd,
    /// `IBV_QPS_SQE`: send queue error.
    Sqe,
    /// `IBV_QPS_ERR`.
    Err,
    /// A number this crate does not know (`IBV_QPS_UNKNOWN` included).
    Unknown(u32),
}

impl QpState {
    fn from_raw(raw: u32) -> Self {
        match raw {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            4 => QpState::Sqd,
            5 => QpState::Sqe,
            6 => QpState::Err,
            n => QpState::Unknown(n),
        }
    }
}

/// What [`CmId::query_qp`] reads of the id's QP (`struct ibv_qp_attr`, the fields the
/// connection parameters and the path set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpAttributes {
    /// The QP's state.
    pub state: QpState,
    /// RDMA READs/atomics outstanding at once as initiator (from the connection's
    /// initiator depth).
    pub max_rd_atomic: u8,
    /// RDMA READs/atomics served at once as responder (from the connection's responder
    /// resources).
    pub max_dest_rd_atomic: u8,
    /// Transport retries (0–7).
    pub retry_cnt: u8,
    /// Receiver-not-ready retries (0–7, 7 = forever).
    pub rnr_retry: u8,
    /// The path MTU in bytes (256 to 4096; `None` before RTR, or a number libibverbs
    /// does not define).
    pub path_mtu: Option<u32>,
    /// The RNR NAK timer this side's receive queue advertises (an IB encoding, 0–31).
    pub min_rnr_timer: u8,
    /// The local ACK timeout (4.096 µs × 2^timeout; 0: infinite).
    pub timeout: u8,
    /// The path's traffic class (on RoCE the IP header's, from the active side's type
    /// of service).
    pub traffic_class: u8,
    /// The path's service level.
    pub service_level: u8,
    /// The local GID table index the path uses.
    pub sgid_index: u8,
}

/// `enum ibv_mtu` (1: 256 bytes … 5: 4096) in bytes.
fn mtu_bytes(raw: u32) -> Option<u32> {
    (1..=5).contains(&raw).then(|| 128 << raw)
}

impl CmId {
    /// `ibv_query_qp` on the id's QP: its state, read depths, retry counts, path MTU,
    /// timers and path (traffic class, service level, GID index), as the device holds them (after ESTABLISHED: what the CM applied from
    /// both sides' connection parameters).
    ///
    /// [`CmError::InvalidArgument`] if the id has no QP yet; the device's errno if the
    /// query fails.
    pub fn query_qp(&self) -> Result<QpAttributes, CmError> {
        const OP: &str = "ibv_query_qp";
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        // SAFETY: live id, read under the ops lock and the channel's fields lock (shared):
        // nothing writes `id->qp` meanwhile.
        let qp = unsafe { (*self.inner.as_ptr()).qp };
        if qp.is_null() {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "the id has no QP yet",
            });
        }
        // SAFETY: both structs are integers (and, in `ibv_qp_attr`, the address vectors'
        // integers and arrays): all zeroes is a valid value.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC
            | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ffi::ibv_qp_attr_mask::IBV_QP_AV;
        // The mask is a few low bits: it fits a C int.
        let mask = i32::try_from(mask.0).unwrap_or(i32::MAX);
        // SAFETY: `qp` is the id's live QP (destroyed only with the id, which `self`
        // keeps); both out-structs are valid for writes during the call. The fields lock
        // keeps librdmacm's event reads from modifying the QP meanwhile.
        let ret = unsafe { ffi::ibv_query_qp(qp, &mut attr, mask, &mut init) };
        verbs_result(OP, ret)?;
        Ok(QpAttributes {
            state: QpState::from_raw(attr.qp_state),
            max_rd_atomic: attr.max_rd_atomic,
            max_dest_rd_atomic: attr.max_dest_rd_atomic,
            retry_cnt: attr.retry_cnt,
            rnr_retry: attr.rnr_retry,
            path_mtu: mtu_bytes(attr.path_mtu),
            min_rnr_timer: attr.min_rnr_timer,
            timeout: attr.timeout,
            traffic_class: attr.ah_attr.grh.traffic_class,
            service_level: attr.ah_attr.sl,
            sgid_index: attr.ah_attr.grh.sgid_index,
        })
    }

    /// The device and port the id is bound to (`id->verbs`, `id->port_num`); `None`
    /// before it is bound or resolved.
    pub fn device_port(&self) -> Option<(String, u8)> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let context = self.device_context_locked("device_port").ok()?;
        // SAFETY: live id, read under the ops lock and the fields lock (shared): an
        // event read does not rewrite `port_num` meanwhile.
        let port = unsafe { (*self.inner.as_ptr()).port_num };
        // SAFETY: the id holds its device context open while it is bound.
        let name = unsafe { crate::device::context_device_name(context.as_ptr()) }?;
        Some((name, port))
    }

    /// The transport of the device the id is bound to (`transport_type`: InfiniBand and
    /// RoCE, or iWARP); `None` before it is bound or resolved.
    pub fn transport(&self) -> Option<DeviceTransport> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let context = self.device_context_locked("transport").ok()?;
        // SAFETY: the id holds its device context open while it is bound; the context's
        // `device` is set at open and lives as long as the context.
        let raw = unsafe {
            let device = (*context.as_ptr()).device;
            if device.is_null() {
                return None;
            }
            (*device).transport_type
        };
        Some(DeviceTransport::from_raw(raw))
    }

    /// The counters of the port the id runs on ([`PortCounters::read`]): RNR NAKs and
    /// transport retries, which the verbs report per QP only once exhausted, counted by
    /// the device for the port, and the CM messages the port's IB CM sent, resent and
    /// received. [`CmError::InvalidArgument`] before the id is bound.
    pub fn port_counters(&self) -> Result<PortCounters, CmError> {
        let (device, port) = self.device_port().ok_or(CmError::InvalidArgument {
            op: "port_counters",
            reason: "the id is not bound to a device yet",
        })?;
        PortCounters::read(&device, port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_every_state_and_mtu() {
        assert_eq!(QpState::from_raw(3), QpState::Rts);
        assert_eq!(QpState::from_raw(7), QpState::Unknown(7));
        assert_eq!(mtu_bytes(1), Some(256));
        assert_eq!(mtu_bytes(5), Some(4096));
        assert_eq!(mtu_bytes(0), None);
        assert_eq!(mtu_bytes(6), None);
    }
}
