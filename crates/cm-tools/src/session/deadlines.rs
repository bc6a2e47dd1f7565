//! The run's patience: each established connection's idle deadline (kept in a heap
//! once [`Session::drive`] runs) and the run's own, and what happens when one passes.

use std::cmp::Reverse;
use std::time::Duration;

use cm_core::Transport;

use super::record::{nanos, Flag, UNSET};
use super::{log_line, Session, IDLE_TIMEOUT};

impl<T: Transport> Session<T> {
    /// The earliest time the run must look again without an event: an established
    /// connection's idle deadline, or, once any connection exists (a server's first
    /// request), the end of the run's patience without any event.
    pub(super) fn next_deadline(&mut self) -> Option<Duration> {
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

    /// Something happened on an established connection (the event at `last_event`): its
    /// idle deadline moves.
    pub(super) fn progress(&mut self, index: usize) {
        let deadline = nanos(self.last_event.saturating_add(IDLE_TIMEOUT));
        let conn = &mut self.conns[index];
        conn.idle_deadline = deadline;
        if self.idle_kept && !conn.flag(Flag::IdleQueued) {
            conn.set_flag(Flag::IdleQueued, true);
            self.idle.push(Reverse((deadline, index as u32)));
        }
    }

    /// Starts keeping the idle heap: every open connection with a deadline joins it.
    pub(super) fn keep_idle(&mut self) {
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
    pub(super) fn expire(&mut self) {
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
}
