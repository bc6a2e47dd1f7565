//! What the endpoint has to report, and taking it in O(1).
//!
//! Nothing is kept in one long list of events. Each connection keeps what it has to
//! report itself (a few flags, its received messages, its close), and a ready queue
//! names the connections that have something, each at most once; endpoint-wide events
//! (listener ends, device events) sit in their own bounded queue. A waiting call that
//! wants one connection's message goes straight to that connection; `accept` has its
//! own queue of accepted connections. Entries that went stale (taken by another call,
//! or the connection is gone) are skipped when met and dropped in bulk when they
//! outnumber the live ones, so every take is O(1) amortised and every queue stays
//! within a bound of the number of connections.

use std::collections::VecDeque;

use cm_core::Transport;

use super::table::entry_in;
use super::{
    CloseReason, ConnError, ConnState, ConnectionId, Endpoint, Entry, EstablishedVia, Event, Inbox,
    PrivateData,
};
use crate::Role;

/// Endpoint-wide events ([`Event::ListenerClosed`], [`Event::Device`]) kept for the
/// application at most; past it the oldest is dropped and counted.
pub const ENDPOINT_EVENT_BACKLOG: usize = 1024;

/// Connections closed but not yet reported ([`Event::Closed`] or a
/// [`ConnError::Closed`]) kept at most; past it a close is not kept (its handle then
/// names nothing) and counted. Connections a [`crate::handle::Connection`] holds (or a
/// listener's accept queue) are kept whatever this says: their holders bound them.
pub const CLOSED_BACKLOG: usize = 4096;

/// What one connection has to report, in the order it is reported.
#[derive(Debug, Default)]
pub(super) struct Pending {
    /// [`Event::Request`] (manual accept) not yet taken.
    pub(super) request: bool,
    /// [`Event::Established`] not yet taken.
    pub(super) established: bool,
    /// Sends completed since the last [`Event::Sent`] was taken.
    pub(super) sent: u32,
    /// Its place in the ready queue (0: not queued); an entry with another ticket is
    /// stale.
    pub(super) ticket: u32,
    /// Someone holds it (a connection handle): its close is kept whatever
    /// [`CLOSED_BACKLOG`] says, since a holder will ask for it.
    pub(super) held: bool,
    /// Closing ([`Endpoint::close_gracefully`](super::Endpoint::close_gracefully)): disconnected once its
    /// sends in flight have completed.
    pub(super) closing: bool,
    /// On shared queues: a send was refused because the device's send pool was empty,
    /// and it waits in the pool's queue for a buffer to come free.
    pub(super) pool_waiting: bool,
    /// A pool buffer came free for it since: reported as an [`Event::Sent`] (of 0
    /// completions if none of its own completed) so that it tries again.
    pub(super) pool_freed: bool,
    /// [`Event::AddressChanged`] not yet taken (several ADDR_CHANGEs before it is taken
    /// are one event).
    pub(super) address_changed: bool,
    /// [`Event::RouteResolved`] not yet taken (an active connection whose QP the
    /// application makes).
    pub(super) route_resolved: bool,
}

/// A connection that ended but whose end the application has not heard of yet: its
/// id, QP and memory are gone, what it has to report is kept.
#[derive(Debug)]
pub(super) struct ClosedConn {
    /// Its slot's generation (see [`Slot`](super::Slot)).
    pub(super) generation: u32,
    pub(super) reason: CloseReason,
    pub(super) role: Role,
    /// The listener it came to (passive side), so that a connection established and
    /// closed before anyone took it still reaches its listener's `accept`.
    pub(super) listener: Option<crate::ListenerId>,
    pub(super) established: Option<EstablishedVia>,
    pub(super) peer_private: PrivateData,
    /// Messages that arrived while it was established and were not taken.
    pub(super) inbox: VecDeque<Vec<u8>>,
    pub(super) pending: Pending,
    /// What it carried, to the end.
    pub(super) traffic: super::Traffic,
}

/// An entry of the ready queue.
#[derive(Debug, Clone, Copy)]
pub(super) enum Ready {
    /// The connection may have something to report (valid while its ticket matches).
    Conn(ConnectionId, u32),
    /// The oldest endpoint-wide event.
    Endpoint,
}

impl<T: Transport> Endpoint<T> {
    /// Puts `conn` in the ready queue unless it is there already.
    pub(super) fn mark_ready(&mut self, conn: ConnectionId) {
        if self.pending_mut(conn).is_some_and(|p| p.ticket == 0) {
            self.requeue(conn);
        }
    }

    /// Puts `conn` at the end of the ready queue, where it is there or not (its close
    /// is reported after what was queued before it).
    pub(super) fn requeue(&mut self, conn: ConnectionId) {
        self.next_ticket = self.next_ticket.wrapping_add(1).max(1);
        let ticket = self.next_ticket;
        let Some(pending) = self.pending_mut(conn) else {
            return;
        };
        pending.ticket = ticket;
        self.ready.push_back(Ready::Conn(conn, ticket));
        self.compact_ready();
    }

    /// Queues an endpoint-wide event (bounded: the oldest goes first).
    pub(super) fn push_endpoint_event(&mut self, event: Event) {
        if self.endpoint_events.len() >= ENDPOINT_EVENT_BACKLOG {
            if let Some(Event::ListenerClosed { .. }) = self.endpoint_events.pop_front() {
                self.listener_closed_pending -= 1;
            }
            self.dropped_events += 1;
        }
        if matches!(event, Event::ListenerClosed { .. }) {
            self.listener_closed_pending += 1;
        }
        self.endpoint_events.push_back(event);
        self.ready.push_back(Ready::Endpoint);
        self.compact_ready();
    }

    /// Drops stale ready entries once they outnumber the live ones: amortised O(1).
    pub(super) fn compact_ready(&mut self) {
        let live = self.live_conns + self.closed_conns + self.endpoint_events.len();
        if self.ready.len() <= 2 * live + 64 {
            return;
        }
        let mut endpoint_markers = self.endpoint_events.len();
        let slots = &self.slots;
        self.ready.retain(|entry| match *entry {
            Ready::Conn(conn, ticket) => slots.get(conn.index()).is_some_and(|s| {
                s.generation() == conn.generation()
                    && match s.entry() {
                        Some(Entry::Live(c)) => c.pending.ticket == ticket,
                        Some(Entry::Closed(c)) => c.pending.ticket == ticket,
                        None => false,
                    }
            }),
            Ready::Endpoint => {
                let keep = endpoint_markers > 0;
                endpoint_markers = endpoint_markers.saturating_sub(1);
                keep
            }
        });
    }

    /// Drops stale `accept` and setup entries once they outnumber the live ones.
    pub(super) fn compact_accepted(&mut self) {
        let live = self.live_conns + self.closed_conns;
        for queue in [&mut self.accepted, &mut self.to_set_up] {
            if queue.len() > 2 * live + 64 {
                queue.retain(|&conn| entry_in(&self.slots, conn).is_some());
            }
        }
    }

    /// The oldest thing to report, from the ready queue. O(1) amortised.
    pub(crate) fn try_next_event(&mut self) -> Option<Event> {
        while let Some(ready) = self.take_ready() {
            match ready {
                Err(event) => return Some(event),
                Ok(conn) => {
                    if let Some(event) = self.take_conn_event(conn) {
                        if self.has_pending(conn) {
                            self.mark_ready(conn);
                        }
                        return Some(event);
                    }
                }
            }
        }
        None
    }

    /// For a caller that routes news itself (the connection handles): the next
    /// connection with something new (its news stays on it, to be taken by `try_recv`,
    /// `try_established`, `send`, …), or the oldest endpoint-wide event. O(1)
    /// amortised.
    pub(crate) fn take_ready(&mut self) -> Option<Result<ConnectionId, Event>> {
        while let Some(entry) = self.ready.pop_front() {
            match entry {
                Ready::Endpoint => {
                    if let Some(event) = self.endpoint_events.pop_front() {
                        if matches!(event, Event::ListenerClosed { .. }) {
                            self.listener_closed_pending -= 1;
                        }
                        return Some(Err(event));
                    }
                }
                Ready::Conn(conn, ticket) => {
                    let Some(pending) = self.pending_mut(conn).filter(|p| p.ticket == ticket)
                    else {
                        continue;
                    };
                    pending.ticket = 0;
                    return Some(Ok(conn));
                }
            }
        }
        None
    }

    /// Whether `conn` closed and its close is not yet reported. O(1).
    pub(crate) fn is_closed(&self, conn: ConnectionId) -> bool {
        self.closed(conn).is_some()
    }

    /// The peer's private data of `conn`: the REQ's on a passive connection (from its
    /// request on), the REP's on an active one once established; live, or closed and not
    /// yet reported. `None` for an unknown connection or an active one not yet
    /// established (its record then holds our own REQ data, or nothing). O(1).
    ///
    /// Reading it takes nothing. Taking the connection's [`Event::Established`]
    /// (`next_event`, `poll`) moves the data into that event, after which this answers
    /// empty data; the handles never take that event (they route with
    /// [`Endpoint::take_ready`]), so for them it holds until the record is freed.
    pub(crate) fn peer_private_data(&self, conn: ConnectionId) -> Option<PrivateData> {
        if let Some(entry) = self.live(conn) {
            let known = entry.role == Role::Passive || entry.established_via().is_some();
            return known.then(|| entry.rare.private());
        }
        let closed = self.closed(conn)?;
        let known = closed.role == Role::Passive || closed.established.is_some();
        known.then(|| closed.peer_private.clone())
    }

    /// `conn`'s next thing to report, in its order: request, established, messages,
    /// notify failure, sent, closed.
    fn take_conn_event(&mut self, conn: ConnectionId) -> Option<Event> {
        if self.live(conn).is_some() {
            return self.take_live_event(conn);
        }
        let closed = self.closed_mut(conn)?;
        if closed.pending.established {
            closed.pending.established = false;
            let (role, via) = (
                closed.role,
                closed.established.unwrap_or(EstablishedVia::Handshake),
            );
            let private_data = std::mem::take(&mut closed.peer_private);
            return Some(Event::Established {
                conn,
                role,
                via,
                private_data,
            });
        }
        if let Some(data) = closed.inbox.pop_front() {
            self.held_messages -= 1;
            return Some(Event::Received { conn, data });
        }
        if closed.pending.sent > 0 {
            let completed = std::mem::take(&mut closed.pending.sent);
            return Some(Event::Sent { conn, completed });
        }
        let reason = self.free_closed(conn);
        Some(Event::Closed { conn, reason })
    }

    fn take_live_event(&mut self, conn: ConnectionId) -> Option<Event> {
        let entry = self.live_mut(conn)?;
        // A request always came to a listener: a connection without one has none to
        // report.
        if let (true, Some(listener)) = (std::mem::take(&mut entry.pending.request), entry.listener)
        {
            return Some(Event::Request {
                listener,
                conn,
                private_data: entry.rare.private(),
            });
        }
        if std::mem::take(&mut entry.pending.route_resolved) {
            return Some(Event::RouteResolved { conn });
        }
        if entry.pending.established {
            entry.pending.established = false;
            return Some(Event::Established {
                conn,
                role: entry.role,
                via: entry.established_via().unwrap_or(EstablishedVia::Handshake),
                private_data: entry.rare.take_private(),
            });
        }
        if let Some(data) = self.take_message(conn) {
            return Some(Event::Received { conn, data });
        }
        let entry = self.live_mut(conn)?;
        if let (Some(error), Some(qp)) = (entry.rare.notify_failed(), entry.qp.get()) {
            entry.rare.set_notify_failed(None);
            return Some(Event::NotifyFailed { conn, qp, error });
        }
        if std::mem::take(&mut entry.pending.address_changed) {
            return Some(Event::AddressChanged { conn });
        }
        if entry.pending.sent > 0 || entry.pending.pool_freed {
            entry.pending.pool_freed = false;
            let completed = std::mem::take(&mut entry.pending.sent);
            return Some(Event::Sent { conn, completed });
        }
        None
    }

    /// Whether `conn` has anything left to report.
    fn has_pending(&self, conn: ConnectionId) -> bool {
        if let Some(entry) = self.live(conn) {
            let p = &entry.pending;
            return p.request
                || p.route_resolved
                || p.established
                || entry.rare.notify_failed().is_some()
                || p.address_changed
                || p.sent > 0
                || p.pool_freed
                || (entry.state == ConnState::Established && !entry.inbox.is_empty());
        }
        self.closed(conn).is_some()
    }

    /// The next message of an established connection, its receive posted again (the
    /// peer may send one more). `None` when there is none.
    pub(super) fn take_message(&mut self, conn: ConnectionId) -> Option<Vec<u8>> {
        let (transport, entry) = self.split(conn)?;
        if entry.state != ConnState::Established || entry.pending.established {
            return None;
        }
        let (slot, data) = entry.inbox.pop_front()?;
        if entry.inbox.is_empty() {
            // An idle connection keeps no message memory (a server may hold a million).
            entry.inbox = Inbox::default();
        }
        let posted = match entry.buffers.as_ref() {
            Some(buffers) => transport.post_recv(&entry.id, buffers, slot, u64::from(slot)),
            None => Ok(()),
        };
        self.held_messages -= 1;
        if let Err(error) = posted {
            self.close(conn, CloseReason::SetupFailed(error), true);
        }
        Some(data)
    }

    /// For `recv`: `conn`'s next message, its end, or nothing yet. Answers at once for a
    /// connection that is closed or unknown.
    pub(crate) fn try_recv(&mut self, conn: ConnectionId) -> Option<Result<Vec<u8>, ConnError>> {
        if let Some(entry) = self.live_mut(conn) {
            if entry.state == ConnState::Established {
                // Reading it is taking it: its ESTABLISHED is no longer news.
                entry.pending.established = false;
            }
            return self.take_message(conn).map(Ok);
        }
        let Some(closed) = self.closed_mut(conn) else {
            return Some(Err(ConnError::UnknownConnection(conn)));
        };
        closed.pending.established = false;
        if let Some(data) = closed.inbox.pop_front() {
            self.held_messages -= 1;
            return Some(Ok(data));
        }
        let reason = self.free_closed(conn);
        Some(Err(ConnError::Closed { conn, reason }))
    }

    /// For `established`: how `conn` got established (its event consumed), its end, or
    /// nothing yet. Answers at once for a connection that is closed or unknown.
    pub(crate) fn try_established(
        &mut self,
        conn: ConnectionId,
    ) -> Option<Result<EstablishedVia, ConnError>> {
        if let Some(entry) = self.live_mut(conn) {
            let via = entry.established_via()?;
            entry.pending.established = false;
            return Some(Ok(via));
        }
        let Some(closed) = self.closed_mut(conn) else {
            return Some(Err(ConnError::UnknownConnection(conn)));
        };
        // Established is a fact about the past: a connection that got there and closed
        // since still answers how (its close comes from `recv` or `next_event`).
        if let Some(via) = closed.established {
            closed.pending.established = false;
            return Some(Ok(via));
        }
        let reason = closed.reason.clone();
        if closed.inbox.is_empty() {
            self.free_closed(conn);
        }
        Some(Err(ConnError::Closed { conn, reason }))
    }

    /// For `accept`: the oldest passive connection whose ESTABLISHED nobody took yet, or
    /// a listener's end. O(1) amortised.
    pub(crate) fn try_accept(&mut self) -> Option<Result<ConnectionId, ConnError>> {
        while let Some(conn) = self.accepted.pop_front() {
            if let Some(pending) = self.pending_mut(conn) {
                if pending.established {
                    pending.established = false;
                    return Some(Ok(conn));
                }
            }
        }
        if self.listener_closed_pending == 0 {
            return None;
        }
        // At most ENDPOINT_EVENT_BACKLOG entries, and only while a listener end waits.
        let position = self
            .endpoint_events
            .iter()
            .position(|e| matches!(e, Event::ListenerClosed { .. }))?;
        self.listener_closed_pending -= 1;
        match self.endpoint_events.remove(position)? {
            Event::ListenerClosed { listener, reason } => {
                Some(Err(ConnError::ListenerClosed { listener, reason }))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use cm_mock::sim::{SimConfig, SimTransports};

    use crate::{ConnError, ConnectOptions, Endpoint, ListenOptions, CLOSED_BACKLOG};

    /// Closes past [`CLOSED_BACKLOG`] are not kept, except those of connections a
    /// handle holds: a mass disconnect leaves every held connection its close.
    #[test]
    fn held_connections_keep_their_close_past_the_backlog() {
        let count = CLOSED_BACKLOG + 8;
        let SimTransports {
            fabric,
            server,
            client,
        } = SimTransports::new(SimConfig::default(), 91);
        let mut server = Endpoint::new(server);
        let mut client = Endpoint::new(client);
        let addr = server.transport().addr(7491);
        server.listen(addr, ListenOptions::default()).unwrap();
        // In rounds, each within the listener's limit of connections in setup.
        let mut outs = Vec::new();
        let mut accepted = Vec::new();
        while outs.len() < count {
            let round = (count - outs.len()).min(512);
            outs.extend((0..round).map(|_| client.connect(addr, ConnectOptions::default())));
            loop {
                server.process().unwrap();
                accepted.extend(std::iter::from_fn(|| server.try_accept()).map(Result::unwrap));
                client.process().unwrap();
                if !fabric.step() {
                    break;
                }
            }
        }
        assert_eq!(accepted.len(), count);
        // Every other connection is held, as a connection handle holds it.
        for conn in accepted.iter().step_by(2) {
            server.hold(*conn, true);
        }
        for out in outs {
            client.disconnect(out.unwrap()).unwrap();
        }
        loop {
            server.process().unwrap();
            client.process().unwrap();
            if !fabric.step() {
                break;
            }
        }
        assert_eq!(server.connection_count(), 0);
        for conn in accepted.iter().step_by(2) {
            assert!(
                matches!(server.try_recv(*conn), Some(Err(ConnError::Closed { .. }))),
                "{conn}: a held connection's close is kept"
            );
        }
        assert!(
            server.stats().dropped_events > 0,
            "the unheld ones past the backlog were not kept"
        );
    }
}
