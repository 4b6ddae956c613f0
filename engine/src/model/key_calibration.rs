//! Key calibration for the compressed key formats, measured once at load with one forward
//! pass over a built-in text: each layer's mean post-RoPE key (subtracted from every key
//! before it is encoded) and, for the formats that spread a key's error over its channels,
//! per-channel balancing scales ([`KvLayout::set_key_transform`] says why attention is
//! unchanged by either).
//!
//! Balancing: a codec whose error is spread evenly over a head's channels (TQ3_0's WHT, QJL's
//! projection) makes an error of about `ε·‖k/s‖` per channel when keys are stored divided by
//! `s`, and the score's error is then `Σ qᵢ·sᵢ·eᵢ`, of variance about
//! `ε²·(Σ aᵢ·sᵢ²)·(Σ bᵢ/sᵢ²)/d` for `aᵢ = E[qᵢ²]`, `bᵢ = Var[kᵢ]`. By Cauchy-Schwarz that is
//! least at `sᵢ = (bᵢ/aᵢ)^¼`, where it falls by `(Σa)(Σb)/(Σ√(ab))²`: 1.1x to 2.5x per head
//! in SmolLM2 (mean 1.7x, from the corpus' own statistics), whose queries and keys put their
//! energy in different channels. The statistics here come from a calibration text, not the
//! one served, and a smaller exponent ([`BALANCE_EXPONENT`]) does better.

use super::{ActivationObserver, ForwardError, LinearSite, LlamaModel, SeqInput};
use crate::kv_cache::{KeyTransform, KvLayout};

/// The calibration text (`key_calibration.txt`, about 1,060 tokens): mostly prose and
/// dialogue (narrative, a letter, exposition, news), with a little chat, Q&A, numbers and code,
/// written for the project and not taken from any text its quality is measured on. The
/// statistics need length as well as variety: on two texts other than the corpus
/// (`scripts/heldout-texts.sh`, on which the constants here were then chosen;
/// ctx 1024, 12 windows), tq3_0 lost +10.5% (Persuasion) and +11.3% (license texts) against
/// bf16 when calibrated on the ~330 tokens of this text's first version, and +6.6% and +6.8%
/// on this one (with [`BALANCE_EXPONENT`] ³⁄₁₆).
pub const CALIBRATION_TEXT: &str = include_str!("key_calibration.txt");

/// Passes of [`CALIBRATION_TEXT`], one after another in one sequence, that calibrate keys
/// which are only centered (HQMQ), so that the mean covers positions 0 to about 2,100 rather
/// than 0 to 1,060: the slowest RoPE pairs barely turn within one pass, so their post-RoPE
/// mean depends on the positions seen. hqmq-s96-r4 at ctx 1024 on Persuasion: one pass 33.90,
/// two 33.62 (bf16 31.78). Balanced keys (tq3_0, qjl1) take one pass: second moments over a
/// pass in which the model copies its previous one are skewed (with three passes of the
/// text's first version, a passphrase 4k tokens back was missed at three corpus offsets out of
/// three, and found at all three with one).
pub const CENTERING_PASSES: usize = 2;

/// Per layer, running sums of the keys, their squares and the squared queries of each KV
/// head's group, channel by channel.
struct AttentionSums {
    /// Query heads per KV head.
    group: usize,
    head_dim: usize,
    /// Per layer: Σk, Σk², Σq² over the group's heads (each `n_kv_heads * head_dim`), rows.
    layers: Vec<([Vec<f64>; 3], usize)>,
}

impl ActivationObserver for AttentionSums {
    fn observe(&mut self, _: usize, _: LinearSite, _: &[f32], _: usize) {}

    fn observe_attention(&mut self, layer: usize, q: &[f32], k: &[f32]) {
        let ([ks, kk, qq], rows) = &mut self.layers[layer];
        let kw = ks.len();
        let hd = self.head_dim;
        for (krow, qrow) in k.chunks_exact(kw).zip(q.chunks_exact(kw * self.group)) {
            for (i, &x) in krow.iter().enumerate() {
                ks[i] += f64::from(x);
                kk[i] += f64::from(x) * f64::from(x);
            }
            for (j, &x) in qrow.iter().enumerate() {
                // Query head j / hd belongs to KV head j / hd / group.
                qq[(j / hd / self.group) * hd + j % hd] += f64::from(x) * f64::from(x);
            }
            *rows += 1;
        }
    }
}

/// The exponent of the balancing scales `(b/a)^e`. The optimum for statistics of the served
/// text is ¼; statistics from a calibration text are a less certain guide, and a smaller
/// exponent trusts them less. TQ3_0 PPL at ctx 1024 on held-out text (Persuasion / license
/// texts, bf16 31.78 / 15.13): ⅛ 34.11 / 16.56, ³⁄₁₆ 33.87 / 16.15, ¼ 34.06 on Persuasion.
/// ⅛ had been chosen with the ~330-token first version of the calibration text.
const BALANCE_EXPONENT: f64 = 0.1875;

/// Floor of a channel's statistic, relative to its head's mean: keeps a channel that never
/// varied in the calibration text from getting an extreme scale.
const STAT_FLOOR: f64 = 1e-3;

/// The balancing scales of one head from its channels' query power `a` and key variance `b`:
/// `(b/a)^e` ([`BALANCE_EXPONENT`]), each statistic floored at [`STAT_FLOOR`] of its head
/// mean, normalised to a geometric mean of 1 (keys keep their overall size).
fn balance(a: &[f64], b: &[f64]) -> Vec<f32> {
    let floor = |v: &[f64]| STAT_FLOOR * v.iter().sum::<f64>() / v.len() as f64;
    let (fa, fb) = (floor(a).max(f64::MIN_POSITIVE), floor(b).max(f64::MIN_POSITIVE));
    let s: Vec<f64> = a.iter().zip(b).map(|(&a, &b)| (b.max(fb) / a.max(fa)).powf(BALANCE_EXPONENT)).collect();
    let log_mean = s.iter().map(|x| x.ln()).sum::<f64>() / s.len() as f64;
    s.iter().map(|x| (x / log_mean.exp()) as f32).collect()
}

impl AttentionSums {
    /// Empty sums for `layers` layers of `n_kv_heads` heads of `head_dim`, `group` query heads
    /// per KV head.
    fn new(layers: usize, n_kv_heads: usize, head_dim: usize, group: usize) -> Self {
        AttentionSums { group, head_dim, layers: vec![(std::array::from_fn(|_| vec![0.0; n_kv_heads * head_dim]), 0); layers] }
    }

    /// The centers (the keys' means) and, when `balanced`, the balancing scales.
    fn transform(&self, balanced: bool) -> KeyTransform {
        let hd = self.head_dim;
        let mut centers = Vec::with_capacity(self.layers.len());
        let mut scales = Vec::with_capacity(self.layers.len());
        for ([ks, kk, qq], rows) in &self.layers {
            let n = (*rows).max(1) as f64;
            let mean: Vec<f64> = ks.iter().map(|s| s / n).collect();
            let var: Vec<f64> = kk.iter().zip(&mean).map(|(s, m)| (s / n - m * m).max(0.0)).collect();
            let power: Vec<f64> = qq.iter().map(|s| s / (n * self.group as f64)).collect();
            centers.push(mean.iter().map(|&m| m as f32).collect());
            scales.push(var.chunks_exact(hd).zip(power.chunks_exact(hd)).flat_map(|(b, a)| balance(a, b)).collect());
        }
        KeyTransform { centers, scales: balanced.then_some(scales) }
    }
}

/// Measures the key transform of `layout`'s key format (centers always, scales when
/// [`KvLayout::wants_key_balance`]) over one forward pass of `tokens` with an f32 cache.
pub fn measure(model: &LlamaModel, layout: &KvLayout, tokens: &[u32]) -> Result<KeyTransform, ForwardError> {
    // A tensor-parallel rank measures its own heads.
    let shape = model.attn_shape();
    let mut sums = AttentionSums::new(model.config().num_layers, shape.n_kv_heads, shape.head_dim, shape.n_heads / shape.n_kv_heads);
    let mut kv = model.local_kv(tokens.len());
    model.forward_observed(&mut [SeqInput { tokens, kv: &mut kv, logits_from: None }], &mut sums)?;
    Ok(sums.transform(layout.wants_key_balance()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_follow_the_query_groups() {
        // 2 KV heads of 2 channels, 2 query heads each; two tokens.
        let mut sums = AttentionSums::new(1, 2, 2, 2);
        let k = [1.0, 2.0, 3.0, 4.0, 3.0, 2.0, 1.0, 0.0];
        // Query heads 0 and 1 belong to KV head 0, heads 2 and 3 to KV head 1.
        let q = [1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 2.0, 1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 2.0];
        sums.observe_attention(0, &q, &k);
        let t = sums.transform(true);
        assert_eq!(t.centers, vec![vec![2.0, 2.0, 2.0, 2.0]]);
        // Key variances [1, 0, 1, 4] (channel 1 floored at 1e-3 of its head's mean 0.5);
        // query powers [1, 0, 0, 4] (KV head 0's channel 1 and head 1's channel 0 floored at
        // 1e-3 of 0.5 and of 2).
        let e = BALANCE_EXPONENT;
        let raw = [(1.0f64 / 1.0).powf(e), (5e-4f64 / 5e-4).powf(e), (1.0f64 / 2e-3).powf(e), (4.0f64 / 4.0).powf(e)];
        let heads = [[raw[0], raw[1]], [raw[2], raw[3]]];
        let want: Vec<f32> = heads.iter().flat_map(|h| h.map(|x| (x / (h[0] * h[1]).sqrt()) as f32)).collect();
        let got = &t.scales.unwrap()[0];
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
        }
        assert!(sums.transform(false).scales.is_none());
    }

    #[test]
    fn balance_is_a_root_of_the_variance_over_the_query_power() {
        let a = [16.0, 1.0, 1.0 / 16.0, 1.0];
        let b = [1.0, 1.0, 16.0, 256.0];
        let s = balance(&a, &b);
        // b/a = [2^-4, 1, 2^8, 2^8], so (b/a)^e = [2^-4e, 1, 2^8e, 2^8e], geometric mean 2^3e.
        let e = BALANCE_EXPONENT;
        let want = [2f64.powf(-4.0 * e), 1.0, 2f64.powf(8.0 * e), 2f64.powf(8.0 * e)].map(|x| x / 2f64.powf(3.0 * e));
        for (g, w) in s.iter().zip(want) {
            assert!((f64::from(*g) - w).abs() < 1e-6, "{s:?} vs {want:?}");
        }
        // A channel that never varied (or never met a query) is floored, not sent to 0 or ∞.
        let s = balance(&[1.0, 1.0, 0.0], &[1.0, 0.0, 1.0]);
        assert!(s.iter().all(|x| x.is_finite() && *x > 0.0 && *x < 20.0), "{s:?}");
    }
}
