//! Activation functions.

/// SwiGLU over rows of `[gate | up]` (each `2 * n` wide): `out[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate_up: &[f32], n: usize, out: &mut [f32]) {
    assert_eq!(gate_up.len(), 2 * out.len());
    for (gu, o) in gate_up.chunks_exact(2 * n).zip(out.chunks_exact_mut(n)) {
        let (g, u) = gu.split_at(n);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
}
