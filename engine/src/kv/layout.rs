//! How a model's KV cache is stored: the K and V formats, one codec per (layer, role), and
//! the byte layout of a block.

use std::fmt;
use std::sync::Arc;
use tessera_kernels::kv::{codec, CodecOptions, KvCodec, KvFormat, KvFormatError, KvGeometry, KvRole};

/// Tokens per block unless configured otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The K and V storage formats (`--kv-cache-dtype-k` / `--kv-cache-dtype-v`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvDtype {
    /// Key format.
    pub k: KvFormat,
    /// Value format.
    pub v: KvFormat,
}

impl Default for KvDtype {
    fn default() -> Self {
        KvDtype { k: KvFormat::F32, v: KvFormat::F32 }
    }
}

impl KvDtype {
    /// Both sides in one format.
    pub fn both(f: KvFormat) -> Self {
        KvDtype { k: f, v: f }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.k == self.v { write!(f, "{}", self.k) } else { write!(f, "k={},v={}", self.k, self.v) }
    }
}

/// Alignment of each (layer, role) region inside a block: keeps f32 pages readable in place.
const REGION_ALIGN: usize = 8;

/// The storage of a model's KV cache: formats, per-layer codecs and block geometry.
pub struct KvLayout {
    dtype: KvDtype,
    geom: KvGeometry,
    block_size: usize,
    /// Per layer: (key codec, value codec).
    codecs: Vec<(Box<dyn KvCodec>, Box<dyn KvCodec>)>,
    /// Per layer: byte offsets of the key and value regions inside a block.
    offsets: Vec<(usize, usize)>,
    block_bytes: usize,
}

impl fmt::Debug for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvLayout").field("dtype", &self.dtype).field("geom", &self.geom).field("block_size", &self.block_size).finish()
    }
}

impl KvLayout {
    /// A layout for `layers` layers of heads `geom`, blocks of `block_size` tokens. `scales`
    /// are the checkpoint's per-layer static (k_scale, v_scale), used by the 8-bit formats;
    /// `seed` fixes the random state of QJL and HQMQ.
    pub fn new(layers: usize, geom: KvGeometry, block_size: usize, dtype: KvDtype, scales: Option<&[(f32, f32)]>, seed: u64) -> Result<Arc<Self>, KvFormatError> {
        assert!(block_size > 0 && layers > 0);
        let mut codecs = Vec::with_capacity(layers);
        let mut offsets = Vec::with_capacity(layers);
        let mut at = 0;
        for layer in 0..layers {
            let (ks, vs) = scales.map(|s| s[layer]).map_or((None, None), |(k, v)| (Some(k), Some(v)));
            let k = codec(&dtype.k, geom, KvRole::Key, CodecOptions { layer, seed, static_scale: ks })?;
            let v = codec(&dtype.v, geom, KvRole::Value, CodecOptions { layer, seed, static_scale: vs })?;
            let ko = at;
            at = (at + geom.n_kv_heads * k.page_bytes(block_size)).next_multiple_of(REGION_ALIGN);
            let vo = at;
            at = (at + geom.n_kv_heads * v.page_bytes(block_size)).next_multiple_of(REGION_ALIGN);
            codecs.push((k, v));
            offsets.push((ko, vo));
        }
        Ok(Arc::new(KvLayout { dtype, geom, block_size, codecs, offsets, block_bytes: at.next_multiple_of(64) }))
    }

    /// The formats.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Head geometry.
    pub fn geometry(&self) -> KvGeometry {
        self.geom
    }

    /// Layers.
    pub fn layers(&self) -> usize {
        self.codecs.len()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes of one block (all layers, keys and values; 64-byte aligned).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// KV-cache bytes per token, all layers, keys and values (block bytes / block size).
    pub fn bytes_per_token(&self) -> f64 {
        self.block_bytes as f64 / self.block_size as f64
    }

    /// Layer `layer`'s (key, value) codecs.
    pub fn codecs(&self, layer: usize) -> (&dyn KvCodec, &dyn KvCodec) {
        let (k, v) = &self.codecs[layer];
        (k.as_ref(), v.as_ref())
    }

    /// Byte ranges of layer `layer`'s key and value regions inside a block.
    pub fn regions(&self, layer: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (k, v) = &self.codecs[layer];
        let (ko, vo) = self.offsets[layer];
        let n = self.geom.n_kv_heads;
        (ko..ko + n * k.page_bytes(self.block_size), vo..vo + n * v.page_bytes(self.block_size))
    }

    /// One line for logs and `inspect`: formats and bytes per token.
    pub fn describe(&self) -> String {
        format!("{} ({:.1} bytes/token, {:.2}x smaller than bf16)", self.dtype, self.bytes_per_token(), self.compression_vs_bf16())
    }

    /// How many times smaller than a bf16 cache of the same model this one is.
    pub fn compression_vs_bf16(&self) -> f64 {
        let bf16 = (self.layers() * 2 * self.geom.n_kv_heads * self.geom.head_dim * 2) as f64;
        bf16 / self.bytes_per_token()
    }
}
