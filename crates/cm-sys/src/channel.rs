//! `EventChannel`: one `rdma_event_channel` (an open `/dev/infiniband/rdma_cm`).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use cm_core::{errno, CmError};

use crate::event::{CmEvent, Decoded};
use crate::ffi;
use crate::id::CmId;
use crate::poll::{wait_then_read, Attempt};

/// The owned `rdma_event_channel`. Ids created on (or migrated to) a channel hold an
/// `Arc` of it: closing the fd while an id lives on it would make the kernel destroy the
/// id behind librdmacm's back and leave the id's later calls writing to a stale fd.
pub(crate) struct ChannelInner {
    raw: NonNull<ffi::rdma_event_channel>,
    /// The lock over the user-space fields of every id on this channel.
    ///
    /// `rdma_get_cm_event` writes fields of the id an event is about (on ADDR_RESOLVED
    /// and ROUTE_RESOLVED it queries the kernel into `route`, `verbs`, `pd`, `port_num`;
    /// on CONNECT_RESPONSE/REJECTED it works on `qp`), so reading an event and decoding
    /// it hold this lock exclusively, while every id call that passes the id to
    /// librdmacm or reads its fields holds it shared (with the id's `ops` lock). It is
    /// also what [`CmId::migrate`] holds exclusively: reading an event is the only way a
    /// new handle to an existing id can appear, and migration needs the id's only
    /// handle. `notify` takes no lock: it reads only `id->channel` (see `IdInner`).
    fields: RwLock<()>,
    /// Whether `O_NONBLOCK` is set on the descriptor, as this crate set it (the
    /// descriptor is the channel's own): saves an `fcntl` per read.
    nonblocking: AtomicBool,
}

// SAFETY: the channel is a heap struct holding an fd, written only by
// rdma_create_event_channel and freed only in Drop. Every operation on it is a
// read/write/poll/fcntl on the fd, which the kernel serializes; what reading an event
// writes into ids is guarded by `fields`.
unsafe impl Send for ChannelInner {}
// SAFETY: see Send: shared use is concurrent system calls on one fd.
unsafe impl Sync for ChannelInner {}

impl ChannelInner {
    pub(crate) fn as_ptr(&self) -> *mut ffi::rdma_event_channel {
        self.raw.as_ptr()
    }

    /// Shared: the fields of the channel's ids are not being written by an event read.
    pub(crate) fn fields_shared(&self) -> RwLockReadGuard<'_, ()> {
        self.fields.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Exclusive: no event is read and no id call runs on this channel until the guard
    /// goes. Never held across a wait: a read takes it only once the descriptor polled
    /// readable.
    pub(crate) fn fields_exclusive(&self) -> RwLockWriteGuard<'_, ()> {
        self.fields.write().unwrap_or_else(PoisonError::into_inner)
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
                    fields: RwLock::new(()),
                    // librdmacm opens the channel blocking.
                    nonblocking: AtomicBool::new(false),
                }),
            }),
            None => Err(channel_creation_error(ffi::last_errno())),
        }
    }

    pub(crate) fn inner(&self) -> &Arc<ChannelInner> {
        &self.inner
    }

    /// Sets (`true`) or clears `O_NONBLOCK` on the channel's descriptor.
    ///
    /// The mode is remembered (no `fcntl` per read): change it only through this method,
    /// not with `fcntl` on the raw descriptor.
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<(), CmError> {
        // Under the lock, so that no read runs with a mode other than the one recorded.
        let _fields = self.inner.fields_exclusive();
        ffi::set_nonblocking(self.inner.fd(), nonblocking)
            .map_err(|e| CmError::from_errno("fcntl(F_SETFL)", e))?;
        self.inner.nonblocking.store(nonblocking, Ordering::Release);
        Ok(())
    }

    /// Whether `O_NONBLOCK` is set on the channel's descriptor (as last set by
    /// [`EventChannel::set_nonblocking`]).
    pub fn is_nonblocking(&self) -> Result<bool, CmError> {
        Ok(self.inner.nonblocking.load(Ordering::Acquire))
    }

    /// `rdma_create_id(channel, …, RDMA_PS_TCP)`: a new reliable-connected id whose events
    /// arrive on this channel.
    pub fn create_id(&self) -> Result<CmId, CmError> {
        self.create_id_in(cm_core::PortSpace::Tcp)
    }

    /// `rdma_create_id(channel, …, space)`: a new id in `space` whose events arrive on
    /// this channel (its QP reliable-connected, as every QP this crate makes).
    pub fn create_id_in(&self, space: cm_core::PortSpace) -> Result<CmId, CmError> {
        let ps = match space {
            cm_core::PortSpace::Tcp => ffi::rdma_port_space::RDMA_PS_TCP,
            cm_core::PortSpace::Ib => ffi::rdma_port_space::RDMA_PS_IB,
        };
        let mut raw = ptr::null_mut();
        // SAFETY: the channel is live; `raw` receives the new id; the context is set by
        // CmId::from_new_raw before any event for the id can be read.
        let ret =
            unsafe { ffi::rdma_create_id(self.inner.as_ptr(), &mut raw, ptr::null_mut(), ps) };
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
    /// empty. Every other answer is returned as is, ENOMEM included (librdmacm could not
    /// allocate its copy; the event is still pending, and a later read takes it).
    pub fn try_next_event(&self) -> Result<Option<CmEvent>, CmError> {
        if self.inner.nonblocking.load(Ordering::Acquire) {
            // Straight to the read: EAGAIN is the answer when empty, and a poll first
            // would cost an event loop a second syscall per read.
            loop {
                match self.read_one()? {
                    Attempt::Got(event) => return Ok(Some(event)),
                    Attempt::Nothing => return Ok(None),
                    Attempt::Skipped => {}
                }
            }
        }
        self.next_event_timeout_inner(Some(Duration::ZERO))
    }

    /// The next event, waiting at most `timeout` (`Duration::MAX`: as long as it takes);
    /// `Ok(None)` if none came.
    pub fn next_event_timeout(&self, timeout: Duration) -> Result<Option<CmEvent>, CmError> {
        self.next_event_timeout_inner(Some(timeout))
    }

    fn next_event_timeout_inner(
        &self,
        timeout: Option<Duration>,
    ) -> Result<Option<CmEvent>, CmError> {
        wait_then_read(self.inner.fd(), timeout, "poll", || self.read_one())
    }

    /// Reads one event once the fd polled readable, holding the channel's `fields` lock
    /// across `rdma_get_cm_event` and the decoding.
    ///
    /// Under the lock no other reader can take the pending event, so on a blocking
    /// descriptor a readable one does not wait: the descriptor is polled again under the
    /// lock first. (librdmacm itself can, rarely, consume an event and read the next one
    /// within one call, for a connection request it fails to set up or a DISCONNECTED
    /// after a failed connect: on a blocking channel that waits with the lock held, and
    /// the channel's ids' calls wait with it. A non-blocking channel never waits.)
    fn read_one(&self) -> Result<Attempt<CmEvent>, CmError> {
        let decoded = {
            let _fields = self.inner.fields_exclusive();
            if !self.inner.nonblocking.load(Ordering::Acquire)
                && !crate::poll::wait_readable(self.inner.fd(), Some(Duration::ZERO))
                    .map_err(|e| CmError::from_errno("poll", e))?
            {
                // Another reader took the event between our poll and the lock.
                return Ok(Attempt::Nothing);
            }
            let mut raw = ptr::null_mut();
            // SAFETY: the channel is live; `raw` receives an event owned by us until
            // acked. The fields lock is held exclusively: what librdmacm writes into the
            // event's id races no other id call.
            let ret = unsafe { ffi::rdma_get_cm_event(self.inner.as_ptr(), &mut raw) };
            if ret != 0 {
                let errno = ffi::last_errno();
                if errno == libc::EAGAIN || errno == libc::EINTR {
                    return Ok(Attempt::Nothing);
                }
                return Err(CmError::from_errno("rdma_get_cm_event", errno));
            }
            let raw = NonNull::new(raw).ok_or(CmError::Os {
                op: "rdma_get_cm_event",
                errno: cm_core::Errno(errno::ENODATA),
            })?;
            // SAFETY: `raw` is an event just returned by rdma_get_cm_event on this
            // channel, not acked, owned by nobody else.
            unsafe { CmEvent::from_raw(raw, &self.inner) }
        };
        Ok(match decoded {
            Decoded::Event(event) => Attempt::Got(event),
            Decoded::Skipped(event) => {
                // Acknowledged (and a new id it carries destroyed) after the lock is
                // released: destroying an id takes the lock shared.
                drop(event);
                Attempt::Skipped
            }
        })
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
