//! A deterministic simulated RDMA CM fabric implementing the cm-core backend traits.
//!
//! Nodes with one RDMA device each, event channels, CM ids and QPs; the IB CM handshake
//! (REQ, delayed MRA, REP, RTU, DREQ/DREP, REJ, TIMEWAIT) with the kernel's states,
//! retransmissions and timeouts; the QP data path with COMM_EST and receive
//! completions; `rdma_notify` answering exactly like the kernel. Virtual time only:
//! nothing happens until [`SimFabric::step`], [`SimFabric::advance`] or
//! [`SimFabric::run_until_idle`] runs the clock. The same seed, configuration and calls
//! always give the same run (compare [`SimFabric::trace`]s).
//!
//! ```
//! use cm_core::{AsyncEventSource, AsyncEventType, CmEvent, CmEventSource, CmEventType, CmId,
//!               IbCmState, NotifyOutcome};
//! use cm_mock::sim::{FaultAction, FaultRule, MsgKind, SimConfig, SimFabric};
//!
//! let fabric = SimFabric::new(SimConfig::default(), 7);
//! let (server, client) = (fabric.add_node(), fabric.add_node());
//! let (server_events, mut client_events) = (server.create_channel(), client.create_channel());
//! let mut server_events = server_events;
//!
//! // The RTU will be lost.
//! fabric.add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
//!
//! let listener = server_events.create_id();
//! listener.bind(4791).unwrap();
//! listener.listen().unwrap();
//!
//! let active = client_events.create_id();
//! active.resolve_addr(server.id(), 4791).unwrap();
//! fabric.run_until_idle();
//! assert_eq!(client_events.try_next_event().unwrap().unwrap().event_type(), CmEventType::AddrResolved);
//! active.resolve_route().unwrap();
//! fabric.run_until_idle();
//! client_events.try_next_event().unwrap().unwrap().ack().unwrap();
//! active.create_qp().unwrap();
//! active.connect(b"hello").unwrap();
//! fabric.advance(std::time::Duration::from_millis(1));
//!
//! let request = server_events.try_next_event().unwrap().unwrap();
//! assert_eq!(request.event_type(), CmEventType::ConnectRequest);
//! let passive = request.id();
//! request.ack().unwrap();
//! passive.create_qp().unwrap();
//! passive.accept(b"").unwrap();
//! fabric.advance(std::time::Duration::from_millis(1));
//!
//! // The active side reads its REP (librdmacm sends the RTU here) and sends data.
//! let established = client_events.try_next_event().unwrap().unwrap();
//! assert_eq!(established.event_type(), CmEventType::Established);
//! established.ack().unwrap();
//! active.post_send(64).unwrap();
//! fabric.advance(std::time::Duration::from_millis(1));
//!
//! // The passive side never got the RTU, but the data raised COMM_EST.
//! assert_eq!(passive.ib_state().unwrap(), Some(IbCmState::RepSent));
//! let mut device = server.device();
//! let comm_est = device.try_next_async_event().unwrap().unwrap();
//! assert_eq!(comm_est.event_type, AsyncEventType::CommEst);
//! assert_eq!(passive.notify(AsyncEventType::CommEst), Ok(NotifyOutcome::Established));
//! fabric.advance(std::time::Duration::from_millis(1));
//! let event = server_events.try_next_event().unwrap().unwrap();
//! assert_eq!(event.event_type(), CmEventType::Established);
//! ```

mod conn_params;
mod device_faults;
mod fabric;
mod pair;
mod rng;
mod schedule;
mod tables;
mod trace;
mod transport;
mod types;

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use cm_core::kernel_model::LapState;
use cm_core::{
    AsyncEvent, AsyncEventSource, AsyncEventType, CmBackend, CmError, CmEvent, CmEventSource,
    CmEventType, CmId, CmIdState, IbCmState, NotifyError, NotifyOutcome, QpNum,
};

use fabric::Fabric;
pub use pair::{SimPair, SimSide, SimTransports};
pub use rng::SplitMix64;
pub use trace::{Trace, TraceEntry, TraceEvent};
pub use transport::{SimAddr, SimBuffers, SimDeviceReader, SimShared, SimTransport};
pub use types::{
    ConnId, DeviceKind, FaultAction, FaultOdds, FaultRule, MsgKind, NodeId, RecvCompletion,
    SimConfig, SimIdKey, SimStats,
};

/// Setup work of an application whose virtual time the fabric charges.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Setup {
    /// [`SimConfig::create_qp_cost`].
    CreateQp,
    /// [`SimConfig::register_cost`].
    Register,
}

/// What every handle of one simulation shares.
struct Shared {
    fabric: Mutex<Fabric>,
    /// The fabric's clock in nanoseconds, as of the last unlock: [`SimFabric::now`]
    /// reads it without the lock (the connection API asks the time on every pass).
    now: AtomicU64,
    /// How many ids the fabric destroyed, as of the last unlock: a transport's hint of
    /// an id's QP number holds while this does not change.
    ids_destroyed: AtomicU64,
    /// The fabric's arrival counters, read without the lock.
    arrivals: Arc<fabric::Arrivals>,
    /// [`SimConfig::create_qp_cost`] and [`SimConfig::register_cost`], read without the
    /// lock: a zero cost takes none.
    costs: (Duration, Duration),
    /// Registered memory, counted without the lock ([`SimStats`]'s `registered_*`).
    registered: transport::Registered,
}

/// The arrival counter a reader saw when it last found its queue empty (`u64::MAX`:
/// never): while the counter stays there, the queue is still empty and the reader
/// answers without taking the lock.
#[derive(Debug)]
struct EmptyAt(AtomicU64);

impl EmptyAt {
    fn new() -> Self {
        EmptyAt(AtomicU64::new(u64::MAX))
    }

    fn is(&self, mark: u64) -> bool {
        self.0.load(Ordering::Relaxed) == mark
    }

    fn set(&self, mark: u64) {
        self.0.store(mark, Ordering::Relaxed);
    }
}

impl Clone for EmptyAt {
    fn clone(&self) -> Self {
        EmptyAt(AtomicU64::new(self.0.load(Ordering::Relaxed)))
    }
}

/// The fabric, locked for one call. Publishes the clock and the count of destroyed
/// ids to [`Shared`] as it unlocks, while it still holds the lock: the published values
/// never go back.
struct Locked<'a> {
    fabric: MutexGuard<'a, Fabric>,
    shared: &'a Shared,
}

impl Deref for Locked<'_> {
    type Target = Fabric;

    fn deref(&self) -> &Fabric {
        &self.fabric
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Fabric {
        &mut self.fabric
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let shared = self.shared;
        shared.now.store(self.fabric.now_nanos(), Ordering::Release);
        shared
            .ids_destroyed
            .store(self.fabric.ids_destroyed(), Ordering::Release);
    }
}

/// The simulated fabric: a cheap, clonable handle (all clones share one simulation).
/// `Send` and `Sync`, as every handle of the fabric is `Send`: the simulation sits behind
/// one lock, taken at most once per call (the run replays as long as the calls come in
/// the same order).
#[derive(Clone)]
pub struct SimFabric {
    inner: Arc<Shared>,
}

impl fmt::Debug for SimFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fabric = self.lock();
        f.debug_struct("SimFabric")
            .field("now", &fabric.now())
            .field("pending", &fabric.pending())
            .finish_non_exhaustive()
    }
}

impl SimFabric {
    /// The fabric's state, locked for one call. The lock is held only inside the calls
    /// of the handles here and of [`SimTransport`], which run no code of their caller
    /// and drop no handle while they hold it, so no thread ever waits for a lock it
    /// holds. A poisoned lock (a panic inside a call) is taken as it is: the other
    /// handles keep working and report their own failures.
    fn lock(&self) -> Locked<'_> {
        Locked {
            fabric: self
                .inner
                .fabric
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
            shared: &self.inner,
        }
    }

    /// How many ids were destroyed, as of the last unlock (no lock taken).
    fn ids_destroyed(&self) -> u64 {
        self.inner.ids_destroyed.load(Ordering::Acquire)
    }

    /// Whether `other` is a handle of the same simulation.
    fn same(&self, other: &SimFabric) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// A fabric with no nodes; `seed` drives every random fault.
    pub fn new(config: SimConfig, seed: u64) -> Self {
        let fabric = Fabric::new(config, seed);
        SimFabric {
            inner: Arc::new(Shared {
                arrivals: Arc::clone(&fabric.arrivals),
                now: AtomicU64::new(fabric.now_nanos()),
                ids_destroyed: AtomicU64::new(fabric.ids_destroyed()),
                costs: (fabric.config.create_qp_cost, fabric.config.register_cost),
                registered: transport::Registered::default(),
                fabric: Mutex::new(fabric),
            }),
        }
    }

    /// Adds a node with the configured device ([`SimConfig::device_kind`]: by default
    /// InfiniBand/RoCE).
    pub fn add_node(&self) -> SimNode {
        let kind = self.lock().config.device_kind;
        self.add_node_with(kind)
    }

    /// Adds a node with a device of `kind`.
    pub fn add_node_with(&self, kind: DeviceKind) -> SimNode {
        let id = self.lock().add_node(kind);
        SimNode {
            fabric: self.clone(),
            id,
        }
    }

    /// The node `id`, if it exists.
    pub fn node(&self, id: NodeId) -> Option<SimNode> {
        self.lock().node_exists(id).then(|| SimNode {
            fabric: self.clone(),
            id,
        })
    }

    /// The configuration the fabric runs with.
    pub fn config(&self) -> SimConfig {
        self.lock().config.clone()
    }

    /// The fabric's activity count (see `Transport::activity`), read without the lock.
    pub(crate) fn activity(&self) -> u64 {
        self.inner.arrivals.activity()
    }

    /// Virtual time since the fabric was created (read without taking the lock).
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.inner.now.load(Ordering::Acquire))
    }

    /// How many deliveries and timers are scheduled.
    pub fn pending(&self) -> usize {
        self.lock().pending()
    }

    /// When the next scheduled action is due, if any.
    pub fn next_due(&self) -> Option<Duration> {
        self.lock().next_due().map(Duration::from_nanos)
    }

    /// Runs the earliest scheduled action (advancing the clock to it); `false` when
    /// nothing is scheduled.
    pub fn step(&self) -> bool {
        self.lock().step()
    }

    /// Runs every action due within `duration` from now, then sets the clock to now +
    /// `duration`. Returns how many actions ran.
    pub fn advance(&self, duration: Duration) -> usize {
        self.lock().advance(duration)
    }

    /// Lets the configured cost of `work` pass, as [`SimFabric::advance`] does. Takes
    /// the lock, so the caller must not hold it: a call charges it once its own work
    /// on the fabric is done.
    pub(crate) fn charge_setup(&self, work: Setup) {
        let cost = match work {
            Setup::CreateQp => self.inner.costs.0,
            Setup::Register => self.inner.costs.1,
        };
        if !cost.is_zero() {
            self.lock().spend(cost);
        }
    }

    /// Runs until nothing is scheduled (every retry exhausted, every timer fired).
    /// Returns how many actions ran.
    pub fn run_until_idle(&self) -> usize {
        let mut fabric = self.lock();
        let mut ran = 0;
        while fabric.step() {
            ran += 1;
        }
        ran
    }

    /// Steps until `done` holds (checked before each step) or nothing is scheduled;
    /// returns whether `done` held.
    pub fn run_until(&self, mut done: impl FnMut(&SimFabric) -> bool) -> bool {
        loop {
            if done(self) {
                return true;
            }
            if !self.step() {
                return done(self);
            }
        }
    }

    /// Adds a deterministic fault rule (the first matching rule applies).
    pub fn add_fault(&self, rule: FaultRule) {
        self.lock().add_rule(rule);
    }

    /// Removes every fault rule.
    pub fn clear_faults(&self) {
        self.lock().clear_rules();
    }

    /// Sets the random faults for messages of `kind` (applied when no rule matches).
    pub fn set_fault_odds(&self, kind: MsgKind, odds: FaultOdds) {
        self.lock().set_odds(kind, odds);
    }

    /// A copy of the trace so far (`None` when the configuration has it off).
    pub fn trace(&self) -> Option<Trace> {
        self.lock().trace.clone()
    }

    /// Takes the trace so far, leaving an empty one.
    pub fn take_trace(&self) -> Option<Trace> {
        self.lock().trace.as_mut().map(std::mem::take)
    }

    /// The counters so far.
    pub fn stats(&self) -> SimStats {
        let mut stats = self.lock().stats.clone();
        self.inner.registered.fill(&mut stats);
        stats
    }
}

/// One node: a host with one RDMA device.
#[derive(Clone, Debug)]
pub struct SimNode {
    fabric: SimFabric,
    id: NodeId,
}

impl SimNode {
    /// The node's number.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The fabric the node belongs to.
    pub fn fabric(&self) -> &SimFabric {
        &self.fabric
    }

    /// Opens an event channel on this node (`rdma_create_event_channel`).
    pub fn create_channel(&self) -> SimChannel {
        let index = self.fabric.lock().add_channel(self.id);
        SimChannel {
            fabric: self.fabric.clone(),
            index,
            empty_at: EmptyAt::new(),
            idle_at: (EmptyAt::new(), EmptyAt::new()),
        }
    }

    /// The node's device: its asynchronous events and its completion queue.
    pub fn device(&self) -> SimDevice {
        SimDevice {
            fabric: self.fabric.clone(),
            node: self.id,
            async_empty_at: EmptyAt::new(),
        }
    }
}

/// A node's device as the verbs layer sees it: asynchronous events
/// (`ibv_get_async_event`) and receive completions (`ibv_poll_cq`).
#[derive(Clone, Debug)]
pub struct SimDevice {
    fabric: SimFabric,
    node: NodeId,
    async_empty_at: EmptyAt,
}

impl SimDevice {
    /// The node the device belongs to.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The next receive completion of any QP of this device.
    pub fn poll_cq(&mut self) -> Option<RecvCompletion> {
        self.fabric.lock().poll_cq(self.node)
    }

    /// The next receive completion of any QP of this device, its payload appended to
    /// `out` (empty for sends made with [`SimCmId::post_send`]).
    pub fn poll_cq_data(&mut self, out: &mut Vec<u8>) -> Option<RecvCompletion> {
        self.fabric.lock().poll_cq_data(self.node, out)
    }

    /// The device's arrival counter (no lock taken).
    pub(crate) fn arrivals(&self) -> u64 {
        self.fabric.inner.arrivals.node(self.node)
    }

    /// Whether asynchronous events or receive completions are waiting.
    pub fn has_pending(&self) -> bool {
        self.fabric.lock().device_pending(self.node)
    }

    /// Raises an asynchronous event as if the device had (QP_FATAL, PORT_ERR, …).
    /// DEVICE_FATAL also stops the device: nothing the node sends afterwards leaves
    /// (counted in [`SimStats::dropped`]).
    pub fn raise(&self, event: AsyncEvent) {
        self.fabric.lock().raise_async_event(self.node, event);
    }
}

impl AsyncEventSource for SimDevice {
    fn try_next_async_event(&mut self) -> Result<Option<AsyncEvent>, CmError> {
        let mark = self.fabric.inner.arrivals.node(self.node);
        if self.async_empty_at.is(mark) {
            return Ok(None);
        }
        let event = self.fabric.lock().next_async_event(self.node);
        if event.is_none() {
            self.async_empty_at.set(mark);
        }
        Ok(event)
    }
}

/// An event channel: a FIFO of CM events of the ids created on it.
#[derive(Clone, Debug)]
pub struct SimChannel {
    fabric: SimFabric,
    index: usize,
    /// For `try_next_event`.
    empty_at: EmptyAt,
    /// For `queued_or_pending`: the channel's and the device's counters when both were
    /// last found empty.
    idle_at: (EmptyAt, EmptyAt),
}

impl SimChannel {
    /// Creates an id on this channel (`rdma_create_id`, RDMA_PS_TCP).
    pub fn create_id(&self) -> SimCmId {
        self.create_id_in(cm_core::PortSpace::Tcp)
    }

    /// Creates an id in `space` on this channel: it listens for, and its REQs reach,
    /// only ids of the same space.
    pub fn create_id_in(&self, space: cm_core::PortSpace) -> SimCmId {
        let mut fabric = self.fabric.lock();
        let key = fabric.create_id(self.index);
        fabric.set_port_space(key, space);
        if fabric.channel_closed(self.index) {
            // rdma_create_id on a closed channel fails; the handle returned here is
            // already destroyed, so every call on it answers `CmError::Gone`.
            let _ = fabric.destroy(key);
        }
        drop(fabric);
        SimCmId {
            fabric: self.fabric.clone(),
            key,
        }
    }

    /// `rdma_destroy_event_channel`: destroys every id still on the channel (their
    /// peers see what [`SimCmId::destroy`] sends) and discards its pending events.
    /// Refused with [`CmError::UnackedEvents`] while any of those ids has an
    /// unacknowledged event, and with [`CmError::Gone`] when already destroyed. Reading
    /// from a destroyed channel, or migrating an id to it, answers [`CmError::Gone`].
    pub fn destroy(&self) -> Result<(), CmError> {
        self.fabric.lock().destroy_channel(self.index)
    }

    /// Whether [`SimChannel::destroy`] ran.
    pub fn is_destroyed(&self) -> bool {
        self.fabric.lock().channel_closed(self.index)
    }

    /// The node the channel is on.
    pub fn node(&self) -> NodeId {
        self.fabric.lock().channel_node(self.index)
    }

    /// Events waiting to be read (including ones of destroyed ids not yet skipped).
    pub fn queued(&self) -> usize {
        self.fabric.lock().channel_len(self.index)
    }

    /// `queued() > 0`, or (with `device`) `device.has_pending()`: one lock when both
    /// are of one fabric.
    fn queued_or_pending(&self, device: Option<&SimDevice>) -> bool {
        let arrivals = &self.fabric.inner.arrivals;
        let marks = (
            arrivals.channel(self.index),
            device
                .filter(|d| d.fabric.same(&self.fabric))
                .map_or(u64::MAX, |d| arrivals.node(d.node)),
        );
        let cached = device.is_none_or(|d| d.fabric.same(&self.fabric));
        if cached && self.idle_at.0.is(marks.0) && self.idle_at.1.is(marks.1) {
            return false;
        }
        let fabric = self.fabric.lock();
        if fabric.channel_len(self.index) > 0 {
            return true;
        }
        match device {
            None => {
                self.idle_at.0.set(marks.0);
                self.idle_at.1.set(marks.1);
                false
            }
            Some(device) if device.fabric.same(&self.fabric) => {
                let pending = fabric.device_pending(device.node);
                if !pending {
                    self.idle_at.0.set(marks.0);
                    self.idle_at.1.set(marks.1);
                }
                pending
            }
            Some(device) => {
                drop(fabric);
                device.has_pending()
            }
        }
    }
}

impl CmEventSource for SimChannel {
    type Event = SimCmEvent;

    fn try_next_event(&mut self) -> Result<Option<SimCmEvent>, CmError> {
        // One lock for the check and the read: the connection API calls this on every
        // pass.
        let mark = self.fabric.inner.arrivals.channel(self.index);
        if self.empty_at.is(mark) {
            return Ok(None);
        }
        let read = {
            let mut fabric = self.fabric.lock();
            if fabric.channel_closed(self.index) {
                return Err(CmError::Gone {
                    op: "rdma_get_cm_event",
                    what: "channel",
                });
            }
            fabric.next_event(self.index)
        };
        if read.is_none() {
            self.empty_at.set(mark);
        }
        Ok(read.map(|read| SimCmEvent {
            fabric: self.fabric.clone(),
            read,
            acked: false,
        }))
    }
}

/// One CM event read from a [`SimChannel`]; acknowledged by [`CmEvent::ack`] or on drop.
pub struct SimCmEvent {
    fabric: SimFabric,
    read: fabric::ReadEvent,
    acked: bool,
}

impl fmt::Debug for SimCmEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimCmEvent")
            .field("id", &self.read.id)
            .field("event_type", &self.read.event_type)
            .field("status", &self.read.status)
            .finish_non_exhaustive()
    }
}

impl SimCmEvent {
    /// The id the event is about (for CONNECT_REQUEST: the new id).
    pub fn id(&self) -> SimCmId {
        SimCmId {
            fabric: self.fabric.clone(),
            key: self.read.id,
        }
    }

    /// For CONNECT_REQUEST: the listening id the request came to.
    pub fn listen_id(&self) -> Option<SimCmId> {
        self.read.listen_id.map(|key| SimCmId {
            fabric: self.fabric.clone(),
            key,
        })
    }

    /// The context its id's owner kept with it ([`SimCmId::set_context`]) when the
    /// event was read.
    pub fn context(&self) -> Option<u32> {
        self.read.context
    }

    /// The connection the event's id belongs to.
    pub fn conn(&self) -> Option<ConnId> {
        self.fabric.lock().id_conn(self.read.id)
    }
}

impl CmEvent for SimCmEvent {
    fn event_type(&self) -> CmEventType {
        self.read.event_type
    }

    fn status(&self) -> i32 {
        self.read.status
    }

    fn qp_num(&self) -> Option<QpNum> {
        self.read.qp
    }

    fn private_data(&self) -> &[u8] {
        &self.read.private
    }

    fn ack(mut self) -> Result<(), CmError> {
        self.acked = true;
        self.fabric.lock().ack(self.read.id);
        Ok(())
    }
}

impl Drop for SimCmEvent {
    fn drop(&mut self) {
        if !self.acked {
            // Never panic or deadlock in drop. The fabric is locked only inside its own
            // calls, which never drop events (it holds none), so this thread does not
            // hold the lock here: if it is taken, another thread is inside a call, and
            // waiting for that call to end is safe (skipping the ack would leave the
            // event unacknowledged for good, and its id could never be destroyed).
            // A poisoned lock is taken as it is.
            self.fabric.lock().ack(self.read.id);
        }
    }
}

/// A CM id of the fabric. Cheap to clone; every clone names the same id. Calls on a
/// destroyed id fail with [`CmError::Gone`] (notify: [`NotifyError::UnknownId`]).
#[derive(Clone)]
pub struct SimCmId {
    fabric: SimFabric,
    key: SimIdKey,
}

impl fmt::Debug for SimCmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimCmId({})", self.key)
    }
}

impl PartialEq for SimCmId {
    fn eq(&self, other: &Self) -> bool {
        self.fabric.same(&other.fabric) && self.key == other.key
    }
}

impl Eq for SimCmId {}

impl SimCmId {
    fn with<T>(&self, f: impl FnOnce(&mut Fabric) -> T) -> T {
        f(&mut self.fabric.lock())
    }

    /// The id's key in the fabric.
    pub fn key(&self) -> SimIdKey {
        self.key
    }

    /// The node the id lives on; `None` once destroyed.
    pub fn node(&self) -> Option<NodeId> {
        self.with(|f| f.id_node(self.key))
    }

    /// The connection the id belongs to, once it connects or is created by a request.
    pub fn conn(&self) -> Option<ConnId> {
        self.with(|f| f.id_conn(self.key))
    }

    /// Whether the id still exists.
    pub fn is_alive(&self) -> bool {
        self.with(|f| f.is_alive(self.key))
    }

    /// The IB CM state (`None`: no IB CM id attached yet).
    pub fn ib_state(&self) -> Result<Option<IbCmState>, CmError> {
        self.with(|f| f.ib_state(self.key))
    }

    /// The RDMA CM id state.
    pub fn cm_state(&self) -> Result<CmIdState, CmError> {
        self.with(|f| f.cm_state(self.key))
    }

    /// Events of this id read and not yet acknowledged.
    pub fn unacked_events(&self) -> Result<u32, CmError> {
        self.with(|f| f.id_unacked(self.key)).ok_or(CmError::Gone {
            op: "unacked_events",
            what: "id",
        })
    }

    /// `rdma_bind_addr` to `port` on the id's node: binds the device.
    pub fn bind(&self, port: u16) -> Result<(), CmError> {
        self.with(|f| f.bind(self.key, port))
    }

    /// `rdma_listen` on the bound port, its backlog unlimited (`u32::MAX`): tests queue
    /// thousands of requests unread with it. [`SimCmId::listen_with_backlog`] models
    /// the kernel's limit.
    pub fn listen(&self) -> Result<(), CmError> {
        self.with(|f| f.listen(self.key, None))
    }

    /// `rdma_listen` with at most `backlog` CONNECT_REQUESTs queued unread (0, or more
    /// than [`SimConfig::max_backlog`]: that maximum, as the kernel does).
    pub fn listen_with_backlog(&self, backlog: u32) -> Result<(), CmError> {
        self.with(|f| f.listen(self.key, Some(backlog)))
    }

    /// What is left of a listening id's backlog (`None`: not listening).
    pub fn backlog_left(&self) -> Option<u32> {
        self.with(|f| f.backlog_left(self.key))
    }

    /// `rdma_resolve_addr` towards `port` on node `to`; ADDR_RESOLVED follows.
    pub fn resolve_addr(&self, to: NodeId, port: u16) -> Result<(), CmError> {
        self.with(|f| f.resolve_addr(self.key, to, port))
    }

    /// `rdma_resolve_route`; ROUTE_RESOLVED follows.
    pub fn resolve_route(&self) -> Result<(), CmError> {
        self.with(|f| f.resolve_route(self.key))
    }

    /// `rdma_create_qp`: the id needs a device (bound, resolved, or from a request).
    /// Lets [`SimConfig::create_qp_cost`] pass once the QP is created.
    pub fn create_qp(&self) -> Result<QpNum, CmError> {
        let qp = self.with(|f| f.create_qp(self.key))?;
        self.fabric.charge_setup(Setup::CreateQp);
        Ok(qp)
    }

    /// `rdma_connect` (route resolved and QP created); returns the connection's number.
    pub fn connect(&self, private_data: &[u8]) -> Result<ConnId, CmError> {
        self.connect_with(private_data, &Default::default())
    }

    /// `rdma_accept` on an id from CONNECT_REQUEST: QP to RTR and RTS, REP sent.
    pub fn accept(&self, private_data: &[u8]) -> Result<(), CmError> {
        self.accept_with(private_data, &Default::default())
    }

    /// `rdma_reject` on an id from CONNECT_REQUEST.
    pub fn reject(&self, private_data: &[u8]) -> Result<(), CmError> {
        self.with(|f| f.reject(self.key, private_data))
    }

    /// `rdma_disconnect`: QP to error, then DREQ (from ESTABLISHED) or DREP (after a
    /// DREQ was received).
    pub fn disconnect(&self) -> Result<(), CmError> {
        self.with(|f| f.disconnect(self.key))
    }

    /// `rdma_destroy_id`. Refused with [`CmError::UnackedEvents`] while events of the
    /// id are unacknowledged (librdmacm would block forever).
    pub fn destroy(&self) -> Result<(), CmError> {
        self.with(|f| f.destroy(self.key))
    }

    /// `rdma_migrate_id`: moves the id and its pending events to `channel`.
    pub fn migrate(&self, channel: &SimChannel) -> Result<(), CmError> {
        if !self.fabric.same(&channel.fabric) {
            return Err(CmError::InvalidArgument {
                op: "rdma_migrate_id",
                reason: "channel of another fabric",
            });
        }
        self.with(|f| f.migrate(self.key, channel.index))
    }

    /// Posts one SEND of `len` bytes on the id's QP (must be in RTS).
    pub fn post_send(&self, len: u32) -> Result<(), CmError> {
        self.with(|f| f.post_send(self.key, len))
    }

    /// Keeps `context` with the id (rdma_cm's `id->context`; `u32::MAX` is refused),
    /// given back with each of its events ([`SimCmEvent::context`]); whether it was kept
    /// (the id is alive).
    pub fn set_context(&self, context: u32) -> bool {
        self.fabric.lock().set_context(self.key, context)
    }

    /// Posts one SEND carrying `data` on the id's QP (must be in RTS); the receiver's
    /// [`SimDevice::poll_cq_data`] gets the bytes.
    pub fn post_send_data(&self, data: &[u8]) -> Result<(), CmError> {
        self.with(|f| f.post_send_data(self.key, data))
    }

    /// Test hook: puts the IB CM id in `state` directly (cancelling its timers), for
    /// states the handshake cannot reach (SIDR_*, LAP-related) in table tests.
    pub fn force_ib_state(&self, state: IbCmState) -> Result<(), CmError> {
        self.with(|f| f.force_ib_state(self.key, state))
    }

    /// Test hook: sets the id's LAP state, which decides PATH_MIG.
    pub fn set_lap_state(&self, lap: LapState) -> Result<(), CmError> {
        self.with(|f| f.set_lap_state(self.key, lap))
    }

    /// Whether the id's QP is in RTS (can send).
    pub fn qp_ready_to_send(&self) -> bool {
        self.with(|f| f.qp_state(self.key)) == Some(fabric::QpState::Rts)
    }
}

impl CmId for SimCmId {
    fn notify(&self, event: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
        self.with(|f| f.notify(self.key, event))
    }

    fn qp_num(&self) -> Option<QpNum> {
        self.with(|f| f.id_qp(self.key))
    }

    fn notify_forces(&self) -> bool {
        !self.with(|f| f.on_iwarp(self.key))
    }
}

/// The [`CmBackend`] of the simulated fabric.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimBackend;

impl CmBackend for SimBackend {
    type Id = SimCmId;
    type Event = SimCmEvent;
    type Events = SimChannel;
    type AsyncEvents = SimDevice;
}
