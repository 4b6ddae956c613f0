//! Block allocation with reference counts and automatic prefix caching.
//!
//! A full block of tokens is registered under a key (the key's parent block's unique id, the
//! block's tokens). A later sequence whose prompt starts with the same tokens walks the chain
//! from the root and reuses every matching block instead of recomputing it. Keys hold the
//! tokens themselves, and parents are named by ids that are never reused, so a hit is exact
//! (no hash collisions).
//!
//! Blocks no sequence references are free. Free blocks that hold a registered prefix stay
//! findable until they are needed: allocation takes never-registered blocks first, then
//! evicts registered ones least-recently-freed first.
//!
//! Only the [`super::KvCacheManager`] uses this pool-level bookkeeping: it keeps the sequences'
//! block tables on top of it.

use super::SinkKeys;
use std::collections::{BTreeMap, HashMap};

/// The root of every prefix chain.
pub(super) const ROOT: u64 = 0;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct BlockKey {
    parent: u64,
    tokens: Box<[u32]>,
}

#[derive(Clone, Debug, Default)]
struct BlockMeta {
    refs: u32,
    key: Option<BlockKey>,
    /// Unique id of the registered content (0: not registered).
    uid: u64,
    /// Position in the eviction order while free and registered.
    free_tick: Option<u64>,
    /// A registered first block's exact sink keys (key formats that keep them).
    sink: Option<SinkKeys>,
}

/// Allocates the pool's blocks to sequences.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    meta: Vec<BlockMeta>,
    /// Free blocks holding nothing reusable.
    free: Vec<u32>,
    /// Free blocks holding a registered prefix, by the tick they were freed at.
    evictable: BTreeMap<u64, u32>,
    cached: HashMap<BlockKey, u32>,
    next_uid: u64,
    tick: u64,
    prefix_caching: bool,
}

/// The result of a prefix-cache lookup: blocks now referenced by the caller.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrefixHit {
    /// Reused blocks, in order.
    pub blocks: Vec<u32>,
    /// Unique id of the last reused block's content (the parent for the next one).
    pub chain: u64,
    /// The first reused block's exact sink keys, when they were attached to it.
    pub sink: Option<SinkKeys>,
}

impl BlockManager {
    /// Manages `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        assert!(block_size > 0 && num_blocks <= u32::MAX as usize);
        BlockManager {
            block_size,
            meta: vec![BlockMeta::default(); num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            evictable: BTreeMap::new(),
            cached: HashMap::new(),
            next_uid: ROOT + 1,
            tick: 0,
            prefix_caching,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }

    /// Blocks available to allocate (free, including evictable cached ones).
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Whether prefix caching is on.
    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Finds and references the longest cached run of full blocks that starts `tokens`,
    /// leaving at least one token uncached (its logits must be computed).
    pub fn lookup(&mut self, tokens: &[u32]) -> PrefixHit {
        let mut hit = PrefixHit { blocks: Vec::new(), chain: ROOT, sink: None };
        if !self.prefix_caching || tokens.is_empty() {
            return hit;
        }
        let max_blocks = (tokens.len() - 1) / self.block_size;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let key = BlockKey { parent: hit.chain, tokens: chunk.into() };
            let Some(&b) = self.cached.get(&key) else { break };
            self.acquire(b);
            hit.chain = self.meta[b as usize].uid;
            hit.blocks.push(b);
        }
        hit.sink = hit.blocks.first().and_then(|&b| self.meta[b as usize].sink.clone());
        hit
    }

    /// Adds a reference to each of `blocks` (held by another sequence): a fork shares its
    /// parent's full blocks.
    pub fn share(&mut self, blocks: &[u32]) {
        for &b in blocks {
            assert!(self.meta[b as usize].refs > 0, "block {b} shared while free");
            self.acquire(b);
        }
    }

    fn acquire(&mut self, b: u32) {
        let m = &mut self.meta[b as usize];
        if m.refs == 0 {
            if let Some(t) = m.free_tick.take() {
                self.evictable.remove(&t);
            }
        }
        m.refs += 1;
    }

    /// Allocates `n` blocks, or none if fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.num_free() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    let (_, b) = self.evictable.pop_first().expect("counted above");
                    let m = &mut self.meta[b as usize];
                    let key = m.key.take().expect("evictable blocks are registered");
                    self.cached.remove(&key);
                    m.free_tick = None;
                    m.uid = 0;
                    m.sink = None;
                    b
                }
            };
            self.meta[b as usize].refs = 1;
            out.push(b);
        }
        Some(out)
    }

    /// Registers a full block's content under its parent `chain`; returns the chain value
    /// for the next block. If the same content is already cached under another block, that
    /// block's id continues the chain and this one stays private.
    pub fn register(&mut self, block: u32, chain: u64, tokens: &[u32]) -> u64 {
        debug_assert_eq!(tokens.len(), self.block_size);
        if !self.prefix_caching {
            return ROOT;
        }
        let key = BlockKey { parent: chain, tokens: tokens.into() };
        if let Some(&existing) = self.cached.get(&key) {
            return self.meta[existing as usize].uid;
        }
        let uid = self.next_uid;
        self.next_uid += 1;
        let m = &mut self.meta[block as usize];
        debug_assert!(m.key.is_none(), "block {block} registered twice");
        m.uid = uid;
        m.key = Some(key.clone());
        self.cached.insert(key, block);
        uid
    }

    /// Attaches a sequence's exact sink keys to its first block, when that block is registered
    /// as a first block (a later hit on it restores them; they go when the block is evicted).
    pub fn attach_sink(&mut self, block: u32, keys: SinkKeys) {
        let m = &mut self.meta[block as usize];
        if m.key.as_ref().is_some_and(|k| k.parent == ROOT) {
            m.sink = Some(keys);
        }
    }

    /// Drops one reference to each block. The blocks are released last to first, so a
    /// sequence's tail is evicted before its (more shareable) head.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let m = &mut self.meta[b as usize];
            assert!(m.refs > 0, "block {b} released more often than referenced");
            m.refs -= 1;
            if m.refs == 0 {
                if m.key.is_some() {
                    self.tick += 1;
                    m.free_tick = Some(self.tick);
                    self.evictable.insert(self.tick, b);
                } else {
                    self.free.push(b);
                }
            }
        }
    }
}

#[cfg(test)]
impl BlockManager {
    /// References held on block `b`.
    pub(crate) fn refs(&self, b: u32) -> u32 {
        self.meta[b as usize].refs
    }

    /// Panics unless the bookkeeping is consistent: every block is either referenced, free
    /// (holding nothing reusable) or evictable (holding a registered prefix), exactly once;
    /// the prefix map and the blocks' keys agree.
    pub(crate) fn check_invariants(&self) {
        let mut seen = vec![0u8; self.meta.len()];
        for &b in &self.free {
            let m = &self.meta[b as usize];
            assert!(m.refs == 0 && m.key.is_none() && m.free_tick.is_none() && m.uid == 0, "free block {b}: {m:?}");
            seen[b as usize] += 1;
        }
        for (&t, &b) in &self.evictable {
            let m = &self.meta[b as usize];
            assert!(m.refs == 0 && m.key.is_some() && m.free_tick == Some(t), "evictable block {b}: {m:?}");
            seen[b as usize] += 1;
        }
        for (b, m) in self.meta.iter().enumerate() {
            if m.refs > 0 {
                assert!(m.free_tick.is_none(), "referenced block {b} is in the eviction order");
                seen[b] += 1;
            }
            assert_eq!(seen[b], 1, "block {b} is in {} of free/evictable/referenced", seen[b]);
            if let Some(k) = &m.key {
                assert_eq!(self.cached.get(k), Some(&(b as u32)), "block {b}'s key maps elsewhere");
                assert!(m.uid != ROOT);
            }
            assert!(m.sink.is_none() || m.key.as_ref().is_some_and(|k| k.parent == ROOT), "sink keys on block {b}");
        }
        for (k, &b) in &self.cached {
            assert_eq!(self.meta[b as usize].key.as_ref(), Some(k), "cached key of block {b}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i.wrapping_mul(2654435761).wrapping_add(seed) % 1000).collect()
    }

    /// Allocates and registers every full block of `t`, like a sequence that computed it.
    fn compute(m: &mut BlockManager, t: &[u32]) -> Vec<u32> {
        let hit = m.lookup(t);
        let mut blocks = hit.blocks.clone();
        blocks.extend(m.allocate(m.blocks_for(t.len()) - blocks.len()).unwrap());
        let mut chain = hit.chain;
        for (i, c) in t.chunks_exact(m.block_size()).enumerate().skip(hit.blocks.len()) {
            chain = m.register(blocks[i], chain, c);
        }
        blocks
    }

    #[test]
    fn hits_are_exact_and_leave_the_last_token() {
        let mut m = BlockManager::new(16, 4, true);
        let a = toks(12, 1);
        let ba = compute(&mut m, &a);
        // Same 12 tokens: only 2 blocks reused (the last token must be recomputed).
        let h = m.lookup(&a);
        assert_eq!(h.blocks, ba[..2]);
        m.release(&h.blocks);
        // Shares the first block only: the second differs in one token.
        let mut b = a.clone();
        b[5] += 1;
        let h = m.lookup(&b);
        assert_eq!(h.blocks, ba[..1]);
        m.release(&h.blocks);
        // Same tokens at a different offset (different parent) are not a hit.
        let mut c = a[4..8].to_vec();
        c.extend(&a[4..12]);
        assert!(m.lookup(&c).blocks.is_empty());
        m.release(&ba);
    }

    #[test]
    fn refcounts_gate_freeing_and_eviction_prefers_uncached_then_oldest() {
        let mut m = BlockManager::new(6, 4, true);
        let a = toks(9, 1); // 3 blocks, 2 registered
        let ba = compute(&mut m, &a);
        assert_eq!(m.num_used(), 3);
        let h = m.lookup(&a);
        assert_eq!(h.blocks.len(), 2);
        m.release(&ba);
        assert_eq!(m.num_used(), 2, "blocks still referenced by the second user stay used");
        m.release(&h.blocks);
        assert_eq!(m.num_used(), 0);
        // 6 free: 4 uncached + 2 cached. Taking 4 keeps the cache intact...
        let x = m.allocate(4).unwrap();
        assert!(x.iter().all(|b| !ba[..2].contains(b)));
        assert_eq!(m.lookup(&a).blocks.len(), 2);
        m.release(&ba[..2]);
        // ...taking one more evicts the tail block first (released last-to-first).
        let y = m.allocate(1).unwrap();
        assert_eq!(y, vec![ba[1]]);
        let h = m.lookup(&a);
        assert_eq!(h.blocks, vec![ba[0]]);
        assert!(m.allocate(2).is_none(), "only one block left");
        m.release(&h.blocks);
        m.release(&x);
        m.release(&y);
        assert_eq!(m.num_free(), 6);
    }

    #[test]
    fn duplicate_content_continues_the_existing_chain() {
        let mut m = BlockManager::new(8, 2, true);
        let t = toks(5, 3);
        // Two sequences compute the same prompt concurrently (neither saw the other's blocks).
        let b1 = m.allocate(3).unwrap();
        let b2 = m.allocate(3).unwrap();
        let (mut c1, mut c2) = (ROOT, ROOT);
        for (i, c) in t.chunks_exact(2).enumerate() {
            c1 = m.register(b1[i], c1, c);
            c2 = m.register(b2[i], c2, c);
        }
        assert_eq!(c1, c2);
        m.release(&b2);
        assert_eq!(m.lookup(&t).blocks, b1[..2]);
    }

    #[test]
    fn disabled_cache_never_hits() {
        let mut m = BlockManager::new(8, 2, false);
        let t = toks(6, 3);
        let b = compute(&mut m, &t);
        assert!(m.lookup(&t).blocks.is_empty());
        m.release(&b);
        assert_eq!(m.num_free(), 8);
    }

    /// Sink keys attached to a registered first block come back with a hit on it and go with
    /// its eviction; a private block takes none.
    #[test]
    fn sink_keys_follow_the_first_block() {
        let mut m = BlockManager::new(3, 4, true);
        let t = toks(9, 1);
        let blocks = compute(&mut m, &t);
        let keys: SinkKeys = vec![vec![vec![1.5f32; 8]]].into();
        m.attach_sink(blocks[0], keys.clone());
        m.attach_sink(blocks[1], keys.clone()); // registered, but not a first block: ignored
        assert!(m.meta[blocks[1] as usize].sink.is_none());
        m.release(&blocks);
        let hit = m.lookup(&t);
        assert_eq!((hit.blocks.len(), hit.sink.as_ref()), (2, Some(&keys)));
        m.release(&hit.blocks);
        // Evicting the blocks for other content forgets the keys.
        let other = m.allocate(3).unwrap();
        assert!(m.meta[blocks[0] as usize].sink.is_none(), "evicted with its keys");
        m.release(&other);
        assert_eq!(m.lookup(&t).blocks.len(), 0);
        let private = m.allocate(1).unwrap();
        m.attach_sink(private[0], keys);
        assert!(m.meta[private[0] as usize].sink.is_none());
    }

    /// Seeded random operations (allocations, prefix lookups, registrations, shares, releases)
    /// against a shadow of who holds what: refcounts always equal the holders, a block is
    /// never handed out while held, every hit holds exactly the tokens looked up, and releasing
    /// everything frees the pool.
    #[test]
    fn random_operations_keep_refcounts_and_hits_exact() {
        use rand::{Rng, SeedableRng};
        use rand_chacha::ChaCha8Rng;
        const BS: usize = 3;
        const N: usize = 20;
        let mut hits = 0;
        for seed in 0..300u64 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let mut m = BlockManager::new(N, BS, seed % 5 != 0);
            // Holders: (blocks, the tokens each block holds, registered prefix blocks, chain).
            let mut holders: Vec<(Vec<u32>, Vec<u32>, usize, u64)> = Vec::new();
            // What each registered block holds: the whole prefix up to and including it.
            let mut content: HashMap<u32, Vec<u32>> = HashMap::new();
            for _ in 0..200 {
                match rng.gen_range(0..10) {
                    0..=3 => {
                        // A sequence: look its prompt up, allocate the rest, register what is full.
                        let len = rng.gen_range(1..=12);
                        let base = rng.gen_range(0..2u32);
                        let mut t: Vec<u32> = (0..len as u32).map(|i| base * 50 + i).collect();
                        if rng.gen_bool(0.3) {
                            t[rng.gen_range(0..len)] = 7;
                        }
                        let hit = m.lookup(&t);
                        for (i, &b) in hit.blocks.iter().enumerate() {
                            assert_eq!(content.get(&b).map(Vec::as_slice), Some(&t[..(i + 1) * BS]), "seed {seed}: inexact hit");
                        }
                        hits += hit.blocks.len();
                        let Some(more) = m.allocate(m.blocks_for(len) - hit.blocks.len()) else {
                            m.release(&hit.blocks);
                            continue;
                        };
                        for b in &more {
                            assert!(holders.iter().all(|h| !h.0.contains(b)), "seed {seed}: block {b} handed out while held");
                            content.remove(b);
                        }
                        let registered = hit.blocks.len();
                        let mut blocks = hit.blocks;
                        blocks.extend(more);
                        let mut chain = hit.chain;
                        for i in registered..len / BS {
                            let c = m.register(blocks[i], chain, &t[i * BS..(i + 1) * BS]);
                            if m.meta[blocks[i] as usize].uid == c && c != ROOT {
                                content.insert(blocks[i], t[..(i + 1) * BS].to_vec());
                            }
                            chain = c;
                        }
                        holders.push((blocks, t, len / BS, chain));
                    }
                    4..=5 if !holders.is_empty() => {
                        // A fork: another holder of the same full blocks.
                        let h = &holders[rng.gen_range(0..holders.len())];
                        let full = h.2;
                        let fork = (h.0[..full].to_vec(), h.1[..full * BS].to_vec(), full, h.3);
                        m.share(&fork.0);
                        holders.push(fork);
                    }
                    _ if !holders.is_empty() => {
                        let h = holders.swap_remove(rng.gen_range(0..holders.len()));
                        m.release(&h.0);
                    }
                    _ => {}
                }
                m.check_invariants();
                for b in 0..N as u32 {
                    let held = holders.iter().map(|h| h.0.iter().filter(|&&x| x == b).count() as u32).sum::<u32>();
                    assert_eq!(m.refs(b), held, "seed {seed}: block {b}");
                }
            }
            for h in holders.drain(..) {
                m.release(&h.0);
            }
            m.check_invariants();
            assert_eq!(m.num_free(), N, "seed {seed}");
        }
        assert!(hits > 1000, "the workload reuses prefixes: {hits} blocks hit");
    }
}
