//! The connection slot table, in fixed-size chunks.

/// Slots per chunk.
const CHUNK: usize = 1024;

/// A vector that grows by chunks of [`CHUNK`] slots: growing never moves or copies
/// the slots already there, so at 100k connections the table's peak is its size, not
/// the old and the new buffer of a reallocation at once.
pub(super) struct Slots<S> {
    chunks: Vec<Vec<S>>,
    len: usize,
}

impl<S> Slots<S> {
    pub(super) const fn new() -> Self {
        Slots {
            chunks: Vec::new(),
            len: 0,
        }
    }

    pub(super) fn get(&self, index: usize) -> Option<&S> {
        self.chunks.get(index / CHUNK)?.get(index % CHUNK)
    }

    pub(super) fn get_mut(&mut self, index: usize) -> Option<&mut S> {
        self.chunks.get_mut(index / CHUNK)?.get_mut(index % CHUNK)
    }

    /// Appends `slot`; its index.
    pub(super) fn push(&mut self, slot: S) -> usize {
        match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < CHUNK => chunk.push(slot),
            _ => {
                let mut chunk = Vec::with_capacity(CHUNK);
                chunk.push(slot);
                self.chunks.push(chunk);
            }
        }
        self.len += 1;
        self.len - 1
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &S> {
        self.chunks.iter().flatten()
    }
}

impl<S> std::ops::Index<usize> for Slots<S> {
    type Output = S;

    fn index(&self, index: usize) -> &S {
        self.get(index)
            .expect("a slot index below the table's length")
    }
}

impl<S> std::ops::IndexMut<usize> for Slots<S> {
    fn index_mut(&mut self, index: usize) -> &mut S {
        self.get_mut(index)
            .expect("a slot index below the table's length")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_stay_valid_across_chunks() {
        let mut slots = Slots::new();
        for n in 0..3 * CHUNK + 5 {
            assert_eq!(slots.push(n), n);
        }
        assert_eq!(slots.get(CHUNK), Some(&CHUNK));
        slots[2 * CHUNK + 1] = 7;
        assert_eq!(slots[2 * CHUNK + 1], 7);
        assert_eq!(slots.get(3 * CHUNK + 5), None);
        assert_eq!(slots.iter().count(), 3 * CHUNK + 5);
    }
}
