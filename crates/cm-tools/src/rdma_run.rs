//! `cmnotify --backend rdma`: real connections through librdmacm, in the style of
//! rdma-core's `ucmatose`, timed per step like `cmtime`.
//!
//! - Server (`-s`): listens on `-b`, accepts `-c` connections, one QP each, with the notify
//!   pump on the event loop (unless `--no-pump`): a receive completing on a connection
//!   not yet ESTABLISHED is forwarded with `rdma_notify`, as is COMM_EST. Answers
//!   DISCONNECTED with a disconnect. With `-C 0` (the default) it echoes every message it
//!   receives and lets the client disconnect (rping clients, cmnotify clients); with
//!   `-C N` it behaves like a ucmatose server: sends N messages once a connection is
//!   established, waits for N back, then disconnects.
//! - Client (`-a`): `-c` connections from `-b`, each resolved, connected, sending `-C`
//!   messages (default 1) once established; once its messages are sent and as many have
//!   come back, it disconnects. `-C 0` connects, establishes and disconnects without
//!   data (what an `rping -s` server accepts without the RDMA READ/WRITE protocol).
//!
//! Receive buffers are posted before connect/accept, so a peer that sends at once never
//! meets an empty receive queue.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cm_core::{AsyncEvent, AsyncEventSource, CmError, CmEventSource, CmEventType, QpNum};
use cm_sys::{AsyncEvents, CmEvent, CmId, Completion, ConnParams, EventChannel, MemoryRegion};
use cm_verbs::rdma::PollWaiter;
use cm_verbs::{Control, EventLoop, LoopEvent, NotifyPump, PumpCounters, PumpEvent, Role, Waiter};
use serde::Serialize;

/// What a real-device run does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RealRun {
    /// Passive side (listen and accept) instead of the client.
    pub server: bool,
    /// Server: the address to listen on (any address when `None`). Client: the source
    /// address.
    pub bind: Option<IpAddr>,
    /// Client: the server's address.
    pub address: Option<IpAddr>,
    /// The server's port.
    pub port: u16,
    /// Connections to open (client) or accept (server).
    pub connections: u32,
    /// Whether the notify pump runs.
    pub pump: bool,
    /// Print JSON instead of the human summary.
    pub json: bool,
    /// Messages each side sends per connection (see the module documentation); `None`:
    /// 1 for the client, 0 (echo) for the server.
    pub messages: Option<u32>,
    /// Bytes per message the run sends first (echoes copy what they received).
    pub message_size: usize,
}

impl Default for RealRun {
    /// A client of one connection to 127.0.0.1:7471 sending one 100-byte message.
    fn default() -> Self {
        RealRun {
            server: false,
            bind: None,
            address: None,
            port: 7471,
            connections: 1,
            pump: true,
            json: false,
            messages: None,
            message_size: DEFAULT_MESSAGE_SIZE,
        }
    }
}

impl RealRun {
    /// The messages per connection in effect.
    pub fn messages(&self) -> u32 {
        self.messages.unwrap_or(if self.server { 0 } else { 1 })
    }

    /// The receive buffer of one posted receive: large enough for rping's and ucmatose's
    /// default messages whatever `--size` says.
    fn receive_size(&self) -> usize {
        self.message_size.max(MIN_RECEIVE_SIZE)
    }
}

/// ucmatose's default message size.
pub const DEFAULT_MESSAGE_SIZE: usize = 100;
/// The largest message size `--size` takes.
pub const MAX_MESSAGE_SIZE: usize = 4096;
/// The most messages per connection: the send queue depth.
pub const MAX_MESSAGES: u32 = SEND_SLOTS as u32;

/// Receives posted per connection (the default QP's receive queue depth).
const RECEIVE_SLOTS: usize = 16;
/// Send buffers per connection (the default QP's send queue depth).
const SEND_SLOTS: usize = 16;
/// The smallest receive buffer.
const MIN_RECEIVE_SIZE: usize = 512;
/// Work request ids of sends start here; receives use their slot number.
const SEND_WR_BASE: u64 = 1 << 32;
/// `IBV_WC_WR_FLUSH_ERR`: work flushed by a disconnect, expected at teardown.
const WC_FLUSH_ERR: u32 = 5;
/// The kernel's timeout of one address or route resolution.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// Address resolution attempts per connection: the first one after the devices come up
/// can time out while the neighbour entry is being resolved.
const RESOLVE_ATTEMPTS: u32 = 5;
/// How often completion queues are polled while a connection expects completions
/// (cm-sys exposes no completion channel to wait on).
const CQ_TICK: Duration = Duration::from_millis(1);

/// The timed steps of a connection, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Client: `rdma_resolve_addr` to ADDR_RESOLVED (the successful attempt).
    ResolveAddr,
    /// Client: `rdma_resolve_route` to ROUTE_RESOLVED.
    ResolveRoute,
    /// `rdma_create_qp`.
    CreateQp,
    /// The `rdma_connect` (client) or `rdma_accept` (server) call.
    Connect,
    /// From the connect/accept call to the ESTABLISHED event.
    Established,
    /// From ESTABLISHED until this side's messages are sent and as many received.
    Exchange,
    /// From the first of "disconnect called" and "DISCONNECTED received" to the later.
    Disconnect,
}

impl Step {
    /// Every step, in order.
    pub const ALL: [Step; 7] = [
        Step::ResolveAddr,
        Step::ResolveRoute,
        Step::CreateQp,
        Step::Connect,
        Step::Established,
        Step::Exchange,
        Step::Disconnect,
    ];

    /// The step's name in the table and the JSON.
    pub const fn name(self, server: bool) -> &'static str {
        match self {
            Step::ResolveAddr => "resolve_addr",
            Step::ResolveRoute => "resolve_route",
            Step::CreateQp => "create_qp",
            Step::Connect if server => "accept",
            Step::Connect => "connect",
            Step::Established => "established",
            Step::Exchange => "exchange",
            Step::Disconnect => "disconnect",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// When one step of one connection started and ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    /// Start.
    pub start: Option<Instant>,
    /// End.
    pub end: Option<Instant>,
}

impl Span {
    fn begin(&mut self, at: Instant) {
        self.start.get_or_insert(at);
    }

    fn finish(&mut self, at: Instant) {
        if self.start.is_some() {
            self.end.get_or_insert(at);
        }
    }

    /// The duration, when the step both started and ended.
    pub fn duration(&self) -> Option<Duration> {
        Some(self.end?.saturating_duration_since(self.start?))
    }
}

/// One step over all connections, as cmtime reports it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct StepStats {
    /// The step's name.
    pub step: &'static str,
    /// Connections that completed the step.
    pub count: usize,
    /// Wall time from the first start to the last end, µs.
    pub total_us: u64,
    /// `total_us` divided by the connections of the run (cmtime's "avg/conn").
    pub avg_per_conn_us: u64,
    /// Sum of the per-connection durations, µs.
    pub sum_us: u64,
    /// `sum_us` divided by the connections of the run (cmtime's "us/conn").
    pub us_per_conn: u64,
    /// Longest per-connection duration, µs.
    pub max_us: u64,
    /// Shortest per-connection duration, µs.
    pub min_us: u64,
}

impl StepStats {
    /// Summarises `spans` (one per connection that took part) over a run of
    /// `connections`.
    pub fn from_spans(step: &'static str, spans: &[Span], connections: u32) -> Self {
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let done: Vec<(Instant, Instant)> = spans
            .iter()
            .filter_map(|s| Some((s.start?, s.end?)))
            .collect();
        let mut stats = StepStats {
            step,
            count: done.len(),
            ..StepStats::default()
        };
        if done.is_empty() {
            return stats;
        }
        let first = done.iter().map(|d| d.0).min().expect("non-empty");
        let last = done.iter().map(|d| d.1).max().expect("non-empty");
        let per_conn: Vec<u64> = done
            .iter()
            .map(|(start, end)| micros(end.saturating_duration_since(*start)))
            .collect();
        let connections = u64::from(connections.max(1));
        stats.total_us = micros(last.saturating_duration_since(first));
        stats.avg_per_conn_us = stats.total_us / connections;
        stats.sum_us = per_conn.iter().sum();
        stats.us_per_conn = stats.sum_us / connections;
        stats.max_us = per_conn.iter().copied().max().unwrap_or(0);
        stats.min_us = per_conn.iter().copied().min().unwrap_or(0);
        stats
    }
}

/// What a real-device run found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RealReport {
    /// Always "rdma".
    pub backend: &'static str,
    /// "server" or "client".
    pub role: &'static str,
    /// The local address (server: listening; client: of the first connection).
    pub local: Option<String>,
    /// The server's address (client).
    pub remote: Option<String>,
    /// Connections asked for.
    pub connections: u32,
    /// Whether the pump ran.
    pub pump: bool,
    /// Messages per connection this side sent first (0 on an echoing server).
    pub messages: u32,
    /// Bytes per message sent first.
    pub message_size: usize,
    /// Connections that reached ESTABLISHED.
    pub established: usize,
    /// Of those, established before any notify (the RTU came first).
    pub via_rtu: usize,
    /// Of those, established after the pump forced them with notify (server side).
    pub via_notify: usize,
    /// notify answered EISCONN: the RTU had already won.
    pub already_established_races: u64,
    /// Connections that failed (never established, or an error on the way).
    pub failed: usize,
    /// Connections torn down cleanly (disconnect called and DISCONNECTED received).
    pub disconnected: usize,
    /// Address resolutions retried after ADDR_ERROR (client).
    pub resolve_retries: u32,
    /// Messages sent (completed sends).
    pub messages_sent: u64,
    /// Messages received (completed receives).
    pub messages_received: u64,
    /// What the pump did.
    pub pump_counters: PumpJson,
    /// Per-step timings, cmtime style.
    pub steps: Vec<StepStats>,
    /// Why connections failed, one line each.
    pub failures: Vec<String>,
    /// Wall time of the whole run, seconds.
    pub seconds: f64,
}

impl RealReport {
    /// Whether every connection was established and torn down cleanly.
    pub fn is_clean(&self) -> bool {
        let all = usize::try_from(self.connections).unwrap_or(usize::MAX);
        self.failed == 0 && self.established == all && self.disconnected == all
    }
}

/// The pump's counters, for JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PumpJson {
    /// notify returned 0.
    pub forced: u64,
    /// notify returned EISCONN.
    pub already_established: u64,
    /// notify was refused.
    pub rejected: u64,
    /// Receive completions that triggered a notify.
    pub receive_triggers: u64,
    /// COMM_EST for QPs no connection owns.
    pub unrouted: u64,
    /// Asynchronous events passed to the application.
    pub passed_through: u64,
}

impl From<PumpCounters> for PumpJson {
    fn from(c: PumpCounters) -> Self {
        PumpJson {
            forced: c.forced,
            already_established: c.already_established,
            rejected: c.notify_failed,
            receive_triggers: c.receive_triggers,
            unrouted: c.unrouted,
            passed_through: c.passed_through,
        }
    }
}

/// The whole tool: runs, prints, and turns the outcome into an exit status (0: every
/// connection established and torn down; 1: some failed; 2: no RDMA device or bad
/// arguments).
pub fn main(config: &RealRun) -> ExitCode {
    let report = match run(config) {
        Ok(report) => report,
        Err(e) if e.is_no_device() => {
            // The error's text starts with "no RDMA device".
            eprintln!("cmnotify: {e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("cmnotify: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(message) = crate::report::emit(config.json, &report, || human(&report)) {
        eprintln!("cmnotify: {message}");
        return ExitCode::FAILURE;
    }
    if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The human summary: a header, cmtime's step table, then outcomes.
pub fn human(r: &RealReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cmnotify: rdma {} {}{}, {} connection(s), {}, pump {}",
        r.role,
        r.local.as_deref().unwrap_or("-"),
        r.remote
            .as_deref()
            .map(|a| format!(" {} {a}", if r.role == "server" { "<-" } else { "->" }))
            .unwrap_or_default(),
        r.connections,
        match (r.role, r.messages) {
            ("server", 0) => "echoing what clients send".to_string(),
            (_, 0) => "no data".to_string(),
            (_, n) => format!("{n} message(s) of {} B each way", r.message_size),
        },
        if r.pump { "on" } else { "OFF" }
    );
    let _ = writeln!(
        out,
        "step             avg/conn  total(us)    us/conn    sum(us)    max(us)    min(us)"
    );
    for s in &r.steps {
        let _ = writeln!(
            out,
            "{:<13}  {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            s.step, s.avg_per_conn_us, s.total_us, s.us_per_conn, s.sum_us, s.max_us, s.min_us
        );
    }
    let _ = writeln!(
        out,
        "established {}/{} (by RTU {}, forced by notify {}, EISCONN races {}), disconnected {}, failed {}",
        r.established,
        r.connections,
        r.via_rtu,
        r.via_notify,
        r.already_established_races,
        r.disconnected,
        r.failed
    );
    let _ = writeln!(
        out,
        "messages sent {}, received {}; resolve retries {}; {:.3} s",
        r.messages_sent, r.messages_received, r.resolve_retries, r.seconds
    );
    let p = &r.pump_counters;
    if r.pump {
        let _ = writeln!(
            out,
            "pump: forced {}, EISCONN {}, refused {}, receive triggers {}, unrouted {}, passed through {}",
            p.forced, p.already_established, p.rejected, p.receive_triggers, p.unrouted, p.passed_through
        );
    }
    for failure in &r.failures {
        let _ = writeln!(out, "failed: {failure}");
    }
    out
}

/// The CM event channel as the loop's event source, shared with the code that creates
/// ids on it.
struct SharedChannel(Arc<EventChannel>);

impl CmEventSource for SharedChannel {
    type Event = CmEvent;

    fn try_next_event(&mut self) -> Result<Option<CmEvent>, CmError> {
        self.0.try_next_event()
    }
}

/// The device's asynchronous events, known once an id is bound to the device.
#[derive(Clone, Default)]
struct DeviceEvents(Rc<RefCell<Option<AsyncEvents>>>);

impl AsyncEventSource for DeviceEvents {
    fn try_next_async_event(&mut self) -> Result<Option<AsyncEvent>, CmError> {
        match self.0.borrow().as_ref() {
            Some(events) => events.try_next_event(),
            None => Ok(None),
        }
    }
}

/// One connection's state.
struct Conn {
    id: CmId,
    memory: Option<MemoryRegion>,
    qp: Option<QpNum>,
    spans: [Span; Step::ALL.len()],
    resolve_attempts: u32,
    established: bool,
    forced: bool,
    sends_posted: u32,
    sends_done: u32,
    received: u32,
    disconnect_called: bool,
    disconnected: bool,
    failure: Option<String>,
}

impl Conn {
    fn new(id: CmId) -> Self {
        Conn {
            id,
            memory: None,
            qp: None,
            spans: [Span::default(); Step::ALL.len()],
            resolve_attempts: 0,
            established: false,
            forced: false,
            sends_posted: 0,
            sends_done: 0,
            received: 0,
            disconnect_called: false,
            disconnected: false,
            failure: None,
        }
    }

    fn span(&mut self, step: Step) -> &mut Span {
        &mut self.spans[step.index()]
    }

    fn is_done(&self) -> bool {
        self.failure.is_some() || self.disconnected
    }

    /// Whether completions may still come that the run waits for.
    fn expects_completions(&self) -> bool {
        self.qp.is_some() && !self.is_done()
    }
}

/// Everything the event handler and the completion polling share.
struct Session {
    config: RealRun,
    channel: Arc<EventChannel>,
    device: DeviceEvents,
    device_to_watch: bool,
    conns: Vec<Conn>,
    by_qp: HashMap<QpNum, usize>,
    resolve_retries: u32,
    races: u64,
    remote: Option<SocketAddr>,
}

/// Runs the server or the client to the end and reports.
pub fn run(config: &RealRun) -> Result<RealReport, CmError> {
    if config.connections == 0 {
        return Err(CmError::InvalidArgument {
            op: "cmnotify",
            reason: "no connections asked for",
        });
    }
    if !config.server && config.address.is_none() {
        return Err(CmError::InvalidArgument {
            op: "cmnotify",
            reason: "the client needs the server's address (-a)",
        });
    }
    let started = Instant::now();
    let channel = Arc::new(EventChannel::new()?);
    channel.set_nonblocking(true)?;
    let mut session = Session {
        config: config.clone(),
        channel: Arc::clone(&channel),
        device: DeviceEvents::default(),
        device_to_watch: false,
        conns: Vec::with_capacity(usize::try_from(config.connections).unwrap_or(0)),
        by_qp: HashMap::new(),
        resolve_retries: 0,
        races: 0,
        remote: None,
    };
    let (mut waiter, _shutdown) = PollWaiter::new(&*channel)?;
    let mut listener = None;
    let local;
    if config.server {
        let id = channel.create_id()?;
        let addr = SocketAddr::new(
            config.bind.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
            config.port,
        );
        id.bind_addr(addr)?;
        id.listen(i32::try_from(config.connections.min(1024)).unwrap_or(1024))?;
        // Bound to an RDMA device's address: its asynchronous events are known now;
        // otherwise they are with the first request.
        if let Ok(events) = id.async_events() {
            session.adopt_device(events)?;
        }
        local = id.local_addr();
        listener = Some(id);
    } else {
        for _ in 0..config.connections {
            let id = channel.create_id()?;
            let mut conn = Conn::new(id);
            session.start_resolve(&mut conn)?;
            session.conns.push(conn);
        }
        local = None;
    }

    let pump = NotifyPump::with_policy(
        cm_core::RoutingPolicy::default(),
        usize::try_from(config.connections).unwrap_or(0),
    );
    let mut event_loop = EventLoop::new(
        SharedChannel(Arc::clone(&channel)),
        session.device.clone(),
        pump,
    );
    while !session.finished() {
        if session.device_to_watch {
            if let Some(events) = session.device.0.borrow().as_ref() {
                waiter.watch_async_events(events)?;
            }
            session.device_to_watch = false;
        }
        waiter.set_tick(session.expects_completions().then_some(CQ_TICK));
        let ready = waiter.wait()?;
        let mut handler =
            |pump: &mut NotifyPump<CmId>, event: LoopEvent<CmEvent>| session.handle(pump, event);
        event_loop.poll_once(ready, &mut handler)?;
        session.poll_completions(event_loop.pump());
        if ready.shutdown {
            break;
        }
    }
    session.settle(event_loop.pump());
    let counters = event_loop.pump().counters();
    let report = session.report(local, counters, started.elapsed());
    // Teardown: every connection is disconnected or failed; ids (and their QPs) go
    // with the session, the listener last.
    drop(event_loop);
    drop(session);
    drop(listener);
    Ok(report)
}

impl Session {
    fn finished(&self) -> bool {
        let wanted = usize::try_from(self.config.connections).unwrap_or(usize::MAX);
        self.conns.len() >= wanted && self.conns.iter().all(Conn::is_done)
    }

    fn expects_completions(&self) -> bool {
        self.conns.iter().any(Conn::expects_completions)
    }

    fn adopt_device(&mut self, events: AsyncEvents) -> Result<(), CmError> {
        if self.device.0.borrow().is_some() {
            return Ok(());
        }
        events.set_nonblocking(true)?;
        *self.device.0.borrow_mut() = Some(events);
        self.device_to_watch = true;
        Ok(())
    }

    fn server_addr(&self) -> SocketAddr {
        SocketAddr::new(
            self.config
                .address
                .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            self.config.port,
        )
    }

    fn start_resolve(&self, conn: &mut Conn) -> Result<(), CmError> {
        conn.resolve_attempts += 1;
        conn.spans[Step::ResolveAddr.index()] = Span::default();
        conn.span(Step::ResolveAddr).begin(Instant::now());
        let source = self.config.bind.map(|ip| SocketAddr::new(ip, 0));
        conn.id
            .resolve_addr(source, self.server_addr(), RESOLVE_TIMEOUT)
    }

    /// The connection an event is about.
    fn conn_of(&self, event: &CmEvent) -> Option<usize> {
        if let Some(index) = event.qp_num().and_then(|qp| self.by_qp.get(&qp)) {
            return Some(*index);
        }
        let id = event.id()?;
        self.conns.iter().position(|c| &c.id == id)
    }

    fn handle(&mut self, pump: &mut NotifyPump<CmId>, event: LoopEvent<CmEvent>) -> Control {
        match event {
            LoopEvent::Pump(pumped) => self.on_pump_event(pumped),
            LoopEvent::Cm(event) => self.on_cm_event(pump, &event),
        }
        Control::Continue
    }

    fn on_pump_event(&mut self, pumped: PumpEvent) {
        match pumped {
            PumpEvent::Forced { qp, .. } => {
                if let Some(&index) = self.by_qp.get(&qp) {
                    let conn = &mut self.conns[index];
                    if !conn.established {
                        conn.forced = true;
                    }
                }
            }
            PumpEvent::AlreadyEstablished { .. } => self.races += 1,
            PumpEvent::NotifyFailed { qp, trigger, error } => {
                log_line(&format!("{qp}: notify after {trigger:?} refused: {error}"));
            }
            // Counted by the pump; an event for the application (QP_FATAL, PORT_ERR…)
            // is also worth a line.
            PumpEvent::PassThrough(event) => log_line(&format!("asynchronous event: {event}")),
            PumpEvent::PathMigrated { .. } | PumpEvent::Unrouted(_) => {}
        }
    }

    fn on_cm_event(&mut self, pump: &mut NotifyPump<CmId>, event: &CmEvent) {
        let now = Instant::now();
        if event.event_type() == CmEventType::ConnectRequest {
            self.on_connect_request(pump, event, now);
            return;
        }
        let Some(index) = self.conn_of(event) else {
            return;
        };
        let result = match event.event_type() {
            CmEventType::AddrResolved => self.on_addr_resolved(index, now),
            CmEventType::AddrError => self.on_addr_error(index, event.status()),
            CmEventType::RouteResolved => self.on_route_resolved(pump, index, now),
            CmEventType::Established => self.on_established(index, now),
            CmEventType::Disconnected => {
                let conn = &mut self.conns[index];
                conn.span(Step::Disconnect).begin(now);
                // Marked first: what the drain finds flushed is teardown, not an error.
                conn.disconnected = true;
                self.drain_completions(pump, index);
                let conn = &mut self.conns[index];
                let answered = if conn.disconnect_called {
                    Ok(())
                } else {
                    // The peer's teardown waits for this side's DREP.
                    conn.disconnect_called = true;
                    conn.id.disconnect()
                };
                conn.span(Step::Disconnect).finish(Instant::now());
                answered
            }
            CmEventType::RouteError
            | CmEventType::ConnectError
            | CmEventType::Unreachable
            | CmEventType::Rejected
            | CmEventType::DeviceRemoval => {
                let conn = &mut self.conns[index];
                if let Some(qp) = conn.qp {
                    pump.unregister(qp);
                }
                conn.failure.get_or_insert_with(|| {
                    format!(
                        "connection {index}: {} (status {})",
                        event.event_type(),
                        event.status()
                    )
                });
                Ok(())
            }
            _ => Ok(()),
        };
        if let Err(e) = result {
            self.fail(pump, index, &e.to_string());
        }
    }

    fn fail(&mut self, pump: &mut NotifyPump<CmId>, index: usize, why: &str) {
        let conn = &mut self.conns[index];
        if let Some(qp) = conn.qp {
            pump.unregister(qp);
        }
        if conn.failure.is_none() {
            conn.failure = Some(format!("connection {index}: {why}"));
        }
    }

    fn on_connect_request(&mut self, pump: &mut NotifyPump<CmId>, event: &CmEvent, now: Instant) {
        let Some(id) = event.id().cloned() else {
            return;
        };
        let wanted = usize::try_from(self.config.connections).unwrap_or(usize::MAX);
        if !self.config.server || self.conns.len() >= wanted {
            // Beyond -c: refused (dropping the id would reject it as well).
            let _ = id.reject(&[]);
            return;
        }
        if let Ok(events) = id.async_events() {
            if let Err(e) = self.adopt_device(events) {
                log_line(&format!("asynchronous events unavailable: {e}"));
            }
        }
        let index = self.conns.len();
        self.conns.push(Conn::new(id));
        if self.remote.is_none() {
            self.remote = self.conns[index].id.peer_addr();
        }
        let result = self
            .prepare_qp(pump, index, now, Role::Passive)
            .and_then(|()| {
                let conn = &mut self.conns[index];
                conn.span(Step::Connect).begin(Instant::now());
                conn.id.accept(&ConnParams::default())?;
                let after = Instant::now();
                conn.span(Step::Connect).finish(after);
                conn.span(Step::Established).begin(after);
                Ok(())
            });
        if let Err(e) = result {
            let _ = self.conns[index].id.reject(&[]);
            self.fail(pump, index, &e.to_string());
        }
    }

    /// QP, memory, posted receives, pump registration: everything before connect/accept.
    fn prepare_qp(
        &mut self,
        pump: &mut NotifyPump<CmId>,
        index: usize,
        now: Instant,
        role: Role,
    ) -> Result<(), CmError> {
        let receive_size = self.config.receive_size();
        let pump_on = self.config.pump;
        let conn = &mut self.conns[index];
        conn.span(Step::CreateQp).begin(now);
        let qp = conn.id.create_qp(&cm_sys::QpCaps::default())?;
        conn.span(Step::CreateQp).finish(Instant::now());
        conn.qp = Some(qp);
        self.by_qp.insert(qp, index);
        let memory = conn
            .id
            .register_memory((RECEIVE_SLOTS + SEND_SLOTS) * receive_size)?;
        for slot in 0..RECEIVE_SLOTS {
            let start = slot * receive_size;
            conn.id
                .post_recv(&memory, start..start + receive_size, slot as u64)?;
        }
        conn.memory = Some(memory);
        if pump_on {
            pump.register(conn.id.clone(), role)
                .map_err(|_| CmError::InvalidArgument {
                    op: "NotifyPump::register",
                    reason: "the QP is registered twice",
                })?;
        }
        Ok(())
    }

    fn on_addr_resolved(&mut self, index: usize, now: Instant) -> Result<(), CmError> {
        if let Ok(events) = self.conns[index].id.async_events() {
            self.adopt_device(events)?;
        }
        let conn = &mut self.conns[index];
        conn.span(Step::ResolveAddr).finish(now);
        conn.span(Step::ResolveRoute).begin(Instant::now());
        conn.id.resolve_route(RESOLVE_TIMEOUT)
    }

    fn on_addr_error(&mut self, index: usize, status: i32) -> Result<(), CmError> {
        if self.conns[index].resolve_attempts >= RESOLVE_ATTEMPTS {
            self.conns[index].failure = Some(format!(
                "connection {index}: ADDR_ERROR (status {status}) after {RESOLVE_ATTEMPTS} attempts"
            ));
            return Ok(());
        }
        // A fresh id for the next attempt; the failed one goes with its event.
        self.resolve_retries += 1;
        let id = self.channel.create_id()?;
        let attempts = self.conns[index].resolve_attempts;
        let mut conn = Conn::new(id);
        conn.resolve_attempts = attempts;
        self.start_resolve(&mut conn)?;
        self.conns[index] = conn;
        Ok(())
    }

    fn on_route_resolved(
        &mut self,
        pump: &mut NotifyPump<CmId>,
        index: usize,
        now: Instant,
    ) -> Result<(), CmError> {
        self.conns[index].span(Step::ResolveRoute).finish(now);
        self.prepare_qp(pump, index, Instant::now(), Role::Active)?;
        let conn = &mut self.conns[index];
        conn.span(Step::Connect).begin(Instant::now());
        conn.id.connect(&ConnParams::default())?;
        let after = Instant::now();
        conn.span(Step::Connect).finish(after);
        conn.span(Step::Established).begin(after);
        Ok(())
    }

    fn on_established(&mut self, index: usize, now: Instant) -> Result<(), CmError> {
        let messages = self.config.messages();
        let size = self.config.message_size;
        let receive_size = self.config.receive_size();
        let conn = &mut self.conns[index];
        if conn.established {
            conn.failure = Some(format!("connection {index}: a second ESTABLISHED event"));
            return Ok(());
        }
        conn.established = true;
        conn.span(Step::Established).finish(now);
        if messages > 0 {
            conn.span(Step::Exchange).begin(now);
            let memory = conn.memory.expect("memory is registered before connecting");
            for seq in 0..messages {
                let slot = RECEIVE_SLOTS + seq as usize % SEND_SLOTS;
                let start = slot * receive_size;
                let mut payload =
                    format!("cmnotify connection {index} message {seq}\0").into_bytes();
                payload.resize(size, 0);
                conn.id.write_memory(&memory, start, &payload)?;
                conn.id
                    .post_send(&memory, start..start + size, SEND_WR_BASE + slot as u64)?;
                conn.sends_posted += 1;
            }
        }
        self.check_exchange_done(index, now)
    }

    /// Notes the end of the exchange (this side's messages sent and as many received)
    /// and then disconnects, when this side initiates: a client always, a server when
    /// it sends first. A side with no messages disconnects once established.
    fn check_exchange_done(&mut self, index: usize, now: Instant) -> Result<(), CmError> {
        let messages = self.config.messages();
        let initiates = !self.config.server || messages > 0;
        let conn = &mut self.conns[index];
        if !conn.established || conn.sends_done < messages || conn.received < messages {
            return Ok(());
        }
        if messages > 0 {
            conn.span(Step::Exchange).finish(now);
        }
        if !initiates || conn.disconnect_called || conn.is_done() {
            return Ok(());
        }
        conn.span(Step::Disconnect).begin(Instant::now());
        conn.disconnect_called = true;
        conn.id.disconnect()
    }

    /// Whether the connection's exchange is complete (always, with no messages).
    fn exchanged(&self, conn: &Conn) -> bool {
        self.config.messages() == 0 || conn.spans[Step::Exchange.index()].end.is_some()
    }

    /// Reads every completion already queued for the connection. Called when its
    /// DISCONNECTED arrives and once more at the end: a peer that disconnects as soon as
    /// the exchange is over can do so between two polls, with our completions still
    /// queued (the disconnect then flushes only what had not completed).
    fn drain_completions(&mut self, pump: &mut NotifyPump<CmId>, index: usize) {
        if self.conns[index].qp.is_none() || self.conns[index].failure.is_some() {
            return;
        }
        loop {
            match self.poll_conn(pump, index) {
                Ok(0) => return,
                Ok(_) => continue,
                Err(e) => return self.fail(pump, index, &e.to_string()),
            }
        }
    }

    /// After the run: a connection whose exchange never completed has failed, even if
    /// the peer then disconnected cleanly.
    fn settle(&mut self, pump: &mut NotifyPump<CmId>) {
        let messages = self.config.messages();
        for index in 0..self.conns.len() {
            self.drain_completions(pump, index);
            let conn = &self.conns[index];
            if conn.established && conn.failure.is_none() && !self.exchanged(conn) {
                let why = format!(
                    "disconnected before the exchange completed (sent {}/{messages}, received {}/{messages})",
                    conn.sends_done, conn.received
                );
                self.fail(pump, index, &why);
            }
        }
    }

    fn poll_completions(&mut self, pump: &mut NotifyPump<CmId>) {
        for index in 0..self.conns.len() {
            if !self.conns[index].expects_completions() {
                continue;
            }
            if let Err(e) = self.poll_conn(pump, index) {
                self.fail(pump, index, &e.to_string());
            }
        }
    }

    /// Polls the connection's queues once; how many completions it found.
    fn poll_conn(&mut self, pump: &mut NotifyPump<CmId>, index: usize) -> Result<usize, ConnError> {
        let receives = self.conns[index].id.poll_recv_cq(RECEIVE_SLOTS)?;
        let sends = self.conns[index].id.poll_send_cq(SEND_SLOTS)?;
        let found = receives.len() + sends.len();
        for completion in receives {
            self.on_receive(pump, index, completion)?;
        }
        for completion in sends {
            if completion.is_success() {
                self.conns[index].sends_done += 1;
            } else if !self.flushed(index, &completion) {
                return Err(ConnError::completion("send", &completion));
            }
        }
        self.check_exchange_done(index, Instant::now())?;
        Ok(found)
    }

    /// Whether a failed completion is work flushed by teardown.
    fn flushed(&self, index: usize, completion: &Completion) -> bool {
        let conn = &self.conns[index];
        completion.status.as_raw() == WC_FLUSH_ERR && (conn.disconnect_called || conn.disconnected)
    }

    fn on_receive(
        &mut self,
        pump: &mut NotifyPump<CmId>,
        index: usize,
        completion: Completion,
    ) -> Result<(), ConnError> {
        if !completion.is_success() {
            if self.flushed(index, &completion) {
                return Ok(());
            }
            return Err(ConnError::completion("receive", &completion));
        }
        // A receive on a connection not yet ESTABLISHED is the trigger soft-RoCE gives
        // (it raises no COMM_EST): the pump forwards it with notify.
        if self.config.pump {
            if let Some(pumped) = pump.on_receive_completion(completion.qp_num) {
                self.on_pump_event(pumped);
            }
        }
        let echo = self.config.server && self.config.messages() == 0;
        let receive_size = self.config.receive_size();
        let conn = &mut self.conns[index];
        conn.received += 1;
        let memory = conn.memory.expect("memory is registered before receiving");
        let slot = usize::try_from(completion.wr_id).unwrap_or(usize::MAX);
        if slot >= RECEIVE_SLOTS {
            return Err(CmError::InvalidArgument {
                op: "ibv_poll_cq",
                reason: "a receive completion with an unknown work request id",
            }
            .into());
        }
        let start = slot * receive_size;
        if echo {
            let len = usize::try_from(completion.byte_len)
                .unwrap_or(usize::MAX)
                .min(receive_size);
            let data = conn.id.read_memory(&memory, start..start + len)?;
            let send_slot = RECEIVE_SLOTS + conn.sends_posted as usize % SEND_SLOTS;
            let send_start = send_slot * receive_size;
            conn.id.write_memory(&memory, send_start, &data)?;
            conn.id.post_send(
                &memory,
                send_start..send_start + len,
                SEND_WR_BASE + send_slot as u64,
            )?;
            conn.sends_posted += 1;
        }
        // The slot is free again (an echo copied it out first).
        conn.id
            .post_recv(&memory, start..start + receive_size, slot as u64)?;
        Ok(())
    }

    fn report(
        &self,
        local: Option<SocketAddr>,
        counters: PumpCounters,
        took: Duration,
    ) -> RealReport {
        let server = self.config.server;
        let steps = Step::ALL
            .iter()
            .filter(|step| match step {
                Step::ResolveAddr | Step::ResolveRoute => !server,
                Step::Exchange => self.config.messages() > 0,
                _ => true,
            })
            .map(|&step| {
                let spans: Vec<Span> = self.conns.iter().map(|c| c.spans[step.index()]).collect();
                StepStats::from_spans(step.name(server), &spans, self.config.connections)
            })
            .collect();
        let established = self.conns.iter().filter(|c| c.established).count();
        let via_notify = self
            .conns
            .iter()
            .filter(|c| c.established && c.forced)
            .count();
        let unstarted = usize::try_from(self.config.connections)
            .unwrap_or(usize::MAX)
            .saturating_sub(self.conns.len());
        let local = local.or_else(|| self.conns.first().and_then(|c| c.id.local_addr()));
        let remote = if server {
            self.remote
        } else {
            Some(self.server_addr())
        };
        RealReport {
            backend: "rdma",
            role: if server { "server" } else { "client" },
            local: local.map(|a| a.to_string()),
            remote: remote.map(|a| a.to_string()),
            connections: self.config.connections,
            pump: self.config.pump,
            messages: self.config.messages(),
            message_size: self.config.message_size,
            established,
            via_rtu: established - via_notify,
            via_notify,
            already_established_races: self.races,
            failed: self.conns.iter().filter(|c| c.failure.is_some()).count() + unstarted,
            disconnected: self
                .conns
                .iter()
                .filter(|c| c.disconnected && c.disconnect_called && c.failure.is_none())
                .count(),
            resolve_retries: self.resolve_retries,
            messages_sent: self.conns.iter().map(|c| u64::from(c.sends_done)).sum(),
            messages_received: self.conns.iter().map(|c| u64::from(c.received)).sum(),
            pump_counters: counters.into(),
            steps,
            failures: self
                .conns
                .iter()
                .filter_map(|c| c.failure.clone())
                .collect(),
            seconds: took.as_secs_f64(),
        }
    }
}

/// Why a connection failed while its completions were handled.
#[derive(Debug)]
enum ConnError {
    /// A verbs or CM call failed.
    Cm(CmError),
    /// A work request completed in error (not a flush by teardown).
    Completion {
        what: &'static str,
        status: u32,
        text: &'static str,
    },
}

impl ConnError {
    fn completion(what: &'static str, completion: &Completion) -> Self {
        ConnError::Completion {
            what,
            status: completion.status.as_raw(),
            text: completion.status_str(),
        }
    }
}

impl From<CmError> for ConnError {
    fn from(e: CmError) -> Self {
        ConnError::Cm(e)
    }
}

impl std::fmt::Display for ConnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnError::Cm(e) => e.fmt(f),
            ConnError::Completion { what, status, text } => {
                write!(f, "{what} completed in error: {text} (status {status})")
            }
        }
    }
}

/// Diagnostics go to stderr, one line each, so that stdout stays the report (or JSON).
fn log_line(line: &str) {
    eprintln!("cmnotify: {line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(base: Instant, start_us: u64, end_us: u64) -> Span {
        Span {
            start: Some(base + Duration::from_micros(start_us)),
            end: Some(base + Duration::from_micros(end_us)),
        }
    }

    #[test]
    fn step_stats_follow_cmtime() {
        let base = Instant::now();
        let spans = [
            span(base, 0, 100),
            span(base, 50, 350),
            Span::default(),
            Span {
                start: Some(base),
                end: None,
            },
        ];
        let stats = StepStats::from_spans("connect", &spans, 4);
        assert_eq!(stats.count, 2);
        assert_eq!(stats.total_us, 350, "first start to last end");
        assert_eq!(stats.avg_per_conn_us, 350 / 4);
        assert_eq!(stats.sum_us, 400);
        assert_eq!(stats.us_per_conn, 100);
        assert_eq!((stats.max_us, stats.min_us), (300, 100));
    }

    #[test]
    fn a_step_nobody_completed_is_all_zeroes() {
        let stats = StepStats::from_spans("disconnect", &[Span::default()], 1);
        assert_eq!(
            stats,
            StepStats {
                step: "disconnect",
                ..StepStats::default()
            }
        );
    }

    #[test]
    fn spans_keep_their_first_start_and_end() {
        let base = Instant::now();
        let mut s = Span::default();
        s.finish(base);
        assert_eq!(s.end, None, "no end without a start");
        s.begin(base);
        s.begin(base + Duration::from_secs(1));
        s.finish(base + Duration::from_millis(3));
        s.finish(base + Duration::from_secs(2));
        assert_eq!(s.duration(), Some(Duration::from_millis(3)));
    }

    #[test]
    fn message_defaults_depend_on_the_role() {
        let client = RealRun::default();
        assert_eq!(client.messages(), 1);
        let server = RealRun {
            server: true,
            ..RealRun::default()
        };
        assert_eq!(server.messages(), 0, "the server echoes by default");
        let ucmatose_like = RealRun {
            messages: Some(10),
            ..server
        };
        assert_eq!(ucmatose_like.messages(), 10);
        assert!(ucmatose_like.receive_size() >= DEFAULT_MESSAGE_SIZE);
    }

    #[test]
    fn the_client_refuses_to_run_without_an_address() {
        let error = run(&RealRun::default()).unwrap_err();
        assert!(matches!(error, CmError::InvalidArgument { .. }), "{error}");
    }

    #[test]
    fn without_a_device_the_run_says_so_in_one_line() {
        if std::path::Path::new("/dev/infiniband/rdma_cm").exists() {
            eprintln!("an RDMA CM device exists: the no-device path is not reachable here");
            return;
        }
        let client = RealRun {
            address: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            ..RealRun::default()
        };
        let error = run(&client).unwrap_err();
        assert!(error.is_no_device(), "{error}");
        let text = error.to_string();
        assert!(text.starts_with("no RDMA device"), "{text}");
        assert!(!text.contains('\n'), "{text}");
    }

    #[test]
    fn json_field_names_are_stable() {
        let report = RealReport {
            backend: "rdma",
            role: "client",
            local: None,
            remote: Some("10.77.1.1:7471".into()),
            connections: 2,
            pump: false,
            messages: 1,
            message_size: 100,
            established: 2,
            via_rtu: 2,
            via_notify: 0,
            already_established_races: 0,
            failed: 0,
            disconnected: 2,
            resolve_retries: 1,
            messages_sent: 2,
            messages_received: 2,
            pump_counters: PumpCounters::default().into(),
            steps: vec![StepStats::from_spans("connect", &[], 2)],
            failures: vec![],
            seconds: 0.25,
        };
        let json = serde_json::to_value(&report).unwrap();
        let mut fields: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut expected = vec![
            "backend",
            "role",
            "local",
            "remote",
            "connections",
            "pump",
            "messages",
            "message_size",
            "established",
            "via_rtu",
            "via_notify",
            "already_established_races",
            "failed",
            "disconnected",
            "resolve_retries",
            "messages_sent",
            "messages_received",
            "pump_counters",
            "steps",
            "failures",
            "seconds",
        ];
        fields.sort_unstable();
        expected.sort_unstable();
        assert_eq!(
            fields, expected,
            "add new fields to this list; never rename"
        );
        let step = &json["steps"][0];
        for key in [
            "step",
            "count",
            "total_us",
            "avg_per_conn_us",
            "sum_us",
            "us_per_conn",
            "max_us",
            "min_us",
        ] {
            assert!(step.get(key).is_some(), "{key}: {step}");
        }
        assert_eq!(json["pump_counters"]["forced"], 0);
    }

    #[test]
    fn the_human_summary_names_every_step_and_the_outcome() {
        let base = Instant::now();
        let steps: Vec<StepStats> = [Step::CreateQp, Step::Connect, Step::Established]
            .iter()
            .map(|s| StepStats::from_spans(s.name(true), &[span(base, 0, 10)], 1))
            .collect();
        let report = RealReport {
            backend: "rdma",
            role: "server",
            local: Some("10.77.1.1:7471".into()),
            remote: None,
            connections: 1,
            pump: true,
            messages: 0,
            message_size: 100,
            established: 1,
            via_rtu: 0,
            via_notify: 1,
            already_established_races: 0,
            failed: 0,
            disconnected: 1,
            resolve_retries: 0,
            messages_sent: 1,
            messages_received: 1,
            pump_counters: PumpCounters::default().into(),
            steps,
            failures: vec![],
            seconds: 0.5,
        };
        assert!(report.is_clean());
        let text = human(&report);
        for needle in [
            "rdma server 10.77.1.1:7471",
            "echoing",
            "create_qp",
            "accept",
            "established 1/1 (by RTU 0, forced by notify 1",
            "pump: forced 0",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
        let unclean = RealReport {
            disconnected: 0,
            ..report
        };
        assert!(!unclean.is_clean());
    }
}
