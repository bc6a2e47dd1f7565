//! The fabric's pending actions, run in (due time, scheduling order).
//!
//! Nearly every action is scheduled a fixed delay after "now" (wire latency, resolve
//! delay, CM timeouts), and the clock never goes back, so the actions of one delay
//! arrive already sorted: each such delay gets a FIFO lane, and only the irregular
//! delays (random fault delays) go to a binary heap. Popping compares the few lane
//! heads and the heap top, so the cost no longer grows with the number pending, and
//! the order is exactly that of one heap over (due time, sequence number).
//!
//! A scale run keeps several actions per connection pending (its timers, its messages
//! in flight), so a lane stores them packed: each entry is its due time and sequence
//! number as varint deltas from the entry before it, then the item's own [`Packed`]
//! bytes. Most entries take a few bytes instead of a fixed struct's tens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::marker::PhantomData;

use super::tables::ByteFifo;

/// More distinct fixed delays than this go to the heap (still in order, only slower).
const MAX_LANES: usize = 16;

/// An item a lane keeps as bytes: written by [`Packed::pack`], read back equal by
/// [`Packed::unpack`].
pub(crate) trait Packed: Sized {
    /// Appends the item's bytes.
    fn pack(self, out: &mut Packer);
    /// Reads back an item [`Packed::pack`] wrote.
    fn unpack(input: &mut Unpacker<'_>) -> Self;
}

/// Where [`Packed::pack`] writes: a scratch buffer the lane then appends whole.
#[derive(Debug, Default)]
pub(crate) struct Packer {
    bytes: Vec<u8>,
    /// The lane's last [`Packer::near`] number.
    last: u32,
}

impl Packer {
    /// One byte.
    pub(crate) fn byte(&mut self, byte: u8) {
        self.bytes.push(byte);
    }

    /// An unsigned number, seven bits a byte (small numbers take one).
    pub(crate) fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.bytes.push(value as u8 | 0x80);
            value >>= 7;
        }
        self.bytes.push(value as u8);
    }

    /// A number likely close to the previous one packed this way in the lane (the ids
    /// of consecutive timers): its difference from it, a byte when they are close.
    pub(crate) fn near(&mut self, value: u32) {
        let delta = value.wrapping_sub(self.last) as i32;
        self.varint(u64::from(((delta << 1) ^ (delta >> 31)) as u32));
        self.last = value;
    }

    /// Raw bytes (the reader knows how many).
    pub(crate) fn bytes(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
    }
}

/// Where [`Packed::unpack`] reads: one record of a lane, from its start.
#[derive(Debug)]
pub(crate) struct Unpacker<'a> {
    bytes: &'a [u8],
    read: usize,
    /// The lane's last [`Unpacker::near`] number.
    last: u32,
}

impl Unpacker<'_> {
    /// One byte.
    #[inline]
    pub(crate) fn byte(&mut self) -> u8 {
        let byte = self.bytes.get(self.read).copied().unwrap_or(0);
        self.read += 1;
        byte
    }

    /// A number [`Packer::varint`] wrote.
    #[inline]
    pub(crate) fn varint(&mut self) -> u64 {
        let first = self.byte();
        if first < 0x80 {
            return u64::from(first);
        }
        let mut value = u64::from(first & 0x7f);
        let mut shift = 7;
        loop {
            let byte = self.byte();
            value |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return value;
            }
            shift += 7;
        }
    }

    /// A number [`Packer::near`] wrote.
    pub(crate) fn near(&mut self) -> u32 {
        let zigzag = self.varint() as u32;
        let delta = (zigzag >> 1) as i32 ^ -((zigzag & 1) as i32);
        self.last = self.last.wrapping_add(delta as u32);
        self.last
    }

    /// Fills `out` with bytes [`Packer::bytes`] wrote.
    pub(crate) fn bytes(&mut self, out: &mut [u8]) {
        let end = (self.read + out.len()).min(self.bytes.len());
        let from = &self.bytes[self.read.min(end)..end];
        out[..from.len()].copy_from_slice(from);
        self.read += out.len();
    }
}

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

/// The items scheduled with one fixed delay, in (due time, sequence) order, packed.
///
/// `bytes` holds the front entry's item, then each later entry as one record: its
/// key's deltas from the entry before it, and its item. The front key is decoded as
/// soon as its entry reaches the front, so peeking costs nothing.
#[derive(Debug)]
struct Lane<T> {
    delay: u64,
    /// Block-built: a lane that grows to a whole run's connections never copies, and the
    /// blocks it frees serve the lane that peaks next.
    bytes: ByteFifo,
    len: usize,
    /// The front entry's key (while `len > 0`).
    head: (u64, u64),
    /// The last entry pushed (the base of the next one's deltas).
    tail: (u64, u64),
    /// The last [`Packer::near`] number packed, and the last unpacked.
    near_packed: u32,
    near_unpacked: u32,
    item: PhantomData<T>,
}

impl<T: Packed> Lane<T> {
    fn new(delay: u64) -> Self {
        Lane {
            delay,
            bytes: ByteFifo::default(),
            len: 0,
            head: (0, 0),
            tail: (0, 0),
            near_packed: 0,
            near_unpacked: 0,
            item: PhantomData,
        }
    }

    /// Appends an entry that sorts after the last one pushed (if any is left).
    fn push(&mut self, entry: Entry<T>, scratch: &mut Packer) {
        let key = entry.key();
        scratch.bytes.clear();
        scratch.last = self.near_packed;
        if self.len == 0 {
            self.head = key;
        } else {
            scratch.varint(key.0 - self.tail.0);
            scratch.varint(key.1 - self.tail.1);
        }
        entry.item.pack(scratch);
        self.near_packed = scratch.last;
        self.bytes.write(&scratch.bytes);
        self.tail = key;
        self.len += 1;
    }

    /// Takes the front entry (the lane is not empty).
    fn pop(&mut self) -> Entry<T> {
        let mut input = Unpacker {
            bytes: self.bytes.front(),
            read: 0,
            last: self.near_unpacked,
        };
        let item = T::unpack(&mut input);
        self.near_unpacked = input.last;
        let (at, seq) = self.head;
        self.len -= 1;
        if self.len > 0 {
            // The next entry's record starts with its key's deltas (its item follows):
            // right after this one, unless this one ended its block.
            if input.read >= input.bytes.len() {
                let read = input.read;
                self.bytes.consume(read);
                input = Unpacker {
                    bytes: self.bytes.front(),
                    read: 0,
                    last: 0,
                };
            }
            let delta = (input.varint(), input.varint());
            self.head = (self.head.0 + delta.0, self.head.1 + delta.1);
        }
        let read = input.read;
        self.bytes.consume(read);
        Entry { at, seq, item }
    }
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
    /// Where a lane entry is packed before it is appended.
    scratch: Packer,
}

impl<T> Default for Schedule<T> {
    fn default() -> Self {
        Schedule {
            seq: 0,
            lanes: Vec::new(),
            heap: BinaryHeap::new(),
            len: 0,
            scratch: Packer::default(),
        }
    }
}

impl<T: Packed> Schedule<T> {
    /// Schedules `item` at `now + delay`, for a delay that recurs (a configured
    /// latency or timeout): it joins the FIFO lane of that delay.
    pub(crate) fn push_fixed(&mut self, now: u64, delay: u64, item: T) {
        let entry = self.entry(now.saturating_add(delay), item);
        let lane = match self.lanes.iter().position(|lane| lane.delay == delay) {
            Some(index) => Some(index),
            None if self.lanes.len() < MAX_LANES => {
                self.lanes.push(Lane::new(delay));
                Some(self.lanes.len() - 1)
            }
            None => None,
        };
        match lane {
            // A lane only takes an entry that sorts after its tail, so each lane stays
            // sorted even if a caller's clock went back.
            Some(index) if self.lanes[index].len == 0 || self.lanes[index].tail < entry.key() => {
                self.lanes[index].push(entry, &mut self.scratch);
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
            Source::Lane(index) => self.lanes[index].pop(),
            Source::Heap => self.heap.pop()?.0,
        };
        self.len -= 1;
        Some((entry.at, entry.item))
    }

    /// The smallest key among the lane heads and the heap top, and where it is.
    fn next(&self) -> Option<((u64, u64), Source)> {
        let mut best = self.heap.peek().map(|top| (top.0.key(), Source::Heap));
        for (index, lane) in self.lanes.iter().enumerate() {
            if lane.len > 0 && best.is_none_or(|(key, _)| lane.head < key) {
                best = Some((lane.head, Source::Lane(index)));
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SplitMix64;

    impl Packed for u64 {
        fn pack(self, out: &mut Packer) {
            // Exercises both encodings: the low half relative to the lane's previous.
            out.near(self as u32);
            out.varint(self >> 32);
        }
        fn unpack(input: &mut Unpacker<'_>) -> Self {
            let low = input.near();
            u64::from(low) | input.varint() << 32
        }
    }

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
        schedule.push_fixed(0, 20, 1);
        schedule.push_at(20, 2);
        schedule.push_fixed(10, 10, 3);
        schedule.push_fixed(0, 20, 4);
        let order: Vec<_> = std::iter::from_fn(|| schedule.pop()).collect();
        assert_eq!(order, [(20, 1), (20, 2), (20, 3), (20, 4)]);
    }

    #[test]
    fn a_clock_going_back_cannot_break_a_lane() {
        let mut schedule = Schedule::default();
        schedule.push_fixed(100, 10, 1u64);
        schedule.push_fixed(50, 10, 2);
        assert_eq!(schedule.pop(), Some((60, 2)));
        assert_eq!(schedule.pop(), Some((110, 1)));
        assert_eq!(schedule.pop(), None);
    }
}
