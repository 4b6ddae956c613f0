//! The Llama-style decoder (SmolLM2, Llama 2/3 without RoPE scaling, Mistral without sliding
//! window) and its mixture-of-experts relatives (Mixtral, Qwen2-MoE with Q/K/V biases,
//! Qwen3-MoE with Q/K norms, DeepSeek-V3 routing over GQA attention).
//!
//! The model knows layers, not kernels: each [`Linear`] carries the kernel chosen for its
//! storage type. The forward pass takes a batch of sequences of different lengths, runs every
//! linear layer once over all their tokens, and attention per sequence over its own KV cache.

use super::linear::{Linear, PlanEntry};
use super::mlp::Mlp;
use super::moe::MoeLayer;
use super::shard::{row_align, Cut, Shard};
use crate::checkpoint::{LoadError, ModelConfig, TensorEntry};
use crate::kv_cache::{KvCacheScheme, KvDtype, KvError, KvLayout, KvLayoutError, KvRequest, LocalKv, SequenceKv, DEFAULT_BLOCK_SIZE};
use crate::weights::ModelWeights;
use std::sync::Arc;
use tessera_kernels::attention::{attention_batch, AttnJob, AttnShape};
use tessera_kernels::comm::Communicator;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::ggml::{dequantize_row, GgmlType};
use tessera_kernels::kv::{KvFormatError, KvGeometry};
use tessera_kernels::linear::LinearPolicy;
use tessera_kernels::ops::{rms_norm, Rope};

/// One sequence's part of a batch.
pub struct SeqInput<'a> {
    /// New tokens, appended after what the cache holds.
    pub tokens: &'a [u32],
    /// The sequence's cache.
    pub kv: &'a mut dyn SequenceKv,
    /// Return logits for new tokens `logits_from..` (`None`: no logits).
    pub logits_from: Option<usize>,
}

/// Why a forward pass was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// The sequence exceeds the context or cache.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// `logits_from` beyond the sequence's new tokens.
    #[error("logits requested from token {from} of a {len}-token input")]
    LogitsRange {
        /// Requested start.
        from: usize,
        /// Tokens given.
        len: usize,
    },
}

/// Where a dense block's linear layers read their input (what calibration observes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinearSite {
    /// The normed hidden state read by Q, K and V.
    Qkv,
    /// The attention output read by O.
    Output,
    /// The normed hidden state read by gate and up.
    GateUp,
    /// `silu(gate) * up`, read by down.
    Down,
}

/// Sees the rows every dense block's linear layers read during a forward pass, e.g. to
/// gather the activation statistics a quantizer calibrates on, and the queries and keys
/// attention reads. MoE feed-forwards are not observed.
pub trait ActivationObserver: Send {
    /// `rows` (row-major, `width` wide) are the input of `site` in block `layer`.
    fn observe(&mut self, layer: usize, site: LinearSite, rows: &[f32], width: usize);
    /// One sequence's new queries (`n × n_heads · head_dim`) and keys (`n × n_kv_heads ·
    /// head_dim`) in block `layer`, after RoPE: what attention scores and the cache stores.
    fn observe_attention(&mut self, layer: usize, q: &[f32], k: &[f32]) {
        let _ = (layer, q, k);
    }
}

/// A block's feed-forward.
enum Ffn {
    Dense(Box<Mlp>),
    Moe(Box<MoeLayer>),
}

struct Block {
    attn_norm: Vec<f32>,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    /// Q, K, V biases concatenated (one row of the fused QKV output).
    qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weights for Q and K.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
}

/// A rank's place in a tensor-parallel group and its link to the other ranks.
struct Parallel {
    shard: Shard,
    comm: Arc<dyn Communicator>,
    /// The output head's rows on every rank (the logits each contributes).
    vocab: Vec<std::ops::Range<usize>>,
}

/// A loaded Llama model, whole or one tensor-parallel rank's shard of it.
pub struct LlamaModel {
    config: ModelConfig,
    embed: TensorEntry,
    blocks: Vec<Block>,
    final_norm: Vec<f32>,
    lm_head: Linear,
    rope: Rope,
    shape: AttnShape,
    kv_cache: Option<KvCacheScheme>,
    parallel: Option<Parallel>,
}

fn norm_weights(t: &TensorEntry, n: usize) -> Result<Vec<f32>, LoadError> {
    if t.shape != [n] || !t.ty.is_float() {
        return Err(LoadError::Tensor {
            name: t.source_name.clone(),
            msg: format!("{} {:?}, expected a float vector of {n}", t.ty, t.shape),
        });
    }
    let mut out = vec![0f32; n];
    dequantize_row(t.ty, t.data.bytes(), &mut out);
    Ok(out)
}

impl LlamaModel {
    /// Builds the model from a checkpoint, choosing a kernel for every linear layer.
    pub fn load(weights: &ModelWeights, caps: &CpuCaps, policy: LinearPolicy) -> Result<Self, LoadError> {
        Self::load_rank(weights, caps, policy, None)
    }

    /// [`Self::load`] for one rank of a tensor-parallel group when `rank` is given: the rank's
    /// [`Shard`] of every layer (see [`super::shard`]), summing partial outputs and gathering
    /// logits through `comm`. Every rank of the group must then make the same calls in the same
    /// order (forward passes, KV calibration), each on its own thread.
    pub fn load_rank(weights: &ModelWeights, caps: &CpuCaps, policy: LinearPolicy, rank: Option<(Shard, Arc<dyn Communicator>)>) -> Result<Self, LoadError> {
        let ckpt = &weights.checkpoint;
        let c = ckpt.config.clone();
        let (h, hd, ffn) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (qw, kw) = (c.num_heads * hd, c.num_kv_heads * hd);
        let shard = rank.as_ref().map(|r| &r.0);
        // This rank's query and KV channels (all of them unsharded).
        let (qc, kc) = match shard {
            Some(s) => (s.q_heads.start * hd..s.q_heads.end * hd, s.kv_heads.start * hd..s.kv_heads.end * hd),
            None => (0..qw, 0..kw),
        };
        let column = |ch: &std::ops::Range<usize>| if shard.is_some() { Cut::Rows(ch.clone()) } else { Cut::Whole };
        let lin = |name: &str, rows, cols, cut| Linear::load_cut(weights, name, rows, cols, cut, caps, policy);
        let embed = ckpt.tensor("token_embd.weight")?.clone();
        if embed.shape != [c.vocab_size, h] || embed.ty.row_bytes(h).is_none() {
            return Err(LoadError::Tensor {
                name: embed.source_name.clone(),
                msg: format!("{} {:?}, expected [{}, {h}]", embed.ty, embed.shape, c.vocab_size),
            });
        }
        let mut blocks = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let qkv_bias = if c.attn_bias {
                // The bias adds after the product, and an output transform would turn it too.
                if let Some(name) = ["attn_q", "attn_k", "attn_v"].map(p).into_iter().find(|n| weights.output_transforms.contains_key(n)) {
                    return Err(LoadError::Tensor { name, msg: "an online output transform on a layer with a bias is not supported".into() });
                }
                let mut b = norm_weights(ckpt.tensor(&format!("blk.{i}.attn_q.bias"))?, qw)?[qc.clone()].to_vec();
                b.extend(&norm_weights(ckpt.tensor(&format!("blk.{i}.attn_k.bias"))?, kw)?[kc.clone()]);
                b.extend(&norm_weights(ckpt.tensor(&format!("blk.{i}.attn_v.bias"))?, kw)?[kc.clone()]);
                Some(b)
            } else {
                None
            };
            let qk_norm = if c.qk_norm {
                Some((norm_weights(ckpt.tensor(&p("attn_q_norm"))?, c.head_dim)?, norm_weights(ckpt.tensor(&p("attn_k_norm"))?, c.head_dim)?))
            } else {
                None
            };
            let ffn = match &c.moe {
                Some(moe) if moe.layers[i] => Ffn::Moe(Box::new(MoeLayer::load(weights, i, &c, moe, shard, caps, policy)?)),
                _ => Ffn::Dense(Box::new(Mlp::load_shard(weights, [&p("ffn_gate"), &p("ffn_up"), &p("ffn_down")], h, ffn, shard, caps, policy)?)),
            };
            let output = if shard.is_some() { Cut::Cols(qc.clone()) } else { Cut::Whole };
            blocks.push(Block {
                attn_norm: norm_weights(ckpt.tensor(&p("attn_norm"))?, h)?,
                wq: lin(&p("attn_q"), qw, h, column(&qc))?,
                wk: lin(&p("attn_k"), kw, h, column(&kc))?,
                wv: lin(&p("attn_v"), kw, h, column(&kc))?,
                wo: lin(&p("attn_output"), h, qw, output)?,
                qkv_bias,
                qk_norm,
                ffn_norm: norm_weights(ckpt.tensor(&p("ffn_norm"))?, h)?,
                ffn,
            });
        }
        let head_name = if c.tie_word_embeddings { "token_embd.weight" } else { "output.weight" };
        let parallel = match rank {
            Some((shard, comm)) => {
                let vocab = shard.row_cuts(head_name, c.vocab_size, row_align(weights, head_name))?;
                Some(Parallel { shard, comm, vocab })
            }
            None => None,
        };
        let head_cut = parallel.as_ref().map_or(Cut::Whole, |p| Cut::Rows(p.vocab[p.shard.rank].clone()));
        let model = LlamaModel {
            final_norm: norm_weights(ckpt.tensor("output_norm.weight")?, h)?,
            lm_head: lin(head_name, c.vocab_size, h, head_cut)?,
            rope: Rope::new(c.head_dim, c.rope_theta),
            shape: AttnShape { n_heads: qc.len() / hd, n_kv_heads: kc.len() / hd, head_dim: hd },
            kv_cache: weights.kv_cache.clone(),
            parallel,
            embed,
            blocks,
            config: c,
        };
        if let Some(q) = &weights.quantization {
            tracing::info!(quantization = %q, "checkpoint quantization");
        }
        model.log_plan();
        Ok(model)
    }

    /// Logs the kernel plan: one line per distinct (scheme, storage, activations, kernel) at
    /// info, every layer at debug.
    fn log_plan(&self) {
        let plan = self.plan();
        let mut counts = std::collections::BTreeMap::new();
        for e in &plan {
            tracing::debug!(tensor = %e.tensor, scheme = %e.scheme, storage = %e.storage, shape = ?e.shape, kernel = %e.kernel, note = ?e.note, "linear layer");
            *counts.entry((&e.scheme, &e.storage, &e.activations, &e.kernel)).or_insert(0usize) += 1;
        }
        for ((scheme, storage, activations, kernel), n) in counts {
            tracing::info!(layers = n, %scheme, %storage, %activations, %kernel, "kernel plan");
        }
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Floats per token per layer in the K (or V) cache.
    pub fn kv_width(&self) -> usize {
        self.shape.kv_width()
    }

    /// The heads attention runs over (this rank's, under tensor parallelism).
    pub fn attn_shape(&self) -> AttnShape {
        self.shape
    }

    /// Head geometry of the KV cache.
    pub fn kv_geometry(&self) -> KvGeometry {
        KvGeometry { head_dim: self.shape.head_dim, n_kv_heads: self.shape.n_kv_heads }
    }

    /// The KV-cache storage for the formats `req` asks for (auto: the checkpoint's
    /// `kv_cache_scheme`, else f32) in blocks of `block_size` tokens (random state of QJL and
    /// HQMQ seeded by `seed`), keys not centered: serving and the CLI use
    /// [`crate::LoadedModel::kv_layout`], which centers them where that helps.
    pub fn kv_layout(&self, req: impl Into<KvRequest>, block_size: usize, seed: u64) -> Result<Arc<KvLayout>, KvFormatError> {
        let whole = KvLayout::for_model(&self.config, self.kv_cache.as_ref(), req.into(), block_size, seed)?;
        Ok(match &self.parallel {
            Some(p) => whole.heads(p.shard.kv_heads.clone()),
            None => whole,
        })
    }

    /// This rank's shard of the model (`None`: the whole model).
    pub fn shard(&self) -> Option<&Shard> {
        self.parallel.as_ref().map(|p| &p.shard)
    }

    /// The tensor-parallel link's counters (collective calls, bytes, time) on this rank.
    pub fn comm_stats(&self) -> Option<tessera_kernels::comm::CommStats> {
        self.parallel.as_ref().map(|p| p.comm.stats())
    }

    /// Sums a row-parallel layer's partial output over the ranks (nothing unsharded).
    fn all_reduce(&self, buf: &mut [f32]) {
        if let Some(p) = &self.parallel {
            p.comm.all_reduce_sum(buf);
        }
    }

    /// [`Self::kv_layout`], with keys centered on their mean over a calibration sequence (one
    /// forward pass) when the key format is one that centering helps (qjl1, tq3_0, hqmq), and
    /// balanced against the queries when it spreads its error over a head (qjl1, tq3_0). The
    /// sequence is `prefix` then `text` once for balanced keys, [`CENTERING_PASSES`] times for
    /// keys that are only centered.
    ///
    /// [`CENTERING_PASSES`]: super::key_calibration::CENTERING_PASSES
    pub fn kv_layout_calibrated(&self, req: impl Into<KvRequest>, block_size: usize, seed: u64, prefix: &[u32], text: &[u32]) -> Result<Arc<KvLayout>, KvLayoutError> {
        let mut layout = self.kv_layout(req, block_size, seed)?;
        if layout.wants_key_centers() {
            let passes = if layout.wants_key_balance() { 1 } else { super::key_calibration::CENTERING_PASSES };
            let mut calibration = prefix.to_vec();
            (0..passes).for_each(|_| calibration.extend_from_slice(text));
            let calibration = &calibration[..calibration.len().min(self.config.max_position_embeddings)];
            let t = super::key_calibration::measure(self, &layout, calibration).map_err(|e| KvLayoutError::Calibration(e.to_string()))?;
            Arc::get_mut(&mut layout).expect("a fresh layout has one owner").set_key_transform(t).map_err(KvLayoutError::Calibration)?;
        }
        Ok(layout)
    }

    /// A cache of `capacity` tokens for one sequence, in the engine's compute type (f32).
    pub fn local_kv(&self, capacity: usize) -> LocalKv {
        let layout = self.kv_layout(KvDtype::default(), DEFAULT_BLOCK_SIZE, 0).expect("f32 stores any head size");
        LocalKv::new(layout, capacity)
    }

    /// The dense blocks' linear layers that run an online input transform (canonical names).
    pub fn transformed_linears(&self) -> Vec<&str> {
        self.linears_where(|l| l.input_transform().is_some())
    }

    /// The dense blocks' linear layers that run an online output transform (canonical names).
    pub fn output_transformed_linears(&self) -> Vec<&str> {
        self.linears_where(|l| l.output_transform().is_some())
    }

    /// The dense blocks' linear layers for which `keep` holds (canonical names).
    fn linears_where(&self, keep: impl Fn(&Linear) -> bool) -> Vec<&str> {
        let mut out = Vec::new();
        for b in &self.blocks {
            let mut ls = vec![&b.wq, &b.wk, &b.wv, &b.wo];
            if let Ffn::Dense(mlp) = &b.ffn {
                ls.extend(mlp.linears());
            }
            out.extend(ls.into_iter().filter(|l| keep(l)).map(Linear::name));
        }
        out
    }

    /// The kernel chosen for every linear layer, in execution order.
    pub fn plan(&self) -> Vec<PlanEntry> {
        let mut out = Vec::new();
        for b in &self.blocks {
            out.extend([&b.wq, &b.wk, &b.wv, &b.wo].map(Linear::plan));
            match &b.ffn {
                Ffn::Dense(mlp) => out.extend(mlp.plan()),
                Ffn::Moe(moe) => out.extend(moe.plan()),
            }
        }
        out.push(self.lm_head.plan());
        out
    }

    /// The linear layer of a dense block whose weight is `name` (canonical: `blk.3.attn_q.weight`,
    /// `blk.3.ffn_down.weight`), e.g. to swap in quantized weights while calibrating.
    pub fn block_linear_mut(&mut self, name: &str) -> Option<&mut Linear> {
        self.blocks.iter_mut().find_map(|b| {
            let ffn: Vec<&mut Linear> = match &mut b.ffn {
                Ffn::Dense(mlp) => mlp.linears_mut().into(),
                Ffn::Moe(_) => Vec::new(),
            };
            [&mut b.wq, &mut b.wk, &mut b.wv, &mut b.wo].into_iter().chain(ffn).find(|l| l.name() == name)
        })
    }

    /// Storage type of the token embedding (looked up row by row, no kernel).
    pub fn embedding_type(&self) -> GgmlType {
        self.embed.ty
    }

    /// Runs the batch; returns, per sequence, logits rows (`vocab` each) for the requested tokens.
    ///
    /// The pass runs on the calling thread, which takes part in each of its parallel regions
    /// on the kernel pool (`tessera_kernels::cpu::pool`).
    pub fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.forward_pass(batch, None)
    }

    /// [`Self::forward`], showing `observer` the input of every dense linear layer and every
    /// layer's post-RoPE queries and keys.
    pub fn forward_observed(&self, batch: &mut [SeqInput<'_>], observer: &mut dyn ActivationObserver) -> Result<Vec<Vec<f32>>, ForwardError> {
        self.forward_pass(batch, Some(observer))
    }

    /// The embedding rows (`hidden_size` each) of `tokens`: the input of the first block.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        self.check_tokens(tokens)?;
        Ok(self.embed_rows(tokens, tokens.len()))
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), ForwardError> {
        let vocab = self.config.vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&id) => Err(ForwardError::TokenOutOfRange { id, vocab }),
            None => Ok(()),
        }
    }

    /// The embedding rows of the `m` tokens of `tokens` (ids already checked).
    fn embed_rows<'t>(&self, tokens: impl IntoIterator<Item = &'t u32>, m: usize) -> Vec<f32> {
        let h = self.config.hidden_size;
        let mut x = vec![0f32; m * h];
        let erb = self.embed.ty.row_bytes(h).expect("checked at load");
        let ebytes = self.embed.data.bytes();
        for (row, &t) in x.chunks_exact_mut(h).zip(tokens) {
            dequantize_row(self.embed.ty, &ebytes[t as usize * erb..(t as usize + 1) * erb], row);
        }
        x
    }

    /// Runs blocks `layers` alone over `x`, the hidden states of the batch's new tokens
    /// (sequence after sequence, `hidden_size` per token: [`Self::embed`]'s rows before block
    /// 0), in place. Each sequence's cache gets those blocks' keys and values at its current
    /// position and then advances by its new tokens, so a cache serves one such call (give
    /// fresh ones to the next range). `logits_from` is not read: no logits are computed.
    /// `observer` sees those blocks' linear inputs. With `until`, the pass stops right after
    /// showing the last block's inputs of that site, leaving `x` and the caches partway: only
    /// what was observed is of use. Calibration uses this to run a model block by block while
    /// its blocks change (sequential GPTQ).
    ///
    /// # Panics
    /// If `layers` goes past the last block or `x` does not hold one row per new token.
    pub fn forward_blocks(
        &self,
        layers: std::ops::Range<usize>,
        batch: &mut [SeqInput<'_>],
        x: &mut [f32],
        observer: Option<&mut dyn ActivationObserver>,
        until: Option<LinearSite>,
    ) -> Result<(), ForwardError> {
        assert!(layers.end <= self.blocks.len(), "blocks {layers:?} of {}", self.blocks.len());
        let m: usize = batch.iter().map(|s| s.tokens.len()).sum();
        assert_eq!(x.len(), m * self.config.hidden_size, "one hidden row per new token");
        self.run_blocks(layers, batch, x, observer, until).map(drop)
    }

    fn forward_pass(&self, batch: &mut [SeqInput<'_>], observer: Option<&mut dyn ActivationObserver>) -> Result<Vec<Vec<f32>>, ForwardError> {
        let c = &self.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        // Validate everything before touching any cache (capacity: in `run_blocks`).
        for s in batch.iter() {
            self.check_tokens(s.tokens)?;
            if let Some(from) = s.logits_from {
                if from >= s.tokens.len() {
                    return Err(ForwardError::LogitsRange { from, len: s.tokens.len() });
                }
            }
        }
        let m = batch.iter().map(|s| s.tokens.len()).sum();
        let mut x = self.embed_rows(batch.iter().flat_map(|s| s.tokens.iter()), m);
        let spans = self.run_blocks(0..self.blocks.len(), batch, &mut x, observer, None)?;

        // All requested rows of all sequences through the output head in one call (one pass
        // over its weights), each sequence's rows a segment.
        let wanted: Vec<(usize, usize)> = batch
            .iter()
            .zip(&spans)
            .map(|(s, &(r0, n, _))| s.logits_from.map_or((r0, 0), |from| (r0 + from, n - from)))
            .collect();
        let rows: usize = wanted.iter().map(|w| w.1).sum();
        let mut hn = vec![0f32; rows * h];
        let mut at = 0;
        for &(r, n) in &wanted {
            rms_norm(&x[r * h..(r + n) * h], &self.final_norm, c.rms_norm_eps, &mut hn[at * h..(at + n) * h]);
            at += n;
        }
        let segments: Vec<usize> = wanted.iter().map(|w| w.1).filter(|&n| n > 0).collect();
        let logits = self.head(&hn, rows, &segments);
        let mut out = Vec::with_capacity(batch.len());
        let mut at = 0;
        for &(_, n) in &wanted {
            out.push(logits[at * vocab..(at + n) * vocab].to_vec());
            at += n;
        }
        Ok(out)
    }

    /// The output head over `rows` normed hidden rows: `rows × vocab` logits, each rank's
    /// vocabulary range gathered from the others under tensor parallelism.
    fn head(&self, hn: &[f32], rows: usize, segments: &[usize]) -> Vec<f32> {
        let vocab = self.config.vocab_size;
        let Some(p) = &self.parallel else {
            let mut logits = vec![0f32; rows * vocab];
            self.lm_head.forward(hn, segments, &mut logits, vocab);
            return logits;
        };
        let mine = self.lm_head.rows();
        let mut part = vec![0f32; rows * mine];
        self.lm_head.forward(hn, segments, &mut part, mine);
        let mut all = Vec::with_capacity(rows * vocab);
        p.comm.all_gather(&part, &mut all);
        // `all` holds each rank's rows x (its vocabulary range), rank after rank.
        let mut logits = vec![0f32; rows * vocab];
        let mut at = 0;
        for range in &p.vocab {
            let w = range.len();
            for (r, src) in all[at..at + rows * w].chunks_exact(w).enumerate() {
                logits[r * vocab + range.start..r * vocab + range.end].copy_from_slice(src);
            }
            at += rows * w;
        }
        logits
    }

    /// Blocks `layers` over the hidden rows `x` of the batch (caches checked, reserved, written
    /// and advanced), stopping after site `until` of the last block when given (caches not
    /// advanced); returns each sequence's (first row, new tokens, first position).
    fn run_blocks(
        &self,
        layers: std::ops::Range<usize>,
        batch: &mut [SeqInput<'_>],
        x: &mut [f32],
        mut observer: Option<&mut dyn ActivationObserver>,
        until: Option<LinearSite>,
    ) -> Result<Vec<(usize, usize, usize)>, ForwardError> {
        if let Some(p) = &self.parallel {
            // Alone, a rank would wait forever for the others at its first all-reduce.
            assert_eq!(super::shard::current_rank(), Some(p.shard.rank), "a tensor-parallel shard runs only on its rank's thread (LoadedModel::run)");
        }
        let last = layers.end.saturating_sub(1);
        let stop = |li: usize, site: LinearSite| li == last && until == Some(site);
        let c = &self.config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qw, kw) = (self.shape.q_width(), self.shape.kv_width());
        let qkv_w = qw + 2 * kw;
        for s in batch.iter() {
            let needed = s.kv.len() + s.tokens.len();
            if needed > c.max_position_embeddings {
                return Err(KvError::Capacity { needed, capacity: c.max_position_embeddings }.into());
            }
        }
        for s in batch.iter_mut() {
            s.kv.reserve(s.tokens.len())?;
        }
        let spans: Vec<(usize, usize, usize)> = {
            let mut row = 0;
            batch
                .iter()
                .map(|s| {
                    let span = (row, s.tokens.len(), s.kv.len());
                    row += s.tokens.len();
                    span
                })
                .collect()
        };
        let m: usize = spans.iter().map(|s| s.1).sum();
        let segments: Vec<usize> = spans.iter().map(|s| s.1).collect();
        let rope_table = self.rope.table(spans.iter().flat_map(|&(_, n, p0)| p0..p0 + n));
        let half = self.rope.half_dim();

        let mut normed = vec![0f32; m * h];
        let mut qkv = vec![0f32; m * qkv_w];
        let mut q = vec![0f32; m * qw];
        let mut attn = vec![0f32; m * qw];
        let mut tmp = vec![0f32; m * h];
        let mut head = vec![0f32; hd];
        let mut kbuf = Vec::new();
        let mut vbuf = Vec::new();
        for (li, b) in self.blocks.iter().enumerate().take(layers.end).skip(layers.start) {
            rms_norm(x, &b.attn_norm, c.rms_norm_eps, &mut normed);
            if let Some(o) = observer.as_deref_mut() {
                o.observe(li, LinearSite::Qkv, &normed, h);
            }
            if stop(li, LinearSite::Qkv) {
                return Ok(spans);
            }
            Linear::forward_fused(&[&b.wq, &b.wk, &b.wv], &normed, &segments, &mut qkv, qkv_w);
            for (t, row) in qkv.chunks_exact_mut(qkv_w).enumerate() {
                if let Some(bias) = &b.qkv_bias {
                    row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
                }
                if let Some((qn, kn)) = &b.qk_norm {
                    let (qs, ks) = row[..qw + kw].split_at_mut(qw);
                    for (x, w) in qs.chunks_exact_mut(hd).map(|x| (x, qn)).chain(ks.chunks_exact_mut(hd).map(|x| (x, kn))) {
                        head.copy_from_slice(x);
                        rms_norm(&head, w, c.rms_norm_eps, x);
                    }
                }
                let cs = &rope_table[t * half..(t + 1) * half];
                let (qr, rest) = row.split_at_mut(qw);
                self.rope.apply(qr, hd, cs);
                self.rope.apply(&mut rest[..kw], hd, cs);
                q[t * qw..(t + 1) * qw].copy_from_slice(qr);
            }
            for (s, &(r0, n, p0)) in batch.iter_mut().zip(&spans) {
                kbuf.clear();
                vbuf.clear();
                for row in qkv[r0 * qkv_w..(r0 + n) * qkv_w].chunks_exact(qkv_w) {
                    kbuf.extend_from_slice(&row[qw..qw + kw]);
                    vbuf.extend_from_slice(&row[qw + kw..]);
                }
                if let Some(o) = observer.as_deref_mut() {
                    o.observe_attention(li, &q[r0 * qw..(r0 + n) * qw], &kbuf);
                }
                s.kv.write(li, p0, &kbuf, &vbuf);
            }
            // Every sequence's attention in one call (decodes share one parallel region).
            let mut jobs = Vec::with_capacity(batch.len());
            let mut rest = &mut attn[..];
            for (s, &(r0, n, p0)) in batch.iter().zip(&spans) {
                let (out, tail) = rest.split_at_mut(n * qw);
                rest = tail;
                jobs.push(AttnJob { q: &q[r0 * qw..(r0 + n) * qw], m: n, pos0: p0, kv: s.kv.view(li, p0 + n), out });
            }
            attention_batch(self.shape, &mut jobs);
            drop(jobs);
            if let Some(o) = observer.as_deref_mut() {
                o.observe(li, LinearSite::Output, &attn, qw);
            }
            if stop(li, LinearSite::Output) {
                return Ok(spans);
            }
            b.wo.forward(&attn, &segments, &mut tmp, h);
            self.all_reduce(&mut tmp);
            x.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);

            rms_norm(x, &b.ffn_norm, c.rms_norm_eps, &mut normed);
            match &b.ffn {
                Ffn::Dense(mlp) => match observer.as_deref_mut() {
                    Some(o) => {
                        o.observe(li, LinearSite::GateUp, &normed, h);
                        if stop(li, LinearSite::GateUp) {
                            return Ok(spans);
                        }
                        mlp.forward_with(&normed, &segments, &mut tmp, |act| o.observe(li, LinearSite::Down, act, act.len() / m));
                    }
                    None => mlp.forward(&normed, &segments, &mut tmp),
                },
                Ffn::Moe(moe) => moe.forward(&normed, &segments, &mut tmp),
            }
            if stop(li, LinearSite::Down) {
                return Ok(spans);
            }
            self.all_reduce(&mut tmp);
            x.iter_mut().zip(&tmp).for_each(|(a, b)| *a += b);
        }
        for (s, &(_, n, _)) in batch.iter_mut().zip(&spans) {
            s.kv.advance(n);
        }
        Ok(spans)
    }
}
