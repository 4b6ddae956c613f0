//! Calibration for `tessera quantize`: the input model runs over calibration text once, and
//! for every dense block the inputs of its linear layers ([`LinearSite`]) are summarized: the
//! per-channel absolute maximum (what SmoothQuant balances) and, when asked, the second
//! moment `Σ x xᵀ` (what GPTQ minimizes the output error under).

use super::gptq::Hessian;
use super::math::column_absmax_into;
use super::QuantizeError;
use crate::model::{ActivationObserver, LinearSite, SeqInput};
use crate::LoadedModel;
use std::collections::BTreeMap;
use std::path::Path;
use tessera_kernels::linear::LinearPolicy;

/// What to calibrate on.
#[derive(Clone, Debug)]
pub struct CalibrationOptions {
    /// Plain-text file of calibration text.
    pub text: std::path::PathBuf,
    /// Tokens to use at most (from the start of the text, BOS tokens included).
    pub max_tokens: usize,
    /// Tokens per calibration sequence.
    pub seq_len: usize,
}

/// The input summary of one linear site.
#[derive(Clone, Debug)]
pub struct SiteStats {
    /// Per-channel `max |x|`.
    pub absmax: Vec<f32>,
    /// `Σ x xᵀ` (when second moments were asked for).
    pub hessian: Option<Hessian>,
}

/// Input summaries of every dense block's linear sites, by (block, site).
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    /// The summaries.
    pub sites: BTreeMap<(usize, LinearSite), SiteStats>,
    /// Calibration tokens run.
    pub tokens: usize,
    /// The model's (query heads, KV heads).
    pub heads: (usize, usize),
    pub(crate) hessians: bool,
}

impl ActivationObserver for Calibration {
    fn observe(&mut self, layer: usize, site: LinearSite, rows: &[f32], width: usize) {
        let hessians = self.hessians;
        let s = self
            .sites
            .entry((layer, site))
            .or_insert_with(|| SiteStats { absmax: vec![0.0; width], hessian: hessians.then(|| Hessian::new(width)) });
        column_absmax_into(&mut s.absmax, rows);
        if let Some(h) = &mut s.hessian {
            h.add(rows);
        }
    }
}

impl Calibration {
    /// The summary of `site` in block `layer`.
    pub fn site(&self, layer: usize, site: LinearSite) -> Option<&SiteStats> {
        self.sites.get(&(layer, site))
    }
}

/// Runs the model of the Hugging Face directory `input` over the calibration text and
/// summarizes every dense linear input (second moments too when `hessians`).
pub fn calibrate(input: &Path, opts: &CalibrationOptions, hessians: bool) -> Result<Calibration, QuantizeError> {
    let usage = |m: String| QuantizeError::Usage(m);
    let text = std::fs::read_to_string(&opts.text).map_err(|e| super::io(&opts.text, e))?;
    let loaded = LoadedModel::load(input, LinearPolicy::DEFAULT).map_err(|e| usage(format!("loading {} to calibrate: {e}", input.display())))?;
    let c = loaded.model.config();
    if c.moe.is_some() {
        return Err(usage("calibrated quantization (--smoothquant, --gptq) supports dense models; this one has MoE layers".into()));
    }
    let seq_len = opts.seq_len.min(c.max_position_embeddings).min(opts.max_tokens);
    if seq_len < 2 {
        return Err(usage(format!("calibration sequences of {seq_len} tokens: use at least 2 (--calibration-seq-len, --calibration-tokens)")));
    }
    let mut tokens = loaded.tokenizer.encode(&text).map_err(|e| usage(format!("tokenizing {}: {e}", opts.text.display())))?;
    // Every sequence starts as the model's inputs do (with BOS when the tokenizer adds one):
    // the first token's activations are the model's largest (an attention sink), and GPTQ
    // must see them as inference will.
    let special = loaded.tokenizer.special();
    let bos = special.bos.filter(|_| special.add_bos);
    if bos.is_some() && tokens.first().copied() == bos {
        tokens.remove(0);
    }
    let body = seq_len - usize::from(bos.is_some());
    // Whole sequences only, at most `max_tokens` in all (BOS included).
    let per_seq = |t: &[u32]| t.len() + usize::from(bos.is_some());
    let mut total = 0;
    let sequences: Vec<Vec<u32>> = tokens
        .chunks(body)
        .take_while(|t| {
            total += per_seq(t);
            total <= opts.max_tokens
        })
        .map(|t| bos.into_iter().chain(t.iter().copied()).collect())
        .collect();
    if sequences.first().is_none_or(|s| s.len() < seq_len) {
        return Err(usage(format!("{} holds {} tokens; calibration wants at least {seq_len}", opts.text.display(), tokens.len())));
    }
    let mut cal = Calibration { hessians, heads: (c.num_heads, c.num_kv_heads), ..Calibration::default() };
    let model = &loaded.model;
    let all: usize = sequences.iter().map(Vec::len).sum();
    // A few sequences per forward pass: the linear layers see more rows per call.
    for group in sequences.chunks(4) {
        let mut caches: Vec<_> = group.iter().map(|s| model.local_kv(s.len())).collect();
        let mut batch: Vec<SeqInput<'_>> = group.iter().zip(caches.iter_mut()).map(|(t, kv)| SeqInput { tokens: t, kv, logits_from: None }).collect();
        model.forward_observed(&mut batch, &mut cal).map_err(|e| usage(format!("calibration forward pass: {e}")))?;
        cal.tokens += group.iter().map(Vec::len).sum::<usize>();
        tracing::info!(tokens = cal.tokens, of = all, "calibrating");
    }
    Ok(cal)
}
