//! The kernel's answer to `rdma_notify`, as a pure function of the IB CM state.
//!
//! This is `ib_cm_notify` / `cm_establish` / `cm_migrate` of
//! drivers/infiniband/core/cm.c for an InfiniBand or RoCE device (soft-RoCE included).
//! The simulated fabric uses it; the real backend gets the same answers from the kernel.

use crate::{AsyncEventType, IbCmState, NotifyError, NotifyOutcome};

/// The state of the id's load-alternate-path (LAP) exchange, which decides PATH_MIG.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LapState {
    /// No alternate path was ever loaded (`IB_CM_LAP_UNINIT`).
    #[default]
    Uninit,
    /// No LAP exchange in progress (`IB_CM_LAP_IDLE`).
    Idle,
    /// A LAP exchange is in progress.
    Busy,
}

/// What `rdma_notify(id, event)` answers for an id whose IB CM id is in `state`.
///
/// - COMM_EST: 0 in REP_SENT and MRA_REP_RCVD (the connection is forced to ESTABLISHED),
///   EISCONN in ESTABLISHED, EINVAL in every other state.
/// - PATH_MIG: 0 in ESTABLISHED with the LAP state UNINIT or IDLE, else EINVAL; it never
///   produces a CM event. (Its success is reported as [`NotifyOutcome::Established`],
///   i.e. "accepted".)
/// - every other event number, known or not: EINVAL.
pub const fn ib_cm_notify(
    state: IbCmState,
    lap: LapState,
    event: AsyncEventType,
) -> Result<NotifyOutcome, NotifyError> {
    match event {
        AsyncEventType::CommEst => match state {
            IbCmState::RepSent | IbCmState::MraRepRcvd => Ok(NotifyOutcome::Established),
            IbCmState::Established => Ok(NotifyOutcome::AlreadyEstablished),
            _ => Err(NotifyError::WrongState),
        },
        AsyncEventType::PathMig => match (state, lap) {
            (IbCmState::Established, LapState::Uninit | LapState::Idle) => {
                Ok(NotifyOutcome::Established)
            }
            _ => Err(NotifyError::WrongState),
        },
        _ => Err(NotifyError::WrongState),
    }
}

/// Whether a successful `ib_cm_notify` in `state` for `event` queues the deferred work
/// item that delivers `RDMA_CM_EVENT_ESTABLISHED` (only a forced establish does).
pub const fn notify_delivers_established(state: IbCmState, event: AsyncEventType) -> bool {
    matches!(event, AsyncEventType::CommEst)
        && matches!(state, IbCmState::RepSent | IbCmState::MraRepRcvd)
}
