//! KV capacity accounting: cache slots and fixed-size blocks.
//!
//! The backends' caches are still slot-addressed (`slots × max_len`); the block pool is the
//! admission control a paged layout needs, and the block ids it hands out are what a
//! block table would hold once the attention kernels read one (see `PlanRow::slot`).

use std::collections::BTreeSet;

/// Free cache slots; the lowest free slot is handed out first.
#[derive(Debug, Clone)]
pub struct SlotPool {
    free: BTreeSet<usize>,
    total: usize,
}

impl SlotPool {
    pub fn new(total: usize) -> Self {
        SlotPool {
            free: (0..total).collect(),
            total,
        }
    }

    pub fn take(&mut self) -> Option<usize> {
        self.free.pop_first()
    }

    pub fn give_back(&mut self, slot: usize) {
        debug_assert!(slot < self.total && !self.free.contains(&slot));
        self.free.insert(slot);
    }

    pub fn in_use(&self) -> usize {
        self.total - self.free.len()
    }

    pub fn total(&self) -> usize {
        self.total
    }
}

/// Fixed-size KV blocks of `block_size` positions.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    free: Vec<u32>,
    total: usize,
}

impl BlockPool {
    pub fn new(block_size: usize, total: usize) -> Self {
        let block_size = block_size.max(1);
        BlockPool {
            block_size,
            // Popped from the end: lowest ids first.
            free: (0..total as u32).rev().collect(),
            total,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks that hold `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// `n` blocks, or None (and nothing taken) if fewer are free.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        Some(self.free.split_off(self.free.len() - n))
    }

    pub fn give_back(&mut self, blocks: Vec<u32>) {
        self.free.extend(blocks);
        // Keep "lowest id first" so the ids a run hands out do not depend on free order.
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }

    pub fn used(&self) -> usize {
        self.total - self.free.len()
    }

    pub fn total(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_all_or_nothing_and_come_back() {
        let mut p = BlockPool::new(16, 4);
        assert_eq!(p.blocks_for(0), 0);
        assert_eq!(p.blocks_for(16), 1);
        assert_eq!(p.blocks_for(17), 2);
        let a = p.take(3).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(p.used(), 3);
        assert!(p.take(2).is_none());
        assert_eq!(p.used(), 3, "a refused take takes nothing");
        p.give_back(a);
        assert_eq!(p.used(), 0);
        assert_eq!(p.take(4).map(|v| v.len()), Some(4));
    }

    #[test]
    fn slots_lowest_first() {
        let mut s = SlotPool::new(3);
        assert_eq!((s.take(), s.take()), (Some(0), Some(1)));
        s.give_back(0);
        assert_eq!(s.take(), Some(0));
        assert_eq!(s.take(), Some(2));
        assert_eq!(s.take(), None);
        assert_eq!(s.in_use(), 3);
    }
}
