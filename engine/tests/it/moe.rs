//! Mixture-of-experts models end to end.
//!
//! - Upcycled default model (identical experts): each family's MoE computes the dense model's
//!   function, so its logits equal the dense BF16 conversion's: routing, grouping, weighting,
//!   shared experts and the summation all have to be right for that to hold.
//! - Small random models of each family (experts differ, group-limited routing, shared experts,
//!   Q/K/V biases, Q/K norms, stacked expert tensors) against an f64 scalar forward pass written
//!   here from checkpoint-formats.md, with its own routing.
//! - Grouped execution equals the per-token loop; batching does not change a sequence's logits.

use crate::common;

use common::{default_model_path, max_rel_err};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tessera_engine::checkpoint::routing::Scoring;
use tessera_engine::checkpoint::{Checkpoint, MoeConfig};
use tessera_engine::convert::{dequantize, to_hf_dir, ConvertOptions};
use tessera_engine::float_dtype::FloatDtype;
use tessera_engine::kv_cache::LocalKv;
use tessera_engine::model::moe::MoeLayer;
use tessera_engine::model::{LlamaModel, SeqInput};
use tessera_engine::upcycle::{random_dense, upcycle, MoeFamily, RandomDims, UpcycleOptions};
use tessera_engine::weights::ModelWeights;
use tessera_engine::LoadedModel;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::linear::LinearPolicy;

fn tmp(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn options(family: MoeFamily, experts: usize, top_k: usize, perturb: f32, stacked: bool, dtype: FloatDtype) -> UpcycleOptions {
    UpcycleOptions { family, experts, top_k, groups: (4, 2), perturb, seed: 11, stacked, convert: ConvertOptions { dtype, max_shard_bytes: None } }
}

fn default_ckpt() -> &'static Checkpoint {
    static C: OnceLock<Checkpoint> = OnceLock::new();
    C.get_or_init(|| ModelWeights::open(&default_model_path()).unwrap().checkpoint)
}

fn logits(m: &LlamaModel, tokens: &[u32]) -> Vec<f32> {
    let mut kv = m.local_kv(256);
    m.forward(&mut [SeqInput { tokens, kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0)
}

const PROMPT: [u32; 12] = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 2491, 30, 12545];

/// Each upcycled family, experts identical, against the dense model converted to the same BF16
/// weights. The MoE output is `Σ wᵢ·MLP(x)` with `Σ wᵢ = 1` in f32 (plus exact power-of-two
/// shares for shared experts), so the only difference is f32 rounding of the weighted sum, a
/// few ulps per layer: bound 1e-4 of the logit spread (measured ~1e-6), and greedy tokens equal.
#[test]
fn upcycled_identical_experts_equal_the_dense_model() {
    let dense_dir = tmp("moe-dense-bf16");
    to_hf_dir(default_ckpt(), &dense_dir, &ConvertOptions { dtype: FloatDtype::BF16, max_shard_bytes: None }).unwrap();
    let dense = LoadedModel::load(&dense_dir, LinearPolicy::DEFAULT).unwrap();
    let want = logits(&dense.model, &PROMPT);
    let vocab = dense.model.config().vocab_size;
    for (family, experts, stacked) in [(MoeFamily::Mixtral, 4, false), (MoeFamily::QwenMoe, 4, false), (MoeFamily::Deepseek, 8, false), (MoeFamily::Deepseek, 8, true)] {
        let dir = tmp("moe-upcycled");
        upcycle(default_ckpt(), &dir, &options(family, experts, 2, 0.0, stacked, FloatDtype::BF16)).unwrap();
        let moe = LoadedModel::load(&dir, LinearPolicy::DEFAULT).unwrap();
        assert!(moe.model.config().moe.is_some());
        let got = logits(&moe.model, &PROMPT);
        let e = max_rel_err(&got, &want, vocab);
        eprintln!("{family:?} (stacked {stacked}): max |MoE - dense| / spread = {e:.2e}");
        assert!(e < 1e-4, "{family:?}: {e}");
        let argmax = |r: &[f32]| r.iter().enumerate().fold(0, |b, (i, &v)| if v > r[b] { i } else { b });
        for (g, w) in got.chunks(vocab).zip(want.chunks(vocab)) {
            assert_eq!(argmax(g), argmax(w));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A small random model of `family` (experts perturbed so they differ), written as f32.
fn random_moe(family: MoeFamily, stacked: bool) -> PathBuf {
    let dims = RandomDims { hidden: 64, ffn: 96, layers: 3, heads: 4, kv_heads: 2 };
    let dense = random_dense(default_ckpt(), dims, 5);
    let dir = tmp(&format!("moe-random-{family:?}-{stacked}"));
    upcycle(&dense, &dir, &options(family, 8, 2, 0.7, stacked, FloatDtype::F32)).unwrap();
    dir
}

/// f64 scalar reference forward pass over a checkpoint's tensors (canonical names).
struct Reference<'a> {
    ck: &'a ModelWeights,
}

impl Reference<'_> {
    /// A weight as f64: plain tensors dequantized from their storage type, checkpoint-quantized
    /// ones from their decoded matrix.
    fn t(&self, name: &str) -> Vec<f64> {
        if let Some(q) = self.ck.quantized.get(name) {
            assert!(q.perm.is_none());
            let (rows, cols) = (q.matrix.rows(), q.matrix.cols());
            let mut out = vec![0f32; rows * cols];
            for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                q.matrix.dequantize_row(r, row);
            }
            return out.into_iter().map(f64::from).collect();
        }
        dequantize(name, self.ck.checkpoint.tensor(name).unwrap()).unwrap().into_iter().map(f64::from).collect()
    }

    fn t_opt(&self, name: &str) -> Option<Vec<f64>> {
        (self.ck.checkpoint.tensors.contains_key(name) || self.ck.quantized.contains_key(name)).then(|| self.t(name))
    }

    fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
        w.chunks(x.len()).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
    }

    fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
        let s = (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
        x.iter().zip(w).map(|(v, w)| v / s * w).collect()
    }

    fn mlp(&self, names: [String; 3], x: &[f64]) -> Vec<f64> {
        let g = Self::matvec(&self.t(&names[0]), x);
        let u = Self::matvec(&self.t(&names[1]), x);
        let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        Self::matvec(&self.t(&names[2]), &a)
    }

    /// Routing straight from checkpoint-formats.md §1.2.
    fn route(moe: &MoeConfig, logits: &[f64], bias: Option<&[f64]>) -> Vec<(usize, f64)> {
        let r = &moe.routing;
        let n = r.n_experts;
        let s: Vec<f64> = match r.scoring {
            Scoring::Softmax => {
                let z: f64 = logits.iter().map(|l| l.exp()).sum();
                logits.iter().map(|l| l.exp() / z).collect()
            }
            Scoring::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
        };
        let c: Vec<f64> = (0..n).map(|e| s[e] + bias.map_or(0.0, |b| b[e])).collect();
        let size = n / r.n_group;
        let mut groups: Vec<(f64, usize)> = (0..r.n_group)
            .map(|g| {
                let mut v = c[g * size..(g + 1) * size].to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                (v.iter().take(2).sum(), g)
            })
            .collect();
        groups.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let kept: Vec<usize> = groups[..r.topk_group].iter().map(|g| g.1).collect();
        let mut cand: Vec<usize> = (0..n).filter(|e| kept.contains(&(e / size))).collect();
        cand.sort_by(|&a, &b| c[b].total_cmp(&c[a]).then(a.cmp(&b)));
        let chosen = &cand[..r.top_k];
        let sum: f64 = chosen.iter().map(|&e| s[e]).sum();
        let scale = if r.norm_topk { r.scaling as f64 / sum } else { r.scaling as f64 };
        chosen.iter().map(|&e| (e, s[e] * scale)).collect()
    }

    fn ffn(&self, l: usize, x: &[f64]) -> Vec<f64> {
        let c = &self.ck.checkpoint.config;
        let names = |kinds: [&str; 3]| kinds.map(|k| format!("blk.{l}.{k}.weight"));
        let Some(moe) = c.moe.as_ref().filter(|m| m.layers[l]) else { return self.mlp(names(["ffn_gate", "ffn_up", "ffn_down"]), x) };
        let logits = Self::matvec(&self.t(&format!("blk.{l}.ffn_gate_inp.weight")), x);
        let bias = self.t_opt(&format!("blk.{l}.exp_probs_b.bias"));
        let mut out = vec![0f64; x.len()];
        for (e, w) in Self::route(moe, &logits, bias.as_deref()) {
            let y = self.mlp(["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"].map(|k| format!("blk.{l}.{k}.{e}.weight")), x);
            out.iter_mut().zip(&y).for_each(|(o, y)| *o += w * y);
        }
        if moe.shared_ffn > 0 {
            let y = self.mlp(names(["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]), x);
            let g = match self.t_opt(&format!("blk.{l}.ffn_gate_inp_shexp.weight")) {
                Some(w) => 1.0 / (1.0 + (-Self::matvec(&w, x)[0]).exp()),
                None => 1.0,
            };
            out.iter_mut().zip(&y).for_each(|(o, y)| *o += g * y);
        }
        out
    }

    fn logits(&self, tokens: &[u32]) -> Vec<f64> {
        let c = &self.ck.checkpoint.config;
        let (h, hd, nh, nkv) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads);
        let eps = c.rms_norm_eps as f64;
        let embed = self.t("token_embd.weight");
        let mut xs: Vec<Vec<f64>> = tokens.iter().map(|&t| embed[t as usize * h..(t as usize + 1) * h].to_vec()).collect();
        let rope = |v: &mut [f64], pos: usize| {
            let half = hd / 2;
            for head in v.chunks_mut(hd) {
                for i in 0..half {
                    let a = pos as f64 * (c.rope_theta as f64).powf(-((2 * i) as f64) / hd as f64);
                    let (x0, x1) = (head[i], head[i + half]);
                    head[i] = x0 * a.cos() - x1 * a.sin();
                    head[i + half] = x0 * a.sin() + x1 * a.cos();
                }
            }
        };
        for l in 0..c.num_layers {
            let b = |s: &str| format!("blk.{l}.{s}");
            let (wq, wk, wv, wo) = (self.t(&b("attn_q.weight")), self.t(&b("attn_k.weight")), self.t(&b("attn_v.weight")), self.t(&b("attn_output.weight")));
            let biases = [b("attn_q.bias"), b("attn_k.bias"), b("attn_v.bias")].map(|n| self.t_opt(&n));
            let norms = [b("attn_q_norm.weight"), b("attn_k_norm.weight")].map(|n| self.t_opt(&n));
            let (mut qs, mut ks, mut vs) = (vec![], vec![], vec![]);
            for (pos, x) in xs.iter().enumerate() {
                let n = Self::rms(x, &self.t(&b("attn_norm.weight")), eps);
                let mut qkv = [Self::matvec(&wq, &n), Self::matvec(&wk, &n), Self::matvec(&wv, &n)];
                for (v, bias) in qkv.iter_mut().zip(&biases) {
                    if let Some(bias) = bias {
                        v.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
                    }
                }
                for (v, w) in qkv.iter_mut().zip(&norms) {
                    if let Some(w) = w {
                        for head in v.chunks_mut(hd) {
                            let normed = Self::rms(head, w, eps);
                            head.copy_from_slice(&normed);
                        }
                    }
                }
                let [mut q, mut k, v] = qkv;
                rope(&mut q, pos);
                rope(&mut k, pos);
                qs.push(q);
                ks.push(k);
                vs.push(v);
            }
            for (t, x) in xs.iter_mut().enumerate() {
                let mut attn = vec![0f64; nh * hd];
                for head in 0..nh {
                    let kvh = head / (nh / nkv);
                    let q = &qs[t][head * hd..(head + 1) * hd];
                    let scores: Vec<f64> = (0..=t).map(|p| q.iter().zip(&ks[p][kvh * hd..(kvh + 1) * hd]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()).collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                    for (p, s) in scores.iter().enumerate() {
                        let w = (s - max).exp() / z;
                        for i in 0..hd {
                            attn[head * hd + i] += w * vs[p][kvh * hd + i];
                        }
                    }
                }
                let o = Self::matvec(&wo, &attn);
                x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            }
            for x in xs.iter_mut() {
                let n = Self::rms(x, &self.t(&b("ffn_norm.weight")), eps);
                let y = self.ffn(l, &n);
                x.iter_mut().zip(&y).for_each(|(x, y)| *x += y);
            }
        }
        let head = self.t(if c.tie_word_embeddings { "token_embd.weight" } else { "output.weight" });
        let norm = self.t("output_norm.weight");
        xs.iter().flat_map(|x| Self::matvec(&head, &Self::rms(x, &norm, eps))).collect()
    }
}

/// Random models of every family (8 experts top-2; DeepSeek with 4 groups of which 2 are kept,
/// a correction bias and a shared expert; Qwen2 with biases and a gated shared expert; Qwen3
/// with Q/K norms; one stacked) against the f64 reference. Weights are f32, so the engine's f32
/// arithmetic differs from f64 by accumulated rounding: bound 1e-4 of the logit spread
/// (measured 2e-7). A routing mistake moves logits by a large fraction of the spread.
#[test]
fn random_models_of_every_family_match_the_scalar_reference() {
    for (family, stacked) in [(MoeFamily::Mixtral, false), (MoeFamily::QwenMoe, false), (MoeFamily::Qwen3Moe, true), (MoeFamily::Deepseek, false)] {
        let dir = random_moe(family, stacked);
        let ck = ModelWeights::open(&dir).unwrap();
        let model = LlamaModel::load(&ck, &CpuCaps::detect(), LinearPolicy::DEFAULT).unwrap();
        let got = logits(&model, &PROMPT[..7]);
        let want: Vec<f32> = Reference { ck: &ck }.logits(&PROMPT[..7]).into_iter().map(|v| v as f32).collect();
        let e = max_rel_err(&got, &want, ck.checkpoint.config.vocab_size);
        eprintln!("random {family:?} (stacked {stacked}): max |engine - f64 reference| / spread = {e:.2e}");
        assert!(e < 1e-4, "{family:?}: {e}");
    }
}

/// Tensor parallelism inside every expert (issue 24): random models of every family over two
/// ranks (each routed and shared expert's inner width split, routers and gates replicated)
/// against the same f64 reference, within the one-rank bound (1e-4 of the spread).
#[test]
fn moe_models_shard_inside_every_expert() {
    use tessera_engine::parallel::{Ranks, TpOptions};
    let caps = CpuCaps::detect();
    for family in [MoeFamily::Mixtral, MoeFamily::QwenMoe, MoeFamily::Qwen3Moe, MoeFamily::Deepseek] {
        let dir = random_moe(family, false);
        let ck = ModelWeights::open(&dir).unwrap();
        let (first, ranks) = Ranks::load(&ck, &caps, LinearPolicy::DEFAULT, &TpOptions { size: 2, cpu_bind: None }).unwrap();
        assert!(first.plan().iter().any(|e| e.tensor.contains("_exps.") && e.shard.as_deref() == Some("rows 0..48 of 96")), "{family:?}");
        let got = ranks.run(&first, |m| logits(m, &PROMPT[..7])).swap_remove(0);
        let want: Vec<f32> = Reference { ck: &ck }.logits(&PROMPT[..7]).into_iter().map(|v| v as f32).collect();
        let e = max_rel_err(&got, &want, ck.checkpoint.config.vocab_size);
        eprintln!("random {family:?} over 2 ranks: max |engine - f64 reference| / spread = {e:.2e}");
        assert!(e < 1e-4, "{family:?}: {e}");
    }
}

/// Grouped execution of one MoE layer equals the per-token loop over experts, on 40 tokens of
/// random activations. Both run the same f32 kernels; the grouped path may take the GEMM path
/// for groups where the loop takes the m = 1 path, which reorders f32 sums: bound 1e-5
/// relative to the output's largest magnitude.
#[test]
fn grouped_execution_equals_the_per_token_loop() {
    let dir = random_moe(MoeFamily::Deepseek, false);
    let ck = ModelWeights::open(&dir).unwrap();
    let c = &ck.checkpoint.config;
    let moe = c.moe.clone().unwrap();
    let layer = MoeLayer::load(&ck, 1, c, &moe, None, &CpuCaps::detect(), LinearPolicy::DEFAULT).unwrap();
    let h = c.hidden_size;
    let m = 40;
    let x: Vec<f32> = (0..m * h).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 1.3).collect();
    let (mut grouped, mut looped) = (vec![f32::NAN; m * h], vec![f32::NAN; m * h]);
    layer.forward(&x, &[m], &mut grouped);
    layer.forward_per_token(&x, &mut looped);
    let scale = looped.iter().fold(0f32, |a, v| a.max(v.abs()));
    let diff = grouped.iter().zip(&looped).fold(0f32, |a, (g, l)| a.max((g - l).abs()));
    eprintln!("grouped vs per-token: max diff {diff:.2e} (scale {scale:.2})");
    assert!(scale > 0.0 && diff <= 1e-5 * scale, "{diff} vs {scale}");
}

/// Three sequences run together give each exactly (bitwise) the logits it gets alone: routing
/// is per token and each sequence's rows are their own kernel segment inside every expert group.
#[test]
fn batching_does_not_change_moe_results() {
    let dir = random_moe(MoeFamily::QwenMoe, false);
    let model = LoadedModel::load(&dir, LinearPolicy::DEFAULT).unwrap().model;
    let seqs: [&[u32]; 3] = [&PROMPT[..9], &PROMPT[3..4], &PROMPT[2..12]];
    let alone: Vec<Vec<f32>> = seqs.iter().map(|s| logits(&model, s)).collect();
    let mut kvs: Vec<LocalKv> = (0..3).map(|_| model.local_kv(256)).collect();
    let mut batch: Vec<SeqInput> = seqs.iter().zip(kvs.iter_mut()).map(|(s, kv)| SeqInput { tokens: s, kv, logits_from: Some(0) }).collect();
    let together = model.forward(&mut batch).unwrap();
    assert_eq!(together, alone);
}

/// The seed's MoE-only quantization: `--experts-only` W4A8 (Quark) and W4A16 (compressed-tensors,
/// group 32) on random Mixtral (`w1`/`w3`/`w2` experts) and Qwen2-MoE (shared expert) models.
/// The plan must show every routed expert projection quantized and everything else (attention,
/// routers, shared experts, dense layers, head) in float, and the model must compute the f64
/// reference over the dequantized weights: W4A16 with f32 activations differs only by rounding
/// (bound 1e-4 of the spread, as for float models); where the CPU has AVX-512 BF16 the default
/// policy rounds W4A16 activations to bf16 (8 significant bits) at every expert projection
/// (bound 1%, measured 0.21% on Mixtral, 0.09% on Qwen2-MoE); W4A8 rounds them to int8 per token (bound 3% of the
/// spread, measured 1.1% and 0.4%). A wrongly decoded or misrouted expert moves logits by tens
/// of percent.
#[test]
fn experts_only_quantization_runs_as_planned() {
    use tessera_engine::quantize::{quantize_dir, Format, QuantizeOptions, Recipe, Scheme};
    for family in [MoeFamily::Mixtral, MoeFamily::QwenMoe] {
        let input = random_moe(family, false);
        let w4a16_bound = if tessera_kernels::cpu::caps::bf16_dot_available() { 1e-2 } else { 1e-4 };
        for (recipe, bound) in [(Recipe::resolve(Scheme::W4A8, Some(Format::Quark), None, false), 0.03), (Recipe::resolve(Scheme::W4A16, None, Some(32), false), w4a16_bound)] {
            let recipe = recipe.unwrap();
            let out = tmp(&format!("moe-quant-{family:?}"));
            quantize_dir(&QuantizeOptions { input: input.clone(), output: out.clone(), recipe, exclude: vec![], experts_only: true, calibrated: None, mse_observer: false, head: None, progress: Default::default() }).unwrap();
            let ck = ModelWeights::open(&out).unwrap();
            let model = LlamaModel::load(&ck, &CpuCaps::detect(), LinearPolicy::DEFAULT).unwrap();
            let plan = model.plan();
            let is_expert = |t: &str| t.contains("_exps.");
            assert_eq!(plan.iter().filter(|e| is_expert(&e.tensor)).count(), 2 * 8 * 3 + if family == MoeFamily::Mixtral { 8 * 3 } else { 0 });
            for e in &plan {
                assert_eq!(is_expert(&e.tensor), e.storage.starts_with("int4"), "{recipe:?}: {e:?}");
            }
            let want: Vec<f32> = Reference { ck: &ck }.logits(&PROMPT[..6]).into_iter().map(|v| v as f32).collect();
            let e = max_rel_err(&logits(&model, &PROMPT[..6]), &want, ck.checkpoint.config.vocab_size);
            eprintln!("{family:?} experts-only {recipe:?}: max |engine - f64 reference on dequantized weights| / spread = {e:.2e}");
            assert!(e < bound, "{family:?} {recipe:?}: {e}");
        }
    }
}

/// GGUF value bytes (type id, then payload) for the metadata the loader reads.
fn gguf_value(v: &tessera_engine::checkpoint::MetaValue, out: &mut Vec<u8>, with_type: bool) {
    use tessera_engine::checkpoint::MetaValue as M;
    let (ty, payload): (u32, Vec<u8>) = match v {
        M::U8(x) => (0, vec![*x]),
        M::I8(x) => (1, x.to_le_bytes().to_vec()),
        M::U16(x) => (2, x.to_le_bytes().to_vec()),
        M::I16(x) => (3, x.to_le_bytes().to_vec()),
        M::U32(x) => (4, x.to_le_bytes().to_vec()),
        M::I32(x) => (5, x.to_le_bytes().to_vec()),
        M::F32(x) => (6, x.to_le_bytes().to_vec()),
        M::Bool(x) => (7, vec![*x as u8]),
        M::String(s) => (8, [(s.len() as u64).to_le_bytes().to_vec(), s.as_bytes().to_vec()].concat()),
        M::Array(a) => {
            let mut p = Vec::new();
            let inner = a.first().map_or(Vec::new(), |f| {
                let mut b = Vec::new();
                gguf_value(f, &mut b, true);
                b
            });
            p.extend_from_slice(&inner[..4.min(inner.len())]);
            if inner.is_empty() {
                p.extend(8u32.to_le_bytes());
            }
            p.extend((a.len() as u64).to_le_bytes());
            for x in a {
                gguf_value(x, &mut p, false);
            }
            (9, p)
        }
        M::U64(x) => (10, x.to_le_bytes().to_vec()),
        M::I64(x) => (11, x.to_le_bytes().to_vec()),
        M::F64(x) => (12, x.to_le_bytes().to_vec()),
    };
    if with_type {
        out.extend(ty.to_le_bytes());
    }
    out.extend(payload);
}

/// llama.cpp's Q/K row order (interleaved RoPE pairs) from Hugging Face's: the inverse of the
/// loader's un-permutation.
fn permute_qk(w: &[f32], rows: usize, head_dim: usize) -> Vec<f32> {
    let cols = w.len() / rows;
    let half = head_dim / 2;
    let mut out = vec![0f32; w.len()];
    for r in 0..rows {
        let (h, i) = (r / head_dim, r % head_dim);
        let (j, p) = (i / 2, i % 2);
        let src = h * head_dim + p * half + j;
        out[r * cols..(r + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
    }
    out
}

/// A Mixtral-style GGUF (`llama` with `expert_count`, stacked `ffn_*_exps`, `ffn_gate_inp`),
/// written here from a random Mixtral HF model with the default model's tokenizer metadata,
/// loads and computes the same logits as the HF directory (same f32 numbers; Q/K rows stored
/// in llama.cpp's order and restored by the loader): bound 1e-6 of the spread, measured 0.
#[test]
fn mixtral_gguf_with_stacked_experts_runs_like_the_hf_model() {
    use tessera_engine::checkpoint::{GgufFile, MetaValue};
    let hf_dir = random_moe(MoeFamily::Mixtral, false);
    let hf = ModelWeights::open(&hf_dir).unwrap();
    let c = &hf.checkpoint.config;
    let moe = c.moe.as_ref().unwrap();
    let src = GgufFile::open(&default_model_path()).unwrap();
    let mut meta: Vec<(String, MetaValue)> = src.metadata.iter().filter(|(k, _)| k.starts_with("tokenizer.")).map(|(k, v)| (k.clone(), v.clone())).collect();
    for (k, v) in [
        ("general.architecture", MetaValue::String("llama".into())),
        ("llama.embedding_length", MetaValue::U32(c.hidden_size as u32)),
        ("llama.feed_forward_length", MetaValue::U32(moe.expert_ffn as u32)),
        ("llama.block_count", MetaValue::U32(c.num_layers as u32)),
        ("llama.attention.head_count", MetaValue::U32(c.num_heads as u32)),
        ("llama.attention.head_count_kv", MetaValue::U32(c.num_kv_heads as u32)),
        ("llama.rope.freq_base", MetaValue::F32(c.rope_theta)),
        ("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(c.rms_norm_eps)),
        ("llama.context_length", MetaValue::U32(c.max_position_embeddings as u32)),
        ("llama.expert_count", MetaValue::U32(moe.routing.n_experts as u32)),
        ("llama.expert_used_count", MetaValue::U32(moe.routing.top_k as u32)),
    ] {
        meta.push((k.into(), v));
    }
    // Tensors in GGUF form: experts stacked per layer and projection, Q/K permuted.
    let f = |name: &str| dequantize(name, hf.checkpoint.tensor(name).unwrap()).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for (name, t) in &hf.checkpoint.tensors {
        if name.contains("_exps.") {
            continue;
        }
        let mut v = f(name);
        if name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight") {
            v = permute_qk(&v, t.shape[0], c.head_dim);
        }
        tensors.push((name.clone(), t.shape.clone(), v));
    }
    for l in 0..c.num_layers {
        for kind in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
            let parts: Vec<Vec<f32>> = (0..moe.routing.n_experts).map(|e| f(&format!("blk.{l}.{kind}.{e}.weight"))).collect();
            let shape = hf.checkpoint.tensor(&format!("blk.{l}.{kind}.0.weight")).unwrap().shape.clone();
            tensors.push((format!("blk.{l}.{kind}.weight"), vec![moe.routing.n_experts, shape[0], shape[1]], parts.concat()));
        }
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in &meta {
        out.extend((k.len() as u64).to_le_bytes());
        out.extend(k.as_bytes());
        gguf_value(v, &mut out, true);
    }
    let mut offset = 0u64;
    for (name, shape, _) in &tensors {
        out.extend((name.len() as u64).to_le_bytes());
        out.extend(name.as_bytes());
        out.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            out.extend((*d as u64).to_le_bytes());
        }
        out.extend(0u32.to_le_bytes()); // F32
        out.extend(offset.to_le_bytes());
        offset += (shape.iter().product::<usize>() * 4).next_multiple_of(32) as u64;
    }
    out.resize(out.len().next_multiple_of(32), 0);
    for (_, _, v) in &tensors {
        out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        out.resize(out.len().next_multiple_of(32), 0);
    }
    let path = tmp("moe-mixtral.gguf");
    std::fs::write(&path, out).unwrap();

    let gguf = ModelWeights::open(&path).unwrap();
    assert_eq!(gguf.checkpoint.config.moe.as_ref().unwrap().routing, moe.routing);
    let caps = CpuCaps::detect();
    let a = LlamaModel::load(&gguf, &caps, LinearPolicy::DEFAULT).unwrap();
    let b = LlamaModel::load(&hf, &caps, LinearPolicy::DEFAULT).unwrap();
    let e = max_rel_err(&logits(&a, &PROMPT[..7]), &logits(&b, &PROMPT[..7]), c.vocab_size);
    eprintln!("Mixtral GGUF vs HF: max |diff| / spread = {e:.2e}");
    assert!(e <= 1e-6, "{e}");
}
