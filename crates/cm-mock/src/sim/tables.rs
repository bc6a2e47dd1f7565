//! Dense tables for the fabric's per-message and per-id bookkeeping.
//!
//! Every key the fabric hands out is a small integer (id slots, QP numbers, connection
//! numbers), and a scale run walks them roughly in order. Tables indexed by those
//! integers need no hashing and keep neighbouring connections on neighbouring cache
//! lines, so the cost per connection grows little as the run outgrows the caches.
//! The id, QP and connection tables grow by fixed chunks, the schedule's queues by
//! blocks: nothing is copied when they grow, none holds twice the memory it needs right
//! after doubling, and queues that peak at different times reuse each other's blocks.

use std::collections::{HashMap, VecDeque};

use super::types::{NodeId, SimIdKey};

/// log2 of the entries of one chunk of a [`Chunked`] table.
const CHUNK_BITS: u32 = 10;
/// Entries of one chunk.
const CHUNK: usize = 1 << CHUNK_BITS;

/// A vector that grows by chunks of [`CHUNK`] entries: pushing never moves what is
/// already stored (no copy, no transient double footprint on growth).
#[derive(Debug)]
pub(crate) struct Chunked<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Chunked<T> {
    fn default() -> Self {
        Chunked {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Chunked<T> {
    /// How many entries are stored.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends `value` at index `len()`.
    pub(crate) fn push(&mut self, value: T) {
        match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < CHUNK => chunk.push(value),
            _ => {
                let mut chunk = Vec::with_capacity(CHUNK);
                chunk.push(value);
                self.chunks.push(chunk);
            }
        }
        self.len += 1;
    }

    /// The entry at `index`.
    pub(crate) fn get(&self, index: usize) -> Option<&T> {
        self.chunks
            .get(index >> CHUNK_BITS)?
            .get(index & (CHUNK - 1))
    }

    /// The entry at `index`, to change.
    pub(crate) fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        self.chunks
            .get_mut(index >> CHUNK_BITS)?
            .get_mut(index & (CHUNK - 1))
    }

    /// Every entry, in index order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }
}

/// A FIFO made of fixed-size blocks: it grows without copying, and the blocks it
/// empties go back to the allocator for any other queue or table to reuse, so queues
/// that peak at different times share their memory. Pushes go to the `tail` block and
/// pops come from the `head` block, each a plain ring buffer on the fast path; full
/// blocks wait in between. Invariant: when `head` is empty, so is `full`, and every
/// entry is in `tail`.
#[derive(Debug)]
pub(crate) struct BlockQueue<T> {
    head: VecDeque<T>,
    full: VecDeque<VecDeque<T>>,
    tail: VecDeque<T>,
}

impl<T> Default for BlockQueue<T> {
    fn default() -> Self {
        BlockQueue {
            head: VecDeque::new(),
            full: VecDeque::new(),
            tail: VecDeque::new(),
        }
    }
}

impl<T> BlockQueue<T> {
    /// Entries of one block.
    const BLOCK: usize = 512;

    /// Appends `value` at the back.
    #[inline]
    pub(crate) fn push_back(&mut self, value: T) {
        if self.tail.len() >= Self::BLOCK {
            if self.head.is_empty() {
                std::mem::swap(&mut self.head, &mut self.tail);
            } else {
                let block = VecDeque::with_capacity(Self::BLOCK);
                self.full
                    .push_back(std::mem::replace(&mut self.tail, block));
            }
        }
        self.tail.push_back(value);
    }

    /// The front entry.
    #[inline]
    pub(crate) fn front(&self) -> Option<&T> {
        self.head.front().or_else(|| self.tail.front())
    }

    /// The back entry.
    pub(crate) fn back(&self) -> Option<&T> {
        self.tail
            .back()
            .or_else(|| self.full.back().and_then(VecDeque::back))
            .or_else(|| self.head.back())
    }

    /// Takes the front entry.
    #[inline]
    pub(crate) fn pop_front(&mut self) -> Option<T> {
        let Some(value) = self.head.pop_front() else {
            return self.tail.pop_front();
        };
        if self.head.is_empty() {
            if let Some(next) = self.full.pop_front() {
                self.head = next;
            }
        }
        Some(value)
    }
}

/// Values parked in numbered slots; a freed slot is the next one reused (last freed,
/// first reused, so a busy run keeps touching the same few cache lines). Once every
/// slot is free again after a peak of more than a chunk, the table gives its memory
/// back: a scale run's burst of messages in flight is not held for the rest of the run.
#[derive(Debug)]
pub(crate) struct Slots<T> {
    slots: Chunked<Option<T>>,
    free: Vec<u32>,
}

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Slots {
            slots: Chunked::default(),
            free: Vec::new(),
        }
    }
}

impl<T> Slots<T> {
    /// Parks `value` and returns its slot.
    pub(crate) fn put(&mut self, value: T) -> u32 {
        match self.free.pop() {
            Some(slot) => {
                if let Some(free) = self.slots.get_mut(slot as usize) {
                    *free = Some(value);
                }
                slot
            }
            None => {
                self.slots.push(Some(value));
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// How many slots there are, free or not.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// The value in `slot`.
    #[cfg(test)]
    pub(crate) fn get(&self, slot: u32) -> Option<&T> {
        self.slots.get(slot as usize)?.as_ref()
    }

    /// The value in `slot`, to change.
    pub(crate) fn get_mut(&mut self, slot: u32) -> Option<&mut T> {
        self.slots.get_mut(slot as usize)?.as_mut()
    }

    /// Takes the value out of `slot`, freeing it.
    pub(crate) fn take(&mut self, slot: u32) -> Option<T> {
        let value = self.slots.get_mut(slot as usize)?.take()?;
        self.free.push(slot);
        if self.free.len() == self.slots.len() && self.slots.len() > CHUNK {
            // No slot number is held by anyone now, so numbering can start over.
            *self = Slots::default();
        }
        Some(value)
    }
}

/// One duplicate-REQ entry, stored at the active id's slot.
#[derive(Debug, Clone, Copy)]
struct ReqEntry {
    from: NodeId,
    generation: u32,
    passive: SimIdKey,
}

/// The passive side's duplicate-REQ table: (active node, active id) → the passive id
/// its REQ created. Indexed by the active id's slot; a second entry for one slot (the
/// active id destroyed and its slot reused while the first passive id lives on) goes
/// to a small map, so the table answers exactly as a map over the full key would.
#[derive(Debug, Default)]
pub(crate) struct ReqTable {
    by_slot: Vec<Option<ReqEntry>>,
    spill: HashMap<(NodeId, SimIdKey), SimIdKey>,
}

impl ReqTable {
    fn entry(&self, from: NodeId, active: SimIdKey) -> Option<&ReqEntry> {
        self.by_slot
            .get(active.index as usize)?
            .as_ref()
            .filter(|e| e.from == from && e.generation == active.generation)
    }

    /// The passive id created by the REQ of `active` on node `from`.
    pub(crate) fn get(&self, from: NodeId, active: SimIdKey) -> Option<SimIdKey> {
        match self.entry(from, active) {
            Some(entry) => Some(entry.passive),
            None if self.spill.is_empty() => None,
            None => self.spill.get(&(from, active)).copied(),
        }
    }

    /// Records that the REQ of `active` on node `from` created `passive` (the caller
    /// checked that none is recorded).
    pub(crate) fn insert(&mut self, from: NodeId, active: SimIdKey, passive: SimIdKey) {
        let index = active.index as usize;
        if index >= self.by_slot.len() {
            self.by_slot.resize(index + 1, None);
        }
        let entry = ReqEntry {
            from,
            generation: active.generation,
            passive,
        };
        match &mut self.by_slot[index] {
            free @ None => *free = Some(entry),
            Some(_) => {
                self.spill.insert((from, active), passive);
            }
        }
    }

    /// Forgets the entry of `active` on node `from`.
    pub(crate) fn remove(&mut self, from: NodeId, active: SimIdKey) {
        if self.entry(from, active).is_some() {
            self.by_slot[active.index as usize] = None;
        } else {
            self.spill.remove(&(from, active));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(index: u32, generation: u32) -> SimIdKey {
        SimIdKey { index, generation }
    }

    #[test]
    fn chunked_indexes_across_chunks() {
        let mut table = Chunked::default();
        for n in 0..3 * CHUNK + 5 {
            table.push(n);
        }
        assert_eq!(table.len(), 3 * CHUNK + 5);
        assert_eq!(table.get(CHUNK), Some(&CHUNK));
        assert_eq!(table.get(3 * CHUNK + 4), Some(&(3 * CHUNK + 4)));
        assert_eq!(table.get(3 * CHUNK + 5), None);
        *table.get_mut(7).unwrap() = 70;
        assert_eq!(table.iter().nth(7), Some(&70));
        assert_eq!(table.iter().count(), table.len());
    }

    #[test]
    fn block_queue_is_a_fifo_across_blocks() {
        let mut queue = BlockQueue::default();
        // Fill and drain in rounds, and interleave, so entries cross blocks in every way
        // (tail only, head and tail, full blocks in between).
        let mut expected = std::collections::VecDeque::new();
        let mut next = 0;
        for round in 1..6 {
            for _ in 0..round * 700 {
                queue.push_back(next);
                expected.push_back(next);
                assert_eq!(queue.back(), expected.back());
                next += 1;
            }
            for _ in 0..round * 500 {
                assert_eq!(queue.front(), expected.front());
                assert_eq!(queue.pop_front(), expected.pop_front());
            }
        }
        while let Some(n) = expected.pop_front() {
            assert_eq!(queue.pop_front(), Some(n));
        }
        assert_eq!(queue.pop_front(), None);
        assert_eq!(queue.front(), None);
        assert_eq!(queue.back(), None);
    }

    #[test]
    fn slots_reuse_the_last_freed() {
        let mut slots = Slots::default();
        let (a, b) = (slots.put('a'), slots.put('b'));
        assert_eq!(slots.take(a), Some('a'));
        assert_eq!(slots.take(a), None);
        assert_eq!(slots.put('c'), a);
        assert_eq!(slots.get_mut(a), Some(&mut 'c'));
        assert_eq!(slots.get_mut(99), None);
        assert_eq!(slots.take(b), Some('b'));
        assert_eq!(slots.take(a), Some('c'));
        assert_eq!(slots.take(99), None);
    }

    #[test]
    fn slots_give_their_memory_back_once_all_are_free() {
        let mut slots = Slots::default();
        let taken: Vec<u32> = (0..2 * CHUNK).map(|n| slots.put(n)).collect();
        for &slot in &taken[1..] {
            assert!(slots.take(slot).is_some());
        }
        // One still parked: nothing is given back yet.
        assert_eq!(slots.len(), 2 * CHUNK);
        assert_eq!(slots.take(taken[0]), Some(0));
        assert_eq!(slots.len(), 0);
        assert_eq!(slots.put(7), 0);
        assert_eq!(slots.take(taken[1]), None);
        assert_eq!(slots.take(0), Some(7));
    }

    #[test]
    fn req_table_answers_like_a_map_over_the_full_key() {
        let mut table = ReqTable::default();
        let (node, other) = (NodeId(1), NodeId(2));
        table.insert(node, key(3, 0), key(10, 0));
        assert_eq!(table.get(node, key(3, 0)), Some(key(10, 0)));
        assert_eq!(table.get(other, key(3, 0)), None);
        assert_eq!(table.get(node, key(3, 1)), None);
        // The slot reused while the first entry lives: both answer.
        table.insert(node, key(3, 1), key(11, 0));
        assert_eq!(table.get(node, key(3, 0)), Some(key(10, 0)));
        assert_eq!(table.get(node, key(3, 1)), Some(key(11, 0)));
        table.remove(node, key(3, 0));
        assert_eq!(table.get(node, key(3, 0)), None);
        assert_eq!(table.get(node, key(3, 1)), Some(key(11, 0)));
        table.remove(node, key(3, 1));
        assert_eq!(table.get(node, key(3, 1)), None);
        table.remove(node, key(7, 0));
        assert_eq!(table.get(node, key(7, 0)), None);
    }
}
