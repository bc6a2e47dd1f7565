//! Dense tables for the fabric's per-message and per-id bookkeeping.
//!
//! Every key the fabric hands out is a small integer (id slots, QP numbers, connection
//! numbers), and a scale run walks them roughly in order. Tables indexed by those
//! integers need no hashing and keep neighbouring connections on neighbouring cache
//! lines, so the cost per connection stays flat as the run outgrows the caches.
//! The id, QP and connection tables grow by fixed chunks: nothing is copied when they
//! grow, and none holds twice the memory it needs right after doubling.

use std::collections::HashMap;

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

/// Values parked in numbered slots; a freed slot is the next one reused (last freed,
/// first reused, so a busy run keeps touching the same few cache lines).
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

    /// Takes the value out of `slot`, freeing it.
    pub(crate) fn take(&mut self, slot: u32) -> Option<T> {
        let value = self.slots.get_mut(slot as usize)?.take()?;
        self.free.push(slot);
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
    fn slots_reuse_the_last_freed() {
        let mut slots = Slots::default();
        let (a, b) = (slots.put('a'), slots.put('b'));
        assert_eq!(slots.take(a), Some('a'));
        assert_eq!(slots.take(a), None);
        assert_eq!(slots.put('c'), a);
        assert_eq!(slots.take(b), Some('b'));
        assert_eq!(slots.take(a), Some('c'));
        assert_eq!(slots.take(99), None);
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
