//! Fork-join pools for the many short parallel regions of a forward pass.
//!
//! A decode step runs a few hundred regions of 20-200 µs each (one per fused matrix, one per
//! attention call, ...). Rayon puts an idle worker to sleep on a futex after about 30 µs of
//! yielding, so nearly every region paid a wake-up: `perf` at batch 8 put 10% of all cycles in
//! `futex_wake` and the woken thread's scheduling, and two threads ran batch-8 decode only
//! 1.26x faster than one. Here the helper threads spin on an epoch counter for `SPIN` (2 ms) after
//! their last task before they park, as OpenMP runtimes and llama.cpp's thread pool do, so
//! back-to-back regions hand work over through shared memory alone.
//!
//! Kernels call [`for_each`] and [`map`], which run on the calling thread's pool: the one it
//! [`install`]ed, or else the global pool, started on first use, never freed, and sized from
//! Rayon's thread count (the single-rank serving path). Tensor-parallel ranks each create a
//! [`ThreadPool`] with their own helper threads, optionally pinned to the rank's CPUs, and
//! install it on the rank's thread, so ranks neither share helpers nor queue behind each other.
//! A per-rank pool's helpers stop when its last handle is dropped (an installed pool is held by
//! its thread until that thread exits).
//!
//! One region runs on a pool at a time: a call made while the pool is busy (from inside a task,
//! or from another thread) runs its tasks inline on the calling thread, so nesting cannot
//! deadlock; a call from a helper thread (a task that nests) always runs inline. Tasks are
//! claimed one index at a time from an atomic counter; a panic in any task is re-raised on the
//! caller once every task has finished.

use std::any::Any;
use std::cell::RefCell;
use std::io;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::affinity::pin_current_thread;

/// How long an idle helper spins for the next region before it parks.
const SPIN: Duration = Duration::from_millis(2);

/// Spin iterations between clock reads while waiting.
const SPINS_PER_CHECK: u32 = 256;

/// One parallel region: `f(i)` for `i` in `0..n`.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job<'_> {
    /// Claims and runs tasks until none are left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.n {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
                let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                if first.is_none() {
                    *first = Some(p);
                } else {
                    // Dropping a payload runs foreign code that may panic again, which would
                    // unwind out of the region while other threads still use the job.
                    std::mem::forget(p);
                }
            }
            self.done.fetch_add(1, SeqCst);
        }
    }
}

/// State shared by the caller and the helpers.
struct Pool {
    helpers: usize,
    /// The running region, null between regions. Its lifetime is erased: the caller keeps the
    /// job alive until `entered` shows no helper can still be reading it.
    job: AtomicPtr<Job<'static>>,
    /// Bumped once per region (and once at shutdown); helpers wait for it to change.
    epoch: AtomicUsize,
    /// Helpers between reading `job` and being done with it.
    entered: AtomicUsize,
    /// Helpers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    /// Set when the pool's last handle is dropped: helpers leave their loop.
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    /// Held by the thread whose region is running.
    busy: Mutex<()>,
}

static POOL: OnceLock<&'static Pool> = OnceLock::new();

/// The global pool, started on first use with one thread fewer than Rayon's global pool (the
/// caller is the last one), so `RAYON_NUM_THREADS` sizes both.
fn global() -> &'static Pool {
    POOL.get_or_init(|| {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        let pool: &'static Pool = Box::leak(Box::new(Pool::new(helpers)));
        for h in 0..helpers {
            std::thread::Builder::new()
                .name(format!("tessera-pool-{h}"))
                .spawn(move || {
                    mark_helper();
                    pool.help()
                })
                .expect("spawn a pool thread");
        }
        pool
    })
}

/// What [`for_each`] runs on for the current thread.
#[derive(Clone)]
enum Local {
    /// The global pool.
    Global,
    /// A pool installed with [`install`].
    Installed(Arc<ThreadPool>),
    /// This is a helper thread: its calls come from inside a task and run inline.
    Helper,
}

thread_local! {
    static LOCAL: RefCell<Local> = const { RefCell::new(Local::Global) };
}

/// Marks the current thread as a pool helper.
fn mark_helper() {
    LOCAL.with(|l| *l.borrow_mut() = Local::Helper);
}

impl Pool {
    /// An idle pool for `helpers` helper threads (spawned by the caller).
    fn new(helpers: usize) -> Pool {
        Pool {
            helpers,
            job: AtomicPtr::new(std::ptr::null_mut()),
            epoch: AtomicUsize::new(0),
            entered: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            busy: Mutex::new(()),
        }
    }

    /// A helper's loop: wait for a new epoch, work on the region it announces, repeat until
    /// shutdown.
    fn help(&self) {
        let mut seen = 0;
        loop {
            seen = self.next_epoch(seen);
            if self.shutdown.load(SeqCst) {
                return;
            }
            self.entered.fetch_add(1, SeqCst);
            let job = self.job.load(SeqCst);
            if !job.is_null() {
                // SAFETY: the caller clears `job` before it waits for `entered` to reach zero,
                // so a job seen here after entering stays alive until this helper leaves.
                unsafe { (*job).work() };
            }
            self.entered.fetch_sub(1, SeqCst);
        }
    }

    /// Waits until the epoch differs from `seen` (spinning, then parked) and returns it.
    fn next_epoch(&self, seen: usize) -> usize {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = self.epoch.load(SeqCst);
            if e != seen {
                return e;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(SPINS_PER_CHECK) && start.elapsed() > SPIN {
                let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                self.sleepers.fetch_add(1, SeqCst);
                while self.epoch.load(SeqCst) == seen {
                    guard = self.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                self.sleepers.fetch_sub(1, SeqCst);
            }
        }
    }

    /// Runs `job` with the helpers when the pool is free and has any, else inline.
    fn run_or_inline(&self, job: &Job<'_>) {
        let guard = if job.n > 1 && self.helpers > 0 { self.busy.try_lock().ok() } else { None };
        match guard {
            Some(_busy) => self.run(job),
            None => job.work(),
        }
    }

    /// Runs `job` with the helpers; the caller works too and returns when every task is done
    /// and no helper still holds the job.
    fn run(&self, job: &Job<'_>) {
        // SAFETY (lifetime erasure): see `job`'s field doc; cleared below before returning.
        let erased = job as *const Job<'_> as *mut Job<'static>;
        self.job.store(erased, SeqCst);
        self.epoch.fetch_add(1, SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
        job.work();
        spin_until(|| job.done.load(SeqCst) == job.n);
        self.job.store(std::ptr::null_mut(), SeqCst);
        spin_until(|| self.entered.load(SeqCst) == 0);
    }
}

/// Spins (yielding now and then) until `ready` holds; the waits here are a task's length.
fn spin_until(ready: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(SPINS_PER_CHECK) {
            std::thread::yield_now();
        }
    }
}

/// A pool of its own for one thread (a tensor-parallel rank): the thread that [`install`]s it
/// plus `threads - 1` helper threads. Dropping the last handle stops and joins the helpers.
pub struct ThreadPool {
    state: Arc<Pool>,
    handles: Vec<JoinHandle<()>>,
    cpus: Option<Vec<usize>>,
}

/// Numbers per-rank pools for their helper threads' names.
static NEXT_POOL_ID: AtomicUsize = AtomicUsize::new(0);

impl ThreadPool {
    /// Starts a pool of `threads` threads in all: the installing thread and `threads - 1`
    /// helpers (none for 1: everything runs inline).
    ///
    /// With `cpus`, every thread is pinned to one CPU of the set, as OpenMP's close binding in
    /// vLLM and SGLang does: the installing thread to `cpus[0]` and helper `h` to
    /// `cpus[(h + 1) % cpus.len()]` (threads beyond the set wrap around and share). Fails when
    /// `threads` is 0, `cpus` is empty, or a helper cannot be pinned (a CPU outside the
    /// process's allowed set); helpers already started are stopped again.
    pub fn new(threads: usize, cpus: Option<Vec<usize>>) -> io::Result<ThreadPool> {
        if threads == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a thread pool needs at least one thread"));
        }
        if cpus.as_ref().is_some_and(Vec::is_empty) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a thread pool cannot be bound to no CPUs"));
        }
        let helpers = threads - 1;
        let id = NEXT_POOL_ID.fetch_add(1, SeqCst);
        let mut pool = ThreadPool { state: Arc::new(Pool::new(helpers)), handles: Vec::with_capacity(helpers), cpus };
        let (pinned_tx, pinned_rx) = mpsc::channel();
        for h in 0..helpers {
            let state = Arc::clone(&pool.state);
            let cpu = pool.cpus.as_ref().map(|c| c[(h + 1) % c.len()]);
            let pinned_tx = pinned_tx.clone();
            let handle = std::thread::Builder::new().name(format!("tessera-tp{id}-{h}")).spawn(move || {
                mark_helper();
                let pinned = cpu.map_or(Ok(()), |c| pin_current_thread(&[c]));
                // The receiver lives until every helper has answered.
                let _ = pinned_tx.send(pinned);
                state.help();
            })?;
            pool.handles.push(handle);
        }
        for _ in 0..helpers {
            pinned_rx.recv().map_err(|_| io::Error::other("a pool thread died before starting"))??;
        }
        Ok(pool)
    }

    /// Threads in the pool, the installing one included.
    pub fn threads(&self) -> usize {
        self.state.helpers + 1
    }

    /// The CPUs the pool's threads are pinned to, if any.
    pub fn cpus(&self) -> Option<&[usize]> {
        self.cpus.as_deref()
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let state = &self.state;
        state.shutdown.store(true, SeqCst);
        state.epoch.fetch_add(1, SeqCst);
        {
            let _guard = state.lock.lock().unwrap_or_else(|e| e.into_inner());
            state.wake.notify_all();
        }
        let me = std::thread::current().id();
        for handle in self.handles.drain(..) {
            // A task that drops the last handle on a helper cannot wait for itself; that
            // helper leaves its loop once the task returns.
            if handle.thread().id() != me {
                let _ = handle.join();
            }
        }
    }
}

/// Makes [`for_each`] and [`map`] called from this thread run on `pool` for the rest of the
/// thread's life (or until another install), instead of on the global pool; the thread keeps
/// a handle, so the pool lives at least as long. With CPUs given to the pool, the thread is
/// pinned to the first of them (and stays pinned after the pool is gone). Fails on a helper
/// thread (inside a task) or when pinning fails, leaving the thread's pool unchanged.
pub fn install(pool: &Arc<ThreadPool>) -> io::Result<()> {
    if LOCAL.with(|l| matches!(*l.borrow(), Local::Helper)) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "a pool helper thread cannot install a pool"));
    }
    if let Some(cpus) = pool.cpus() {
        pin_current_thread(&cpus[..1])?;
    }
    // Replaced outside the borrow: dropping the old pool joins its helpers.
    let old = LOCAL.with(|l| std::mem::replace(&mut *l.borrow_mut(), Local::Installed(Arc::clone(pool))));
    drop(old);
    Ok(())
}

/// The threads that run [`for_each`]'s tasks from this thread, itself included: its installed
/// pool's, the global pool's, or 1 on a helper thread (whose calls run inline).
pub fn current_threads() -> usize {
    match LOCAL.try_with(|l| l.borrow().clone()).unwrap_or(Local::Global) {
        Local::Global => global().helpers + 1,
        Local::Installed(pool) => pool.threads(),
        Local::Helper => 1,
    }
}

/// Runs `f(i)` for every `i` in `0..n` on the calling thread's pool (see the module docs) and
/// the calling thread, and returns when all have finished. Tasks run in no particular order
/// and on any of the pool's threads; a panicking task's payload is re-raised here after the
/// others finish.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    let job = Job { f: &f, n, next: AtomicUsize::new(0), done: AtomicUsize::new(0), panic: Mutex::new(None) };
    // During thread-local teardown (a destructor that runs kernels) the global pool serves.
    match LOCAL.try_with(|l| l.borrow().clone()).unwrap_or(Local::Global) {
        Local::Global => global().run_or_inline(&job),
        Local::Installed(pool) => pool.state.run_or_inline(&job),
        Local::Helper => job.work(),
    }
    if let Some(p) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
        resume_unwind(p);
    }
}

/// Runs `f(i, piece)` for the `i`-th `len`-long piece of `data` (the last may be shorter), the
/// pieces in parallel as in [`for_each`]: row-wise work over one output buffer without raw
/// pointers.
///
/// # Panics
/// If `len` is zero.
pub fn for_each_chunk<T: Send>(data: &mut [T], len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    // One uncontended lock per piece: each task takes only its own.
    let pieces: Vec<Mutex<&mut [T]>> = data.chunks_mut(len).map(Mutex::new).collect();
    for_each(pieces.len(), |i| f(i, &mut pieces[i].lock().unwrap_or_else(|e| e.into_inner())));
}

/// [`for_each`] collecting `f(i)` in index order.
pub fn map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let slots: Vec<Mutex<Option<T>>> = (0..n).map(|_| Mutex::new(None)).collect();
    for_each(n, |i| *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(f(i)));
    slots.into_iter().map(|s| s.into_inner().unwrap_or_else(|e| e.into_inner()).expect("every task ran")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_runs_once() {
        for n in [0, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each(n, |i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "n = {n}");
        }
    }

    #[test]
    fn chunks_are_disjoint_and_cover_the_buffer() {
        for (n, len) in [(0, 3), (1, 1), (10, 3), (64, 16), (100, 7)] {
            let mut data = vec![usize::MAX; n];
            for_each_chunk(&mut data, len, |i, piece| {
                assert!(piece.len() == len || (i + 1) * len >= n, "only the last piece is short");
                for (j, x) in piece.iter_mut().enumerate() {
                    assert_eq!(*x, usize::MAX, "element written twice");
                    *x = i * len + j;
                }
            });
            assert_eq!(data, (0..n).collect::<Vec<_>>(), "n = {n}, len = {len}");
        }
    }

    #[test]
    fn map_keeps_index_order() {
        let v = map(257, |i| i * i);
        assert_eq!(v, (0..257).map(|i| i * i).collect::<Vec<_>>());
    }

    #[test]
    fn nested_and_concurrent_calls_finish() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..50 {
                        for_each(8, |_| {
                            for_each(4, |_| {
                                total.fetch_add(1, SeqCst);
                            })
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(SeqCst), 3 * 50 * 8 * 4);
    }

    /// Two tasks that each wait for the other to start: they finish only if a helper runs
    /// one of them while the caller runs the other. Returns what `probe` saw on the two
    /// threads when they met.
    fn rendezvous_with<T: Send>(timeout: Duration, probe: impl Fn() -> T + Sync) -> Option<Vec<T>> {
        let started = AtomicUsize::new(0);
        let met = AtomicUsize::new(0);
        let seen = map(2, |_| {
            started.fetch_add(1, SeqCst);
            let t = Instant::now();
            while started.load(SeqCst) < 2 {
                if t.elapsed() > timeout {
                    return None;
                }
                std::hint::spin_loop();
            }
            met.fetch_add(1, SeqCst);
            Some(probe())
        });
        if met.load(SeqCst) == 2 { seen.into_iter().collect() } else { None }
    }

    fn rendezvous(timeout: Duration) -> bool {
        rendezvous_with(timeout, || ()).is_some()
    }

    /// The current thread's name.
    fn name() -> String {
        std::thread::current().name().unwrap_or("").to_string()
    }

    /// Runs `f` on a new thread that has installed `pool` (which it keeps).
    fn on_rank<T: Send>(pool: ThreadPool, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(move || {
                install(&Arc::new(pool)).expect("install");
                f()
            })
            .join()
            .expect("rank thread")
        })
    }

    #[test]
    fn a_parked_helper_wakes_for_the_next_region() {
        if global().helpers == 0 {
            return;
        }
        // Other tests in this process may hold the pool at that moment (their call then runs
        // inline and cannot meet), so a few attempts are allowed; a helper that never wakes
        // fails every one.
        let met = (0..10).any(|_| {
            std::thread::sleep(SPIN * 3);
            rendezvous(Duration::from_millis(500))
        });
        assert!(met, "no helper took the second task after parking");
    }

    #[test]
    fn a_task_panic_reaches_the_caller_after_the_others_finish() {
        let done = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            for_each(32, |i| {
                if i == 5 {
                    panic!("task five");
                }
                done.fetch_add(1, SeqCst);
            })
        }));
        let msg = r.expect_err("the panic propagates");
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"task five"));
        assert_eq!(done.load(SeqCst), 31);
        // The pool is usable afterwards.
        assert_eq!(map(3, |i| i + 1), vec![1, 2, 3]);
    }

    #[test]
    fn an_installed_pool_runs_tasks_on_its_own_helpers() {
        on_rank(ThreadPool::new(2, None).unwrap(), || {
            let me = name();
            let names = (0..10)
                .find_map(|_| rendezvous_with(Duration::from_secs(1), name))
                .expect("no helper of the installed pool took a task");
            assert!(names.contains(&me), "{names:?}");
            assert!(names.iter().any(|n| n.starts_with("tessera-tp")), "{names:?}");
            // Every task of a larger region runs on the rank thread or the pool's helper.
            let all = map(200, |_| name());
            assert!(all.iter().all(|n| *n == me || n.starts_with("tessera-tp")), "{all:?}");
        });
    }

    #[test]
    fn a_one_thread_pool_runs_inline() {
        let pool = ThreadPool::new(1, None).unwrap();
        assert_eq!(pool.threads(), 1);
        on_rank(pool, || {
            let me = std::thread::current().id();
            assert!(map(64, |_| std::thread::current().id()).iter().all(|t| *t == me));
        });
    }

    #[test]
    fn ranks_with_their_own_pools_run_regions_at_the_same_time() {
        // Each rank runs one 2-task region; every task waits until all four have started. They
        // can only all meet if both ranks' regions run at once, each on its caller and its own
        // helper: with one shared pool the second region would run inline and never meet.
        let ready = std::sync::Barrier::new(2);
        let started = AtomicUsize::new(0);
        let names: Vec<Option<String>> = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        install(&Arc::new(ThreadPool::new(2, None).unwrap())).unwrap();
                        ready.wait();
                        map(2, |_| {
                            started.fetch_add(1, SeqCst);
                            let t = Instant::now();
                            while started.load(SeqCst) < 4 {
                                if t.elapsed() > Duration::from_secs(10) {
                                    return None;
                                }
                                std::hint::spin_loop();
                            }
                            Some(name())
                        })
                    })
                })
                .collect();
            ranks.into_iter().flat_map(|r| r.join().unwrap()).collect()
        });
        let names: Vec<String> = names.into_iter().collect::<Option<_>>().expect("the ranks' regions never overlapped");
        let helpers: std::collections::BTreeSet<&String> = names.iter().filter(|n| n.starts_with("tessera-tp")).collect();
        assert_eq!(helpers.len(), 2, "each rank's own helper should take a task: {names:?}");
    }

    #[test]
    fn nesting_inside_an_installed_pool_finishes() {
        let total = on_rank(ThreadPool::new(3, None).unwrap(), || {
            let total = AtomicUsize::new(0);
            for _ in 0..50 {
                for_each(8, |_| {
                    let inner = map(4, |j| j);
                    total.fetch_add(inner.iter().sum::<usize>(), SeqCst);
                    for_each(2, |_| {
                        total.fetch_add(1, SeqCst);
                    });
                });
            }
            total.into_inner()
        });
        assert_eq!(total, 50 * 8 * (6 + 2));
    }

    #[test]
    fn dropping_a_pool_stops_its_helpers() {
        // Helpers hold the pool state until they leave their loop, so a dead weak reference
        // right after the drop shows they have all exited.
        let spinning = ThreadPool::new(3, None).unwrap();
        let state = Arc::downgrade(&spinning.state);
        drop(spinning);
        assert!(state.upgrade().is_none(), "a spinning helper outlived its pool");

        let parked = ThreadPool::new(3, None).unwrap();
        let state = Arc::downgrade(&parked.state);
        std::thread::sleep(SPIN * 5);
        drop(parked);
        assert!(state.upgrade().is_none(), "a parked helper outlived its pool");

        // An installed pool lives until its thread exits, then goes the same way.
        let pool = ThreadPool::new(2, None).unwrap();
        let state = Arc::downgrade(&pool.state);
        assert_eq!(on_rank(pool, || map(10, |i| i).len()), 10);
        assert!(state.upgrade().is_none(), "an installed pool outlived its thread");
    }

    #[test]
    fn bad_pool_arguments_are_refused() {
        assert!(ThreadPool::new(0, None).is_err());
        assert!(ThreadPool::new(2, Some(vec![])).is_err());
        #[cfg(target_os = "linux")]
        {
            // A helper that cannot be pinned fails the pool (and the other helpers stop).
            let err = ThreadPool::new(3, Some(vec![0, 1_000_000])).err().expect("CPU out of range");
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        }
    }

    #[test]
    fn an_installed_pool_pins_its_threads() {
        use crate::cpu::affinity::current_thread_cpus;
        let allowed = match current_thread_cpus() {
            Ok(cpus) if !cpus.is_empty() => cpus,
            other => {
                println!("skipped: thread affinity cannot be read here ({other:?})");
                return;
            }
        };
        let (mine, helper) = (*allowed.last().unwrap(), allowed[0]);
        let pool = ThreadPool::new(2, Some(vec![mine, helper])).unwrap();
        assert_eq!(pool.cpus(), Some(&[mine, helper][..]));
        std::thread::scope(|s| {
            s.spawn(|| {
                if let Err(e) = install(&Arc::new(pool)) {
                    println!("skipped: pinning is not permitted here ({e})");
                    return;
                }
                assert_eq!(current_thread_cpus().unwrap(), vec![mine]);
                let seen = (0..10)
                    .find_map(|_| rendezvous_with(Duration::from_secs(1), || current_thread_cpus().unwrap()))
                    .expect("no helper took a task");
                assert!(seen.contains(&vec![mine]) && seen.contains(&vec![helper]), "{seen:?}");
            });
        });
    }
}
