//! The invariants checked after every operation, on both endpoints: the queues of
//! `stats()` within their bounds and a closed handle naming nothing.

use cm_verbs::{ConnError, CLOSED_BACKLOG, ENDPOINT_EVENT_BACKLOG};

use super::world::World;

impl World {
    /// The invariants that hold after every operation, on both endpoints.
    pub(super) fn check(&mut self) {
        let depth = self.caps.recv_depth as usize;
        for side in &mut self.sides {
            let at = &self.at;
            let who = side.who;
            let ep = side.endpoint.lock().unwrap();
            let stats = ep.stats();
            assert_eq!(stats.connections, ep.connection_count(), "{at}");
            assert!(
                stats.closed_unreported <= CLOSED_BACKLOG,
                "{at}: {who:?} {stats:?}"
            );
            assert!(
                stats.endpoint_events <= ENDPOINT_EVENT_BACKLOG,
                "{at}: {who:?} {stats:?}"
            );
            assert!(
                stats.held_messages <= (stats.connections + stats.closed_unreported) * depth,
                "{at}: {who:?} holds more than the receive depths: {stats:?}"
            );
            // The bounds of the ready, accept and deadline queues are taken against
            // the most the side held so far: their stale entries are dropped when
            // entries are added (or deadlines come due), not when connections leave
            // (cm-verbs' ignored `accept_entries_*` and `deadlines_*` tests).
            side.peak = side
                .peak
                .max(stats.connections + stats.closed_unreported + stats.endpoint_events);
            let bound = 2 * side.peak + 64;
            assert!(
                stats.ready_entries <= bound
                    && stats.accept_entries <= bound
                    && stats.deadline_entries <= bound
                    && stats.awaiting_entries <= bound,
                "{at}: {who:?} queues past 2 x {} + 64: {stats:?}",
                side.peak
            );
            for conn in &side.gone {
                assert_eq!(
                    ep.info(*conn).map(drop),
                    Err(ConnError::UnknownConnection(*conn)),
                    "{at}: {who:?} {conn} named nothing, then something"
                );
            }
            let _ = ep.counters();
        }
    }
}
