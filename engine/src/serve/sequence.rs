//! One request's state inside the engine.

use super::output::OutputText;
use super::{Event, GenRequest, TokenLogprob};
use crate::sample::Sampler;
use crate::structured::Guide;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A request being served: its tokens, how many are in the KV cache (whose blocks the
/// scheduler's [`crate::kv_cache::KvCacheManager`] keeps under `key`) and its output state.
pub(crate) struct Sequence {
    /// Engine-wide id.
    pub key: u64,
    /// What was asked.
    pub req: GenRequest,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose keys/values are in the cache.
    pub computed: usize,
    /// Tokens in prefix-cache blocks shared with others (never written).
    pub shared: usize,
    /// Sampling state.
    pub sampler: Sampler,
    /// Visible-text state.
    pub output: OutputText,
    /// The structured output's place in its grammar (taken from the request).
    pub guide: Option<Guide>,
    /// Prompt logprobs computed so far (when asked for).
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Whether the sequence has been scheduled before (queue time is observed once).
    pub admitted: bool,
    /// When the first and the latest output tokens were sampled.
    pub first_token: Option<Instant>,
    /// See `first_token`.
    pub last_token: Option<Instant>,
    /// Where events go.
    pub tx: UnboundedSender<Event>,
    /// Other choices of the same prompt waiting for this sequence's prefill: when it ends,
    /// they fork from it (sharing its prompt blocks) instead of computing the prompt again.
    pub followers: Vec<u64>,
}

impl Sequence {
    /// A new sequence for `req`.
    pub fn new(key: u64, mut req: GenRequest, tx: UnboundedSender<Event>) -> Self {
        Sequence {
            guide: req.guide.take(),
            key,
            tokens: req.prompt.clone(),
            computed: 0,
            shared: 0,
            sampler: Sampler::new(req.sampling.clone(), &req.prompt),
            output: OutputText::new(&req.stop),
            prompt_logprobs: Vec::new(),
            cached_tokens: 0,
            admitted: false,
            first_token: None,
            last_token: None,
            tx,
            req,
            followers: Vec::new(),
        }
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }

    /// Whether this sequence wants prompt logprobs it has not reported yet.
    pub fn wants_prompt_logprobs(&self) -> bool {
        self.req.prompt_logprobs.is_some() && self.prompt_logprobs.len() < self.req.prompt.len()
    }

    /// The first row to compute logits for when the next `n` tokens (from `computed`) run:
    /// the rows that score prompt tokens (position `p` predicts token `p + 1`, from
    /// `score_from`), else the last row when it ends the sequence's tokens, else none.
    pub fn logits_from(&self, n: usize) -> Option<usize> {
        let end = self.computed + n;
        if self.wants_prompt_logprobs() {
            let first = self.req.score_from.max(1) - 1;
            if first < end {
                return Some(first.saturating_sub(self.computed));
            }
        }
        (end == self.tokens.len()).then(|| n - 1)
    }
}
