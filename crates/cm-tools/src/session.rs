//! The server and the client of `cmnotify`, written once on the connection API and run
//! on either transport: one [`Endpoint`] owns the CM channel, the device readers, the
//! notify path and every connection, and a [`Session`] is the application's answer to
//! each event it yields. The real mode drives it with [`Session::drive`] (blocking, with
//! deadlines); the simulated mode puts a server and a client on one fabric and drives
//! both with [`Session::handle_ready`], never waiting.
//!
//! - Server: listens on [`Plan::addr`], accepts [`Plan::connections`] connections
//!   (refuses any beyond), one QP each, receives posted before the REP. The endpoint
//!   forwards COMM_EST and a receive completing on a connection not yet established
//!   with `rdma_notify` (unless [`Plan::notify`] is off). With no messages of its own it
//!   echoes every message it receives and lets the client disconnect; with N it sends N
//!   once a connection is established, waits for N back (and its own to complete), then
//!   disconnects.
//! - Client: opens every connection at once, each sending [`Plan::messages`] messages
//!   once established; once they are sent and as many have come back it disconnects.
//!   An address resolution that fails is retried on a new connection.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use cm_core::{AsyncEventType, CmError, QpNum, QueueCaps, Transport};
use cm_verbs::{
    CloseReason, ConnError, ConnTimes, ConnectOptions, ConnectionId, Endpoint, EstablishedVia,
    Event, ListenOptions, PrivateData, Trigger,
};

use crate::steps::{Span, Step, StepTotals};

/// How long an established connection may go without progress (a message, a send
/// completing, its end) before [`Session::drive`] gives it up and disconnects; also how
/// long a server that has had a request waits for the next event before it gives up on
/// the connections that never came. A peer that vanished without a DREQ cannot hang a
/// run.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Receives posted per connection (the QP's receive queue depth).
pub const RECEIVE_SLOTS: u32 = 16;
/// Send buffers per connection (the QP's send queue depth).
pub const SEND_SLOTS: u32 = 16;
/// The smallest receive buffer: large enough for rping's and ucmatose's default
/// messages whatever the run sends.
pub const MIN_RECEIVE_SIZE: usize = 512;

/// The queues of every connection of a run sending `message_size`-byte messages.
pub fn queue_caps(message_size: usize) -> QueueCaps {
    QueueCaps {
        recv_depth: RECEIVE_SLOTS,
        send_depth: SEND_SLOTS,
        buffer_size: u32::try_from(message_size.max(MIN_RECEIVE_SIZE)).unwrap_or(u32::MAX),
        work_depth: 0,
    }
}

/// What one side of a run does, whatever the transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan<A> {
    /// Passive side (listen and accept) instead of the client.
    pub server: bool,
    /// Server: the address to listen on. Client: the server's address.
    pub addr: A,
    /// Client: the address to resolve from (`None`: the routing decides).
    pub source: Option<A>,
    /// Connections to open (client) or accept (server).
    pub connections: u32,
    /// Whether the endpoint's notify path runs ([`Endpoint::set_notify`]).
    pub notify: bool,
    /// Messages this side sends first on each connection once it is established (0 on
    /// a server: it echoes what it receives).
    pub messages: u32,
    /// Bytes per message sent first (echoes copy what they received).
    pub message_size: usize,
    /// Queues and buffers of every connection.
    pub caps: QueueCaps,
    /// Address and route resolution timeout, each.
    pub resolve_timeout: Duration,
    /// Address resolution attempts per connection (a failed one is retried on a new
    /// connection).
    pub resolve_attempts: u32,
    /// How long a connection may take from connect or accept to established before the
    /// endpoint closes it as timed out (`None`: the CM's own retries decide).
    pub establish_timeout: Option<Duration>,
    /// Whether the side that initiates the end disconnects as soon as its exchange is
    /// done; if not, connections stay up until [`Session::close_all`].
    pub disconnect_when_done: bool,
}

/// One connection as the run sees it (a retried address resolution keeps its slot).
/// Compact, a run may hold a million (64 bytes): the steps' timings are summed up on
/// the session ([`Session::step_totals`]) rather than kept here, what is rare (a
/// failure, a close for another reason than the usual two, echoes waiting for a
/// buffer, an unusual way of getting established, a setup slower than four seconds)
/// is boxed, and small values take the bytes they need.
#[derive(Debug, Clone, PartialEq)]
pub struct ConnRecord {
    /// The endpoint's handle of the current attempt (`None`: connect failed at once).
    pub handle: Option<ConnectionId>,
    /// Its QP number once known ([`NO_QP`]: not yet).
    qp: u32,
    /// Address resolution attempts so far.
    pub attempts: u32,
    /// Messages posted.
    pub sends_posted: u32,
    /// Sends reported complete ([`Event::Sent`]'s counts).
    pub sends_done: u32,
    /// Messages received.
    pub received: u32,
    /// What the caller of [`Session::handle_ready`] tagged it with (`u32::MAX`: nothing).
    tag: u32,
    /// How long its [`Step::Established`] took, in nanoseconds (`u32::MAX`: not timed;
    /// [`FAR`]: longer, in `rare`).
    established_in: u32,
    /// When its exchange began, in nanoseconds (`u64::MAX`: not yet).
    exchange_start: u64,
    /// When it is given up if nothing happens (set once established), in nanoseconds
    /// (`u64::MAX`: not set).
    idle_deadline: u64,
    /// What few connections have: a failure, an unusual close, echoes waiting.
    rare: Option<Box<Rare>>,
    /// How it became established (the first report), as a [`Via`] code.
    established: u8,
    /// [`Event::Established`] reports received, saturating (exactly one for an
    /// established connection).
    established_reports: u8,
    /// How it ended: the two usual reasons here, any other in `rare`.
    closed: Closed,
    /// [`Flag`]s.
    flags: u8,
}

/// A [`ConnRecord`]'s QP number before it is known (QP numbers are 24-bit).
const NO_QP: u32 = u32::MAX;
/// A [`ConnRecord::established_in`] kept in `rare` (four seconds or more).
const FAR: u32 = u32::MAX - 1;

/// The bits of [`ConnRecord::flags`].
#[derive(Debug, Clone, Copy)]
enum Flag {
    /// Its exchange completed.
    Exchanged = 1,
    /// It has its entry in the session's idle heap.
    IdleQueued = 2,
    /// This side called disconnect on it.
    DisconnectCalled = 4,
}

/// How a connection became established, in a byte: the usual ways have a code, any
/// other is kept whole in [`Rare::established`].
struct Via;

impl Via {
    const NONE: u8 = 0;
    const OTHER: u8 = u8::MAX;
    const USUAL: [EstablishedVia; 5] = [
        EstablishedVia::Handshake,
        EstablishedVia::Notify(Trigger::AsyncEvent(AsyncEventType::CommEst)),
        EstablishedVia::Notify(Trigger::ReceiveCompletion),
        EstablishedVia::RtuWonRace(Trigger::AsyncEvent(AsyncEventType::CommEst)),
        EstablishedVia::RtuWonRace(Trigger::ReceiveCompletion),
    ];

    fn code(via: EstablishedVia) -> u8 {
        Self::USUAL
            .iter()
            .position(|usual| *usual == via)
            .map_or(Self::OTHER, |index| index as u8 + 1)
    }
}

/// How a connection ended, in a byte: nearly all end disconnected or timed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closed {
    Open,
    Disconnected,
    TimedOut,
    /// The reason is in [`Rare::closed`].
    Other,
}

/// The part of a [`ConnRecord`] few connections need.
#[derive(Debug, Clone, PartialEq, Default)]
struct Rare {
    /// Why it failed, one line.
    failure: Option<String>,
    /// How it ended, for a reason other than the usual two.
    closed: Option<CloseReason>,
    /// Echoes waiting for a free send buffer.
    pending: VecDeque<Vec<u8>>,
    /// How it became established, when no [`Via`] code says it.
    established: Option<EstablishedVia>,
    /// How long its [`Step::Established`] took, in nanoseconds, when it did not fit.
    established_in: Option<u64>,
}

/// An unset instant or duration of a [`ConnRecord`].
const UNSET: u64 = u64::MAX;

/// `at` in nanoseconds, short of [`UNSET`].
fn nanos(at: Duration) -> u64 {
    u64::try_from(at.as_nanos()).map_or(UNSET - 1, |n| n.min(UNSET - 1))
}

impl ConnRecord {
    fn new(handle: Option<ConnectionId>, attempts: u32) -> Self {
        ConnRecord {
            handle,
            qp: NO_QP,
            attempts,
            sends_posted: 0,
            sends_done: 0,
            received: 0,
            tag: u32::MAX,
            established_in: u32::MAX,
            exchange_start: UNSET,
            idle_deadline: UNSET,
            rare: None,
            established: Via::NONE,
            established_reports: 0,
            closed: Closed::Open,
            flags: 0,
        }
    }

    /// Its QP, once known.
    pub fn qp(&self) -> Option<QpNum> {
        (self.qp != NO_QP).then_some(QpNum(self.qp))
    }

    fn set_qp(&mut self, qp: Option<QpNum>) {
        self.qp = qp.map_or(NO_QP, |qp| qp.0);
    }

    /// How it became established (the first report).
    pub fn established(&self) -> Option<EstablishedVia> {
        match self.established {
            Via::NONE => None,
            Via::OTHER => self.rare.as_ref().and_then(|r| r.established),
            code => Via::USUAL.get(usize::from(code) - 1).copied(),
        }
    }

    fn set_established(&mut self, via: EstablishedVia) {
        self.established = Via::code(via);
        if self.established == Via::OTHER {
            self.rare.get_or_insert_default().established = Some(via);
        }
    }

    /// [`Event::Established`] reports received (exactly one for an established
    /// connection; counted up to 255).
    pub fn established_reports(&self) -> u32 {
        u32::from(self.established_reports)
    }

    fn flag(&self, flag: Flag) -> bool {
        self.flags & flag as u8 != 0
    }

    fn set_flag(&mut self, flag: Flag, on: bool) {
        if on {
            self.flags |= flag as u8;
        } else {
            self.flags &= !(flag as u8);
        }
    }

    /// Whether it ended.
    pub fn is_done(&self) -> bool {
        self.closed != Closed::Open
    }

    /// How it ended, once it did (for a connection this side closed: the reason it
    /// closed it with).
    pub fn closed(&self) -> Option<CloseReason> {
        match self.closed {
            Closed::Open => None,
            Closed::Disconnected => Some(CloseReason::Disconnected),
            Closed::TimedOut => Some(CloseReason::TimedOut),
            Closed::Other => self.rare.as_ref().and_then(|r| r.closed.clone()),
        }
    }

    /// Why it failed, one line.
    pub fn failure(&self) -> Option<&str> {
        self.rare.as_ref()?.failure.as_deref()
    }

    /// How long its [`Step::Established`] took (from the return of the connect or
    /// accept call to established), once it is.
    pub fn established_in(&self) -> Option<Duration> {
        match self.established_in {
            u32::MAX => None,
            FAR => self
                .rare
                .as_ref()
                .and_then(|r| r.established_in)
                .map(Duration::from_nanos),
            nanos => Some(Duration::from_nanos(u64::from(nanos))),
        }
    }

    fn set_established_in(&mut self, nanos: u64) {
        match u32::try_from(nanos).ok().filter(|&n| n < FAR) {
            Some(near) => self.established_in = near,
            None => {
                self.established_in = FAR;
                self.rare.get_or_insert_default().established_in = Some(nanos);
            }
        }
    }

    /// What [`Session::handle_ready`]'s caller tagged it with.
    pub fn tag(&self) -> Option<u32> {
        (self.tag != u32::MAX).then_some(self.tag)
    }

    fn set_failure(&mut self, why: String) {
        self.rare.get_or_insert_default().failure = Some(why);
    }

    fn pending_is_empty(&self) -> bool {
        self.rare.as_ref().is_none_or(|r| r.pending.is_empty())
    }

    fn queue_echo(&mut self, data: Vec<u8>) {
        self.rare.get_or_insert_default().pending.push_back(data);
    }
}

/// The steps of one connection's setup as the endpoint timed them: each step's span,
/// when both ends are known.
fn setup_spans(times: &ConnTimes) -> [(Step, Option<Duration>, Option<Duration>); 5] {
    [
        (Step::ResolveAddr, Some(times.started), times.addr_resolved),
        (
            Step::ResolveRoute,
            times.addr_resolved,
            times.route_resolved,
        ),
        (Step::CreateQp, times.create_qp_called, times.qp_created),
        (Step::Connect, times.connect_called, times.connect_returned),
        (Step::Established, times.connect_returned, times.established),
    ]
}

/// One side of a run: the endpoint and what the application knows of its connections.
pub struct Session<T: Transport> {
    plan: Plan<T::Addr>,
    endpoint: Endpoint<T>,
    conns: Vec<ConnRecord>,
    /// Per handle slot ([`ConnectionId::slot`]), the record of the connection holding
    /// it, plus one (0: none): a dense table, as slots are reused and stay below the
    /// most connections held at once. The record's handle confirms a hit.
    by_handle: Vec<u32>,
    /// Each step summed over every connection that passed it.
    steps: [StepTotals; Step::ALL.len()],
    /// The first connection's steps, each as it began and ended (for its timeline).
    first: [Span; Step::ALL.len()],
    resolve_retries: u32,
    local: Option<T::Addr>,
    remote: Option<T::Addr>,
    /// Set when the device went away or failed: the run stops.
    aborted: Option<String>,
    /// Set when nothing happened for too long: the run stops, what is left failed.
    gave_up: bool,
    /// When the last event arrived.
    last_event: Duration,
    /// Connections established or ended without being established.
    settled: usize,
    /// Connections ended (records with `closed` set).
    closed: usize,
    /// Idle deadlines, at most one entry per open connection: an entry earlier than
    /// its connection's deadline is put back with the later one when it comes up, so
    /// the earliest deadline is found without walking the connections.
    /// Deadlines and indexes compact (nanoseconds, `u32`): an entry per connection.
    /// Filled only once [`Session::drive`] runs: nothing else reads it.
    idle: BinaryHeap<Reverse<(u64, u32)>>,
    /// Whether `idle` is kept (since [`Session::drive`] first ran).
    idle_kept: bool,
}

impl<T: Transport> std::fmt::Debug for Session<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("server", &self.plan.server)
            .field("connections", &self.conns.len())
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> Session<T> {
    /// A session on `endpoint` (its notify path set as the plan says); nothing starts
    /// before [`Session::start`].
    pub fn new(mut endpoint: Endpoint<T>, plan: Plan<T::Addr>) -> Self {
        endpoint.set_notify(plan.notify);
        Session {
            conns: Vec::with_capacity(usize::try_from(plan.connections).unwrap_or(0)),
            plan,
            endpoint,
            by_handle: Vec::new(),
            steps: [StepTotals::default(); Step::ALL.len()],
            first: [Span::default(); Step::ALL.len()],
            resolve_retries: 0,
            local: None,
            remote: None,
            aborted: None,
            gave_up: false,
            last_event: Duration::ZERO,
            settled: 0,
            closed: 0,
            idle: BinaryHeap::new(),
            idle_kept: false,
        }
    }

    /// Listens (server) or starts every connection (client). An error is what stops
    /// the run before it starts: the listen address unusable.
    pub fn start(&mut self) -> Result<(), CmError> {
        if self.plan.server {
            self.listen()
        } else {
            for index in 0..self.wanted() {
                self.connect(index, 1);
            }
            Ok(())
        }
    }

    /// The plan.
    pub fn plan(&self) -> &Plan<T::Addr> {
        &self.plan
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &Endpoint<T> {
        &self.endpoint
    }

    /// Every connection, in the order they were started (client) or requested (server).
    pub fn conns(&self) -> &[ConnRecord] {
        &self.conns
    }

    /// The records of the connections, ending the session: its endpoint, and all the
    /// endpoint holds, are dropped.
    pub fn into_conns(self) -> Vec<ConnRecord> {
        self.conns
    }

    /// `step` summed over every connection that passed it.
    pub fn step_totals(&self, step: Step) -> StepTotals {
        self.steps[step.index()]
    }

    /// When the first connection ([`Session::conns`]' first) began and ended `step`.
    pub fn first_span(&self, step: Step) -> Span {
        self.first[step.index()]
    }

    /// Connections established or ended without being established so far.
    pub fn settled(&self) -> usize {
        self.settled
    }

    /// Address resolutions retried after ADDR_ERROR.
    pub fn resolve_retries(&self) -> u32 {
        self.resolve_retries
    }

    /// The local address (server: listening; client: of the first established
    /// connection).
    pub fn local(&self) -> Option<T::Addr> {
        self.local
    }

    /// The peer's address (server: of the first request).
    pub fn remote(&self) -> Option<T::Addr> {
        self.remote
    }

    /// Why the run stopped early (the device went away or failed).
    pub fn aborted(&self) -> Option<&str> {
        self.aborted.as_deref()
    }

    /// The transport's clock.
    pub fn now(&self) -> Duration {
        self.endpoint.transport().now()
    }

    fn wanted(&self) -> usize {
        usize::try_from(self.plan.connections).unwrap_or(usize::MAX)
    }

    fn listen(&mut self) -> Result<(), CmError> {
        let options = ListenOptions {
            backlog: u16::try_from(self.plan.connections.min(1024)).unwrap_or(1024),
            caps: self.plan.caps,
            // Each request is answered here: the ones beyond the plan are refused.
            auto_accept: false,
            private_data: PrivateData::empty(),
            establish_timeout: self.plan.establish_timeout,
            // Answered as they come; the run's own deadlines judge the rest.
            request_timeout: None,
            // Every connection of the plan may be in setup at once (the client starts
            // them together, as cmtime does); a real server keeps the default bound.
            max_in_setup: self.plan.connections.max(1),
        };
        let listener = self
            .endpoint
            .listen(self.plan.addr, options)
            .map_err(cm_error)?;
        self.local = self.endpoint.listener_addr(listener).map_err(cm_error)?;
        Ok(())
    }

    /// Starts (or, for a retried resolution, restarts) client connection `index`.
    fn connect(&mut self, index: usize, attempt: u32) {
        let options = ConnectOptions {
            source: self.plan.source,
            caps: self.plan.caps,
            private_data: PrivateData::empty(),
            resolve_timeout: self.plan.resolve_timeout,
            timeout: self.plan.establish_timeout,
        };
        let conn = match self.endpoint.connect(self.plan.addr, options) {
            Ok(handle) => {
                self.map_handle(handle, index);
                ConnRecord::new(Some(handle), attempt)
            }
            Err(error) => {
                // No handle: nothing will be reported for it.
                let mut conn = ConnRecord::new(None, attempt);
                conn.set_failure(format!("connection {index}: connect: {error}"));
                conn.closed = Closed::Disconnected;
                self.settled += 1;
                self.closed += 1;
                conn
            }
        };
        if index == 0 {
            self.first = [Span::default(); Step::ALL.len()];
        }
        if index < self.conns.len() {
            self.conns[index] = conn;
        } else {
            self.conns.push(conn);
        }
    }

    /// Whether the run is over: stopped, given up, or every connection ended.
    pub fn finished(&self) -> bool {
        self.aborted.is_some()
            || self.gave_up
            || (self.conns.len() >= self.wanted() && self.closed == self.conns.len())
    }

    /// The earliest time the run must look again without an event: an established
    /// connection's idle deadline, or, once any connection exists (a server's first
    /// request), the end of the run's patience without any event.
    fn next_deadline(&mut self) -> Option<Duration> {
        let overall =
            (!self.conns.is_empty()).then(|| self.last_event.saturating_add(IDLE_TIMEOUT));
        self.next_idle().into_iter().chain(overall).min()
    }

    /// The earliest idle deadline of an open connection (it is the heap's top); stale
    /// heap entries are dropped or moved to their connection's later deadline on the
    /// way (amortised O(log n)).
    fn next_idle(&mut self) -> Option<Duration> {
        while let Some(&Reverse((at, index))) = self.idle.peek() {
            let conn = &mut self.conns[index as usize];
            match conn.idle_deadline {
                deadline if deadline != UNSET && !conn.is_done() && deadline > at => {
                    self.idle.pop();
                    self.idle.push(Reverse((deadline, index)));
                }
                deadline if deadline != UNSET && !conn.is_done() => {
                    return Some(Duration::from_nanos(at))
                }
                _ => {
                    conn.set_flag(Flag::IdleQueued, false);
                    self.idle.pop();
                }
            }
        }
        None
    }

    /// Runs to the end, waiting in the endpoint for each event (and giving up on what
    /// makes no progress for [`IDLE_TIMEOUT`]).
    pub fn drive(&mut self) -> Result<(), ConnError> {
        self.keep_idle();
        while !self.finished() {
            let timeout = self
                .next_deadline()
                .map(|deadline| deadline.saturating_sub(self.now()));
            match self.endpoint.next_event(timeout) {
                Ok(event) => {
                    self.last_event = self.now();
                    self.on_event(event);
                }
                Err(ConnError::Timeout) => self.expire(),
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Handles every event ready now, without waiting, showing each to `inspect` (with
    /// the endpoint, while the connection it names is still live) before answering it.
    /// A tag `inspect` returns for an event naming a connection is kept on its record
    /// once the event is answered ([`ConnRecord::tag`]; the latest counts). Returns how
    /// many events there were.
    pub fn handle_ready(
        &mut self,
        inspect: &mut dyn FnMut(&Endpoint<T>, &Event) -> Option<u32>,
    ) -> Result<usize, ConnError> {
        let mut handled = 0;
        while let Some(event) = self.endpoint.poll()? {
            let tagged = inspect(&self.endpoint, &event).zip(event.conn());
            self.on_event(event);
            if let Some((tag, index)) =
                tagged.and_then(|(tag, conn)| Some((tag, self.index(conn)?)))
            {
                self.conns[index].tag = tag;
            }
            handled += 1;
        }
        Ok(handled)
    }

    /// Disconnects every connection still open, as the end of the run (not a failure
    /// for an established one).
    pub fn close_all(&mut self) {
        for index in 0..self.conns.len() {
            let conn = &mut self.conns[index];
            if conn.is_done() {
                continue;
            }
            if conn.established().is_none() {
                conn.set_failure(format!(
                    "connection {index}: still not established when the run ended"
                ));
            }
            self.disconnect(index);
        }
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Request { conn, .. } => self.on_request(conn),
            Event::Established { conn, via, .. } => self.on_established(conn, via),
            Event::Sent { conn, completed } => {
                if let Some(index) = self.index(conn) {
                    self.conns[index].sends_done += completed;
                    self.progress(index);
                    self.flush_echoes(index);
                    self.check_exchange_done(index);
                }
            }
            Event::Received { conn, data } => self.on_received(conn, data),
            Event::Closed { conn, reason } => self.on_closed(conn, reason),
            Event::ListenerClosed { reason, .. } => {
                let addr = self.local_text();
                self.abort(format!(
                    "the listener on {addr} closed: {}",
                    describe(&reason)
                ));
            }
            // Port and GID changes need no answer here (the notify path counts them as
            // passed through); a fatal device error ends the run.
            Event::Device(event) => {
                if event.event_type == AsyncEventType::DeviceFatal && self.aborted.is_none() {
                    let addr = self.local_text();
                    self.abort(format!(
                        "the RDMA device under {addr} reported a fatal error"
                    ));
                }
            }
            Event::DeviceFailed { error } => {
                if self.aborted.is_none() {
                    let addr = self.local_text();
                    self.abort(format!(
                        "reading the RDMA device under {addr} failed: {error}"
                    ));
                }
            }
            Event::NotifyFailed { conn, qp, error } => {
                log_line(&format!("{conn} ({qp}): notify refused: {error}"));
            }
            Event::AcceptFailed { error, .. } => {
                log_line(&format!(
                    "a request was rejected, its setup failed: {error}"
                ));
            }
            // Events added to the API later: named in the log, not acted on.
            other => log_line(&format!("not handled: {other:?}")),
        }
    }

    fn local_text(&self) -> String {
        self.local.map_or_else(|| "-".into(), |a| format!("{a:?}"))
    }

    fn index(&self, conn: ConnectionId) -> Option<usize> {
        let index = (*self.by_handle.get(conn.slot())?).checked_sub(1)? as usize;
        (self.conns.get(index)?.handle == Some(conn)).then_some(index)
    }

    /// Events for `handle` go to record `index` from now on.
    fn map_handle(&mut self, handle: ConnectionId, index: usize) {
        let slot = handle.slot();
        if slot >= self.by_handle.len() {
            self.by_handle.resize(slot + 1, 0);
        }
        self.by_handle[slot] = u32::try_from(index + 1).expect("fewer than 2^32 connections");
    }

    /// Events for `handle` are ignored from now on; its record, if any.
    fn unmap_handle(&mut self, handle: ConnectionId) -> Option<usize> {
        let index = self.index(handle)?;
        self.by_handle[handle.slot()] = 0;
        Some(index)
    }

    /// Counts `step` of connection `index`, from `start` to `end`.
    fn step_done(&mut self, index: usize, step: Step, start: Duration, end: Duration) {
        self.steps[step.index()].add(start, end);
        if index == 0 {
            self.first[step.index()] = Span::between(Some(start), Some(end));
        }
    }

    fn on_request(&mut self, handle: ConnectionId) {
        if self.conns.len() >= self.wanted() || self.aborted.is_some() {
            // Beyond the plan: refused.
            if let Err(error) = self.endpoint.reject_request(handle, &PrivateData::empty()) {
                log_line(&format!("refusing a request beyond -c: {error}"));
            }
            return;
        }
        let index = self.conns.len();
        self.conns.push(ConnRecord::new(Some(handle), 1));
        self.map_handle(handle, index);
        if self.remote.is_none() {
            self.remote = self
                .endpoint
                .info(handle)
                .ok()
                .and_then(|info| info.peer_addr);
        }
        match self.endpoint.accept_request(handle, &PrivateData::empty()) {
            Ok(()) => {
                let qp = self.endpoint.info(handle).ok().and_then(|i| i.qp);
                self.conns[index].set_qp(qp);
            }
            // Its Closed (SetupFailed) follows.
            Err(error) => {
                self.conns[index].set_failure(format!("connection {index}: accept: {error}"));
            }
        }
    }

    fn on_established(&mut self, handle: ConnectionId, via: EstablishedVia) {
        let Some(index) = self.index(handle) else {
            return;
        };
        let info = self.endpoint.info(handle).ok();
        if self.local.is_none() {
            self.local = info.as_ref().and_then(|i| i.local_addr);
        }
        let now = self.now();
        let conn = &mut self.conns[index];
        conn.established_reports = conn.established_reports.saturating_add(1);
        if conn.established().is_some() {
            // Reported twice: counted (the exactly-once check sees it), answered once.
            return;
        }
        conn.set_established(via);
        self.settled += 1;
        if let Some(info) = &info {
            if conn.qp().is_none() {
                conn.set_qp(info.qp);
            }
            for (step, start, end) in setup_spans(&info.times) {
                if let (Some(start), Some(end)) = (start, end) {
                    if step == Step::Established {
                        self.conns[index].set_established_in(nanos(end.saturating_sub(start)));
                    }
                    self.step_done(index, step, start, end);
                }
            }
        }
        let messages = self.plan.messages;
        if messages > 0 {
            self.conns[index].exchange_start = nanos(now);
            if index == 0 {
                self.first[Step::Exchange.index()].begin(now);
            }
            let size = self.plan.message_size;
            for seq in 0..messages {
                let mut payload =
                    format!("cmnotify connection {index} message {seq}\0").into_bytes();
                payload.resize(size, 0);
                match self.endpoint.send(handle, &payload) {
                    Ok(()) => {}
                    // Closed meanwhile: its Closed follows (an incomplete exchange).
                    Err(ConnError::UnknownConnection(_)) => return,
                    Err(error) => return self.give_up(index, format!("send {seq}: {error}")),
                }
                self.conns[index].sends_posted += 1;
            }
        }
        self.progress(index);
        self.check_exchange_done(index);
    }

    fn on_received(&mut self, handle: ConnectionId, data: Vec<u8>) {
        let Some(index) = self.index(handle) else {
            return;
        };
        self.conns[index].received += 1;
        self.progress(index);
        // Also retried here: a send buffer freed without its own Sent event.
        self.flush_echoes(index);
        if self.plan.server && self.plan.messages == 0 {
            if self.conns[index].pending_is_empty() {
                // The usual case: a free buffer, nothing queued (a queue allocates).
                self.echo(index, data);
            } else {
                self.conns[index].queue_echo(data);
            }
        }
        self.check_exchange_done(index);
    }

    /// Sends `data` back, or queues it until a send buffer is free.
    fn echo(&mut self, index: usize, data: Vec<u8>) {
        let Some(handle) = self.conns[index].handle else {
            return;
        };
        match self.endpoint.send(handle, &data) {
            Ok(()) => self.conns[index].sends_posted += 1,
            Err(ConnError::SendQueueFull(_)) => self.conns[index].queue_echo(data),
            // A connection closed meanwhile has its Closed queued.
            Err(ConnError::UnknownConnection(_)) => {}
            Err(error) => self.give_up(index, format!("echo: {error}")),
        }
    }

    /// Sends the echoes waiting for a buffer, until the send queue is full (a later
    /// event on the connection retries).
    fn flush_echoes(&mut self, index: usize) {
        let Some(handle) = self.conns[index].handle else {
            return;
        };
        while let Some(data) = self.conns[index]
            .rare
            .as_ref()
            .and_then(|r| r.pending.front())
        {
            match self.endpoint.send(handle, data) {
                Ok(()) => {
                    let conn = &mut self.conns[index];
                    conn.rare.as_mut().and_then(|r| r.pending.pop_front());
                    conn.sends_posted += 1;
                }
                // A later Sent frees a buffer; a connection closed meanwhile has its
                // Closed queued.
                Err(ConnError::SendQueueFull(_) | ConnError::UnknownConnection(_)) => return,
                Err(error) => return self.give_up(index, format!("echo: {error}")),
            }
        }
        // Drained: its memory goes too (a run may hold a million records).
        if let Some(rare) = &mut self.conns[index].rare {
            rare.pending = VecDeque::new();
            if rare.failure.is_none() && rare.closed.is_none() {
                self.conns[index].rare = None;
            }
        }
    }

    /// Notes the end of the exchange (this side's messages sent and as many received)
    /// and then, when the plan says so, disconnects if this side initiates: a client
    /// always, a server when it sends first. A side with no messages is done once
    /// established.
    fn check_exchange_done(&mut self, index: usize) {
        let messages = self.plan.messages;
        let initiates = !self.plan.server || messages > 0;
        let now = self.now();
        let conn = &mut self.conns[index];
        if conn.established().is_none() || conn.sends_done < messages || conn.received < messages {
            return;
        }
        if messages > 0 && !conn.flag(Flag::Exchanged) && conn.exchange_start != UNSET {
            conn.set_flag(Flag::Exchanged, true);
            let start = Duration::from_nanos(conn.exchange_start);
            self.step_done(index, Step::Exchange, start, now);
        }
        let conn = &self.conns[index];
        if initiates && self.plan.disconnect_when_done && !conn.flag(Flag::DisconnectCalled) {
            self.disconnect(index);
        }
    }

    /// Disconnects connection `index` and counts it closed at once (whether or not the
    /// endpoint then reports its end).
    fn disconnect(&mut self, index: usize) {
        let conn = &self.conns[index];
        if conn.is_done() || conn.flag(Flag::DisconnectCalled) {
            return;
        }
        let Some(handle) = conn.handle else {
            return;
        };
        let began = self.now();
        match self.endpoint.disconnect(handle) {
            Ok(()) => {}
            // The peer disconnected first, in the same batch: its Closed follows.
            Err(ConnError::UnknownConnection(_)) => return,
            Err(error) => {
                self.conns[index].set_failure(format!("connection {index}: disconnect: {error}"));
                return;
            }
        }
        self.conns[index].set_flag(Flag::DisconnectCalled, true);
        self.unmap_handle(handle);
        let now = self.now();
        // Closed right after the call: the step is the call itself.
        self.step_done(index, Step::Disconnect, began, now);
        self.close(index, CloseReason::Disconnected);
    }

    /// Whether the connection's exchange is complete (always, with no messages).
    fn exchanged(&self, conn: &ConnRecord) -> bool {
        self.plan.messages == 0 || conn.flag(Flag::Exchanged)
    }

    fn on_closed(&mut self, handle: ConnectionId, reason: CloseReason) {
        let Some(index) = self.unmap_handle(handle) else {
            return;
        };
        // An address resolution that failed is retried on a new connection.
        let attempts = self.conns[index].attempts;
        if let CloseReason::AddressError { status } = reason {
            if !self.plan.server && attempts < self.plan.resolve_attempts {
                let attempt = attempts + 1;
                let of = self.plan.resolve_attempts;
                self.resolve_retries += 1;
                log_line(&format!(
                    "connection {index}: ADDR_ERROR (status {status}), attempt {attempt} of {of}"
                ));
                self.connect(index, attempt);
                return;
            }
        }
        if matches!(
            reason,
            CloseReason::DeviceRemoved | CloseReason::DeviceFatal
        ) && self.aborted.is_none()
        {
            let what = if reason == CloseReason::DeviceRemoved {
                "was removed"
            } else {
                "reported a fatal error"
            };
            let addr = self.local_text();
            self.abort(format!("the RDMA device under {addr} {what}"));
        }
        let conn = &mut self.conns[index];
        if conn.failure().is_none() {
            let why = match &reason {
                CloseReason::Disconnected if conn.established().is_none() => {
                    Some("disconnected before it was established".into())
                }
                CloseReason::Disconnected => None,
                other => Some(describe(other)),
            };
            if let Some(why) = why {
                conn.set_failure(format!("connection {index}: {why}"));
            }
        }
        self.close(index, reason);
        let conn = &self.conns[index];
        if conn.established().is_some() && conn.failure().is_none() && !self.exchanged(conn) {
            let messages = self.plan.messages;
            let why = format!(
                "connection {index}: disconnected before the exchange completed (sent {}/{messages}, received {}/{messages})",
                conn.sends_done, conn.received
            );
            self.conns[index].set_failure(why);
        }
    }

    /// Records the end of connection `index` (the first one counts).
    fn close(&mut self, index: usize, reason: CloseReason) {
        let conn = &mut self.conns[index];
        if conn.is_done() {
            return;
        }
        if conn.established().is_none() {
            self.settled += 1;
        }
        conn.closed = match reason {
            CloseReason::Disconnected => Closed::Disconnected,
            CloseReason::TimedOut => Closed::TimedOut,
            other => {
                conn.rare.get_or_insert_default().closed = Some(other);
                Closed::Other
            }
        };
        self.closed += 1;
    }

    /// Something happened on an established connection: its idle deadline moves.
    fn progress(&mut self, index: usize) {
        let deadline = nanos(self.now().saturating_add(IDLE_TIMEOUT));
        let conn = &mut self.conns[index];
        conn.idle_deadline = deadline;
        if self.idle_kept && !conn.flag(Flag::IdleQueued) {
            conn.set_flag(Flag::IdleQueued, true);
            self.idle.push(Reverse((deadline, index as u32)));
        }
    }

    /// Starts keeping the idle heap: every open connection with a deadline joins it.
    fn keep_idle(&mut self) {
        if self.idle_kept {
            return;
        }
        self.idle_kept = true;
        for (index, conn) in self.conns.iter_mut().enumerate() {
            if conn.idle_deadline != UNSET && !conn.is_done() && !conn.flag(Flag::IdleQueued) {
                conn.set_flag(Flag::IdleQueued, true);
                self.idle.push(Reverse((conn.idle_deadline, index as u32)));
            }
        }
    }

    /// A deadline of the run passed with no event.
    fn expire(&mut self) {
        let now = self.now();
        while self.next_idle().is_some_and(|at| at <= now) {
            let Some(Reverse((_, index))) = self.idle.pop() else {
                break;
            };
            let index = index as usize;
            self.conns[index].set_flag(Flag::IdleQueued, false);
            let conn = &self.conns[index];
            let messages = self.plan.messages;
            let why = format!(
                "nothing happened for {} s (sent {}/{messages}, received {}/{messages})",
                IDLE_TIMEOUT.as_secs(),
                conn.sends_done,
                conn.received
            );
            self.give_up(index, why);
        }
        if self.last_event.saturating_add(IDLE_TIMEOUT) <= now && !self.finished() {
            // Connections that never came (server) or never ended: given up, the run
            // ends; the endpoint drops whatever is left.
            for index in 0..self.conns.len() {
                if !self.conns[index].is_done() {
                    self.give_up(
                        index,
                        format!("nothing happened for {} s", IDLE_TIMEOUT.as_secs()),
                    );
                }
            }
            let missing = self.wanted().saturating_sub(self.conns.len());
            if missing > 0 {
                log_line(&format!(
                    "{missing} connection(s) never arrived in {} s",
                    IDLE_TIMEOUT.as_secs()
                ));
            }
            self.gave_up = true;
        }
    }

    /// Fails the connection and closes it (its Closed event is then ignored).
    fn give_up(&mut self, index: usize, why: String) {
        let conn = &mut self.conns[index];
        if conn.failure().is_none() {
            conn.set_failure(format!("connection {index}: {why}"));
        }
        if conn.is_done() {
            return;
        }
        if let Some(handle) = conn.handle {
            self.unmap_handle(handle);
            let _ = self.endpoint.disconnect(handle);
        }
        self.close(index, CloseReason::TimedOut);
    }

    /// Stops the run; the caller reports the reason.
    fn abort(&mut self, why: String) {
        self.aborted = Some(why);
    }
}

/// One line for why a connection ended.
pub fn describe(reason: &CloseReason) -> String {
    match reason {
        CloseReason::Disconnected => "disconnected".into(),
        CloseReason::Rejected { reason, .. } => format!("rejected by the peer ({reason})"),
        CloseReason::Unreachable { status } => format!("UNREACHABLE (status {status})"),
        CloseReason::AddressError { status } => format!("ADDR_ERROR (status {status})"),
        CloseReason::RouteError { status } => format!("ROUTE_ERROR (status {status})"),
        CloseReason::ConnectError { status } => format!("CONNECT_ERROR (status {status})"),
        CloseReason::DeviceRemoved => "the RDMA device was removed".into(),
        CloseReason::DeviceFatal => "the RDMA device reported a fatal error".into(),
        CloseReason::DeviceFailed(error) => format!("reading the RDMA device failed: {error}"),
        CloseReason::QpError { detail } => format!("QP error ({detail:?})"),
        CloseReason::TimedOut => "timed out (connect/establish deadline)".into(),
        CloseReason::SetupFailed(error) => format!("setup failed: {error}"),
        CloseReason::RejectedHere => "refused here".into(),
        other => format!("{other:?}"),
    }
}

/// The endpoint's setup calls and its loop fail only with a backend error; anything
/// else (not expected there) is named generically.
pub fn cm_error(error: ConnError) -> CmError {
    match error {
        ConnError::Cm(e) | ConnError::Endpoint(e) => e,
        _ => CmError::InvalidArgument {
            op: "cmnotify",
            reason: "the endpoint failed",
        },
    }
}

/// Diagnostics go to stderr, one line each, so that stdout stays the report (or JSON).
fn log_line(line: &str) {
    eprintln!("cmnotify: {line}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use cm_mock::sim::{SimConfig, SimTransport, SimTransports};

    #[test]
    fn a_record_keeps_the_unusual_exactly_beside_the_usual() {
        let mut record = ConnRecord::new(None, 1);
        assert_eq!(
            (record.established(), record.established_in()),
            (None, None)
        );
        assert_eq!(record.qp(), None);
        for via in Via::USUAL {
            record.set_established(via);
            assert_eq!(record.established(), Some(via));
        }
        assert!(record.rare.is_none(), "the usual ways take no box");
        let unusual = EstablishedVia::Notify(Trigger::AsyncEvent(AsyncEventType::PathMig));
        record.set_established(unusual);
        assert_eq!(record.established(), Some(unusual));
        record.set_established_in(70_000);
        assert_eq!(record.established_in(), Some(Duration::from_nanos(70_000)));
        let slow = 5_000_000_123;
        record.set_established_in(slow);
        assert_eq!(record.established_in(), Some(Duration::from_nanos(slow)));
        record.set_qp(Some(QpNum(0xff_ffff)));
        assert_eq!(record.qp(), Some(QpNum(0xff_ffff)));
        record.set_flag(Flag::IdleQueued, true);
        record.set_flag(Flag::Exchanged, true);
        record.set_flag(Flag::IdleQueued, false);
        assert!(record.flag(Flag::Exchanged) && !record.flag(Flag::IdleQueued));
        assert!(!record.flag(Flag::DisconnectCalled));
    }

    /// The real mode's exchange (the client sends, the server echoes, the client
    /// disconnects once its messages came back) on the simulated transport.
    #[test]
    fn the_real_modes_exchange_runs_on_the_simulated_transport() {
        let SimTransports {
            fabric,
            server,
            client,
        } = SimTransports::new(SimConfig::default(), 3);
        let addr = server.addr(7471);
        let plan = |server: bool| Plan {
            server,
            addr,
            source: None,
            connections: 5,
            notify: true,
            messages: if server { 0 } else { 2 },
            message_size: 100,
            caps: queue_caps(100),
            resolve_timeout: Duration::from_secs(2),
            resolve_attempts: 1,
            establish_timeout: Some(IDLE_TIMEOUT),
            disconnect_when_done: true,
        };
        let mut server = Session::new(Endpoint::new(server), plan(true));
        let mut client = Session::new(Endpoint::new(client), plan(false));
        server.start().unwrap();
        client.start().unwrap();
        let ready = |s: &mut Session<SimTransport>| s.handle_ready(&mut |_, _| None).unwrap();
        while ready(&mut client) + ready(&mut server) > 0 || fabric.step() {}
        assert!(client.finished() && server.finished());
        for conn in client.conns().iter().chain(server.conns()) {
            assert_eq!(conn.established_reports(), 1, "{conn:?}");
            assert_eq!((conn.sends_posted, conn.received), (2, 2), "{conn:?}");
            assert_eq!(conn.closed(), Some(CloseReason::Disconnected), "{conn:?}");
            assert_eq!(conn.failure(), None);
        }
        assert_eq!(client.step_totals(Step::Exchange).count(), 5);
        assert!(client.first_span(Step::Exchange).duration().is_some());
        assert_eq!(client.endpoint().connection_count(), 0);
        assert_eq!(server.endpoint().connection_count(), 0);
    }
}
