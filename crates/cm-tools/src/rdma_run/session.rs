//! The run itself: one [`Endpoint`] over the real transport, and the application's
//! answer to each event it yields.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use cm_core::{AsyncEventType, CmError, QueueCaps, Transport};
use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{
    CloseReason, ConnError, ConnTimes, ConnectOptions, ConnectionId, Endpoint, EstablishedVia,
    Event, ListenOptions, PrivateData, Trigger,
};

use super::report::{RealReport, Span, Step, StepStats};
use super::{
    RealRun, ESTABLISH_TIMEOUT, IDLE_TIMEOUT, RECEIVE_SLOTS, RESOLVE_ATTEMPTS, RESOLVE_TIMEOUT,
    SEND_SLOTS,
};

/// One connection as the run sees it (a retried address resolution keeps its slot).
struct Conn {
    /// The endpoint's handle of the current attempt (`None`: connect failed at once).
    handle: Option<ConnectionId>,
    spans: [Span; Step::ALL.len()],
    attempts: u32,
    established: Option<EstablishedVia>,
    sends_posted: u32,
    sends_done: u32,
    received: u32,
    /// Echoes waiting for a free send buffer.
    pending: VecDeque<Vec<u8>>,
    /// When it is given up if nothing happens (set once established).
    idle_deadline: Option<Duration>,
    disconnect_called: bool,
    /// Set once the endpoint reported it closed.
    closed: Option<CloseReason>,
    failure: Option<String>,
}

impl Conn {
    fn new(handle: Option<ConnectionId>) -> Self {
        Conn {
            handle,
            spans: [Span::default(); Step::ALL.len()],
            attempts: 1,
            established: None,
            sends_posted: 0,
            sends_done: 0,
            received: 0,
            pending: VecDeque::new(),
            idle_deadline: None,
            disconnect_called: false,
            closed: None,
            failure: None,
        }
    }

    fn span(&mut self, step: Step) -> &mut Span {
        &mut self.spans[step.index()]
    }

    fn is_done(&self) -> bool {
        self.closed.is_some()
    }

    /// The setup steps the endpoint timed.
    fn take_times(&mut self, times: &ConnTimes) {
        let spans = [
            (Step::ResolveAddr, Some(times.started), times.addr_resolved),
            (
                Step::ResolveRoute,
                times.addr_resolved,
                times.route_resolved,
            ),
            (Step::CreateQp, times.create_qp_called, times.qp_created),
            (Step::Connect, times.connect_called, times.connect_returned),
            (Step::Established, times.connect_returned, times.established),
        ];
        for (step, start, end) in spans {
            if start.is_some() && end.is_some() {
                self.spans[step.index()] = Span::between(start, end);
            }
        }
    }
}

/// The endpoint and what the run knows of its connections.
struct Session {
    config: RealRun,
    endpoint: Endpoint<RdmaTransport>,
    caps: QueueCaps,
    conns: Vec<Conn>,
    by_handle: HashMap<ConnectionId, usize>,
    resolve_retries: u32,
    local: Option<SocketAddr>,
    remote: Option<SocketAddr>,
    /// Set when the device went away or failed: the run stops.
    aborted: Option<String>,
    /// Set when nothing happened for too long: the run stops, what is left failed.
    gave_up: bool,
    /// When the last event arrived.
    last_event: Duration,
}

/// Runs the server or the client to the end and reports. Errors are what stops the run
/// before it starts (no device, the listen address unusable) or a failure of the
/// endpoint itself.
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
    let mut endpoint = Endpoint::new(RdmaTransport::new()?);
    endpoint.set_notify(config.pump);
    let caps = QueueCaps {
        recv_depth: RECEIVE_SLOTS,
        send_depth: SEND_SLOTS as u32,
        buffer_size: u32::try_from(config.receive_size()).unwrap_or(u32::MAX),
    };
    let mut session = Session {
        config: config.clone(),
        endpoint,
        caps,
        conns: Vec::with_capacity(usize::try_from(config.connections).unwrap_or(0)),
        by_handle: HashMap::new(),
        resolve_retries: 0,
        local: None,
        remote: None,
        aborted: None,
        gave_up: false,
        last_event: Duration::ZERO,
    };
    if config.server {
        session.listen()?;
    } else {
        for index in 0..config.connections as usize {
            session.connect(index, 1);
        }
    }
    session.drive().map_err(cm_error)?;
    let took = session.now();
    Ok(session.report(took))
    // The endpoint goes with the session: every connection left, then the listener.
}

impl Session {
    fn now(&self) -> Duration {
        self.endpoint.transport().now()
    }

    fn wanted(&self) -> usize {
        usize::try_from(self.config.connections).unwrap_or(usize::MAX)
    }

    fn server_addr(&self) -> SocketAddr {
        SocketAddr::new(
            self.config
                .address
                .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            self.config.port,
        )
    }

    fn listen(&mut self) -> Result<(), CmError> {
        let addr = SocketAddr::new(
            self.config
                .bind
                .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
            self.config.port,
        );
        let options = ListenOptions {
            backlog: u16::try_from(self.config.connections.min(1024)).unwrap_or(1024),
            caps: self.caps,
            // Each request is answered here: the ones beyond -c are refused.
            auto_accept: false,
            private_data: PrivateData::empty(),
            establish_timeout: Some(ESTABLISH_TIMEOUT),
        };
        let listener = self.endpoint.listen(addr, options).map_err(cm_error)?;
        self.local = self.endpoint.listener_addr(listener).map_err(cm_error)?;
        Ok(())
    }

    /// Starts (or, for a retried resolution, restarts) client connection `index`.
    fn connect(&mut self, index: usize, attempt: u32) {
        let options = ConnectOptions {
            source: self.config.bind.map(|ip| SocketAddr::new(ip, 0)),
            caps: self.caps,
            private_data: PrivateData::empty(),
            resolve_timeout: RESOLVE_TIMEOUT,
            timeout: Some(ESTABLISH_TIMEOUT),
        };
        match self.endpoint.connect(self.server_addr(), options) {
            Ok(handle) => {
                let mut conn = Conn::new(Some(handle));
                conn.attempts = attempt;
                self.by_handle.insert(handle, index);
                self.put(index, conn);
            }
            Err(error) => {
                // No handle: nothing will be reported for it.
                let mut conn = Conn::new(None);
                conn.attempts = attempt;
                conn.failure = Some(format!("connection {index}: connect: {error}"));
                conn.closed = Some(CloseReason::Disconnected);
                self.put(index, conn);
            }
        }
    }

    fn put(&mut self, index: usize, conn: Conn) {
        if index < self.conns.len() {
            self.conns[index] = conn;
        } else {
            self.conns.push(conn);
        }
    }

    fn finished(&self) -> bool {
        self.aborted.is_some()
            || self.gave_up
            || (self.conns.len() >= self.wanted() && self.conns.iter().all(Conn::is_done))
    }

    /// The earliest time the run must look again without an event: an established
    /// connection's idle deadline, or, once any connection exists (a server's first
    /// request), the end of the run's patience without any event.
    fn next_deadline(&self) -> Option<Duration> {
        let idle = self
            .conns
            .iter()
            .filter(|c| !c.is_done())
            .filter_map(|c| c.idle_deadline);
        let overall =
            (!self.conns.is_empty()).then(|| self.last_event.saturating_add(IDLE_TIMEOUT));
        idle.chain(overall).min()
    }

    /// The library's loop, and the application's answer to each event.
    fn drive(&mut self) -> Result<(), ConnError> {
        while !self.finished() {
            let timeout = self
                .next_deadline()
                .map(|deadline| deadline.saturating_sub(self.now()));
            match self.endpoint.next_event(timeout)? {
                Some(event) => {
                    self.last_event = self.now();
                    self.on_event(event);
                }
                None => self.expire(),
            }
        }
        Ok(())
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Request { conn, .. } => self.on_request(conn),
            Event::Established { conn, via, .. } => self.on_established(conn, via),
            Event::Sent { conn } => {
                if let Some(index) = self.index(conn) {
                    self.conns[index].sends_done += 1;
                    self.progress(index);
                    self.flush_echoes(index);
                    self.check_exchange_done(index);
                }
            }
            Event::Received { conn, data } => self.on_received(conn, data),
            Event::Closed { conn, reason } => self.on_closed(conn, reason),
            Event::ListenerClosed { reason, .. } => {
                let addr = self.local.map_or_else(|| "-".into(), |a| a.to_string());
                self.abort(format!(
                    "the listener on {addr} closed: {}",
                    describe(&reason)
                ));
            }
            // Port and GID changes need no answer here (the pump counts them as passed
            // through); a fatal device error ends the run.
            Event::Device(event) => {
                if event.event_type == AsyncEventType::DeviceFatal && self.aborted.is_none() {
                    let addr = self.local.map_or_else(|| "-".into(), |a| a.to_string());
                    self.abort(format!(
                        "the RDMA device under {addr} reported a fatal error"
                    ));
                }
            }
            Event::NotifyFailed { conn, qp, error } => {
                log_line(&format!("{conn} ({qp}): notify refused: {error}"));
            }
        }
    }

    fn index(&self, conn: ConnectionId) -> Option<usize> {
        self.by_handle.get(&conn).copied()
    }

    fn on_request(&mut self, handle: ConnectionId) {
        if self.conns.len() >= self.wanted() || self.aborted.is_some() {
            // Beyond -c: refused.
            if let Err(error) = self.endpoint.reject_request(handle, &PrivateData::empty()) {
                log_line(&format!("refusing a request beyond -c: {error}"));
            }
            return;
        }
        let index = self.conns.len();
        self.conns.push(Conn::new(Some(handle)));
        self.by_handle.insert(handle, index);
        if self.remote.is_none() {
            self.remote = self
                .endpoint
                .info(handle)
                .ok()
                .and_then(|info| info.peer_addr);
        }
        if let Err(error) = self.endpoint.accept_request(handle, &PrivateData::empty()) {
            // Its Closed (SetupFailed) follows.
            self.conns[index].failure = Some(format!("connection {index}: accept: {error}"));
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
        conn.established = Some(via);
        if let Some(info) = &info {
            conn.take_times(&info.times);
        }
        let messages = self.config.messages();
        if messages > 0 {
            conn.span(Step::Exchange).begin(now);
            let size = self.config.message_size;
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
        if self.config.server && self.config.messages() == 0 {
            self.conns[index].pending.push_back(data);
            self.flush_echoes(index);
        }
        self.check_exchange_done(index);
    }

    /// Sends the echoes waiting for a buffer, until the send queue is full (the next
    /// [`Event::Sent`] frees one).
    fn flush_echoes(&mut self, index: usize) {
        let Some(handle) = self.conns[index].handle else {
            return;
        };
        while let Some(data) = self.conns[index].pending.front() {
            match self.endpoint.send(handle, data) {
                Ok(()) => {
                    self.conns[index].pending.pop_front();
                    self.conns[index].sends_posted += 1;
                }
                // The next Sent frees a buffer; a connection closed meanwhile has its
                // Closed queued.
                Err(ConnError::SendQueueFull(_) | ConnError::UnknownConnection(_)) => return,
                Err(error) => return self.give_up(index, format!("echo: {error}")),
            }
        }
    }

    /// Notes the end of the exchange (this side's messages sent and as many received)
    /// and then disconnects, when this side initiates: a client always, a server when
    /// it sends first. A side with no messages disconnects once established.
    fn check_exchange_done(&mut self, index: usize) {
        let messages = self.config.messages();
        let initiates = !self.config.server || messages > 0;
        let now = self.now();
        let conn = &mut self.conns[index];
        if conn.established.is_none() || conn.sends_done < messages || conn.received < messages {
            return;
        }
        if messages > 0 {
            conn.span(Step::Exchange).finish(now);
        }
        if !initiates || conn.disconnect_called || conn.is_done() {
            return;
        }
        let Some(handle) = conn.handle else {
            return;
        };
        match self.endpoint.disconnect(handle) {
            Ok(()) => {
                conn.disconnect_called = true;
                conn.span(Step::Disconnect).begin(now);
            }
            // The peer disconnected first, in the same batch: its Closed follows.
            Err(ConnError::UnknownConnection(_)) => {}
            Err(error) => {
                conn.failure = Some(format!("connection {index}: disconnect: {error}"));
            }
        }
    }

    /// Whether the connection's exchange is complete (always, with no messages).
    fn exchanged(&self, conn: &Conn) -> bool {
        self.config.messages() == 0 || conn.spans[Step::Exchange.index()].end.is_some()
    }

    fn on_closed(&mut self, handle: ConnectionId, reason: CloseReason) {
        let Some(index) = self.by_handle.remove(&handle) else {
            return;
        };
        let now = self.now();
        let conn = &mut self.conns[index];
        if conn.disconnect_called {
            conn.span(Step::Disconnect).finish(now);
        }
        // An address resolution that failed is retried on a new connection.
        if let CloseReason::AddressError { status } = reason {
            if !self.config.server && conn.attempts < RESOLVE_ATTEMPTS {
                let attempt = conn.attempts + 1;
                self.resolve_retries += 1;
                log_line(&format!(
                    "connection {index}: ADDR_ERROR (status {status}), attempt {attempt} of {RESOLVE_ATTEMPTS}"
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
            let addr = self.local.map_or_else(|| "-".into(), |a| a.to_string());
            self.abort(format!("the RDMA device under {addr} {what}"));
        }
        let conn = &mut self.conns[index];
        if conn.failure.is_none() {
            conn.failure = match &reason {
                CloseReason::Disconnected if conn.established.is_none() => {
                    Some("disconnected before it was established".into())
                }
                CloseReason::Disconnected => None,
                other => Some(describe(other)),
            }
            .map(|why| format!("connection {index}: {why}"));
        }
        conn.closed = Some(reason);
        let conn = &self.conns[index];
        if conn.established.is_some() && conn.failure.is_none() && !self.exchanged(conn) {
            let messages = self.config.messages();
            let why = format!(
                "connection {index}: disconnected before the exchange completed (sent {}/{messages}, received {}/{messages})",
                conn.sends_done, conn.received
            );
            self.conns[index].failure = Some(why);
        }
    }

    /// Something happened on an established connection: its idle deadline moves.
    fn progress(&mut self, index: usize) {
        let deadline = self.now().saturating_add(IDLE_TIMEOUT);
        self.conns[index].idle_deadline = Some(deadline);
    }

    /// A deadline of the run passed with no event.
    fn expire(&mut self) {
        let now = self.now();
        for index in 0..self.conns.len() {
            let conn = &self.conns[index];
            if !conn.is_done() && conn.idle_deadline.is_some_and(|d| d <= now) {
                let messages = self.config.messages();
                let why = format!(
                    "nothing happened for {} s (sent {}/{messages}, received {}/{messages})",
                    IDLE_TIMEOUT.as_secs(),
                    conn.sends_done,
                    conn.received
                );
                self.give_up(index, why);
            }
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
        conn.failure
            .get_or_insert_with(|| format!("connection {index}: {why}"));
        if conn.closed.is_none() {
            conn.closed = Some(CloseReason::TimedOut);
            if let Some(handle) = conn.handle {
                self.by_handle.remove(&handle);
                let _ = self.endpoint.disconnect(handle);
            }
        }
    }

    /// Stops the run; `main` prints the reason as the one line on stderr.
    fn abort(&mut self, why: String) {
        self.aborted = Some(why);
    }

    fn report(&self, took: Duration) -> RealReport {
        let server = self.config.server;
        let messages = self.config.messages();
        let steps = Step::ALL
            .iter()
            .filter(|step| match step {
                Step::ResolveAddr | Step::ResolveRoute => !server,
                Step::Exchange => messages > 0,
                // An echoing server never disconnects: its clients do.
                Step::Disconnect => !server || messages > 0,
                _ => true,
            })
            .map(|&step| {
                let spans: Vec<Span> = self.conns.iter().map(|c| c.spans[step.index()]).collect();
                StepStats::from_spans(step.name(server), &spans, self.config.connections)
            })
            .collect();
        let count = |pick: fn(EstablishedVia) -> bool| {
            self.conns
                .iter()
                .filter(|c| c.established.is_some_and(pick))
                .count()
        };
        let established = count(|_| true);
        let via_comm_est =
            count(|via| matches!(via, EstablishedVia::Notify(Trigger::AsyncEvent(_))));
        let via_receive =
            count(|via| matches!(via, EstablishedVia::Notify(Trigger::ReceiveCompletion)));
        let via_notify = via_comm_est + via_receive;
        let unstarted = self.wanted().saturating_sub(self.conns.len());
        let remote = if server {
            self.remote
        } else {
            Some(self.server_addr())
        };
        RealReport {
            backend: "rdma",
            role: if server { "server" } else { "client" },
            local: self.local.map(|a| a.to_string()),
            remote: remote.map(|a| a.to_string()),
            connections: self.config.connections,
            pump: self.config.pump,
            messages,
            message_size: self.config.message_size,
            established,
            via_rtu: established - via_notify,
            via_notify,
            via_comm_est,
            via_receive,
            already_established_races: count(|via| matches!(via, EstablishedVia::RtuWonRace(_))),
            failed: self.conns.iter().filter(|c| c.failure.is_some()).count() + unstarted,
            disconnected: self
                .conns
                .iter()
                .filter(|c| c.closed == Some(CloseReason::Disconnected) && c.failure.is_none())
                .count(),
            timed_out: self
                .conns
                .iter()
                .filter(|c| c.closed == Some(CloseReason::TimedOut))
                .count(),
            aborted: self.aborted.clone(),
            resolve_retries: self.resolve_retries,
            messages_sent: self.conns.iter().map(|c| u64::from(c.sends_done)).sum(),
            messages_received: self.conns.iter().map(|c| u64::from(c.received)).sum(),
            pump_counters: self.endpoint.counters().into(),
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

/// One line for why a connection ended.
fn describe(reason: &CloseReason) -> String {
    match reason {
        CloseReason::Disconnected => "disconnected".into(),
        CloseReason::Rejected { reason, .. } => format!("rejected by the peer ({reason})"),
        CloseReason::Unreachable { status } => format!("UNREACHABLE (status {status})"),
        CloseReason::AddressError { status } => format!("ADDR_ERROR (status {status})"),
        CloseReason::RouteError { status } => format!("ROUTE_ERROR (status {status})"),
        CloseReason::ConnectError { status } => format!("CONNECT_ERROR (status {status})"),
        CloseReason::DeviceRemoved => "the RDMA device was removed".into(),
        CloseReason::DeviceFatal => "the RDMA device reported a fatal error".into(),
        CloseReason::QpError { detail } => format!("QP error ({detail:?})"),
        CloseReason::TimedOut => "timed out (connect/establish deadline)".into(),
        CloseReason::SetupFailed(error) => format!("setup failed: {error}"),
        CloseReason::RejectedHere => "refused here".into(),
    }
}

/// The endpoint's setup calls and its loop fail only with a backend error; anything
/// else (not expected there) is named generically.
fn cm_error(error: ConnError) -> CmError {
    match error {
        ConnError::Cm(e) => e,
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
