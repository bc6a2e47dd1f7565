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

mod inputs;
mod table;
mod types;

use std::collections::VecDeque;
use std::time::Duration;

use rustc_hash::FxHashMap;

use cm_core::{CmEventType, QpNum, QueueCaps, RejectReason, Transport, WorkCompletion};

use crate::{NotifyPump, PumpCounters, Role};

pub use types::{
    CloseReason, ConnError, ConnTimes, ConnectOptions, ConnectionId, EstablishedVia, Event,
    ListenOptions, ListenerId, PrivateData, QpErrorDetail,
};

/// Completions read per `poll_cq` call.
const POLL_BATCH: usize = 32;

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConnState {
    /// Active side: resolving the address, then the route.
    Resolving,
    /// Active side: REQ sent, waiting for the REP.
    Connecting,
    /// Passive side: the request waits for the application's answer.
    Requested,
    /// Passive side: REP sent, waiting for the RTU (or a notify).
    Accepted,
    /// Established and reported.
    Established,
}

/// What the endpoint knows of one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

struct Listener<T: Transport> {
    id: T::Id,
    options: ListenOptions,
}

struct Conn<T: Transport> {
    id: T::Id,
    role: Role,
    state: ConnState,
    listener: Option<ListenerId>,
    device: Option<T::DeviceKey>,
    qp: Option<QpNum>,
    caps: QueueCaps,
    buffers: Option<T::Buffers>,
    free_send: Vec<u32>,
    deadline: Option<Duration>,
    /// What the notify path did before ESTABLISHED arrived.
    via: Option<EstablishedVia>,
    established: Option<EstablishedVia>,
    /// Messages received before the connection was reported established.
    held: Vec<Vec<u8>>,
    /// Active side: the REQ's private data and the resolution timeout, until connect.
    request: PrivateData,
    resolve_timeout: Duration,
    peer_private: PrivateData,
    times: ConnTimes,
}

impl<T: Transport> Conn<T> {
    /// A connection that has just begun, on its id, with nothing set up yet.
    fn new(id: T::Id, role: Role, state: ConnState, caps: QueueCaps, now: Duration) -> Self {
        Conn {
            times: ConnTimes {
                started: now,
                ..ConnTimes::default()
            },
            id,
            role,
            state,
            listener: None,
            device: None,
            qp: None,
            caps,
            buffers: None,
            free_send: Vec::new(),
            deadline: None,
            via: None,
            established: None,
            held: Vec::new(),
            request: PrivateData::empty(),
            resolve_timeout: Duration::ZERO,
            peer_private: PrivateData::empty(),
        }
    }
}

struct Slot<T: Transport> {
    generation: u32,
    conn: Option<Conn<T>>,
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
/// queued for [`Endpoint::next_event`]: none is lost.
///
/// Device contexts are read once each, whatever number of listeners and connections
/// share them, and every CM-bound asynchronous event is routed to the connection that
/// owns its QP. A device's asynchronous events form one stream per process, so put every
/// listener and connection on a device in one endpoint: the real backend refuses a
/// second endpoint on a device ([`cm_core::CmError::Busy`]) rather than let the two
/// split its COMM_ESTs.
pub struct Endpoint<T: Transport> {
    transport: T,
    pump: NotifyPump<T::Id>,
    device_keys: Vec<T::DeviceKey>,
    devices: Vec<T::Device>,
    listeners: Vec<Option<Listener<T>>>,
    slots: Vec<Slot<T>>,
    free_slots: Vec<u32>,
    by_id: FxHashMap<usize, Owner>,
    by_qp: FxHashMap<QpNum, ConnectionId>,
    events: VecDeque<Event>,
    completions: Vec<WorkCompletion>,
    /// When the transport asked to run its housekeeping again.
    housekeeping_due: Option<Duration>,
    /// A device reader was given back since the housekeeping last ran.
    device_released: bool,
    notify: bool,
}

impl<T: Transport> std::fmt::Debug for Endpoint<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("devices", &self.device_keys)
            .field("connections", &self.connection_count())
            .field("queued_events", &self.events.len())
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Endpoint<T> {
    /// An endpoint over `transport`, with no listener or connection yet.
    pub fn new(transport: T) -> Self {
        Endpoint {
            transport,
            pump: NotifyPump::new(),
            device_keys: Vec::new(),
            devices: Vec::new(),
            listeners: Vec::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_id: FxHashMap::default(),
            by_qp: FxHashMap::default(),
            events: VecDeque::new(),
            completions: Vec::with_capacity(POLL_BATCH),
            housekeeping_due: None,
            device_released: false,
            notify: true,
        }
    }

    /// Turns the notify path on (the default) or off for connections set up from now
    /// on. Off, no COMM_EST or receive completion is forwarded with `rdma_notify`: a
    /// passive connection whose RTU is lost then waits for the CM's REP retries (or its
    /// establish deadline). For showing what the notify path prevents.
    pub fn set_notify(&mut self, on: bool) {
        self.notify = on;
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// What the notify path did so far.
    pub fn counters(&self) -> PumpCounters {
        self.pump.counters()
    }

    /// Live connections (in any state).
    pub fn connection_count(&self) -> usize {
        self.slots.iter().filter(|s| s.conn.is_some()).count()
    }

    /// Live listeners.
    pub fn listener_count(&self) -> usize {
        self.listeners.iter().filter(|l| l.is_some()).count()
    }

    /// Device contexts being read.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Binds a listener to `addr` and listens.
    pub fn listen(
        &mut self,
        addr: T::Addr,
        options: ListenOptions,
    ) -> Result<ListenerId, ConnError> {
        options.caps.validate()?;
        options.private_data.check("REP", PrivateData::MAX_REP)?;
        let id = self.transport.create_id()?;
        self.transport.bind(&id, addr)?;
        self.transport.listen(&id, options.backlog)?;
        // A listener bound to a device's address knows its device now: open its reader
        // before any request can arrive.
        self.device_for(&id)?;
        let index = match self.listeners.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.listeners.push(None);
                self.listeners.len() - 1
            }
        };
        let listener = ListenerId(index as u32);
        self.by_id
            .insert(self.transport.id_key(&id), Owner::Listener(listener));
        self.listeners[index] = Some(Listener { id, options });
        Ok(listener)
    }

    /// The listener's local address (its port, when bound to port 0).
    pub fn listener_addr(&self, listener: ListenerId) -> Result<Option<T::Addr>, ConnError> {
        let entry = self.listener(listener)?;
        Ok(self.transport.local_addr(&entry.id))
    }

    /// Stops listening; connections it accepted carry on.
    pub fn close_listener(&mut self, listener: ListenerId) -> Result<(), ConnError> {
        let entry = self
            .listeners
            .get_mut(listener.0 as usize)
            .and_then(Option::take)
            .ok_or(ConnError::UnknownListener(listener))?;
        self.by_id.remove(&self.transport.id_key(&entry.id));
        Ok(())
    }

    /// Starts connecting to `dst`: resolves the address and the route, creates the QP,
    /// posts the receives and sends the REQ. [`Event::Established`] or
    /// [`Event::Closed`] follows.
    pub fn connect(
        &mut self,
        dst: T::Addr,
        options: ConnectOptions<T::Addr>,
    ) -> Result<ConnectionId, ConnError> {
        options.caps.validate()?;
        options.private_data.check("REQ", PrivateData::MAX_REQ)?;
        let id = self.transport.create_id()?;
        self.transport
            .resolve_addr(&id, options.source, dst, options.resolve_timeout)?;
        let now = self.transport.now();
        let mut entry = Conn::new(id, Role::Active, ConnState::Resolving, options.caps, now);
        entry.deadline = options.timeout.map(|t| now.saturating_add(t));
        entry.request = options.private_data;
        entry.resolve_timeout = options.resolve_timeout;
        let conn = self.insert(entry);
        Ok(conn)
    }

    /// Accepts a request reported as [`Event::Request`], with private data for the REP.
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
        Ok(())
    }

    /// Rejects a request reported as [`Event::Request`] (the peer sees
    /// [`RejectReason::Consumer`] with `private_data`).
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
        self.remove(conn);
        result.map_err(Into::into)
    }

    /// Sends one message (a SEND of `data`) on an established connection. The buffer
    /// is free again once its completion is read ([`ConnError::SendQueueFull`] until
    /// then).
    pub fn send(&mut self, conn: ConnectionId, data: &[u8]) -> Result<(), ConnError> {
        let (transport, entry) = self.split(conn).ok_or(ConnError::UnknownConnection(conn))?;
        if entry.state != ConnState::Established {
            return Err(ConnError::WrongState {
                conn,
                what: "send",
                needs: "established",
            });
        }
        let max = entry.caps.buffer_size as usize;
        if data.len() > max {
            return Err(ConnError::MessageTooLarge {
                len: data.len(),
                max,
            });
        }
        let Some(buffers) = entry.buffers.as_ref() else {
            return Err(ConnError::WrongState {
                conn,
                what: "send",
                needs: "buffers",
            });
        };
        let slot = entry
            .free_send
            .pop()
            .ok_or(ConnError::SendQueueFull(conn))?;
        let result = transport.post_send(&entry.id, buffers, slot, data, u64::from(slot));
        if result.is_err() {
            entry.free_send.push(slot);
        }
        result.map_err(Into::into)
    }

    /// Disconnects (DREQ) and forgets the connection; [`Event::Closed`] with
    /// [`CloseReason::Disconnected`] follows.
    pub fn disconnect(&mut self, conn: ConnectionId) -> Result<(), ConnError> {
        self.conn(conn)?;
        self.close(conn, CloseReason::Disconnected, true);
        Ok(())
    }

    /// What the endpoint knows of `conn`.
    pub fn info(&self, conn: ConnectionId) -> Result<ConnectionInfo<T::Addr>, ConnError> {
        let entry = self.conn(conn)?;
        Ok(ConnectionInfo {
            role: entry.role,
            state: entry.state,
            qp: entry.qp,
            established: entry.established,
            listener: entry.listener,
            local_addr: self.transport.local_addr(&entry.id),
            peer_addr: self.transport.peer_addr(&entry.id),
            times: entry.times,
        })
    }

    /// The CM id of `conn`, for calls this API does not wrap.
    pub fn cm_id(&self, conn: ConnectionId) -> Result<&T::Id, ConnError> {
        Ok(&self.conn(conn)?.id)
    }

    // ----- driving ---------------------------------------------------------------

    /// Handles everything ready now, without waiting, and returns the oldest queued
    /// event, if any.
    pub fn poll(&mut self) -> Result<Option<Event>, ConnError> {
        self.process()?;
        Ok(self.events.pop_front())
    }

    /// The next event, waiting at most `timeout` (`None`: as long as it takes);
    /// `Ok(None)` when the timeout passed.
    pub fn next_event(&mut self, timeout: Option<Duration>) -> Result<Option<Event>, ConnError> {
        match self.wait_for(timeout, |events| events.pop_front().map(Ok)) {
            Ok(event) => Ok(Some(event)),
            Err(ConnError::Timeout) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Waits for the next accepted connection to be established (on any listener) and
    /// returns it; its [`Event::Established`] is consumed, other events stay queued.
    /// Ends with [`ConnError::Timeout`], or [`ConnError::ListenerClosed`] when a
    /// listener ends meanwhile (its device was removed).
    pub fn accept(&mut self, timeout: Option<Duration>) -> Result<ConnectionId, ConnError> {
        self.wait_for(timeout, take_accepted)
    }

    /// Waits for `conn` to be established (after [`Endpoint::connect`] or an accept)
    /// and says how it got there. Ends with [`ConnError::Closed`] if it failed.
    pub fn established(
        &mut self,
        conn: ConnectionId,
        timeout: Option<Duration>,
    ) -> Result<EstablishedVia, ConnError> {
        if let Some(via) = self.slot(conn).and_then(|c| c.established) {
            return Ok(via);
        }
        self.wait_for(timeout, |events| take_established(events, conn))
    }

    /// Waits for the next message on `conn`; other events stay queued. Ends with
    /// [`ConnError::Closed`] if the connection closes first.
    pub fn recv(
        &mut self,
        conn: ConnectionId,
        timeout: Option<Duration>,
    ) -> Result<Vec<u8>, ConnError> {
        self.wait_for(timeout, |events| take_received(events, conn))
    }

    /// Handles everything ready, then hands the queue to `take` until it finds what it
    /// looks for, waiting in the transport in between.
    fn wait_for<R>(
        &mut self,
        timeout: Option<Duration>,
        mut take: impl FnMut(&mut VecDeque<Event>) -> Option<Result<R, ConnError>>,
    ) -> Result<R, ConnError> {
        let deadline = timeout.map(|t| self.transport.now().saturating_add(t));
        loop {
            self.process()?;
            if let Some(found) = take(&mut self.events) {
                return found;
            }
            let now = self.transport.now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(ConnError::Timeout);
            }
            let wait = [deadline, self.next_deadline()]
                .into_iter()
                .flatten()
                .min()
                .map(|d| d.saturating_sub(now));
            match self.transport.wait(&self.devices, wait) {
                Ok(_) => {}
                // The simulation: nothing can ever happen. With a deadline that is a
                // timeout; without one the wait would never end.
                Err(cm_core::CmError::Busy { .. }) if deadline.is_some() => {
                    return Err(ConnError::Timeout)
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The earliest connect/establish deadline, for a caller that waits by itself.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.slots
            .iter()
            .filter_map(|s| s.conn.as_ref())
            .filter(|c| c.state != ConnState::Established)
            .filter_map(|c| c.deadline)
            .chain(self.housekeeping_due)
            .min()
    }

    /// Handles every ready source: asynchronous events first (a COMM_EST forwarded now
    /// lets its ESTABLISHED come sooner), then completions (a receive on a connection
    /// not yet established is the other trigger), then CM events, then deadlines.
    pub fn process(&mut self) -> Result<(), ConnError> {
        for index in 0..self.devices.len() {
            while index < self.devices.len() {
                let Some(event) = self.transport.next_async_event(&mut self.devices[index])? else {
                    break;
                };
                self.on_async_event(index, event);
            }
        }
        for index in 0..self.devices.len() {
            while index < self.devices.len() {
                let Some(token) = self.transport.next_cq_event(&mut self.devices[index])? else {
                    break;
                };
                self.on_cq_event(ConnectionId(token));
            }
        }
        while let Some(event) = self.transport.next_cm_event()? {
            self.on_cm_event(event);
        }
        self.expire();
        // The clock is read only when housekeeping is pending (a read per pass shows on
        // the notify path).
        if self.device_released || self.housekeeping_due.is_some() {
            let now = self.transport.now();
            if self.device_released || self.housekeeping_due.is_some_and(|due| due <= now) {
                self.device_released = false;
                self.housekeeping_due = self
                    .transport
                    .housekeeping()
                    .map(|after| now.saturating_add(after));
            }
        }
        Ok(())
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

/// Takes the first accepted connection's ESTABLISHED, or the first listener end.
pub(crate) fn take_accepted(
    events: &mut VecDeque<Event>,
) -> Option<Result<ConnectionId, ConnError>> {
    let position = events.iter().position(|e| {
        matches!(
            e,
            Event::Established {
                role: Role::Passive,
                ..
            } | Event::ListenerClosed { .. }
        )
    })?;
    match events.remove(position)? {
        Event::Established { conn, .. } => Some(Ok(conn)),
        Event::ListenerClosed { listener, reason } => {
            Some(Err(ConnError::ListenerClosed { listener, reason }))
        }
        _ => None,
    }
}

/// Takes `conn`'s ESTABLISHED, or its end.
pub(crate) fn take_established(
    events: &mut VecDeque<Event>,
    conn: ConnectionId,
) -> Option<Result<EstablishedVia, ConnError>> {
    let position = events.iter().position(|e| match e {
        Event::Established { conn: c, .. } | Event::Closed { conn: c, .. } => *c == conn,
        _ => false,
    })?;
    match events.remove(position)? {
        Event::Established { via, .. } => Some(Ok(via)),
        Event::Closed { conn, reason } => Some(Err(ConnError::Closed { conn, reason })),
        _ => None,
    }
}

/// Takes `conn`'s next message, or its end.
pub(crate) fn take_received(
    events: &mut VecDeque<Event>,
    conn: ConnectionId,
) -> Option<Result<Vec<u8>, ConnError>> {
    let position = events.iter().position(|e| match e {
        Event::Received { conn: c, .. } | Event::Closed { conn: c, .. } => *c == conn,
        _ => false,
    })?;
    match events.remove(position)? {
        Event::Received { data, .. } => Some(Ok(data)),
        Event::Closed { conn, reason } => Some(Err(ConnError::Closed { conn, reason })),
        _ => None,
    }
}
