//! Dense Llama checkpoint -> mixture-of-experts Hugging Face directory (`tessera convert
//! upcycle-moe`): every MLP becomes `experts` copies of itself behind a random router, in the
//! config and tensor naming of Mixtral, Qwen2-MoE or DeepSeek-V3.
//!
//! With identical experts (`perturb` 0) the MoE computes the dense model's function: routed
//! weights are normalized, and where a family adds a shared expert the copies are scaled so
//! that the parts sum to one MLP exactly (powers of two, exact in every float type):
//!
//! - mixtral: `Σ wᵢ·MLP = MLP` (weights sum to 1);
//! - qwen-moe (`qwen2_moe`): routed down projections × ½, shared expert gate weights 0 so
//!   `sigmoid(0) = ½`: `½·MLP + ½·MLP`; layer 0 stays dense (`mlp_only_layers: [0]`); zero Q/K/V
//!   biases (Qwen2 attention has them);
//! - qwen3-moe (`qwen3_moe`): softmax top-k, renormalized; its per-head Q/K RMSNorms are
//!   written as ones, which are not the identity, so this family does *not* reproduce the dense
//!   model (it exists for tests of Qwen3-MoE attention and as a benchmark model);
//! - deepseek (`deepseek_v3`, GQA attention, MLA fields null): sigmoid scoring with a random
//!   correction bias, `n_group` groups of which `topk_group` are kept, `routed_scaling_factor`
//!   2, routed down × ¼, shared expert down × ½: `2·¼·MLP + ½·MLP`; layer 0 dense
//!   (`first_k_dense_replace: 1`).
//!
//! `perturb σ` adds `σ · rms(W) · N(0, 1)` noise to every expert copy (seeded per tensor), so
//! experts differ, as in a real MoE; the router is `N(0, 1/hidden)` either way.
//! [`random_dense`] makes a small random dense checkpoint to upcycle, for unit tests of each
//! family at small sizes.

use crate::checkpoint::{Architecture, Checkpoint, CheckpointFormat, ModelConfig, TensorBytes, TensorEntry};
use crate::convert::{dequantize, hf_config, write_hf_dir, ConvertError, ConvertOptions, ConvertSummary, OutTensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use tessera_kernels::ggml::GgmlType;

/// MoE family of the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeFamily {
    /// `mixtral` (`block_sparse_moe`, `w1`/`w3`/`w2`).
    Mixtral,
    /// `qwen2_moe` with a gated shared expert.
    QwenMoe,
    /// `qwen3_moe` (Q/K norms of ones: not function-preserving).
    Qwen3Moe,
    /// `deepseek_v3` routing (GQA attention) with a shared expert and a dense first layer.
    Deepseek,
}

/// Options of [`upcycle`].
#[derive(Clone, Debug)]
pub struct UpcycleOptions {
    /// Output family.
    pub family: MoeFamily,
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// DeepSeek expert groups (`n_group`) and groups kept per token (`topk_group`).
    pub groups: (usize, usize),
    /// Relative noise added to every expert copy (0: identical copies).
    pub perturb: f32,
    /// Seed of the router and the noise.
    pub seed: u64,
    /// Write experts as transformers 5's stacked tensors (`mlp.experts.gate_up_proj`
    /// `[E, 2·I, hidden]`, `mlp.experts.down_proj` `[E, hidden, I]`) instead of per expert.
    pub stacked: bool,
    /// Output float type and sharding.
    pub convert: ConvertOptions,
}

fn bad(msg: String) -> ConvertError {
    ConvertError::Tensor { name: "<options>".into(), msg }
}

/// Standard normal samples (Box-Muller).
fn normals(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u: f64 = 1.0 - rng.gen::<f64>();
            let v: f64 = rng.gen();
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
        })
        .collect()
}

/// A seed per output tensor, from the run's seed and the tensor's name (FNV-1a).
fn tensor_seed(seed: u64, name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325 ^ seed, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// `w · scale + σ · rms(w) · N(0, 1)`.
fn copy_expert(w: &[f32], scale: f32, sigma: f32, seed: u64) -> Vec<f32> {
    let mut out: Vec<f32> = w.iter().map(|v| v * scale).collect();
    if sigma > 0.0 {
        let rms = (w.iter().map(|v| (v * v) as f64).sum::<f64>() / w.len().max(1) as f64).sqrt() as f32;
        let noise = normals(&mut ChaCha8Rng::seed_from_u64(seed), w.len());
        out.iter_mut().zip(noise).for_each(|(o, z)| *o += sigma * rms * scale * z);
    }
    out
}

/// config.json of the MoE model.
fn moe_config(ck: &Checkpoint, o: &UpcycleOptions) -> Value {
    let c = &ck.config;
    let mut cfg = hf_config(ck, o.convert.dtype);
    let m = cfg.as_object_mut().expect("config is an object");
    let (arch, model_type) = match o.family {
        MoeFamily::Mixtral => ("MixtralForCausalLM", "mixtral"),
        MoeFamily::QwenMoe => ("Qwen2MoeForCausalLM", "qwen2_moe"),
        MoeFamily::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
        MoeFamily::Deepseek => ("DeepseekV3ForCausalLM", "deepseek_v3"),
    };
    m.insert("architectures".into(), json!([arch]));
    m.insert("model_type".into(), json!(model_type));
    m.insert("num_experts_per_tok".into(), json!(o.top_k));
    let extra = match o.family {
        MoeFamily::Mixtral => json!({
            "num_local_experts": o.experts,
            "router_aux_loss_coef": 0.0,
            "sliding_window": null,
        }),
        MoeFamily::QwenMoe => json!({
            "num_experts": o.experts,
            "moe_intermediate_size": c.intermediate_size,
            "shared_expert_intermediate_size": c.intermediate_size,
            "norm_topk_prob": true,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "use_sliding_window": false,
            "sliding_window": null,
        }),
        MoeFamily::Qwen3Moe => json!({
            "num_experts": o.experts,
            "moe_intermediate_size": c.intermediate_size,
            "norm_topk_prob": true,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": false,
            "sliding_window": null,
        }),
        MoeFamily::Deepseek => json!({
            "n_routed_experts": o.experts,
            "n_shared_experts": 1,
            "moe_intermediate_size": c.intermediate_size,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "n_group": o.groups.0,
            "topk_group": o.groups.1,
            "norm_topk_prob": true,
            "routed_scaling_factor": 2.0,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "kv_lora_rank": null,
            "q_lora_rank": null,
        }),
    };
    m.extend(extra.as_object().expect("object").clone());
    if o.family == MoeFamily::QwenMoe {
        m.remove("attention_bias");
    }
    cfg
}

/// Writes the upcycled MoE of the dense checkpoint `ck` to `output`.
pub fn upcycle(ck: &Checkpoint, output: &Path, o: &UpcycleOptions) -> Result<ConvertSummary, ConvertError> {
    let c = &ck.config;
    if c.moe.is_some() || c.arch != Architecture::Llama {
        return Err(bad(format!("the input is {:?}, not a dense Llama model", c.arch)));
    }
    let (groups, kept) = if o.family == MoeFamily::Deepseek { o.groups } else { (1, 1) };
    let routing = crate::checkpoint::routing::Routing {
        scoring: crate::checkpoint::routing::Scoring::Softmax,
        n_experts: o.experts,
        top_k: o.top_k,
        norm_topk: true,
        n_group: groups,
        topk_group: kept,
        scaling: 1.0,
    };
    routing.validate().map_err(|(k, m)| bad(format!("{k}: {m}")))?;
    if !(o.perturb.is_finite() && o.perturb >= 0.0) {
        return Err(bad(format!("perturb {} is not a finite non-negative number", o.perturb)));
    }
    let (h, ffn) = (c.hidden_size, c.intermediate_size);
    let dense_first = matches!(o.family, MoeFamily::QwenMoe | MoeFamily::Deepseek);
    let (routed_scale, shared_scale) = match o.family {
        MoeFamily::Mixtral | MoeFamily::Qwen3Moe => (1.0, None),
        MoeFamily::QwenMoe => (0.5, Some(1.0)),
        MoeFamily::Deepseek => (0.25, Some(0.5)),
    };
    let (moe_prefix, leaves) = match o.family {
        MoeFamily::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    };
    let shared_prefix = if o.family == MoeFamily::Deepseek { "mlp.shared_experts" } else { "mlp.shared_expert" };

    let mut out: Vec<OutTensor> = Vec::new();
    let dense = |canon: &str| -> Result<&TensorEntry, ConvertError> { Ok(ck.tensor(canon)?) };
    for (canon, t) in &ck.tensors {
        let is_mlp = ["ffn_gate", "ffn_up", "ffn_down"].iter().any(|k| canon.ends_with(&format!(".{k}.weight")));
        let layer0 = canon.starts_with("blk.0.");
        if is_mlp && !(dense_first && layer0) {
            continue;
        }
        let hf = crate::checkpoint::names::hf_name(canon).ok_or_else(|| bad(format!("{canon} has no Hugging Face name")))?;
        out.push(OutTensor { name: hf, shape: t.shape.clone(), values: Box::new(move || dequantize(canon, t)) });
    }
    for l in (dense_first as usize)..c.num_layers {
        let pre = format!("model.layers.{l}");
        let mlp = ["ffn_gate", "ffn_up", "ffn_down"].map(|k| format!("blk.{l}.{k}.weight"));
        let src = [dense(&mlp[0])?, dense(&mlp[1])?, dense(&mlp[2])?];
        let router = format!("{pre}.{moe_prefix}.gate.weight");
        let (seed, experts) = (o.seed, o.experts);
        out.push(OutTensor {
            shape: vec![experts, h],
            values: Box::new(move || Ok(normals(&mut ChaCha8Rng::seed_from_u64(tensor_seed(seed, &router)), experts * h).iter().map(|z| z / (h as f32).sqrt()).collect())),
            name: format!("{pre}.{moe_prefix}.gate.weight"),
        });
        if o.family == MoeFamily::Deepseek {
            let name = format!("{pre}.mlp.gate.e_score_correction_bias");
            let n2 = name.clone();
            out.push(OutTensor { name, shape: vec![experts], values: Box::new(move || Ok(normals(&mut ChaCha8Rng::seed_from_u64(tensor_seed(seed, &n2)), experts).iter().map(|z| 0.05 * z).collect())) });
        }
        let sigma = o.perturb;
        let scales = [1.0, 1.0, routed_scale];
        if o.stacked {
            let gu_name = format!("{pre}.mlp.experts.gate_up_proj");
            let (g, u) = (src[0], src[1]);
            let n = gu_name.clone();
            out.push(OutTensor {
                name: gu_name,
                shape: vec![experts, 2 * ffn, h],
                values: Box::new(move || {
                    let (gw, uw) = (dequantize(&n, g)?, dequantize(&n, u)?);
                    let mut v = Vec::with_capacity(experts * 2 * ffn * h);
                    for e in 0..experts {
                        v.extend(copy_expert(&gw, 1.0, sigma, tensor_seed(seed, &format!("{n}.{e}.gate"))));
                        v.extend(copy_expert(&uw, 1.0, sigma, tensor_seed(seed, &format!("{n}.{e}.up"))));
                    }
                    Ok(v)
                }),
            });
            let d = src[2];
            let n = format!("{pre}.mlp.experts.down_proj");
            let n2 = n.clone();
            out.push(OutTensor {
                name: n,
                shape: vec![experts, h, ffn],
                values: Box::new(move || {
                    let dw = dequantize(&n2, d)?;
                    Ok((0..experts).flat_map(|e| copy_expert(&dw, routed_scale, sigma, tensor_seed(seed, &format!("{n2}.{e}")))).collect())
                }),
            });
        } else {
            for e in 0..experts {
                for ((leaf, t), scale) in leaves.iter().zip(src).zip(scales) {
                    let name = format!("{pre}.{moe_prefix}.experts.{e}.{leaf}.weight");
                    let n = name.clone();
                    out.push(OutTensor { name, shape: t.shape.clone(), values: Box::new(move || Ok(copy_expert(&dequantize(&n, t)?, scale, sigma, tensor_seed(seed, &n)))) });
                }
            }
        }
        if let Some(s) = shared_scale {
            for ((leaf, t), scale) in ["gate_proj", "up_proj", "down_proj"].iter().zip(src).zip([1.0, 1.0, s]) {
                let name = format!("{pre}.{shared_prefix}.{leaf}.weight");
                let n = name.clone();
                out.push(OutTensor { name, shape: t.shape.clone(), values: Box::new(move || Ok(copy_expert(&dequantize(&n, t)?, scale, sigma, tensor_seed(seed, &n)))) });
            }
        }
        if o.family == MoeFamily::QwenMoe {
            out.push(OutTensor { name: format!("{pre}.mlp.shared_expert_gate.weight"), shape: vec![1, h], values: Box::new(move || Ok(vec![0.0; h])) });
        }
    }
    if o.family == MoeFamily::QwenMoe {
        let (qw, kw) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        for l in 0..c.num_layers {
            for (p, n) in [("q", qw), ("k", kw), ("v", kw)] {
                out.push(OutTensor { name: format!("model.layers.{l}.self_attn.{p}_proj.bias"), shape: vec![n], values: Box::new(move || Ok(vec![0.0; n])) });
            }
        }
    }
    if o.family == MoeFamily::Qwen3Moe {
        let hd = c.head_dim;
        for l in 0..c.num_layers {
            for p in ["q", "k"] {
                out.push(OutTensor { name: format!("model.layers.{l}.self_attn.{p}_norm.weight"), shape: vec![hd], values: Box::new(move || Ok(vec![1.0; hd])) });
            }
        }
    }
    write_hf_dir(ck, output, &o.convert, &moe_config(ck, o), out)
}

/// Sizes of a [`random_dense`] model.
#[derive(Clone, Copy, Debug)]
pub struct RandomDims {
    /// Hidden width.
    pub hidden: usize,
    /// MLP inner width.
    pub ffn: usize,
    /// Decoder blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
}

/// A dense Llama checkpoint with `like`'s tokenizer, vocabulary and special tokens and random
/// f32 weights of the given sizes (`N(0, 1/cols)` matrices, norms near 1), to upcycle into
/// small models of each MoE family for tests.
pub fn random_dense(like: &Checkpoint, dims: RandomDims, seed: u64) -> Checkpoint {
    let hd = dims.hidden / dims.heads;
    let config = ModelConfig {
        arch: Architecture::Llama,
        vocab_size: like.config.vocab_size,
        hidden_size: dims.hidden,
        intermediate_size: dims.ffn,
        num_layers: dims.layers,
        num_heads: dims.heads,
        num_kv_heads: dims.kv_heads,
        head_dim: hd,
        rope_theta: like.config.rope_theta,
        rms_norm_eps: like.config.rms_norm_eps,
        max_position_embeddings: like.config.max_position_embeddings,
        tie_word_embeddings: true,
        attn_bias: false,
        qk_norm: false,
        moe: None,
    };
    let mut tensors = BTreeMap::new();
    let mut add = |name: String, shape: Vec<usize>, values: Vec<f32>| {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let entry = TensorEntry { source_name: name.clone(), ty: GgmlType::F32, shape, data: TensorBytes::Owned(Arc::from(bytes)) };
        tensors.insert(name, entry);
    };
    let matrix = |name: &str, rows: usize, cols: usize| {
        let z = normals(&mut ChaCha8Rng::seed_from_u64(tensor_seed(seed, name)), rows * cols);
        z.iter().map(|v| v / (cols as f32).sqrt()).collect::<Vec<f32>>()
    };
    let norm = |name: &str, n: usize| normals(&mut ChaCha8Rng::seed_from_u64(tensor_seed(seed, name)), n).iter().map(|z| 1.0 + 0.1 * z).collect::<Vec<f32>>();
    let (h, v) = (dims.hidden, config.vocab_size);
    add("token_embd.weight".into(), vec![v, h], matrix("token_embd.weight", v, h).iter().map(|x| x * (h as f32).sqrt()).collect());
    add("output_norm.weight".into(), vec![h], norm("output_norm.weight", h));
    for l in 0..dims.layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        for (s, rows, cols) in [
            ("attn_q", dims.heads * hd, h),
            ("attn_k", dims.kv_heads * hd, h),
            ("attn_v", dims.kv_heads * hd, h),
            ("attn_output", h, dims.heads * hd),
            ("ffn_gate", dims.ffn, h),
            ("ffn_up", dims.ffn, h),
            ("ffn_down", h, dims.ffn),
        ] {
            add(n(s), vec![rows, cols], matrix(&n(s), rows, cols));
        }
        add(n("attn_norm"), vec![h], norm(&n("attn_norm"), h));
        add(n("ffn_norm"), vec![h], norm(&n("ffn_norm"), h));
    }
    Checkpoint {
        path: like.path.clone(),
        format: CheckpointFormat::HfDir,
        name: format!("random-{}x{}", dims.layers, dims.hidden),
        config,
        tensors,
        tokenizer: like.tokenizer.clone(),
        special: like.special.clone(),
    }
}
