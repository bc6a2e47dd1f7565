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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cm_core::{
    AsyncEvent, CmError, ConnectionParams, CqKind, IdOption, QpNum, QueueCaps, SharedCaps,
    Transport, WorkCompletion,
};

use crate::device_events::{hub_of, DeviceHub, MailFlag, Object};
use crate::rdma::WakeReader;
use crate::removal_retry::{RemovalRetry, ANNOUNCED_RETRY_FOR};
use cm_sys::{
    CmEvent, CmId, Completion, CompletionChannel, ConnParams, DeviceKey, DeviceMonitor,
    EventChannel, MemoryRegion, QpCaps, SharedQueues,
};

/// One endpoint's hold on a device context: its subscription to the device's
/// asynchronous events (shared by every endpoint of the process on the device, routed
/// to the one that owns each object) and its own completion channel. It keeps the
/// device context open, and no CM id.
#[derive(Debug)]
pub struct RdmaDevice {
    hub: Arc<DeviceHub>,
    /// This endpoint's number among the hub's subscribers.
    subscriber: u64,
    /// Raised while this endpoint's mailbox on the hub may hold mail.
    mail: MailFlag,
    completions: CompletionChannel,
}

impl Drop for RdmaDevice {
    fn drop(&mut self) {
        self.hub.unsubscribe(self.subscriber);
    }
}

/// The next subscriber number: one per transport, unique in the process.
static NEXT_SUBSCRIBER: AtomicU64 = AtomicU64::new(1);

impl RdmaDevice {
    /// The asynchronous event descriptor (the device's, shared by the endpoints on it).
    pub fn async_fd(&self) -> BorrowedFd<'_> {
        self.hub.fd()
    }

    /// The completion channel's descriptor.
    pub fn completion_fd(&self) -> BorrowedFd<'_> {
        self.completions.as_fd()
    }

    /// A number unique in the process to this reader's hold on its device: a device
    /// removed and opened again gets a new one even if its descriptors reuse the old
    /// numbers (what a caller watching the descriptors compares).
    pub fn serial(&self) -> u64 {
        self.hub.serial()
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
    /// The wake-up socket of [`Transport::waker`] and of other endpoints' mail for this
    /// one (device events), waited on with the other descriptors.
    wake: WakeReader,
    /// A wait on the reactor found the wake-up socket readable: the next read of a
    /// device's events drains it first (then looks at the mailbox).
    wake_noted: AtomicBool,
    /// This transport's number among the subscribers of its devices' events.
    subscriber: u64,
}

impl RdmaTransport {
    /// A transport on a new event channel. With no RDMA device this is
    /// [`CmError::NoDevice`].
    pub fn new() -> Result<Self, CmError> {
        let channel = EventChannel::new()?;
        channel.set_nonblocking(true)?;
        // Made now, not with the first device: the descriptors a device's open takes
        // stay one (its completion channel), as a server near its RLIMIT_NOFILE needs.
        let (wake, _) = WakeReader::new()?;
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
            wake,
            wake_noted: AtomicBool::new(false),
            subscriber: NEXT_SUBSCRIBER.fetch_add(1, Ordering::Relaxed),
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

    /// The wake-up socket's descriptor: wait on it with the others.
    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    /// Notes that a wait outside [`Transport::wait`] (on tokio's reactor) found the
    /// wake-up socket readable: the next read of device events drains it.
    #[cfg(feature = "tokio")]
    pub(crate) fn note_wake_readable(&self) {
        self.wake_noted.store(true, Ordering::Relaxed);
    }

    /// Drains the wake-up socket if a wait on the reactor found it readable. Before the
    /// mailbox is looked at: mail posted after the drain wakes the next wait.
    fn drain_wake_noted(&mut self) -> Result<(), CmError> {
        if std::mem::take(self.wake_noted.get_mut()) {
            self.wake.drain()?;
        }
        Ok(())
    }

    /// When the transport was made: the origin of [`Transport::now`].
    pub fn origin(&self) -> Instant {
        self.origin
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
            Some(self.wake.as_fd()),
        ];
        if devices.len() <= 2 {
            // On the stack: the unused places hold the channel again, never passed.
            let mut fds = [channel; 7];
            let mut n = 1;
            for device in devices {
                fds[n] = device.async_fd();
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
            fds.push(device.async_fd());
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

/// The objects of shared queues their device's events name: the SRQ and both CQs.
fn shared_objects(shared: &SharedQueues) -> [Object; 3] {
    [
        Object::Srq(shared.srq_handle()),
        Object::Cq(shared.cq_handle(cm_sys::CqKind::Send)),
        Object::Cq(shared.cq_handle(cm_sys::CqKind::Recv)),
    ]
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

    fn claim_qp(&mut self, device: &RdmaDevice, qp: QpNum) {
        device.hub.claim(self.subscriber, Object::Qp(qp.0));
    }

    fn release_qp(&mut self, device: &RdmaDevice, qp: QpNum) {
        device.hub.release(self.subscriber, Object::Qp(qp.0));
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
        let completions = events.completion_channel()?;
        // Another endpoint's mail for us wakes our wait through the wake-up socket.
        let waker = self.waker()?.expect("the real backend has a waker");
        let hub = hub_of(events)?;
        let mail = hub.subscribe(self.subscriber, waker);
        Ok(RdmaDevice {
            hub,
            subscriber: self.subscriber,
            mail,
            completions,
        })
    }

    fn next_async_event(&mut self, device: &mut RdmaDevice) -> Result<Option<AsyncEvent>, CmError> {
        self.drain_wake_noted()?;
        // The mailbox is read whatever the wait found: another endpoint fills it.
        let read_stream = !self.take_idle(device.async_fd().as_raw_fd());
        device
            .hub
            .next_for(self.subscriber, &device.mail, read_stream)
    }

    fn release_device(&mut self, device: RdmaDevice) {
        let fds = [
            device.async_fd().as_raw_fd(),
            device.completions.as_raw_fd(),
        ];
        self.idle.retain(|fd| !fds.contains(fd));
        self.removed.push(device.hub.name());
        // A new removal retries quickly again.
        self.removal_retry = RemovalRetry::begin();
        drop(device);
    }

    fn close_device(&mut self, device: RdmaDevice) {
        let fds = [
            device.async_fd().as_raw_fd(),
            device.completions.as_raw_fd(),
        ];
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
        let shared = SharedQueues::new(id, &device.completions, token, caps)?;
        for object in shared_objects(&shared) {
            device.hub.claim(self.subscriber, object);
        }
        Ok(shared)
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

    fn prepare_qps_shared(&mut self, shared: &SharedQueues, caps: &QueueCaps) {
        shared.prepare_ready(caps.send_depth + caps.work_depth);
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

    fn release_shared(&mut self, device: &RdmaDevice, shared: SharedQueues) {
        for object in shared_objects(&shared) {
            device.hub.release(self.subscriber, object);
        }
        // Only the handle: QPs still on the queues keep them until they are destroyed.
        drop(shared);
    }

    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn waker(&mut self) -> Result<Option<std::task::Waker>, CmError> {
        Ok(Some(std::task::Waker::from(self.wake.shared())))
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
                self.idle.push(device.async_fd().as_raw_fd());
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
        if ready.is_ready(next) {
            self.wake.drain()?;
        }
        Ok(true)
    }
}
