//! A QP's receive and completion queues on the transport, kept small for scale runs:
//! posted receives as a compact run, everything else in a pooled busy part held only
//! while something is outstanding.

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroU16;

use cm_core::WorkCompletion;

/// A QP's state on the transport, kept small because a scale run holds one per
/// connection and side: the compact run of posted receives inline, everything else
/// (payloads, completions, receives posted out of order) in a [`Busy`] that only QPs
/// with something outstanding hold.
#[derive(Debug)]
pub(super) struct Queues {
    pub(super) token: u64,
    /// Everything beyond the compact state; `None` while it would be empty, as an idle
    /// connection's is.
    pub(super) busy: Option<Box<Busy>>,
    /// The first receives of the posted FIFO, as a run: `len` work request ids from
    /// `first`, each the next modulo `wrap` (the receive depth). The connection API
    /// posts slot numbers as ids and reposts each slot as it is read, so its posted
    /// receives stay one such run however long it runs.
    run: Run,
}

// An idle QP costs its transport 24 bytes in the slot table: checked when compiling.
const _: () = assert!(std::mem::size_of::<Option<Queues>>() == 24);

/// A run of posted receive ids `first, first + 1, …` modulo `wrap`.
#[derive(Debug, Clone, Copy)]
struct Run {
    len: u32,
    first: u16,
    /// The QP's receive depth (at most 16384 by [`QueueCaps::validate`]); never 0, which
    /// also lets `Option<Queues>` take no room of its own.
    ///
    /// [`QueueCaps::validate`]: cm_core::QueueCaps::validate
    wrap: NonZeroU16,
}

impl Run {
    /// Whether `wr_id` can go at the end of the run.
    fn continues(&self, wr_id: u64) -> bool {
        let wrap = u64::from(self.wrap.get());
        wr_id < wrap
            && self.len < u32::MAX
            && (self.len == 0 || wr_id == (u64::from(self.first) + u64::from(self.len)) % wrap)
    }

    /// Appends `wr_id`, which [`Run::continues`] the run.
    fn push(&mut self, wr_id: u64) {
        if self.len == 0 {
            // Below `wrap`, a u16: checked by `continues`.
            self.first = wr_id as u16;
        }
        self.len += 1;
    }

    /// Takes the first id of a non-empty run.
    fn pop(&mut self) -> u64 {
        let wr_id = self.first;
        self.first = ((u32::from(wr_id) + 1) % u32::from(self.wrap.get())) as u16;
        self.len -= 1;
        u64::from(wr_id)
    }
}

/// The parts of a QP's state that are empty while the connection is idle.
#[derive(Debug, Default)]
pub(super) struct Busy {
    /// Posted receives after the run, in order: ids that did not continue it (or came
    /// while some were already here).
    posted: VecDeque<u64>,
    /// Payloads that arrived with no receive posted (the real QP would RNR-retry them).
    pub(super) unposted: VecDeque<(Vec<u8>, u32)>,
    pub(super) landed: HashMap<u64, Vec<u8>>,
    pub(super) recv: VecDeque<WorkCompletion>,
    pub(super) send: VecDeque<WorkCompletion>,
}

impl Busy {
    /// Entries a pooled [`Busy`] keeps room for in each queue: what a connection with
    /// a few messages in flight needs, no more, so the pool stays small.
    const POOLED_ROOM: usize = 16;

    fn is_empty(&self) -> bool {
        self.posted.is_empty()
            && self.unposted.is_empty()
            && self.landed.is_empty()
            && self.recv.is_empty()
            && self.send.is_empty()
    }

    /// Gives back room beyond [`Busy::POOLED_ROOM`] of an empty one, before pooling it.
    fn trim(&mut self) {
        self.posted.shrink_to(Self::POOLED_ROOM);
        self.unposted.shrink_to(Self::POOLED_ROOM);
        self.landed.shrink_to(Self::POOLED_ROOM);
        self.recv.shrink_to(Self::POOLED_ROOM);
        self.send.shrink_to(Self::POOLED_ROOM);
    }
}

impl Queues {
    pub(super) fn new(token: u64, recv_depth: NonZeroU16) -> Self {
        Queues {
            token,
            busy: None,
            run: Run {
                len: 0,
                first: 0,
                wrap: recv_depth,
            },
        }
    }

    /// The busy part, taken from `pool` (or allocated) when the QP had none.
    pub(super) fn busy(&mut self, pool: &mut Pool) -> &mut Busy {
        self.busy.get_or_insert_with(|| pool.take())
    }

    /// Appends a posted receive to the FIFO: to the run while it continues it and
    /// nothing follows it.
    pub(super) fn post(&mut self, wr_id: u64, pool: &mut Pool) {
        let behind = self.busy.as_ref().is_some_and(|b| !b.posted.is_empty());
        if !behind && self.run.continues(wr_id) {
            self.run.push(wr_id);
        } else {
            self.busy(pool).posted.push_back(wr_id);
        }
    }

    /// Takes the first posted receive; when that empties the run, the ids waiting
    /// behind it that form a run become the new one.
    pub(super) fn take_posted(&mut self) -> Option<u64> {
        let wr_id = if self.run.len > 0 {
            self.run.pop()
        } else {
            self.busy.as_mut()?.posted.pop_front()?
        };
        if self.run.len == 0 {
            if let Some(busy) = self.busy.as_mut() {
                while let Some(&next) = busy.posted.front() {
                    if !self.run.continues(next) {
                        break;
                    }
                    busy.posted.pop_front();
                    self.run.push(next);
                }
            }
        }
        Some(wr_id)
    }

    /// Puts the busy part back in `pool` once it is empty, so that an idle connection
    /// holds nothing beyond its [`Queues`] and a busy one reuses a warm allocation.
    pub(super) fn settle(&mut self, pool: &mut Pool) {
        if self.busy.as_ref().is_some_and(|b| b.is_empty()) {
            if let Some(busy) = self.busy.take() {
                pool.give(busy);
            }
        }
    }
}

/// Empty [`Busy`] parts kept for reuse, so that a connection going busy and idle in
/// turn (every message) allocates nothing once warm.
#[derive(Debug, Default)]
pub(super) struct Pool {
    /// Boxed because a part moves between a QP and the pool as it is: neither way
    /// allocates.
    #[allow(clippy::vec_box)]
    parts: Vec<Box<Busy>>,
}

impl Pool {
    /// Parts kept at most: enough for the connections that carry traffic at one time
    /// in the benches, small next to the QPs themselves.
    const MAX: usize = 64;

    /// A pooled part, or a new one.
    fn take(&mut self) -> Box<Busy> {
        self.parts.pop().unwrap_or_default()
    }

    /// Keeps an empty part for reuse (trimmed), or drops it when the pool is full.
    fn give(&mut self, mut busy: Box<Busy>) {
        if self.parts.len() < Self::MAX {
            busy.trim();
            self.parts.push(busy);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SplitMix64;

    /// The posted receives answer exactly as a plain FIFO of ids, whatever mix of runs,
    /// out-of-order slots and ids beyond the depth is posted.
    #[test]
    fn posted_receives_keep_their_order_in_every_form() {
        let mut rng = SplitMix64::new(5);
        let mut pool = Pool::default();
        for depth in [1u16, 2, 5, 16] {
            let mut queues = Queues::new(7, NonZeroU16::new(depth).unwrap());
            let mut model = VecDeque::new();
            for _ in 0..20_000 {
                if rng.chance(0.5) {
                    let next = model
                        .back()
                        .map_or(0, |&last: &u64| last.wrapping_add(1) % u64::from(depth));
                    let wr_id = match rng.up_to(9) {
                        0 => rng.up_to(u64::from(depth) * 2),
                        1 => u64::MAX - rng.up_to(1),
                        _ => next,
                    };
                    queues.post(wr_id, &mut pool);
                    model.push_back(wr_id);
                } else {
                    assert_eq!(queues.take_posted(), model.pop_front());
                }
            }
            while let Some(wr_id) = model.pop_front() {
                assert_eq!(queues.take_posted(), Some(wr_id));
            }
            assert_eq!(queues.take_posted(), None);
            queues.settle(&mut pool);
            assert!(queues.busy.is_none(), "emptied, the busy part goes back");
        }
    }

    /// The connection API's pattern (slots posted in order, each reposted as it is
    /// read) stays a run: no busy part at rest, however many messages went through.
    #[test]
    fn reposting_slots_in_order_stays_a_run() {
        let mut pool = Pool::default();
        let mut queues = Queues::new(0, NonZeroU16::new(4).unwrap());
        for slot in 0..4 {
            queues.post(slot, &mut pool);
        }
        for message in 0..10 {
            assert_eq!(queues.take_posted(), Some(message % 4));
            queues.post(message % 4, &mut pool);
            assert!(queues.busy.is_none());
        }
        assert_eq!(queues.run.len, 4);
    }
}
