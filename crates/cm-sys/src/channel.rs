//! `EventChannel`: one `rdma_event_channel` (an open `/dev/infiniband/rdma_cm`).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use cm_core::{errno, CmError};

use crate::event::{CmEvent, Decoded};
use crate::ffi;
use crate::id::CmId;

/// The owned `rdma_event_channel`. Ids created on (or migrated to) a channel hold an
/// `Arc` of it: closing the fd while an id lives on it would make the kernel destroy the
/// id behind librdmacm's back and leave the id's later calls writing to a stale fd.
pub(crate) struct ChannelInner {
    raw: NonNull<ffi::rdma_event_channel>,
    /// Held shared while an event is read and bound to the owners of its ids, and
    /// exclusively by [`CmId::migrate`]: reading an event is the only way a new handle
    /// to an existing id can appear, and migration needs the id's only handle.
    reading: RwLock<()>,
}

// SAFETY: the channel is a heap struct holding an fd, written only by
// rdma_create_event_channel and freed only in Drop. Every operation on it is a
// read/write/poll/fcntl on the fd, which the kernel serializes; librdmacm keeps no other
// per-channel state.
unsafe impl Send for ChannelInner {}
// SAFETY: see Send: shared use is concurrent system calls on one fd.
unsafe impl Sync for ChannelInner {}

impl ChannelInner {
    pub(crate) fn as_ptr(&self) -> *mut ffi::rdma_event_channel {
        self.raw.as_ptr()
    }

    /// Shared: an event is being read on this channel.
    fn start_reading(&self) -> RwLockReadGuard<'_, ()> {
        self.reading.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Exclusive: no thread is reading an event on this channel until the guard goes;
    /// `None` if one is now (a blocking read may last, so this never waits).
    pub(crate) fn try_exclude_readers(&self) -> Option<RwLockWriteGuard<'_, ()>> {
        match self.reading.try_write() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: `raw` points to the live channel until Drop; `fd` is never written
        // after creation.
        unsafe { (*self.raw.as_ptr()).fd }
    }
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: the channel is live and this is its only owner (every id on it holds an
        // Arc, so none is left); it is not used after this.
        unsafe { ffi::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

/// An RDMA CM event channel: the file descriptor CM events arrive on, and the factory of
/// [`CmId`]s.
///
/// Blocking by default, as librdmacm creates it; [`EventChannel::set_nonblocking`]
/// switches `O_NONBLOCK`. Every read method works in either mode: [`next_event`] waits,
/// [`try_next_event`] never does, [`next_event_timeout`] waits at most the given time.
/// The descriptor ([`AsFd`]) can go into an event loop's `poll`.
///
/// Dropping the channel closes it once every id created on it is gone too.
///
/// [`next_event`]: EventChannel::next_event
/// [`try_next_event`]: EventChannel::try_next_event
/// [`next_event_timeout`]: EventChannel::next_event_timeout
pub struct EventChannel {
    inner: Arc<ChannelInner>,
}

impl std::fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventChannel")
            .field("fd", &self.inner.fd())
            .finish()
    }
}

impl EventChannel {
    /// `rdma_create_event_channel`.
    ///
    /// With no RDMA device (or no RDMA CM in the kernel) this is
    /// [`CmError::NoDevice`]: librdmacm answers ENODEV, and some rdma-core versions
    /// EPERM (kernel ABI check failed) or ENOENT (no `/dev/infiniband/rdma_cm`); all
    /// three mean "nothing to talk to" here.
    pub fn new() -> Result<Self, CmError> {
        // SAFETY: no arguments; returns an owned channel or NULL with errno set.
        let raw = unsafe { ffi::rdma_create_event_channel() };
        match NonNull::new(raw) {
            Some(raw) => Ok(EventChannel {
                inner: Arc::new(ChannelInner {
                    raw,
                    reading: RwLock::new(()),
                }),
            }),
            None => Err(channel_creation_error(ffi::last_errno())),
        }
    }

    pub(crate) fn inner(&self) -> &Arc<ChannelInner> {
        &self.inner
    }

    /// Sets (`true`) or clears `O_NONBLOCK` on the channel's descriptor.
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<(), CmError> {
        ffi::set_nonblocking(self.inner.fd(), nonblocking)
            .map_err(|e| CmError::from_errno("fcntl(F_SETFL)", e))
    }

    /// Whether `O_NONBLOCK` is set on the channel's descriptor.
    pub fn is_nonblocking(&self) -> Result<bool, CmError> {
        ffi::is_nonblocking(self.inner.fd()).map_err(|e| CmError::from_errno("fcntl(F_GETFL)", e))
    }

    /// `rdma_create_id(channel, …, RDMA_PS_TCP)`: a new reliable-connected id whose events
    /// arrive on this channel.
    pub fn create_id(&self) -> Result<CmId, CmError> {
        let mut raw = ptr::null_mut();
        // SAFETY: the channel is live; `raw` receives the new id; the context is set by
        // CmId::from_new_raw before any event for the id can be read.
        let ret = unsafe {
            ffi::rdma_create_id(
                self.inner.as_ptr(),
                &mut raw,
                ptr::null_mut(),
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        };
        if ret != 0 {
            return Err(CmError::from_errno("rdma_create_id", ffi::last_errno()));
        }
        let raw = NonNull::new(raw).ok_or(CmError::Os {
            op: "rdma_create_id",
            errno: cm_core::Errno(errno::ENOMEM),
        })?;
        // SAFETY: `raw` was just created on this channel and is owned by nobody else.
        Ok(unsafe { CmId::from_new_raw(raw, Arc::clone(&self.inner)) })
    }

    /// `rdma_get_cm_event`, waiting as long as it takes.
    pub fn next_event(&self) -> Result<CmEvent, CmError> {
        loop {
            if let Some(event) = self.next_event_timeout_inner(None)? {
                return Ok(event);
            }
        }
    }

    /// The next event if one is pending, without waiting: `Ok(None)` when the channel is
    /// empty.
    ///
    /// On a blocking channel this polls the descriptor first; if another thread reads
    /// the same channel concurrently, prefer non-blocking mode.
    pub fn try_next_event(&self) -> Result<Option<CmEvent>, CmError> {
        self.next_event_timeout_inner(Some(Duration::ZERO))
    }

    /// The next event, waiting at most `timeout`; `Ok(None)` if none came.
    pub fn next_event_timeout(&self, timeout: Duration) -> Result<Option<CmEvent>, CmError> {
        self.next_event_timeout_inner(Some(timeout))
    }

    fn next_event_timeout_inner(
        &self,
        timeout: Option<Duration>,
    ) -> Result<Option<CmEvent>, CmError> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
            let readable = ffi::wait_readable(self.inner.fd(), left)
                .map_err(|e| CmError::from_errno("poll", e))?;
            if !readable {
                return Ok(None);
            }
            match self.read_one()? {
                Some(Decoded::Event(event)) => return Ok(Some(event)),
                // The event was for an id being destroyed right now: it is acked; look
                // for the next one.
                Some(Decoded::Skipped) => continue,
                // Readable but nothing for us (another reader was faster).
                None if timeout == Some(Duration::ZERO) => return Ok(None),
                None => continue,
            }
        }
    }

    /// Reads one event once the fd polled readable. `None` when the read found nothing
    /// (non-blocking mode only; in blocking mode the read waits, which a prior poll keeps
    /// short).
    fn read_one(&self) -> Result<Option<Decoded>, CmError> {
        let _reading = self.inner.start_reading();
        let mut raw = ptr::null_mut();
        // SAFETY: the channel is live; `raw` receives an event owned by us until acked.
        let ret = unsafe { ffi::rdma_get_cm_event(self.inner.as_ptr(), &mut raw) };
        if ret != 0 {
            let errno = ffi::last_errno();
            if errno == libc::EAGAIN || errno == libc::EINTR {
                return Ok(None);
            }
            return Err(CmError::from_errno("rdma_get_cm_event", errno));
        }
        let raw = NonNull::new(raw).ok_or(CmError::Os {
            op: "rdma_get_cm_event",
            errno: cm_core::Errno(errno::ENODATA),
        })?;
        // SAFETY: `raw` is an event just returned by rdma_get_cm_event on this channel,
        // not acked, owned by nobody else.
        Ok(Some(unsafe { CmEvent::from_raw(raw, &self.inner) }))
    }
}

/// The error for a failed `rdma_create_event_channel`: ENODEV, EPERM and ENOENT all mean
/// there is no usable RDMA CM device.
pub(crate) fn channel_creation_error(errno: i32) -> CmError {
    match errno {
        errno::ENODEV | errno::EPERM | errno::ENOENT => CmError::NoDevice {
            op: "rdma_create_event_channel",
            errno: cm_core::Errno(errno),
        },
        other => CmError::from_errno("rdma_create_event_channel", other),
    }
}

impl AsRawFd for EventChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.fd()
    }
}

impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd stays open as long as `self.inner` lives, which outlives the
        // returned borrow of `self`.
        unsafe { BorrowedFd::borrow_raw(self.inner.fd()) }
    }
}

impl cm_core::CmEventSource for EventChannel {
    type Event = CmEvent;

    fn try_next_event(&mut self) -> Result<Option<CmEvent>, CmError> {
        EventChannel::try_next_event(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_device_errnos_map_to_the_typed_error() {
        for errno in [libc::ENODEV, libc::EPERM, libc::ENOENT] {
            let error = channel_creation_error(errno);
            assert!(error.is_no_device(), "{errno}: {error}");
            assert_eq!(error.errno(), errno);
        }
        let error = channel_creation_error(libc::ENOMEM);
        assert!(!error.is_no_device());
        assert_eq!(error.errno(), libc::ENOMEM);
    }
}
