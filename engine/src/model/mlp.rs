//! The gated SiLU MLP (`down(silu(gate(x)) * up(x))`): a dense layer's feed-forward, one routed
//! expert, or a shared expert.

use super::linear::{Linear, PlanEntry};
use crate::checkpoint::{Checkpoint, LoadError};
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
    pub fn load(ck: &Checkpoint, names: [&str; 3], hidden: usize, ffn: usize, caps: &CpuCaps, policy: LinearPolicy) -> Result<Self, LoadError> {
        Ok(Mlp {
            gate: Linear::load(ck, names[0], ffn, hidden, caps, policy)?,
            up: Linear::load(ck, names[1], ffn, hidden, caps, policy)?,
            down: Linear::load(ck, names[2], hidden, ffn, caps, policy)?,
        })
    }

    /// `out` (rows of `hidden`) = the MLP of the rows of `x`, which belong to sequences of
    /// `segments` rows (each picks its kernel path by its own length).
    pub fn forward(&self, x: &[f32], segments: &[usize], out: &mut [f32]) {
        self.forward_with(x, segments, out, |_| ());
    }

    /// [`Self::forward`], handing the down projection's input (`silu(gate) * up`, rows of
    /// the inner width) to `inner` first.
    pub fn forward_with(&self, x: &[f32], segments: &[usize], out: &mut [f32], mut inner: impl FnMut(&[f32])) {
        let (m, ffn, hidden) = (segments.iter().sum::<usize>(), self.gate.rows(), self.down.rows());
        let mut gu = vec![0f32; m * 2 * ffn];
        let mut act = vec![0f32; m * ffn];
        Linear::forward_fused(&[&self.gate, &self.up], x, segments, &mut gu, 2 * ffn);
        silu_mul(&gu, ffn, &mut act);
        inner(&act);
        self.down.forward(&act, segments, out, hidden);
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
