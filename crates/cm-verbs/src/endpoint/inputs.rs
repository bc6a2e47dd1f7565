//! What the endpoint does with each input: asynchronous events, completion events, CM
//! events and deadlines. Every handler runs inside `Endpoint::process`.

use cm_core::{
    AsyncEvent, AsyncEventType, CmEvent, CmEventType, CqKind, Errno, Transport, WorkCompletion,
};

use std::cmp::Reverse;

use super::table::live_in;
use super::{
    failure_reason, CloseReason, Conn, ConnState, ConnectionId, Endpoint, EstablishedVia, Event,
    ListenerId, Nanos, Owner, PrivateData, QpErrorDetail, Step, PASS_BATCH, POLL_BATCH,
};
use crate::{PumpEvent, Role};

/// Why a connection's completion queues are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reading {
    /// Its completion event came (or busy polling): every completion counts, a failed
    /// one closes it, a receive may trigger the notify.
    Event,
    /// The CM reported the peer gone: what it sent before is taken; the flush of the
    /// posted receives is not a failure, and no receive triggers a notify.
    PeerLeft,
}

impl<T: Transport> Endpoint<T> {
    // ----- inputs ----------------------------------------------------------------

    pub(super) fn on_async_event(&mut self, device: usize, event: AsyncEvent) {
        match self.pump.on_async_event(event) {
            PumpEvent::PassThrough(event) => self.on_device_event(device, event),
            PumpEvent::Unrouted(event) => {
                tracing::debug!("{event}: no connection owns it");
            }
            pumped => self.on_pumped(None, pumped),
        }
    }

    pub(super) fn on_device_event(&mut self, device: usize, event: AsyncEvent) {
        if self.on_shared_event(device, event) {
            // Reported too: the limit says the pool is short for the load, an error
            // that its connections ended.
            self.push_endpoint_event(Event::Device(event));
            return;
        }
        match event.event_type {
            AsyncEventType::QpFatal | AsyncEventType::QpReqErr | AsyncEventType::QpAccessErr => {
                if let Some(conn) = event.qp_num().and_then(|qp| self.conn_of_qp(qp)) {
                    let detail = QpErrorDetail::AsyncEvent(event);
                    self.close(conn, CloseReason::QpError { detail }, true);
                    return;
                }
            }
            AsyncEventType::DeviceFatal => {
                // Reported before the listeners and connections it ends.
                self.push_endpoint_event(Event::Device(event));
                let key = self.device_keys[device];
                self.device_lost(key, &CloseReason::DeviceFatal);
                return;
            }
            _ => {}
        }
        self.push_endpoint_event(Event::Device(event));
    }

    /// What the pump did with a trigger of `qp`; `owner`: the connection of that QP when
    /// the caller knows it (a receive polled from its queue), else it is looked up.
    pub(super) fn on_pumped(&mut self, owner: Option<ConnectionId>, pumped: PumpEvent) {
        let (qp, via) = match pumped {
            PumpEvent::Forced { qp, trigger } => (qp, EstablishedVia::Notify(trigger)),
            PumpEvent::AlreadyEstablished { qp, trigger } => {
                (qp, EstablishedVia::RtuWonRace(trigger))
            }
            PumpEvent::NotifyFailed { qp, error, .. } => {
                if let Some(conn) = owner.or_else(|| self.conn_of_qp(qp)) {
                    super::trace::notify_failed(conn, qp, error);
                    if let Some(entry) = self.live_mut(conn) {
                        // The latest failure stands for the earlier ones (the
                        // counters count them all).
                        entry.rare.set_notify_failed(Some(error));
                        self.mark_ready(conn);
                    }
                }
                return;
            }
            PumpEvent::PathMigrated { .. } | PumpEvent::Unrouted(_) | PumpEvent::PassThrough(_) => {
                return
            }
        };
        if let Some(conn) = owner.or_else(|| self.conn_of_qp(qp)) {
            super::trace::notified(conn, qp, via);
            if let Some(entry) = self.live_mut(conn) {
                // Before ESTABLISHED; once established, `via` says how and stays.
                if entry.via.is_none() {
                    entry.via = Some(via);
                }
            }
        }
    }

    pub(super) fn on_cq_event(&mut self, conn: ConnectionId) {
        let Some((transport, entry)) = self.split(conn) else {
            return; // a connection closed since: its queues are gone
        };
        // Re-armed before polling, so a completion landing in between raises a new event.
        let mut unarmed = None;
        for kind in [CqKind::Recv, CqKind::Send] {
            if let Err(error) = transport.arm_cq(&entry.id, kind) {
                tracing::warn!("{conn}: re-arming the {kind:?} queue failed, closing: {error}");
                unarmed.get_or_insert((kind, error));
            }
        }
        // What is already there is still taken; after that an unarmed queue raises no
        // event again, and the connection would stall unheard: it ends.
        self.poll_queues(conn, Reading::Event);
        if let Some((kind, error)) = unarmed {
            let detail = QpErrorDetail::ArmFailed {
                kind,
                errno: Errno(error.errno()),
            };
            self.close(conn, CloseReason::QpError { detail }, true);
        }
    }

    /// Busy polling: polls the receive queues of at most [`PASS_BATCH`] accepted
    /// connections whose trigger has not come, in turn; whether a receive among them
    /// forced an establish. Their send queues are left to the completion events (the
    /// endpoint sends nothing before ESTABLISHED; work the application posts itself
    /// still raises its event). Entries of connections that moved on are dropped as
    /// they are met. O(1) per connection polled.
    pub(super) fn poll_awaiting(&mut self) -> bool {
        let forced = self.pump.counters().forced;
        for _ in 0..self.awaiting.len().min(PASS_BATCH) {
            let Some(conn) = self.awaiting.pop_front() else {
                break;
            };
            if !self
                .live(conn)
                .is_some_and(|c| c.state == ConnState::Accepted && c.via.is_none())
            {
                continue;
            }
            self.awaiting.push_back(conn);
            self.poll_queue(conn, CqKind::Recv, Reading::Event);
        }
        self.pump.counters().forced != forced
    }

    /// Drops the stale entries of [`Endpoint::poll_awaiting`]'s queue once they
    /// outnumber the connections (it is read only while busy polling): on every entry
    /// added and every connection gone, amortised O(1).
    pub(super) fn compact_awaiting(&mut self) {
        if self.awaiting.len() <= 2 * self.live_conns + 64 {
            return;
        }
        let slots = &self.slots;
        self.awaiting
            .retain(|&conn| live_in(slots, conn).is_some_and(|c| c.state == ConnState::Accepted));
    }

    /// Polls `conn`'s receive then send queue dry and handles each completion; with
    /// `failures` off, failed completions are skipped (the connection is ending anyway).
    fn poll_queues(&mut self, conn: ConnectionId, reading: Reading) {
        for kind in [CqKind::Recv, CqKind::Send] {
            self.poll_queue(conn, kind, reading);
        }
    }

    /// Polls one of `conn`'s queues dry (see [`Endpoint::poll_queues`]); stops once the
    /// connection is closed, by a completion handled or before.
    fn poll_queue(&mut self, conn: ConnectionId, kind: CqKind, reading: Reading) {
        if self.live(conn).is_some_and(|c| c.application_qp) {
            return; // the application's queues are the application's to read
        }
        if let Some(key) = self.shared_key_of(conn) {
            self.poll_shared(key, kind, Some((conn, reading)));
            return;
        }
        loop {
            let mut batch = std::mem::take(&mut self.completions);
            batch.clear();
            // Looked up again for each batch: a completion handled may close it.
            let Some((transport, entry)) = self.split(conn) else {
                self.completions = batch;
                return;
            };
            let polled = transport.poll_cq(&entry.id, kind, &mut batch, POLL_BATCH);
            let n = match polled {
                Ok(n) => n,
                Err(error) => {
                    tracing::warn!("{conn}: polling the {kind:?} queue failed: {error}");
                    0
                }
            };
            for completion in batch.iter().copied() {
                if reading == Reading::Event || completion.is_success() {
                    self.on_completion(conn, completion, reading);
                }
            }
            self.completions = batch;
            if n < POLL_BATCH {
                return;
            }
        }
    }

    pub(super) fn on_completion(
        &mut self,
        conn: ConnectionId,
        completion: WorkCompletion,
        reading: Reading,
    ) {
        if self.live(conn).is_none() {
            return; // closed by an earlier completion of the batch
        }
        if completion.wr_id & super::APPLICATION_WR_ID != 0 {
            self.on_work_completed(conn, completion);
            if completion.is_success() {
                return;
            }
        }
        if !completion.is_success() {
            if completion.is_flush() {
                if self.seeking_cause {
                    return; // the other queue flushed too: no cause there
                }
                // A flush is a consequence of the QP's error: its cause (RNR or transport
                // retries exceeded, say) is on the other queue, with what completed
                // before it. Read that first, so the close names the cause.
                self.seeking_cause = true;
                let other = match completion.kind {
                    CqKind::Send => CqKind::Recv,
                    CqKind::Recv => CqKind::Send,
                };
                self.poll_queue(conn, other, reading);
                self.seeking_cause = false;
                // No cause of its own: the CM's event will name it.
                self.on_flushed(conn);
                return;
            }
            let detail = QpErrorDetail::Completion(completion.status);
            self.close(conn, CloseReason::QpError { detail }, true);
            return;
        }
        match completion.kind {
            CqKind::Send => {
                if let Some(entry) = self.live_mut(conn) {
                    // In order (RC): the oldest send's buffer is free again.
                    entry.sends_in_flight = entry.sends_in_flight.saturating_sub(1);
                    entry.pending.sent = entry.pending.sent.saturating_add(1);
                    self.mark_ready(conn);
                    self.send_completed(conn);
                }
            }
            CqKind::Recv => self.on_received(conn, completion, reading),
        }
    }

    /// The application's own work completed: kept for it (bounded by the connection's
    /// `work_depth`), and the connection marked as having news.
    fn on_work_completed(&mut self, conn: ConnectionId, completion: WorkCompletion) {
        let Some(bound) = self.live(conn).map(|c| c.caps.work_depth.max(1) as usize) else {
            return;
        };
        let done = self.work_done.entry(conn).or_default();
        if done.len() >= bound {
            done.pop_front();
            self.dropped_events += 1;
        }
        done.push_back(completion);
        self.mark_ready(conn);
    }

    pub(super) fn on_received(
        &mut self,
        conn: ConnectionId,
        completion: WorkCompletion,
        reading: Reading,
    ) {
        self.receive_trigger(conn, &completion, reading);
        let slot = completion.wr_id as u32;
        let Some((transport, entry)) = self.split(conn) else {
            return;
        };
        // Empty: the transport fills it with the message's one copy. The receive is
        // posted again only when the application takes the message.
        let mut data = Vec::new();
        let read = match entry.buffers.as_ref() {
            Some(buffers) => transport.read_recv(
                &entry.id,
                buffers,
                slot,
                completion.byte_len as usize,
                &mut data,
            ),
            None => Ok(()),
        };
        if let Err(error) = read {
            self.close(conn, CloseReason::SetupFailed(error), true);
            return;
        }
        self.hold_message(conn, slot, data);
    }

    /// A receive on `conn`, to the pump first: on a passive connection whose RTU is
    /// late, it is what forces the establish. Not once the peer left: the CM is past
    /// it, and a notify would only fail.
    pub(super) fn receive_trigger(
        &mut self,
        conn: ConnectionId,
        completion: &WorkCompletion,
        reading: Reading,
    ) {
        if reading == Reading::Event {
            if let Some(pumped) = self.pump.on_receive_completion(completion.qp) {
                self.on_pumped(Some(conn), pumped);
            }
        }
    }

    /// Holds a message received on `conn` (from receive buffer `slot` of its own, or
    /// copied out of the shared pool) until the application takes it; the trigger was
    /// handled already.
    pub(super) fn hold_message(&mut self, conn: ConnectionId, slot: u32, data: Vec<u8>) {
        let Some(entry) = self.live_mut(conn) else {
            return;
        };
        if entry.inbox.capacity() == 0 {
            // Room for one (a push would make room for four): most connections hold
            // one message at a time, and a server may hold a million connections.
            entry.inbox.reserve_exact(1);
        }
        entry.traffic.count_received(data.len());
        entry.inbox.push_back((slot, data));
        let deliverable = entry.state == ConnState::Established;
        self.held_messages += 1;
        if deliverable {
            self.mark_ready(conn);
        }
    }

    /// Reads the completions that came on `conn` before its end was read (CM events
    /// are read before completions in a pass), so that what the peer sent before it
    /// left is delivered, and the sends it acknowledged are reported, before the close.
    pub(super) fn drain_completions(&mut self, conn: ConnectionId) {
        self.poll_queues(conn, Reading::PeerLeft);
    }

    /// A passive connection the CM reports disconnected before it reported it
    /// established, which holds a message of the peer's: the message shows the peer
    /// was established, so this side is too ([`EstablishedVia::PeerMessage`], or the
    /// notify that forced the CM when its ESTABLISHED lost the race with the DREQ).
    /// Its messages and close follow, as for any established connection.
    fn establish_by_peer_message(&mut self, conn: ConnectionId) {
        let Some(entry) = self.live_mut(conn) else {
            return;
        };
        let proven = !entry.inbox.is_empty() || entry.via.is_some();
        if entry.role != Role::Passive || entry.state != ConnState::Accepted || !proven {
            return;
        }
        if entry.via.is_none() {
            entry.via = Some(EstablishedVia::PeerMessage);
        }
        self.on_established(conn, &[]);
    }

    pub(super) fn on_cm_event(&mut self, event: T::Event) {
        let kind = event.event_type();
        if kind == CmEventType::ConnectRequest {
            self.on_connect_request(&event);
            return;
        }
        let Some(id) = self.transport.event_id(&event) else {
            return;
        };
        // A connection's id carries its slot where the transport keeps a context;
        // listeners, and connections on a transport that keeps none, are indexed.
        let owner = match self.transport.event_context(&event) {
            Some(index) => self.conn_with_id(index, &id).map(Owner::Conn),
            None => self.by_id.get(&self.transport.id_key(&id)).copied(),
        };
        match owner {
            Some(Owner::Listener(listener)) => self.on_listener_event(listener, kind),
            Some(Owner::Conn(conn)) => self.on_conn_event(conn, &event),
            None => tracing::debug!("{kind} for an id no longer owned"),
        }
    }

    pub(super) fn on_listener_event(&mut self, listener: ListenerId, kind: CmEventType) {
        match kind {
            CmEventType::DeviceRemoval => {}
            CmEventType::AddrChange => {
                return self.push_endpoint_event(Event::ListenerAddressChanged { listener });
            }
            _ => return,
        }
        let Some(key) = self
            .listener_entry(listener)
            .map(|l| l.device.or_else(|| self.transport.device_key(&l.id)))
        else {
            return;
        };
        match key {
            // This listener ends with everything else on the device, its reader given
            // back as lost.
            Some(key) => self.device_removed(key),
            None => {
                if let Some(entry) = self.take_listener(listener) {
                    self.by_id.remove(&self.transport.id_key(&entry.id));
                }
                self.push_endpoint_event(Event::ListenerClosed {
                    listener,
                    reason: CloseReason::DeviceRemoved,
                });
            }
        }
    }

    pub(super) fn on_connect_request(&mut self, event: &T::Event) {
        let (Some(id), Some(listen_id)) = (
            self.transport.event_id(event),
            self.transport.event_listener(event),
        ) else {
            return;
        };
        let listener = match self.by_id.get(&self.transport.id_key(&listen_id)) {
            Some(&Owner::Listener(listener)) => listener,
            _ => {
                // The listener is gone: refuse rather than leave the peer retrying.
                let _ = self.transport.reject(&id, &[]);
                return;
            }
        };
        let Some(listening) = self.listener_entry_mut(listener) else {
            return;
        };
        if listening.in_setup >= listening.options.max_in_setup {
            // A flood holds no more than the bound: refused before anything is set up.
            let bound = listening.options.max_in_setup;
            self.requests_refused += 1;
            tracing::debug!("{listener}: a request was refused, {bound} connections in setup");
            if let Err(error) = self.transport.reject(&id, &[]) {
                tracing::debug!("{listener}: reject: {error}");
            }
            return;
        }
        listening.in_setup += 1;
        let options = listening.options.clone();
        let now = self.transport.now();
        let mut entry = Conn::new(id, Role::Passive, ConnState::Requested, options.caps, now);
        entry.listener = Some(listener);
        entry
            .rare
            .set_private(PrivateData::from(event.private_data()));
        if !options.auto_accept {
            entry.deadline = Nanos::new(options.request_timeout.map(|t| now.saturating_add(t)));
        }
        let conn = self.insert(entry);
        super::trace::requested(conn, listener);
        if let Some(deadline) = self.live(conn).and_then(|c| c.deadline.get()) {
            self.deadlines.push(Reverse((deadline, conn)));
        }
        if options.auto_accept {
            // Set up once the channel has been read (see `Endpoint::set_up_requests`).
            self.to_set_up.push_back(conn);
        } else if let Some(entry) = self.live_mut(conn) {
            entry.pending.request = true;
            self.mark_ready(conn);
        }
    }

    pub(super) fn on_conn_event(&mut self, conn: ConnectionId, event: &T::Event) {
        let _span = super::trace::conn_span(conn).entered();
        let status = event.status();
        super::trace::cm_event(conn, event.event_type(), status);
        let result = match event.event_type() {
            CmEventType::AddrResolved => {
                let now = self.transport.now();
                let (id, timeout) = match self.live_mut(conn) {
                    Some(c) => {
                        c.times.mark(Step::AddrResolved, now);
                        (c.id.clone(), c.resolve_timeout.get())
                    }
                    None => return,
                };
                self.transport.resolve_route(&id, timeout)
            }
            CmEventType::RouteResolved => {
                let now = self.transport.now();
                let application_qp = self.live_mut(conn).is_some_and(|c| {
                    c.times.mark(Step::RouteResolved, now);
                    c.application_qp
                });
                if application_qp {
                    // The application makes its QP, then connects.
                    if let Some(c) = self.live_mut(conn) {
                        c.state = ConnState::AwaitingQp;
                        c.pending.route_resolved = true;
                    }
                    self.mark_ready(conn);
                    return;
                }
                self.connect_resolved(conn)
            }
            CmEventType::Established => {
                if let Some(qp) = self.live(conn).and_then(|c| c.qp.get()) {
                    self.pump.on_cm_event(CmEventType::Established, Some(qp));
                }
                self.on_established(conn, event.private_data());
                Ok(())
            }
            CmEventType::AddrError
            | CmEventType::RouteError
            | CmEventType::Unreachable
            | CmEventType::ConnectError
            | CmEventType::Rejected => {
                let reason = failure_reason(event.event_type(), status, event.private_data());
                self.close(conn, reason, false);
                Ok(())
            }
            CmEventType::Disconnected => {
                // What the peer sent before it left comes first.
                self.drain_completions(conn);
                self.establish_by_peer_message(conn);
                // Our DREP: the peer's teardown waits for it.
                self.close(conn, CloseReason::Disconnected, true);
                Ok(())
            }
            CmEventType::DeviceRemoval => {
                let key = self
                    .live(conn)
                    .and_then(|c| c.device.or_else(|| self.transport.device_key(&c.id)));
                match key {
                    // This connection ends with everything else on the device, its
                    // reader given back as lost.
                    Some(key) => self.device_removed(key),
                    None => self.close(conn, CloseReason::DeviceRemoved, false),
                }
                Ok(())
            }
            CmEventType::AddrChange => {
                // The connection carries on; the application decides (a bond that failed
                // over keeps it working, an address that moved away may not).
                if let Some(entry) = self.live_mut(conn) {
                    entry.rare.count_address_change();
                    entry.pending.address_changed = true;
                    self.mark_ready(conn);
                }
                Ok(())
            }
            other => {
                tracing::debug!("{conn}: {other} ignored");
                Ok(())
            }
        };
        if let Err(error) = result {
            self.close(conn, CloseReason::SetupFailed(error), false);
        }
    }

    pub(super) fn on_established(&mut self, conn: ConnectionId, private_data: &[u8]) {
        let now = self.transport.now();
        let Some(entry) = self.live_mut(conn) else {
            return;
        };
        if entry.state == ConnState::Established {
            return; // exactly once, whatever the CM says twice
        }
        if entry.role == Role::Active {
            let timer = entry.rare.take_params().min_rnr_timer;
            if let Err(error) = self.apply_min_rnr_timer(conn, timer) {
                self.close(conn, CloseReason::SetupFailed(error), false);
                return;
            }
        }
        let Some(entry) = self.live_mut(conn) else {
            return;
        };
        let via = entry.via.unwrap_or(EstablishedVia::Handshake);
        entry.via = Some(via);
        super::trace::established(conn, via);
        entry.times.mark(Step::Established, now);
        entry.state = ConnState::Established;
        entry.deadline = Nanos::NONE;
        entry.pending.established = true;
        if entry.role == Role::Active {
            entry.rare.set_private(PrivateData::from(private_data));
        }
        let passive = entry.role == Role::Passive;
        let listener = entry.listener;
        self.left_setup(listener);
        // Messages held until now follow the event: they are in the inbox already.
        self.mark_ready(conn);
        if passive {
            self.accepted.push_back(conn);
            self.compact_accepted();
        }
    }

    /// Closes the connections whose deadline passed, at most [`PASS_BATCH`]; whether
    /// more are due. O(log n) per deadline.
    pub(super) fn expire(&mut self) -> bool {
        // The earliest deadlines of connections that moved on (established, closed) go
        // first, a bounded number: when none left applies, the clock is not read (a
        // read is a system call where the clock source has no vDSO, as in a VM).
        for _ in 0..PASS_BATCH {
            match self.deadlines.peek() {
                Some(&Reverse((due, conn))) if !deadline_applies(self.live(conn), due) => {
                    self.deadlines.pop();
                }
                _ => break,
            }
        }
        let Some(&Reverse((first, _))) = self.deadlines.peek() else {
            return false;
        };
        let now = self.transport.now();
        if first > now {
            return false;
        }
        let mut expired = 0;
        while let Some(&Reverse((due, conn))) = self.deadlines.peek() {
            if due > now {
                break;
            }
            if expired == PASS_BATCH {
                return true;
            }
            self.deadlines.pop();
            if deadline_applies(self.live(conn), due) {
                let unanswered = self
                    .live(conn)
                    .filter(|c| c.state == ConnState::Requested)
                    .map(|c| c.id.clone());
                if let Some(id) = unanswered {
                    // A request the application did not answer in time: the peer hears
                    // a REJ now rather than retrying its REQ for a minute.
                    if let Err(error) = self.transport.reject(&id, &[]) {
                        tracing::debug!("{conn}: reject: {error}");
                    }
                }
                self.close_expired(conn);
                expired += 1;
            }
        }
        self.compact_deadlines();
        false
    }

    /// Drops deadlines that no longer apply once they outnumber the connections.
    pub(super) fn compact_deadlines(&mut self) {
        if self.deadlines.len() <= 2 * self.live_conns + 64 {
            return;
        }
        let slots = &self.slots;
        self.deadlines
            .retain(|&Reverse((due, conn))| deadline_applies(live_in(slots, conn), due));
    }
}

/// Whether the deadline `due` of a connection (`None`: not live) still applies: it is
/// live, not established (or its QP flushed), and `due` is its current deadline.
fn deadline_applies<T: Transport>(conn: Option<&Conn<T>>, due: std::time::Duration) -> bool {
    conn.is_some_and(|c| {
        (c.state != ConnState::Established || c.flushed) && c.deadline.get() == Some(due)
    })
}

#[cfg(test)]
mod tests {
    use cm_core::{CqKind, QueueCaps, WcStatus, WorkCompletion};

    use crate::{CloseReason, ConnError, ConnectOptions, QpErrorDetail, APPLICATION_WR_ID};

    use super::Reading;

    /// A failed one-sided work request closes its connection (its QP is in the error
    /// state); the application still learns which of its earlier requests completed,
    /// in order, before the close.
    #[test]
    fn a_failed_one_sided_completion_keeps_the_successes_before_it() {
        let options = ConnectOptions {
            caps: QueueCaps {
                work_depth: 4,
                ..QueueCaps::default()
            },
            ..ConnectOptions::default()
        };
        let (_fabric, _server, _, mut client, out) =
            super::super::flush::tests::established(81, options);
        let qp = client.info(out).unwrap().qp.expect("a QP");
        let work = |n: u64, status| WorkCompletion {
            wr_id: APPLICATION_WR_ID | n,
            qp,
            kind: CqKind::Send,
            status,
            byte_len: 0,
        };
        client.on_completion(out, work(1, WcStatus::Success), Reading::Event);
        client.on_completion(out, work(2, WcStatus::Success), Reading::Event);
        client.on_completion(out, work(3, WcStatus::RemAccessErr), Reading::Event);
        let taken: Vec<u64> =
            std::iter::from_fn(|| client.take_work_completion(out).ok().flatten())
                .map(|done| done.wr_id & !APPLICATION_WR_ID)
                .collect();
        assert_eq!(taken, [1, 2, 3], "every completion, in order");
        let closed = client.take_work_completion(out);
        assert!(
            matches!(
                closed,
                Err(ConnError::Closed {
                    reason: CloseReason::QpError {
                        detail: QpErrorDetail::Completion(WcStatus::RemAccessErr)
                    },
                    ..
                })
            ),
            "then the close: {closed:?}"
        );
    }
}
