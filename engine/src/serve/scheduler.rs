//! Which sequences run in the next step, and with how many tokens.
//!
//! Iteration-level scheduling: running sequences first, oldest first (one token for a
//! decode, one prefill chunk for a prompt), then waiting sequences in arrival order while
//! the token budget, the sequence cap and the free blocks allow. When blocks run out, the
//! newest running sequence is preempted: its blocks are freed and it goes back to the front
//! of the queue to be recomputed later.
//!
//! Prefill chunks have a fixed size (`chunk`) that never depends on what else runs, and every
//! kernel computes a sequence's rows independently of the rest of the batch, so batching
//! never changes a sequence's results.

use super::metrics::Metrics;
use super::sequence::Sequence;
use crate::kv::{BlockManager, ExactKeyStore, PrefixHit};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Scheduler limits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Most sequences per step.
    pub max_seqs: usize,
    /// Most tokens per step.
    pub max_tokens: usize,
    /// Prefill chunk size (`max_tokens - max_seqs`: a chunk always fits beside the decodes).
    pub chunk: usize,
}

/// Queue state plus the block manager.
pub(crate) struct Scheduler {
    limits: Limits,
    /// Allocation and prefix caching.
    pub blocks: BlockManager,
    /// Waiting sequences, front first.
    pub waiting: VecDeque<u64>,
    /// Running sequences, oldest admission first.
    pub running: Vec<u64>,
    /// New requests not yet admitted (shared with the handle, which caps it).
    queued: Arc<AtomicUsize>,
    /// The empty exact-key store each admitted sequence gets a copy of (`None`: the key
    /// format keeps none).
    exact_keys: Option<ExactKeyStore>,
}

/// One sequence's work in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Work {
    /// Sequence key.
    pub key: u64,
    /// Tokens to compute.
    pub tokens: usize,
}

impl Scheduler {
    /// A scheduler over `blocks`.
    pub fn new(limits: Limits, blocks: BlockManager, queued: Arc<AtomicUsize>) -> Self {
        Scheduler { limits, blocks, waiting: VecDeque::new(), running: Vec::new(), queued, exact_keys: None }
    }

    /// Gives every admitted sequence an (empty) copy of `store` for the keys its format keeps
    /// exactly.
    pub fn with_exact_keys(mut self, store: Option<ExactKeyStore>) -> Self {
        self.exact_keys = store;
        self
    }

    /// Whether anything is queued or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Removes a sequence from the queues and frees its blocks.
    pub fn remove(&mut self, seq: &mut Sequence) {
        if !seq.admitted {
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
        self.waiting.retain(|&k| k != seq.key);
        self.running.retain(|&k| k != seq.key);
        let blocks = seq.reset_cache_state();
        self.blocks.release(&blocks);
    }

    /// Tokens a sequence computes next: the rest of its prompt in fixed chunks, else one.
    fn next_tokens(&self, s: &Sequence) -> usize {
        let left = s.tokens.len() - s.computed;
        // Chunk boundaries are multiples of `chunk` from the first uncached token.
        let into = (s.computed - s.shared) % self.limits.chunk;
        left.min(self.limits.chunk - into)
    }

    /// Makes sure `s` has blocks for `n` more tokens.
    fn grow(&mut self, s: &mut Sequence, n: usize) -> bool {
        let need = self.blocks.blocks_for(s.computed + n).saturating_sub(s.blocks.len());
        if need == 0 {
            return true;
        }
        match self.blocks.allocate(need) {
            Some(b) => {
                s.blocks.extend(b);
                true
            }
            None => false,
        }
    }

    /// Plans one step.
    pub fn schedule(&mut self, seqs: &mut HashMap<u64, Sequence>, metrics: &Metrics) -> Vec<Work> {
        let mut budget = self.limits.max_tokens;
        let mut work = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            let key = self.running[i];
            let n = self.next_tokens(&seqs[&key]);
            if n > budget {
                i += 1;
                continue;
            }
            // Free blocks by preempting the newest sequences until this one fits.
            let mut fits = self.grow(seqs.get_mut(&key).expect("running sequences exist"), n);
            while !fits {
                let victim = self.running.pop().expect("this sequence is running");
                let blocks = seqs.get_mut(&victim).expect("running sequences exist").reset_cache_state();
                self.blocks.release(&blocks);
                self.waiting.push_front(victim);
                metrics.preemptions.inc();
                preempted = true;
                tracing::debug!(seq = victim, "preempted for lack of KV blocks");
                if victim == key {
                    break;
                }
                fits = self.grow(seqs.get_mut(&key).expect("running sequences exist"), n);
            }
            if !fits {
                break;
            }
            work.push(Work { key, tokens: n });
            budget -= n;
            i += 1;
        }
        while !preempted && budget > 0 && self.running.len() < self.limits.max_seqs {
            let Some(&key) = self.waiting.front() else { break };
            let s = seqs.get_mut(&key).expect("waiting sequences exist");
            if s.exact.is_none() {
                s.exact.clone_from(&self.exact_keys);
            }
            let looked_up = s.computed == 0 && s.req.prompt_logprobs.is_none();
            if looked_up {
                // A key format with an exact window computes at least a window of the prompt,
                // so that its last token scores its whole window exactly.
                let window = s.exact.as_ref().map_or(1, |e| e.window().max(1));
                let mut hit = self.blocks.lookup(&s.tokens[..s.tokens.len().saturating_sub(window - 1)]);
                if let Some(e) = s.exact.as_mut().filter(|e| e.sink() > 0 && !hit.blocks.is_empty()) {
                    // The sink's exact keys come with the first block, or the hit is not used.
                    match &hit.sink {
                        Some(keys) => e.restore_sink(keys),
                        None => {
                            self.blocks.release(&hit.blocks);
                            hit = PrefixHit::default();
                        }
                    }
                }
                let hit_tokens = hit.blocks.len() * self.blocks.block_size();
                s.registered = hit.blocks.len();
                s.blocks = hit.blocks;
                s.chain = hit.chain;
                s.computed = hit_tokens;
                s.shared = hit_tokens;
            }
            let n = self.next_tokens(s);
            if n > budget || !self.grow(s, n) {
                let blocks = s.reset_cache_state();
                self.blocks.release(&blocks);
                break;
            }
            if looked_up && self.blocks.prefix_caching() {
                metrics.prefix_queries.inc_by(s.tokens.len() as u64);
                metrics.prefix_hits.inc_by(s.shared as u64);
            }
            if !s.admitted {
                s.admitted = true;
                s.cached_tokens = s.shared;
                self.queued.fetch_sub(1, Ordering::Relaxed);
                metrics.prompt_tokens.inc_by(s.req.prompt.len() as u64);
                metrics.queue.observe(s.req.arrival.elapsed().as_secs_f64());
            }
            self.waiting.pop_front();
            self.running.push(key);
            work.push(Work { key, tokens: n });
            budget -= n;
        }
        work
    }
}
