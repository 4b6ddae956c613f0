//! KV cache storage seen by the model.
//!
//! The model writes each layer's new keys/values at their positions and asks for the cached
//! tokens as a [`KvView`] (the layer's formats and one tile per block), so the serving pool
//! ([`PagedSeqKv`]) and a single sequence's own cache ([`LocalKv`]) share one storage
//! ([`BlockPool`]) behind the [`SequenceKv`] trait, in any format of [`KvLayout`].

mod block_manager;
mod cache_manager;
pub mod checkpoint_scheme;
mod exact_keys;
mod block_pool;
mod layout;

pub use cache_manager::{Fork, KvCacheManager, OutOfBlocks, StepCache};
pub use block_pool::{BlockPool, PagedSeqKv};
pub use exact_keys::{ExactKeyPart, ExactKeyStore, SinkKeys};
pub use layout::{KeyTransform, KvCacheScheme, KvDtype, KvLayout, KvLayoutError, KvRequest, DEFAULT_BLOCK_SIZE};

use std::sync::Arc;
use tessera_kernels::attention::KvView;

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
    /// Writes `k`/`v` rows (`kv_width` each) for layer `layer` at positions `pos..`, encoding
    /// them in the layer's formats.
    fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]);
    /// The cached tokens `0..end` of layer `layer`, as attention reads them.
    fn view(&self, layer: usize, end: usize) -> KvView<'_>;
    /// Commits `n` more tokens (after every layer has written them).
    fn advance(&mut self, n: usize);
    /// Forgets everything after the first `len` tokens.
    fn truncate(&mut self, len: usize);
}

/// One sequence's cache with a pool of its own (generation, perplexity, tests): blocks are
/// used in order; untouched blocks cost no memory (the pool is allocated lazily by the OS).
pub struct LocalKv {
    pool: BlockPool,
    blocks: Vec<u32>,
    len: usize,
    exact: Option<ExactKeyPart>,
}

impl LocalKv {
    /// An empty cache of up to `capacity` tokens in `layout`.
    pub fn new(layout: Arc<KvLayout>, capacity: usize) -> Self {
        let n = capacity.div_ceil(layout.block_size());
        let exact = ExactKeyPart::for_layout(&layout);
        LocalKv { pool: BlockPool::new(layout, n), blocks: (0..n as u32).collect(), len: 0, exact }
    }

    fn paged(&mut self) -> PagedSeqKv<'_> {
        PagedSeqKv::new(&self.pool, &self.blocks, self.len, 0).with_exact(self.exact.as_mut())
    }
}

impl SequenceKv for LocalKv {
    fn len(&self) -> usize {
        self.len
    }

    fn reserve(&mut self, n: usize) -> Result<(), KvError> {
        self.paged().reserve(n)
    }

    fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        self.paged().write(layer, pos, k, v)
    }

    fn view(&self, layer: usize, end: usize) -> KvView<'_> {
        self.pool.view(&self.blocks, layer, end, self.exact.as_ref())
    }

    fn advance(&mut self, n: usize) {
        self.len += n;
        if let Some(e) = &mut self.exact {
            e.advance(self.len);
        }
    }

    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        if let Some(e) = &mut self.exact {
            e.truncate(self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_kernels::kv::{KvFormat, KvGeometry};

    fn layout(dtype: KvDtype) -> Arc<KvLayout> {
        KvLayout::new(2, KvGeometry { head_dim: 32, n_kv_heads: 2 }, 4, dtype, None, 1).unwrap()
    }

    #[test]
    fn capacity_is_enforced_and_writes_land_at_their_positions() {
        let mut kv = LocalKv::new(layout(KvDtype::default()), 10);
        assert_eq!(kv.reserve(13), Err(KvError::Capacity { needed: 13, capacity: 12 }));
        kv.reserve(6).unwrap();
        let k: Vec<f32> = (0..6 * 64).map(|i| i as f32).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        for layer in 0..2 {
            kv.write(layer, 0, &k, &v);
        }
        kv.advance(6);
        let view = kv.view(1, 6);
        assert_eq!(view.tiles.len(), 2);
        assert_eq!((view.tiles[1].start, view.tiles[1].len, view.tiles[1].slots), (4, 2, 4));
        // Head 1 of token 5 lives in the second block's head-1 page, slot 1.
        let mut out = vec![0f32; 32];
        let page_bytes = view.k.page_bytes(4);
        let page = tessera_kernels::kv::KvPage { bytes: &view.tiles[1].keys[page_bytes..2 * page_bytes], tokens: 4 };
        view.k.decode(1, page, 1..2, &mut out);
        assert_eq!(out, k[5 * 64 + 32..6 * 64].to_vec());
        kv.truncate(2);
        assert_eq!(kv.len(), 2);
    }

    #[test]
    fn a_qjl_sink_must_fit_the_first_block() {
        let geom = KvGeometry { head_dim: 32, n_kv_heads: 2 };
        let dtype = |sink| KvDtype { k: format!("qjl1-w8-s{sink}").parse().unwrap(), v: KvFormat::BF16 };
        assert!(KvLayout::new(2, geom, 4, dtype(4), None, 1).is_ok());
        let e = KvLayout::new(2, geom, 4, dtype(5), None, 1).unwrap_err();
        assert!(e.to_string().contains("qjl1-w8-s5's sink must fit the first KV-cache block (4 tokens)"), "{e}");
    }

    #[test]
    fn block_bytes_follow_the_formats() {
        let f32_layout = layout(KvDtype::default());
        let bf16 = layout(KvDtype::both(KvFormat::BF16));
        // 2 layers x (K + V) x 2 heads x 4 tokens x 32 values.
        assert_eq!(f32_layout.block_bytes(), 2 * 2 * 2 * 4 * 32 * 4);
        assert_eq!(bf16.block_bytes(), 2 * 2 * 2 * 4 * 32 * 2);
        assert!((bf16.compression_vs_bf16() - 1.0).abs() < 1e-9);
        // The log line says which way the size differs (f32 once read "0.50x smaller").
        assert!(f32_layout.describe().contains("2.00x larger than bf16"), "{}", f32_layout.describe());
        assert!(bf16.describe().contains("1.00x smaller than bf16"), "{}", bf16.describe());
        let mixed = layout(KvDtype { k: KvFormat::INT8, v: KvFormat::BF16 });
        assert!(mixed.block_bytes() < bf16.block_bytes() && mixed.block_bytes().is_multiple_of(64));
    }
}
