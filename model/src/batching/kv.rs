//! The KV cache's blocks (of `arbor_kernels::paged::KV_BLOCK` positions): which are free,
//! which sequences hold them (reference counts), and the prefix cache.
//!
//! Prefix cache: a full block, once its positions are computed, is registered under the
//! hash of its tokens chained with its parent's (the previous block of the same sequence),
//! together with the tokens themselves and its parent's identity, so that a hit is checked
//! token for token, never trusted on a hash. A block nobody holds any more keeps its
//! contents and waits in an LRU list; a new sequence whose tokens begin with the same full
//! blocks takes them instead of computing them again. Because a prefix's KV has the same
//! bits however it was computed (docs/invariance.md), a cached block gives exactly the bits
//! of recomputation. Blocks are taken from the never-cached free ones first (lowest id
//! first), then by evicting the least recently released cached block; a block in use is
//! never evicted.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::Hasher;

use arbor_kernels::paged::KV_BLOCK;

/// The chain hash of a full block: its parent's hash (`None` for a sequence's first block)
/// and its `KV_BLOCK` tokens.
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    // SipHash with fixed keys: the same value in every run (only rank 0 uses it).
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new_with_keys(0x6172_626f_7220_6b76, 0x7072_6566_6978_2121);
    h.write_u64(parent.unwrap_or(0x9e37_79b9_7f4a_7c15));
    h.write_usize(tokens.len());
    for &t in tokens {
        h.write_u32(t);
    }
    h.finish()
}

/// The chain hashes of the full blocks of `tokens` (those of the first `blocks` blocks).
pub fn chain_hashes(tokens: &[u32], blocks: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(blocks);
    let mut parent = None;
    for chunk in tokens.chunks_exact(KV_BLOCK).take(blocks) {
        let h = block_hash(parent, chunk);
        out.push(h);
        parent = Some(h);
    }
    out
}

/// What a registered block holds: checked on every hit.
#[derive(Debug, Clone)]
struct Content {
    hash: u64,
    /// The previous block of the sequence and its generation when this one was
    /// registered (`None`: a sequence's first block).
    parent: Option<(u32, u64)>,
    tokens: Box<[u32]>,
}

#[derive(Debug, Clone, Default)]
struct Block {
    refs: u32,
    /// Bumped whenever the block's contents are forgotten (evicted, dropped): a child
    /// registered under an older generation no longer matches.
    generation: u64,
    content: Option<Content>,
    /// Its place in the LRU list while cached and unheld.
    lru: Option<u64>,
}

/// Prefix-cache counters (positions, as `/metrics` reports them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Positions of admitted sequences looked up in the cache.
    pub queried: u64,
    /// Of those, the positions found cached (and not computed again).
    pub hits: u64,
}

/// The cache's blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Never-cached (or forgotten) unheld blocks.
    free: BTreeSet<u32>,
    /// Cached unheld blocks by release tick: the first is evicted first.
    lru: BTreeMap<u64, u32>,
    tick: u64,
    by_hash: HashMap<u64, u32>,
    /// Blocks with `refs > 0`.
    held: usize,
    prefix: bool,
    stats: PrefixStats,
}

impl BlockPool {
    /// A pool of `total` blocks (ids `0..total`, at most `u32::MAX`), with the prefix
    /// cache when `prefix_cache`.
    pub fn new(total: usize, prefix_cache: bool) -> Self {
        let total = total.min(u32::MAX as usize);
        BlockPool {
            blocks: vec![Block::default(); total],
            free: (0..total as u32).collect(),
            lru: BTreeMap::new(),
            tick: 0,
            by_hash: HashMap::new(),
            held: 0,
            prefix: prefix_cache,
            stats: PrefixStats::default(),
        }
    }

    pub fn prefix_cache(&self) -> bool {
        self.prefix
    }

    /// Blocks a `take` can hand out now: the free ones and the cached unheld ones.
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// `n` blocks held once each (free ones first, lowest id first, then the least recently
    /// released cached ones, forgotten), or None (and nothing taken) if fewer are
    /// available.
    pub fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.available() {
            return None;
        }
        let mut got = Vec::with_capacity(n);
        while got.len() < n {
            let id = match self.free.pop_first() {
                Some(id) => id,
                None => {
                    let (_, id) = self.lru.pop_first()?;
                    self.blocks[id as usize].lru = None;
                    self.forget(id);
                    id
                }
            };
            self.hold(id);
            got.push(id);
        }
        Some(got)
    }

    /// Drops one hold of each block of `table`; a block nobody holds goes to the LRU list
    /// when it is cached, else back to the free ones. The table's last blocks are released
    /// first, so they are evicted first: a prefix outlives its tails.
    pub fn release(&mut self, table: &[u32]) {
        for &id in table.iter().rev() {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.refs > 0, "block {id} released more often than held");
            b.refs = b.refs.saturating_sub(1);
            if b.refs > 0 {
                continue;
            }
            self.held -= 1;
            if b.content.is_some() {
                self.tick += 1;
                b.lru = Some(self.tick);
                self.lru.insert(self.tick, id);
            } else {
                self.free.insert(id);
            }
        }
    }

    fn hold(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        if b.refs == 0 {
            self.held += 1;
            if let Some(t) = b.lru.take() {
                self.lru.remove(&t);
            }
        }
        b.refs += 1;
    }

    /// Forgets a block's contents (its hash no longer finds it).
    fn forget(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        if let Some(c) = b.content.take() {
            if self.by_hash.get(&c.hash) == Some(&id) {
                self.by_hash.remove(&c.hash);
            }
        }
        b.generation += 1;
    }

    /// The cached blocks that hold the first full blocks of `tokens`, whose chain hashes
    /// are `hashes` (`chain_hashes`), in order: the longest run found, checked token for
    /// token and parent by parent. Takes nothing.
    pub fn lookup(&self, tokens: &[u32], hashes: &[u64]) -> Vec<u32> {
        let mut found = Vec::new();
        if !self.prefix {
            return found;
        }
        let mut parent: Option<(u32, u64)> = None;
        for (i, h) in hashes.iter().enumerate() {
            let Some(&id) = self.by_hash.get(h) else {
                break;
            };
            let b = &self.blocks[id as usize];
            let ok = b.content.as_ref().is_some_and(|c| {
                c.parent == parent && *c.tokens == tokens[i * KV_BLOCK..(i + 1) * KV_BLOCK]
            });
            if !ok {
                break;
            }
            parent = Some((id, b.generation));
            found.push(id);
        }
        found
    }

    /// How many of `ids` are cached and unheld (taking them makes that many fewer
    /// available).
    pub fn unheld(&self, ids: &[u32]) -> usize {
        ids.iter()
            .filter(|&&id| self.blocks[id as usize].refs == 0)
            .count()
    }

    /// Holds each of `ids` once more (blocks `lookup` found).
    pub fn acquire(&mut self, ids: &[u32]) {
        for &id in ids {
            self.hold(id);
        }
    }

    /// Counts a lookup of `queried` positions of which `hits` were cached.
    pub fn count_lookup(&mut self, queried: usize, hits: usize) {
        self.stats.queried += queried as u64;
        self.stats.hits += hits as u64;
    }

    /// Registers held block `id`, whose positions are computed, as holding `tokens` (a
    /// full block) after `parent` (the sequence's previous block, registered before it;
    /// `None` for its first), under chain hash `hash`. Returns the block that already holds
    /// the same contents, if one does (the caller may hold that one instead: the same
    /// bits); else `id` is now cached.
    pub fn register(
        &mut self,
        id: u32,
        hash: u64,
        parent: Option<u32>,
        tokens: &[u32],
    ) -> Option<u32> {
        if !self.prefix || tokens.len() != KV_BLOCK {
            return None;
        }
        let parent = parent.map(|p| (p, self.blocks[p as usize].generation));
        if let Some(&other) = self.by_hash.get(&hash) {
            let same = self.blocks[other as usize]
                .content
                .as_ref()
                .is_some_and(|c| c.parent == parent && *c.tokens == *tokens);
            return (same && other != id).then_some(other);
        }
        if self.blocks[id as usize].content.is_some() {
            return None;
        }
        self.blocks[id as usize].content = Some(Content {
            hash,
            parent,
            tokens: tokens.into(),
        });
        self.by_hash.insert(hash, id);
        None
    }

    /// Forgets every cached block (after the weights change, say: their contents are the
    /// old model's). Held blocks stay held, no longer cached.
    pub fn drop_cache(&mut self) {
        for id in 0..self.blocks.len() as u32 {
            if self.blocks[id as usize].content.is_some() {
                self.forget(id);
            }
        }
        for (_, id) in std::mem::take(&mut self.lru) {
            self.blocks[id as usize].lru = None;
            self.free.insert(id);
        }
        self.by_hash.clear();
    }

    /// Blocks held by sequences.
    pub fn used(&self) -> usize {
        self.held
    }

    pub fn total(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks whose contents are cached (held or not).
    pub fn cached(&self) -> usize {
        self.by_hash.len()
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 1000 + i).collect()
    }

    #[test]
    fn blocks_are_all_or_nothing_and_come_back() {
        let mut p = BlockPool::new(4, false);
        let a = p.take(3).unwrap();
        assert_eq!(a, [0, 1, 2]);
        assert_eq!(p.used(), 3);
        assert!(p.take(2).is_none());
        assert_eq!(p.used(), 3, "a refused take takes nothing");
        p.release(&a);
        assert_eq!(p.used(), 0);
        assert_eq!(p.take(4), Some(vec![0, 1, 2, 3]));
    }

    #[test]
    fn the_chain_hash_depends_on_every_token_and_the_parent() {
        let t = toks(1, 2 * KV_BLOCK);
        let h = chain_hashes(&t, 2);
        assert_eq!(h.len(), 2);
        assert_eq!(h[0], block_hash(None, &t[..KV_BLOCK]));
        assert_eq!(h[1], block_hash(Some(h[0]), &t[KV_BLOCK..]));
        let mut u = t.clone();
        u[3] += 1;
        let g = chain_hashes(&u, 2);
        assert_ne!(g[0], h[0]);
        assert_ne!(g[1], h[1], "a change in block 0 changes block 1's hash");
        assert_eq!(
            chain_hashes(&t[..KV_BLOCK + 5], 9).len(),
            1,
            "full blocks only"
        );
    }

    /// A sequence of `n` blocks over `t` registered in `p` (as the scheduler does once they
    /// are computed); returns its table.
    fn computed(p: &mut BlockPool, t: &[u32], n: usize) -> Vec<u32> {
        let table = p.take(n).unwrap();
        let hashes = chain_hashes(t, n);
        for i in 0..n {
            let parent = (i > 0).then(|| table[i - 1]);
            let dup = p.register(
                table[i],
                hashes[i],
                parent,
                &t[i * KV_BLOCK..(i + 1) * KV_BLOCK],
            );
            assert_eq!(dup, None);
        }
        table
    }

    #[test]
    fn refcounts_keep_shared_blocks_and_the_lru_keeps_released_ones() {
        let mut p = BlockPool::new(6, true);
        let t = toks(2, 3 * KV_BLOCK);
        let a = computed(&mut p, &t, 3);
        assert_eq!((p.used(), p.cached()), (3, 3));
        // A second sequence with the same first two blocks and another third.
        let mut u = t.clone();
        u[2 * KV_BLOCK] = 7;
        let hits = p.lookup(&u, &chain_hashes(&u, 3));
        assert_eq!(hits, a[..2]);
        assert_eq!(p.unheld(&hits), 0);
        p.acquire(&hits);
        p.release(&a);
        // Blocks 0 and 1 are still held by the second sequence; block 2 is cached, unheld.
        assert_eq!((p.used(), p.available()), (2, 4));
        let again = p.lookup(&t, &chain_hashes(&t, 3));
        assert_eq!(again, a, "the released block is still found");
        assert_eq!(p.unheld(&again), 1);
        p.release(&hits);
        assert_eq!(p.used(), 0);
        assert_eq!(p.available(), 6);
        assert_eq!(p.cached(), 3);
    }

    #[test]
    fn free_blocks_go_first_then_the_least_recently_released_tails() {
        let mut p = BlockPool::new(5, true);
        let t = toks(3, 2 * KV_BLOCK);
        let u = toks(4, 2 * KV_BLOCK);
        let a = computed(&mut p, &t, 2); // blocks 0, 1
        let b = computed(&mut p, &u, 2); // blocks 2, 3
        p.release(&a);
        p.release(&b);
        // Free first: block 4.
        assert_eq!(p.take(1), Some(vec![4]));
        // Then the LRU: a's tail (released before its head), then a's head, then b's tail.
        assert_eq!(p.take(1), Some(vec![a[1]]));
        assert_eq!(
            p.lookup(&t, &chain_hashes(&t, 2)),
            [a[0]],
            "a's head still cached"
        );
        assert_eq!(p.take(2), Some(vec![a[0], b[1]]));
        assert!(p.lookup(&t, &chain_hashes(&t, 2)).is_empty());
        assert_eq!(p.lookup(&u, &chain_hashes(&u, 2)), [b[0]]);
        assert_eq!(p.cached(), 1);
        // A held block is never evicted: b[0] is the only one left.
        let held = p.lookup(&u, &chain_hashes(&u, 1));
        p.acquire(&held);
        assert!(p.take(1).is_none());
    }

    #[test]
    fn hits_are_checked_token_by_token_and_parent_by_parent() {
        let mut p = BlockPool::new(8, true);
        let t = toks(5, 2 * KV_BLOCK);
        let a = computed(&mut p, &t, 2);
        p.release(&a);
        // The same hashes with other tokens (a collision) find nothing.
        let mut u = t.clone();
        u[1] = 99;
        assert!(p.lookup(&u, &chain_hashes(&t, 2)).is_empty());
        // Taking every block evicts the cached ones, tails first; a block registered again
        // with other tokens is found under those, and the old chain is gone.
        let all = p.take(8).unwrap();
        assert_eq!(all, [2, 3, 4, 5, 6, 7, a[1], a[0]]);
        assert_eq!(p.cached(), 0);
        let v = toks(6, KV_BLOCK);
        let hv = chain_hashes(&v, 1);
        assert_eq!(p.register(a[0], hv[0], None, &v), None);
        assert!(p.lookup(&t, &chain_hashes(&t, 2)).is_empty());
        assert_eq!(p.lookup(&v, &hv), [a[0]]);
    }

    #[test]
    fn a_child_of_a_reused_parent_is_not_found() {
        let mut p = BlockPool::new(3, true);
        let t = toks(7, 2 * KV_BLOCK);
        let a = computed(&mut p, &t, 2);
        // The parent block forgotten and registered again with the same tokens (a new
        // generation): its old child must not follow it.
        p.release(&a[..1]);
        let spare = p.take(1).unwrap(); // free block 2
        assert_eq!(spare, [2]);
        let again = p.take(1).unwrap(); // evicts a[0]
        assert_eq!(again, [a[0]]);
        let h = chain_hashes(&t, 2);
        assert_eq!(p.register(a[0], h[0], None, &t[..KV_BLOCK]), None);
        p.release(&a[1..]);
        assert_eq!(
            p.lookup(&t, &h),
            [a[0]],
            "the child's parent changed generation"
        );
    }

    #[test]
    fn a_duplicate_registration_names_the_cached_block() {
        let mut p = BlockPool::new(4, true);
        let t = toks(8, KV_BLOCK);
        let h = chain_hashes(&t, 1);
        let a = computed(&mut p, &t, 1);
        let b = p.take(1).unwrap();
        assert_eq!(p.register(b[0], h[0], None, &t), Some(a[0]));
        assert_eq!(p.cached(), 1);
        // Without the prefix cache nothing is registered or found.
        let mut q = BlockPool::new(2, false);
        let c = q.take(1).unwrap();
        assert_eq!(q.register(c[0], h[0], None, &t), None);
        assert!(q.lookup(&t, &h).is_empty());
        q.release(&c);
        assert_eq!(q.available(), 2);
    }

    #[test]
    fn dropping_the_cache_frees_the_unheld_and_forgets_the_held() {
        let mut p = BlockPool::new(4, true);
        let t = toks(9, 2 * KV_BLOCK);
        let a = computed(&mut p, &t, 2);
        p.release(&a[1..]);
        p.drop_cache();
        assert_eq!((p.cached(), p.used(), p.available()), (0, 1, 3));
        assert!(p.lookup(&t, &chain_hashes(&t, 2)).is_empty());
        p.release(&a[..1]);
        assert_eq!(p.available(), 4);
    }
}
