//! Closing a connection gracefully: what was sent is delivered first, then the DREQ
//! (as a TCP close, or UCX's `ucp_ep_close_nbx` unless forced).

use cm_core::Transport;

use super::{ConnError, ConnState, ConnectionId, Endpoint};

impl<T: Transport> Endpoint<T> {
    /// Closes the connection once every message sent on it has completed (the peer's
    /// QP acknowledged it, or the connection failed), then disconnects (DREQ) and
    /// forgets it as [`Endpoint::disconnect`] does: nothing more is reported of it and
    /// its handle names nothing. Sends are refused from now on
    /// ([`ConnError::WrongState`]); messages that arrive meanwhile are dropped with it.
    /// With nothing in flight (or on a connection not established) it disconnects at
    /// once. A peer that stops acknowledging ends the wait with the QP's retries, after
    /// which the connection fails and is forgotten. [`Endpoint::disconnect`] is the
    /// forced close: the DREQ at once, sends in flight lost. O(1).
    pub fn close_gracefully(&mut self, conn: ConnectionId) -> Result<(), ConnError> {
        let Some(entry) = self.live_mut(conn) else {
            return self.disconnect(conn);
        };
        if entry.state != ConnState::Established || entry.sends_in_flight == 0 {
            return self.disconnect(conn);
        }
        entry.pending.closing = true;
        Ok(())
    }

    /// A send of `conn` completed: a closing connection with nothing more in flight is
    /// disconnected now.
    pub(super) fn send_completed(&mut self, conn: ConnectionId) {
        let drained = self
            .live(conn)
            .is_some_and(|c| c.pending.closing && c.sends_in_flight == 0);
        if drained {
            self.forget(conn);
        }
    }

    /// Whether `conn` is closing ([`Endpoint::close_gracefully`]): its sends are refused.
    pub(super) fn is_closing(&self, conn: ConnectionId) -> bool {
        self.live(conn).is_some_and(|c| c.pending.closing)
    }
}
