//! Registering the backend's descriptors with tokio's reactor (feature `tokio`).
//!
//! tokio's `AsyncFd` constructors are `unsafe`: the caller promises that the descriptor
//! stays open and the same for the `AsyncFd`'s whole life. The types here own their
//! descriptors, so that promise is made once, here, for each of them.

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use cm_core::{errno, CmError, Errno};

use crate::{AsyncEvents, EventChannel};

fn registration_error(e: std::io::Error) -> CmError {
    CmError::Os {
        op: "tokio AsyncFd registration",
        errno: Errno(e.raw_os_error().unwrap_or(errno::EINVAL)),
    }
}

/// The event channel, switched to non-blocking mode and registered for readability with
/// the current tokio runtime (call it from within one).
pub fn async_event_channel(channel: EventChannel) -> Result<AsyncFd<EventChannel>, CmError> {
    channel.set_nonblocking(true)?;
    // SAFETY: the channel owns its rdma_event_channel, whose fd stays open, and is
    // returned unchanged by as_raw_fd, until the channel is dropped — which happens only
    // after the AsyncFd (its owner) is dropped or gives it back with into_inner.
    unsafe { AsyncFd::register_with_interest(channel, Interest::READABLE) }
        .map_err(|e| registration_error(e.into_parts().1))
}

/// The device's asynchronous events, switched to non-blocking mode and registered for
/// readability with the current tokio runtime (call it from within one).
pub fn async_device_events(events: AsyncEvents) -> Result<AsyncFd<AsyncEvents>, CmError> {
    events.set_nonblocking(true)?;
    // SAFETY: AsyncEvents keeps the device context, and so its async_fd, open
    // for as long as it lives; async_fd is set once when the context opens.
    unsafe { AsyncFd::register_with_interest(events, Interest::READABLE) }
        .map_err(|e| registration_error(e.into_parts().1))
}

/// A descriptor the caller owns (for example a duplicate of a completion channel's),
/// registered for readability with the current tokio runtime. Non-blocking mode is the
/// caller's business (it is shared with the original descriptor).
pub fn async_owned_fd(fd: std::os::fd::OwnedFd) -> Result<AsyncFd<std::os::fd::OwnedFd>, CmError> {
    // SAFETY: the AsyncFd owns the descriptor: it stays open and the same number until
    // the AsyncFd is dropped (or gives it back with into_inner).
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
        .map_err(|e| registration_error(e.into_parts().1))
}
