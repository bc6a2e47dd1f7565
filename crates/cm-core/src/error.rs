//! The notify contract (what `rdma_notify` can answer) and the general CM error.

use core::fmt;

/// Linux errno values this crate names. They are the kernel ABI; `cm-core` does no FFI,
/// so it spells them out instead of depending on `libc`.
pub mod errno {
    /// Operation not permitted (some rdma-core versions report a missing device so).
    pub const EPERM: i32 = 1;
    /// No such file or directory: unknown id handle.
    pub const ENOENT: i32 = 2;
    /// Input/output error: what an I/O error that carries no errno is reported as.
    pub const EIO: i32 = 5;
    /// No such device or address: the id is being destroyed.
    pub const ENXIO: i32 = 6;
    /// Try again: a non-blocking read found nothing.
    pub const EAGAIN: i32 = 11;
    /// Out of memory.
    pub const ENOMEM: i32 = 12;
    /// Device or resource busy.
    pub const EBUSY: i32 = 16;
    /// Resource deadlock avoided: a wait that nothing could ever end.
    pub const EDEADLK: i32 = 35;
    /// No such device.
    pub const ENODEV: i32 = 19;
    /// Invalid argument: the id is not in a state that takes the event.
    pub const EINVAL: i32 = 22;
    /// No data available: librdmacm's answer to a short write of the command.
    pub const ENODATA: i32 = 61;
    /// Operation not supported.
    pub const EOPNOTSUPP: i32 = 95;
    /// Connection reset by peer (an iWARP peer's MPA reject).
    pub const ECONNRESET: i32 = 104;
    /// Transport endpoint is already connected: the RTU won the race.
    pub const EISCONN: i32 = 106;
    /// Connection timed out (the status of UNREACHABLE after REP retries).
    pub const ETIMEDOUT: i32 = 110;
    /// Connection refused (iWARP: a TCP reset, nobody listens).
    pub const ECONNREFUSED: i32 = 111;

    /// The symbolic name of an errno this module knows, for messages.
    pub const fn name(errno: i32) -> Option<&'static str> {
        Some(match errno {
            EPERM => "EPERM",
            ENOENT => "ENOENT",
            EIO => "EIO",
            ENXIO => "ENXIO",
            EAGAIN => "EAGAIN",
            ENOMEM => "ENOMEM",
            EBUSY => "EBUSY",
            EDEADLK => "EDEADLK",
            ENODEV => "ENODEV",
            EINVAL => "EINVAL",
            ENODATA => "ENODATA",
            EOPNOTSUPP => "EOPNOTSUPP",
            EISCONN => "EISCONN",
            ETIMEDOUT => "ETIMEDOUT",
            _ => return None,
        })
    }
}

/// An errno value that prints as its name and number ("EINVAL (22)").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Errno(pub i32);

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match errno::name(self.0) {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "errno {}", self.0),
        }
    }
}

/// A successful `rdma_notify(COMM_EST)`. Both outcomes mean the connection is (or will
/// be reported) established exactly once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NotifyOutcome {
    /// The call returned 0: the CM forced the connection to ESTABLISHED and will deliver
    /// `RDMA_CM_EVENT_ESTABLISHED`.
    Established,
    /// `EISCONN`: the CM was already established (the RTU won the race). Harmless; the
    /// ESTABLISHED event is (or was) delivered by the RTU path.
    AlreadyEstablished,
}

/// A failed `rdma_notify`, one variant per answer the kernel or librdmacm gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum NotifyError {
    /// `EINVAL`: the id is not connecting or accepting, its IB CM state does not take
    /// the event (e.g. UNREACHABLE already reported), the event is not one the CM
    /// handles, the id belongs to another channel, or it has no device yet.
    #[error("notify refused: the id is not in a state that takes this event (EINVAL)")]
    WrongState,
    /// `ENOENT`: the kernel does not know the id handle.
    #[error("notify refused: unknown id (ENOENT)")]
    UnknownId,
    /// `ENXIO`: the id is being destroyed.
    #[error("notify refused: the id is being destroyed (ENXIO)")]
    IdDestroyed,
    /// `ENODEV`: the device is going away.
    #[error("notify refused: no device (ENODEV)")]
    NoDevice,
    /// `ENODATA`: librdmacm wrote fewer bytes of the command than it should.
    #[error("notify failed: short write of the command (ENODATA)")]
    ShortWrite,
    /// Any other errno, kept as is.
    #[error("notify failed: {0}")]
    Os(Errno),
}

impl NotifyError {
    /// The errno this error stands for.
    pub const fn errno(&self) -> i32 {
        match self {
            NotifyError::WrongState => errno::EINVAL,
            NotifyError::UnknownId => errno::ENOENT,
            NotifyError::IdDestroyed => errno::ENXIO,
            NotifyError::NoDevice => errno::ENODEV,
            NotifyError::ShortWrite => errno::ENODATA,
            NotifyError::Os(Errno(e)) => *e,
        }
    }
}

/// Maps what `rdma_notify` returned to the contract: `0` (or a non-positive value, the
/// kernel's `-errno` convention is accepted too) is [`NotifyOutcome::Established`],
/// `EISCONN` is [`NotifyOutcome::AlreadyEstablished`], everything else an error.
///
/// `errno` is the positive errno when the call returned -1, or 0 on success.
#[inline]
pub const fn notify_result_from_errno(errno: i32) -> Result<NotifyOutcome, NotifyError> {
    let errno = errno.wrapping_abs();
    match errno {
        0 => Ok(NotifyOutcome::Established),
        errno::EISCONN => Ok(NotifyOutcome::AlreadyEstablished),
        errno::EINVAL => Err(NotifyError::WrongState),
        errno::ENOENT => Err(NotifyError::UnknownId),
        errno::ENXIO => Err(NotifyError::IdDestroyed),
        errno::ENODEV => Err(NotifyError::NoDevice),
        errno::ENODATA => Err(NotifyError::ShortWrite),
        other => Err(NotifyError::Os(Errno(other))),
    }
}

/// The error of every CM call other than notify. The errno is always kept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CmError {
    /// There is no RDMA device (or no RDMA CM in the kernel).
    #[error("no RDMA device: {op} failed with {errno}")]
    NoDevice {
        /// The call that found no device.
        op: &'static str,
        /// What it answered (ENODEV, or EPERM/ENOENT on some rdma-core versions).
        errno: Errno,
    },
    /// A call failed with an errno.
    #[error("{op} failed: {errno}")]
    Os {
        /// The call that failed, e.g. "rdma_accept".
        op: &'static str,
        /// Its errno.
        errno: Errno,
    },
    /// Destroying an id (or channel) whose events are not all acknowledged: librdmacm
    /// would block forever, so this is refused instead.
    #[error("{op} refused: {unacked} event(s) still unacknowledged (librdmacm would hang)")]
    UnackedEvents {
        /// The refused call.
        op: &'static str,
        /// How many events are still out.
        unacked: usize,
    },
    /// The object the call names no longer exists (destroyed id, closed channel).
    #[error("{op} refused: {what} is gone")]
    Gone {
        /// The refused call.
        op: &'static str,
        /// What is gone ("id", "channel", "event").
        what: &'static str,
    },
    /// The call needs the object to itself and something else holds or uses it (other
    /// handles of an id being migrated, a thread reading its channel).
    #[error("{op} refused: {reason}")]
    Busy {
        /// The refused call.
        op: &'static str,
        /// What is in the way.
        reason: &'static str,
    },
    /// A wait without a deadline on a source where nothing can ever happen: the
    /// simulated fabric with no message, event or timer pending (a real device never
    /// answers this; refused rather than hanging). Its errno is `EDEADLK`.
    #[error("{op} refused: nothing is pending, the wait would never end")]
    Idle {
        /// The refused call.
        op: &'static str,
    },
    /// The arguments are invalid before anything reaches the CM.
    #[error("{op} refused: {reason}")]
    InvalidArgument {
        /// The refused call.
        op: &'static str,
        /// Why.
        reason: &'static str,
    },
}

impl CmError {
    /// The error of a system call made through `std::io` (a socket, a readiness wait):
    /// its errno, or EIO when it carries none.
    pub fn from_io(op: &'static str, error: &std::io::Error) -> Self {
        CmError::from_errno(op, error.raw_os_error().unwrap_or(errno::EIO))
    }

    /// Builds the error for a call that failed with `errno`, telling "no device" apart.
    pub const fn from_errno(op: &'static str, errno: i32) -> Self {
        match errno {
            errno::ENODEV => CmError::NoDevice {
                op,
                errno: Errno(errno),
            },
            _ => CmError::Os {
                op,
                errno: Errno(errno),
            },
        }
    }

    /// The errno behind the error, when one is (refusals made before any call have none;
    /// they report `EINVAL`/`EBUSY` analogues so callers can still branch on a number).
    pub const fn errno(&self) -> i32 {
        match self {
            CmError::NoDevice { errno, .. } | CmError::Os { errno, .. } => errno.0,
            CmError::UnackedEvents { .. } | CmError::Busy { .. } => errno::EBUSY,
            CmError::Gone { .. } => errno::ENXIO,
            CmError::Idle { .. } => errno::EDEADLK,
            CmError::InvalidArgument { .. } => errno::EINVAL,
        }
    }

    /// Whether this is the typed "no RDMA device" error.
    pub const fn is_no_device(&self) -> bool {
        matches!(self, CmError::NoDevice { .. })
    }
}

/// For code written against `io::Result` (`RdmaTransport::new()?` in a function that
/// returns one). An error that a call answered with an errno becomes that OS error
/// ([`std::io::Error::raw_os_error`] is the errno, the kind follows from it; the name of
/// the call is not kept). A refusal made before any call keeps its message, with the
/// kind of its errno analogue ([`CmError::errno`]) and this error as the source.
impl From<CmError> for std::io::Error {
    fn from(error: CmError) -> Self {
        match error {
            CmError::NoDevice { errno, .. } | CmError::Os { errno, .. } => {
                std::io::Error::from_raw_os_error(errno.0)
            }
            _ => {
                let kind = std::io::Error::from_raw_os_error(error.errno()).kind();
                std::io::Error::new(kind, error)
            }
        }
    }
}
