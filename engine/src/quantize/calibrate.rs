//! Calibration for `tessera quantize`: the input model runs over calibration text.
//!
//! - [`calibrate`]: the float model, once, summarizing every dense block's linear inputs
//!   ([`LinearSite`]) by their per-channel absolute maximum (what SmoothQuant balances).
//! - [`calibrate_sequential`]: block by block for GPTQ, collecting each site's second moment
//!   `Σ x̃ x̃ᵀ` from the inputs it gets once everything before it is quantized (and the cross
//!   moment with the float model's inputs), and handing them to the caller, whose quantized
//!   weights replace the float ones before the next site.

use super::gptq::Hessian;
use super::math::column_absmax_into;
use super::QuantizeError;
use crate::checkpoint::names::canonical_name;
use crate::model::{ActivationObserver, LinearSite, SeqInput};
use crate::tokenizer::Tokenizer;
use crate::LoadedModel;
use std::collections::BTreeMap;
use std::path::Path;
use tessera_kernels::linear::LinearPolicy;

/// The built-in calibration text: chapters 1-16 of Herman Melville's *Moby-Dick* (1851,
/// public domain; 170 KB, about 40,000 tokens for SmolLM2's tokenizer), rebuilt from its
/// source and checked by scripts/calibration-text.sh. General English prose that none of the
/// project's evaluation texts come from: on the default model it calibrated W4A16 closer to
/// BF16 on two other novels than the model's own samples did, and as close on legal text
/// (docs/benchmarks/quantized-quality.md).
pub const BUILTIN_TEXT: &str = include_str!("builtin_text.txt");

/// Where the calibration text comes from.
#[derive(Clone, Debug)]
pub enum CalibrationText {
    /// [`BUILTIN_TEXT`] (the default recipe's).
    BuiltIn,
    /// A plain-text file.
    File(std::path::PathBuf),
    /// Text the model samples itself from this seed ([`super::sampled`]).
    Sampled {
        /// Seed of the first tokens and of the sampling.
        seed: u64,
    },
}

/// What to calibrate on.
#[derive(Clone, Debug)]
pub struct CalibrationOptions {
    /// The calibration text.
    pub text: CalibrationText,
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
}

impl ActivationObserver for Calibration {
    fn observe(&mut self, layer: usize, site: LinearSite, rows: &[f32], width: usize) {
        let s = self.sites.entry((layer, site)).or_insert_with(|| SiteStats { absmax: vec![0.0; width] });
        column_absmax_into(&mut s.absmax, rows);
    }
}

impl Calibration {
    /// The summary of `site` in block `layer`.
    pub fn site(&self, layer: usize, site: LinearSite) -> Option<&SiteStats> {
        self.sites.get(&(layer, site))
    }
}

/// The model of the Hugging Face directory `input`, loaded to calibrate (dense models only).
fn load(input: &Path) -> Result<LoadedModel, QuantizeError> {
    let loaded = LoadedModel::load(input, LinearPolicy::DEFAULT).map_err(|e| QuantizeError::Usage(format!("loading {} to calibrate: {e}", input.display())))?;
    if loaded.model.config().moe.is_some() {
        return Err(QuantizeError::Usage("calibrated quantization (GPTQ and SmoothQuant, with their flags) supports dense models; this one has MoE layers: quantize it with --rtn".into()));
    }
    // Calibration observes a site's input before its layers run; only down_proj's transform
    // is applied before it is observed (the MLP does it in place).
    if let Some(name) = loaded.model.transformed_linears().into_iter().find(|n| !n.ends_with("ffn_down.weight")) {
        return Err(QuantizeError::Usage(format!("calibrated quantization supports online input transforms before down_proj only; {name} has one: quantize it with --rtn")));
    }
    Ok(loaded)
}

/// The calibration sequences of `opts` for the model of the Hugging Face directory `input`:
/// from the built-in text or a file, [`text_sequences`]; sampled, `opts.max_tokens / seq_len` sequences (at least one)
/// of `seq_len` tokens ([`super::sampled::sample_sequences`]). `progress(done, total)` sees
/// the tokens sampled so far.
pub fn calibration_sequences(input: &Path, opts: &CalibrationOptions, progress: &dyn Fn(usize, usize)) -> Result<Vec<Vec<u32>>, QuantizeError> {
    let loaded = load(input)?;
    let max_position = loaded.model.config().max_position_embeddings;
    match opts.text {
        CalibrationText::BuiltIn => text_sequences(&loaded.tokenizer, max_position, BUILTIN_TEXT, "the built-in calibration text", opts),
        CalibrationText::File(ref path) => sequences(&loaded.tokenizer, max_position, path, opts),
        CalibrationText::Sampled { seed } => {
            let seq_len = seq_len(max_position, opts)?;
            let count = (opts.max_tokens / seq_len).max(1);
            super::sampled::sample_sequences(std::sync::Arc::new(loaded), count, seq_len, seed, progress)
        }
    }
}

/// Tokens per calibration sequence: `opts.seq_len`, at most `max_position` and `opts.max_tokens`.
fn seq_len(max_position: usize, opts: &CalibrationOptions) -> Result<usize, QuantizeError> {
    let seq_len = opts.seq_len.min(max_position).min(opts.max_tokens);
    if seq_len < 2 {
        return Err(QuantizeError::Usage(format!("calibration sequences of {seq_len} tokens: use at least 2 (--calibration-seq-len, --calibration-tokens)")));
    }
    Ok(seq_len)
}

/// The calibration sequences of the text file `path` ([`text_sequences`]).
pub fn sequences(tokenizer: &Tokenizer, max_position: usize, path: &Path, opts: &CalibrationOptions) -> Result<Vec<Vec<u32>>, QuantizeError> {
    let text = std::fs::read_to_string(path).map_err(|e| super::io(path, e))?;
    text_sequences(tokenizer, max_position, &text, &path.display().to_string(), opts)
}

/// The calibration sequences of `text` (named `source` in errors), tokenized by `tokenizer`,
/// cut into whole sequences of `opts.seq_len` tokens (at most `max_position`), each starting
/// as the model's inputs do (with BOS when the tokenizer adds one), at most `opts.max_tokens`
/// in all.
pub fn text_sequences(tokenizer: &Tokenizer, max_position: usize, text: &str, source: &str, opts: &CalibrationOptions) -> Result<Vec<Vec<u32>>, QuantizeError> {
    let usage = |m: String| QuantizeError::Usage(m);
    let seq_len = seq_len(max_position, opts)?;
    let mut tokens = tokenizer.encode(text).map_err(|e| usage(format!("tokenizing {source}: {e}")))?;
    // The first token's activations are the model's largest (an attention sink), and GPTQ
    // must see them as inference will.
    let special = tokenizer.special();
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
        return Err(usage(format!("{source} holds {} tokens; calibration wants at least {seq_len}", tokens.len())));
    }
    Ok(sequences)
}

/// Sequences per forward pass: the linear layers see more rows per call.
const GROUP: usize = 4;

/// Runs the float model of the Hugging Face directory `input` over the calibration
/// `sequences` once and summarizes every dense linear input.
pub fn calibrate(input: &Path, sequences: &[Vec<u32>]) -> Result<Calibration, QuantizeError> {
    let loaded = load(input)?;
    let c = loaded.model.config();
    let mut cal = Calibration { heads: (c.num_heads, c.num_kv_heads), ..Calibration::default() };
    let model = &loaded.model;
    let all: usize = sequences.iter().map(Vec::len).sum();
    for group in sequences.chunks(GROUP) {
        let mut caches: Vec<_> = group.iter().map(|s| model.local_kv(s.len())).collect();
        let mut batch: Vec<SeqInput<'_>> = group.iter().zip(caches.iter_mut()).map(|(t, kv)| SeqInput { tokens: t, kv, logits_from: None }).collect();
        model.forward_observed(&mut batch, &mut cal).map_err(|e| QuantizeError::Usage(format!("calibration forward pass: {e}")))?;
        cal.tokens += group.iter().map(Vec::len).sum::<usize>();
        tracing::info!(tokens = cal.tokens, of = all, "calibrating");
    }
    // SmoothQuant would divide up_proj's rows and multiply down_proj's columns by one factor
    // per channel; an online transform between them mixes the channels, so those sites are
    // not summarized (and not smoothed). `load` refuses transforms anywhere else.
    // Likewise an output transform on the layer whose rows a site's factors fold into: v_proj
    // for O's site, up_proj for down's.
    let layer_of = |name: &str| name.strip_prefix("blk.").and_then(|r| r.split_once('.')).and_then(|(l, _)| l.parse::<usize>().ok());
    for name in model.transformed_linears() {
        if let Some(layer) = layer_of(name) {
            cal.sites.remove(&(layer, LinearSite::Down));
        }
    }
    for name in model.output_transformed_linears() {
        let site = if name.ends_with("attn_v.weight") {
            LinearSite::Output
        } else if name.ends_with("ffn_up.weight") {
            LinearSite::Down
        } else {
            continue;
        };
        if let Some(layer) = layer_of(name) {
            cal.sites.remove(&(layer, site));
        }
    }
    Ok(cal)
}

/// The sites of a dense block in the order [`calibrate_sequential`] quantizes them: each
/// site's layers see the inputs the block produces once the earlier sites' layers are
/// quantized (the GPTQ reference's "true sequential").
pub const STAGES: [LinearSite; 4] = [LinearSite::Qkv, LinearSite::Output, LinearSite::GateUp, LinearSite::Down];

/// The rows of every site's inputs of one block in one forward pass, in [`STAGES`] order.
struct BlockRows {
    layer: usize,
    rows: [Vec<f32>; 4],
}

impl ActivationObserver for BlockRows {
    fn observe(&mut self, layer: usize, site: LinearSite, rows: &[f32], _: usize) {
        if let Some(i) = STAGES.iter().position(|&s| s == site).filter(|_| layer == self.layer) {
            self.rows[i].extend_from_slice(rows);
        }
    }
}

/// What GPTQ learns of one site's inputs `x̃` in the model being quantized, paired with the
/// float model's inputs `x` of the same tokens.
#[derive(Clone, Debug)]
pub struct SiteMoments {
    /// `Σ x̃ x̃ᵀ`.
    pub hessian: Hessian,
    /// `Σ x x̃ᵀ`.
    pub cross: Hessian,
}

/// Accumulates [`SiteMoments`] over forward passes, given each pass's float rows first.
struct MomentsObserver<'a> {
    at: (usize, LinearSite),
    float_rows: &'a [f32],
    moments: Option<SiteMoments>,
}

impl ActivationObserver for MomentsObserver<'_> {
    fn observe(&mut self, layer: usize, site: LinearSite, rows: &[f32], width: usize) {
        if (layer, site) == self.at {
            let m = self.moments.get_or_insert_with(|| SiteMoments { hessian: Hessian::new(width), cross: Hessian::new(width) });
            m.hessian.add(rows);
            m.cross.add_cross(self.float_rows, rows);
        }
    }
}

/// Sequential calibration for GPTQ, as in the GPTQ paper and llm-compressor's sequential
/// pipeline: the model of the Hugging Face directory `input` runs over the calibration `sequences`
/// block by block, keeping every calibration token's hidden state between blocks. For each
/// block and each site of [`STAGES`], the block runs over those hidden states and the site's
/// input moments go to `quantize(block, site, moments)`, which returns the weights that
/// replace the float ones of that site's layers: `(Hugging Face weight name, [rows, cols] f32
/// values)`, in the float model's input frame. Once the block's last site is replaced, the
/// block runs again to give the next block its inputs. So every Hessian is that of the inputs
/// the site gets from a model whose earlier layers are already quantized, not the float
/// model's. The float model runs alongside on its own hidden states, so that each moment also
/// pairs the float inputs of the same tokens with the quantized model's ([`SiteMoments`]).
///
/// Cost: per block, the model being quantized runs its first three sites' partial passes and
/// two whole ones over the calibration tokens (about three forward passes without the output
/// head), and the float model, which does not change, one whole pass that keeps every site's
/// inputs. Memory: the model loaded twice, the hidden states of every calibration token
/// (4 · tokens · hidden_size bytes, twice per model), the float model's inputs of one block's
/// sites (4 · tokens · (3 · hidden_size + intermediate_size) bytes), one site's moments, and
/// the replaced weights as f32 (twice a BF16 model's linear weights once all are replaced).
/// `progress(done, total)` sees the blocks quantized so far. Returns the tokens run.
pub fn calibrate_sequential(
    input: &Path,
    sequences: &[Vec<u32>],
    progress: &dyn Fn(usize, usize),
    mut quantize: impl FnMut(usize, LinearSite, &SiteMoments) -> Result<Vec<(String, Vec<f32>)>, QuantizeError>,
) -> Result<usize, QuantizeError> {
    let usage = |m: String| QuantizeError::Usage(m);
    let mut loaded = load(input)?;
    let float = load(input)?;
    let (caps, layers) = (loaded.caps, loaded.model.config().num_layers);
    let groups: Vec<&[Vec<u32>]> = sequences.chunks(GROUP).collect();
    let tokens: usize = sequences.iter().map(Vec::len).sum();
    let mut hidden = groups.iter().map(|g| loaded.model.embed(&g.concat())).collect::<Result<Vec<_>, _>>().map_err(|e| usage(format!("calibration: {e}")))?;
    let mut float_hidden = hidden.clone();
    for layer in 0..layers {
        let failed = |e: crate::model::ForwardError| usage(format!("calibration, block {layer}: {e}"));
        // The float model: one pass per group gives every site's inputs and the next block's.
        let mut float_rows = Vec::with_capacity(groups.len());
        for (group, fx) in groups.iter().zip(float_hidden.iter_mut()) {
            let mut rows = BlockRows { layer, rows: Default::default() };
            run_block(&float.model, layer, group, fx, Some(&mut rows), None).map_err(failed)?;
            float_rows.push(rows.rows);
        }
        for (i, site) in STAGES.into_iter().enumerate() {
            let mut obs = MomentsObserver { at: (layer, site), float_rows: &[], moments: None };
            for ((group, x), fr) in groups.iter().zip(&hidden).zip(&float_rows) {
                obs.float_rows = &fr[i];
                run_block(&loaded.model, layer, group, &mut x.clone(), Some(&mut obs), Some(site)).map_err(failed)?;
            }
            let moments = obs.moments.ok_or_else(|| usage(format!("calibration: block {layer} has no {site:?} inputs")))?;
            for (name, w) in quantize(layer, site, &moments)? {
                let canonical = canonical_name(&name).ok().flatten();
                let linear = canonical.and_then(|c| loaded.model.block_linear_mut(&c)).ok_or_else(|| usage(format!("calibration: the model has no dense block layer {name}")))?;
                linear.set_f32(&w, &caps, LinearPolicy::DEFAULT).map_err(usage)?;
            }
        }
        for (group, x) in groups.iter().zip(hidden.iter_mut()) {
            run_block(&loaded.model, layer, group, x, None, None).map_err(failed)?;
        }
        tracing::info!(block = layer, of = layers, tokens, "block quantized");
        progress(layer + 1, layers);
    }
    Ok(tokens)
}

/// Block `layer` of `model` over the hidden states `x` of the sequences `group`, in place
/// (to site `until` only, when given).
fn run_block(
    model: &crate::model::LlamaModel,
    layer: usize,
    group: &[Vec<u32>],
    x: &mut [f32],
    observer: Option<&mut dyn ActivationObserver>,
    until: Option<LinearSite>,
) -> Result<(), crate::model::ForwardError> {
    let mut caches: Vec<_> = group.iter().map(|s| model.local_kv(s.len())).collect();
    let mut batch: Vec<SeqInput<'_>> = group.iter().zip(caches.iter_mut()).map(|(t, kv)| SeqInput { tokens: t, kv, logits_from: None }).collect();
    model.forward_blocks(layer..layer + 1, &mut batch, x, observer, until)
}
