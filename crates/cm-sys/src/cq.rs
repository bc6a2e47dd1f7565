//! Completion channels (`ibv_comp_channel`) and the completion queues an id creates on
//! them ([`crate::CmId::create_qp_on`]), for event loops that wait on completion events
//! with poll(2) instead of polling completion queues on a timer.
//!
//! Accounting of completion events: libibverbs' `ibv_destroy_cq` waits until every
//! event read from the CQ is acknowledged, so a read that is not counted would make the
//! destroy wait forever. Every read (`ibv_get_cq_event`) and its count happen under the
//! channel's lock, and a CQ is destroyed under the same lock after its remaining events
//! are acknowledged: a concurrent destroy sees either the count with the event in it or
//! a CQ whose queued events the kernel discards with it. The channel never blocks
//! (`O_NONBLOCK`), so the lock is never held across a wait.

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cm_core::{CmError, Errno};

use crate::device::DeviceRef;
use crate::ffi;
use crate::id::CmId;

/// How many completion events of one CQ are acknowledged at once
/// (`ibv_ack_cq_events` takes a mutex: once per event would be wasteful).
pub(crate) const ACK_BATCH: u32 = 16;

/// The identity of an open device context (`struct ibv_context *`): equal for every id,
/// [`CompletionChannel`] and [`crate::AsyncEvents`] of the same device, so that an event
/// loop can keep one completion channel and one asynchronous event source per device.
///
/// Only meaningful while something of the device is alive: the value is the context's
/// address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceKey(usize);

impl DeviceKey {
    pub(crate) fn of(context: NonNull<ffi::ibv_context>) -> Self {
        DeviceKey(context.as_ptr() as usize)
    }
}

/// Which of a QP's two completion queues ([`crate::CmId::arm_cq`],
/// [`crate::CmId::poll_cq`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CqKind {
    /// The send queue's completions.
    Send,
    /// The receive queue's completions.
    Recv,
}

/// The owned `ibv_comp_channel`, shared by the [`CompletionChannel`] handle and by every
/// CQ created on it (libibverbs refuses to destroy a channel that still has CQs).
pub(crate) struct ChannelCore {
    raw: NonNull<ffi::ibv_comp_channel>,
    context: NonNull<ffi::ibv_context>,
    /// Keeps the device context open until the channel (and so every CQ on it) is gone.
    _device: Arc<DeviceRef>,
    /// Held across each `ibv_get_cq_event` and the count that follows it, and across the
    /// final acknowledgement and destroy of each CQ on the channel.
    events: Mutex<()>,
    /// The completion vector of every CQ on the channel (its interrupt, so its core).
    vector: i32,
}

/// The next channel's completion vector, before the device's count is applied: each
/// channel takes the next, so endpoints (one channel each per device, one per core)
/// spread their CQs' interrupts over the device's vectors.
static NEXT_VECTOR: AtomicU32 = AtomicU32::new(0);

// SAFETY: the channel is a heap struct holding an fd and its context, written only at
// creation and freed only in Drop; reads of completion events go through `events`, and
// the other calls (poll, fcntl) are system calls on the fd.
unsafe impl Send for ChannelCore {}
// SAFETY: see Send.
unsafe impl Sync for ChannelCore {}

impl ChannelCore {
    fn lock(&self) -> MutexGuard<'_, ()> {
        self.events.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn fd(&self) -> RawFd {
        // SAFETY: live channel until Drop; `fd` is never written after creation.
        unsafe { (*self.raw.as_ptr()).fd }
    }

    pub(crate) fn device_key(&self) -> DeviceKey {
        DeviceKey::of(self.context)
    }
}

impl Drop for ChannelCore {
    fn drop(&mut self) {
        // SAFETY: the last owner: every CQ created on the channel held an Arc of it and
        // is destroyed, so libibverbs has no reason to refuse (EBUSY); nothing uses the
        // channel after this.
        let _ = unsafe { ffi::ibv_destroy_comp_channel(self.raw.as_ptr()) };
    }
}

/// What a CQ's `cq_context` points to: the token to report and the events read from
/// the CQ but not yet acknowledged.
pub(crate) struct CqEvents {
    token: u64,
    /// Changed only under the channel's `events` lock.
    unacked: AtomicU32,
}

/// A completion queue created on a [`CompletionChannel`], owned by the id whose QP uses
/// it; destroyed (after acknowledging its remaining events) when dropped, which the id
/// does after destroying its QP.
pub(crate) struct OwnedCq {
    cq: NonNull<ffi::ibv_cq>,
    /// Pointed to by the CQ's `cq_context`; freed only once the CQ is destroyed.
    events: ManuallyDrop<Box<CqEvents>>,
    /// Freed only once the CQ is destroyed (the channel cannot go before its CQs).
    channel: ManuallyDrop<Arc<ChannelCore>>,
}

// SAFETY: the CQ is only polled, armed and destroyed; libibverbs' CQ calls are thread
// safe, and the event count is changed only under the channel's lock.
unsafe impl Send for OwnedCq {}
// SAFETY: see Send.
unsafe impl Sync for OwnedCq {}

impl OwnedCq {
    /// `ibv_create_cq` of `cqe` entries on `channel`, reporting `token`.
    ///
    /// # Safety
    /// `context` is the live device context of `channel`, open as long as the CQ lives.
    pub(crate) unsafe fn create(
        context: NonNull<ffi::ibv_context>,
        channel: &Arc<ChannelCore>,
        cqe: i32,
        token: u64,
    ) -> Result<OwnedCq, CmError> {
        let events = Box::new(CqEvents {
            token,
            unacked: AtomicU32::new(0),
        });
        let cq_context = ptr::from_ref::<CqEvents>(&events)
            .cast_mut()
            .cast::<c_void>();
        // SAFETY: live context and channel of the same device (caller); the context
        // pointer stays valid as long as the CQ (freed after it is destroyed).
        let cq = unsafe {
            ffi::ibv_create_cq(
                context.as_ptr(),
                cqe,
                cq_context,
                channel.raw.as_ptr(),
                channel.vector,
            )
        };
        match NonNull::new(cq) {
            Some(cq) => Ok(OwnedCq {
                cq,
                events: ManuallyDrop::new(events),
                channel: ManuallyDrop::new(Arc::clone(channel)),
            }),
            None => Err(CmError::from_errno("ibv_create_cq", ffi::last_errno())),
        }
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_cq {
        self.cq.as_ptr()
    }
}

impl Drop for OwnedCq {
    fn drop(&mut self) {
        let destroyed = {
            let _events = self.channel.lock();
            let unacked = self.events.unacked.swap(0, Ordering::AcqRel);
            // SAFETY: the CQ is live; under the channel's lock no event of it is being
            // read, so `unacked` is exactly what was read and not acknowledged.
            unsafe {
                if unacked > 0 {
                    ffi::ibv_ack_cq_events(self.cq.as_ptr(), unacked);
                }
                // Its QP is destroyed first by the id. Under the lock: an event not yet
                // read is discarded with the CQ by the kernel, never read after.
                ffi::ibv_destroy_cq(self.cq.as_ptr()) == 0
            }
        };
        if destroyed {
            // SAFETY: the CQ is gone: nothing refers to its context or needs the channel
            // through it any more; each field is dropped once, here.
            unsafe {
                ManuallyDrop::drop(&mut self.events);
                ManuallyDrop::drop(&mut self.channel);
            }
        }
        // Otherwise the CQ still exists and may still report events naming its context:
        // both stay allocated (leaked) rather than dangling.
    }
}

/// A completion channel (`ibv_comp_channel`) on one device: the descriptor completion
/// events of the CQs created on it ([`CmId::create_qp_on`]) arrive on.
///
/// Always non-blocking: [`CompletionChannel::try_next`] never waits; wait for the
/// descriptor ([`AsFd`]) to become readable with poll(2) (e.g.
/// [`crate::poll_readable`]). The standard pattern: on readable, drain `try_next`
/// (acknowledgement is batched by the channel), re-arm the CQ each token names
/// ([`CmId::arm_cq`]), then poll it until empty ([`CmId::poll_cq`]).
///
/// Keeps the device context open (a reference librdmacm counts, as
/// [`crate::AsyncEvents`] holds), not the id it was made from. Any id on the same device
/// can put its CQs on it; dropping the channel while such CQs exist keeps it (and the
/// context) open until the last is destroyed.
pub struct CompletionChannel {
    core: Arc<ChannelCore>,
}

impl std::fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.core.fd())
            .field("device", &self.core.device_key())
            .finish()
    }
}

impl CompletionChannel {
    /// `ibv_create_comp_channel` on the device `id` is bound to, set `O_NONBLOCK`.
    ///
    /// [`CmError::InvalidArgument`] before the id is bound to a device (bound, resolved,
    /// or a connection request's id).
    pub fn new(id: &CmId) -> Result<CompletionChannel, CmError> {
        let context = id.device_context("ibv_create_comp_channel")?;
        Self::on(DeviceRef::take(context)?)
    }

    /// A channel on the device `device` keeps open.
    pub(crate) fn on(device: Arc<DeviceRef>) -> Result<CompletionChannel, CmError> {
        const OP: &str = "ibv_create_comp_channel";
        let context = device.context();
        // SAFETY: the context is open while `device` is, which the channel keeps.
        let raw = unsafe { ffi::ibv_create_comp_channel(context.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| CmError::from_errno(OP, ffi::last_errno()))?;
        // SAFETY: the context is open (above); the count is set once at open.
        let vectors = unsafe { (*context.as_ptr()).num_comp_vectors }.max(1);
        let vector = (NEXT_VECTOR.fetch_add(1, Ordering::Relaxed) % vectors.unsigned_abs()) as i32;
        let core = Arc::new(ChannelCore {
            raw,
            context,
            _device: device,
            events: Mutex::new(()),
            vector,
        });
        // On failure `core` drops and destroys the fresh channel.
        ffi::set_nonblocking(core.fd(), true)
            .map_err(|e| CmError::from_errno("fcntl(F_SETFL)", e))?;
        Ok(CompletionChannel { core })
    }

    pub(crate) fn core(&self) -> &Arc<ChannelCore> {
        &self.core
    }

    /// The device the channel is on.
    pub fn device_key(&self) -> DeviceKey {
        self.core.device_key()
    }

    /// The completion vector of the CQs made on this channel: each channel of the
    /// process takes the next of its device's vectors (`num_comp_vectors`), so that
    /// endpoints driven by different cores have their completions signalled on
    /// different vectors.
    pub fn vector(&self) -> u32 {
        self.core.vector.unsigned_abs()
    }

    /// How many completion vectors the device has (`num_comp_vectors`, at least 1).
    pub fn device_vectors(&self) -> u32 {
        // SAFETY: the context is open while the channel is; the count is set once.
        unsafe { (*self.core.context.as_ptr()).num_comp_vectors }
            .max(1)
            .unsigned_abs()
    }

    /// One `ibv_get_cq_event`: the token of the CQ that had a completion event (as given
    /// to [`CmId::create_qp_on`]), or `Ok(None)` when none is pending. Never waits.
    ///
    /// The CQ is disarmed by the event: re-arm it ([`CmId::arm_cq`]) before polling it
    /// empty, or later completions raise no event. Events are acknowledged in batches
    /// of 16 per CQ, and the rest before the CQ is destroyed.
    pub fn try_next(&self) -> Result<Option<u64>, CmError> {
        let _events = self.core.lock();
        let mut cq = ptr::null_mut();
        let mut cq_context = ptr::null_mut();
        // SAFETY: live, non-blocking channel; the outputs are valid for the call.
        let ret =
            unsafe { ffi::ibv_get_cq_event(self.core.raw.as_ptr(), &mut cq, &mut cq_context) };
        if ret != 0 {
            return match ffi::last_errno() {
                libc::EAGAIN | libc::EINTR => Ok(None),
                errno => Err(CmError::Os {
                    op: "ibv_get_cq_event",
                    errno: Errno(errno),
                }),
            };
        }
        if cq_context.is_null() || cq.is_null() {
            return Err(CmError::Os {
                op: "ibv_get_cq_event",
                errno: Errno(libc::EIO),
            });
        }
        // SAFETY: every CQ on this channel was created by OwnedCq::create with a
        // CqEvents as its context, freed only after the CQ is destroyed under this lock;
        // the event just read names a CQ not destroyed yet (the kernel discards a
        // destroyed CQ's events), so both are alive.
        let events = unsafe { &*cq_context.cast_const().cast::<CqEvents>() };
        let unacked = events.unacked.load(Ordering::Acquire) + 1;
        if unacked >= ACK_BATCH {
            // SAFETY: live CQ (above); acknowledges exactly the events read and counted.
            unsafe { ffi::ibv_ack_cq_events(cq, unacked) };
            events.unacked.store(0, Ordering::Release);
        } else {
            events.unacked.store(unacked, Ordering::Release);
        }
        Ok(Some(events.token))
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.core.fd()
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd stays open as long as the core lives, which outlives the borrow
        // of `self`.
        unsafe { BorrowedFd::borrow_raw(self.core.fd()) }
    }
}
