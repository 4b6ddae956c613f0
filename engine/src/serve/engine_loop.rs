//! The engine thread: receive commands, schedule a step, run one batched forward pass,
//! sample, and stream each request's results.

use super::metrics::Metrics;
use super::scheduler::{Scheduler, Work};
use super::sequence::Sequence;
use super::{Event, FinishReason, StopReason, TokenLogprob, Usage};
use super::backend::{Backend, StepSeq};
use crate::sample::{logsumexp, top_n, Sampled};
use crate::structured::{Guide, Masker, TokenSet};
use crate::tokenizer::Tokenizer;
use crate::LoadedModel;
use std::collections::HashMap;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

/// What the handle asks of the engine thread.
pub(crate) enum Command {
    /// Queue new sequences; each one's followers (other choices of its prompt) wait beside
    /// it for its prefill, unqueued.
    Submit(Vec<(Sequence, Vec<Sequence>)>),
    /// Drop a request (client gone); unknown keys are ignored.
    Abort(u64),
    /// Stop admitting; abort what is left at the deadline, then exit.
    Shutdown(Instant),
}

/// The engine thread's state.
pub(crate) struct EngineLoop {
    /// The model.
    pub model: Arc<LoadedModel>,
    /// The model and its KV storage, on the CPU or a GPU.
    pub backend: Box<dyn Backend>,
    /// Queues and blocks.
    pub sched: Scheduler,
    /// Every live sequence by key.
    pub seqs: HashMap<u64, Sequence>,
    /// Commands from handles.
    pub rx: Receiver<Command>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Longest prompt + output.
    pub max_model_len: usize,
    /// Set once shutdown was asked for.
    pub deadline: Option<Instant>,
    /// Computes the structured outputs' masks during the forward pass.
    pub masker: Masker,
}

impl EngineLoop {
    /// Runs until shut down or until every handle is gone.
    pub fn run(mut self) {
        loop {
            if self.sched.is_idle() {
                if self.deadline.is_some() {
                    break;
                }
                match self.rx.recv() {
                    Ok(c) => self.command(c),
                    Err(_) => break,
                }
            }
            while let Ok(c) = self.rx.try_recv() {
                self.command(c);
            }
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            if !self.sched.is_idle() {
                self.step();
            }
            self.update_gauges();
        }
        let keys: Vec<u64> = self.seqs.keys().copied().collect();
        for key in keys {
            self.finish(key, FinishReason::Abort, None);
        }
        self.update_gauges();
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Submit(groups) => {
                for (mut seq, followers) in groups {
                    seq.followers = followers.iter().map(|f| f.key).collect();
                    self.sched.waiting.push_back(seq.key);
                    self.seqs.insert(seq.key, seq);
                    self.seqs.extend(followers.into_iter().map(|f| (f.key, f)));
                }
            }
            Command::Abort(key) => {
                if self.seqs.contains_key(&key) {
                    tracing::debug!(seq = key, "aborted");
                    self.finish(key, FinishReason::Abort, None);
                }
            }
            Command::Shutdown(deadline) => self.deadline = Some(deadline),
        }
    }

    fn update_gauges(&self) {
        let m = &self.metrics;
        m.running.set(self.sched.running.len() as i64);
        m.waiting.set(self.sched.waiting.len() as i64);
        m.set_kv(self.sched.kv.num_used(), self.sched.kv.num_blocks());
    }

    /// One iteration: schedule, forward, sample, stream.
    fn step(&mut self) {
        let t0 = Instant::now();
        let work = self.sched.schedule(&mut self.seqs, &self.metrics);
        if work.is_empty() {
            // Nothing fits although nothing runs: the head request can never be served.
            if self.sched.running.is_empty() {
                if let Some(&key) = self.sched.waiting.front() {
                    self.fail(key, "the request does not fit in the KV cache".into());
                }
            }
            return;
        }
        let t_fwd = Instant::now();
        let guides = self.take_sampling_guides(&work);
        self.masker.start(guides);
        let result = {
            // Each scheduled sequence's block table, and its exact keys to write in the pass.
            let keys: Vec<u64> = work.iter().map(|w| w.key).collect();
            let caches = self.sched.kv.step_caches(&keys);
            let mut batch: Vec<StepSeq<'_>> = work
                .iter()
                .zip(caches)
                .map(|(w, c)| {
                    let s = &self.seqs[&w.key];
                    let logits_from = s.logits_from(w.tokens);
                    let tokens = &s.tokens[s.computed..s.computed + w.tokens];
                    StepSeq { tokens, blocks: c.blocks, cached: s.computed, shared: s.shared, logits_from, exact: c.exact }
                })
                .collect();
            self.backend.forward(&mut batch)
        };
        // The masks were computed beside the forward pass (one that takes longer is waited
        // for inside the step's forward time).
        let (guides, masks) = self.masker.wait();
        let mut masks: HashMap<u64, Result<TokenSet, String>> = guides.iter().map(|(k, _)| *k).zip(masks).collect();
        for (key, guide) in guides {
            self.seqs.get_mut(&key).expect("scheduled sequences exist").guide = Some(guide);
        }
        let forward_secs = t_fwd.elapsed().as_secs_f64();
        // Before any event goes out: a client that sees its request end sees its steps counted.
        let m = &self.metrics;
        m.batch_size.observe(work.len() as f64);
        m.step_tokens.observe(work.iter().map(|w| w.tokens).sum::<usize>() as f64);
        m.step_forward.observe(forward_secs);
        let ranks = self.model.tensor_parallel_size();
        if ranks > 1 {
            m.observe_collectives(&(0..ranks).map(|r| self.model.rank(r).comm_stats().unwrap_or_default()).collect::<Vec<_>>());
        }
        match result {
            Ok(logits) => {
                for (w, l) in work.iter().zip(logits) {
                    self.after_forward(*w, &l, masks.remove(&w.key));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "forward pass failed");
                for w in &work {
                    self.fail(w.key, format!("forward pass failed: {e}"));
                }
            }
        }
        self.metrics.step_overhead.observe((t0.elapsed().as_secs_f64() - forward_secs).max(0.0));
    }

    /// The guides of the scheduled sequences that sample after this step (their last tokens
    /// are in it), taken out so that their masks can be computed during the forward pass.
    fn take_sampling_guides(&mut self, work: &[Work]) -> Vec<(u64, Guide)> {
        work.iter()
            .filter_map(|w| {
                let s = self.seqs.get_mut(&w.key)?;
                let samples = s.computed + w.tokens == s.tokens.len();
                samples.then(|| s.guide.take().map(|g| (w.key, g))).flatten()
            })
            .collect()
    }

    /// Commits a sequence's computed tokens and, at the end of its tokens, samples the next
    /// (with its structured output's `mask` when computed during the pass).
    fn after_forward(&mut self, w: Work, logits: &[f32], mask: Option<Result<TokenSet, String>>) {
        let tok = &self.model.tokenizer;
        let vocab = self.model.model.config().vocab_size;
        let s = self.seqs.get_mut(&w.key).expect("scheduled sequences exist");
        // The position of the first logits row.
        let start = s.computed + s.logits_from(w.tokens).unwrap_or(w.tokens);
        self.sched.commit(s, w.tokens);
        if s.wants_prompt_logprobs() {
            record_prompt_logprobs(s, tok, logits, vocab, start);
            if !s.wants_prompt_logprobs() {
                let _ = s.tx.send(Event::PromptLogprobs(s.prompt_logprobs.clone()));
            }
        }
        if s.computed < s.tokens.len() {
            return;
        }
        let last = &logits[logits.len() - vocab..];
        let followers = std::mem::take(&mut s.followers);
        if !followers.is_empty() {
            self.fork(w.key, &followers, last);
        }
        self.sample_next(w.key, last, mask);
    }

    /// Starts the other choices of `key`'s prompt, which `key` has just computed: each one
    /// shares its KV blocks and samples its first token from the same logits (`last`).
    fn fork(&mut self, key: u64, followers: &[u64], last: &[f32]) {
        let parent = self.seqs.remove(&key).expect("the parent exists");
        for &f in followers {
            let Some(s) = self.seqs.get_mut(&f) else { continue }; // aborted meanwhile
            if let Some((src, dst)) = self.sched.fork(&parent, s, &self.metrics) {
                if let Err(e) = self.backend.copy_block(src, dst) {
                    tracing::error!(error = %e, "KV block copy failed");
                    self.fail(f, format!("KV block copy failed: {e}"));
                    continue;
                }
            }
            if s.req.prompt_logprobs.is_some() {
                let _ = s.tx.send(Event::PromptLogprobs(s.prompt_logprobs.clone()));
            }
        }
        self.seqs.insert(key, parent);
        for &f in followers {
            if self.seqs.contains_key(&f) {
                self.sample_next(f, last, None);
            }
        }
    }

    /// Samples the next token of `key`, whose tokens are all computed, from `last` (its last
    /// position's logits) within its structured output's mask (`mask`, or computed here),
    /// streams it and checks the stop conditions.
    fn sample_next(&mut self, key: u64, last: &[f32], mask: Option<Result<TokenSet, String>>) {
        let tok = &self.model.tokenizer;
        let s = self.seqs.get_mut(&key).expect("sampled sequences exist");
        if s.req.max_tokens == 0 {
            return self.finish(key, FinishReason::Length, None);
        }
        let mut banned = Vec::new();
        if s.generated() < s.req.min_tokens {
            banned.extend(&s.req.stop_token_ids);
            if !s.req.ignore_eos {
                banned.extend(&self.model.weights.checkpoint.special.eos);
            }
        }
        let allowed = match mask.or_else(|| s.guide.as_mut().map(Guide::allowed)).transpose() {
            Ok(a) => a,
            Err(e) => return self.fail(key, e),
        };
        let sampled = s.sampler.sample_within(last, &banned, allowed.as_ref());
        let id = sampled.id;
        s.tokens.push(id);
        let complete = match s.guide.as_mut().map(|g| g.advance(id).map(|()| g.is_complete())) {
            Some(Err(e)) => return self.fail(key, e),
            Some(Ok(c)) => c,
            None => false,
        };
        let now = Instant::now();
        match s.last_token {
            None => self.metrics.ttft.observe((now - s.req.arrival).as_secs_f64()),
            Some(t) => self.metrics.inter_token.observe((now - t).as_secs_f64()),
        }
        s.first_token.get_or_insert(now);
        s.last_token = Some(now);
        self.metrics.generation_tokens.inc();

        let info = token_info(s.req.sampling.logprobs.is_some(), tok, &sampled);
        let stop_token = s.req.stop_token_ids.contains(&id) || (!s.req.ignore_eos && self.model.weights.checkpoint.special.eos.contains(&id));
        let check_stop = s.generated() >= s.req.min_tokens;
        let (text, finish) = if stop_token {
            (s.output.finish(tok, false).0, Some((FinishReason::Stop, Some(StopReason::Token(id)))))
        } else {
            match s.output.push(tok, id, check_stop) {
                (text, Some(st)) => (text, Some((FinishReason::Stop, Some(StopReason::Text(st))))),
                (mut text, None) if complete || s.generated() >= s.req.max_tokens || s.tokens.len() >= self.max_model_len => {
                    let (rest, hit) = s.output.finish(tok, check_stop);
                    text.push_str(&rest);
                    let end = match hit {
                        Some(st) => (FinishReason::Stop, Some(StopReason::Text(st))),
                        None if complete => (FinishReason::Stop, None),
                        None => (FinishReason::Length, None),
                    };
                    (text, Some(end))
                }
                (text, None) => (text, None),
            }
        };
        let _ = s.tx.send(Event::Delta { text, tokens: vec![info] });
        if let Some((reason, why)) = finish {
            self.finish(key, reason, why);
        }
    }

    /// Ends a request: final event, metrics, blocks freed.
    fn finish(&mut self, key: u64, reason: FinishReason, stop_reason: Option<StopReason>) {
        let Some(s) = self.sched.take(key, &mut self.seqs) else { return };
        let m = &self.metrics;
        m.success.with_label_values(&[reason.as_str()]).inc();
        m.e2e.observe(s.req.arrival.elapsed().as_secs_f64());
        let n = s.generated();
        if let (Some(a), Some(b)) = (s.first_token, s.last_token) {
            if n > 1 {
                m.tpot.observe((b - a).as_secs_f64() / (n - 1) as f64);
            }
        }
        let usage = Usage { prompt_tokens: s.req.prompt.len(), completion_tokens: n, cached_tokens: s.cached_tokens };
        // Gauges first: a client that sees the end also sees the blocks freed.
        self.update_gauges();
        let _ = s.tx.send(Event::Finished { reason, stop_reason, usage });
    }

    /// Ends a request with an error.
    fn fail(&mut self, key: u64, msg: String) {
        let Some(s) = self.sched.take(key, &mut self.seqs) else { return };
        self.update_gauges();
        let _ = s.tx.send(Event::Error(msg));
    }
}

/// The logprob record for a sampled token (text and logprobs only when asked for).
fn token_info(with_logprobs: bool, tok: &Tokenizer, s: &Sampled) -> TokenLogprob {
    if !with_logprobs {
        return TokenLogprob { id: s.id, text: String::new(), logprob: None, top: Vec::new() };
    }
    TokenLogprob {
        id: s.id,
        text: tok.decode(&[s.id]),
        logprob: s.logprob,
        top: s.top.iter().map(|&(i, l)| (tok.decode(&[i]), l)).collect(),
    }
}

/// Adds the logprobs of the prompt tokens that `logits` (rows for positions `start..`) predict.
fn record_prompt_logprobs(s: &mut Sequence, tok: &Tokenizer, logits: &[f32], vocab: usize, start: usize) {
    let n_top = s.req.prompt_logprobs.unwrap_or(0);
    let prompt = &s.req.prompt;
    // The first token (nothing predicts it) and those before `score_from` have no logprob.
    // Only the first one's text is decoded (echo shows it); nobody reads the others'.
    while s.prompt_logprobs.len() < s.req.score_from.max(1).min(prompt.len()) {
        let pos = s.prompt_logprobs.len();
        let id = prompt[pos];
        let text = if pos == 0 { tok.decode(&[id]) } else { String::new() };
        s.prompt_logprobs.push(TokenLogprob { id, text, logprob: None, top: Vec::new() });
    }
    for (i, row) in logits.chunks_exact(vocab).enumerate() {
        let target = start + i + 1;
        if target != s.prompt_logprobs.len() || target >= prompt.len() {
            continue;
        }
        let lse = logsumexp(row);
        let lp = |v: f32| (v as f64 - lse) as f32;
        let id = prompt[target];
        s.prompt_logprobs.push(TokenLogprob {
            id,
            text: tok.decode(&[id]),
            logprob: Some(lp(row[id as usize])),
            top: top_n(row, n_top).into_iter().map(|(i, v)| (tok.decode(&[i]), lp(v))).collect(),
        });
    }
}
