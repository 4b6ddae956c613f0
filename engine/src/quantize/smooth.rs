//! SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before
//! quantizing, with a per-channel factor `s` that leaves the model's function unchanged.
//!
//! For each linear site of a dense block, the input `x` is divided channel-wise by `s` where it
//! is produced and the weights reading it are multiplied column-wise by `s`:
//!
//! | site | `x / s` folded into | columns `· s` |
//! | --- | --- | --- |
//! | Q, K, V input | `input_layernorm.weight` | `q_proj`, `k_proj`, `v_proj` |
//! | O input (attention output) | rows (and bias) of `v_proj` (attention is linear in V) | `o_proj` |
//! | gate, up input | `post_attention_layernorm.weight` | `gate_proj`, `up_proj` |
//! | down input (`silu(gate) · up`) | rows of `up_proj` | `down_proj` |
//!
//! `s_j = max|x_j|^α / max|W_:,j|^(1−α)` (the weights' maximum over every layer reading channel
//! `j`), as in the paper and llm-compressor, clamped to `[1e-4, 1e4]`; channels with no
//! activation or weight get 1. The function is unchanged in exact arithmetic with a
//! full-precision KV cache; a quantized V cache stores `V / s` and rounds it differently. With
//! grouped-query attention a V channel serves several query heads' O columns, so the O site's
//! factor is computed per V channel from the maxima over its heads.

use super::calibrate::Calibration;
use crate::model::LinearSite;
use std::collections::BTreeMap;

/// How one tensor is rewritten: its rows (or a vector's elements) divided, its columns multiplied.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rescale {
    /// Divisors of the rows (vectors: of the elements).
    pub rows: Option<Vec<f32>>,
    /// Factors of the columns.
    pub cols: Option<Vec<f32>>,
}

impl Rescale {
    /// Undoes [`Self::apply`] (rows multiplied, columns divided).
    pub fn undo(&self, w: &mut [f32], cols: usize) {
        for (r, row) in w.chunks_exact_mut(cols).enumerate() {
            if let Some(d) = &self.rows {
                row.iter_mut().for_each(|x| *x *= d[r]);
            }
            if let Some(f) = &self.cols {
                row.iter_mut().zip(f).for_each(|(x, s)| *x /= s);
            }
        }
    }

    /// Applies the rescale to `w` (`[rows, cols]` row-major, or a vector when `cols` is 1).
    pub fn apply(&self, w: &mut [f32], cols: usize) {
        for (r, row) in w.chunks_exact_mut(cols).enumerate() {
            if let Some(d) = &self.rows {
                row.iter_mut().for_each(|x| *x /= d[r]);
            }
            if let Some(f) = &self.cols {
                row.iter_mut().zip(f).for_each(|(x, s)| *x *= s);
            }
        }
    }
}

/// The block and site whose input Hugging Face Llama module `module` reads
/// (`model.layers.I.self_attn.q_proj` → `(I, Qkv)`).
pub fn module_site(module: &str) -> Option<(usize, LinearSite)> {
    let rest = module.strip_prefix("model.layers.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let site = match leaf {
        "self_attn.q_proj" | "self_attn.k_proj" | "self_attn.v_proj" => LinearSite::Qkv,
        "self_attn.o_proj" => LinearSite::Output,
        "mlp.gate_proj" | "mlp.up_proj" => LinearSite::GateUp,
        "mlp.down_proj" => LinearSite::Down,
        _ => return None,
    };
    Some((layer.parse().ok()?, site))
}

/// The smoothing factors of every calibrated site and the tensor rewrites they imply.
#[derive(Clone, Debug, Default)]
pub struct Smoothing {
    factors: BTreeMap<(usize, LinearSite), Vec<f32>>,
    edits: BTreeMap<String, Rescale>,
}

/// `max|x|^α / max|w|^(1−α)`, 1 where either maximum is 0.
fn factor(act: f32, weight: f32, alpha: f32) -> f32 {
    if act > 0.0 && weight > 0.0 {
        (act.powf(alpha) / weight.powf(1.0 - alpha)).clamp(1e-4, 1e4)
    } else {
        1.0
    }
}

impl Smoothing {
    /// Factors with migration strength `alpha` for every site of `cal`; `col_absmax(name)` is
    /// the per-column `max |w|` of weight tensor `name`; `heads` is (query heads, KV heads).
    pub fn new(cal: &Calibration, alpha: f32, heads: (usize, usize), col_absmax: impl Fn(&str) -> Option<Vec<f32>>) -> Result<Self, String> {
        let mut out = Smoothing::default();
        for (&(layer, site), stats) in &cal.sites {
            let p = format!("model.layers.{layer}");
            let (prev, balance): (&str, &[&str]) = match site {
                LinearSite::Qkv => ("input_layernorm", &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                LinearSite::Output => ("self_attn.v_proj", &["self_attn.o_proj"]),
                LinearSite::GateUp => ("post_attention_layernorm", &["mlp.gate_proj", "mlp.up_proj"]),
                LinearSite::Down => ("mlp.up_proj", &["mlp.down_proj"]),
            };
            let width = stats.absmax.len();
            let mut wmax = vec![0f32; width];
            for b in balance {
                let name = format!("{p}.{b}.weight");
                let m = col_absmax(&name).ok_or_else(|| format!("{name}: not found (smoothing needs every layer reading a site)"))?;
                if m.len() != width {
                    return Err(format!("{name}: {} columns, its calibrated input is {width} wide", m.len()));
                }
                wmax.iter_mut().zip(&m).for_each(|(a, b)| *a = a.max(*b));
            }
            let (s_prev, s_cols) = if site == LinearSite::Output {
                // One factor per V channel, shared by the O columns of its query heads.
                let (nh, nkv) = heads;
                let hd = width / nh;
                let group = nh / nkv;
                let v: Vec<f32> = (0..nkv * hd)
                    .map(|kc| {
                        let (kvh, d) = (kc / hd, kc % hd);
                        let cols = (kvh * group..(kvh + 1) * group).map(|h| h * hd + d);
                        let (a, w) = cols.fold((0f32, 0f32), |(a, w), c| (a.max(stats.absmax[c]), w.max(wmax[c])));
                        factor(a, w, alpha)
                    })
                    .collect();
                let cols = (0..width).map(|c| v[(c / hd / group) * hd + c % hd]).collect();
                (v, cols)
            } else {
                let s: Vec<f32> = stats.absmax.iter().zip(&wmax).map(|(&a, &w)| factor(a, w, alpha)).collect();
                (s.clone(), s)
            };
            out.edits.entry(format!("{p}.{prev}.weight")).or_default().rows = Some(s_prev.clone());
            if site == LinearSite::Output {
                out.edits.entry(format!("{p}.{prev}.bias")).or_default().rows = Some(s_prev);
            }
            for b in balance {
                out.edits.entry(format!("{p}.{b}.weight")).or_default().cols = Some(s_cols.clone());
            }
            out.factors.insert((layer, site), s_cols);
        }
        Ok(out)
    }

    /// How tensor `name` is rewritten, if it is.
    pub fn rescale(&self, name: &str) -> Option<&Rescale> {
        self.edits.get(name)
    }

    /// The weight tensors smoothing rewrites (biases, which a model may lack, left out).
    pub fn weights(&self) -> impl Iterator<Item = &str> {
        self.edits.keys().map(String::as_str).filter(|n| n.ends_with(".weight"))
    }

    /// The factor of a site's input channels (its inputs become `x / s`).
    pub fn factor(&self, layer: usize, site: LinearSite) -> Option<&[f32]> {
        self.factors.get(&(layer, site)).map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::calibrate::SiteStats;

    #[test]
    fn factors_follow_the_formula_and_share_v_channels() {
        let stats = |absmax: Vec<f32>| SiteStats { absmax };
        let mut cal = Calibration { heads: (2, 1), ..Calibration::default() };
        cal.sites.insert((0, LinearSite::Output), stats(vec![1.0, 4.0, 9.0, 16.0]));
        cal.sites.insert((0, LinearSite::Qkv), stats(vec![4.0, 0.0, 1.0]));
        let weights = |name: &str| match name {
            "model.layers.0.self_attn.o_proj.weight" => Some(vec![1.0, 1.0, 0.25, 4.0]),
            "model.layers.0.self_attn.q_proj.weight" => Some(vec![1.0, 1.0, 0.0]),
            "model.layers.0.self_attn.k_proj.weight" => Some(vec![0.25, 2.0, 0.0]),
            "model.layers.0.self_attn.v_proj.weight" => Some(vec![0.5, 1.0, 0.0]),
            _ => None,
        };
        let s = Smoothing::new(&cal, 0.5, (2, 1), weights).unwrap();
        // O site, 2 query heads on 1 KV head of dim 2: channel d's maxima over both heads'
        // columns d and 2 + d: activations max(1, 9) = 9 and max(4, 16) = 16, weights
        // max(1, 0.25) = 1 and max(1, 4) = 4; s = sqrt(a / w) = 3 and 2.
        assert_eq!(s.factor(0, LinearSite::Output), Some(&[3.0, 2.0, 3.0, 2.0][..]));
        let v = s.rescale("model.layers.0.self_attn.v_proj.weight").unwrap();
        assert_eq!(v.rows.as_deref(), Some(&[3.0, 2.0][..]));
        assert_eq!(s.rescale("model.layers.0.self_attn.v_proj.bias").unwrap().rows, v.rows);
        // Q/K/V site: weights max over q, k, v per column (1, 2, 0); a channel with no
        // activation or no weight keeps 1.
        assert_eq!(v.cols.as_deref(), Some(&[2.0, 1.0, 1.0][..]));
        assert_eq!(s.rescale("model.layers.0.input_layernorm.weight").unwrap().rows.as_deref(), Some(&[2.0, 1.0, 1.0][..]));
        let o = s.rescale("model.layers.0.self_attn.o_proj.weight").unwrap();
        assert_eq!((o.rows.as_ref(), o.cols.as_deref()), (None, Some(&[3.0, 2.0, 3.0, 2.0][..])));
        // A missing balance layer is an error naming it.
        let err = Smoothing::new(&cal, 0.5, (2, 1), |n| weights(n).filter(|_| !n.contains("k_proj"))).unwrap_err();
        assert!(err.contains("k_proj.weight: not found"), "{err}");
    }

    #[test]
    fn rescale_divides_rows_and_multiplies_columns() {
        let r = Rescale { rows: Some(vec![2.0, 4.0]), cols: Some(vec![1.0, 3.0]) };
        let mut w = vec![2.0, 2.0, 8.0, 8.0];
        r.apply(&mut w, 2);
        assert_eq!(w, [1.0, 3.0, 2.0, 6.0]);
        r.undo(&mut w, 2);
        assert_eq!(w, [2.0, 2.0, 8.0, 8.0]);
        assert_eq!(module_site("model.layers.12.mlp.down_proj"), Some((12, LinearSite::Down)));
        assert_eq!(module_site("model.layers.1.mlp.experts.0.down_proj"), None);
    }
}
