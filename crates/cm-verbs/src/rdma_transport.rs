//! [`RdmaTransport`]: the real backend (librdmacm and libibverbs through cm-sys) as a
//! [`Transport`] for [`Endpoint`](crate::Endpoint).
//!
//! Every descriptor is non-blocking and waited on together in `poll(2)`: the CM event
//! channel, and per device context its asynchronous event descriptor and one completion
//! channel shared by the queues of every connection on the device. Completion events
//! are acknowledged in batches by cm-sys; queues are re-armed before they are polled,
//! so no completion is missed and none is polled on a timer.
//!
//! After a wait that found something ready, the endpoint reads every source; a
//! descriptor `poll(2)` reported idle is skipped by that read, once (no syscall to hear
//! EAGAIN). `poll(2)` is level-triggered: what arrives on a skipped descriptor meanwhile
//! makes the next wait return at once, so nothing is lost. With one or two device
//! contexts a wait allocates nothing.
//!
//! A device's reader holds the device's context (a reference librdmacm counts), never a
//! CM id: every listener and connection id is destroyed when the endpoint drops it, so a
//! closed listener stops listening and frees its address, and a device nothing uses any
//! more is given back ([`Transport::close_device`]). librdmacm itself keeps the context
//! of a listed device open even with no user, until a device-list refresh finds the
//! device gone, and the kernel's removal of a soft-RoCE device waits for that close.
//! So the transport also watches the kernel's announcements of device removals
//! ([`crate::sys::DeviceMonitor`], in the same `poll(2)`) and refreshes the list when one
//! comes, retrying for a few seconds: `rdma link delete` returns while the process
//! lives, whether the removal reached one of its ids (DEVICE_REMOVAL) or none.

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cm_core::{
    AsyncEvent, CmError, ConnectionParams, CqKind, IdOption, QpNum, QueueCaps, SharedCaps,
    Transport, WorkCompletion,
};

use crate::rdma::WakeReader;
use cm_sys::{
    AsyncEvents, CmEvent, CmId, Completion, CompletionChannel, ConnParams, DeviceKey,
    DeviceMonitor, EventChannel, MemoryRegion, QpCaps, SharedQueues,
};

/// How soon a pending device removal is first retried; each retry then waits twice as
/// long, up to [`REMOVAL_RETRY_MAX`].
const REMOVAL_RETRY_FIRST: Duration = Duration::from_millis(50);
/// The longest wait between two retries.
const REMOVAL_RETRY_MAX: Duration = Duration::from_secs(2);
/// How long retries go on before they are given up: a device that failed without
/// being removed (DEVICE_FATAL) stays in the device list and is not polled forever.
const REMOVAL_RETRY_FOR: Duration = Duration::from_secs(120);
/// How long refreshes go on after the kernel announced a removal: the device may be one
/// librdmacm never opened, so this gives up sooner.
const ANNOUNCED_RETRY_FOR: Duration = Duration::from_secs(10);

/// The retries of a pending removal: quick at first (the kernel's removal waits for
/// the context to close), then ever slower, then given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct RemovalRetry {
    /// Time waited so far.
    spent: Duration,
    /// The next wait.
    next: Duration,
    /// When the retries are given up.
    limit: Duration,
}

impl RemovalRetry {
    /// The retries of a removal just begun.
    fn begin() -> Self {
        Self::for_at_most(REMOVAL_RETRY_FOR)
    }

    /// Retries that end once `limit` is spent.
    fn for_at_most(limit: Duration) -> Self {
        RemovalRetry {
            spent: Duration::ZERO,
            next: REMOVAL_RETRY_FIRST,
            limit,
        }
    }

    /// How long to wait before the next retry; `None` once they are given up.
    fn after(&mut self) -> Option<Duration> {
        if self.spent >= self.limit {
            return None;
        }
        let wait = self.next;
        self.spent += wait;
        self.next = (self.next * 2).min(REMOVAL_RETRY_MAX);
        Some(wait)
    }
}

/// The reader of one device context: its asynchronous events and its completion
/// channel, each read by this endpoint only. It keeps the device context open, and no
/// CM id.
#[derive(Debug)]
pub struct RdmaDevice {
    events: AsyncEvents,
    completions: CompletionChannel,
    /// Holds the device's place in [`READERS`] while this reader lives.
    _claim: ReaderClaim,
}

/// The device contexts an endpoint of this process reads. A device's asynchronous
/// events form one stream per context: two readers would each get part of them, and a
/// COMM_EST read by the wrong one would never reach its connection's CM. So a second
/// endpoint on a device is refused, with a typed error, instead of losing events.
static READERS: std::sync::Mutex<Vec<DeviceKey>> = std::sync::Mutex::new(Vec::new());

/// One device context's entry in [`READERS`], removed on drop.
#[derive(Debug)]
struct ReaderClaim(DeviceKey);

impl ReaderClaim {
    fn take(key: DeviceKey) -> Result<ReaderClaim, CmError> {
        let mut readers = READERS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if readers.contains(&key) {
            return Err(CmError::Busy {
                op: "open_device",
                reason: "another endpoint of this process reads this device's events: \
                         share one Endpoint among the listeners and connections on a device",
            });
        }
        readers.push(key);
        Ok(ReaderClaim(key))
    }
}

impl Drop for ReaderClaim {
    fn drop(&mut self) {
        let mut readers = READERS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        readers.retain(|key| *key != self.0);
    }
}

impl RdmaDevice {
    /// The asynchronous event descriptor.
    pub fn async_fd(&self) -> BorrowedFd<'_> {
        self.events.as_fd()
    }

    /// The completion channel's descriptor.
    pub fn completion_fd(&self) -> BorrowedFd<'_> {
        self.completions.as_fd()
    }

    /// A number unique in the process to this reader's hold on its device: a device
    /// removed and opened again gets a new one even if its descriptors reuse the old
    /// numbers (what a caller watching the descriptors compares).
    pub fn serial(&self) -> u64 {
        self.events.device_serial()
    }
}

/// A connection's registered buffer area: receive buffers, then send buffers.
#[derive(Debug)]
pub struct RdmaBuffers {
    region: MemoryRegion,
    caps: QueueCaps,
}

impl RdmaBuffers {
    fn recv_range(&self, slot: u32, len: usize) -> std::ops::Range<usize> {
        let start = slot as usize * self.caps.buffer_size as usize;
        start..start + len
    }

    fn send_range(&self, slot: u32, len: usize) -> std::ops::Range<usize> {
        let start =
            (self.caps.recv_depth as usize + slot as usize) * self.caps.buffer_size as usize;
        start..start + len
    }
}

/// librdmacm and libibverbs as a [`Transport`]: one event channel of its own.
#[derive(Debug)]
pub struct RdmaTransport {
    channel: EventChannel,
    origin: Instant,
    scratch: Vec<Completion>,
    /// The last wait found the CM channel idle (and something else ready): its next read
    /// is skipped.
    channel_idle: bool,
    /// Device descriptors the last wait found idle (while something else was ready):
    /// the next read of each is skipped.
    idle: Vec<RawFd>,
    /// Devices given back after a removal whose context librdmacm has not closed yet.
    removed: Vec<String>,
    /// The retries of the pending removals.
    removal_retry: RemovalRetry,
    /// The kernel's announcements of device removals (`None` if the socket could not
    /// be opened: then only removals that reach an id of ours are seen).
    monitor: Option<DeviceMonitor>,
    /// The last wait found the monitor readable: a removal may be under way. Atomic
    /// because a wait on the reactor notes it through `&self`
    /// (`note_monitor_readable`); a relaxed load costs what a `bool` does.
    monitor_ready: AtomicBool,
    /// Refreshes after an announced removal: the devices listed before it, and the
    /// retries.
    announced: Option<(Vec<String>, RemovalRetry)>,
    /// The wake-up socket of [`Transport::waker`], made on first use and waited on
    /// with the other descriptors.
    wake: Option<WakeReader>,
}

impl RdmaTransport {
    /// A transport on a new event channel. With no RDMA device this is
    /// [`CmError::NoDevice`].
    pub fn new() -> Result<Self, CmError> {
        let channel = EventChannel::new()?;
        channel.set_nonblocking(true)?;
        Ok(RdmaTransport {
            channel,
            origin: Instant::now(),
            scratch: Vec::with_capacity(32),
            channel_idle: false,
            idle: Vec::with_capacity(8),
            removed: Vec::new(),
            removal_retry: RemovalRetry::default(),
            monitor: match DeviceMonitor::new() {
                Ok(monitor) => Some(monitor),
                Err(e) => {
                    tracing::warn!("device removals not watched: {e}");
                    None
                }
            },
            monitor_ready: AtomicBool::new(false),
            announced: None,
            wake: None,
        })
    }

    /// The descriptor of the kernel's device removal announcements, if watched: wait on
    /// it with the others (the endpoint's housekeeping reads it).
    pub fn monitor_fd(&self) -> Option<BorrowedFd<'_>> {
        self.monitor.as_ref().map(AsFd::as_fd)
    }

    /// Notes that a wait outside [`Transport::wait`] (on tokio's reactor) found the
    /// monitor readable: the next housekeeping reads it.
    #[cfg(feature = "tokio")]
    pub(crate) fn note_monitor_readable(&self) {
        self.monitor_ready.store(true, Ordering::Relaxed);
    }

    /// Reads the monitor if the last wait found it readable; a removal announced starts
    /// (or restarts) the refreshes.
    fn read_monitor(&mut self) {
        if !std::mem::take(self.monitor_ready.get_mut()) {
            return;
        }
        let Some(monitor) = &self.monitor else {
            return;
        };
        match monitor.removals() {
            Ok(false) => {}
            Ok(true) => {
                let listed = match &self.announced {
                    Some((listed, _)) => listed.clone(),
                    None => listed_devices(),
                };
                self.announced = Some((listed, RemovalRetry::for_at_most(ANNOUNCED_RETRY_FOR)));
            }
            Err(e) => tracing::debug!("reading device announcements: {e}"),
        }
    }

    /// The CM event channel's descriptor.
    pub fn channel_fd(&self) -> BorrowedFd<'_> {
        self.channel.as_fd()
    }

    /// The refreshes after a device removal that reached our ids; how soon to retry.
    fn removal_refresh(&mut self) -> Option<Duration> {
        if self.removed.is_empty() {
            return None;
        }
        // The kernel's removal goes on once our ids are destroyed and then waits for the
        // device context to close; librdmacm closes it when a resync finds the device
        // gone. Retried at a short interval until then: only during a removal.
        match cm_sys::refresh_devices() {
            Ok(present) => self.removed.retain(|name| present.contains(name)),
            // No device left at all: the removed one is gone too.
            Err(e) if e.is_no_device() => self.removed.clear(),
            Err(e) => tracing::debug!("refreshing the device list: {e}"),
        }
        // The resync that found a device gone closed its context (no id uses it).
        if self.removed.is_empty() {
            return None;
        }
        let after = self.removal_retry.after();
        if after.is_none() {
            // Failed, not removed: it stays in the device list, and a reader opened on
            // it again later is used as any other.
            tracing::debug!("devices {:?} still listed: retries given up", self.removed);
            self.removed.clear();
        }
        after
    }

    /// The refreshes after the kernel announced a removal, until a device listed before
    /// it is gone (librdmacm closed its context if nothing used it) or they are given
    /// up; how soon to retry.
    fn announced_refresh(&mut self) -> Option<Duration> {
        let (before, retry) = self.announced.as_mut()?;
        let now = listed_devices();
        if before.iter().any(|name| !now.contains(name)) {
            self.announced = None;
            return None;
        }
        let after = retry.after();
        if after.is_none() {
            self.announced = None;
        }
        after
    }

    /// Whether the last wait found `fd` idle and it was not read since (forgotten now).
    fn take_idle(&mut self, fd: RawFd) -> bool {
        match self.idle.iter().position(|&idle| idle == fd) {
            Some(index) => {
                self.idle.swap_remove(index);
                true
            }
            None => false,
        }
    }

    /// `poll(2)` on the CM channel and every device's asynchronous event and completion
    /// descriptors, in that order, the removal monitor's.
    fn poll(
        &self,
        devices: &[RdmaDevice],
        timeout: Option<Duration>,
    ) -> Result<cm_sys::ReadySet, CmError> {
        let channel = self.channel.as_fd();
        let extra = [
            self.monitor.as_ref().map(AsFd::as_fd),
            self.wake.as_ref().map(AsFd::as_fd),
        ];
        if devices.len() <= 2 {
            // On the stack: the unused places hold the channel again, never passed.
            let mut fds = [channel; 7];
            let mut n = 1;
            for device in devices {
                fds[n] = device.events.as_fd();
                fds[n + 1] = device.completions.as_fd();
                n += 2;
            }
            for fd in extra.into_iter().flatten() {
                fds[n] = fd;
                n += 1;
            }
            return cm_sys::poll_readable(&fds[..n], timeout);
        }
        let mut fds = Vec::with_capacity(3 + 2 * devices.len());
        fds.push(channel);
        for device in devices {
            fds.push(device.events.as_fd());
            fds.push(device.completions.as_fd());
        }
        fds.extend(extra.into_iter().flatten());
        cm_sys::poll_readable(&fds, timeout)
    }
}

/// The devices librdmacm lists now (a refresh: one gone with no user is closed).
fn listed_devices() -> Vec<String> {
    match cm_sys::refresh_devices() {
        Ok(names) => names,
        Err(e) => {
            if !e.is_no_device() {
                tracing::debug!("refreshing the device list: {e}");
            }
            Vec::new()
        }
    }
}

fn conn_params<'a>(private_data: &'a [u8], params: &ConnectionParams) -> ConnParams<'a> {
    ConnParams {
        private_data,
        responder_resources: params.responder_resources,
        initiator_depth: params.initiator_depth,
        retry_count: params.retry_count,
        rnr_retry_count: params.rnr_retry_count,
    }
}

/// A completion as the connection layer reads it; `kind` is the queue polled.
fn work_completion(c: &cm_sys::Completion, kind: CqKind) -> WorkCompletion {
    WorkCompletion {
        wr_id: c.wr_id,
        qp: c.qp_num,
        kind,
        status: c.status,
        byte_len: c.byte_len,
    }
}

/// Appends a message cm-sys copied out to `out`; into an empty one it moves: the copy
/// cm-sys made is the message, no second allocation and copy.
fn append_message(out: &mut Vec<u8>, message: Vec<u8>) {
    if out.is_empty() {
        *out = message;
    } else {
        out.extend_from_slice(&message);
    }
}

fn sys_kind(kind: CqKind) -> cm_sys::CqKind {
    match kind {
        CqKind::Send => cm_sys::CqKind::Send,
        CqKind::Recv => cm_sys::CqKind::Recv,
    }
}

fn check_slot(op: &'static str, slot: u32, depth: u32) -> Result<(), CmError> {
    if slot < depth {
        Ok(())
    } else {
        Err(CmError::InvalidArgument {
            op,
            reason: "no such buffer slot",
        })
    }
}

impl Transport for RdmaTransport {
    type Addr = SocketAddr;
    type Id = CmId;
    type Event = CmEvent;
    type Device = RdmaDevice;
    type DeviceKey = DeviceKey;
    type Buffers = RdmaBuffers;
    type Shared = SharedQueues;

    fn create_id(&mut self) -> Result<CmId, CmError> {
        self.channel.create_id()
    }

    fn create_id_in(&mut self, space: cm_core::PortSpace) -> Result<CmId, CmError> {
        self.channel.create_id_in(space)
    }

    fn set_min_rnr_timer(&mut self, id: &CmId, timer: u8) -> Result<(), CmError> {
        id.set_min_rnr_timer(timer)
    }

    fn id_key(&self, id: &CmId) -> usize {
        id.as_raw() as usize
    }

    fn next_cm_event(&mut self) -> Result<Option<CmEvent>, CmError> {
        if std::mem::take(&mut self.channel_idle) {
            return Ok(None);
        }
        self.channel.try_next_event()
    }

    fn event_id(&self, event: &CmEvent) -> Option<CmId> {
        event.id().cloned()
    }

    fn event_listener(&self, event: &CmEvent) -> Option<CmId> {
        event.listener().cloned()
    }

    fn bind(&mut self, id: &CmId, addr: SocketAddr) -> Result<(), CmError> {
        id.bind_addr(addr)
    }

    fn listen(&mut self, id: &CmId, backlog: u16) -> Result<(), CmError> {
        id.listen(i32::from(backlog))
    }

    fn set_option(&mut self, id: &CmId, option: IdOption) -> Result<(), CmError> {
        id.set_option(option)
    }

    fn resolve_addr(
        &mut self,
        id: &CmId,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<(), CmError> {
        id.resolve_addr(src, dst, timeout)
    }

    fn resolve_route(&mut self, id: &CmId, timeout: Duration) -> Result<(), CmError> {
        id.resolve_route(timeout)
    }

    fn connect(
        &mut self,
        id: &CmId,
        private_data: &[u8],
        params: &ConnectionParams,
    ) -> Result<(), CmError> {
        id.connect(&conn_params(private_data, params))
    }

    fn accept(
        &mut self,
        id: &CmId,
        private_data: &[u8],
        params: &ConnectionParams,
    ) -> Result<(), CmError> {
        id.accept(&conn_params(private_data, params))
    }

    fn reject(&mut self, id: &CmId, private_data: &[u8]) -> Result<(), CmError> {
        id.reject(private_data)
    }

    fn disconnect(&mut self, id: &CmId) -> Result<(), CmError> {
        id.disconnect()
    }

    fn local_addr(&self, id: &CmId) -> Option<SocketAddr> {
        id.local_addr()
    }

    fn peer_addr(&self, id: &CmId) -> Option<SocketAddr> {
        id.peer_addr()
    }

    fn device_key(&self, id: &CmId) -> Option<DeviceKey> {
        id.device_key()
    }

    fn open_device(&mut self, id: &CmId) -> Result<RdmaDevice, CmError> {
        // The context, not the id: the reader outlives the id that found the device.
        let events = id.async_events()?;
        let claim = ReaderClaim::take(events.device_key())?;
        events.set_nonblocking(true)?;
        let completions = events.completion_channel()?;
        Ok(RdmaDevice {
            events,
            completions,
            _claim: claim,
        })
    }

    fn next_async_event(&mut self, device: &mut RdmaDevice) -> Result<Option<AsyncEvent>, CmError> {
        if self.take_idle(device.events.as_raw_fd()) {
            return Ok(None);
        }
        device.events.try_next_event()
    }

    fn release_device(&mut self, device: RdmaDevice) {
        let fds = [device.events.as_raw_fd(), device.completions.as_raw_fd()];
        self.idle.retain(|fd| !fds.contains(fd));
        self.removed.push(device.events.device_name());
        // A new removal retries quickly again.
        self.removal_retry = RemovalRetry::begin();
        drop(device);
    }

    fn close_device(&mut self, device: RdmaDevice) {
        let fds = [device.events.as_raw_fd(), device.completions.as_raw_fd()];
        self.idle.retain(|fd| !fds.contains(fd));
        // The device is still there: nothing to retry. Its context stays open in
        // librdmacm until a refresh finds it gone, which the monitor brings about.
        drop(device);
    }

    fn wants_housekeeping(&self) -> bool {
        self.monitor_ready.load(Ordering::Relaxed)
    }

    fn housekeeping(&mut self) -> Option<Duration> {
        self.read_monitor();
        let announced = self.announced_refresh();
        let removed = self.removal_refresh();
        [announced, removed].into_iter().flatten().min()
    }

    fn next_cq_event(&mut self, device: &mut RdmaDevice) -> Result<Option<u64>, CmError> {
        if self.take_idle(device.completions.as_raw_fd()) {
            return Ok(None);
        }
        device.completions.try_next()
    }

    fn create_qp(
        &mut self,
        id: &CmId,
        device: &RdmaDevice,
        token: u64,
        caps: &QueueCaps,
    ) -> Result<QpNum, CmError> {
        caps.validate()?;
        let qp_caps = QpCaps {
            max_send_wr: caps.send_depth + caps.work_depth,
            max_recv_wr: caps.recv_depth,
            ..QpCaps::default()
        };
        id.create_qp_on(&qp_caps, &device.completions, token)
    }

    fn register_buffers(&mut self, id: &CmId, caps: &QueueCaps) -> Result<RdmaBuffers, CmError> {
        caps.validate()?;
        let len = caps.area_len().ok_or(CmError::InvalidArgument {
            op: "ibv_reg_mr",
            reason: "buffer area larger than the address space",
        })?;
        Ok(RdmaBuffers {
            region: id.register_memory(len)?,
            caps: *caps,
        })
    }

    fn post_recv(
        &mut self,
        id: &CmId,
        buffers: &RdmaBuffers,
        slot: u32,
        wr_id: u64,
    ) -> Result<(), CmError> {
        check_slot("ibv_post_recv", slot, buffers.caps.recv_depth)?;
        let range = buffers.recv_range(slot, buffers.caps.buffer_size as usize);
        id.post_recv(&buffers.region, range, wr_id)
    }

    fn post_send(
        &mut self,
        id: &CmId,
        buffers: &RdmaBuffers,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError> {
        check_slot("ibv_post_send", slot, buffers.caps.send_depth)?;
        if data.len() > buffers.caps.buffer_size as usize {
            return Err(CmError::InvalidArgument {
                op: "ibv_post_send",
                reason: "the message does not fit the send buffer",
            });
        }
        let range = buffers.send_range(slot, data.len());
        id.write_memory(&buffers.region, range.start, data)?;
        id.post_send(&buffers.region, range, wr_id)
    }

    fn read_recv(
        &mut self,
        id: &CmId,
        buffers: &RdmaBuffers,
        slot: u32,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CmError> {
        check_slot("read_recv", slot, buffers.caps.recv_depth)?;
        let len = len.min(buffers.caps.buffer_size as usize);
        let message = id.read_memory(&buffers.region, buffers.recv_range(slot, len))?;
        append_message(out, message);
        Ok(())
    }

    fn arm_cq(&mut self, id: &CmId, kind: CqKind) -> Result<(), CmError> {
        id.arm_cq(sys_kind(kind))
    }

    fn poll_cq(
        &mut self,
        id: &CmId,
        kind: CqKind,
        out: &mut Vec<WorkCompletion>,
        max: usize,
    ) -> Result<usize, CmError> {
        self.scratch.clear();
        let n = id.poll_cq(sys_kind(kind), &mut self.scratch, max)?;
        out.extend(self.scratch.iter().map(|c| work_completion(c, kind)));
        Ok(n)
    }

    fn create_shared(
        &mut self,
        id: &CmId,
        device: &RdmaDevice,
        token: u64,
        caps: &SharedCaps,
    ) -> Result<SharedQueues, CmError> {
        SharedQueues::new(id, &device.completions, token, caps)
    }

    fn create_qp_shared(
        &mut self,
        id: &CmId,
        shared: &SharedQueues,
        caps: &QueueCaps,
    ) -> Result<QpNum, CmError> {
        caps.validate()?;
        id.create_qp_shared(shared, caps.send_depth + caps.work_depth)
    }

    fn ready_qps(&self, shared: &SharedQueues) -> (usize, u64) {
        let stats = shared.ready_qps();
        (stats.ready, stats.taken)
    }

    fn post_shared_recv(
        &mut self,
        shared: &SharedQueues,
        slot: u32,
        wr_id: u64,
    ) -> Result<(), CmError> {
        shared.post_recv(slot, wr_id)
    }

    fn post_shared_send(
        &mut self,
        id: &CmId,
        shared: &SharedQueues,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError> {
        id.post_shared_send(shared, slot, data, wr_id)
    }

    fn read_shared_recv(
        &mut self,
        shared: &SharedQueues,
        slot: u32,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CmError> {
        // As read_recv: a completion's length never exceeds the buffer, so clamping
        // only guards a caller's mistake.
        let len = len.min(shared.caps().buffer_size as usize);
        append_message(out, shared.read_recv(slot, len)?);
        Ok(())
    }

    fn arm_shared_cq(&mut self, shared: &SharedQueues, kind: CqKind) -> Result<(), CmError> {
        shared.arm_cq(sys_kind(kind))
    }

    fn poll_shared_cq(
        &mut self,
        shared: &SharedQueues,
        kind: CqKind,
        out: &mut Vec<WorkCompletion>,
        max: usize,
    ) -> Result<usize, CmError> {
        self.scratch.clear();
        let n = shared.poll_cq(sys_kind(kind), &mut self.scratch, max)?;
        // Each completion names its own connection's QP.
        out.extend(self.scratch.iter().map(|c| work_completion(c, kind)));
        Ok(n)
    }

    fn arm_shared_limit(&mut self, shared: &SharedQueues, limit: u32) -> Result<(), CmError> {
        shared.arm_limit(limit)
    }

    fn release_shared(&mut self, shared: SharedQueues) {
        // Only the handle: QPs still on the queues keep them until they are destroyed.
        drop(shared);
    }

    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn waker(&mut self) -> Result<Option<std::task::Waker>, CmError> {
        let shared = match &self.wake {
            Some(wake) => wake.shared(),
            None => {
                let (reader, shared) = WakeReader::new()?;
                self.wake = Some(reader);
                shared
            }
        };
        Ok(Some(std::task::Waker::from(shared)))
    }

    fn wait(&mut self, devices: &[RdmaDevice], timeout: Option<Duration>) -> Result<bool, CmError> {
        self.channel_idle = false;
        self.idle.clear();
        let ready = self.poll(devices, timeout)?;
        if ready.is_empty() {
            // Timed out: the next reads look at every source, as before any wait.
            return Ok(false);
        }
        self.channel_idle = !ready.is_ready(0);
        for (index, device) in devices.iter().enumerate() {
            if !ready.is_ready(1 + 2 * index) {
                self.idle.push(device.events.as_raw_fd());
            }
            if !ready.is_ready(2 + 2 * index) {
                self.idle.push(device.completions.as_raw_fd());
            }
        }
        let mut next = 1 + 2 * devices.len();
        if self.monitor.is_some() {
            if ready.is_ready(next) {
                *self.monitor_ready.get_mut() = true;
            }
            next += 1;
        }
        if let Some(wake) = self.wake.as_mut().filter(|_| ready.is_ready(next)) {
            wake.drain()?;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_retries_slow_down_and_end() {
        let mut retry = RemovalRetry::begin();
        let waits: Vec<Duration> = std::iter::from_fn(|| retry.after()).collect();
        assert_eq!(waits[0], REMOVAL_RETRY_FIRST);
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert!(waits.iter().all(|w| *w <= REMOVAL_RETRY_MAX));
        let total: Duration = waits.iter().sum();
        assert!(total >= REMOVAL_RETRY_FOR && total < REMOVAL_RETRY_FOR + REMOVAL_RETRY_MAX);
        assert!(waits.len() < 80, "{} retries", waits.len());
        assert_eq!(retry.after(), None, "given up for good");
    }
}
