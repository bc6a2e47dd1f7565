//! A hand-rolled id that answers like the kernel, for tests and benches that need an id
//! costing nothing itself.

use std::cell::Cell;

use cm_core::{AsyncEventType, CmId, NotifyError, NotifyOutcome, QpNum};

/// An id answering `notify(COMM_EST)` like the kernel on an accepted connection whose RTU
/// is lost: 0 (forced establish) the first time, EISCONN afterwards. Costs nothing
/// itself, so a measurement through it shows what the caller (e.g. the pump) adds, and
/// it never allocates.
///
/// ```
/// use cm_core::{AsyncEventType, CmId, NotifyOutcome, QpNum};
/// use cm_mock::KernelLikeId;
///
/// let id = KernelLikeId::new(QpNum(7));
/// assert_eq!(id.notify(AsyncEventType::CommEst), Ok(NotifyOutcome::Established));
/// assert_eq!(id.notify(AsyncEventType::CommEst), Ok(NotifyOutcome::AlreadyEstablished));
/// ```
#[derive(Debug)]
pub struct KernelLikeId {
    qp: QpNum,
    established: Cell<bool>,
}

impl KernelLikeId {
    /// A connection on `qp`, not yet established.
    pub fn new(qp: QpNum) -> Self {
        KernelLikeId {
            qp,
            established: Cell::new(false),
        }
    }
}

impl CmId for KernelLikeId {
    fn notify(&self, _event: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
        if self.established.replace(true) {
            Ok(NotifyOutcome::AlreadyEstablished)
        } else {
            Ok(NotifyOutcome::Established)
        }
    }

    fn qp_num(&self) -> Option<QpNum> {
        Some(self.qp)
    }
}
