//! Paged KV cache on the GPU: writing new tokens' K/V into the byte pool ([`kv_append`]) and
//! decode attention reading it in place ([`paged_decode_attention`]).
//!
//! The pool is the engine's block pool as one device buffer of bytes, laid out exactly as on the
//! CPU (`engine/src/kv_cache/layout.rs`): block `b` starts at byte `b * block_bytes`; inside a block each
//! layer has a K region and a V region, each `n_kv_heads` pages (one per KV head) of
//! `block_size` token records in the CPU codec's byte layout (`kv::plain`, `kv::scaled8`). A
//! [`KvLayerDesc`] describes one layer's regions; the engine builds one per layer from its
//! `KvLayout` and calls the launchers per layer with the same pool.
//!
//! Formats on CUDA: those whose family has a CUDA side in the registry (`kv::cuda_page`; today
//! f32, bf16, f16, fp8_e4m3 and int8, with per-token-and-head scales or a static per-layer
//! scale), for head dims 64 and 128. K and V may differ. Others (qjl1, tq3_0, hqmq) are refused
//! with [`CudaError::Unsupported`].
//!
//! Decode attention is flash-decoding: one CTA per (sequence, KV head, chunk of up to 8 query
//! heads of the group, token split), fp32 online softmax, splits merged by a second kernel. The
//! number of splits comes from [`plan_splits`] (enough CTAs to fill the GPU) unless the
//! workspace forces one ([`AttnWorkspace::force_splits`]). Positions at or past a sequence's
//! length are never read, so unused slots and pages may hold any bytes.

use super::device::CudaDevice;
use super::kv_source;
use super::CudaError;
use crate::kv::{self, KvCudaPage, KvFormat};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};

/// Query heads one CTA serves (`TS_GMAX` in `attention.cu`); larger groups take several CTAs.
pub const HEADS_PER_CTA: usize = 8;
/// Threads per attention CTA (`TS_THREADS` in `attention.cu`).
const ATTN_THREADS: u32 = 128;
/// Fewest tokens [`plan_splits`] gives a split (below this a split's fixed cost dominates).
pub const MIN_SPLIT_TOKENS: usize = 256;
/// Split lengths are rounded to this many tokens (the largest token step of an attention CTA).
const SPLIT_ALIGN: usize = 16;
/// Largest grid y and z dimension.
const GRID_YZ_MAX: usize = 65535;

/// One side (K or V) of a layer: its format and where its pages are.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvSide {
    /// Storage format.
    pub format: KvFormat,
    /// Byte offset of this side's region inside a block.
    pub offset: usize,
    /// Bytes of one KV head's page (the codec's `page_bytes(block_size)`).
    pub page_bytes: usize,
    /// The checkpoint's static scale for the 8-bit formats (`k_scale` / `v_scale`); `None`
    /// stores a scale per token and head. Ignored by the plain formats, as on the CPU.
    pub static_scale: Option<f32>,
}

/// The kernels' view of one layer's pages: `struct TsKvLayer` in `kv_pages.cuh` (same fields,
/// same order, 56 bytes on both sides).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvLayerRaw {
    /// Bytes of one block (all layers).
    pub block_bytes: i64,
    /// The layer's K region inside a block.
    pub k_offset: i64,
    /// The layer's V region inside a block.
    pub v_offset: i64,
    /// One KV head's K page.
    pub k_page_bytes: i64,
    /// One KV head's V page.
    pub v_page_bytes: i64,
    /// Tokens per block.
    pub block_size: i32,
    /// KV heads.
    pub n_kv_heads: i32,
    /// Static K scale (static 8-bit formats; 1 otherwise).
    pub k_scale: f32,
    /// Static V scale (static 8-bit formats; 1 otherwise).
    pub v_scale: f32,
}

// SAFETY: plain-old-data, `repr(C)`, laid out as `TsKvLayer` (asserted below and in the kernel).
unsafe impl DeviceRepr for KvLayerRaw {}

const _: () = assert!(std::mem::size_of::<KvLayerRaw>() == 56 && std::mem::align_of::<KvLayerRaw>() == 8);

/// One layer of the paged KV cache as the CUDA kernels read and write it, validated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvLayerDesc {
    raw: KvLayerRaw,
    head_dim: usize,
    k_format: KvFormat,
    v_format: KvFormat,
    k_code: u8,
    v_code: u8,
}

/// The kernels' view of a side's pages (its `TS_KV_*` code and layout), from the format's
/// folder through the registry (`kv::cuda_page`); an error for formats not on CUDA yet.
fn cuda_page(format: KvFormat, static_scale: Option<f32>) -> Result<KvCudaPage, CudaError> {
    kv::cuda_page(&format, static_scale.is_some()).ok_or_else(|| {
        let supported: Vec<String> = KvFormat::all().into_iter().filter(|f| kv::cuda_page(f, false).is_some()).map(|f| f.to_string()).collect();
        CudaError::Unsupported(format!(
            "KV-cache format {format} is not yet on CUDA (supported: {}); use --device cpu or another --kv-cache-dtype",
            supported.join(", ")
        ))
    })
}

impl KvLayerDesc {
    /// Describes one layer: blocks of `block_bytes` bytes holding `block_size` tokens,
    /// `n_kv_heads` heads of `head_dim`, and the K and V sides. Checks that the head dim and
    /// formats are supported on CUDA, that each page is the size the CPU codec gives it, that
    /// both regions fit inside a block, and the alignment the kernels load with (8 bytes for
    /// f32/bf16/f16 regions, 4 for 8-bit ones).
    pub fn new(block_bytes: usize, block_size: usize, n_kv_heads: usize, head_dim: usize, k: KvSide, v: KvSide) -> Result<Self, CudaError> {
        if head_dim != 64 && head_dim != 128 {
            return Err(CudaError::Unsupported(format!("CUDA attention supports head dims 64 and 128, not {head_dim}")));
        }
        if block_size == 0 || n_kv_heads == 0 {
            return Err(CudaError::Shape(format!("KV layer: block size {block_size}, {n_kv_heads} KV heads")));
        }
        let mut codes = [0u8; 2];
        let mut scales = [1f32; 2];
        for (i, (name, side)) in [("K", k), ("V", v)].into_iter().enumerate() {
            let page = cuda_page(side.format, side.static_scale)?;
            let scale = if page.kind.static_scale { side.static_scale } else { None };
            if let Some(s) = scale {
                if !(s.is_finite() && s > 0.0) {
                    return Err(CudaError::Shape(format!("KV layer {name}: static scale {s} is not a positive finite number")));
                }
                scales[i] = s;
            }
            let want = block_size * page.kind.record_bytes(head_dim);
            if side.page_bytes != want {
                return Err(CudaError::Shape(format!(
                    "KV layer {name}: {} pages of {block_size} tokens x {head_dim} take {want} bytes, not {}",
                    side.format, side.page_bytes
                )));
            }
            let end = side.offset + n_kv_heads * side.page_bytes;
            if end > block_bytes {
                return Err(CudaError::Shape(format!("KV layer {name}: region {}..{end} overruns the {block_bytes}-byte block", side.offset)));
            }
            let align = page.kind.align;
            if !side.offset.is_multiple_of(align) || !block_bytes.is_multiple_of(align) {
                return Err(CudaError::Shape(format!(
                    "KV layer {name}: {} regions need {align}-byte alignment (offset {}, block bytes {block_bytes})",
                    side.format, side.offset
                )));
            }
            codes[i] = page.code;
        }
        let i64_of = |x: usize| i64::try_from(x).map_err(|_| CudaError::Shape(format!("KV layer: {x} bytes exceed i64")));
        let raw = KvLayerRaw {
            block_bytes: i64_of(block_bytes)?,
            k_offset: i64_of(k.offset)?,
            v_offset: i64_of(v.offset)?,
            k_page_bytes: i64_of(k.page_bytes)?,
            v_page_bytes: i64_of(v.page_bytes)?,
            block_size: int(block_size)?,
            n_kv_heads: int(n_kv_heads)?,
            k_scale: scales[0],
            v_scale: scales[1],
        };
        Ok(KvLayerDesc { raw, head_dim, k_format: k.format, v_format: v.format, k_code: codes[0], v_code: codes[1] })
    }

    /// The struct the kernels receive.
    pub fn raw(&self) -> KvLayerRaw {
        self.raw
    }

    /// Floats per head vector.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// KV heads.
    pub fn n_kv_heads(&self) -> usize {
        self.raw.n_kv_heads as usize
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.raw.block_size as usize
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> usize {
        self.raw.block_bytes as usize
    }

    /// (K format, V format).
    pub fn formats(&self) -> (KvFormat, KvFormat) {
        (self.k_format, self.v_format)
    }

    /// The `-D` set of the attention specialization for this layer.
    fn attention_defines(&self) -> [&'static str; 3] {
        kv_source::attention_defines(self.head_dim, self.k_code, self.v_code)
    }

    /// Whole blocks in a pool of `pool_bytes` bytes (block ids at or past it are never touched).
    fn pool_blocks(&self, pool_bytes: usize) -> i64 {
        (pool_bytes / self.block_bytes()) as i64
    }
}

fn int(v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape(format!("{v} does not fit a 32-bit kernel argument")))
}

fn check(what: &str, len: usize, want: usize) -> Result<(), CudaError> {
    if len == want {
        Ok(())
    } else {
        Err(CudaError::Shape(format!("{what}: {len} elements, expected {want}")))
    }
}

/// Writes the K and V rows of `slots.len()` new tokens into `pool`, encoded in the layer's
/// formats byte for byte as the CPU codecs encode them. `k` and `v` are
/// `[tokens, n_kv_heads, head_dim]` f32; token `i` goes to slot `slots[i]` =
/// `block * block_size + offset`; slots must be distinct within one call (two writes to one slot
/// race). Negative slots (padding) are skipped, as are slots whose block lies past the end of
/// `pool`.
pub fn kv_append(
    dev: &CudaDevice,
    desc: &KvLayerDesc,
    pool: &mut CudaSlice<u8>,
    k: &CudaView<f32>,
    v: &CudaView<f32>,
    slots: &CudaView<i32>,
) -> Result<(), CudaError> {
    let tokens = slots.len();
    let row = desc.n_kv_heads() * desc.head_dim;
    check("kv_append k", k.len(), tokens * row)?;
    check("kv_append v", v.len(), tokens * row)?;
    if tokens == 0 {
        return Ok(());
    }
    let f = dev.function(&kv_source::builtin().kv_append, &[], "kv_append")?;
    let cfg = LaunchConfig { grid_dim: (u32::try_from(tokens).map_err(|_| CudaError::Shape(format!("{tokens} tokens exceed the grid")))?, desc.raw.n_kv_heads as u32, 1), block_dim: (64, 1, 1), shared_mem_bytes: 0 };
    let raw = desc.raw;
    let (head_dim, k_fmt, v_fmt) = (int(desc.head_dim)?, desc.k_code as i32, desc.v_code as i32);
    let pool_blocks = desc.pool_blocks(pool.len());
    let mut b = dev.stream().launch_builder(&f);
    b.arg(k).arg(v).arg(slots).arg(pool).arg(&raw).arg(&head_dim).arg(&k_fmt).arg(&v_fmt).arg(&pool_blocks);
    // SAFETY: argument types and order match `kv_append` (TsKvLayer = KvLayerRaw by value);
    // lengths checked above; the kernel bounds block ids by `pool_blocks`.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// How a decode batch's context is cut into token ranges: `splits` ranges of
/// `tokens_per_split` tokens (the last runs to each sequence's end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    /// Token ranges (grid z).
    pub splits: usize,
    /// Tokens per range.
    pub tokens_per_split: usize,
}

impl SplitPlan {
    /// Exactly `splits` ranges covering `max_seq_len` tokens (ranges past a sequence's end do
    /// nothing and are merged away).
    pub fn fixed(splits: usize, max_seq_len: usize) -> Self {
        let splits = splits.max(1);
        SplitPlan { splits, tokens_per_split: max_seq_len.max(1).div_ceil(splits) }
    }
}

/// Splits for a batch whose unsplit grid has `ctas` CTAs, sequences of at most `max_seq_len`
/// tokens, on a GPU with `sm_count` SMs: enough splits for about two CTAs per SM, no split
/// under [`MIN_SPLIT_TOKENS`] tokens, at most `max_splits`; split lengths a multiple of 16.
pub fn plan_splits(ctas: usize, max_seq_len: usize, sm_count: usize, max_splits: usize) -> SplitPlan {
    let len = max_seq_len.max(1);
    let want = (2 * sm_count).div_ceil(ctas.max(1));
    let by_len = len / MIN_SPLIT_TOKENS;
    let splits = want.min(by_len).min(max_splits).max(1);
    let tokens_per_split = len.div_ceil(splits).next_multiple_of(SPLIT_ALIGN);
    SplitPlan { splits: len.div_ceil(tokens_per_split), tokens_per_split }
}

/// Preallocated scratch for the split partials of [`paged_decode_attention`]: per (sequence,
/// query head, split) a `head_dim` accumulator and its (max, sum). Sized for up to `max_seqs`
/// sequences of `n_heads` query heads and `max_splits` splits; allocate once per model.
pub struct AttnWorkspace {
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    rows: usize,
    head_dim: usize,
    max_splits: usize,
    sm_count: usize,
    forced: Option<usize>,
}

impl AttnWorkspace {
    /// Allocates `max_seqs * n_heads * max_splits * (head_dim + 2)` floats on `dev`.
    pub fn new(dev: &CudaDevice, max_seqs: usize, n_heads: usize, head_dim: usize, max_splits: usize) -> Result<Self, CudaError> {
        let max_splits = max_splits.max(1);
        let rows = max_seqs * n_heads;
        let sm_count = dev.context().attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(AttnWorkspace {
            part_o: dev.stream().alloc_zeros((rows * max_splits * head_dim).max(1))?,
            part_ml: dev.stream().alloc_zeros((rows * max_splits * 2).max(1))?,
            rows,
            head_dim,
            max_splits,
            sm_count: sm_count.max(1) as usize,
            forced: None,
        })
    }

    /// Uses exactly `splits` token ranges instead of [`plan_splits`] (`None` restores the plan);
    /// for tests and tuning. Must not exceed the workspace's `max_splits`.
    pub fn force_splits(&mut self, splits: Option<usize>) {
        self.forced = splits;
    }

    /// The plan a batch with `ctas` unsplit CTAs and sequences up to `max_seq_len` would use.
    pub fn plan(&self, ctas: usize, max_seq_len: usize) -> SplitPlan {
        match self.forced {
            Some(n) => SplitPlan::fixed(n, max_seq_len),
            None => plan_splits(ctas, max_seq_len, self.sm_count, self.max_splits),
        }
    }
}

/// The sequences of one decode step and where their tokens live.
pub struct PagedBatch<'a> {
    /// The KV byte pool (every layer; [`KvLayerDesc`] picks this layer's regions).
    pub pool: &'a CudaSlice<u8>,
    /// `[seqs, max_blocks]` block ids: the block holding each sequence's tokens
    /// `j * block_size .. (j + 1) * block_size`. Entries past a sequence's length are not read.
    pub block_tables: CudaView<'a, i32>,
    /// Columns of `block_tables`.
    pub max_blocks: usize,
    /// `[seqs]` tokens in the cache per sequence, the new token's K/V included (its query is at
    /// position `seq_len - 1` and sees every cached token).
    pub seq_lens: CudaView<'a, i32>,
    /// An upper bound of `seq_lens` known on the host (sizes the split plan; a sequence longer
    /// than it is still attended in full, only with less parallelism). At most
    /// `max_blocks * block_size`.
    pub max_seq_len: usize,
}

/// Decode attention for one layer: for each sequence `s` and query head `h`,
/// `out[s, h] = softmax(q[s, h] · K_sᵀ / sqrt(head_dim)) · V_s` over the sequence's
/// `seq_lens[s]` cached tokens of KV head `h / (n_heads / n_kv_heads)`, read from the pool in the
/// layer's formats. `q` and `out` are `[seqs, n_heads, head_dim]` f32. A sequence of length 0
/// gets zeros. Asynchronous on the device's stream.
pub fn paged_decode_attention(
    dev: &CudaDevice,
    desc: &KvLayerDesc,
    batch: &PagedBatch<'_>,
    q: &CudaView<f32>,
    n_heads: usize,
    out: &mut CudaViewMut<f32>,
    ws: &mut AttnWorkspace,
) -> Result<(), CudaError> {
    let (hd, n_kv) = (desc.head_dim, desc.n_kv_heads());
    let seqs = batch.seq_lens.len();
    if n_heads == 0 || !n_heads.is_multiple_of(n_kv) {
        return Err(CudaError::Shape(format!("attention: {n_heads} query heads are not groups of {n_kv} KV heads")));
    }
    check("attention q", q.len(), seqs * n_heads * hd)?;
    check("attention out", out.len(), seqs * n_heads * hd)?;
    check("attention block tables", batch.block_tables.len(), seqs * batch.max_blocks)?;
    if batch.max_seq_len > batch.max_blocks * desc.block_size() {
        return Err(CudaError::Shape(format!(
            "attention: max_seq_len {} exceeds {} blocks of {} tokens",
            batch.max_seq_len,
            batch.max_blocks,
            desc.block_size()
        )));
    }
    if ws.head_dim != hd || seqs * n_heads > ws.rows {
        return Err(CudaError::Shape(format!(
            "attention workspace holds {} rows of head dim {}, batch needs {} of {hd}",
            ws.rows,
            ws.head_dim,
            seqs * n_heads
        )));
    }
    if seqs == 0 {
        return Ok(());
    }
    let chunks = (n_heads / n_kv).div_ceil(HEADS_PER_CTA);
    let plan = ws.plan(seqs * n_kv * chunks, batch.max_seq_len);
    if plan.splits > ws.max_splits || plan.splits > GRID_YZ_MAX || n_kv * chunks > GRID_YZ_MAX {
        return Err(CudaError::Shape(format!("attention: {} splits x {} head CTAs exceed the workspace or grid", plan.splits, n_kv * chunks)));
    }
    let defines = desc.attention_defines();
    let f = dev.function(&kv_source::builtin().attention, &defines, "paged_decode_attention")?;
    let cfg = LaunchConfig {
        grid_dim: (u32::try_from(seqs).map_err(|_| CudaError::Shape(format!("{seqs} sequences exceed the grid")))?, (n_kv * chunks) as u32, plan.splits as u32),
        block_dim: (ATTN_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let raw = desc.raw;
    let (n_heads_i, max_blocks, chunks_i) = (int(n_heads)?, int(batch.max_blocks)?, int(chunks)?);
    let (tps, splits) = (int(plan.tokens_per_split)?, int(plan.splits)?);
    let pool_blocks = desc.pool_blocks(batch.pool.len());
    let mut b = dev.stream().launch_builder(&f);
    b.arg(q).arg(batch.pool).arg(&batch.block_tables).arg(&batch.seq_lens).arg(&raw);
    b.arg(&n_heads_i).arg(&max_blocks).arg(&pool_blocks).arg(&chunks_i).arg(&tps).arg(&splits);
    b.arg(&mut *out).arg(&mut ws.part_o).arg(&mut ws.part_ml);
    // SAFETY: argument types and order match `paged_decode_attention`; q/out/tables checked
    // above; the workspace holds `rows * max_splits` partial rows; block ids are bounded by
    // `pool_blocks` in the kernel and token indices by `max_blocks * block_size`.
    unsafe { b.launch(cfg) }?;
    if plan.splits > 1 {
        let merge = dev.function(&kv_source::builtin().attention, &defines, "paged_attention_merge")?;
        let rows = u32::try_from(seqs * n_heads).map_err(|_| CudaError::Shape("attention rows exceed the grid".into()))?;
        let cfg = LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (hd as u32, 1, 1), shared_mem_bytes: 0 };
        let mut b = dev.stream().launch_builder(&merge);
        b.arg(&ws.part_o).arg(&ws.part_ml).arg(&splits).arg(&mut *out);
        // SAFETY: argument types and order match `paged_attention_merge`; the partials of every
        // (row, split) were written by the launch above.
        unsafe { b.launch(cfg) }?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{codec, CodecOptions, KvGeometry, KvRole};

    fn side(format: KvFormat, offset: usize, head_dim: usize, block_size: usize, static_scale: Option<f32>) -> KvSide {
        let geom = KvGeometry { head_dim, n_kv_heads: 1 };
        let c = codec(&format, geom, KvRole::Key, CodecOptions { static_scale, ..Default::default() }).unwrap();
        KvSide { format, offset, page_bytes: c.page_bytes(block_size), static_scale }
    }

    #[test]
    fn descriptor_page_sizes_match_the_cpu_codecs() {
        for f in [KvFormat::F32, KvFormat::BF16, KvFormat::F16, KvFormat::FP8_E4M3, KvFormat::INT8] {
            for scale in [None, Some(0.25)] {
                for hd in [64, 128] {
                    let (bs, heads) = (16, 3);
                    let k = side(f, 0, hd, bs, scale);
                    let v_off = (heads * k.page_bytes).next_multiple_of(8);
                    let v = side(KvFormat::BF16, v_off, hd, bs, None);
                    let block = (v_off + heads * v.page_bytes).next_multiple_of(64);
                    let d = KvLayerDesc::new(block, bs, heads, hd, k, v).unwrap_or_else(|e| panic!("{f} {scale:?} {hd}: {e}"));
                    let raw = d.raw();
                    assert_eq!((raw.block_bytes, raw.v_offset, raw.block_size, raw.n_kv_heads), (block as i64, v_off as i64, 16, 3));
                    let is8 = f == KvFormat::FP8_E4M3 || f == KvFormat::INT8;
                    assert_eq!(raw.k_scale, if is8 { scale.unwrap_or(1.0) } else { 1.0 });
                    assert_eq!(d.formats(), (f, KvFormat::BF16));
                }
            }
        }
    }

    #[test]
    fn descriptor_rejects_what_the_kernels_cannot_read() {
        let ok = |f| side(f, 0, 64, 16, None);
        let v = side(KvFormat::F32, 8192, 64, 16, None);
        // Compressed formats are refused by name.
        for f in ["qjl1", "tq3_0", "hqmq-s96-r4"] {
            let f: KvFormat = f.parse().unwrap();
            let k = KvSide { format: f, offset: 0, page_bytes: 100, static_scale: None };
            let e = KvLayerDesc::new(16384, 16, 1, 64, k, v).unwrap_err();
            assert!(matches!(e, CudaError::Unsupported(_)) && e.to_string().contains(&f.to_string()) && e.to_string().contains("not yet on CUDA"), "{e}");
            assert!(e.to_string().contains("(supported: f32, bf16, f16, fp8_e4m3, int8);"), "{e}");
        }
        assert!(matches!(KvLayerDesc::new(16384, 16, 1, 96, ok(KvFormat::F32), v), Err(CudaError::Unsupported(_))));
        // Wrong page size, region past the block, misaligned offset, bad static scale.
        let mut k = ok(KvFormat::BF16);
        k.page_bytes += 2;
        assert!(KvLayerDesc::new(16384, 16, 1, 64, k, v).unwrap_err().to_string().contains("take 2048 bytes"));
        assert!(KvLayerDesc::new(8192, 16, 1, 64, ok(KvFormat::F32), v).unwrap_err().to_string().contains("overruns"));
        let mut k = ok(KvFormat::F16);
        k.offset = 4;
        assert!(KvLayerDesc::new(16384, 16, 1, 64, k, v).unwrap_err().to_string().contains("alignment"));
        let mut k = side(KvFormat::INT8, 4, 64, 16, None);
        assert!(KvLayerDesc::new(16384, 16, 1, 64, k, v).is_ok(), "8-bit regions need only 4-byte alignment");
        k.static_scale = Some(0.0);
        k.page_bytes = 16 * 64;
        assert!(KvLayerDesc::new(16384, 16, 1, 64, k, v).unwrap_err().to_string().contains("static scale"));
    }

    #[test]
    fn specializations_exist_for_every_format_pair_in_the_gate_diagonal() {
        for hd in [64, 128] {
            for f in [KvFormat::F32, KvFormat::BF16, KvFormat::F16, KvFormat::FP8_E4M3, KvFormat::INT8] {
                for scale in [None, Some(0.5)] {
                    let s = side(f, 0, hd, 4, scale);
                    let d = KvLayerDesc::new(1 << 16, 4, 1, hd, s, KvSide { offset: 1 << 15, ..s }).unwrap();
                    let defines = d.attention_defines();
                    assert!(kv_source::builtin().attention.variants.iter().any(|v| *v == defines), "{defines:?} not compiled by the gate");
                }
            }
        }
    }

    #[test]
    fn split_plans_fill_the_gpu_without_tiny_splits() {
        // One sequence, 8 KV heads on 132 SMs: 33 splits wanted, capped by length and max.
        let p = plan_splits(8, 32768, 132, 64);
        assert_eq!(p, SplitPlan { splits: 33, tokens_per_split: 1008 });
        assert!(p.splits * p.tokens_per_split >= 32768);
        // Short contexts and big batches stay unsplit.
        assert_eq!(plan_splits(8, 100, 132, 64), SplitPlan { splits: 1, tokens_per_split: 112 });
        assert_eq!(plan_splits(512, 32768, 132, 64).splits, 1);
        assert_eq!(plan_splits(8, 32768, 132, 4), SplitPlan { splits: 4, tokens_per_split: 8192 });
        assert_eq!(plan_splits(8, 0, 132, 4).splits, 1);
        for len in [1, 15, 16, 17, 255, 256, 257, 5000, 100_000] {
            for ctas in [1, 7, 64, 1000] {
                let p = plan_splits(ctas, len, 132, 16);
                assert!(p.splits >= 1 && p.splits <= 16 && p.tokens_per_split.is_multiple_of(16));
                assert!(p.splits * p.tokens_per_split >= len && (p.splits - 1) * p.tokens_per_split < len, "{len} {ctas}: {p:?}");
                assert!(p.splits == 1 || p.tokens_per_split >= MIN_SPLIT_TOKENS);
            }
        }
        assert_eq!(SplitPlan::fixed(5, 3), SplitPlan { splits: 5, tokens_per_split: 1 });
        assert_eq!(SplitPlan::fixed(4, 33), SplitPlan { splits: 4, tokens_per_split: 9 });
    }
}
