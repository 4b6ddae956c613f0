//! Tensor parallelism on the CPU: one model sharded over N ranks inside one process.
//!
//! Each rank is a long-lived thread with its own kernel thread pool, pinned to its own cores
//! (`--cpu-bind "0-31|32-63"`, else one NUMA node per rank, else an even split of the cores),
//! holding its [`Shard`] of every layer. The ranks run SPMD: [`Ranks::run`] hands the same
//! closure to every rank, and each rank's forward pass meets the others in the same
//! collectives (an all-reduce after the attention output and after the feed-forward, an
//! all-gather of the logits) over shared memory. Sums go in rank order, so every rank holds the
//! same bits and a run is reproducible.
//!
//! Scheduling, the prefix cache and HTTP stay one: the engine thread asks the ranks to step and
//! takes rank 0's logits (every rank has the same).

use crate::checkpoint::LoadError;
use crate::model::shard::Shard;
use crate::model::LlamaModel;
use crate::weights::ModelWeights;
use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use tessera_kernels::comm::{Communicator, LocalComm};
use tessera_kernels::cpu::affinity::{auto_cpu_split, parse_cpu_bind};
use tessera_kernels::cpu::pool::{self, ThreadPool};
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::linear::LinearPolicy;

/// How to run a model over several ranks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TpOptions {
    /// Ranks (1: no tensor parallelism).
    pub size: usize,
    /// CPUs per rank in vLLM's `VLLM_CPU_OMP_THREADS_BIND` form (`"0-31|32-63"`); `None`: one
    /// NUMA node per rank when there are enough, else an even split of the usable CPUs.
    pub cpu_bind: Option<String>,
}

impl TpOptions {
    /// Each rank's CPUs.
    pub fn cpu_sets(&self) -> Result<Vec<Vec<usize>>, String> {
        match &self.cpu_bind {
            Some(spec) => {
                let sets = parse_cpu_bind(spec)?;
                if sets.len() != self.size {
                    return Err(format!("--cpu-bind names {} ranks for a tensor-parallel size of {}", sets.len(), self.size));
                }
                Ok(sets)
            }
            None => {
                let split = auto_cpu_split(self.size);
                if split.shared {
                    tracing::warn!(ranks = self.size, "fewer CPUs than tensor-parallel ranks: ranks share CPUs");
                }
                Ok(split.ranks)
            }
        }
    }
}

/// A closure every rank runs once, its lifetime erased (see [`Workers::run`]).
type Task = &'static (dyn Fn(usize) + Sync);

/// Counts finished ranks and keeps the first panic.
#[derive(Default)]
struct Latch {
    state: Mutex<(usize, Option<Box<dyn Any + Send>>)>,
    done: Condvar,
}

/// The rank threads.
struct Workers {
    senders: Vec<Sender<(Task, Arc<Latch>)>>,
    threads: Vec<JoinHandle<()>>,
    /// Held for a whole SPMD run: two callers' tasks must not interleave on the ranks (each
    /// rank would meet the other caller's collectives).
    running: Mutex<()>,
}

impl Workers {
    /// One thread per rank, each with a kernel pool over its CPUs (pinned), aborting `comms`
    /// (so the other ranks stop waiting) when its task panics.
    fn start(cpus: Vec<Vec<usize>>, comms: Vec<Arc<LocalComm>>) -> Self {
        let (mut senders, mut threads) = (Vec::new(), Vec::new());
        for (rank, (set, comm)) in cpus.into_iter().zip(comms).enumerate() {
            let (tx, rx) = channel::<(Task, Arc<Latch>)>();
            let thread = std::thread::Builder::new()
                .name(format!("tessera-rank-{rank}"))
                .spawn(move || {
                    crate::model::shard::set_current_rank(rank);
                    let threads = set.len().max(1);
                    let pinned = ThreadPool::new(threads, Some(set.clone())).and_then(|p| pool::install(&Arc::new(p)));
                    if let Err(e) = pinned {
                        tracing::warn!(rank, cpus = ?set, error = %e, "cannot pin the rank's threads; running unpinned");
                        if let Err(e) = ThreadPool::new(threads, None).and_then(|p| pool::install(&Arc::new(p))) {
                            tracing::warn!(rank, error = %e, "no pool of its own for the rank; it shares the global one");
                        }
                    }
                    while let Ok((task, latch)) = rx.recv() {
                        let r = catch_unwind(AssertUnwindSafe(|| task(rank)));
                        let mut s = latch.state.lock().unwrap_or_else(|e| e.into_inner());
                        if let Err(p) = r {
                            comm.abort();
                            s.1.get_or_insert(p);
                        }
                        s.0 += 1;
                        latch.done.notify_all();
                    }
                })
                .expect("spawn a tensor-parallel rank thread");
            senders.push(tx);
            threads.push(thread);
        }
        Workers { senders, threads, running: Mutex::new(()) }
    }

    /// Runs `f(rank)` on every rank thread at once and returns when all have finished,
    /// re-raising the first panic. Calls from several threads take turns.
    fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let _turn = self.running.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY (lifetime erasure): every rank finishes with `f` (returning or unwinding into
        // its `catch_unwind`) before it counts itself done, and this function returns only once
        // every rank has counted, so `f` outlives each use.
        let task: Task = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Task>(f) };
        let latch = Arc::new(Latch::default());
        for tx in &self.senders {
            tx.send((task, latch.clone())).expect("rank threads live as long as the group");
        }
        let mut s = latch.state.lock().unwrap_or_else(|e| e.into_inner());
        while s.0 < self.senders.len() {
            s = latch.done.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(p) = s.1.take() {
            drop(s);
            resume_unwind(p);
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.senders.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Ranks 1.. of a tensor-parallel model (rank 0's shard is the [`crate::LoadedModel`]'s model)
/// and the threads all ranks run on.
pub struct Ranks {
    others: Vec<LlamaModel>,
    workers: Workers,
}

impl Ranks {
    /// Loads every rank's shard of `weights` on its own thread (so its weights are first touched
    /// on its cores' memory); returns rank 0's shard and the group.
    pub fn load(weights: &ModelWeights, caps: &CpuCaps, policy: LinearPolicy, opts: &TpOptions) -> Result<(LlamaModel, Ranks), LoadError> {
        let world = opts.size;
        let cpus = opts.cpu_sets().map_err(|msg| LoadError::Config { key: "cpu_bind".into(), msg })?;
        for (r, set) in cpus.iter().enumerate() {
            tracing::info!(rank = r, cpus = ?set, "tensor-parallel rank");
        }
        let shards = (0..world).map(|r| Shard::new(&weights.checkpoint.config, r, world)).collect::<Result<Vec<_>, _>>()?;
        let comms: Vec<Arc<LocalComm>> = LocalComm::group(world).into_iter().map(Arc::new).collect();
        let workers = Workers::start(cpus, comms.clone());
        let loaded: Vec<Mutex<Option<Result<LlamaModel, LoadError>>>> = (0..world).map(|_| Mutex::new(None)).collect();
        workers.run(&|r| {
            let comm: Arc<dyn Communicator> = comms[r].clone();
            let m = LlamaModel::load_rank(weights, caps, policy, Some((shards[r].clone(), comm)));
            *loaded[r].lock().unwrap_or_else(|e| e.into_inner()) = Some(m);
        });
        let mut models = loaded
            .into_iter()
            .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every rank ran"))
            .collect::<Result<Vec<_>, _>>()?;
        let first = models.remove(0);
        Ok((first, Ranks { others: models, workers }))
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.others.len() + 1
    }

    /// Runs `f` on every rank's shard at once (rank 0's is `first`), each on its own thread,
    /// and returns the results in rank order. All ranks must make the same collective calls.
    pub fn run<R: Send>(&self, first: &LlamaModel, f: impl Fn(&LlamaModel) -> R + Sync) -> Vec<R> {
        let out: Vec<Mutex<Option<R>>> = (0..self.world()).map(|_| Mutex::new(None)).collect();
        self.workers.run(&|r| {
            let m = if r == 0 { first } else { &self.others[r - 1] };
            *out[r].lock().unwrap_or_else(|e| e.into_inner()) = Some(f(m));
        });
        out.into_iter().map(|o| o.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every rank ran")).collect()
    }

    /// Rank `r`'s shard, for `r >= 1`.
    pub fn other(&self, r: usize) -> &LlamaModel {
        &self.others[r - 1]
    }
}
