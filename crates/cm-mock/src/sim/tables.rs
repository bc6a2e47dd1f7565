//! Dense tables for the fabric's per-message and per-id bookkeeping.
//!
//! Every key the fabric hands out is a small integer (id slots, QP numbers, connection
//! numbers), and a scale run walks them roughly in order. Tables indexed by those
//! integers need no hashing and keep neighbouring connections on neighbouring cache
//! lines, so the cost per connection grows little as the run outgrows the caches.
//! The id, QP and connection tables grow by fixed chunks, the schedule's queues by
//! blocks of bytes: nothing is copied when they grow, none holds twice the memory it needs right
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

/// A FIFO of records (byte strings) made of blocks: it grows without copying, and the
/// blocks it empties go back to the allocator for any other queue or table to reuse,
/// so queues that peak at different times share their memory. A record never straddles
/// two blocks (one that does not fit starts the next block, and one larger than a
/// block gets a block of its own), so a reader decodes it from one slice.
#[derive(Debug, Default)]
pub(crate) struct ByteFifo {
    blocks: VecDeque<Block>,
    /// Read position in the front block.
    head: usize,
}

/// A block of a [`ByteFifo`] and how much of it is written.
#[derive(Debug)]
struct Block {
    bytes: Box<[u8]>,
    len: usize,
}

impl ByteFifo {
    /// Bytes of one block.
    const BLOCK: usize = 8192;

    /// Appends the record `bytes` at the back.
    pub(crate) fn write(&mut self, bytes: &[u8]) {
        let fits = self
            .blocks
            .back()
            .is_some_and(|block| block.bytes.len() - block.len >= bytes.len());
        if !fits {
            let size = bytes.len().max(Self::BLOCK);
            self.blocks.push_back(Block {
                bytes: vec![0; size].into_boxed_slice(),
                len: 0,
            });
        }
        if let Some(block) = self.blocks.back_mut() {
            block.bytes[block.len..block.len + bytes.len()].copy_from_slice(bytes);
            block.len += bytes.len();
        }
    }

    /// The unread bytes of the front block, where the next record starts (empty when
    /// the FIFO is).
    #[inline]
    pub(crate) fn front(&mut self) -> &[u8] {
        if self
            .blocks
            .front()
            .is_some_and(|block| self.head == block.len)
            && self.blocks.len() > 1
        {
            self.blocks.pop_front();
            self.head = 0;
        }
        self.blocks
            .front()
            .map_or(&[][..], |block| &block.bytes[self.head..block.len])
    }

    /// Marks `n` bytes of [`ByteFifo::front`] read. A FIFO read to its end starts its
    /// last block over rather than allocating another.
    #[inline]
    pub(crate) fn consume(&mut self, n: usize) {
        self.head += n;
        let only = self.blocks.len() == 1;
        if let Some(block) = self
            .blocks
            .front_mut()
            .filter(|b| only && b.len == self.head)
        {
            block.len = 0;
            self.head = 0;
        }
    }
}

/// Values parked in numbered slots; a freed slot is the next one reused (last freed,
/// first reused, so a busy run keeps touching the same few cache lines). Once every
/// slot is free again after a peak of more than a chunk, the table gives its memory
/// back: a scale run's peak is not held for the rest of the run.
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

/// One duplicate-REQ entry, stored at the active id's slot; free while `passive`'s
/// slot is `u32::MAX` (never handed out).
#[derive(Debug, Clone, Copy)]
struct ReqEntry {
    from: NodeId,
    generation: u32,
    passive: SimIdKey,
}

impl ReqEntry {
    const FREE: ReqEntry = ReqEntry {
        from: NodeId(0),
        generation: 0,
        passive: SimIdKey {
            index: u32::MAX,
            generation: 0,
        },
    };

    fn is_free(&self) -> bool {
        self.passive.index == u32::MAX
    }
}

/// The passive side's duplicate-REQ table: (active node, active id) → the passive id
/// its REQ created. Indexed by the active id's slot, grown by chunks; a second entry
/// for one slot (the active id destroyed and its slot reused while the first passive
/// id lives on) goes to a small map, so the table answers exactly as a map over the
/// full key would.
#[derive(Debug, Default)]
pub(crate) struct ReqTable {
    by_slot: Chunked<ReqEntry>,
    spill: HashMap<(NodeId, SimIdKey), SimIdKey>,
}

impl ReqTable {
    fn entry(&self, from: NodeId, active: SimIdKey) -> Option<&ReqEntry> {
        self.by_slot
            .get(active.index as usize)
            .filter(|e| !e.is_free() && e.from == from && e.generation == active.generation)
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
        while self.by_slot.len() <= index {
            self.by_slot.push(ReqEntry::FREE);
        }
        let entry = ReqEntry {
            from,
            generation: active.generation,
            passive,
        };
        match self.by_slot.get_mut(index) {
            Some(free) if free.is_free() => *free = entry,
            _ => {
                self.spill.insert((from, active), passive);
            }
        }
    }

    /// Forgets the entry of `active` on node `from`.
    pub(crate) fn remove(&mut self, from: NodeId, active: SimIdKey) {
        if self.entry(from, active).is_some() {
            if let Some(entry) = self.by_slot.get_mut(active.index as usize) {
                *entry = ReqEntry::FREE;
            }
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
    fn byte_fifo_reads_back_its_records_in_order() {
        let mut fifo = ByteFifo::default();
        // Fill and drain in rounds, and interleave, so records fill blocks in every way;
        // some are larger than a block.
        let mut expected = std::collections::VecDeque::new();
        let mut next = 0usize;
        let read = |fifo: &mut ByteFifo, value: &[u8]| {
            let front = fifo.front();
            assert!(front.len() >= value.len());
            assert_eq!(&front[..value.len()], value);
            fifo.consume(value.len());
        };
        for round in 1..6 {
            for _ in 0..round * 3_000 {
                let len = if next % 1_000 == 999 {
                    10_000
                } else {
                    next % 23
                };
                let value: Vec<u8> = (0..len).map(|b| (next + b) as u8).collect();
                fifo.write(&value);
                expected.push_back(value);
                next += 1;
            }
            for _ in 0..round * 2_000 {
                read(&mut fifo, &expected.pop_front().unwrap());
            }
        }
        while let Some(value) = expected.pop_front() {
            read(&mut fifo, &value);
        }
        assert!(fifo.front().is_empty());
        assert!(fifo.blocks.len() <= 1);
        assert_eq!(fifo.head, 0);
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
