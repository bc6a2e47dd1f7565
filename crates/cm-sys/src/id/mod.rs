//! `CmId`: one `rdma_cm_id`, shared by cheap clones and destroyed with the last one.

mod borrowed;
mod data;
mod options;
mod query;
mod ready;
mod teardown;

pub(crate) use teardown::DestroyJob;

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::net::SocketAddr;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLockReadGuard, Weak};
use std::time::Duration;

use cm_core::{
    notify_result_from_errno, AsyncEventType, CmError, DeviceTransport, NotifyError, NotifyOutcome,
    QpNum,
};

use crate::channel::{ChannelInner, EventChannel};
use crate::cq::{CompletionChannel, CqKind, DeviceKey, OwnedCq};
use crate::device::AsyncEvents;
use crate::ffi;
use crate::shared::{SharedCore, SharedQueues};
use crate::verbs::{QpCaps, RegisteredMemory};

pub use borrowed::BorrowedRegion;
pub use query::{QpAttributes, QpState};

/// `qp_num` value meaning "no QP yet" (QP numbers are 24 bits).
const NO_QP: u32 = u32::MAX;

/// Connection parameters of [`CmId::connect`] and [`CmId::accept`]
/// (`struct rdma_conn_param`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnParams<'a> {
    /// Private data sent with the REQ or REP (at most 56 and 196 bytes on IB/RoCE).
    pub private_data: &'a [u8],
    /// Outstanding RDMA reads/atomics this side accepts as responder.
    pub responder_resources: u8,
    /// Outstanding RDMA reads/atomics this side issues as initiator.
    pub initiator_depth: u8,
    /// Transport retries before an error (0–7).
    pub retry_count: u8,
    /// Receiver-not-ready retries (0–7, 7 = forever).
    pub rnr_retry_count: u8,
}

impl Default for ConnParams<'_> {
    /// No private data, one outstanding read each way, 7 retries.
    fn default() -> Self {
        ConnParams {
            private_data: &[],
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
        }
    }
}

impl ConnParams<'_> {
    fn to_raw(self, op: &'static str) -> Result<ffi::rdma_conn_param, CmError> {
        let private_data_len =
            u8::try_from(self.private_data.len()).map_err(|_| CmError::InvalidArgument {
                op,
                reason: "private data longer than 255 bytes",
            })?;
        Ok(ffi::rdma_conn_param {
            private_data: if self.private_data.is_empty() {
                ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 0,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: 0,
            qp_num: 0,
        })
    }
}

/// The shared state of one `rdma_cm_id`; destroyed (QP, memory, id) when the last
/// [`CmId`] or [`crate::CmEvent`] referring to it goes.
///
/// The id's `context` holds a `Weak` of this struct (leaked into a raw pointer), so that
/// reading an event can find the owner of `event->id`. The `Weak` is reclaimed after
/// `rdma_destroy_id` returns: from then on librdmacm reports no event for the id.
pub(crate) struct IdInner {
    raw: NonNull<ffi::rdma_cm_id>,
    /// Serializes the calls that change librdmacm's user-space id state (bind, resolve,
    /// connect, accept, QP creation, posting, polling); each also holds the channel's
    /// `fields` lock shared (see [`OpsGuard`]). `notify` takes neither. It holds the
    /// channel the id's events arrive on (kept open while the id lives on it), which
    /// only [`CmId::migrate`] changes, under this lock: one lock per call, no count
    /// taken on the channel.
    ops: Mutex<Arc<ChannelInner>>,
    /// QP number, or [`NO_QP`]; cached so that `qp_num` never reads `id->qp` while
    /// another thread creates the QP.
    qp_num: AtomicU32,
    /// CM events for this id read but not yet acknowledged.
    events_out: AtomicUsize,
    /// Set once the id sent a REQ or a REP: from then on the kernel may hold its destroy
    /// while a CM message is outstanding, so the destroy goes to the reaper.
    sent_cm_messages: AtomicBool,
    /// Memory registered for the id's QP; deregistered after the QP is destroyed.
    regions: Mutex<Vec<RegisteredMemory>>,
    /// The completion queues of [`CmId::create_qp_on`] (send, receive); destroyed after
    /// the QP, before the memory.
    cqs: Mutex<Vec<OwnedCq>>,
    /// The shared queues of [`CmId::create_qp_shared`], set once its QP exists. A field
    /// with no part in `Drop::drop`: released after it, so after the QP and the id are
    /// destroyed.
    shared: OnceLock<Arc<SharedCore>>,
}

/// The id's `ops` lock and its channel, held by every id call that passes the id to
/// librdmacm or reads its fields.
struct OpsGuard<'a> {
    channel: MutexGuard<'a, Arc<ChannelInner>>,
}

impl OpsGuard<'_> {
    /// The channel's `fields` lock, shared: no event read on the channel writes into any
    /// of its ids until the guard goes.
    fn fields(&self) -> RwLockReadGuard<'_, ()> {
        self.channel.fields_shared()
    }
}

// SAFETY: librdmacm ids may be used from any thread. The user-space fields of the id are
// written in two places, both guarded:
// - by the id's own calls (bind, resolve, QP creation, ...): each holds `ops`, which
//   serializes them, and the channel's `fields` lock shared;
// - by `rdma_get_cm_event` on the id's channel (address and route queries into `route`,
//   `verbs`, `pd`, `port_num`; the QP on connection responses and rejections): a read and
//   its decoding hold that channel's `fields` lock exclusively, so they never overlap an
//   id call (every one holds it shared: `local_addr`, `peer_addr`, `device_key`,
//   `create_qp`, `async_events`, `register_memory` included), nor the id's destruction
//   (which holds it shared too).
// `notify`, the one call that takes no lock, reads only `id->channel`, which changes only
// in `CmId::migrate`, and that runs with the id's sole handle borrowed mutably and both
// channels' `fields` locks held exclusively (so no `notify` can run, and no event read
// can hand out a handle, meanwhile); the cached QP number is atomic. The kernel
// serializes the commands themselves.
unsafe impl Send for IdInner {}
// SAFETY: see Send; every `&self` method takes the locks its C call needs.
unsafe impl Sync for IdInner {}

impl IdInner {
    pub(crate) fn as_ptr(&self) -> *mut ffi::rdma_cm_id {
        self.raw.as_ptr()
    }

    /// The ops lock, with the id's current channel whose `fields` lock the caller takes
    /// shared ([`OpsGuard::fields`]) before touching the id.
    fn lock_ops(&self) -> OpsGuard<'_> {
        OpsGuard {
            channel: self.ops.lock().unwrap_or_else(PoisonError::into_inner),
        }
    }

    pub(crate) fn event_read(&self) {
        self.events_out.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn event_acked(&self) {
        self.events_out.fetch_sub(1, Ordering::AcqRel);
    }

    /// Finds the owner of an id reported by `rdma_get_cm_event`, if it is still alive.
    ///
    /// # Safety
    /// `raw` is NULL or an id this crate created (its context is NULL or a `Weak` leaked
    /// by [`IdInner::new`]) that is not yet destroyed: true for `event->id` and
    /// `event->listen_id` of an unacknowledged event, since `rdma_destroy_id` waits for
    /// that acknowledgement before it frees the id and the `Weak` is reclaimed after.
    pub(crate) unsafe fn upgrade(raw: *mut ffi::rdma_cm_id) -> Option<Arc<IdInner>> {
        if raw.is_null() {
            return None;
        }
        // SAFETY: the caller guarantees `raw` is a live id.
        let context = unsafe { (*raw).context }.cast_const().cast::<IdInner>();
        if context.is_null() {
            return None;
        }
        // SAFETY: `context` came from Weak::into_raw in IdInner::new and is reclaimed
        // only after the id is destroyed; ManuallyDrop keeps the leaked count as is.
        let weak = ManuallyDrop::new(unsafe { Weak::from_raw(context) });
        weak.upgrade()
    }

    /// Takes ownership of a fresh id and points its context at the new owner.
    ///
    /// # Safety
    /// `raw` is a live id created on `channel`, owned by nobody else, with no event read
    /// for it yet.
    pub(crate) unsafe fn new(
        raw: NonNull<ffi::rdma_cm_id>,
        channel: Arc<ChannelInner>,
    ) -> Arc<IdInner> {
        Arc::new_cyclic(|weak: &Weak<IdInner>| {
            let context = Weak::into_raw(weak.clone()).cast_mut().cast::<c_void>();
            // SAFETY: the caller owns the id exclusively; the context is this crate's.
            unsafe { (*raw.as_ptr()).context = context };
            IdInner {
                raw,
                ops: Mutex::new(channel),
                qp_num: AtomicU32::new(NO_QP),
                events_out: AtomicUsize::new(0),
                sent_cm_messages: AtomicBool::new(false),
                regions: Mutex::new(Vec::new()),
                cqs: Mutex::new(Vec::new()),
                shared: OnceLock::new(),
            }
        })
    }
}

/// An RDMA CM id (`struct rdma_cm_id`), reliable-connected (`RDMA_PS_TCP`).
///
/// Clones are cheap handles to the same id: the notify pump keeps one to call
/// [`CmId::notify`] while the application keeps using its own. The id (with its QP and
/// registered memory) is destroyed when the last clone, and the last [`crate::CmEvent`]
/// about it, are gone: an id can never be destroyed while one of its events is
/// unacknowledged, so `rdma_destroy_id` never hangs on one.
///
/// `Send + Sync`: every method takes `&self`.
#[derive(Clone)]
pub struct CmId {
    inner: Arc<IdInner>,
}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmId")
            .field("raw", &self.inner.raw)
            .field("qp_num", &self.qp_num())
            .finish()
    }
}

impl PartialEq for CmId {
    /// Two handles are equal when they refer to the same id.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for CmId {}

/// The result of a verbs call that returns its errno (positive, or negative as some
/// providers do) instead of setting `errno`.
pub(crate) fn verbs_result(op: &'static str, ret: i32) -> Result<(), CmError> {
    match ret {
        0 => Ok(()),
        errno if errno > 0 => Err(CmError::from_errno(op, errno)),
        // -1 says nothing about the cause; -errno does.
        -1 | i32::MIN => Err(CmError::from_errno(op, libc::EIO)),
        minus_errno => Err(CmError::from_errno(op, -minus_errno)),
    }
}

fn check(op: &'static str, ret: i32) -> Result<(), CmError> {
    if ret == 0 {
        Ok(())
    } else {
        Err(CmError::from_errno(op, ffi::last_errno()))
    }
}

/// Where a new QP's queues are: NULL fields are librdmacm's defaults (CQs it creates,
/// the id's PD, a receive queue of the QP's own).
struct QpQueues {
    send_cq: *mut ffi::ibv_cq,
    recv_cq: *mut ffi::ibv_cq,
    pd: *mut rdma_sys::ibv_pd,
    srq: *mut ffi::ibv_srq,
}

impl Default for QpQueues {
    fn default() -> Self {
        QpQueues {
            send_cq: ptr::null_mut(),
            recv_cq: ptr::null_mut(),
            pd: ptr::null_mut(),
            srq: ptr::null_mut(),
        }
    }
}

impl CmId {
    /// # Safety
    /// As [`IdInner::new`].
    pub(crate) unsafe fn from_new_raw(
        raw: NonNull<ffi::rdma_cm_id>,
        channel: Arc<ChannelInner>,
    ) -> CmId {
        CmId {
            // SAFETY: forwarded from the caller.
            inner: unsafe { IdInner::new(raw, channel) },
        }
    }

    pub(crate) fn from_inner(inner: Arc<IdInner>) -> CmId {
        CmId { inner }
    }

    pub(crate) fn inner(&self) -> &Arc<IdInner> {
        &self.inner
    }

    /// `rdma_bind_addr`: binds to a local address (port 0 picks one); an address of an
    /// RDMA device's netdev also binds the id to that device.
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<(), CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let mut storage = ffi::sockaddr_from(&addr);
        // SAFETY: live id; `storage` is a valid sockaddr for the call's duration.
        let ret = unsafe {
            ffi::rdma_bind_addr(
                self.inner.as_ptr(),
                (&mut storage as *mut libc::sockaddr_storage).cast(),
            )
        };
        check("rdma_bind_addr", ret)
    }

    /// `rdma_resolve_addr`: starts resolving `dst` (from `src`, if given) to a device;
    /// ADDR_RESOLVED or ADDR_ERROR follows on the channel.
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<(), CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let mut src_storage = src.as_ref().map(ffi::sockaddr_from);
        let mut dst_storage = ffi::sockaddr_from(&dst);
        let src_ptr = src_storage.as_mut().map_or(ptr::null_mut(), |s| {
            (s as *mut libc::sockaddr_storage).cast()
        });
        // SAFETY: live id; both addresses are valid (or NULL) for the call's duration.
        let ret = unsafe {
            ffi::rdma_resolve_addr(
                self.inner.as_ptr(),
                src_ptr,
                (&mut dst_storage as *mut libc::sockaddr_storage).cast(),
                ffi::timeout_ms(timeout),
            )
        };
        check("rdma_resolve_addr", ret)
    }

    /// `rdma_resolve_route`: ROUTE_RESOLVED or ROUTE_ERROR follows.
    pub fn resolve_route(&self, timeout: Duration) -> Result<(), CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        // SAFETY: live id.
        let ret = unsafe { ffi::rdma_resolve_route(self.inner.as_ptr(), ffi::timeout_ms(timeout)) };
        check("rdma_resolve_route", ret)
    }

    /// `rdma_listen`: CONNECT_REQUEST events (each with a new id) follow.
    pub fn listen(&self, backlog: i32) -> Result<(), CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        // SAFETY: live id.
        let ret = unsafe { ffi::rdma_listen(self.inner.as_ptr(), backlog) };
        check("rdma_listen", ret)
    }

    /// `rdma_connect`: sends the REQ. With a QP, librdmacm answers the REP itself (QP to
    /// RTR/RTS, RTU sent) and reports ESTABLISHED.
    pub fn connect(&self, params: &ConnParams<'_>) -> Result<(), CmError> {
        let mut raw = params.to_raw("rdma_connect")?;
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        self.inner.sent_cm_messages.store(true, Ordering::Relaxed);
        // SAFETY: live id; `raw` and its private data outlive the call.
        let ret = unsafe { ffi::rdma_connect(self.inner.as_ptr(), &mut raw) };
        check("rdma_connect", ret)
    }

    /// `rdma_accept` on the id of a CONNECT_REQUEST: moves the QP to RTR/RTS and sends
    /// the REP (IB CM state REP_SENT until the RTU or a notify).
    pub fn accept(&self, params: &ConnParams<'_>) -> Result<(), CmError> {
        let mut raw = params.to_raw("rdma_accept")?;
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        self.inner.sent_cm_messages.store(true, Ordering::Relaxed);
        // SAFETY: live id; `raw` and its private data outlive the call.
        let ret = unsafe { ffi::rdma_accept(self.inner.as_ptr(), &mut raw) };
        check("rdma_accept", ret)
    }

    /// `rdma_reject` on the id of a CONNECT_REQUEST.
    pub fn reject(&self, private_data: &[u8]) -> Result<(), CmError> {
        let len = u8::try_from(private_data.len()).map_err(|_| CmError::InvalidArgument {
            op: "rdma_reject",
            reason: "private data longer than 255 bytes",
        })?;
        let data = if private_data.is_empty() {
            ptr::null()
        } else {
            private_data.as_ptr().cast()
        };
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        // SAFETY: live id; `data` is valid for `len` bytes during the call.
        let ret = unsafe { ffi::rdma_reject(self.inner.as_ptr(), data, len) };
        check("rdma_reject", ret)
    }

    /// `rdma_disconnect`. Call it also on receiving DISCONNECTED: the peer's teardown
    /// waits for this side's DREP.
    pub fn disconnect(&self) -> Result<(), CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        // SAFETY: live id.
        let ret = unsafe { ffi::rdma_disconnect(self.inner.as_ptr()) };
        check("rdma_disconnect", ret)
    }

    /// The underlying `struct rdma_cm_id *`, for calls this crate does not wrap and for
    /// baselines (git2-style `raw()` accessor). Valid while this id or a clone lives;
    /// using it is `unsafe` and must not race [`CmId::migrate`] on the same id.
    pub fn as_raw(&self) -> *mut rdma_sys::rdma_cm_id {
        self.inner.as_ptr()
    }

    /// `rdma_notify(id, event)`: tells the CM that `event` (COMM_EST) happened on the id's
    /// QP. EISCONN is `Ok(AlreadyEstablished)`; see [`cm_core::CmId::notify`].
    ///
    /// The event number goes to the kernel as is, unknown ones included. Does not wait
    /// behind the id's other calls.
    pub fn notify(&self, event: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
        // SAFETY: live id. rdma_notify reads `id->channel`, which only rdma_migrate_id
        // writes, and `migrate` needs `&mut` on the id's only handle with no event being
        // read: no thread can be here meanwhile. No lock on this path.
        let ret = unsafe { ffi::rdma_notify_raw(self.inner.as_ptr(), event.as_raw()) };
        if ret == 0 {
            Ok(NotifyOutcome::Established)
        } else {
            notify_result_from_errno(ffi::last_errno())
        }
    }

    /// `rdma_migrate_id`: the id's future events arrive on `channel`.
    ///
    /// Needs the id to itself, so that [`CmId::notify`] can go without a lock: refused
    /// with [`CmError::UnackedEvents`] while an event of the id is unacknowledged
    /// (librdmacm would wait for it, possibly forever), and with [`CmError::Busy`] while
    /// another handle exists (a clone, one held by a notify pump: unregister it first).
    /// Waits for an event being decoded on either channel.
    pub fn migrate(&mut self, channel: &EventChannel) -> Result<(), CmError> {
        const OP: &str = "rdma_migrate_id";
        let mut current = self
            .inner
            .ops
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let unacked = self.inner.events_out.load(Ordering::Acquire);
        if unacked > 0 {
            return Err(CmError::UnackedEvents { op: OP, unacked });
        }
        let old = Arc::clone(&current);
        let new = channel.inner();
        // No event is read on either channel meanwhile, so no handle can appear (checked
        // after). Both locks are taken in address order: two migrations between the same
        // two channels in opposite directions cannot deadlock. A read holds its lock only
        // once an event is there, so this waits for one decoding at most.
        let (_first, _second) = if Arc::ptr_eq(&old, new) {
            (old.fields_exclusive(), None)
        } else if Arc::as_ptr(&old) < Arc::as_ptr(new) {
            let first = old.fields_exclusive();
            (first, Some(new.fields_exclusive()))
        } else {
            let first = new.fields_exclusive();
            (first, Some(old.fields_exclusive()))
        };
        if Arc::strong_count(&self.inner) > 1 {
            return Err(CmError::Busy {
                op: OP,
                reason: "the id has other handles (clones, events, a notify pump)",
            });
        }
        // SAFETY: live id and channel; this is the id's only handle, borrowed mutably,
        // and no event is being read on either channel, so nothing else uses the id
        // meanwhile.
        let ret = unsafe { ffi::rdma_migrate_id(self.inner.as_ptr(), new.as_ptr()) };
        check(OP, ret)?;
        *current = Arc::clone(new);
        Ok(())
    }

    /// How many of the id's CM events are read but not yet acknowledged.
    pub fn unacked_events(&self) -> usize {
        self.inner.events_out.load(Ordering::Acquire)
    }

    /// The local address (`rdma_get_local_addr`), once bound or resolved.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        // SAFETY: live id; the route's source address is a sockaddr_storage-sized union.
        unsafe {
            let id = self.inner.as_ptr();
            ffi::socket_addr_from_raw(ptr::addr_of!((*id).route.addr.src_addr_union).cast())
        }
    }

    /// The peer address (`rdma_get_peer_addr`), once resolved or connected.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        // SAFETY: live id; the route's destination address is a sockaddr_storage-sized
        // union.
        unsafe {
            let id = self.inner.as_ptr();
            ffi::socket_addr_from_raw(ptr::addr_of!((*id).route.addr.dst_addr_union).cast())
        }
    }

    /// `rdma_create_qp` with an RC QP on the device's default protection domain and
    /// completion queues librdmacm creates for it; every send is signalled.
    pub fn create_qp(&self, caps: &QpCaps) -> Result<QpNum, CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        self.device_context_locked("rdma_create_qp")?;
        // SAFETY: NULL CQs: librdmacm creates them (and destroys them with the QP).
        unsafe { self.create_qp_locked(caps, QpQueues::default()) }
    }

    /// `rdma_create_qp` with an RC QP on the device's default protection domain and two
    /// completion queues (send, receive) created on `channel`, both armed
    /// (`ibv_req_notify_cq`): their completion events arrive on `channel` as `token`.
    /// Every send is signalled. The id owns the CQs (destroyed after its QP).
    ///
    /// [`CmError::InvalidArgument`] if the id is not bound to a device yet, already has
    /// a QP, the channel is on another device, or a queue depth does not fit a C `int`.
    pub fn create_qp_on(
        &self,
        caps: &QpCaps,
        channel: &CompletionChannel,
        token: u64,
    ) -> Result<QpNum, CmError> {
        const OP: &str = "rdma_create_qp";
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let context = self.device_context_locked(OP)?;
        if DeviceKey::of(context) != channel.device_key() {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "the completion channel is on another device",
            });
        }
        self.no_qp_yet(OP)?;
        let depth = |wr: u32| {
            i32::try_from(wr.max(1)).map_err(|_| CmError::InvalidArgument {
                op: "ibv_create_cq",
                reason: "queue depth larger than a C int",
            })
        };
        let (send_depth, recv_depth) = (depth(caps.max_send_wr)?, depth(caps.max_recv_wr)?);
        // SAFETY: the context is the id's live device context, the channel's (checked);
        // the id keeps it open as long as the CQs (they are destroyed before the id).
        let send = unsafe { OwnedCq::create(context, channel.core(), send_depth, token) }?;
        // SAFETY: as above.
        let recv = unsafe { OwnedCq::create(context, channel.core(), recv_depth, token) }?;
        for cq in [&send, &recv] {
            // SAFETY: live CQ created above, not shared yet.
            let ret = unsafe { ffi::ibv_req_notify_cq(cq.as_ptr(), 0) };
            verbs_result("ibv_req_notify_cq", ret)?;
        }
        let queues = QpQueues {
            send_cq: send.as_ptr(),
            recv_cq: recv.as_ptr(),
            ..QpQueues::default()
        };
        // SAFETY: both CQs are live and stay so as long as the QP (kept in `cqs` below,
        // destroyed after the QP).
        let qp_num = unsafe { self.create_qp_locked(caps, queues) }?;
        self.inner
            .cqs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend([send, recv]);
        Ok(qp_num)
    }

    /// `rdma_create_qp` with an RC QP on `shared`: its PD, its SRQ (no receive queue of
    /// its own: `max_recv_wr` 0) and its two completion queues; a send queue of
    /// `max_send_wr`, every send signalled. The id then keeps the shared queues until
    /// its QP is destroyed with it.
    ///
    /// librdmacm names the QP's PD as the id's from then on: memory the id registers
    /// afterwards ([`CmId::register_memory`]) is on the shared PD (and usable by the
    /// QP). The id's own CQ calls ([`CmId::poll_cq`], [`CmId::arm_cq`]) reach the shared
    /// CQs, which every QP on them reports to: use [`SharedQueues`]' instead.
    ///
    /// Where the queues keep QPs made ahead ([`SharedCaps::ready_qps`]), the id takes
    /// one of `max_send_wr` if one is ready and moves it to INIT as librdmacm does.
    ///
    /// [`CmError::InvalidArgument`] if the id is not bound to a device yet, already has
    /// a QP, the queues are on another device, or `max_send_wr` is 0.
    ///
    /// [`SharedCaps::ready_qps`]: cm_core::SharedCaps::ready_qps
    pub fn create_qp_shared(
        &self,
        shared: &SharedQueues,
        max_send_wr: u32,
    ) -> Result<QpNum, CmError> {
        const OP: &str = "rdma_create_qp";
        if max_send_wr == 0 {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "a send queue of 0 work requests",
            });
        }
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let context = self.device_context_locked(OP)?;
        let core = shared.core();
        if DeviceKey::of(context) != core.device_key() {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "the shared queues are on another device",
            });
        }
        self.no_qp_yet(OP)?;
        if let Some(ready) = shared.take_ready(max_send_wr) {
            // A QP made ahead the same way: handed to the id as librdmacm would make it
            // (if that fails, the QP is destroyed and one is made here after all).
            // SAFETY: the QP is on the core's queues, on the id's device (checked), and
            // the id holds the core from here until after its QP is destroyed.
            if let Ok(qp_num) = unsafe { self.adopt_locked(ready) } {
                let _ = self.inner.shared.set(Arc::clone(core));
                return Ok(qp_num);
            }
        }
        let caps = QpCaps {
            max_send_wr,
            max_recv_wr: 0,
            max_send_sge: 1,
            max_recv_sge: 0,
            max_inline_data: 0,
        };
        let queues = QpQueues {
            send_cq: core.cq(CqKind::Send),
            recv_cq: core.cq(CqKind::Recv),
            pd: core.pd(),
            srq: core.srq(),
        };
        // SAFETY: the CQs, PD and SRQ are the core's, on the id's device (checked), and
        // live as long as the core, which the id holds from here until after its QP
        // is destroyed.
        let qp_num = unsafe { self.create_qp_locked(&caps, queues) }?;
        // Never set before: a QP exists only once, and only here sets it.
        let _ = self.inner.shared.set(Arc::clone(core));
        Ok(qp_num)
    }

    /// Copies `data` into send buffer `slot` (0..send_slots) of `shared` and posts one
    /// signalled SEND of it on the id's QP, completing with `wr_id` on the shared send
    /// CQ.
    ///
    /// [`CmError::InvalidArgument`] when the id's QP is not on `shared`
    /// ([`CmId::create_qp_shared`]), the slot does not exist, or `data` is longer than a
    /// buffer. Do not reuse a slot whose send has not completed: the bytes sent are then
    /// unspecified (the call stays memory-safe).
    pub fn post_shared_send(
        &self,
        shared: &SharedQueues,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        let on_shared = self
            .inner
            .shared
            .get()
            .is_some_and(|core| Arc::ptr_eq(core, shared.core()));
        // SAFETY: live id; `qp` is written only by QP creation under the ops lock, held.
        let qp = unsafe { (*self.inner.as_ptr()).qp };
        if !on_shared || qp.is_null() {
            return Err(CmError::InvalidArgument {
                op: "ibv_post_send",
                reason: "the id's QP is not on these shared queues",
            });
        }
        // SAFETY: the id's live QP (destroyed only by the last owner), created on these
        // shared queues (checked), which the id holds.
        unsafe { shared.core().post_send(qp, slot, data, wr_id) }
    }

    /// The QP creation itself; the caller holds the ops lock and checked the device.
    ///
    /// # Safety
    /// `queues.send_cq`/`recv_cq` are both NULL (librdmacm creates CQs) or live CQs of
    /// the id's device that outlive the QP; `queues.pd` and `queues.srq` are NULL or a
    /// live PD and SRQ of the id's device that outlive the QP.
    unsafe fn create_qp_locked(&self, caps: &QpCaps, queues: QpQueues) -> Result<QpNum, CmError> {
        self.no_qp_yet("rdma_create_qp")?;
        let id = self.inner.as_ptr();
        // SAFETY: ibv_qp_init_attr is integers and pointers; all zeroes is valid (NULL
        // CQs/SRQ: librdmacm creates the CQs, the QP has its own receive queue).
        let mut attr: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = queues.send_cq;
        attr.recv_cq = queues.recv_cq;
        attr.srq = queues.srq;
        attr.cap.max_send_wr = caps.max_send_wr;
        attr.cap.max_recv_wr = caps.max_recv_wr;
        attr.cap.max_send_sge = caps.max_send_sge;
        attr.cap.max_recv_sge = caps.max_recv_sge;
        attr.cap.max_inline_data = caps.max_inline_data;
        attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 1;
        // SAFETY: live id bound to a device; `attr` valid for the call; NULL PD means the
        // id's (the device's default) PD; the CQs, PD and SRQ are as the caller
        // guarantees.
        let ret = unsafe { ffi::rdma_create_qp(id, queues.pd, &mut attr) };
        check("rdma_create_qp", ret)?;
        // SAFETY: rdma_create_qp succeeded, so `id->qp` is the new live QP.
        let qp_num = unsafe { (*(*id).qp).qp_num };
        self.inner.qp_num.store(qp_num, Ordering::Release);
        Ok(QpNum(qp_num))
    }

    /// Refuses a second QP (librdmacm would overwrite `id->qp` and leak the first).
    fn no_qp_yet(&self, op: &'static str) -> Result<(), CmError> {
        if self.inner.qp_num.load(Ordering::Acquire) == NO_QP {
            Ok(())
        } else {
            Err(CmError::InvalidArgument {
                op,
                reason: "the id already has a QP",
            })
        }
    }

    /// The id's device context (`id->verbs`); the caller holds the ops lock.
    fn device_context_locked(
        &self,
        op: &'static str,
    ) -> Result<NonNull<ffi::ibv_context>, CmError> {
        // SAFETY: live id, read under the ops lock.
        let verbs = unsafe { (*self.inner.as_ptr()).verbs };
        NonNull::new(verbs).ok_or(CmError::InvalidArgument {
            op,
            reason: "the id is not bound to a device yet",
        })
    }

    /// The id's device context, once bound to a device.
    pub(crate) fn device_context(
        &self,
        op: &'static str,
    ) -> Result<NonNull<ffi::ibv_context>, CmError> {
        let ops = self.inner.lock_ops();
        let _fields = ops.fields();
        self.device_context_locked(op)
    }

    /// The device the id is bound to; `None` before (a fresh id, not bound or resolved).
    pub fn device_key(&self) -> Option<DeviceKey> {
        self.device_context("device_key").ok().map(DeviceKey::of)
    }

    /// The id's QP number, once [`CmId::create_qp`] succeeded.
    pub fn qp_num(&self) -> Option<QpNum> {
        match self.inner.qp_num.load(Ordering::Acquire) {
            NO_QP => None,
            n => Some(QpNum(n)),
        }
    }

    /// The asynchronous events of the id's device (`id->verbs`). Every id on the same
    /// device shares one stream; the returned source keeps the device context open (a
    /// reference librdmacm counts), not this id: the id is destroyed with its last
    /// handle whatever the source does.
    pub fn async_events(&self) -> Result<AsyncEvents, CmError> {
        let context = self.device_context("async_events")?;
        // The id holds the context open during the call: the reference is taken on a
        // live context.
        AsyncEvents::new(crate::device::DeviceRef::take(context)?)
    }
}

impl cm_core::CmId for CmId {
    fn notify(&self, event: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
        CmId::notify(self, event)
    }

    fn qp_num(&self) -> Option<QpNum> {
        CmId::qp_num(self)
    }

    fn notify_forces(&self) -> bool {
        self.transport().is_none_or(DeviceTransport::notify_forces)
    }
}
