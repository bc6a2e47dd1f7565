//! The notify pump's table: values by QP number, indexed directly.
//!
//! A device hands out QP numbers close together (24-bit, from a bitmap), so a table of
//! pages indexed by the number itself finds an entry with one load and no hashing, and
//! holds about one slot per number in the range in use: no hash table's empty half at
//! a million entries, no rehash when it grows. A page goes once its last entry does;
//! up to the capacity asked for is kept for reuse. Numbers beyond 24 bits (never from a
//! device) go to a small hash map.

use rustc_hash::FxHashMap;

use cm_core::QpNum;

/// log2 of the slots of a page.
const PAGE_BITS: u32 = 9;
/// Slots per page.
const PAGE: usize = 1 << PAGE_BITS;
/// Numbers below this are paged (IB QP numbers are 24-bit).
const DIRECT: u32 = 1 << 24;

struct Page<V> {
    used: usize,
    slots: Box<[Option<V>]>,
}

impl<V> Page<V> {
    fn new() -> Self {
        Page {
            used: 0,
            slots: (0..PAGE).map(|_| None).collect(),
        }
    }
}

pub(crate) struct QpTable<V> {
    pages: Vec<Option<Page<V>>>,
    /// Empty pages kept for reuse, up to `reserved` slots' worth.
    spare: Vec<Page<V>>,
    spill: FxHashMap<QpNum, V>,
    len: usize,
    live_pages: usize,
    reserved: usize,
}

impl<V> QpTable<V> {
    /// A table holding `capacity` entries before it allocates (if their numbers fall
    /// within that many slots' pages).
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        QpTable {
            pages: Vec::new(),
            spare: (0..capacity.div_ceil(PAGE)).map(|_| Page::new()).collect(),
            spill: FxHashMap::default(),
            len: 0,
            live_pages: 0,
            reserved: capacity,
        }
    }

    fn split(qp: QpNum) -> Option<(usize, usize)> {
        (qp.0 < DIRECT).then_some(((qp.0 >> PAGE_BITS) as usize, qp.0 as usize & (PAGE - 1)))
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Entries it holds without allocating.
    pub(crate) fn capacity(&self) -> usize {
        (self.live_pages + self.spare.len()) * PAGE + self.spill.capacity()
    }

    pub(crate) fn get(&self, qp: QpNum) -> Option<&V> {
        match Self::split(qp) {
            Some((page, slot)) => self.pages.get(page)?.as_ref()?.slots[slot].as_ref(),
            None => self.spill.get(&qp),
        }
    }

    pub(crate) fn get_mut(&mut self, qp: QpNum) -> Option<&mut V> {
        match Self::split(qp) {
            Some((page, slot)) => self.pages.get_mut(page)?.as_mut()?.slots[slot].as_mut(),
            None => self.spill.get_mut(&qp),
        }
    }

    /// Puts `value` under `qp`; the value it replaces, if any.
    pub(crate) fn insert(&mut self, qp: QpNum, value: V) -> Option<V> {
        let Some((page, slot)) = Self::split(qp) else {
            let old = self.spill.insert(qp, value);
            self.len += usize::from(old.is_none());
            return old;
        };
        if page >= self.pages.len() {
            self.pages.resize_with(page + 1, || None);
        }
        let entry = self.pages[page].get_or_insert_with(|| {
            self.live_pages += 1;
            self.spare.pop().unwrap_or_else(Page::new)
        });
        let old = entry.slots[slot].replace(value);
        if old.is_none() {
            entry.used += 1;
            self.len += 1;
        }
        old
    }

    /// Takes the value under `qp` out.
    pub(crate) fn remove(&mut self, qp: QpNum) -> Option<V> {
        let Some((index, slot)) = Self::split(qp) else {
            let old = self.spill.remove(&qp);
            if old.is_some() {
                self.len -= 1;
                if self.spill.is_empty() {
                    self.spill = FxHashMap::default();
                } else if self.spill.capacity() > 4 * self.spill.len() + 64 {
                    self.spill.shrink_to(2 * self.spill.len());
                }
            }
            return old;
        };
        let page = self.pages.get_mut(index)?.as_mut()?;
        let old = page.slots[slot].take()?;
        page.used -= 1;
        self.len -= 1;
        if page.used == 0 {
            let page = self.pages[index].take().expect("the page just emptied");
            self.live_pages -= 1;
            if self.spare.len() * PAGE < self.reserved {
                self.spare.push(page);
            }
            if self.live_pages == 0 {
                // Nothing paged: the directory goes too.
                self.pages = Vec::new();
            }
        }
        Some(old)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_like_a_map_across_pages_and_beyond_24_bits() {
        let mut table = QpTable::with_capacity(0);
        let numbers = [0, 1, 511, 512, 70_000, DIRECT - 1, DIRECT, u32::MAX];
        for (n, &qp) in numbers.iter().enumerate() {
            assert_eq!(table.insert(QpNum(qp), n), None);
        }
        assert_eq!(table.len(), numbers.len());
        assert_eq!(table.insert(QpNum(512), 99), Some(3));
        assert_eq!(table.get(QpNum(512)), Some(&99));
        *table.get_mut(QpNum(u32::MAX)).unwrap() += 1;
        assert_eq!(table.get(QpNum(u32::MAX)), Some(&8));
        assert_eq!(table.get(QpNum(2)), None);
        assert_eq!(table.get(QpNum(DIRECT + 1)), None);
        for &qp in &numbers {
            assert!(table.remove(QpNum(qp)).is_some());
            assert_eq!(table.remove(QpNum(qp)), None);
        }
        assert_eq!((table.len(), table.capacity()), (0, 0));
    }

    #[test]
    fn keeps_what_was_reserved() {
        let mut table = QpTable::with_capacity(1000);
        assert!(table.capacity() >= 1000);
        for qp in 5000..6000 {
            table.insert(QpNum(qp), ());
        }
        for qp in 5000..6000 {
            table.remove(QpNum(qp));
        }
        assert!((1000..2 * 1000 + PAGE).contains(&table.capacity()));
    }
}
