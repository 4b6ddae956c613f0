//! A fork-join pool for the many short parallel regions of a forward pass.
//!
//! A decode step runs a few hundred regions of 20-200 µs each (one per fused matrix, one per
//! attention call, ...). Rayon puts an idle worker to sleep on a futex after about 30 µs of
//! yielding, so nearly every region paid a wake-up: `perf` at batch 8 put 10% of all cycles in
//! `futex_wake` and the woken thread's scheduling, and two threads ran batch-8 decode only
//! 1.26x faster than one. Here the helper threads spin on an epoch counter for `SPIN` (2 ms) after
//! their last task before they park, as OpenMP runtimes and llama.cpp's thread pool do, so
//! back-to-back regions hand work over through shared memory alone.
//!
//! One region runs at a time: a call made while the pool is busy (from inside a task, or from
//! another thread) runs its tasks inline on the calling thread, so nesting cannot deadlock.
//! Tasks are claimed one index at a time from an atomic counter; a panic in any task is
//! re-raised on the caller once every task has finished.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

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
    /// Bumped once per region; helpers wait for it to change.
    epoch: AtomicUsize,
    /// Helpers between reading `job` and being done with it.
    entered: AtomicUsize,
    /// Helpers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// Held by the thread whose region is running.
    busy: Mutex<()>,
}

static POOL: OnceLock<&'static Pool> = OnceLock::new();

/// The pool, started on first use with one thread fewer than Rayon's global pool (the caller
/// is the last one), so `RAYON_NUM_THREADS` sizes both.
fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            helpers,
            job: AtomicPtr::new(std::ptr::null_mut()),
            epoch: AtomicUsize::new(0),
            entered: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            busy: Mutex::new(()),
        }));
        for h in 0..helpers {
            std::thread::Builder::new()
                .name(format!("tessera-pool-{h}"))
                .spawn(move || pool.help())
                .expect("spawn a pool thread");
        }
        pool
    })
}

impl Pool {
    /// A helper's loop: wait for a new epoch, work on the region it announces, repeat.
    fn help(&self) {
        let mut seen = 0;
        loop {
            seen = self.next_epoch(seen);
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

/// Runs `f(i)` for every `i` in `0..n` on the pool's helpers and the calling thread, and
/// returns when all have finished. Tasks run in no particular order and on any thread; a
/// panicking task's payload is re-raised here after the others finish.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    let pool = pool();
    let guard = if n > 1 && pool.helpers > 0 { pool.busy.try_lock().ok() } else { None };
    let job = Job { f: &f, n, next: AtomicUsize::new(0), done: AtomicUsize::new(0), panic: Mutex::new(None) };
    match guard {
        Some(_busy) => pool.run(&job),
        None => job.work(),
    }
    if let Some(p) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
        resume_unwind(p);
    }
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
    /// one of them while the caller runs the other.
    fn rendezvous(timeout: Duration) -> bool {
        let started = AtomicUsize::new(0);
        let met = AtomicUsize::new(0);
        for_each(2, |_| {
            started.fetch_add(1, SeqCst);
            let t = Instant::now();
            while started.load(SeqCst) < 2 {
                if t.elapsed() > timeout {
                    return;
                }
                std::hint::spin_loop();
            }
            met.fetch_add(1, SeqCst);
        });
        met.load(SeqCst) == 2
    }

    #[test]
    fn a_parked_helper_wakes_for_the_next_region() {
        if pool().helpers == 0 {
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
}
