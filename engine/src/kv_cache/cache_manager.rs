//! Each sequence's KV blocks behind a narrow API (after vLLM's `KVCacheManager`).
//!
//! The scheduler names sequences by id and asks for a cached prefix
//! ([`KvCacheManager::lookup_prefix`]), for room for more tokens
//! ([`KvCacheManager::allocate_slots`], which fails so that the scheduler can preempt), to
//! register what was computed ([`KvCacheManager::commit`]), to fork and to free. The manager
//! owns every block table, the prefix-chain bookkeeping and the keys a key format keeps exactly
//! beside the cache, which live and die with the blocks: restored from a prefix hit's first
//! block, copied to a fork, dropped on free. A forward pass reads the tables (and records the
//! exact keys) through [`KvCacheManager::step_caches`].

use super::block_manager::{BlockManager, PrefixHit, ROOT};
use super::ExactKeyStore;
use std::collections::{HashMap, HashSet};

/// One sequence's cache state.
#[derive(Debug)]
struct SeqCache {
    /// Block table.
    blocks: Vec<u32>,
    /// Leading full blocks registered in (or matched from) the prefix cache.
    registered: usize,
    /// Prefix-chain id of the last registered block.
    chain: u64,
    /// Keys kept exactly beside the cache (key formats that keep some).
    exact: Option<ExactKeyStore>,
}

/// Too few free blocks for an allocation (nothing was allocated).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("too few free KV blocks")]
pub struct OutOfBlocks;

/// How a fork starts: what it shares with its parent and the block copy it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fork {
    /// Leading tokens in blocks shared with the parent (its full blocks; never written).
    pub shared: usize,
    /// `(source, destination)`: the parent's partial last block and the fork's own block, to
    /// be filled by copying the source before the fork runs.
    pub copy: Option<(u32, u32)>,
}

/// A scheduled sequence's cache as one forward pass uses it.
#[derive(Debug)]
pub struct StepCache<'a> {
    /// The block table (covering the tokens the pass computes).
    pub blocks: &'a [u32],
    /// The exact keys, when the key format keeps some (the pass records its new keys).
    pub exact: Option<&'a mut ExactKeyStore>,
}

/// Allocates the pool's blocks to sequences and keeps their block tables (see the module docs).
#[derive(Debug)]
pub struct KvCacheManager {
    blocks: BlockManager,
    seqs: HashMap<u64, SeqCache>,
    /// The empty exact-key store each sequence starts from (`None`: the key format keeps none).
    exact: Option<ExactKeyStore>,
}

impl KvCacheManager {
    /// Manages `num_blocks` blocks of `block_size` tokens, with or without prefix caching.
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        KvCacheManager { blocks: BlockManager::new(num_blocks, block_size, prefix_caching), seqs: HashMap::new(), exact: None }
    }

    /// Gives every sequence an (empty) copy of `store` for the keys its format keeps exactly.
    pub fn with_exact_keys(mut self, store: Option<ExactKeyStore>) -> Self {
        self.exact = store;
        self
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.blocks.num_blocks()
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.blocks.num_used()
    }

    /// Whether prefix caching is on.
    pub fn prefix_caching(&self) -> bool {
        self.blocks.prefix_caching()
    }

    /// `seq`'s block table (empty when it holds no blocks).
    pub fn block_table(&self, seq: u64) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |c| &c.blocks)
    }

    /// The pool and `seq`'s state, started (empty, with its exact-key store) when it has none.
    fn open(&mut self, seq: u64) -> (&mut BlockManager, &mut SeqCache) {
        let exact = &self.exact;
        let state = self.seqs.entry(seq).or_insert_with(|| SeqCache { blocks: Vec::new(), registered: 0, chain: ROOT, exact: exact.clone() });
        (&mut self.blocks, state)
    }

    /// Gives `seq`, which holds no blocks, the longest cached run of full blocks that starts
    /// `tokens`, and returns the tokens they hold (0 without prefix caching). At least one token
    /// is left to compute (its logits are needed); a key format with an exact window leaves a
    /// whole window, so that the last token scores it exactly; with an exact sink, a hit counts
    /// only if its first block kept the sink's keys, which `seq` then takes.
    pub fn lookup_prefix(&mut self, seq: u64, tokens: &[u32]) -> usize {
        let (blocks, c) = self.open(seq);
        debug_assert!(c.blocks.is_empty(), "seq {seq} looks a prefix up while holding blocks");
        let window = c.exact.as_ref().map_or(1, |e| e.window().max(1));
        let mut hit = blocks.lookup(&tokens[..tokens.len().saturating_sub(window - 1)]);
        if let Some(e) = c.exact.as_mut().filter(|e| e.sink() > 0 && !hit.blocks.is_empty()) {
            match &hit.sink {
                Some(keys) => e.restore_sink(keys),
                None => {
                    blocks.release(&hit.blocks);
                    hit = PrefixHit::default();
                }
            }
        }
        c.registered = hit.blocks.len();
        c.chain = hit.chain;
        c.blocks = hit.blocks;
        c.registered * blocks.block_size()
    }

    /// Makes `seq`'s block table cover `tokens` tokens, allocating the blocks it lacks; fails,
    /// allocating nothing, when too few are free (the caller preempts or waits).
    pub fn allocate_slots(&mut self, seq: u64, tokens: usize) -> Result<(), OutOfBlocks> {
        let (blocks, c) = self.open(seq);
        let need = blocks.blocks_for(tokens).saturating_sub(c.blocks.len());
        if need > 0 {
            c.blocks.extend(blocks.allocate(need).ok_or(OutOfBlocks)?);
        }
        Ok(())
    }

    /// Records that the first `computed` of `tokens` (the sequence's tokens) are in `seq`'s
    /// blocks, and registers its newly full blocks in the prefix cache (the first with its exact
    /// sink keys, for key formats that keep them).
    ///
    /// # Panics
    /// If `seq` holds no blocks.
    pub fn commit(&mut self, seq: u64, tokens: &[u32], computed: usize) {
        let bs = self.blocks.block_size();
        let c = self.seqs.get_mut(&seq).expect("committed sequences hold blocks");
        while (c.registered + 1) * bs <= computed {
            let b = c.registered;
            c.chain = self.blocks.register(c.blocks[b], c.chain, &tokens[b * bs..(b + 1) * bs]);
            if let Some(keys) = c.exact.as_ref().filter(|_| b == 0).and_then(ExactKeyStore::sink_keys) {
                self.blocks.attach_sink(c.blocks[0], keys);
            }
            c.registered += 1;
        }
    }

    /// Starts `child`, which holds no blocks, as a fork of `parent`, whose block table holds
    /// exactly its `computed` tokens: the child references the parent's full blocks, gets a
    /// block of its own for a partial last one (see [`Fork::copy`]), and copies of the parent's
    /// prefix-chain state and exact keys. `None`, changing nothing, when no block is free for
    /// the copy.
    ///
    /// # Panics
    /// If `parent` holds no blocks.
    pub fn fork(&mut self, parent: u64, child: u64, computed: usize) -> Option<Fork> {
        debug_assert!(!self.seqs.contains_key(&child), "fork {child} already holds blocks");
        let bs = self.blocks.block_size();
        let full = computed / bs;
        let private = self.blocks.allocate(usize::from(!computed.is_multiple_of(bs)))?;
        let p = self.seqs.get(&parent).expect("a fork's parent holds blocks");
        debug_assert_eq!(p.blocks.len(), self.blocks.blocks_for(computed));
        self.blocks.share(&p.blocks[..full]);
        let copy = private.first().map(|&dst| (p.blocks[full], dst));
        let mut table = p.blocks[..full].to_vec();
        table.extend(private);
        let state = SeqCache { blocks: table, registered: p.registered, chain: p.chain, exact: p.exact.clone() };
        self.seqs.insert(child, state);
        Some(Fork { shared: full * bs, copy })
    }

    /// Drops `seq`'s blocks and exact keys (nothing when it holds none): its tokens must be
    /// computed again before it runs.
    pub fn free(&mut self, seq: u64) {
        if let Some(c) = self.seqs.remove(&seq) {
            self.blocks.release(&c.blocks);
        }
    }

    /// The caches of `seqs` (distinct sequences holding blocks), in order, for one forward pass.
    ///
    /// # Panics
    /// If a sequence holds no blocks or is named twice.
    pub fn step_caches(&mut self, seqs: &[u64]) -> Vec<StepCache<'_>> {
        let wanted: HashSet<u64> = seqs.iter().copied().collect();
        let mut caches: HashMap<u64, StepCache<'_>> = self
            .seqs
            .iter_mut()
            .filter(|(k, _)| wanted.contains(k))
            .map(|(&k, c)| (k, StepCache { blocks: &c.blocks, exact: c.exact.as_mut() }))
            .collect();
        seqs.iter().map(|k| caches.remove(k).expect("scheduled sequences hold blocks, once each")).collect()
    }
}

#[cfg(test)]
impl KvCacheManager {
    /// References held on block `b`.
    pub(crate) fn refs(&self, b: u32) -> u32 {
        self.blocks.refs(b)
    }

    /// The sequences holding cache state.
    pub(crate) fn sequences(&self) -> impl Iterator<Item = u64> + '_ {
        self.seqs.keys().copied()
    }

    /// Panics unless the pool's bookkeeping is consistent and every reference on a block is
    /// one of the block tables'.
    pub(crate) fn check_invariants(&self) {
        self.blocks.check_invariants();
        let mut refs = vec![0u32; self.num_blocks()];
        for &b in self.seqs.values().flat_map(|c| &c.blocks) {
            refs[b as usize] += 1;
        }
        for (b, &r) in refs.iter().enumerate() {
            assert_eq!(self.refs(b as u32), r, "block {b}: refcount vs block tables");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::{KvDtype, KvLayout};
    use tessera_kernels::kv::{KvFormat, KvGeometry};

    const BS: usize = 4;

    /// A sequence that computes `tokens` from scratch (no lookup) and commits them.
    fn compute(m: &mut KvCacheManager, seq: u64, tokens: &[u32]) {
        m.allocate_slots(seq, tokens.len()).unwrap();
        m.commit(seq, tokens, tokens.len());
    }

    #[test]
    fn allocation_grows_the_table_or_fails_whole() {
        let mut m = KvCacheManager::new(4, BS, true);
        m.allocate_slots(1, 5).unwrap();
        assert_eq!(m.block_table(1).len(), 2);
        m.allocate_slots(1, 8).unwrap();
        assert_eq!(m.block_table(1).len(), 2, "still fits");
        let before = m.block_table(1).to_vec();
        assert_eq!(m.allocate_slots(1, 4 * BS + 1), Err(OutOfBlocks));
        assert_eq!((m.block_table(1), m.num_used()), (&before[..], 2), "a failed allocation takes nothing");
        m.allocate_slots(2, 2 * BS).unwrap();
        m.check_invariants();
        m.free(1);
        m.free(2);
        m.free(3);
        assert_eq!((m.num_used(), m.sequences().count()), (0, 0));
    }

    #[test]
    fn prefix_hits_and_forks_share_full_blocks_only() {
        let mut m = KvCacheManager::new(8, BS, true);
        let t: Vec<u32> = (0..10).collect();
        compute(&mut m, 1, &t);
        // A new sequence with the same prompt reuses both full blocks (the rest is computed).
        assert_eq!(m.lookup_prefix(2, &t), 2 * BS);
        assert_eq!(m.block_table(2), &m.block_table(1)[..2]);
        m.free(2);
        // A fork shares the full blocks and copies the partial one into a block of its own.
        let f = m.fork(1, 3, t.len()).unwrap();
        let (parent, child) = (m.block_table(1).to_vec(), m.block_table(3).to_vec());
        assert_eq!((f.shared, &child[..2]), (2 * BS, &parent[..2]));
        assert_eq!(f.copy, Some((parent[2], child[2])));
        m.check_invariants();
        // Without a free block for the copy, nothing changes.
        m.allocate_slots(4, 4 * BS).unwrap();
        assert_eq!(m.fork(1, 5, t.len()), None);
        assert!(m.block_table(5).is_empty());
        m.check_invariants();
        // A whole-block prompt forks without a copy.
        m.free(4);
        compute(&mut m, 6, &t[..8]);
        assert_eq!(m.fork(6, 7, 8), Some(Fork { shared: 8, copy: None }));
        for s in [1, 3, 6, 7] {
            m.free(s);
        }
        assert_eq!(m.num_used(), 0);
    }

    /// With a qjl1 key format, a hit leaves a window to compute and brings the sink's exact
    /// keys, or is not used when its first block kept none.
    #[test]
    fn exact_keys_follow_the_first_block() {
        let dtype = KvDtype { k: "qjl1-w3-s2".parse().unwrap(), v: KvFormat::BF16 };
        let layout = KvLayout::new(1, KvGeometry { head_dim: 4, n_kv_heads: 1 }, BS, dtype, None, 1).unwrap();
        let mut m = KvCacheManager::new(8, BS, true).with_exact_keys(ExactKeyStore::for_layouts([&*layout]));
        let t: Vec<u32> = (0..9).collect();
        m.allocate_slots(1, t.len()).unwrap();
        let rows: Vec<f32> = (0..t.len() * 4).map(|i| i as f32).collect();
        m.step_caches(&[1])[0].exact.as_mut().unwrap().only_part().write(0, 0, &rows);
        m.commit(1, &t, t.len());
        let want = m.step_caches(&[1])[0].exact.as_ref().unwrap().sink_keys();
        assert!(want.is_some());
        m.free(1);
        // 9 tokens, a window of 3: one block is reused (two would leave a token to compute), with
        // the sink's keys.
        assert_eq!(m.lookup_prefix(2, &t), BS);
        assert_eq!(m.step_caches(&[2])[0].exact.as_ref().unwrap().sink_keys(), want);
        m.free(2);
        // Computed without recording keys: the first block keeps no sink keys, so no hit.
        let u: Vec<u32> = (100..112).collect();
        compute(&mut m, 3, &u);
        m.free(3);
        assert_eq!((m.lookup_prefix(4, &u), m.num_used()), (0, 0));
        m.free(4);
        assert_eq!((m.num_used(), m.sequences().count()), (0, 0));
    }
}
