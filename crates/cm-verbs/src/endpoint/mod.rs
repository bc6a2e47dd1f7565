//! The connection API: an [`Endpoint`] owns a CM event channel, one reader per device
//! context (asynchronous events and a completion channel), the notify pump and every
//! listener and connection on them. The notify path needs no application code: a
//! COMM_EST, or a receive completing on an accepted connection whose RTU is late or
//! lost, is forwarded with `rdma_notify` before the application hears of either, and
//! the connection is reported [`Event::Established`] exactly once, with how it got there.
//!
//! The endpoint is generic over a [`Transport`]: the real backend (`rdma` feature,
//! [`crate::rdma::RdmaTransport`]) or a simulated fabric (cm-mock's `SimTransport`), so
//! an application's tests swap the backend and keep their code. It reads no clock of
//! its own (time comes from the transport) and waits only in [`Transport::wait`].

mod application;
mod compact;
mod drain;
mod driving;
mod flush;
mod inputs;
mod options;
mod queue;
mod sending;
mod setup;
mod shared;
mod slots;
mod table;
mod trace;
mod types;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustc_hash::FxHashMap;

use cm_core::{CmEventType, QpNum, QueueCaps, RejectReason, Transport, WorkCompletion};

use crate::{NotifyPump, PumpCounters, Role};

use compact::{Inbox, Micros, Nanos, QpSlot, Rare, SlotIndex, Step, Times};
pub use flush::FLUSH_GRACE;
pub use options::{ConnectOptions, ListenOptions, PrivateData};
use queue::{ClosedConn, Pending, Ready};
pub use queue::{CLOSED_BACKLOG, ENDPOINT_EVENT_BACKLOG};
pub use types::{
    CloseReason, ConnError, ConnTimes, ConnectionId, EndpointOptions, EndpointStats,
    EstablishedVia, Event, ListenerId, QpErrorDetail, Traffic,
};

/// On a transport in virtual time, turns given to the other parties (the runtime's
/// other tasks, the application's threads) in which nothing moves before a wait with
/// nothing pending is refused, or time jumps to the next deadline: one number for the
/// async endpoint and the handles' drivers.
pub(crate) const IDLE_TURNS: u32 = 64;

/// Completions read per `poll_cq` call.
const POLL_BATCH: usize = 32;

/// What one [`Endpoint::process`] pass handles at most from each source: asynchronous
/// events per device, completion-queue events per device (each drains one
/// connection's queues, at most its receive plus send depth), CM events, expired
/// deadlines. A source with more waiting is read again on the next pass, which then
/// does not wait: sustained traffic on one source cannot starve the others.
pub const PASS_BATCH: usize = 64;

/// Ids of ended connections kept at most before they are destroyed while the CM
/// channel still has events waiting (see [`EndpointStats::ended_ids`]).
pub const DEFERRED_DESTROY_MAX: usize = 1024;

/// The bit that marks a work request id as the application's own: one-sided work
/// (RDMA READ/WRITE) it posts on a connection's QP (through [`Endpoint::cm_id`], room
/// made by [`QueueCaps::work_depth`]) with this bit set completes to the application
/// ([`Endpoint::take_work_completion`]) and is never taken for one of the endpoint's
/// messages.
pub const APPLICATION_WR_ID: u64 = 1 << 63;

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConnState {
    /// Active side: resolving the address, then the route.
    Resolving,
    /// Active side, the application's QP ([`ConnectOptions::application_qp`]): the
    /// route is resolved, the application makes its QP
    /// ([`Event::RouteResolved`]).
    AwaitingQp,
    /// Active side: REQ sent, waiting for the REP.
    Connecting,
    /// Passive side: the request waits for the application's answer, or (auto
    /// accept) for its turn to be set up.
    Requested,
    /// Passive side: REP sent, waiting for the RTU (or a notify).
    Accepted,
    /// Established and reported.
    Established,
}

/// What the endpoint knows of one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionInfo<A> {
    /// Passive (accepted) or active (connected).
    pub role: Role,
    /// Where it is.
    pub state: ConnState,
    /// Its QP, once created.
    pub qp: Option<QpNum>,
    /// How it became established, once it is.
    pub established: Option<EstablishedVia>,
    /// The listener it came to (passive side).
    pub listener: Option<ListenerId>,
    /// The local address.
    pub local_addr: Option<A>,
    /// The peer's address.
    pub peer_addr: Option<A>,
    /// When it passed each step of its setup.
    pub times: ConnTimes,
    /// Messages sent and not yet completed (their buffers are in flight): completed
    /// sends are reported as one coalesced [`Event::Sent`], this says how many remain.
    pub sends_in_flight: u32,
    /// ADDR_CHANGE events the CM reported for it ([`Event::AddressChanged`]).
    pub address_changes: u32,
    /// Messages and bytes each way.
    pub traffic: Traffic,
}

struct Listener<T: Transport> {
    id: T::Id,
    options: ListenOptions,
    /// Its connections in setup (requested or accepted, not yet established or
    /// closed), at most `options.max_in_setup`.
    in_setup: u32,
    /// The device whose reader this listener counts as a user of (bound to a device's
    /// address); `None` for a wildcard listener.
    device: Option<T::DeviceKey>,
}

struct Conn<T: Transport> {
    /// Its slot's generation (see [`Slot`]).
    generation: u32,
    id: T::Id,
    role: Role,
    state: ConnState,
    listener: Option<ListenerId>,
    device: Option<T::DeviceKey>,
    qp: QpSlot,
    caps: QueueCaps,
    buffers: Option<T::Buffers>,
    /// The send buffer the next message goes in: RC completes a QP's sends in the
    /// order they were posted, so the free buffers are a ring.
    send_next: u32,
    /// Sends posted and not yet completed.
    sends_in_flight: u32,
    deadline: Nanos,
    /// What the notify path did before ESTABLISHED arrived, then (once `state` is
    /// established) how it was established: one field, as the second follows the first.
    via: Option<EstablishedVia>,
    /// Messages received and not yet taken, with the receive slot each one used (of
    /// its own queues; `shared::NO_SLOT` from the shared pool). An own slot's receive
    /// is posted again only when its message is taken, so this never holds more than
    /// the receive depth: a peer that sends faster than the application reads (or
    /// before the connection is established) meets RNR. On shared queues the depth is
    /// enforced by closing ([`CloseReason::ReceiveOverrun`]).
    inbox: Inbox,
    /// What it has to report.
    pending: Pending,
    /// Active side: the resolution timeout, until connect.
    resolve_timeout: Micros,
    /// Private data (the REQ's to send on an active side until connect, then the
    /// peer's until reported) and a notify failure not yet reported
    /// ([`Event::NotifyFailed`], about its QP): seldom there, boxed together.
    rare: Rare,
    times: Times,
    traffic: Traffic,
    /// Its QP is the application's (made on its id before `accept_request`): the
    /// endpoint made no queue, buffer or receive for it and never reads its completion
    /// queues; the application reports its receives ([`Endpoint::received`]).
    application_qp: bool,
    /// Its QP flushed with no error of its own (`flush.rs`).
    flushed: bool,
}

impl<T: Transport> Conn<T> {
    /// How it was established, once it is.
    fn established_via(&self) -> Option<EstablishedVia> {
        self.via.filter(|_| self.state == ConnState::Established)
    }

    /// A connection that has just begun, on its id, with nothing set up yet.
    fn new(id: T::Id, role: Role, state: ConnState, caps: QueueCaps, now: Duration) -> Self {
        Conn {
            generation: 0,
            times: Times::new(now),
            id,
            role,
            state,
            listener: None,
            device: None,
            qp: QpSlot::NONE,
            caps,
            buffers: None,
            send_next: 0,
            sends_in_flight: 0,
            deadline: Nanos::NONE,
            via: None,
            inbox: Inbox::default(),
            pending: Pending::default(),
            resolve_timeout: Micros::new(Duration::ZERO),
            rare: Rare::default(),
            traffic: Traffic::default(),
            application_qp: false,
            flushed: false,
        }
    }
}

/// A slot's occupant: a live connection, or one that closed and whose close the
/// application has not heard of yet.
// Live is the common case: boxing it would cost an allocation per connection.
#[allow(clippy::large_enum_variant)]
enum Entry<T: Transport> {
    Live(Conn<T>),
    Closed(ClosedConn),
}

/// A slot of the connection table. Its generation (which completes a handle) lives
/// inside whatever occupies it, in padding a connection's entry has anyway, rather
/// than beside it: eight bytes less per slot.
enum Slot<T: Transport> {
    Vacant(u32),
    Occupied(Entry<T>),
}

impl<T: Transport> Slot<T> {
    fn generation(&self) -> u32 {
        match self {
            Slot::Vacant(generation) => *generation,
            Slot::Occupied(Entry::Live(c)) => c.generation,
            Slot::Occupied(Entry::Closed(c)) => c.generation,
        }
    }

    fn entry(&self) -> Option<&Entry<T>> {
        match self {
            Slot::Occupied(entry) => Some(entry),
            Slot::Vacant(_) => None,
        }
    }

    fn entry_mut(&mut self) -> Option<&mut Entry<T>> {
        match self {
            Slot::Occupied(entry) => Some(entry),
            Slot::Vacant(_) => None,
        }
    }

    /// The occupant, the slot left vacant with its generation.
    fn take(&mut self) -> Option<Entry<T>> {
        let generation = self.generation();
        match std::mem::replace(self, Slot::Vacant(generation)) {
            Slot::Occupied(entry) => Some(entry),
            Slot::Vacant(_) => None,
        }
    }

    /// Occupies the slot with `entry`, which takes its generation.
    fn put(&mut self, mut entry: Entry<T>) {
        let generation = self.generation();
        match &mut entry {
            Entry::Live(c) => c.generation = generation,
            Entry::Closed(c) => c.generation = generation,
        }
        *self = Slot::Occupied(entry);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    Listener(ListenerId),
    Conn(ConnectionId),
}

/// Listeners and connections over one [`Transport`], with the notify path built in.
///
/// Everything happens in [`Endpoint::poll`] (handle whatever is ready, never wait) or
/// in the waiting calls ([`Endpoint::next_event`], [`Endpoint::accept`],
/// [`Endpoint::recv`], [`Endpoint::established`]), which block in the transport until
/// something is ready or their timeout passes. Events no call was waiting for stay
/// queued for [`Endpoint::next_event`], within bounds: a connection holds at most its
/// receive depth of messages (with queues of its own a receive is posted again only
/// when its message is taken, so a faster peer meets RNR; on shared queues a peer that
/// sends past it ends the connection, [`CloseReason::ReceiveOverrun`]), at most one [`Event::Sent`] and one
/// [`Event::NotifyFailed`] (the latest), and its close; closes not yet reported are
/// kept up to [`CLOSED_BACKLOG`] and endpoint-wide events up to
/// [`ENDPOINT_EVENT_BACKLOG`], what passes a bound being counted
/// ([`EndpointStats::dropped_events`]). A connection the application closed itself
/// ([`Endpoint::disconnect`]) reports nothing more.
///
/// The connection table keeps the size of its peak: a slot (under 200 bytes) for each of the
/// most connections the endpoint held at once (a slot freed is reused, not given back;
/// everything else a connection holds goes with it), so a server's memory after a burst
/// stays at the burst's table. O(peak) is also the cost of the rare walks over every
/// connection (a device's loss).
///
/// Every call costs O(1) (amortised) in the number of connections unless its
/// documentation says otherwise, and one pass reads at most [`PASS_BATCH`] events from
/// each source.
///
/// Device contexts are read once each, whatever number of listeners and connections
/// share them, and every CM-bound asynchronous event is routed to the connection that
/// owns its QP. A device's asynchronous events form one stream per process, so put every
/// listener and connection on a device in one endpoint: the real backend refuses a second
/// endpoint on a device ([`CmError::Busy`](crate::CmError::Busy)), not to split its COMM_ESTs.
pub struct Endpoint<T: Transport> {
    transport: T,
    pump: NotifyPump<T::Id>,
    device_keys: Vec<T::DeviceKey>,
    devices: Vec<T::Device>,
    /// Per reader, how many listeners and connections use it: it is closed when the
    /// last goes.
    device_users: Vec<u32>,
    listeners: Vec<Option<Listener<T>>>,
    /// Each listener slot's generation, moved on when its listener goes.
    listener_generations: Vec<u32>,
    slots: slots::Slots<Slot<T>>,
    free_slots: Vec<u32>,
    /// Listeners by id key, and connections too on a transport that keeps no id context
    /// (elsewhere a connection's id carries its slot).
    by_id: FxHashMap<usize, Owner>,
    /// Each QP's connection, by slot: an entry goes with its connection, so the slot's
    /// generation completes the handle (half the size of keeping handles).
    /// Indexed directly by QP number, as the pump's table.
    by_qp: crate::qp_table::QpTable<SlotIndex>,
    /// Connections (each at most once) and endpoint-wide events with something to
    /// report, oldest first.
    ready: VecDeque<Ready>,
    /// Endpoint-wide events (bounded by [`ENDPOINT_EVENT_BACKLOG`]).
    endpoint_events: VecDeque<Event>,
    /// How many of them are [`Event::ListenerClosed`] (for `accept`).
    listener_closed_pending: usize,
    /// Passive connections established, in order, for `accept`.
    accepted: VecDeque<ConnectionId>,
    /// Requests to auto-accepting listeners read from the CM channel and not yet set
    /// up, oldest first: the channel is read ahead of the setup work, so unread
    /// requests never fill the kernel's listen backlog (past it the kernel drops a REQ
    /// without a reply, and the peer resends it only after its CM response timeout).
    /// Each listener's share is bounded by its `max_in_setup`; an entry whose
    /// connection moved on is stale and skipped.
    to_set_up: VecDeque<ConnectionId>,
    /// Ids of connections that ended while the CM channel was read, destroyed at the
    /// end of the pass unless the read left a full batch waiting (then once a later
    /// pass finds less, or [`DEFERRED_DESTROY_MAX`] wait): the kernel's
    /// `rdma_destroy_id` walks every unread event of the channel to drop the id's own,
    /// so destroying ids amid a burst of thousands of DISCONNECTEDs costs their square.
    ended_ids: Vec<T::Id>,
    /// Whether the CM channel is being read (an id that ends now is deferred).
    reading_cm: bool,
    /// Whether a flushed completion's cause is being looked for on the other queue.
    seeking_cause: bool,
    /// Whether a waiting call is busy polling: the shared completion queues it polls
    /// are not armed again on their completion event meanwhile (no event per message).
    spinning: bool,
    /// Whether a shared completion queue was left unarmed by a spin: armed again (and
    /// polled once more) before anything waits.
    shared_unarmed: bool,
    /// Whether the last CM read took a full batch (more are likely waiting).
    cm_batch_full: bool,
    /// Connect and establish deadlines; an entry whose connection moved on is stale
    /// and skipped.
    deadlines: BinaryHeap<Reverse<(Duration, ConnectionId)>>,
    /// Accepted connections whose trigger may still come, for busy polling to poll
    /// their receive queues itself; an entry whose connection moved on is stale and
    /// skipped.
    awaiting: VecDeque<ConnectionId>,
    /// The last ready-queue ticket given out.
    next_ticket: u32,
    live_conns: usize,
    live_listeners: usize,
    closed_conns: usize,
    held_messages: usize,
    dropped_events: u64,
    /// Requests rejected at once: their listener had its most connections in setup.
    requests_refused: u64,
    options: EndpointOptions,
    completions: Vec<WorkCompletion>,
    /// When the transport asked to run its housekeeping again.
    housekeeping_due: Option<Duration>,
    /// A device reader was given back since the housekeeping last ran.
    device_released: bool,
    notify: bool,
    /// Set by an [`EndpointWaker`]: the current or next wait returns.
    woken: Arc<AtomicBool>,
    /// Completions of the application's one-sided work, per connection, until taken
    /// (each at most its `work_depth`).
    work_done: FxHashMap<ConnectionId, VecDeque<WorkCompletion>>,
    /// The devices' shared queues ([`EndpointOptions::shared_queues`]).
    shared: shared::SharedQueues<T>,
}

/// Wakes an [`Endpoint`]'s waiting call from another thread: a server stops (or looks
/// at something else) without waking on a tick. Cheap to clone, [`Send`] and [`Sync`].
///
/// [`EndpointWaker::wake`] makes the current wait, or the next one if none is under
/// way, return at once: every waiting call answers [`ConnError::Woken`]. Wakes before a wait coalesce into one.
#[derive(Debug, Clone)]
pub struct EndpointWaker {
    woken: Arc<AtomicBool>,
    /// The transport's own (its wait may block in a system call); `None` for one that
    /// never blocks in real time.
    transport: Option<std::task::Waker>,
}

impl EndpointWaker {
    /// Makes the endpoint's current or next wait return. Never blocks.
    pub fn wake(&self) {
        self.woken.store(true, Ordering::Release);
        if let Some(waker) = &self.transport {
            waker.wake_by_ref();
        }
    }
}

impl<T: Transport> std::fmt::Debug for Endpoint<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("devices", &self.device_keys)
            .field("connections", &self.connection_count())
            .field("ready", &self.ready.len())
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Endpoint<T> {
    /// An endpoint over `transport`, with no listener or connection yet, and the
    /// default [`EndpointOptions`]. O(1).
    pub fn new(transport: T) -> Self {
        Self::with_options(transport, EndpointOptions::default())
    }

    /// An endpoint over `transport` with `options`. O(1).
    pub fn with_options(transport: T, options: EndpointOptions) -> Self {
        Endpoint {
            transport,
            pump: NotifyPump::new(),
            device_keys: Vec::new(),
            devices: Vec::new(),
            device_users: Vec::new(),
            listeners: Vec::new(),
            listener_generations: Vec::new(),
            slots: slots::Slots::new(),
            free_slots: Vec::new(),
            by_id: FxHashMap::default(),
            by_qp: crate::qp_table::QpTable::with_capacity(0),
            ready: VecDeque::new(),
            endpoint_events: VecDeque::new(),
            listener_closed_pending: 0,
            accepted: VecDeque::new(),
            to_set_up: VecDeque::new(),
            ended_ids: Vec::new(),
            reading_cm: false,
            seeking_cause: false,
            spinning: false,
            shared_unarmed: false,
            cm_batch_full: false,
            deadlines: BinaryHeap::new(),
            awaiting: VecDeque::new(),
            next_ticket: 0,
            live_conns: 0,
            live_listeners: 0,
            closed_conns: 0,
            held_messages: 0,
            dropped_events: 0,
            requests_refused: 0,
            options,
            completions: Vec::with_capacity(POLL_BATCH),
            housekeeping_due: None,
            device_released: false,
            notify: true,
            woken: Arc::new(AtomicBool::new(false)),
            work_done: FxHashMap::default(),
            shared: shared::SharedQueues::default(),
        }
    }

    /// Turns the notify path on (the default) or off for connections set up from now
    /// on. Off, no COMM_EST or receive completion is forwarded with `rdma_notify`: a
    /// passive connection whose RTU is lost then waits for the CM's REP retries (or its
    /// establish deadline). For showing what the notify path prevents. O(1).
    pub fn set_notify(&mut self, on: bool) {
        self.notify = on;
    }

    /// Turns busy polling on (`Some(budget)`: a waiting call spins on its sources, and
    /// on the receive queues of the connections accepted while it is on and not yet
    /// established, for up to `budget` before it sleeps; see
    /// [`EndpointOptions::busy_poll`]) or off (`None`), from the next wait on. O(1).
    pub fn set_busy_poll(&mut self, budget: Option<Duration>) {
        self.options.busy_poll = budget;
    }

    /// The transport. O(1).
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The device readers, for a caller that waits on their descriptors itself.
    #[cfg(feature = "tokio")]
    pub(crate) fn devices(&self) -> &[T::Device] {
        &self.devices
    }

    /// One wait in the transport, at most `timeout` (`None`: until something comes),
    /// for a caller that runs the passes itself; errors as the waiting calls give them.
    pub(crate) fn wait_transport(&mut self, timeout: Option<Duration>) -> Result<(), ConnError> {
        match self.transport.wait(&self.devices, timeout) {
            Ok(_) => Ok(()),
            Err(e @ cm_core::CmError::Idle { .. }) => Err(e.into()),
            Err(e) => Err(ConnError::Endpoint(e)),
        }
    }

    /// What the notify path did so far. O(1).
    pub fn counters(&self) -> PumpCounters {
        self.pump.counters()
    }

    /// Live connections (any state; not those closed and waiting to be reported). O(1).
    pub fn connection_count(&self) -> usize {
        self.live_conns
    }

    /// Live listeners. O(1).
    pub fn listener_count(&self) -> usize {
        self.live_listeners
    }

    /// What the endpoint holds for the application, for monitoring and tests:
    /// O(devices).
    pub fn stats(&self) -> EndpointStats {
        let (shared_sends_free, srq_limit_events) = self.shared.figures();
        let (ready_qps, ready_qps_taken) = self.shared.ready_qps(&self.transport);
        EndpointStats {
            connections: self.live_conns,
            closed_unreported: self.closed_conns,
            held_messages: self.held_messages,
            endpoint_events: self.endpoint_events.len(),
            ready_entries: self.ready.len(),
            accept_entries: self.accepted.len(),
            deadline_entries: self.deadlines.len(),
            awaiting_entries: self.awaiting.len(),
            setup_entries: self.to_set_up.len(),
            ended_ids: self.ended_ids.len(),
            dropped_events: self.dropped_events,
            requests_refused: self.requests_refused,
            shared_queue_devices: self.shared.sets(),
            shared_sends_free,
            srq_limit_events,
            ready_qps,
            ready_qps_taken,
        }
    }

    /// Device contexts being read. O(1).
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Binds a listener to `addr` and listens. O(listeners) (a free listener slot is
    /// reused).
    pub fn listen(
        &mut self,
        addr: T::Addr,
        options: ListenOptions,
    ) -> Result<ListenerId, ConnError> {
        options.caps.validate()?;
        options.params.validate()?;
        options.private_data.check("REP", PrivateData::MAX_REP)?;
        options.id_options.validate()?;
        let id = self.create_id_with(&options.id_options)?;
        self.transport.bind(&id, addr)?;
        self.transport.listen(&id, options.backlog)?;
        // A listener bound to a device's address knows its device now: open its reader
        // before any request can arrive. It uses the reader until it is closed.
        // Its shared queues too: the first request does not wait for them.
        let device = self.device_for(&id)?;
        if let Some((index, key)) = device {
            self.device_use(key);
            self.prepare_shared(&id, index, &options.caps);
        }
        let device = device.map(|(_, key)| key);
        let index = match self.listeners.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.listeners.push(None);
                self.listener_generations.push(0);
                self.listeners.len() - 1
            }
        };
        let listener = ListenerId::new(index, self.listener_generations[index]);
        self.by_id
            .insert(self.transport.id_key(&id), Owner::Listener(listener));
        self.listeners[index] = Some(Listener {
            id,
            options,
            in_setup: 0,
            device,
        });
        self.live_listeners += 1;
        Ok(listener)
    }

    /// The listener's local address (its port, when bound to port 0). O(1).
    pub fn listener_addr(&self, listener: ListenerId) -> Result<Option<T::Addr>, ConnError> {
        let entry = self.listener(listener)?;
        Ok(self.transport.local_addr(&entry.id))
    }

    /// Stops listening: the listening id is destroyed, so the address is free to listen
    /// on again at once and requests to it are refused by the kernel (no one listens);
    /// a request already read for it is rejected. Connections it accepted carry on. If
    /// nothing else of the endpoint uses the listener's device, its reader is closed
    /// too, and the endpoint holds nothing of the device any more. O(1).
    pub fn close_listener(&mut self, listener: ListenerId) -> Result<(), ConnError> {
        let entry = self
            .take_listener(listener)
            .ok_or(ConnError::UnknownListener(listener))?;
        self.by_id.remove(&self.transport.id_key(&entry.id));
        // The id goes now (nothing else holds it): the kernel stops listening.
        self.transport.release_id(entry.id);
        Ok(())
    }

    /// Starts connecting to `dst`: resolves the address and the route, creates the QP,
    /// posts the receives and sends the REQ. [`Event::Established`] or
    /// [`Event::Closed`] follows. O(log n) (its deadline, if any, joins a heap).
    pub fn connect(
        &mut self,
        dst: T::Addr,
        options: ConnectOptions<T::Addr>,
    ) -> Result<ConnectionId, ConnError> {
        options.caps.validate()?;
        options.params.validate()?;
        options.private_data.check("REQ", PrivateData::MAX_REQ)?;
        options.id_options.validate()?;
        let id = self.create_id_with(&options.id_options)?;
        self.transport
            .resolve_addr(&id, options.source, dst, options.resolve_timeout)?;
        let now = self.transport.now();
        let mut entry = Conn::new(id, Role::Active, ConnState::Resolving, options.caps, now);
        entry.deadline = Nanos::new(options.timeout.map(|t| now.saturating_add(t)));
        entry.rare.set_private(options.private_data);
        entry.rare.set_params(options.params);
        entry.resolve_timeout = Micros::new(options.resolve_timeout);
        entry.application_qp = options.application_qp;
        let conn = self.insert(entry);
        trace::step(conn, "resolving the address");
        if let Some(deadline) = self.live(conn).and_then(|c| c.deadline.get()) {
            self.deadlines.push(Reverse((deadline, conn)));
        }
        Ok(conn)
    }

    /// Accepts a request reported as [`Event::Request`], with private data for the REP.
    /// O(receive depth) (its receives are posted) plus O(log n) for its deadline.
    pub fn accept_request(
        &mut self,
        conn: ConnectionId,
        private_data: &PrivateData,
    ) -> Result<(), ConnError> {
        private_data.check("REP", PrivateData::MAX_REP)?;
        let state = self.conn(conn)?.state;
        if state != ConnState::Requested {
            return Err(ConnError::WrongState {
                conn,
                what: "accept_request",
                needs: "to be a request not yet answered",
            });
        }
        if let Err(error) = self.setup_and_accept(conn, private_data.as_bytes()) {
            self.close(conn, CloseReason::SetupFailed(error.clone()), false);
            return Err(error.into());
        }
        // Requests kept arriving during the setup: read them now, as an auto-accepting
        // listener's setups do, so that they wait here and not in the kernel's backlog.
        self.read_cm_ahead();
        Ok(())
    }

    /// Rejects a request reported as [`Event::Request`] (the peer sees
    /// [`RejectReason::Consumer`] with `private_data`). O(1).
    pub fn reject_request(
        &mut self,
        conn: ConnectionId,
        private_data: &PrivateData,
    ) -> Result<(), ConnError> {
        private_data.check("REJ", PrivateData::MAX_REJ)?;
        let entry = self.conn(conn)?;
        if entry.state != ConnState::Requested {
            return Err(ConnError::WrongState {
                conn,
                what: "reject_request",
                needs: "to be a request not yet answered",
            });
        }
        let id = entry.id.clone();
        let result = self.transport.reject(&id, private_data.as_bytes());
        self.forget(conn);
        result.map_err(Into::into)
    }

    /// Disconnects (DREQ) and forgets the connection: the application closed it, so
    /// nothing more is reported of it (no [`Event::Closed`]) and its handle names
    /// nothing. On a connection that had closed already, forgets its unreported close.
    /// O(1).
    pub fn disconnect(&mut self, conn: ConnectionId) -> Result<(), ConnError> {
        if self.live(conn).is_none() && self.closed(conn).is_none() {
            return Err(ConnError::UnknownConnection(conn));
        }
        self.forget(conn);
        Ok(())
    }

    /// What the endpoint knows of `conn`. O(1). A connection that closed and whose
    /// close is not yet reported answers [`ConnError::Closed`] (nothing is consumed).
    pub fn info(&self, conn: ConnectionId) -> Result<ConnectionInfo<T::Addr>, ConnError> {
        let entry = self.conn(conn)?;
        Ok(ConnectionInfo {
            role: entry.role,
            state: entry.state,
            qp: entry.qp.get(),
            established: entry.established_via(),
            listener: entry.listener,
            local_addr: self.transport.local_addr(&entry.id),
            peer_addr: self.transport.peer_addr(&entry.id),
            times: entry.times.public(),
            sends_in_flight: entry.sends_in_flight,
            address_changes: entry.rare.address_changes(),
            traffic: entry.traffic,
        })
    }

    /// What `conn` carried ([`ConnectionInfo::traffic`]), live or closed and not yet
    /// reported (its final counts; once its close is reported the counts go with it,
    /// and the endpoint's `closed` debug event has them). O(1).
    pub fn traffic(&self, conn: ConnectionId) -> Result<Traffic, ConnError> {
        match self.live(conn) {
            Some(entry) => Ok(entry.traffic),
            None => self
                .closed(conn)
                .map(|closed| closed.traffic)
                .ok_or(ConnError::UnknownConnection(conn)),
        }
    }

    /// One step of a wait in the transport ([`Transport::wait_step`]): whether anything
    /// moved or is ready.
    pub(crate) fn wait_step(&mut self, timeout: Option<Duration>) -> Result<bool, ConnError> {
        self.transport
            .wait_step(&self.devices, timeout)
            .map_err(ConnError::Endpoint)
    }

    /// The listener a connection came to (passive side), live or closed and not yet
    /// reported. O(1).
    pub(crate) fn listener_of(&self, conn: ConnectionId) -> Option<ListenerId> {
        match self.live(conn) {
            Some(c) => c.listener,
            None => self.closed(conn).and_then(|c| c.listener),
        }
    }

    /// How `conn` got established, live or closed and not yet reported (`None`
    /// before, or if it never was). O(1).
    pub(crate) fn established_via(&self, conn: ConnectionId) -> Option<EstablishedVia> {
        match self.live(conn) {
            Some(c) => c.established_via(),
            None => self.closed(conn).and_then(|c| c.established),
        }
    }

    /// Marks `conn` as held (or no longer) by something that will ask for its close,
    /// such as a connection handle: a held connection's close is kept whatever
    /// [`CLOSED_BACKLOG`] says. O(1).
    pub(crate) fn hold(&mut self, conn: ConnectionId, held: bool) {
        if let Some(pending) = self.pending_mut(conn) {
            pending.held = held;
        }
    }

    /// The transport's own waker (`None`: its wait never blocks in real time).
    pub(crate) fn transport_waker(&mut self) -> Result<Option<std::task::Waker>, ConnError> {
        Ok(self.transport.waker()?)
    }

    /// The oldest completion of the application's one-sided work on `conn` (work
    /// requests posted with [`APPLICATION_WR_ID`] set), without waiting: `Ok(None)`
    /// when none is there. A connection keeps at most its
    /// [`QueueCaps::work_depth`] of them (past it the oldest is dropped and counted in
    /// [`EndpointStats::dropped_events`]). A failed one also closes the connection (its
    /// QP is in the error state); the completions before it, and it, are still taken
    /// here, in order, until the close is reported (they go with the connection's
    /// record). O(1).
    pub fn take_work_completion(
        &mut self,
        conn: ConnectionId,
    ) -> Result<Option<WorkCompletion>, ConnError> {
        if let Some(done) = self.work_done.get_mut(&conn) {
            let completion = done.pop_front();
            if done.is_empty() {
                self.work_done.remove(&conn);
            }
            if completion.is_some() {
                return Ok(completion);
            }
        }
        self.conn(conn).map(|_| None)
    }

    /// The CM id of `conn`, for calls this API does not wrap (on the real transport its
    /// QP and protection domain: memory of the application's own, one-sided work; its
    /// QP's attributes, `CmId::query_qp`, to see the connection parameters the kernel
    /// applied). O(1).
    pub fn cm_id(&self, conn: ConnectionId) -> Result<&T::Id, ConnError> {
        Ok(&self.conn(conn)?.id)
    }
}

/// Why a connection failed, from the CM event that says so.
fn failure_reason(kind: CmEventType, status: i32, private_data: &[u8]) -> CloseReason {
    match kind {
        CmEventType::AddrError => CloseReason::AddressError { status },
        CmEventType::RouteError => CloseReason::RouteError { status },
        CmEventType::Unreachable => CloseReason::Unreachable { status },
        CmEventType::Rejected => CloseReason::Rejected {
            reason: RejectReason::from_status(status),
            private_data: PrivateData::from(private_data),
        },
        _ => CloseReason::ConnectError { status },
    }
}
