//! What a client asks the engine for, and what the engine streams back.

use crate::sample::SamplingParams;
use crate::structured::Guide;
use std::time::Instant;

/// One generation request: a tokenized prompt plus everything that decides when to stop.
#[derive(Clone, Debug)]
pub struct GenRequest {
    /// Id for logs and spans (e.g. `cmpl-…-0`).
    pub id: String,
    /// Prompt token ids (BOS already applied by the caller's tokenization).
    pub prompt: Vec<u32>,
    /// Sampling parameters (`logprobs: Some(n)` reports each sampled token's top-n).
    pub sampling: SamplingParams,
    /// Most tokens to generate; 0 only scores the prompt (with `prompt_logprobs`).
    pub max_tokens: usize,
    /// EOS and stop strings are ignored until this many tokens are generated.
    pub min_tokens: usize,
    /// Stop strings: generation ends when the text contains one; it is never emitted.
    pub stop: Vec<String>,
    /// Extra token ids that end generation (not emitted as text).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's EOS tokens.
    pub ignore_eos: bool,
    /// `Some(n)`: report every prompt token's logprob and top-n alternatives (echo + logprobs).
    pub prompt_logprobs: Option<usize>,
    /// With `prompt_logprobs`: the first prompt position whose logprob is computed; earlier
    /// tokens are reported with `logprob: None` and their logits never computed (perplexity
    /// scores the second half of each window), and, after the first, with an empty `text` (not
    /// decoded). 0 (the default): every token after the first.
    pub score_from: usize,
    /// When the request reached the server (queue time and TTFT are measured from here).
    pub arrival: Instant,
    /// A structured output's guide at its start: only tokens it allows are sampled, and the
    /// request finishes (`Stop`) once the grammar is complete. Each choice has its own.
    pub guide: Option<Guide>,
}

impl GenRequest {
    /// A request with default stopping rules (EOS stops, no stop strings).
    pub fn new(id: impl Into<String>, prompt: Vec<u32>, sampling: SamplingParams, max_tokens: usize) -> Self {
        GenRequest {
            id: id.into(),
            prompt,
            sampling,
            max_tokens,
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            prompt_logprobs: None,
            score_from: 0,
            arrival: Instant::now(),
            guide: None,
        }
    }
}

/// Logprob information about one token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// Token id.
    pub id: u32,
    /// The token's text on its own (may hold U+FFFD for a partial UTF-8 character); empty for
    /// the prompt tokens a scoring request skips (after the first, before `score_from`).
    pub text: String,
    /// Its log-probability under the model's raw distribution (`None` for the first prompt
    /// token, which nothing predicts).
    pub logprob: Option<f32>,
    /// The most likely alternatives `(text, logprob)`, most likely first (empty unless asked).
    pub top: Vec<(String, f32)>,
}

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// Aborted (client gone, server shutting down).
    Abort,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (a stop token counts; text after a stop string does not exist).
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// What the engine streams back for one request, in order: at most one `PromptLogprobs`,
/// any number of `Delta`s, then exactly one `Finished` (or `Error`).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Every prompt token with its logprob (the first has `None`), when asked for.
    PromptLogprobs(Vec<TokenLogprob>),
    /// New output: `text` is safe to show (never part of a stop string, never half a
    /// character); `tokens` are the tokens sampled since the last delta, with logprobs when
    /// asked (their texts may not add up to `text` while text is held back).
    Delta {
        /// New text.
        text: String,
        /// New tokens.
        tokens: Vec<TokenLogprob>,
    },
    /// The request ended.
    Finished {
        /// Why.
        reason: FinishReason,
        /// The stop string or stop token id that ended it, if any (vLLM's `stop_reason`).
        stop_reason: Option<StopReason>,
        /// Token counts.
        usage: Usage,
    },
    /// The engine failed this request (e.g. a forward-pass error); nothing more follows.
    Error(String),
}

/// What matched when a request stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// A stop string.
    Text(String),
    /// A stop token id (EOS or from `stop_token_ids`).
    Token(u32),
}
