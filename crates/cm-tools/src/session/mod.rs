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
//!
//! This file holds the plan, the session and its calls; `record` is a connection's
//! record, `events` the answer to each event and `deadlines` the run's patience.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use cm_core::{CmError, ConnectionParams, IdOptions, QueueCaps, Transport};
use cm_verbs::{
    CloseReason, ConnError, ConnectOptions, ConnectionId, Endpoint, Event, ListenOptions,
    PrivateData,
};

use crate::steps::{Span, Step, StepTotals};

mod deadlines;
mod events;
mod record;

use record::Closed;
pub use record::ConnRecord;

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

/// The endpoint options of a run: every connection of a device on shared queues (the
/// default), their buffers as large as the run's messages, `ready_qps` QPs made ahead
/// (`--ready-qps`; `None`: the default), or each connection with its own
/// (`--own-queues`).
pub fn endpoint_options(
    own_queues: bool,
    message_size: usize,
    ready_qps: Option<u32>,
) -> cm_verbs::EndpointOptions {
    if own_queues {
        return cm_verbs::EndpointOptions::own_queues();
    }
    let defaults = cm_verbs::SharedCaps::default();
    cm_verbs::EndpointOptions::shared_queues(cm_verbs::SharedCaps {
        buffer_size: queue_caps(message_size).buffer_size,
        ready_qps: ready_qps.unwrap_or(defaults.ready_qps),
        ..defaults
    })
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
    /// Client: the most connections in setup at once (each next one starts as one is
    /// established or ends), so that a connection's establish deadline runs from its
    /// own start, not from the run's; `None`: all at once.
    pub connect_window: Option<usize>,
    /// `rdma_set_option` choices of every connection (client) or of the listener and
    /// the connections it accepts (server).
    pub id_options: IdOptions,
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
    /// When the last event arrived: the clock is read once per event, and every answer
    /// to the event (its record's times, the idle deadline it moves) is stamped with it.
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
            self.connect_more();
            Ok(())
        }
    }

    /// Client: starts connections while fewer than the plan's window are in setup.
    fn connect_more(&mut self) {
        if self.plan.server {
            return;
        }
        let window = self.plan.connect_window.unwrap_or(usize::MAX);
        while self.conns.len() < self.wanted()
            && self.conns.len() - self.settled < window
            && self.aborted.is_none()
        {
            self.connect(self.conns.len(), 1);
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
            // Linux's cap: requests past the backlog are dropped unanswered.
            backlog: ListenOptions::default().backlog,
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
            params: ConnectionParams::default(),
            id_options: self.plan.id_options,
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
            params: ConnectionParams::default(),
            id_options: self.plan.id_options,
            ..ConnectOptions::default()
        };
        let conn = match self.endpoint.connect(self.plan.addr, options) {
            Ok(handle) => {
                self.map_handle(handle, index);
                ConnRecord::new(Some(handle), attempt)
            }
            Err(error) => {
                // The device under the source address is gone (removed while earlier
                // connections resolved or closed, with none of them left to report it):
                // every later connect would fail the same way.
                if matches!(&error, ConnError::Cm(cm) if cm.is_no_device())
                    && self.aborted.is_none()
                {
                    let addr = self.local_text();
                    self.abort(format!("no RDMA device under {addr} any more: {error}"));
                }
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

    /// Runs to the end, waiting in the endpoint for each event (and giving up on what
    /// makes no progress for [`IDLE_TIMEOUT`]).
    pub fn drive(&mut self) -> Result<(), ConnError> {
        self.keep_idle();
        while !self.finished() {
            // Counted from the last event's time, not read again: a deadline is met at
            // most one event's handling late.
            let timeout = self
                .next_deadline()
                .map(|deadline| deadline.saturating_sub(self.last_event));
            match self.endpoint.next_event(timeout) {
                Ok(event) => {
                    self.last_event = self.now();
                    self.on_event(event);
                    self.connect_more();
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
            self.last_event = self.now();
            let tagged = inspect(&self.endpoint, &event).zip(event.conn());
            self.on_event(event);
            self.connect_more();
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

    fn local_text(&self) -> String {
        // A client whose connections all ended before one was bound names its source.
        match self.local.or(self.plan.source) {
            Some(addr) => format!("{addr:?}"),
            None => "-".into(),
        }
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
        CloseReason::ReceiveOverrun { depth } => {
            format!("the peer sent past the receive depth ({depth} messages untaken)")
        }
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
    use cm_mock::sim::{SimAddr, SimConfig, SimTransport, SimTransports};

    /// Five connections; the client sends two messages on each, the server echoes.
    fn plan(server: bool, addr: SimAddr, source: Option<SimAddr>) -> Plan<SimAddr> {
        Plan {
            server,
            addr,
            source,
            connections: 5,
            notify: true,
            messages: if server { 0 } else { 2 },
            message_size: 100,
            caps: queue_caps(100),
            resolve_timeout: Duration::from_secs(2),
            resolve_attempts: 1,
            establish_timeout: Some(IDLE_TIMEOUT),
            disconnect_when_done: true,
            connect_window: None,
            id_options: IdOptions::default(),
        }
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
        let mut server = Session::new(Endpoint::new(server), plan(true, addr, None));
        let mut client = Session::new(Endpoint::new(client), plan(false, addr, None));
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

    /// A client whose device went while none of its connections was bound to it (all
    /// closed, or still resolving) hears of it from its next connect only: the run stops
    /// there, with a line naming the source address, instead of failing every connection
    /// left.
    #[test]
    fn a_connect_that_finds_no_device_stops_the_run() {
        let SimTransports { server, client, .. } = SimTransports::new(SimConfig::default(), 3);
        let addr = server.addr(7471);
        let source = client.addr(0);
        client.node().remove_device().unwrap();
        let mut client = Session::new(Endpoint::new(client), plan(false, addr, Some(source)));
        client.start().unwrap();
        assert!(client.finished());
        let why = client.aborted().expect("the run stopped");
        assert!(why.starts_with("no RDMA device under"), "{why}");
        assert!(why.contains(&format!("{source:?}")), "{why}");
        assert_eq!(
            client.conns().len(),
            1,
            "no connect after the first refusal"
        );
    }
}
