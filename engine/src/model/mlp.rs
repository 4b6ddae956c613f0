//! The gated SiLU MLP (`down(silu(gate(x)) * up(x))`): a dense layer's feed-forward, one routed
//! expert, or a shared expert.

use super::linear::{Linear, PlanEntry};
use super::shard::{inner_align, Cut, Shard};
use crate::checkpoint::LoadError;
use crate::weights::ModelWeights;
use tessera_kernels::cpu::scratch::with_f32;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::linear::LinearPolicy;
use tessera_kernels::ops::silu_mul;

/// Gate, up and down projections of inner width `ffn`.
#[derive(Debug)]
pub struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    /// Loads the three canonical weights `[gate, up, down]` for hidden width `hidden`, inner `ffn`.
    pub fn load(ck: &ModelWeights, names: [&str; 3], hidden: usize, ffn: usize, caps: &CpuCaps, policy: LinearPolicy) -> Result<Self, LoadError> {
        Self::load_shard(ck, names, hidden, ffn, None, caps, policy)
    }

    /// [`Self::load`], holding only `shard`'s part of the inner width when given: gate and up
    /// column-parallel, down row-parallel, the cut on down's column granularity (its output is
    /// a partial sum the caller all-reduces).
    pub fn load_shard(ck: &ModelWeights, names: [&str; 3], hidden: usize, ffn: usize, shard: Option<&Shard>, caps: &CpuCaps, policy: LinearPolicy) -> Result<Self, LoadError> {
        let (rows, cols) = match shard {
            Some(s) => {
                let inner = s.inner(names[2], ffn, inner_align(ck, names)?)?;
                (Cut::Rows(inner.clone()), Cut::Cols(inner))
            }
            None => (Cut::Whole, Cut::Whole),
        };
        Ok(Mlp {
            gate: Linear::load_cut(ck, names[0], ffn, hidden, rows.clone(), caps, policy)?,
            up: Linear::load_cut(ck, names[1], ffn, hidden, rows, caps, policy)?,
            down: Linear::load_cut(ck, names[2], hidden, ffn, cols, caps, policy)?,
        })
    }

    /// `out` (rows of `hidden`) = the MLP of the rows of `x`, which belong to sequences of
    /// `segments` rows (each picks its kernel path by its own length).
    pub fn forward(&self, x: &[f32], segments: &[usize], out: &mut [f32]) {
        self.forward_with(x, segments, out, |_| ());
    }

    /// [`Self::forward`], handing the down projection's input (`silu(gate) * up`, rows of
    /// the inner width, after down's online input transform if it has one) to `inner` first.
    pub fn forward_with(&self, x: &[f32], segments: &[usize], out: &mut [f32], mut inner: impl FnMut(&[f32])) {
        let (m, ffn, hidden) = (segments.iter().sum::<usize>(), self.gate.rows(), self.down.rows());
        // Reused buffers: at prefill these are tens of MiB per layer.
        with_f32(m * 2 * ffn, |gu| {
            with_f32(m * ffn, |act| {
                Linear::forward_fused(&[&self.gate, &self.up], x, segments, gu, 2 * ffn);
                silu_mul(gu, ffn, act);
                self.down.transform_input(act);
                inner(act);
                self.down.forward_transformed(act, segments, out, hidden);
            })
        });
    }

    /// Gate, up and down.
    pub fn linears(&self) -> [&Linear; 3] {
        [&self.gate, &self.up, &self.down]
    }

    /// Gate, up and down.
    pub fn linears_mut(&mut self) -> [&mut Linear; 3] {
        [&mut self.gate, &mut self.up, &mut self.down]
    }

    /// Plan entries of the three projections.
    pub fn plan(&self) -> [PlanEntry; 3] {
        [self.gate.plan(), self.up.plan(), self.down.plan()]
    }
}
