//! The prompts of a run: token-exact random prompts (bench_serving's `random`), a ShareGPT
//! JSON file, or a plain file with one prompt per line.

use crate::cli::{scaled_range, Config, DatasetName};
use crate::tokens::Tokens;
use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use std::path::Path;

/// One request to send.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRequest {
    /// Prompt text (the user message on the chat endpoint).
    pub prompt: String,
    /// Prompt tokens, by the target's tokenizer without added BOS.
    pub prompt_len: usize,
    /// Requested output tokens (`max_tokens`).
    pub output_len: usize,
}

/// Output tokens for prompts-file requests when `--output-len` is not given.
const PROMPTS_DEFAULT_OUTPUT_LEN: usize = 128;

/// Builds `n` requests from the configured dataset.
pub fn build(config: &Config, tokens: &Tokens, n: usize) -> Result<Vec<BenchRequest>> {
    let path = || config.dataset_path.as_deref().context("this dataset needs --dataset-path");
    match config.dataset_name {
        DatasetName::Random => random(
            tokens,
            &RandomSpec {
                num_prompts: n,
                input_len: config.random_input_len,
                output_len: config.random_output_len,
                range_ratio: config.random_range_ratio,
                shared_prefix_len: config.shared_prefix_len,
                seed: config.seed,
            },
        ),
        DatasetName::Sharegpt => sharegpt(path()?, tokens, n, config.output_len, config.seed),
        DatasetName::Prompts => prompts_file(path()?, tokens, n, config.output_len),
    }
}

/// The random dataset's parameters.
#[derive(Clone, Debug)]
pub struct RandomSpec {
    /// Number of prompts.
    pub num_prompts: usize,
    /// Prompt tokens before the range ratio.
    pub input_len: usize,
    /// Output tokens before the range ratio.
    pub output_len: usize,
    /// Lengths drawn uniformly from `[len*(1-r), len*(1+r)]`.
    pub range_ratio: f64,
    /// Leading tokens shared by every prompt (part of each prompt's length).
    pub shared_prefix_len: usize,
    /// RNG seed.
    pub seed: u64,
}

/// Prompts of random ordinary tokens whose text encodes to exactly the drawn length.
///
/// Each prompt's tokens come from its own stretch of one seeded stream, so prompts share no
/// prefix beyond the `shared_prefix_len` tokens they are asked to share.
pub fn random(tokens: &Tokens, spec: &RandomSpec) -> Result<Vec<BenchRequest>> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let (in_lo, in_hi) = scaled_range(spec.input_len, spec.range_ratio);
    let (out_lo, out_hi) = scaled_range(spec.output_len, spec.range_ratio);
    if spec.shared_prefix_len >= in_lo {
        bail!("the shared prefix ({} tokens) must be shorter than every prompt ({in_lo})", spec.shared_prefix_len);
    }
    let prefix = if spec.shared_prefix_len > 0 {
        tokens.encode(&exact_text(tokens, &mut rng, &[], spec.shared_prefix_len)?)?
    } else {
        Vec::new()
    };
    (0..spec.num_prompts)
        .map(|_| {
            let prompt_len = rng.gen_range(in_lo..=in_hi);
            let output_len = rng.gen_range(out_lo..=out_hi);
            let prompt = exact_text(tokens, &mut rng, &prefix, prompt_len)?;
            Ok(BenchRequest { prompt, prompt_len, output_len })
        })
        .collect()
}

/// Rounds of decode, re-encode and adjust before giving up on a prompt.
const EXACT_ROUNDS: usize = 200;

/// Text that encodes to `prefix` followed by random ordinary tokens, `target` tokens in all.
///
/// Random ids rarely survive decode + encode unchanged (byte pieces merge, words re-split), so
/// this re-encodes, truncates or extends with fresh random ids, and checks again.
fn exact_text(tokens: &Tokens, rng: &mut StdRng, prefix: &[u32], target: usize) -> Result<String> {
    let mut ids = prefix.to_vec();
    extend_random(tokens, rng, &mut ids, target);
    for _ in 0..EXACT_ROUNDS {
        let text = tokens.decode(&ids)?;
        let enc = tokens.encode(&text)?;
        if !enc.starts_with(prefix) || enc.iter().any(|&t| tokens.is_added(t)) {
            ids.truncate(prefix.len());
        } else if enc.len() == target {
            return Ok(text);
        } else {
            ids = enc;
            ids.truncate(target);
        }
        extend_random(tokens, rng, &mut ids, target);
    }
    bail!("could not build a prompt of exactly {target} tokens in {EXACT_ROUNDS} rounds")
}

/// Appends uniformly drawn ordinary token ids up to `target`.
fn extend_random(tokens: &Tokens, rng: &mut StdRng, ids: &mut Vec<u32>, target: usize) {
    let vocab = tokens.vocab_size() as u32;
    while ids.len() < target {
        let id = rng.gen_range(0..vocab);
        if !tokens.is_added(id) {
            ids.push(id);
        }
    }
}

/// One ShareGPT record; records of other shapes are skipped.
#[derive(Deserialize)]
struct Conversation {
    #[serde(default, alias = "messages")]
    conversations: Vec<Turn>,
}

/// One turn (`from`/`value`, or `role`/`content`).
#[derive(Deserialize)]
struct Turn {
    #[serde(alias = "content")]
    value: String,
}

/// ShareGPT prompts, filtered as bench_serving does.
///
/// Takes the first turn as the prompt and the second as the reference answer; records are
/// shuffled with `seed`, and a pair is skipped when the prompt or answer has fewer than 4
/// tokens, the prompt more than 1024, or both together more than 2048. `output_len` replaces
/// the answer's length.
pub fn sharegpt(
    path: &Path,
    tokens: &Tokens,
    n: usize,
    output_len: Option<usize>,
    seed: u64,
) -> Result<Vec<BenchRequest>> {
    let file = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut convs: Vec<Conversation> =
        serde_json::from_str(&file).with_context(|| format!("{} is not a ShareGPT JSON array", path.display()))?;
    convs.retain(|c| c.conversations.len() >= 2);
    convs.shuffle(&mut StdRng::seed_from_u64(seed));
    let mut out = Vec::with_capacity(n);
    for c in &convs {
        if out.len() == n {
            break;
        }
        let prompt = &c.conversations[0].value;
        let prompt_len = tokens.count(prompt)?;
        let (answer_len, fixed) = match output_len {
            Some(n) => (n, true),
            None => (tokens.count(&c.conversations[1].value)?, false),
        };
        let too_short = prompt_len < 4 || (!fixed && answer_len < 4);
        if too_short || prompt_len > 1024 || prompt_len + answer_len > 2048 {
            continue;
        }
        out.push(BenchRequest { prompt: prompt.clone(), prompt_len, output_len: answer_len });
    }
    fill(out, n, path)
}

/// Prompts from a text file, one per non-empty line, each asking for `output_len` tokens.
pub fn prompts_file(path: &Path, tokens: &Tokens, n: usize, output_len: Option<usize>) -> Result<Vec<BenchRequest>> {
    let file = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let output_len = output_len.unwrap_or(PROMPTS_DEFAULT_OUTPUT_LEN);
    let out = file
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .take(n)
        .map(|p| Ok(BenchRequest { prompt: p.to_string(), prompt_len: tokens.count(p)?, output_len }))
        .collect::<Result<Vec<_>>>()?;
    fill(out, n, path)
}

/// Repeats `items` in order up to `n` requests (saying so on stderr when it has to).
fn fill(items: Vec<BenchRequest>, n: usize, path: &Path) -> Result<Vec<BenchRequest>> {
    if items.is_empty() {
        bail!("{} has no usable prompts", path.display());
    }
    if items.len() < n {
        eprintln!("note: {} has {} usable prompts; reusing them for {n} requests", path.display(), items.len());
    }
    Ok(items.iter().cycle().take(n).cloned().collect())
}
