//! The Llama decoder on an NVIDIA GPU: the same checkpoint, plan and KV formats as
//! [`LlamaModel`](super::LlamaModel), run by the CUDA kernels of `tessera_kernels::cuda`.
//!
//! Weights are uploaded once in their storage type (GGUF blocks, checkpoint int4/int8/fp8);
//! activations stay on the device in f32 (the engine's compute type, so GPU and CPU compute the
//! same function); the KV cache is one device byte pool in the [`KvLayout`] the CPU uses, one
//! page per KV head in each codec's byte layout, indexed by the caller's block ids (the
//! scheduler's, or a single sequence's own). A step runs every linear layer once over all
//! tokens of all its sequences, and causal attention as one decode query per token (token `i`
//! of a sequence sees its positions `..=cached+i`), which is exact and needs no separate
//! prefill kernel.
//!
//! Not yet here (see issue 8's notes): MoE layers, Q/K norms and biases, act-order
//! permutations, CUDA graphs and preallocated step buffers.

use crate::checkpoint::{LoadError, ModelConfig};
use crate::kv_cache::{KvError, KvLayout};
use crate::model::linear::checkpoint_weight;
use crate::model::{ForwardError, PlanEntry};
use crate::weights::ModelWeights;
use std::cell::RefCell;
use std::sync::Arc;
use tessera_kernels::cuda::attention::{self as attn, AttnWorkspace, KvLayerDesc, KvSide, PagedBatch};
use tessera_kernels::linear::cuda::{self as lin, ActScratch, DeviceWeight};
use tessera_kernels::cuda::{ops, CudaDevice, CudaError, CudaSlice};
use tessera_kernels::ggml::dequantize_row;
use tessera_kernels::ops::Rope;

/// Most context splits of one decode query (32 x 256 tokens covers 8k without a longer split).
const MAX_SPLITS: usize = 32;

/// Why the CUDA model could not be built or run.
#[derive(Debug, thiserror::Error)]
pub enum CudaModelError {
    /// The checkpoint is malformed.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The device or a kernel failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The checkpoint needs something the CUDA backend does not run yet.
    #[error("not yet supported on CUDA: {0}")]
    Unsupported(String),
    /// The input is invalid (token id, context, cache).
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

struct CudaBlock {
    attn_norm: CudaSlice<f32>,
    wq: DeviceWeight,
    wk: DeviceWeight,
    wv: DeviceWeight,
    wo: DeviceWeight,
    ffn_norm: CudaSlice<f32>,
    gate: DeviceWeight,
    up: DeviceWeight,
    down: DeviceWeight,
}

/// A Llama model resident on one GPU, with its KV pool.
pub struct CudaLlama {
    dev: Arc<CudaDevice>,
    config: ModelConfig,
    embed: DeviceWeight,
    blocks: Vec<CudaBlock>,
    final_norm: CudaSlice<f32>,
    /// `None`: tied to the embedding.
    lm_head: Option<DeviceWeight>,
    rope: Rope,
    layout: Arc<KvLayout>,
    layers: Vec<KvLayerDesc>,
    pool: CudaSlice<u8>,
    num_blocks: usize,
    /// Per-step scratch shared by every layer, and the step size (tokens) it holds.
    workspace: Option<StepScratch>,
    plan: Vec<PlanEntry>,
}

/// Scratch every step reuses: attention split partials and quantized activations.
struct StepScratch {
    attn: AttnWorkspace,
    act: ActScratch,
    /// Tokens per step it holds.
    tokens: usize,
}

/// One sequence's part of a step.
pub struct CudaStep<'a> {
    /// New tokens, after the `cached` ones.
    pub tokens: &'a [u32],
    /// The sequence's block table in the model's pool (covering `cached + tokens.len()`).
    pub blocks: &'a [u32],
    /// Tokens already cached.
    pub cached: usize,
    /// Return logits of new tokens `logits_from..` (`None`: none).
    pub logits_from: Option<usize>,
}

impl CudaLlama {
    /// Uploads `weights` to `dev` and allocates a KV pool of `kv_blocks` blocks of
    /// `layout`.
    pub fn load(weights: &ModelWeights, dev: Arc<CudaDevice>, layout: Arc<KvLayout>, kv_blocks: usize) -> Result<Self, CudaModelError> {
        let ckpt = &weights.checkpoint;
        let c = ckpt.config.clone();
        if layout.key_center(0).is_some() {
            return Err(CudaModelError::Unsupported("KV layouts with centered or balanced keys (the GPU KV append stores keys as they are)".into()));
        }
        if c.moe.is_some() || c.attn_bias || c.qk_norm {
            return Err(CudaModelError::Unsupported(format!("{:?} with MoE layers, attention biases or Q/K norms", c.arch)));
        }
        let (h, qw, kw, ffn) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
        let plan = RefCell::new(Vec::new());
        let record = |name: &str, scheme: String, activations: String, w: &DeviceWeight, note: Option<String>| {
            let (storage, kernel) = (w.storage(), w.kernel_id());
            plan.borrow_mut().push(PlanEntry { tensor: name.to_string(), scheme, storage, activations, shape: [w.rows(), w.cols()], kernel, note, shard: None });
        };
        let weight = |name: &str, rows: usize, cols: usize| -> Result<DeviceWeight, CudaModelError> {
            let cw = checkpoint_weight(weights, name, rows, cols)?;
            if cw.perm.is_some() {
                return Err(CudaModelError::Unsupported(format!("{name}: act-order (g_idx) input permutation")));
            }
            if weights.input_transforms.contains_key(name) || weights.output_transforms.contains_key(name) {
                return Err(CudaModelError::Unsupported(format!("{name}: an online input or output transform (compressed-tensors transform_config)")));
            }
            let w = cw.matrix.upload(&dev, cw.act)?;
            record(name, cw.scheme, cw.act.name().to_string(), &w, cw.note);
            Ok(w)
        };
        let vector = |name: &str, n: usize| -> Result<CudaSlice<f32>, CudaModelError> {
            let t = ckpt.tensor(name)?;
            if t.shape != [n] || !t.ty.is_float() {
                return Err(LoadError::Tensor { name: t.source_name.clone(), msg: format!("{} {:?}, expected a float vector of {n}", t.ty, t.shape) }.into());
            }
            let mut v = vec![0f32; n];
            dequantize_row(t.ty, t.data.bytes(), &mut v);
            Ok(dev.stream().clone_htod(&v).map_err(CudaError::from)?)
        };
        let mut blocks = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            blocks.push(CudaBlock {
                attn_norm: vector(&p("attn_norm"), h)?,
                wq: weight(&p("attn_q"), qw, h)?,
                wk: weight(&p("attn_k"), kw, h)?,
                wv: weight(&p("attn_v"), kw, h)?,
                wo: weight(&p("attn_output"), h, qw)?,
                ffn_norm: vector(&p("ffn_norm"), h)?,
                gate: weight(&p("ffn_gate"), ffn, h)?,
                up: weight(&p("ffn_up"), ffn, h)?,
                down: weight(&p("ffn_down"), h, ffn)?,
            });
        }
        let layers = (0..c.num_layers).map(|l| layer_desc(&layout, l)).collect::<Result<Vec<_>, _>>()?;
        let pool_bytes = kv_blocks.checked_mul(layout.block_bytes()).ok_or_else(|| CudaModelError::Unsupported("KV pool size overflows".into()))?;
        let pool = dev.stream().alloc_zeros::<u8>(pool_bytes).map_err(CudaError::from)?;
        // A tied output head multiplies by the embedding table itself (uploaded once).
        let lm_head = (!c.tie_word_embeddings).then(|| weight("output.weight", c.vocab_size, h)).transpose()?;
        let embed = weight("token_embd.weight", c.vocab_size, h)?;
        let mut plan = plan.into_inner();
        // The embedding is looked up, not multiplied: in the plan only as the tied head.
        if !c.tie_word_embeddings {
            plan.pop();
        }
        Ok(CudaLlama {
            embed,
            final_norm: vector("output_norm.weight", h)?,
            lm_head,
            plan,
            rope: Rope::new(c.head_dim, c.rope_theta),
            num_blocks: kv_blocks,
            workspace: None,
            blocks,
            layers,
            pool,
            layout,
            config: c,
            dev,
        })
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The device, for logs.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// The kernel chosen for every linear layer, in execution order.
    pub fn plan(&self) -> &[PlanEntry] {
        &self.plan
    }

    /// Makes the step scratch hold a step of `tokens` queries: attention with many splits of
    /// the context for the few queries of decode steps and none for prefill-sized steps (which
    /// fill the GPU with CTAs anyway), and one int8/FP8 activation scratch for every layer that
    /// quantizes activations. Grows to a power of two so steps rarely reallocate.
    fn ensure_workspace(&mut self, tokens: usize) -> Result<(), CudaError> {
        if self.workspace.as_ref().is_some_and(|w| w.tokens >= tokens) {
            return Ok(());
        }
        let n = tokens.next_power_of_two();
        let splits = (MAX_SPLITS * 16 / n).clamp(1, MAX_SPLITS);
        let c = &self.config;
        let widest = c.hidden_size.max(c.num_heads * c.head_dim).max(c.intermediate_size);
        self.workspace = Some(StepScratch {
            attn: AttnWorkspace::new(&self.dev, n, c.num_heads, c.head_dim, splits)?,
            act: ActScratch::new(&self.dev, n, widest)?,
            tokens: n,
        });
        Ok(())
    }

    /// Blocks in the device pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Copies KV block `src` of the device pool into block `dst` (all layers).
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), CudaModelError> {
        let n = self.num_blocks;
        if src as usize >= n || dst as usize >= n {
            return Err(CudaModelError::Unsupported(format!("block copy {src} -> {dst} outside the pool of {n} blocks")));
        }
        if src == dst {
            return Ok(());
        }
        let bb = self.layout.block_bytes();
        let (s, d) = (src as usize * bb, dst as usize * bb);
        let st = self.dev.stream();
        // Split the pool between the two blocks so one is read while the other is written.
        let (mut lo, mut hi) = self.pool.split_at_mut(s.max(d));
        if s < d {
            st.memcpy_dtod(&lo.slice(s..s + bb), &mut hi.slice_mut(..bb)).map_err(CudaError::from)?;
        } else {
            st.memcpy_dtod(&hi.slice(..bb), &mut lo.slice_mut(d..d + bb)).map_err(CudaError::from)?;
        }
        Ok(())
    }

    /// Runs one step over `batch` and returns, per sequence, its requested logit rows
    /// (`vocab` each).
    pub fn forward(&mut self, batch: &[CudaStep<'_>]) -> Result<Vec<Vec<f32>>, CudaModelError> {
        let m: usize = batch.iter().map(|s| s.tokens.len()).sum();
        self.ensure_workspace(m.max(1))?;
        let c = &self.config;
        let (h, hd, vocab) = (c.hidden_size, c.head_dim, c.vocab_size);
        let (qw, kw, ffn) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
        let bs = self.layout.block_size();
        // Validate everything before touching the cache.
        for s in batch {
            if let Some(&id) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(ForwardError::TokenOutOfRange { id, vocab }.into());
            }
            if let Some(from) = s.logits_from.filter(|&f| f >= s.tokens.len()) {
                return Err(ForwardError::LogitsRange { from, len: s.tokens.len() }.into());
            }
            let needed = s.cached + s.tokens.len();
            let capacity = (s.blocks.len() * bs).min(c.max_position_embeddings);
            if needed > capacity {
                return Err(ForwardError::Kv(KvError::Capacity { needed, capacity }).into());
            }
            if let Some(&b) = s.blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
                return Err(CudaModelError::Unsupported(format!("block id {b} outside the pool of {} blocks", self.num_blocks)));
            }
        }
        if m == 0 {
            return Ok(batch.iter().map(|_| Vec::new()).collect());
        }
        // Per token: its id, cache slot, sequence length seen by its query and block table row.
        let max_blocks = batch.iter().map(|s| s.blocks.len()).max().unwrap_or(0).max(1);
        let (mut ids, mut slots, mut seq_lens, mut tables, mut positions) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for s in batch {
            for (i, &t) in s.tokens.iter().enumerate() {
                let p = s.cached + i;
                ids.push(t as i32);
                slots.push((s.blocks[p / bs] as usize * bs + p % bs) as i32);
                seq_lens.push(p as i32 + 1);
                positions.push(p);
                tables.extend(s.blocks.iter().map(|&b| b as i32));
                tables.resize(tables.len() + max_blocks - s.blocks.len(), 0);
            }
        }
        let sin_cos: Vec<f32> = self.rope.table(positions.into_iter()).into_iter().flat_map(|(sn, cs)| [sn, cs]).collect();
        let st = self.dev.stream();
        let up = |v: &[i32]| st.clone_htod(v).map_err(CudaError::from);
        let (ids, slots, tables, seq_lens) = (up(&ids)?, up(&slots)?, up(&tables)?, up(&seq_lens)?);
        let sin_cos = st.clone_htod(&sin_cos).map_err(CudaError::from)?;
        let zeros = |n: usize| st.alloc_zeros::<f32>(n).map_err(CudaError::from);
        let (mut x, mut normed, mut tmp) = (zeros(m * h)?, zeros(m * h)?, zeros(m * h)?);
        let (mut q, mut k, mut v, mut att) = (zeros(m * qw)?, zeros(m * kw)?, zeros(m * kw)?, zeros(m * qw)?);
        let (mut g, mut u, mut act) = (zeros(m * ffn)?, zeros(m * ffn)?, zeros(m * ffn)?);
        let max_seq_len = batch.iter().map(|s| s.cached + s.tokens.len()).max().unwrap_or(1);
        let dev = &*self.dev;
        let scratch = self.workspace.as_mut().expect("sized above");
        let (pool, ws, aq) = (&mut self.pool, &mut scratch.attn, &mut scratch.act);
        let half = self.rope.half_dim();

        lin::embedding(dev, &self.embed, &ids, &mut x.as_view_mut())?;
        let mut pending = false;
        for (b, desc) in self.blocks.iter().zip(&self.layers) {
            ops::rms_norm(dev, &mut x, pending.then_some(&tmp), &b.attn_norm, c.rms_norm_eps, &mut normed)?;
            lin::matmul_with(dev, &b.wq, &normed.as_view(), m, &mut q.as_view_mut(), aq)?;
            lin::matmul_with(dev, &b.wk, &normed.as_view(), m, &mut k.as_view_mut(), aq)?;
            lin::matmul_with(dev, &b.wv, &normed.as_view(), m, &mut v.as_view_mut(), aq)?;
            ops::rope(dev, &mut q, &sin_cos, c.num_heads, hd, half)?;
            ops::rope(dev, &mut k, &sin_cos, c.num_kv_heads, hd, half)?;
            attn::kv_append(dev, desc, pool, &k.as_view(), &v.as_view(), &slots.as_view())?;
            let paged = PagedBatch { pool, block_tables: tables.as_view(), max_blocks, seq_lens: seq_lens.as_view(), max_seq_len };
            attn::paged_decode_attention(dev, desc, &paged, &q.as_view(), c.num_heads, &mut att.as_view_mut(), ws)?;
            lin::matmul_with(dev, &b.wo, &att.as_view(), m, &mut tmp.as_view_mut(), aq)?;
            ops::rms_norm(dev, &mut x, Some(&tmp), &b.ffn_norm, c.rms_norm_eps, &mut normed)?;
            lin::matmul_with(dev, &b.gate, &normed.as_view(), m, &mut g.as_view_mut(), aq)?;
            lin::matmul_with(dev, &b.up, &normed.as_view(), m, &mut u.as_view_mut(), aq)?;
            ops::silu_mul(dev, &g, &u, &mut act)?;
            lin::matmul_with(dev, &b.down, &act.as_view(), m, &mut tmp.as_view_mut(), aq)?;
            pending = true;
        }
        ops::rms_norm(dev, &mut x, Some(&tmp), &self.final_norm, c.rms_norm_eps, &mut normed)?;
        // The requested rows of every sequence through the output head, one row range each.
        let mut out = Vec::with_capacity(batch.len());
        let mut row = 0;
        for s in batch {
            let n = s.tokens.len();
            out.push(match s.logits_from {
                Some(from) => {
                    let rows = n - from;
                    let mut logits = zeros(rows * vocab)?;
                    let hidden = normed.slice((row + from) * h..(row + n) * h);
                    lin::matmul_with(dev, self.lm_head.as_ref().unwrap_or(&self.embed), &hidden, rows, &mut logits.as_view_mut(), aq)?;
                    Some(logits)
                }
                None => None,
            });
            row += n;
        }
        self.dev.synchronize()?;
        out.into_iter().map(|l| l.map_or(Ok(Vec::new()), |l| st.clone_dtoh(&l).map_err(|e| CudaError::from(e).into()))).collect()
    }
}

/// Layer `l`'s page geometry in the device pool.
fn layer_desc(layout: &KvLayout, l: usize) -> Result<KvLayerDesc, CudaError> {
    let (kr, vr) = layout.regions(l);
    let (g, dtype, (ks, vs)) = (layout.geometry(), layout.dtype(), layout.static_scales(l));
    let side = |format, r: std::ops::Range<usize>, static_scale| KvSide { format, offset: r.start, page_bytes: r.len() / g.n_kv_heads, static_scale };
    KvLayerDesc::new(layout.block_bytes(), layout.block_size(), g.n_kv_heads, g.head_dim, side(dtype.k, kr, ks), side(dtype.v, vr, vs))
}
