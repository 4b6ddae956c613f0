//! A mixture-of-experts feed-forward layer with grouped execution.
//!
//! All tokens of a batch are routed at once; their (token, expert) pairs are grouped by expert
//! (per-expert offsets into one gathered activation buffer, tokens in batch order within a
//! group, as fused-MoE kernels sort them), each active expert runs its gate/up and down
//! projections once over its whole group with the kernel the plan chose for it, and the
//! results are weighted and summed back per token in routing order. Experts run concurrently
//! on the kernel thread pool (each projection is itself parallel over output rows).
//!
//! Batching never changes a token's result: routing is per token, and within an expert's group
//! the rows of one sequence form their own kernel segment, exactly as if that sequence ran alone.

use super::linear::{Linear, PlanEntry};
use super::mlp::Mlp;
use crate::checkpoint::routing::Routing;
use super::shard::Shard;
use crate::checkpoint::{names, LoadError, ModelConfig, MoeConfig};
use crate::weights::ModelWeights;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::ggml::dequantize_row;
use tessera_kernels::linear::LinearPolicy;

/// One MoE layer: router, routed experts, optional shared expert (optionally gated).
#[derive(Debug)]
pub struct MoeLayer {
    routing: Routing,
    router: Linear,
    bias: Option<Vec<f32>>,
    experts: Vec<Mlp>,
    shared: Option<Mlp>,
    shared_gate: Option<Linear>,
}

/// A batch's routing grouped by expert.
struct Groups {
    /// Chosen experts per token (`top_k` each, routing order).
    ids: Vec<u32>,
    /// Their weights.
    weights: Vec<f32>,
    /// Row of each (token, slot) pair in the gathered buffer.
    slot_row: Vec<usize>,
    /// Per expert: first gathered row (`n_experts + 1` entries).
    offsets: Vec<usize>,
    /// Token of each gathered row.
    tokens: Vec<usize>,
}

impl MoeLayer {
    /// Loads layer `layer`'s MoE tensors (canonical names) for `cfg`; with `shard`, each routed
    /// and shared expert holds that rank's part of its inner width (tensor parallelism inside
    /// every expert: the router and gates are replicated, the output is a partial sum).
    pub fn load(ck: &ModelWeights, layer: usize, cfg: &ModelConfig, moe: &MoeConfig, shard: Option<&Shard>, caps: &CpuCaps, policy: LinearPolicy) -> Result<Self, LoadError> {
        let h = cfg.hidden_size;
        let n = moe.routing.n_experts;
        let blk = |s: &str| format!("blk.{layer}.{s}");
        let router = Linear::load(ck, &blk("ffn_gate_inp.weight"), n, h, caps, policy)?;
        let bias = if moe.correction_bias {
            let t = ck.checkpoint.tensor(&blk("exp_probs_b.bias"))?;
            if t.shape != [n] || !t.ty.is_float() {
                return Err(LoadError::Tensor { name: t.source_name.clone(), msg: format!("{} {:?}, expected a float vector of {n}", t.ty, t.shape) });
            }
            let mut b = vec![0f32; n];
            dequantize_row(t.ty, t.data.bytes(), &mut b);
            Some(b)
        } else {
            None
        };
        let shard = shard.map(Shard::evenly);
        let shard = shard.as_ref();
        let experts = (0..n)
            .map(|e| {
                let names = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"].map(|k| names::expert_name(layer, k, e));
                Mlp::load_shard(ck, [&names[0], &names[1], &names[2]], h, moe.expert_ffn, shard, caps, policy)
            })
            .collect::<Result<_, _>>()?;
        let shared = match moe.shared_ffn {
            0 => None,
            ffn => {
                let names = ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"].map(|k| blk(&format!("{k}.weight")));
                Some(Mlp::load_shard(ck, [&names[0], &names[1], &names[2]], h, ffn, shard, caps, policy)?)
            }
        };
        let shared_gate = match (&shared, moe.shared_gate) {
            (Some(_), true) => Some(Linear::load(ck, &blk("ffn_gate_inp_shexp.weight"), 1, h, caps, policy)?),
            _ => None,
        };
        Ok(MoeLayer { routing: moe.routing.clone(), router, bias, experts, shared, shared_gate })
    }

    /// Routes the rows of `x` (hidden width each) and groups them by expert.
    fn route(&self, x: &[f32], segments: &[usize]) -> Groups {
        let (m, n, k) = (segments.iter().sum::<usize>(), self.routing.n_experts, self.routing.top_k);
        let mut logits = vec![0f32; m * n];
        self.router.forward(x, segments, &mut logits, n);
        let mut ids = vec![0u32; m * k];
        let mut weights = vec![0f32; m * k];
        for ((l, i), w) in logits.chunks_exact(n).zip(ids.chunks_exact_mut(k)).zip(weights.chunks_exact_mut(k)) {
            self.routing.route(l, self.bias.as_deref(), i, w);
        }
        let mut offsets = vec![0usize; n + 1];
        for &e in &ids {
            offsets[e as usize + 1] += 1;
        }
        for e in 0..n {
            offsets[e + 1] += offsets[e];
        }
        let mut fill = offsets.clone();
        let mut slot_row = vec![0usize; m * k];
        let mut tokens = vec![0usize; m * k];
        for (p, &e) in ids.iter().enumerate() {
            let r = fill[e as usize];
            fill[e as usize] += 1;
            slot_row[p] = r;
            tokens[r] = p / k;
        }
        Groups { ids, weights, slot_row, offsets, tokens }
    }

    /// `out` (rows of hidden width) = the layer's output for the rows of `x`, which belong to
    /// sequences of `segments` rows.
    pub fn forward(&self, x: &[f32], segments: &[usize], out: &mut [f32]) {
        let h = self.router.cols();
        let m: usize = segments.iter().sum();
        let g = self.route(x, segments);
        // Sequence of each token, to cut each expert's group into per-sequence kernel segments.
        let seq_of: Vec<usize> = segments.iter().enumerate().flat_map(|(s, &n)| std::iter::repeat_n(s, n)).collect();
        let rows = g.tokens.len();
        let mut xg = vec![0f32; rows * h];
        for (dst, &t) in xg.chunks_exact_mut(h).zip(&g.tokens) {
            dst.copy_from_slice(&x[t * h..(t + 1) * h]);
        }
        let mut yg = vec![0f32; rows * h];
        let mut shared_out = vec![0f32; if self.shared.is_some() { m * h } else { 0 }];
        // Experts one after another, each projection a parallel region of its own: with few
        // rows per expert (decode) a task per expert would leave threads idle.
        let mut rest = &mut yg[..];
        for (e, w) in g.offsets.windows(2).enumerate() {
            let (y, tail) = rest.split_at_mut((w[1] - w[0]) * h);
            rest = tail;
            if w[1] > w[0] {
                let segs = runs(&g.tokens[w[0]..w[1]], &seq_of);
                self.experts[e].forward(&xg[w[0] * h..w[1] * h], &segs, y);
            }
        }
        if let Some(s) = &self.shared {
            s.forward(x, segments, &mut shared_out);
        }
        let k = self.routing.top_k;
        for (t, o) in out.chunks_exact_mut(h).enumerate() {
            o.fill(0.0);
            for p in t * k..(t + 1) * k {
                let w = g.weights[p];
                let r = g.slot_row[p];
                o.iter_mut().zip(&yg[r * h..(r + 1) * h]).for_each(|(o, y)| *o += w * y);
            }
        }
        if self.shared.is_some() {
            self.add_shared(x, segments, &shared_out, out);
        }
    }

    /// Adds the shared expert's output (gated by `sigmoid(gate · x)` where the layer has one).
    fn add_shared(&self, x: &[f32], segments: &[usize], shared_out: &[f32], out: &mut [f32]) {
        let h = self.router.cols();
        let m: usize = segments.iter().sum();
        let mut gate = vec![1f32; m];
        if let Some(gl) = &self.shared_gate {
            gl.forward(x, segments, &mut gate, 1);
            gate.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp()));
        }
        for ((o, s), g) in out.chunks_exact_mut(h).zip(shared_out.chunks_exact(h)).zip(&gate) {
            o.iter_mut().zip(s).for_each(|(o, s)| *o += g * s);
        }
    }

    /// The same output computed token by token, each chosen expert run on one row at a time
    /// (the baseline grouped execution is measured against; results agree within the kernels'
    /// small-batch versus large-batch rounding).
    pub fn forward_per_token(&self, x: &[f32], out: &mut [f32]) {
        let h = self.router.cols();
        let m = x.len() / h;
        let segments = vec![1; m];
        let g = self.route(x, &segments);
        let mut shared_out = vec![0f32; if self.shared.is_some() { m * h } else { 0 }];
        if let Some(s) = &self.shared {
            s.forward(x, &segments, &mut shared_out);
        }
        let k = self.routing.top_k;
        let mut y = vec![0f32; h];
        for (t, o) in out.chunks_exact_mut(h).enumerate() {
            o.fill(0.0);
            for p in t * k..(t + 1) * k {
                self.experts[g.ids[p] as usize].forward(&x[t * h..(t + 1) * h], &[1], &mut y);
                o.iter_mut().zip(&y).for_each(|(o, y)| *o += g.weights[p] * y);
            }
        }
        if self.shared.is_some() {
            self.add_shared(x, &segments, &shared_out, out);
        }
    }

    /// Plan entries: router, every expert's projections, shared expert and its gate.
    pub fn plan(&self) -> Vec<PlanEntry> {
        let mut out = vec![self.router.plan()];
        out.extend(self.experts.iter().flat_map(Mlp::plan));
        out.extend(self.shared.iter().flat_map(Mlp::plan));
        out.extend(self.shared_gate.iter().map(Linear::plan));
        out
    }
}

/// Lengths of the runs of consecutive rows from the same sequence.
fn runs(tokens: &[usize], seq_of: &[usize]) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    let mut last = usize::MAX;
    for &t in tokens {
        let s = seq_of[t];
        match out.last_mut() {
            Some(n) if s == last => *n += 1,
            _ => out.push(1),
        }
        last = s;
    }
    out
}
