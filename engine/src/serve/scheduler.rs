//! Which sequences run in the next step, and with how many tokens.
//!
//! Iteration-level scheduling: running sequences first, oldest first (one token for a
//! decode, one prefill chunk for a prompt), then waiting sequences in arrival order while
//! the token budget, the sequence cap and the free blocks allow. When blocks run out, the
//! newest running sequence is preempted: its blocks are freed and it goes back to the front
//! of the queue to be recomputed later. Blocks are asked of the [`KvCacheManager`] by sequence
//! key (a cached prefix, slots for more tokens, a fork, a free); the scheduler keeps only each
//! sequence's progress (`computed`, `shared`).
//!
//! Prefill chunks have a fixed size (`chunk`) that never depends on what else runs, and every
//! kernel computes a sequence's rows independently of the rest of the batch, so batching
//! never changes a sequence's results.

use super::metrics::Metrics;
use super::sequence::Sequence;
use crate::kv_cache::KvCacheManager;
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

/// Queue state plus the KV cache manager.
pub(crate) struct Scheduler {
    limits: Limits,
    /// Every sequence's blocks, prefix caching and exact keys.
    pub kv: KvCacheManager,
    /// Waiting sequences, front first.
    pub waiting: VecDeque<u64>,
    /// Running sequences, oldest admission first.
    pub running: Vec<u64>,
    /// New requests not yet admitted (shared with the handle, which caps it).
    queued: Arc<AtomicUsize>,
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
    /// A scheduler over the blocks of `kv`.
    pub fn new(limits: Limits, kv: KvCacheManager, queued: Arc<AtomicUsize>) -> Self {
        Scheduler { limits, kv, waiting: VecDeque::new(), running: Vec::new(), queued }
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
        self.evict(seq);
    }

    /// Frees `s`'s blocks: its tokens are computed again when it runs next.
    fn evict(&mut self, s: &mut Sequence) {
        self.kv.free(s.key);
        s.computed = 0;
        s.shared = 0;
    }

    /// Tokens a sequence computes next: the rest of its prompt in fixed chunks, else one.
    fn next_tokens(&self, s: &Sequence) -> usize {
        let left = s.tokens.len() - s.computed;
        // Chunk boundaries are multiples of `chunk` from the first uncached token.
        let into = (s.computed - s.shared) % self.limits.chunk;
        left.min(self.limits.chunk - into)
    }

    /// Makes sure `s` has blocks for `n` more tokens.
    fn grow(&mut self, s: &Sequence, n: usize) -> bool {
        self.kv.allocate_slots(s.key, s.computed + n).is_ok()
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
            let mut fits = self.grow(&seqs[&key], n);
            while !fits {
                let victim = self.running.pop().expect("this sequence is running");
                self.evict(seqs.get_mut(&victim).expect("running sequences exist"));
                self.waiting.push_front(victim);
                metrics.preemptions.inc();
                preempted = true;
                tracing::debug!(seq = victim, "preempted for lack of KV blocks");
                if victim == key {
                    break;
                }
                fits = self.grow(&seqs[&key], n);
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
            let looked_up = s.computed == 0 && s.req.prompt_logprobs.is_none();
            if looked_up {
                let hit = self.kv.lookup_prefix(key, &s.tokens);
                s.computed = hit;
                s.shared = hit;
            }
            let n = self.next_tokens(s);
            if n > budget || !self.grow(s, n) {
                self.evict(s);
                break;
            }
            if looked_up && self.kv.prefix_caching() {
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

    /// Commits `n` tokens of `s` just computed (the KV cache manager registers its newly full
    /// blocks in the prefix cache).
    pub fn commit(&mut self, s: &mut Sequence, n: usize) {
        s.computed += n;
        self.kv.commit(s.key, &s.tokens, s.computed);
    }

    /// Admits `f`, another choice of `parent`'s prompt, as a fork of `parent`, which has just
    /// computed that prompt and nothing more: `f` takes references to the parent's full blocks,
    /// a private block for the partial last one (returned as `(source, destination)` for the
    /// backend to copy), the parent's exact keys and prompt logprobs, and runs after the
    /// others. Without a free block for the copy it waits at the front of the queue to
    /// compute its tokens itself, as a preempted sequence does.
    pub fn fork(&mut self, parent: &Sequence, f: &mut Sequence, metrics: &Metrics) -> Option<(u32, u32)> {
        debug_assert!(parent.computed == parent.req.prompt.len() && parent.tokens.len() == parent.computed);
        debug_assert!(f.req.prompt == parent.req.prompt && f.computed == 0 && self.kv.block_table(f.key).is_empty());
        if !f.admitted {
            f.admitted = true;
            self.queued.fetch_sub(1, Ordering::Relaxed);
            metrics.queue.observe(f.req.arrival.elapsed().as_secs_f64());
        }
        f.cached_tokens = parent.cached_tokens;
        f.prompt_logprobs.clone_from(&parent.prompt_logprobs);
        let Some(fork) = self.kv.fork(parent.key, f.key, parent.computed) else {
            self.waiting.push_front(f.key);
            return None;
        };
        f.computed = parent.computed;
        f.shared = fork.shared;
        self.running.push(f.key);
        fork.copy
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
                sched: Scheduler::new(limits, KvCacheManager::new(NUM_BLOCKS, BS, prefix_caching), queued.clone()),
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
            let table = self.sched.kv.block_table(s.key);
            for p in 0..s.computed {
                let b = table[p / BS] as usize;
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
                let table = self.sched.kv.block_table(s.key);
                assert!(table.len() * BS >= s.computed + w.tokens, "seq {} lacks blocks", s.key);
                self.check_contents(s);
                for p in s.computed..s.computed + w.tokens {
                    let b = table[p / BS];
                    assert!(p >= s.shared, "seq {} writes shared position {p}", s.key);
                    assert_eq!(self.sched.kv.refs(b), 1, "seq {} writes block {b} that others hold", s.key);
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
                        assert_eq!(src, self.sched.kv.block_table(s.key)[s.computed / BS]);
                        self.shadow[dst as usize] = self.shadow[src as usize].clone();
                    }
                    if !self.sched.kv.block_table(f).is_empty() {
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

        /// The bookkeeping agrees with the sequences: every reference is a live sequence's,
        /// exactly the running sequences hold cache state, every sequence is in exactly one
        /// place, the queue count is the unadmitted sequences.
        fn check(&self) {
            let kv = &self.sched.kv;
            kv.check_invariants();
            let mut refs = [0u32; NUM_BLOCKS];
            for s in self.seqs.values() {
                for &b in kv.block_table(s.key) {
                    refs[b as usize] += 1;
                }
            }
            for (b, &r) in refs.iter().enumerate() {
                assert_eq!(kv.refs(b as u32), r, "block {b}: refcount vs live sequences' tables");
            }
            assert_eq!(kv.num_used(), refs.iter().filter(|&&r| r > 0).count());
            let mut holders: Vec<u64> = kv.sequences().collect();
            let mut running = self.sched.running.clone();
            holders.sort_unstable();
            running.sort_unstable();
            assert_eq!(holders, running, "cache state held by other than the running sequences");
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
                    assert!(s.computed == 0 && s.shared == 0, "waiting seq {k} keeps cache progress");
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
        assert_eq!(sim.sched.kv.num_used(), 0, "seed {seed}: blocks leaked");
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
