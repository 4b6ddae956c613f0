//! The paged KV cache's storage: a fixed pool of blocks, each holding `block_size` tokens of
//! keys and values for every layer in the layout's formats, and the per-sequence view the
//! model writes through.
//!
//! Layout of a block: per layer, a key region then a value region ([`KvLayout::regions`]),
//! each one page per KV head in the codec's own format. A (block, layer) pair hands attention
//! one [`KvTile`]. Blocks are allocated and shared by the [`super::KvCacheManager`]; this module
//! only stores their contents.

use super::{ExactKeyPart, KvError, KvLayout, SequenceKv};
use std::borrow::Cow;
use tessera_kernels::cpu::pool;
use std::cell::UnsafeCell;
use std::sync::Arc;
use tessera_kernels::attention::{KvTile, KvView};
use tessera_kernels::kv::{KvCodec, KvPageMut};

/// Encoding work (tokens × heads × roles) below which a write stays on the calling thread.
const PARALLEL_WRITE_MIN: usize = 64;

/// The pool's memory. Zero-initialised lazily by the OS (pages are touched on first write).
pub struct BlockPool {
    layout: Arc<KvLayout>,
    num_blocks: usize,
    /// u64 words so every region (8-byte aligned inside a block) is aligned in memory.
    data: Box<[UnsafeCell<u64>]>,
}

// SAFETY: the pool is shared between the sequences of one forward pass. Each sequence writes
// only blocks it owns exclusively (blocks shared through the prefix cache are full and never
// written again; see `PagedSeqKv::write`), and reads only its own blocks, so no location is
// written by one thread while another accesses it.
unsafe impl Sync for BlockPool {}

impl BlockPool {
    /// A pool of `num_blocks` blocks in `layout`.
    pub fn new(layout: Arc<KvLayout>, num_blocks: usize) -> Self {
        let words = layout.block_bytes() / 8 * num_blocks;
        // vec![0; n] is a calloc: untouched pages cost no memory.
        let data: Vec<u64> = vec![0; words];
        // SAFETY: UnsafeCell<u64> has the same layout as u64.
        let data = unsafe { Box::from_raw(Box::into_raw(data.into_boxed_slice()) as *mut [UnsafeCell<u64>]) };
        BlockPool { layout, num_blocks, data }
    }

    /// The storage layout.
    pub fn layout(&self) -> &Arc<KvLayout> {
        &self.layout
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Copies block `src`'s contents (every layer's keys and values) into block `dst`: a fork's
    /// private copy of its parent's partial last block.
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let bb = self.layout.block_bytes();
        assert!((src as usize) < self.num_blocks && (dst as usize) < self.num_blocks);
        if src == dst {
            return;
        }
        // SAFETY: both blocks lie inside the pool (asserted), they differ so the ranges do not
        // overlap, and `&mut self` excludes every other access.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(src, 0), self.ptr(dst, 0), bb) };
    }

    /// Pointer to byte `offset` of `block`.
    fn ptr(&self, block: u32, offset: usize) -> *mut u8 {
        assert!((block as usize) < self.num_blocks && offset <= self.layout.block_bytes());
        // SAFETY: in bounds of the allocation (asserted).
        unsafe { (self.data.as_ptr() as *mut u8).add(block as usize * self.layout.block_bytes() + offset) }
    }

    /// The keys and values of `len` tokens of `block` in `layer`.
    fn tile(&self, block: u32, layer: usize, start: usize, len: usize) -> KvTile<'_> {
        let (k, v) = self.layout.regions(layer);
        // SAFETY: in bounds (regions lie inside a block); no one writes these tokens during
        // the borrow (see the `Sync` impl).
        let (keys, values) = unsafe {
            (
                std::slice::from_raw_parts(self.ptr(block, k.start), k.len()),
                std::slice::from_raw_parts(self.ptr(block, v.start), v.len()),
            )
        };
        KvTile { start, len, slots: self.layout.block_size(), keys, values }
    }

    /// Tokens `0..end` of layer `layer` of the sequence whose block table is `blocks`, with
    /// the sequence's exact keys when its key format keeps some.
    pub fn view<'a>(&'a self, blocks: &[u32], layer: usize, end: usize, exact: Option<&'a ExactKeyPart>) -> KvView<'a> {
        let bs = self.layout.block_size();
        let (k, v) = self.layout.codecs(layer);
        let tiles = (0..end.div_ceil(bs)).map(|b| self.tile(blocks[b], layer, b * bs, bs.min(end - b * bs))).collect();
        KvView { k, v, tiles, query_scale: self.layout.key_scale(layer), exact: exact.map(|e| e.view(layer)) }
    }

    /// Encodes head `head`'s rows (`n × head_dim`) into slots `slot..` of its page in the
    /// region at `region` of `block`.
    ///
    /// # Safety
    /// The caller owns `block` exclusively for the duration of the forward pass, and no other
    /// thread writes the same (block, region, head) page at the same time.
    unsafe fn encode(&self, codec: &dyn KvCodec, block: u32, region: usize, head: usize, slot: usize, rows: &[f32]) {
        let bs = self.layout.block_size();
        let pb = codec.page_bytes(bs);
        assert!(slot * codec.head_dim() + rows.len() <= bs * codec.head_dim());
        // SAFETY: the page lies inside the block; exclusive per the caller's contract.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr(block, region + head * pb), pb) };
        codec.encode(head, KvPageMut { bytes, tokens: bs }, slot, rows);
    }
}

/// One sequence's cache as the model sees it: its block table over the shared pool.
pub struct PagedSeqKv<'a> {
    pool: &'a BlockPool,
    blocks: &'a [u32],
    len: usize,
    /// Positions below this live in shared (read-only) blocks.
    shared_len: usize,
    /// The sequence's exact keys, when its key format keeps some.
    exact: Option<&'a mut ExactKeyPart>,
}

impl<'a> PagedSeqKv<'a> {
    /// A view of `len` cached tokens in `blocks`, of which the first `shared_len` tokens are in
    /// blocks shared with other sequences (never written). Panics if a block id is out of range.
    pub fn new(pool: &'a BlockPool, blocks: &'a [u32], len: usize, shared_len: usize) -> Self {
        assert!(blocks.iter().all(|&b| (b as usize) < pool.num_blocks), "block id out of range");
        assert!(len <= blocks.len() * pool.layout.block_size() && shared_len <= len);
        PagedSeqKv { pool, blocks, len, shared_len, exact: None }
    }

    /// The same, recording keys in (and scoring from) the sequence's exact-key store too.
    pub fn with_exact(mut self, exact: Option<&'a mut ExactKeyPart>) -> Self {
        self.exact = exact;
        self
    }
}

impl SequenceKv for PagedSeqKv<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn reserve(&mut self, n: usize) -> Result<(), KvError> {
        let capacity = self.blocks.len() * self.pool.layout.block_size();
        let needed = self.len + n;
        if needed > capacity {
            return Err(KvError::Capacity { needed, capacity });
        }
        Ok(())
    }

    fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let layout = &self.pool.layout;
        let (bs, geom) = (layout.block_size(), layout.geometry());
        let (hd, kw) = (geom.head_dim, geom.head_dim * geom.n_kv_heads);
        assert!(pos >= self.shared_len, "write at {pos} into a shared block (shared up to {})", self.shared_len);
        assert!(k.len() == v.len() && k.len().is_multiple_of(kw));
        let tokens = k.len() / kw;
        let (kc, vc) = layout.codecs(layer);
        let (kr, vr) = layout.regions(layer);
        // Keys as the codec stores them (`KvLayout::set_key_transform`).
        let k: Cow<'_, [f32]> = match layout.key_center(layer) {
            Some(_) => {
                let mut t = k.to_vec();
                layout.transform_keys(layer, &mut t);
                t.into()
            }
            None => k.into(),
        };
        if let Some(e) = self.exact.as_deref_mut() {
            e.write(layer, pos, &k);
        }
        let k = &*k;
        // Pages to write: (first token, tokens, role, head); each a distinct page.
        let mut jobs = Vec::new();
        let mut done = 0;
        while done < tokens {
            let p = pos + done;
            let n = (bs - p % bs).min(tokens - done);
            for role in 0..2 {
                for g in 0..geom.n_kv_heads {
                    jobs.push((done, n, role, g));
                }
            }
            done += n;
        }
        let run = |&(t0, n, role, g): &(usize, usize, usize, usize)| {
            let (codec, region, src) = if role == 0 { (kc, kr.start, k) } else { (vc, vr.start, v) };
            let rows: Vec<f32> = (t0..t0 + n).flat_map(|t| &src[t * kw + g * hd..t * kw + (g + 1) * hd]).copied().collect();
            let p = pos + t0;
            // SAFETY: positions >= shared_len are in blocks this sequence owns alone, and each
            // job writes a different (block, role, head) page.
            unsafe { self.pool.encode(codec, self.blocks[p / bs], region, g, p % bs, &rows) };
        };
        if tokens * 2 * geom.n_kv_heads >= PARALLEL_WRITE_MIN {
            pool::for_each(jobs.len(), |i| run(&jobs[i]));
        } else {
            jobs.iter().for_each(run);
        }
    }

    fn view(&self, layer: usize, end: usize) -> KvView<'_> {
        self.pool.view(self.blocks, layer, end, self.exact.as_deref())
    }

    fn advance(&mut self, n: usize) {
        self.len += n;
        if let Some(e) = self.exact.as_deref_mut() {
            e.advance(self.len);
        }
    }

    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        if let Some(e) = self.exact.as_deref_mut() {
            e.truncate(self.len);
        }
    }
}
