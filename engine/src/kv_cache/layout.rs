//! How a model's KV cache is stored: the K and V formats, one codec per (layer, role), and
//! the byte layout of a block.

use crate::checkpoint::ModelConfig;
use std::fmt;
use std::sync::Arc;
use tessera_kernels::kv::{codec, CodecOptions, HeadOffset, KeyCalibration, KvCodec, KvFormat, KvFormatError, KvGeometry, KvRole};

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

/// The checkpoint's quantized KV cache (`quantization_config.kv_cache_scheme`): the format and
/// each layer's static per-tensor `(k_scale, v_scale)` (value = code × scale, as vLLM reads them).
#[derive(Clone, Debug, PartialEq)]
pub struct KvCacheScheme {
    /// fp8_e4m3 or int8.
    pub format: KvFormat,
    /// Per layer `(k_scale, v_scale)`.
    pub scales: Vec<(f32, f32)>,
}

/// The formats asked for, per side; `None` is `auto`: the checkpoint's `kv_cache_scheme` when it
/// has one, else f32 (the compute type).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvRequest {
    /// Key format, or auto.
    pub k: Option<KvFormat>,
    /// Value format, or auto.
    pub v: Option<KvFormat>,
}

impl KvRequest {
    /// The formats to use with the checkpoint's `scheme`.
    pub fn resolve(self, scheme: Option<&KvCacheScheme>) -> KvDtype {
        let auto = scheme.map_or(KvFormat::F32, |s| s.format);
        KvDtype { k: self.k.unwrap_or(auto), v: self.v.unwrap_or(auto) }
    }
}

impl From<KvDtype> for KvRequest {
    fn from(d: KvDtype) -> Self {
        KvRequest { k: Some(d.k), v: Some(d.v) }
    }
}

impl fmt::Display for KvRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = |x: Option<KvFormat>| x.map_or("auto".to_string(), |x| x.to_string());
        if self.k == self.v { write!(f, "{}", side(self.k)) } else { write!(f, "k={},v={}", side(self.k), side(self.v)) }
    }
}

/// Why a model's KV-cache layout could not be built.
#[derive(Debug, thiserror::Error)]
pub enum KvLayoutError {
    /// A format the model's geometry or the role refuses.
    #[error(transparent)]
    Format(#[from] KvFormatError),
    /// The key-calibration pass (centering, balancing) failed.
    #[error("key calibration: {0}")]
    Calibration(String),
}

/// How keys are stored relative to the model's post-RoPE keys: per layer,
/// `(k - center) / scale`, channel by channel (`n_kv_heads * head_dim` values each).
#[derive(Clone, Debug, PartialEq)]
pub struct KeyTransform {
    /// Per layer, subtracted from every key.
    pub centers: Vec<Vec<f32>>,
    /// Per layer, positive factors the centered keys are divided by and the queries multiplied
    /// by; `None`: all 1.
    pub scales: Option<Vec<Vec<f32>>>,
}

/// Alignment of each (layer, role) region inside a block: keeps f32 pages readable in place.
const REGION_ALIGN: usize = 8;

/// The storage of a model's KV cache: formats, per-layer codecs and block geometry.
pub struct KvLayout {
    dtype: KvDtype,
    geom: KvGeometry,
    block_size: usize,
    /// Per layer: (key codec, value codec).
    codecs: Vec<(Arc<dyn KvCodec>, Arc<dyn KvCodec>)>,
    /// Per layer: byte offsets of the key and value regions inside a block.
    offsets: Vec<(usize, usize)>,
    /// Per layer: the static (key, value) scales of 8-bit sides that use the checkpoint's.
    static_scales: Vec<(Option<f32>, Option<f32>)>,
    /// How keys are stored, when not as they are (see [`KvLayout::set_key_transform`]).
    key_transform: Option<KeyTransform>,
    block_bytes: usize,
}

impl fmt::Debug for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvLayout").field("dtype", &self.dtype).field("geom", &self.geom).field("block_size", &self.block_size).finish()
    }
}

impl KvLayout {
    /// A layout for `layers` layers of heads `geom`, blocks of `block_size` tokens. A side whose
    /// format is the checkpoint `scheme`'s uses its static per-layer scale; `seed` fixes the
    /// random state of QJL and HQMQ.
    pub fn new(layers: usize, geom: KvGeometry, block_size: usize, dtype: KvDtype, scheme: Option<&KvCacheScheme>, seed: u64) -> Result<Arc<Self>, KvFormatError> {
        assert!(block_size > 0 && layers > 0);
        if let Some(p) = dtype.k.exact_keys() {
            if usize::from(p.sink) > block_size {
                return Err(KvFormatError::SinkTooLong { format: dtype.k, block_size });
            }
        }
        assert!(scheme.is_none_or(|s| s.scales.len() == layers), "one (k_scale, v_scale) per layer");
        let mut codecs = Vec::with_capacity(layers);
        let mut static_scales = Vec::with_capacity(layers);
        for layer in 0..layers {
            let scale = |f: KvFormat, pick: fn((f32, f32)) -> f32| scheme.filter(|s| s.format == f).map(|s| pick(s.scales[layer]));
            let (ks, vs) = (scale(dtype.k, |s| s.0), scale(dtype.v, |s| s.1));
            let k = codec(&dtype.k, geom, KvRole::Key, CodecOptions { layer, seed, static_scale: ks })?;
            let v = codec(&dtype.v, geom, KvRole::Value, CodecOptions { layer, seed, static_scale: vs })?;
            codecs.push((Arc::from(k), Arc::from(v)));
            static_scales.push((ks, vs));
        }
        Ok(Arc::new(Self::with_codecs(dtype, geom, block_size, codecs, static_scales, None)))
    }

    /// A layout over `codecs` (per layer, key and value) for `geom`, its regions laid out in
    /// layer order.
    fn with_codecs(
        dtype: KvDtype,
        geom: KvGeometry,
        block_size: usize,
        codecs: Vec<(Arc<dyn KvCodec>, Arc<dyn KvCodec>)>,
        static_scales: Vec<(Option<f32>, Option<f32>)>,
        key_transform: Option<KeyTransform>,
    ) -> Self {
        let mut offsets = Vec::with_capacity(codecs.len());
        let mut at = 0;
        for (k, v) in &codecs {
            let ko = at;
            at = (at + geom.n_kv_heads * k.page_bytes(block_size)).next_multiple_of(REGION_ALIGN);
            let vo = at;
            at = (at + geom.n_kv_heads * v.page_bytes(block_size)).next_multiple_of(REGION_ALIGN);
            offsets.push((ko, vo));
        }
        KvLayout { dtype, geom, block_size, codecs, offsets, static_scales, key_transform, block_bytes: at.next_multiple_of(64) }
    }

    /// The layout of KV heads `heads` alone (a tensor-parallel rank's cache): the same formats,
    /// each head coded as it is in this layout (its random state and key transform), in blocks
    /// holding only those heads.
    pub fn heads(&self, heads: std::ops::Range<usize>) -> Arc<KvLayout> {
        assert!(!heads.is_empty() && heads.end <= self.geom.n_kv_heads, "heads {heads:?} of {}", self.geom.n_kv_heads);
        let geom = KvGeometry { head_dim: self.geom.head_dim, n_kv_heads: heads.len() };
        let part = |c: &Arc<dyn KvCodec>| Arc::new(HeadOffset::new(c.clone(), heads.start)) as Arc<dyn KvCodec>;
        let codecs = self.codecs.iter().map(|(k, v)| (part(k), part(v))).collect();
        let channels = heads.start * geom.head_dim..heads.end * geom.head_dim;
        let slice = |v: &Vec<Vec<f32>>| v.iter().map(|l| l[channels.clone()].to_vec()).collect();
        let transform = self.key_transform.as_ref().map(|t| KeyTransform { centers: slice(&t.centers), scales: t.scales.as_ref().map(slice) });
        Arc::new(Self::with_codecs(self.dtype, geom, self.block_size, codecs, self.static_scales.clone(), transform))
    }

    /// The layout of a model of `config` for the formats `req` asks for (auto sides take the
    /// checkpoint's `scheme`, whose scales serve the sides in its format).
    pub fn for_model(config: &ModelConfig, scheme: Option<&KvCacheScheme>, req: KvRequest, block_size: usize, seed: u64) -> Result<Arc<Self>, KvFormatError> {
        let geom = KvGeometry { head_dim: config.head_dim, n_kv_heads: config.num_kv_heads };
        Self::new(config.num_layers, geom, block_size, req.resolve(scheme), scheme, seed)
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

    /// Layer `layer`'s static (key, value) scales: `Some` for an 8-bit side that uses the
    /// checkpoint's per-tensor scale (its pages store no scale per token).
    pub fn static_scales(&self, layer: usize) -> (Option<f32>, Option<f32>) {
        self.static_scales[layer]
    }

    /// Whether keys are stored in a format that loses enough of them that centering helps
    /// (the key codec's [`KeyCalibration`]; qjl1, tq3_0, hqmq): their error grows with the
    /// key's norm, and SmolLM2's post-RoPE keys carry a per-channel mean worth 45-70% of their
    /// energy.
    pub fn wants_key_centers(&self) -> bool {
        self.key_calibration() != KeyCalibration::None
    }

    /// Whether the key format spreads a key's coding error over all of a head's channels
    /// (qjl1 through its projection, tq3_0 through its WHT), so that balancing the channels
    /// against the queries ([`KeyTransform::scales`]) lowers the error of the scores (HQMQ's
    /// does not: see its codec).
    pub fn wants_key_balance(&self) -> bool {
        self.key_calibration() == KeyCalibration::CenterAndBalance
    }

    /// What the key format asks of key calibration (every layer's keys share one format).
    fn key_calibration(&self) -> KeyCalibration {
        self.codecs.first().map_or(KeyCalibration::None, |(k, _)| k.key_calibration())
    }

    /// Stores every key of layer `l` as `(k - centers[l]) / scales[l]`, channel by channel.
    /// Attention is unchanged in exact arithmetic: a query's scores all move by the same
    /// `q · center`, which softmax cancels (no score soft-capping in the supported models),
    /// attention multiplies the queries by the scales ([`KvView::query_scale`]), and values are
    /// untouched. What changes is what the codec sees: a smaller key whose error lands where
    /// the queries are small, so a smaller error in the scores.
    ///
    /// [`KvView::query_scale`]: tessera_kernels::attention::KvView::query_scale
    pub fn set_key_transform(&mut self, t: KeyTransform) -> Result<(), String> {
        let kw = self.geom.n_kv_heads * self.geom.head_dim;
        let valid = |v: &Vec<Vec<f32>>, positive: bool| {
            v.len() == self.layers() && v.iter().all(|c| c.len() == kw && c.iter().all(|x| x.is_finite() && (!positive || *x > 0.0)))
        };
        if !valid(&t.centers, false) || !t.scales.as_ref().is_none_or(|s| valid(s, true)) {
            return Err(format!("key centers and scales must be {} vectors of {kw} finite values (scales positive)", self.layers()));
        }
        self.key_transform = Some(t);
        Ok(())
    }

    /// Applies layer `layer`'s key transform to `rows` (keys of `n_kv_heads * head_dim`):
    /// `(k - center) / scale`, channel by channel; nothing when keys are stored as they are.
    pub fn transform_keys(&self, layer: usize, rows: &mut [f32]) {
        let Some(center) = self.key_center(layer) else { return };
        let kw = center.len();
        rows.chunks_exact_mut(kw).for_each(|r| r.iter_mut().zip(center).for_each(|(x, m)| *x -= m));
        if let Some(scale) = self.key_scale(layer) {
            rows.chunks_exact_mut(kw).for_each(|r| r.iter_mut().zip(scale).for_each(|(x, f)| *x /= f));
        }
    }

    /// Layer `layer`'s key center, when keys are centered.
    pub fn key_center(&self, layer: usize) -> Option<&[f32]> {
        self.key_transform.as_ref().map(|t| t.centers[layer].as_slice())
    }

    /// Layer `layer`'s key scales, when keys are balanced.
    pub fn key_scale(&self, layer: usize) -> Option<&[f32]> {
        self.key_transform.as_ref().and_then(|t| t.scales.as_ref()).map(|s| s[layer].as_slice())
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
        let centered = match &self.key_transform {
            Some(KeyTransform { scales: Some(_), .. }) => ", keys centered and balanced",
            Some(_) => ", keys centered",
            None => "",
        };
        let exact = match self.dtype.k.exact_keys() {
            Some(p) if p.window > 0 || p.sink > 0 => {
                let rows = super::exact_keys::max_rows(p.window.into(), p.sink.into());
                let bytes = rows * self.layers() * self.geom.n_kv_heads * self.geom.head_dim * 4;
                format!("; exact f32 keys of the first {} and last {} positions: up to {:.2} MiB per sequence", p.sink, p.window, bytes as f64 / (1 << 20) as f64)
            }
            _ => String::new(),
        };
        let c = self.compression_vs_bf16();
        let size = if c >= 1.0 { format!("{c:.2}x smaller than bf16") } else { format!("{:.2}x larger than bf16", 1.0 / c) };
        format!("{} ({:.1} bytes/token, {size}{centered}{exact})", self.dtype, self.bytes_per_token())
    }

    /// How many times smaller than a bf16 cache of the same model this one is.
    pub fn compression_vs_bf16(&self) -> f64 {
        let bf16 = (self.layers() * 2 * self.geom.n_kv_heads * self.geom.head_dim * 2) as f64;
        bf16 / self.bytes_per_token()
    }
}
