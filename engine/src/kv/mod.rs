//! KV cache storage seen by the model.
//!
//! The model writes each layer's new keys/values at their positions and asks for the
//! cached tokens as [`KvTile`]s, so a paged cache (blocks of tokens) slots in behind the
//! same [`SequenceKv`] trait as the contiguous one here.

mod block_manager;
mod block_pool;

pub use block_manager::{BlockManager, PrefixHit};
pub use block_pool::{BlockPool, PagedSeqKv, PoolShape};

use tessera_kernels::attention::KvTile;

/// Why a KV write failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// The sequence would exceed the cache's capacity.
    #[error("sequence of {needed} tokens exceeds the KV capacity of {capacity}")]
    Capacity {
        /// Tokens needed.
        needed: usize,
        /// Tokens available.
        capacity: usize,
    },
}

/// One sequence's cached keys and values, all layers.
pub trait SequenceKv: Send {
    /// Tokens committed so far (the position of the next token).
    fn len(&self) -> usize;
    /// Whether no tokens are cached.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Makes room for positions `len()..len() + n` in every layer.
    fn reserve(&mut self, n: usize) -> Result<(), KvError>;
    /// Writes `k`/`v` rows (`kv_width` each) for layer `layer` at positions `pos..`.
    fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]);
    /// The cached tokens `0..end` of layer `layer` as tiles.
    fn tiles(&self, layer: usize, end: usize) -> Vec<KvTile<'_>>;
    /// Commits `n` more tokens (after every layer has written them).
    fn advance(&mut self, n: usize);
    /// Forgets everything after the first `len` tokens.
    fn truncate(&mut self, len: usize);
}

/// Tokens added per growth step of a [`ContiguousKv`].
const GROW_TOKENS: usize = 256;

/// A contiguous f32 cache for one sequence, grown on demand up to `capacity` tokens.
#[derive(Debug, Clone)]
pub struct ContiguousKv {
    kv_width: usize,
    capacity: usize,
    len: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl ContiguousKv {
    /// An empty cache for `layers` layers of `kv_width` floats per token.
    pub fn new(layers: usize, kv_width: usize, capacity: usize) -> Self {
        ContiguousKv { kv_width, capacity, len: 0, keys: vec![Vec::new(); layers], values: vec![Vec::new(); layers] }
    }

    /// Bytes currently allocated.
    pub fn allocated_bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|v| v.capacity() * 4).sum()
    }
}

impl SequenceKv for ContiguousKv {
    fn len(&self) -> usize {
        self.len
    }

    fn reserve(&mut self, n: usize) -> Result<(), KvError> {
        let needed = self.len + n;
        if needed > self.capacity {
            return Err(KvError::Capacity { needed, capacity: self.capacity });
        }
        // Grow in exact steps of GROW_TOKENS (not Vec's doubling), never past the capacity,
        // so memory tracks the sequence length.
        let target = needed.next_multiple_of(GROW_TOKENS).min(self.capacity) * self.kv_width;
        for buf in self.keys.iter_mut().chain(self.values.iter_mut()) {
            if buf.len() < needed * self.kv_width {
                buf.reserve_exact(target - buf.len());
                buf.resize(target, 0.0);
            }
        }
        Ok(())
    }

    fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (a, b) = (pos * self.kv_width, pos * self.kv_width + k.len());
        self.keys[layer][a..b].copy_from_slice(k);
        self.values[layer][a..b].copy_from_slice(v);
    }

    fn tiles(&self, layer: usize, end: usize) -> Vec<KvTile<'_>> {
        let n = end * self.kv_width;
        vec![KvTile { start: 0, len: end, keys: &self.keys[layer][..n], values: &self.values[layer][..n] }]
    }

    fn advance(&mut self, n: usize) {
        self.len += n;
    }

    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_in_exact_steps_and_respects_capacity() {
        let mut kv = ContiguousKv::new(2, 4, 600);
        kv.reserve(10).unwrap();
        assert_eq!(kv.allocated_bytes(), 2 * 2 * 256 * 4 * 4);
        kv.advance(10);
        kv.reserve(300).unwrap();
        assert_eq!(kv.allocated_bytes(), 2 * 2 * 512 * 4 * 4);
        kv.advance(300);
        kv.reserve(290).unwrap();
        assert_eq!(kv.allocated_bytes(), 2 * 2 * 600 * 4 * 4, "capped at capacity");
        assert_eq!(kv.reserve(291), Err(KvError::Capacity { needed: 601, capacity: 600 }));
    }

    #[test]
    fn writes_land_at_their_positions_and_truncate_forgets() {
        let mut kv = ContiguousKv::new(1, 2, 8);
        kv.reserve(3).unwrap();
        kv.write(0, 0, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
        kv.write(0, 2, &[9.0, 10.0], &[11.0, 12.0]);
        kv.advance(3);
        let t = kv.tiles(0, 3);
        assert_eq!(t[0].keys, &[1.0, 2.0, 3.0, 4.0, 9.0, 10.0]);
        assert_eq!(t[0].values, &[5.0, 6.0, 7.0, 8.0, 11.0, 12.0]);
        kv.truncate(1);
        assert_eq!(kv.len(), 1);
    }
}
