//! The session's answer to each event the endpoint yields: a request accepted or
//! refused, a connection established (its messages sent), a message received (echoed),
//! a send completed, a connection closed (an address resolution retried), and what
//! each answer leaves on the connection's record.

use std::collections::VecDeque;
use std::time::Duration;

use cm_core::{AsyncEventType, Transport};
use cm_verbs::{
    CloseReason, ConnError, ConnTimes, ConnectionId, EstablishedVia, Event, PrivateData,
};

use super::record::{nanos, Closed, ConnRecord, Flag, UNSET};
use super::{describe, log_line, Session};
use crate::steps::Step;

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

impl<T: Transport> Session<T> {
    pub(super) fn on_event(&mut self, event: Event) {
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
        let now = self.last_event;
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
            // Once one is refused for want of a buffer (the device's shared send pool
            // all in flight), the rest wait behind it, sent in order as buffers free.
            let mut waiting = false;
            for seq in 0..messages {
                let mut payload =
                    format!("cmnotify connection {index} message {seq}\0").into_bytes();
                payload.resize(size, 0);
                if waiting {
                    self.conns[index].queue_echo(payload);
                    continue;
                }
                match self.endpoint.send(handle, &payload) {
                    Ok(()) => self.conns[index].sends_posted += 1,
                    Err(ConnError::SendQueueFull(_)) => {
                        waiting = true;
                        self.conns[index].queue_echo(payload);
                    }
                    // Closed meanwhile: its Closed follows (an incomplete exchange).
                    Err(ConnError::UnknownConnection(_)) => return,
                    Err(error) => return self.give_up(index, format!("send {seq}: {error}")),
                }
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
        let now = self.last_event;
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
    pub(super) fn disconnect(&mut self, index: usize) {
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

    /// Fails the connection and closes it (its Closed event is then ignored).
    pub(super) fn give_up(&mut self, index: usize, why: String) {
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
}
