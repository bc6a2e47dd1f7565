//! The fabric's pending actions, run in (due time, scheduling order).
//!
//! Nearly every action is scheduled a fixed delay after "now" (wire latency, resolve
//! delay, CM timeouts), and the clock never goes back, so the actions of one delay
//! arrive already sorted: each such delay gets a FIFO lane, and only the irregular
//! delays (random fault delays) go to a binary heap. Popping compares the few lane
//! heads and the heap top, so the cost no longer grows with the number pending, and
//! the order is exactly that of one heap over (due time, sequence number).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::tables::BlockQueue;

/// More distinct fixed delays than this go to the heap (still in order, only slower).
const MAX_LANES: usize = 16;

/// One pending item with its position in the order.
#[derive(Debug)]
struct Entry<T> {
    at: u64,
    seq: u64,
    item: T,
}

impl<T> Entry<T> {
    fn key(&self) -> (u64, u64) {
        (self.at, self.seq)
    }
}

/// Wraps an entry for the max-heap so the earliest (then first scheduled) is on top.
#[derive(Debug)]
struct Earliest<T>(Entry<T>);

impl<T> PartialEq for Earliest<T> {
    fn eq(&self, other: &Self) -> bool {
        self.0.key() == other.0.key()
    }
}
impl<T> Eq for Earliest<T> {}
impl<T> PartialOrd for Earliest<T> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for Earliest<T> {
    fn cmp(&self, other: &Self) -> Ordering {
        other.0.key().cmp(&self.0.key())
    }
}

/// The items scheduled with one fixed delay, in (due time, sequence) order.
#[derive(Debug)]
struct Lane<T> {
    delay: u64,
    /// Block-built: a lane that grows to a whole run's connections never copies, and the
    /// blocks it frees serve the lane that peaks next.
    fifo: BlockQueue<Entry<T>>,
}

/// Where the next item to run sits.
#[derive(Debug, Clone, Copy)]
enum Source {
    Lane(usize),
    Heap,
}

/// A priority queue of items keyed by (due time, sequence number), where the sequence
/// number is the scheduling order; specialised for items scheduled a fixed delay after
/// a clock that never goes back.
#[derive(Debug)]
pub(crate) struct Schedule<T> {
    seq: u64,
    lanes: Vec<Lane<T>>,
    heap: BinaryHeap<Earliest<T>>,
    len: usize,
}

impl<T> Default for Schedule<T> {
    fn default() -> Self {
        Schedule {
            seq: 0,
            lanes: Vec::new(),
            heap: BinaryHeap::new(),
            len: 0,
        }
    }
}

impl<T> Schedule<T> {
    /// Schedules `item` at `now + delay`, for a delay that recurs (a configured
    /// latency or timeout): it joins the FIFO lane of that delay.
    pub(crate) fn push_fixed(&mut self, now: u64, delay: u64, item: T) {
        let entry = self.entry(now.saturating_add(delay), item);
        let lane = match self.lanes.iter().position(|lane| lane.delay == delay) {
            Some(index) => Some(index),
            None if self.lanes.len() < MAX_LANES => {
                self.lanes.push(Lane {
                    delay,
                    fifo: BlockQueue::default(),
                });
                Some(self.lanes.len() - 1)
            }
            None => None,
        };
        match lane {
            // A lane only takes an entry that sorts after its tail, so each lane stays
            // sorted even if a caller's clock went back.
            Some(index)
                if self.lanes[index]
                    .fifo
                    .back()
                    .is_none_or(|tail| tail.key() < entry.key()) =>
            {
                self.lanes[index].fifo.push_back(entry);
            }
            _ => self.heap.push(Earliest(entry)),
        }
    }

    /// Schedules `item` at `at`, for an irregular (e.g. random) due time.
    pub(crate) fn push_at(&mut self, at: u64, item: T) {
        let entry = self.entry(at, item);
        self.heap.push(Earliest(entry));
    }

    fn entry(&mut self, at: u64, item: T) -> Entry<T> {
        self.seq += 1;
        self.len += 1;
        Entry {
            at,
            seq: self.seq,
            item,
        }
    }

    /// How many items are pending.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The due time of the next item, if any.
    pub(crate) fn next_due(&self) -> Option<u64> {
        self.next().map(|(key, _)| key.0)
    }

    /// Takes the item with the smallest (due time, sequence) and its due time.
    pub(crate) fn pop(&mut self) -> Option<(u64, T)> {
        let (_, source) = self.next()?;
        let entry = match source {
            Source::Lane(index) => self.lanes[index].fifo.pop_front(),
            Source::Heap => self.heap.pop().map(|earliest| earliest.0),
        }?;
        self.len -= 1;
        Some((entry.at, entry.item))
    }

    /// The smallest key among the lane heads and the heap top, and where it is.
    fn next(&self) -> Option<((u64, u64), Source)> {
        let mut best = self.heap.peek().map(|top| (top.0.key(), Source::Heap));
        for (index, lane) in self.lanes.iter().enumerate() {
            if let Some(head) = lane.fifo.front() {
                if best.is_none_or(|(key, _)| head.key() < key) {
                    best = Some((head.key(), Source::Lane(index)));
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SplitMix64;

    /// Runs a random mix of fixed-delay and irregular pushes and pops against a sorted
    /// reference, with the clock moving forward as items run.
    fn check_against_reference(seed: u64, fixed_delays: &[u64]) {
        let mut rng = SplitMix64::new(seed);
        let mut schedule = Schedule::default();
        let mut reference: Vec<(u64, u64)> = Vec::new();
        let mut seq = 0;
        let mut now = 0;
        for _ in 0..5_000 {
            if rng.chance(0.55) || reference.is_empty() {
                seq += 1;
                let at = if rng.chance(0.8) {
                    let delay = fixed_delays[rng.up_to(fixed_delays.len() as u64 - 1) as usize];
                    schedule.push_fixed(now, delay, seq);
                    now + delay
                } else {
                    let at = now + rng.up_to(1_000);
                    schedule.push_at(at, seq);
                    at
                };
                reference.push((at, seq));
            } else {
                reference.sort_unstable_by(|a, b| b.cmp(a));
                let expected = reference.pop();
                assert_eq!(schedule.next_due(), expected.map(|e| e.0));
                let (at, item) = schedule.pop().unwrap();
                assert_eq!(Some((at, item)), expected);
                now = now.max(at);
            }
            assert_eq!(schedule.len(), reference.len());
        }
        reference.sort_unstable();
        let rest: Vec<_> = std::iter::from_fn(|| schedule.pop()).collect();
        assert_eq!(rest, reference);
        assert_eq!(schedule.next_due(), None);
    }

    #[test]
    fn pops_in_due_time_then_scheduling_order() {
        for seed in 0..20 {
            check_against_reference(seed, &[10, 10, 50, 0, 700, 1_000]);
        }
    }

    #[test]
    fn more_delays_than_lanes_still_in_order() {
        let delays: Vec<u64> = (0..3 * MAX_LANES as u64).map(|d| d * 37).collect();
        for seed in 0..5 {
            check_against_reference(seed, &delays);
        }
    }

    #[test]
    fn equal_due_times_keep_scheduling_order() {
        let mut schedule = Schedule::default();
        schedule.push_fixed(0, 20, "a");
        schedule.push_at(20, "b");
        schedule.push_fixed(10, 10, "c");
        schedule.push_fixed(0, 20, "d");
        let order: Vec<_> = std::iter::from_fn(|| schedule.pop()).collect();
        assert_eq!(order, [(20, "a"), (20, "b"), (20, "c"), (20, "d")]);
    }

    #[test]
    fn a_clock_going_back_cannot_break_a_lane() {
        let mut schedule = Schedule::default();
        schedule.push_fixed(100, 10, 1);
        schedule.push_fixed(50, 10, 2);
        assert_eq!(schedule.pop(), Some((60, 2)));
        assert_eq!(schedule.pop(), Some((110, 1)));
        assert_eq!(schedule.pop(), None);
    }
}
