//! The transport's QP number → slot table: dense from the first QP number it saw.

use cm_core::QpNum;

use crate::sim::tables::Chunked;

/// No slot: the QP is not this transport's (or was freed).
pub(super) const NO_SLOT: u32 = u32::MAX;

/// QP number → slot, as a table from the first QP number set: the QPs the fabric
/// numbered before it (the other nodes') take no room.
#[derive(Debug, Default)]
pub(super) struct QpSlots {
    /// The QP number of entry 0.
    base: u32,
    slots: Chunked<u32>,
}

impl QpSlots {
    /// The slot of `qp` ([`NO_SLOT`]: none).
    pub(super) fn get(&self, qp: QpNum) -> u32 {
        qp.0.checked_sub(self.base)
            .and_then(|index| self.slots.get(index as usize))
            .copied()
            .unwrap_or(NO_SLOT)
    }

    pub(super) fn get_mut(&mut self, qp: QpNum) -> Option<&mut u32> {
        let index = qp.0.checked_sub(self.base)?;
        self.slots.get_mut(index as usize)
    }

    pub(super) fn set(&mut self, qp: QpNum, slot: u32) {
        if self.slots.len() == 0 {
            self.base = qp.0;
        } else if qp.0 < self.base {
            // Below the first: the table starts over from `qp` (QPs are numbered in
            // creation order, so this does not happen on one fabric).
            let mut slots = Chunked::default();
            for _ in qp.0..self.base {
                slots.push(NO_SLOT);
            }
            for &old in self.slots.iter() {
                slots.push(old);
            }
            self.slots = slots;
            self.base = qp.0;
        }
        let index = (qp.0 - self.base) as usize;
        while self.slots.len() <= index {
            self.slots.push(NO_SLOT);
        }
        if let Some(entry) = self.slots.get_mut(index) {
            *entry = slot;
        }
    }

    /// Sets every entry that is `entry` to [`NO_SLOT`] (a walk of the whole table).
    pub(super) fn clear_entries(&mut self, entry: u32) {
        for index in 0..self.slots.len() {
            if let Some(slot) = self.slots.get_mut(index).filter(|slot| **slot == entry) {
                *slot = NO_SLOT;
            }
        }
    }

    /// Every entry, from the first QP number set.
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = &u32> {
        self.slots.iter()
    }
}
