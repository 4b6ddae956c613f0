//! The paged KV cache's storage: a fixed pool of blocks, each holding `block_size` tokens of
//! keys and values for every layer, and the per-sequence view the model writes through.
//!
//! Layout: block-major, then layer, then keys before values, each `block_size × kv_width`
//! f32 row-major. A block is therefore one contiguous region, and a (block, layer) pair
//! hands attention one [`KvTile`]. Blocks are allocated and shared by the
//! [`super::BlockManager`]; this module only stores their contents.

use super::{KvError, SequenceKv};
use std::cell::UnsafeCell;
use tessera_kernels::attention::KvTile;

/// Geometry of a block pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolShape {
    /// Layers.
    pub layers: usize,
    /// Floats per token per layer in K (and in V).
    pub kv_width: usize,
    /// Tokens per block.
    pub block_size: usize,
}

impl PoolShape {
    /// Floats in one block (all layers, keys and values).
    pub fn block_floats(&self) -> usize {
        self.layers * 2 * self.block_size * self.kv_width
    }

    /// Bytes in one block.
    pub fn block_bytes(&self) -> usize {
        self.block_floats() * std::mem::size_of::<f32>()
    }
}

/// The pool's memory. Zero-initialised lazily by the OS (pages are touched on first write).
pub struct BlockPool {
    shape: PoolShape,
    num_blocks: usize,
    data: Box<[UnsafeCell<f32>]>,
}

// SAFETY: the pool is shared between the sequences of one forward pass. Each sequence writes
// only blocks it owns exclusively (blocks shared through the prefix cache are full and never
// written again; see `PagedSeqKv::write`), and reads only its own blocks, so no location is
// written by one thread while another accesses it.
unsafe impl Sync for BlockPool {}

impl BlockPool {
    /// A pool of `num_blocks` blocks.
    pub fn new(shape: PoolShape, num_blocks: usize) -> Self {
        let floats = shape.block_floats() * num_blocks;
        // vec![0.0; n] is a calloc: untouched pages cost no memory.
        let data: Vec<f32> = vec![0.0; floats];
        // SAFETY: UnsafeCell<f32> has the same layout as f32.
        let data = unsafe { Box::from_raw(Box::into_raw(data.into_boxed_slice()) as *mut [UnsafeCell<f32>]) };
        BlockPool { shape, num_blocks, data }
    }

    /// Geometry.
    pub fn shape(&self) -> PoolShape {
        self.shape
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Offset of (block, layer, keys or values).
    fn offset(&self, block: u32, layer: usize, values: bool) -> usize {
        let s = &self.shape;
        let region = s.block_size * s.kv_width;
        block as usize * s.block_floats() + (layer * 2 + values as usize) * region
    }

    /// The keys and values of `len` tokens of `block` in `layer`.
    fn tile(&self, block: u32, layer: usize, start: usize, len: usize) -> KvTile<'_> {
        let n = len * self.shape.kv_width;
        let (k, v) = (self.offset(block, layer, false), self.offset(block, layer, true));
        // SAFETY: in bounds (block < num_blocks, checked by the block table's construction);
        // no one writes these tokens during the borrow (see the `Sync` impl).
        let (keys, values) = unsafe {
            (
                std::slice::from_raw_parts(self.data[k].get() as *const f32, n),
                std::slice::from_raw_parts(self.data[v].get() as *const f32, n),
            )
        };
        KvTile { start, len, keys, values }
    }

    /// Writes rows `src` (`kv_width` each) at slot `slot` of `block`.
    ///
    /// # Safety
    /// The caller owns `block` exclusively for the duration of the forward pass.
    unsafe fn write_rows(&self, block: u32, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let kw = self.shape.kv_width;
        assert!(slot * kw + k.len() <= self.shape.block_size * kw && k.len() == v.len());
        for (values, src) in [(false, k), (true, v)] {
            let at = self.offset(block, layer, values) + slot * kw;
            // SAFETY: in bounds (asserted); exclusive per the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.data[at].get(), src.len()) };
        }
    }
}

/// One sequence's cache as the model sees it: its block table over the shared pool.
pub struct PagedSeqKv<'a> {
    pool: &'a BlockPool,
    blocks: &'a [u32],
    len: usize,
    /// Positions below this live in shared (read-only) blocks.
    shared_len: usize,
}

impl<'a> PagedSeqKv<'a> {
    /// A view of `len` cached tokens in `blocks`, of which the first `shared_len` tokens are in
    /// blocks shared with other sequences (never written). Panics if a block id is out of range.
    pub fn new(pool: &'a BlockPool, blocks: &'a [u32], len: usize, shared_len: usize) -> Self {
        assert!(blocks.iter().all(|&b| (b as usize) < pool.num_blocks), "block id out of range");
        assert!(len <= blocks.len() * pool.shape.block_size && shared_len <= len);
        PagedSeqKv { pool, blocks, len, shared_len }
    }
}

impl SequenceKv for PagedSeqKv<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn reserve(&mut self, n: usize) -> Result<(), KvError> {
        let capacity = self.blocks.len() * self.pool.shape.block_size;
        let needed = self.len + n;
        if needed > capacity {
            return Err(KvError::Capacity { needed, capacity });
        }
        Ok(())
    }

    fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (bs, kw) = (self.pool.shape.block_size, self.pool.shape.kv_width);
        assert!(pos >= self.shared_len, "write at {pos} into a shared block (shared up to {})", self.shared_len);
        let tokens = k.len() / kw;
        let mut done = 0;
        while done < tokens {
            let p = pos + done;
            let (b, slot) = (p / bs, p % bs);
            let n = (bs - slot).min(tokens - done);
            let rows = done * kw..(done + n) * kw;
            // SAFETY: positions >= shared_len are in blocks this sequence owns alone.
            unsafe { self.pool.write_rows(self.blocks[b], layer, slot, &k[rows.clone()], &v[rows]) };
            done += n;
        }
    }

    fn tiles(&self, layer: usize, end: usize) -> Vec<KvTile<'_>> {
        let bs = self.pool.shape.block_size;
        (0..end.div_ceil(bs)).map(|b| self.pool.tile(self.blocks[b], layer, b * bs, bs.min(end - b * bs))).collect()
    }

    fn advance(&mut self, n: usize) {
        self.len += n;
    }

    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}
