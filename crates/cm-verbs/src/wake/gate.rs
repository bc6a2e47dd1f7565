//! The handshake between calls that want the handles' lock and the thread driver that
//! holds it while it waits in the transport.
//!
//! A call counts itself in `wanting`, then looks at `blocked`; the driver sets
//! `blocked`, then looks at `wanting`. At least one of them sees the other, so either
//! the driver does not wait (it saw the call) or the call wakes the wait (it saw the
//! driver blocked); never both miss. Every access is a read-modify-write (a look is an
//! RMW that changes nothing): an RMW reads the latest value of its atomic, and if the
//! look at `blocked` comes before the driver's set, that set reads from (and acquires)
//! the look, after which the driver's look at `wanting` sees the call. The classic
//! form, plain `SeqCst` stores and loads, is as correct, but loom cannot check `SeqCst`
//! loads; this one it checks.

use super::sync::{AtomicBool, AtomicUsize, Ordering};

/// Who wants the lock, and whether its holder is blocked in the transport's wait.
#[derive(Debug)]
pub(crate) struct LockGate {
    /// Calls waiting for the lock: the driver lets them in before anything else.
    wanting: AtomicUsize,
    /// The driver is in the transport's wait, holding the lock.
    blocked: AtomicBool,
}

impl LockGate {
    /// A gate with nobody waiting.
    pub(crate) fn new() -> Self {
        LockGate {
            wanting: AtomicUsize::new(0),
            blocked: AtomicBool::new(false),
        }
    }

    /// A call is about to take the lock: whether the driver may be blocked in its wait
    /// holding it (then the call wakes that wait before it locks).
    pub(crate) fn want(&self) -> bool {
        self.wanting.fetch_add(1, Ordering::AcqRel);
        self.blocked.fetch_or(false, Ordering::AcqRel)
    }

    /// The call that wanted the lock has it.
    pub(crate) fn got(&self) {
        self.wanting.fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether a call waits for the lock.
    pub(crate) fn wanted(&self) -> bool {
        self.wanting.fetch_add(0, Ordering::AcqRel) > 0
    }

    /// The driver, holding the lock, is about to wait in the transport: whether it may
    /// (no call wants the lock; one that comes from now on sees it blocked and wakes the
    /// wait). [`LockGate::end_blocking`] follows either way.
    pub(crate) fn begin_blocking(&self) -> bool {
        self.blocked.swap(true, Ordering::AcqRel);
        !self.wanted()
    }

    /// The driver's wait is over.
    pub(crate) fn end_blocking(&self) {
        self.blocked.swap(false, Ordering::AcqRel);
    }
}
