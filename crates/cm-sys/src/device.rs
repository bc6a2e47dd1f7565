//! `AsyncEvents`: the verbs asynchronous events of a device context (`ibv_get_async_event`).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cm_core::{AsyncEvent, CmError, EventObject};

use crate::ffi::{self, RawAsyncEvent};
use crate::poll::{wait_then_read, Attempt};

/// The asynchronous event stream of the device an id is bound to (`id->verbs`), from
/// [`crate::CmId::async_events`].
///
/// It holds the device's context open (a reference librdmacm counts, as it counts its
/// ids), not the id it was made from: that id is destroyed with its last handle, and a
/// reader that outlives every id of the device keeps only the context (so drop it once
/// nothing of yours uses the device, and the device can be removed).
///
/// Each event is copied out (type, and the QP number for QP events, the object's handle
/// for CQ/SRQ/WQ events, the port otherwise) and acknowledged with
/// `ibv_ack_async_event` before it is returned, so no destroy can ever wait on one.
/// Event numbers the installed headers do not know (e.g. 20, DEVICE_SPEED_CHANGE, with
/// rdma-core 44) are read as integers and come out as
/// [`AsyncEventType::Unknown`](cm_core::AsyncEventType::Unknown) or their cm-core value,
/// never as undefined behaviour.
///
/// All sources of one device share its `async_fd`, and so its blocking mode. Each
/// source remembers the mode (read once when it is made, then as it sets it) instead of
/// asking the kernel on every read: set the mode through the sources, the same for every
/// source of a device (event loops switch it on once, as the tokio registration does).
/// A source that believes the descriptor blocking polls before it reads; one that
/// believes it non-blocking reads straight away, so if something else clears
/// `O_NONBLOCK` behind its back its [`AsyncEvents::try_next_event`] can wait.
pub struct AsyncEvents {
    context: NonNull<ffi::ibv_context>,
    /// The descriptor's `O_NONBLOCK`, as this source last saw or set it.
    nonblocking: AtomicBool,
    /// Keeps the device context open.
    device: Arc<DeviceRef>,
}

// SAFETY: the context is only used for ibv_get_async_event/ibv_ack_async_event and
// fcntl/poll on its async_fd, all thread-safe in libibverbs; `device` keeps it open.
unsafe impl Send for AsyncEvents {}
// SAFETY: every method takes `&self` and writes nothing but the atomic `nonblocking`;
// concurrent `ibv_get_async_event` calls each read their own event (or EAGAIN) and each
// acknowledge it, which libibverbs counts under its own lock.
unsafe impl Sync for AsyncEvents {}

impl std::fmt::Debug for AsyncEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncEvents")
            .field("async_fd", &self.as_raw_fd())
            .finish()
    }
}

impl AsyncEvents {
    /// The events of the device `device` keeps open.
    pub(crate) fn new(device: Arc<DeviceRef>) -> Result<Self, CmError> {
        let events = AsyncEvents {
            context: device.context(),
            nonblocking: AtomicBool::new(false),
            device,
        };
        let nonblocking = ffi::is_nonblocking(events.fd())
            .map_err(|e| CmError::from_errno("fcntl(F_GETFL)", e))?;
        events.nonblocking.store(nonblocking, Ordering::Release);
        Ok(events)
    }

    /// The device the events are about.
    pub fn device_key(&self) -> crate::DeviceKey {
        crate::cq::DeviceKey::of(self.context)
    }

    /// A completion channel on the same device, sharing this source's hold on the
    /// device context.
    pub fn completion_channel(&self) -> Result<crate::CompletionChannel, CmError> {
        crate::CompletionChannel::on(Arc::clone(&self.device))
    }

    /// A number unique in the process to the device reference this source holds: a
    /// device removed and opened again gets a new one, even if its context and
    /// descriptors reuse the old numbers.
    pub fn device_serial(&self) -> u64 {
        self.device.serial()
    }

    /// The device's name (`ibv_get_device_name`, e.g. `rxe0`, `mlx5_0`).
    pub fn device_name(&self) -> String {
        // SAFETY: the context is open while `device` is.
        unsafe { context_device_name(self.context.as_ptr()) }.unwrap_or_default()
    }

    fn fd(&self) -> RawFd {
        // SAFETY: the context is open while `device` is; async_fd is set once at open.
        unsafe { (*self.context.as_ptr()).async_fd }
    }

    /// Sets (`true`) or clears `O_NONBLOCK` on the device's `async_fd`.
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<(), CmError> {
        ffi::set_nonblocking(self.fd(), nonblocking)
            .map_err(|e| CmError::from_errno("fcntl(F_SETFL)", e))?;
        self.nonblocking.store(nonblocking, Ordering::Release);
        Ok(())
    }

    /// Whether `O_NONBLOCK` is set on the device's `async_fd`, as this source last saw
    /// or set it (see the type's documentation).
    pub fn is_nonblocking(&self) -> Result<bool, CmError> {
        Ok(self.nonblocking.load(Ordering::Acquire))
    }

    /// The next event, waiting as long as it takes.
    pub fn next_event(&self) -> Result<AsyncEvent, CmError> {
        loop {
            if let Some(event) = self.next_event_timeout_inner(None)? {
                return Ok(event);
            }
        }
    }

    /// The next event if one is pending (`Ok(None)`: none; EAGAIN on a non-blocking
    /// descriptor).
    pub fn try_next_event(&self) -> Result<Option<AsyncEvent>, CmError> {
        if self.nonblocking.load(Ordering::Acquire) {
            // Straight to the read: EAGAIN is the answer when empty.
            return Ok(match self.read_one()? {
                Attempt::Got(event) => Some(event),
                Attempt::Nothing | Attempt::Skipped => None,
            });
        }
        self.next_event_timeout_inner(Some(Duration::ZERO))
    }

    /// The next event, waiting at most `timeout` (`Duration::MAX`: as long as it takes).
    pub fn next_event_timeout(&self, timeout: Duration) -> Result<Option<AsyncEvent>, CmError> {
        self.next_event_timeout_inner(Some(timeout))
    }

    fn next_event_timeout_inner(
        &self,
        timeout: Option<Duration>,
    ) -> Result<Option<AsyncEvent>, CmError> {
        wait_then_read(self.fd(), timeout, "poll", || self.read_one())
    }

    /// One `ibv_get_async_event` + copy + `ibv_ack_async_event`; `None` on EAGAIN.
    fn read_one(&self) -> Result<Attempt<AsyncEvent>, CmError> {
        let mut raw = RawAsyncEvent::zeroed();
        // SAFETY: live context; `raw` has the layout of struct ibv_async_event with the
        // type as a u32, so any number the kernel reports is a valid value.
        let ret = unsafe { ffi::ibv_get_async_event(self.context.as_ptr(), raw.as_c_ptr()) };
        if ret != 0 {
            let errno = ffi::last_errno();
            if errno == libc::EAGAIN || errno == libc::EINTR {
                return Ok(Attempt::Nothing);
            }
            return Err(CmError::from_errno("ibv_get_async_event", errno));
        }
        // SAFETY: `raw` was just filled by ibv_get_async_event and is not yet acked, so
        // the object it names is alive.
        let event = unsafe { decode(&raw) };
        // SAFETY: acknowledges the event read above, exactly once, after the copy.
        unsafe { ffi::ibv_ack_async_event(raw.as_c_ptr()) };
        Ok(Attempt::Got(event))
    }
}

/// Copies an asynchronous event out of C memory.
///
/// # Safety
/// For a known event type naming a QP/CQ/SRQ/WQ, `element` is NULL or points to the
/// live object (true until the event is acknowledged).
pub(crate) unsafe fn decode(raw: &RawAsyncEvent) -> AsyncEvent {
    // The object member is read only for the type that names it, as cm-core's decoder
    // asks; the port member is a plain int.
    // SAFETY: every bit pattern is a valid int, so reading this union member is sound
    // whichever member libibverbs wrote.
    let port_num = unsafe { raw.element.port_num };
    cm_core::decode::decode_async_event(raw.event_type, port_num, |object_kind| {
        // SAFETY: the union member read is the one the event type selects; the pointer is
        // checked for NULL and otherwise names a live object (caller's guarantee).
        unsafe {
            let object = raw.element.object;
            if object.is_null() {
                return None;
            }
            match object_kind {
                EventObject::Qp => Some((*object.cast::<ffi::ibv_qp>()).qp_num),
                EventObject::Cq => Some((*object.cast::<ffi::ibv_cq>()).handle),
                EventObject::Srq => Some((*object.cast::<ffi::ibv_srq>()).handle),
                EventObject::Wq => Some((*object.cast::<ffi::ibv_wq>()).handle),
                EventObject::Port | EventObject::Unknown => None,
            }
        }
    })
}

/// A counted reference to librdmacm's context of one device, held without any CM id.
///
/// librdmacm opens one `ibv_context` per device and counts its users: every id bound to
/// the device, and every entry of a list from `rdma_get_devices` until
/// `rdma_free_devices`. This takes one such entry (the list's other entries are given
/// back at once), so the context stays open while the reference lives, whatever happens
/// to the ids that found the device; dropping it gives the entry back. A removed device
/// whose context has no user left is closed by librdmacm at the next device-list
/// refresh ([`refresh_devices`]).
pub(crate) struct DeviceRef {
    context: NonNull<ffi::ibv_context>,
    /// A one-entry, NULL-terminated, `malloc`ed list naming `context`, given to
    /// `rdma_free_devices` on drop (which frees it).
    list: NonNull<*mut ffi::ibv_context>,
    /// This reference's number, unique in the process.
    serial: u64,
}

// SAFETY: the reference only keeps the context open; the context's own calls used
// through it (async events, completion channels) are thread-safe in libibverbs, and
// rdma_get_devices/rdma_free_devices take librdmacm's global lock.
unsafe impl Send for DeviceRef {}
// SAFETY: see Send; the fields are never written after creation.
unsafe impl Sync for DeviceRef {}

/// The next [`DeviceRef::serial`].
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

impl DeviceRef {
    /// A reference on librdmacm's context `context` (an id's `verbs`); ENODEV when
    /// librdmacm no longer lists it (the device went away).
    pub(crate) fn take(context: NonNull<ffi::ibv_context>) -> Result<Arc<DeviceRef>, CmError> {
        const OP: &str = "rdma_get_devices";
        // SAFETY: a single pointer-sized allocation for our list; checked for NULL.
        let ours = unsafe { libc::malloc(2 * size_of::<*mut ffi::ibv_context>()) }
            .cast::<*mut ffi::ibv_context>();
        let Some(ours) = NonNull::new(ours) else {
            return Err(CmError::from_errno(OP, libc::ENOMEM));
        };
        let mut count = 0;
        // SAFETY: plain call; a NULL-terminated, malloc'ed array (or NULL), every entry
        // counted as a user of its device until given back with rdma_free_devices.
        let list = unsafe { ffi::rdma_get_devices(&mut count) };
        if list.is_null() {
            let errno = ffi::last_errno();
            // SAFETY: allocated above, not handed out.
            unsafe { libc::free(ours.as_ptr().cast()) };
            return Err(CmError::from_errno(OP, errno));
        }
        // Our entry leaves the list (the others move up); the rest is given back.
        let mut found = false;
        let (mut read, mut write) = (0, 0);
        loop {
            // SAFETY: `list` is NULL-terminated and `read` has not passed the NULL;
            // `write <= read`, so both stay inside the array.
            let entry = unsafe { *list.add(read) };
            if entry.is_null() {
                // SAFETY: as above.
                unsafe { *list.add(write) = entry };
                break;
            }
            if !found && entry == context.as_ptr() {
                found = true;
            } else {
                // SAFETY: as above.
                unsafe { *list.add(write) = entry };
                write += 1;
            }
            read += 1;
        }
        // SAFETY: `list` came from rdma_get_devices and is given back once; each entry
        // left in it is one reference librdmacm counted, `context`'s excepted.
        unsafe { ffi::rdma_free_devices(list) };
        if !found {
            // SAFETY: allocated above, not handed out.
            unsafe { libc::free(ours.as_ptr().cast()) };
            return Err(CmError::from_errno(OP, libc::ENODEV));
        }
        // SAFETY: `ours` holds two entries: the context and the terminating NULL.
        unsafe {
            *ours.as_ptr() = context.as_ptr();
            *ours.as_ptr().add(1) = std::ptr::null_mut();
        }
        Ok(Arc::new(DeviceRef {
            context,
            list: ours,
            serial: NEXT_SERIAL.fetch_add(1, Ordering::Relaxed),
        }))
    }

    /// The context (open while `self` lives).
    pub(crate) fn context(&self) -> NonNull<ffi::ibv_context> {
        self.context
    }

    /// This reference's number, unique in the process: tells a reopened device from the
    /// one before it, even when the context and descriptors reuse the same numbers.
    pub(crate) fn serial(&self) -> u64 {
        self.serial
    }
}

impl Drop for DeviceRef {
    fn drop(&mut self) {
        // SAFETY: the one-entry list taken in `take`: rdma_free_devices gives back the
        // one reference it names and frees the list (malloc'ed); nothing uses either after.
        unsafe { ffi::rdma_free_devices(self.list.as_ptr()) };
    }
}

impl AsRawFd for AsyncEvents {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

impl AsFd for AsyncEvents {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the async_fd stays open while the context is, which `self` keeps alive
        // longer than the borrow.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

impl cm_core::AsyncEventSource for AsyncEvents {
    fn try_next_async_event(&mut self) -> Result<Option<AsyncEvent>, CmError> {
        AsyncEvents::try_next_event(self)
    }
}

/// The name of a device context's device (`ibv_get_device_name`), if it has one.
///
/// # Safety
/// `context` is a live device context.
pub(crate) unsafe fn context_device_name(context: *mut ffi::ibv_context) -> Option<String> {
    // SAFETY: the context is live (caller); its `device` is set at open and lives as
    // long as the context; the name is a NUL-terminated string owned by the device.
    unsafe {
        let device = (*context).device;
        if device.is_null() {
            return None;
        }
        let name = ffi::ibv_get_device_name(device);
        if name.is_null() {
            return None;
        }
        Some(
            std::ffi::CStr::from_ptr(name)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// Lets librdmacm notice devices that went away (`rdma_get_devices` resynchronises its
/// device list with libibverbs') and returns the names of the devices still there.
///
/// librdmacm keeps a device context open while any id uses it, and closes the context
/// of a removed device only when it learns that the device is gone with no id left on
/// it. The kernel's removal of a device without context disassociation (soft-RoCE among
/// others) waits for that close, so a process that outlives the removal calls this once
/// its ids on the device are destroyed.
pub fn refresh_devices() -> Result<Vec<String>, CmError> {
    let mut count = 0;
    // SAFETY: plain call; returns a NULL-terminated array (or NULL) that we free below.
    let list = unsafe { ffi::rdma_get_devices(&mut count) };
    if list.is_null() {
        return Err(CmError::from_errno("rdma_get_devices", ffi::last_errno()));
    }
    let mut names = Vec::new();
    let mut index = 0;
    loop {
        // SAFETY: `list` is NULL-terminated; every entry before the NULL is a live
        // context while the list is held.
        let context = unsafe { *list.add(index) };
        if context.is_null() {
            break;
        }
        // SAFETY: a live context while the list is held.
        names.extend(unsafe { context_device_name(context) });
        index += 1;
    }
    // SAFETY: the list came from rdma_get_devices and is freed once.
    unsafe { ffi::rdma_free_devices(list) };
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::RawAsyncElement;
    use cm_core::{AsyncEventType, EventElement, QpNum};
    use std::ffi::c_void;

    fn port_event(event_type: u32, port: i32) -> RawAsyncEvent {
        RawAsyncEvent {
            element: RawAsyncElement { port_num: port },
            event_type,
        }
    }

    #[test]
    fn unknown_event_numbers_decode_without_touching_the_element() {
        for raw in [21u32, 64, 0x7fff_ffff, u32::MAX] {
            // A dangling "pointer": decoding must not follow it for an unknown type.
            let event = RawAsyncEvent {
                element: RawAsyncElement {
                    object: 0x10 as *mut c_void,
                },
                event_type: raw,
            };
            // SAFETY: the type is unknown, so the element is never dereferenced.
            let decoded = unsafe { decode(&event) };
            assert_eq!(decoded.event_type, AsyncEventType::Unknown(raw));
            assert_eq!(decoded.element, EventElement::Unknown);
        }
    }

    #[test]
    fn device_speed_change_beyond_rdma_core_44_decodes_as_a_port_event() {
        // SAFETY: port events never dereference the element.
        let decoded = unsafe { decode(&port_event(20, 1)) };
        assert_eq!(decoded.event_type, AsyncEventType::DeviceSpeedChange);
        assert_eq!(decoded.element, EventElement::Port(1));
        // SAFETY: as above.
        let decoded = unsafe { decode(&port_event(9, 2)) };
        assert_eq!(
            decoded,
            AsyncEvent {
                event_type: AsyncEventType::PortActive,
                element: EventElement::Port(2),
            }
        );
    }

    #[test]
    fn qp_events_carry_the_qp_number_and_cq_events_the_handle() {
        // SAFETY: ibv_qp/ibv_cq are integers, pointers and opaque pthread storage: all
        // zeroes is a valid value to read fields from.
        let mut qp: ffi::ibv_qp = unsafe { std::mem::zeroed() };
        qp.qp_num = 0x11;
        let event = RawAsyncEvent {
            element: RawAsyncElement {
                object: (&mut qp as *mut ffi::ibv_qp).cast(),
            },
            event_type: AsyncEventType::CommEst.as_raw(),
        };
        // SAFETY: the element points to a live ibv_qp.
        let decoded = unsafe { decode(&event) };
        assert_eq!(
            decoded,
            AsyncEvent::qp(AsyncEventType::CommEst, QpNum(0x11))
        );

        // SAFETY: as above.
        let mut cq: ffi::ibv_cq = unsafe { std::mem::zeroed() };
        cq.handle = 7;
        let event = RawAsyncEvent {
            element: RawAsyncElement {
                object: (&mut cq as *mut ffi::ibv_cq).cast(),
            },
            event_type: AsyncEventType::CqErr.as_raw(),
        };
        // SAFETY: the element points to a live ibv_cq.
        assert_eq!(unsafe { decode(&event) }.element, EventElement::Cq(7));

        let null_qp = RawAsyncEvent {
            element: RawAsyncElement {
                object: std::ptr::null_mut(),
            },
            event_type: AsyncEventType::QpFatal.as_raw(),
        };
        // SAFETY: NULL elements are checked, never dereferenced.
        assert_eq!(unsafe { decode(&null_qp) }.element, EventElement::Unknown);
    }

    #[test]
    fn the_mirror_reads_the_type_where_libibverbs_writes_it() {
        // libibverbs writes `enum ibv_event_type` (4 bytes) after the 8-byte element.
        let mut bytes = [0u8; size_of::<RawAsyncEvent>()];
        bytes[8..12].copy_from_slice(&20u32.to_ne_bytes());
        bytes[0..4].copy_from_slice(&3i32.to_ne_bytes());
        // SAFETY: RawAsyncEvent is plain integers/pointers; any bit pattern of the right
        // size is valid, read unaligned from the byte array.
        let raw: RawAsyncEvent = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        assert_eq!(raw.event_type, 20);
        // SAFETY: port events never dereference the element.
        let decoded = unsafe { decode(&raw) };
        assert_eq!(decoded.event_type, AsyncEventType::DeviceSpeedChange);
        assert_eq!(decoded.element, EventElement::Port(3));
    }
}
