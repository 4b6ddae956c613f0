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
        // Forks can leave more sequences running than one step takes (the newest wait).
        while i < self.running.len() && work.len() < self.limits.max_seqs {
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

    /// Commits `n` tokens of `s` just computed and registers its newly full blocks in the
    /// prefix cache (the first with its exact sink keys, for key formats that keep them).
    pub fn commit(&mut self, s: &mut Sequence, n: usize) {
        let bs = self.blocks.block_size();
        s.computed += n;
        while (s.registered + 1) * bs <= s.computed {
            let b = s.registered;
            s.chain = self.blocks.register(s.blocks[b], s.chain, &s.tokens[b * bs..(b + 1) * bs]);
            if let Some(keys) = s.exact.as_ref().filter(|_| b == 0).and_then(|e| e.sink_keys()) {
                self.blocks.attach_sink(s.blocks[0], keys);
            }
            s.registered += 1;
        }
    }

    /// Admits `f`, another choice of `parent`'s prompt, as a fork of `parent`, which has just
    /// computed that prompt and nothing more: `f` takes references to the parent's full blocks,
    /// a private block for the partial last one (returned as `(source, destination)` for the
    /// backend to copy), the parent's exact keys and prompt logprobs, and runs after the
    /// others. Without a free block for the copy it waits at the front of the queue to
    /// compute its tokens itself, as a preempted sequence does.
    pub fn fork(&mut self, parent: &Sequence, f: &mut Sequence, metrics: &Metrics) -> Option<(u32, u32)> {
        debug_assert!(parent.computed == parent.req.prompt.len() && parent.tokens.len() == parent.computed);
        debug_assert!(f.req.prompt == parent.req.prompt && f.computed == 0 && f.blocks.is_empty());
        if !f.admitted {
            f.admitted = true;
            self.queued.fetch_sub(1, Ordering::Relaxed);
            metrics.queue.observe(f.req.arrival.elapsed().as_secs_f64());
        }
        f.cached_tokens = parent.cached_tokens;
        f.prompt_logprobs.clone_from(&parent.prompt_logprobs);
        let bs = self.blocks.block_size();
        let full = parent.computed / bs;
        let partial = !parent.computed.is_multiple_of(bs);
        let Some(private) = self.blocks.allocate(usize::from(partial)) else {
            self.waiting.push_front(f.key);
            return None;
        };
        self.blocks.share(&parent.blocks[..full]);
        f.blocks = parent.blocks[..full].to_vec();
        f.blocks.extend(&private);
        f.computed = parent.computed;
        f.shared = full * bs;
        f.registered = parent.registered;
        f.chain = parent.chain;
        f.exact.clone_from(&parent.exact);
        self.running.push(f.key);
        private.first().map(|&dst| (parent.blocks[full], dst))
    }

    /// Removes a sequence (finished, aborted or failed) from the queues and frees its blocks.
    /// Followers still waiting for its prompt pass to the first of them, which takes its place
    /// in the queue.
    pub fn take(&mut self, key: u64, seqs: &mut HashMap<u64, Sequence>) -> Option<Sequence> {
        let at = self.waiting.iter().position(|&k| k == key).unwrap_or(0);
        let mut s = seqs.remove(&key)?;
        self.remove(&mut s);
        let mut followers = std::mem::take(&mut s.followers).into_iter().filter(|k| seqs.contains_key(k));
        if let Some(first) = followers.next() {
            seqs.get_mut(&first).expect("checked").followers = followers.collect();
            self.waiting.insert(at, first);
        }
        Some(s)
    }
}

/// Property tests: seeded random workloads (arrivals with n-choice groups and shared
/// prefixes, aborts, a pool small enough to preempt) driven through the scheduler the way the
/// engine loop drives it, with a shadow of every block's contents instead of a model.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::SamplingParams;
    use crate::serve::GenRequest;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::collections::HashSet;

    const BS: usize = 4;
    const NUM_BLOCKS: usize = 24;
    const MAX_WAITING: usize = 12;

    /// How a sequence ended.
    #[derive(Debug, PartialEq)]
    enum End {
        Finished,
        Aborted,
        Failed,
    }

    struct Sim {
        rng: ChaCha8Rng,
        sched: Scheduler,
        seqs: HashMap<u64, Sequence>,
        metrics: Metrics,
        queued: Arc<AtomicUsize>,
        next_key: u64,
        /// Every submitted key, and how it ended once it did.
        ends: HashMap<u64, Option<End>>,
        /// What each block holds: the token at each slot (`None`: never written).
        shadow: Vec<Vec<Option<u32>>>,
        /// Prefills of prompts with followers, and forks made.
        group_prefills: usize,
        forks: usize,
    }

    impl Sim {
        fn new(seed: u64, prefix_caching: bool, max_seqs: usize, max_tokens: usize) -> Sim {
            let queued = Arc::new(AtomicUsize::new(0));
            let limits = Limits { max_seqs, max_tokens, chunk: max_tokens - max_seqs };
            Sim {
                rng: ChaCha8Rng::seed_from_u64(seed),
                sched: Scheduler::new(limits, BlockManager::new(NUM_BLOCKS, BS, prefix_caching), queued.clone()),
                seqs: HashMap::new(),
                metrics: Metrics::new(&[], &[], 0.0).unwrap(),
                queued,
                next_key: 1,
                ends: HashMap::new(),
                shadow: vec![vec![None; BS]; NUM_BLOCKS],
                group_prefills: 0,
                forks: 0,
            }
        }

        fn new_seq(&mut self, prompt: &[u32], max_tokens: usize, prompt_logprobs: Option<usize>) -> Sequence {
            let key = self.next_key;
            self.next_key += 1;
            self.ends.insert(key, None);
            let mut req = GenRequest::new(key.to_string(), prompt.to_vec(), SamplingParams::greedy(), max_tokens);
            req.prompt_logprobs = prompt_logprobs;
            let (tx, _) = tokio::sync::mpsc::unbounded_channel();
            Sequence::new(key, req, tx)
        }

        /// A request of 1-4 choices whose prompt often starts like earlier ones, queued the way
        /// the handle and the engine loop queue it (refused when the queue has no room).
        fn arrive(&mut self) {
            let n = if self.rng.gen_bool(0.4) { self.rng.gen_range(2..=4) } else { 1 };
            if self.queued.load(Ordering::Relaxed) + n > MAX_WAITING {
                return;
            }
            let base = self.rng.gen_range(0..3u32);
            let len = self.rng.gen_range(1..=40);
            let mut prompt: Vec<u32> = (0..len as u32).map(|i| base * 100 + i).collect();
            if self.rng.gen_bool(0.5) {
                let at = self.rng.gen_range(0..len);
                prompt[at] = 999;
            }
            let max_tokens = self.rng.gen_range(0..=24);
            let logprobs = self.rng.gen_bool(0.2).then_some(1);
            if max_tokens == 0 && logprobs.is_none() {
                return; // answered by the handle without queueing
            }
            self.queued.fetch_add(n, Ordering::Relaxed);
            let mut lead = self.new_seq(&prompt, max_tokens, logprobs);
            let followers: Vec<Sequence> = (1..n).map(|_| self.new_seq(&prompt, max_tokens, logprobs)).collect();
            lead.followers = followers.iter().map(|f| f.key).collect();
            self.sched.waiting.push_back(lead.key);
            self.seqs.insert(lead.key, lead);
            self.seqs.extend(followers.into_iter().map(|f| (f.key, f)));
        }

        fn end(&mut self, key: u64, how: End) {
            assert!(self.sched.take(key, &mut self.seqs).is_some(), "{key} ends twice");
            let e = self.ends.get_mut(&key).expect("submitted");
            assert!(e.is_none(), "{key} already ended: {e:?}");
            *e = Some(how);
        }

        fn abort_one(&mut self) {
            let mut keys: Vec<u64> = self.seqs.keys().copied().collect();
            keys.sort_unstable();
            if !keys.is_empty() {
                let k = keys[self.rng.gen_range(0..keys.len())];
                self.end(k, End::Aborted);
            }
        }

        /// The blocks a sequence's cached positions live in hold its tokens.
        fn check_contents(&self, s: &Sequence) {
            for p in 0..s.computed {
                let b = s.blocks[p / BS] as usize;
                assert_eq!(self.shadow[b][p % BS], Some(s.tokens[p]), "seq {} position {p} in block {b}", s.key);
            }
        }

        /// One engine step: schedule, "forward" (write the shadow), commit, fork, sample.
        fn step(&mut self) {
            let work = self.sched.schedule(&mut self.seqs, &self.metrics);
            let keys: HashSet<u64> = work.iter().map(|w| w.key).collect();
            assert_eq!(keys.len(), work.len(), "a sequence scheduled twice");
            assert!(work.len() <= self.sched.limits.max_seqs, "{} sequences in one step", work.len());
            assert!(work.iter().map(|w| w.tokens).sum::<usize>() <= self.sched.limits.max_tokens);
            if work.is_empty() {
                if self.sched.running.is_empty() {
                    if let Some(&key) = self.sched.waiting.front() {
                        self.end(key, End::Failed);
                    }
                }
                return;
            }
            for w in &work {
                assert!(self.sched.running.contains(&w.key));
                let s = &self.seqs[&w.key];
                assert!(w.tokens > 0 && s.computed + w.tokens <= s.tokens.len());
                assert!(s.blocks.len() * BS >= s.computed + w.tokens, "seq {} lacks blocks", s.key);
                self.check_contents(s);
                for p in s.computed..s.computed + w.tokens {
                    let b = s.blocks[p / BS];
                    assert!(p >= s.shared, "seq {} writes shared position {p}", s.key);
                    assert_eq!(self.sched.blocks.refs(b), 1, "seq {} writes block {b} that others hold", s.key);
                    self.shadow[b as usize][p % BS] = Some(s.tokens[p]);
                }
            }
            for w in work {
                let Some(mut s) = self.seqs.remove(&w.key) else { continue };
                self.sched.commit(&mut s, w.tokens);
                if s.computed < s.tokens.len() {
                    self.seqs.insert(w.key, s);
                    continue;
                }
                let followers = std::mem::take(&mut s.followers);
                if !followers.is_empty() {
                    self.group_prefills += 1;
                }
                for &f in &followers {
                    let Some(fs) = self.seqs.get_mut(&f) else { continue };
                    if let Some((src, dst)) = self.sched.fork(&s, fs, &self.metrics) {
                        assert_eq!(src, s.blocks[s.computed / BS]);
                        self.shadow[dst as usize] = self.shadow[src as usize].clone();
                    }
                    if !self.seqs[&f].blocks.is_empty() {
                        self.forks += 1;
                        self.check_contents(&self.seqs[&f]);
                    }
                }
                self.seqs.insert(w.key, s);
                for key in std::iter::once(w.key).chain(followers) {
                    let Some(s) = self.seqs.get_mut(&key) else { continue };
                    if s.req.max_tokens > 0 {
                        let t = self.rng.gen_range(0..5);
                        s.tokens.push(t);
                    }
                    if s.generated() >= s.req.max_tokens {
                        self.end(key, End::Finished);
                    }
                }
            }
        }

        /// The bookkeeping agrees with the sequences: every reference is a sequence's, every
        /// sequence is in exactly one place, the queue count is the unadmitted sequences.
        fn check(&self) {
            let bm = &self.sched.blocks;
            bm.check_invariants();
            let mut refs = [0u32; NUM_BLOCKS];
            for s in self.seqs.values() {
                for &b in &s.blocks {
                    refs[b as usize] += 1;
                }
            }
            for (b, &r) in refs.iter().enumerate() {
                assert_eq!(bm.refs(b as u32), r, "block {b}: refcount vs block tables");
            }
            assert_eq!(bm.num_used(), refs.iter().filter(|&&r| r > 0).count());
            let mut place: HashMap<u64, usize> = HashMap::new();
            for &k in self.sched.waiting.iter().chain(&self.sched.running) {
                *place.entry(k).or_default() += 1;
            }
            for s in self.seqs.values() {
                for &f in &s.followers {
                    assert_eq!(s.generated(), 0, "followers outlive their leader's prefill");
                    if self.seqs.contains_key(&f) {
                        *place.entry(f).or_default() += 1;
                    }
                }
            }
            for (k, s) in &self.seqs {
                assert_eq!(place.get(k), Some(&1), "seq {k} is in {:?} places", place.get(k));
                if self.sched.waiting.contains(k) {
                    assert!(s.blocks.is_empty() && s.computed == 0, "waiting seq {k} holds blocks");
                }
                if self.sched.running.contains(k) {
                    self.check_contents(s);
                }
            }
            assert!(place.keys().all(|k| self.seqs.contains_key(k)), "a queue holds an ended sequence");
            let unadmitted = self.seqs.values().filter(|s| !s.admitted).count();
            assert_eq!(self.queued.load(Ordering::Relaxed), unadmitted);
        }
    }

    fn run(seed: u64, prefix_caching: bool) -> Sim {
        let mut sim = Sim::new(seed, prefix_caching, 3 + seed as usize % 4, 16);
        for _ in 0..300 {
            let r = sim.rng.gen_range(0..100);
            if r < 25 {
                sim.arrive();
            } else if r < 30 {
                sim.abort_one();
            } else {
                sim.step();
            }
            sim.check();
        }
        let mut steps = 0;
        while !sim.seqs.is_empty() {
            sim.step();
            sim.check();
            steps += 1;
            assert!(steps < 10_000, "seed {seed}: no progress; waiting {:?} running {:?}", sim.sched.waiting, sim.sched.running);
        }
        assert!(sim.ends.values().all(Option::is_some), "seed {seed}: a request never ended");
        assert!(!sim.ends.values().any(|e| *e == Some(End::Failed)), "seed {seed}: every request fits the pool alone");
        assert_eq!(sim.sched.blocks.num_used(), 0, "seed {seed}: blocks leaked");
        assert_eq!(sim.queued.load(Ordering::Relaxed), 0);
        sim
    }

    /// Random workloads keep the block and queue bookkeeping exact, every cached position holds
    /// its sequence's token (prefix hits and forks included), no step writes a shared block,
    /// every request ends with a reason, and the pool drains.
    #[test]
    fn random_workloads_keep_blocks_and_queues_consistent() {
        let (mut preemptions, mut forks, mut prefills, mut hits) = (0, 0, 0, 0);
        for seed in 0..200 {
            let sim = run(seed, seed % 4 != 3);
            preemptions += sim.metrics.preemptions.get();
            hits += sim.metrics.prefix_hits.get();
            forks += sim.forks;
            prefills += sim.group_prefills;
        }
        // The workloads exercise what they are meant to.
        assert!(preemptions > 100 && hits > 100 && prefills > 100 && forks > prefills, "{preemptions} {hits} {prefills} {forks}");
    }
}
