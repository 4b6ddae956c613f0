//! [`LocalComm`]: the ranks are threads of one process and exchange through shared memory.
//!
//! # Protocol
//!
//! Every collective is one or two *phases*. Each rank counts the phases it has entered
//! (`1, 2, 3, …`, the same sequence on every rank since all ranks call the same collectives in
//! the same order). To enter phase `m` a rank stores `m` into its arrival counter (release) and
//! spins until every other rank's counter is at least `m` (acquire): it has then *passed* `m`.
//!
//! Each rank owns two slots (a growable `f32` buffer and a length), indexed by phase parity.
//! Data a rank publishes for phase `m` goes in its slot `m % 2`, and the rules are:
//! - **write window**: rank `r` writes (or grows) its slot `m % 2` only after passing phase
//!   `m - 1` and before arriving at `m`;
//! - **read window**: other ranks read it only after passing `m` and before arriving at `m + 1`.
//!
//! Why reuse is safe: the next write of that slot is for phase `m + 2` at the earliest, so it
//! happens after its writer passed `m + 1`, i.e. after every rank arrived at `m + 1`, i.e.
//! after every read window of phase `m` closed. And a read of phase `m` starts after passing `m`,
//! so after the writer's release store, which follows its write. Writes and reads of a slot never
//! overlap, and each read happens-after the write it reads (release/acquire on the counters).
//! While a rank waits at `m`, the others are at `m` or `m + 1`, never further (passing `m + 1`
//! needs the waiting rank's arrival), which is what the two parities cover.
//!
//! The slots live in the group's shared state, not in the callers' buffers, so a rank that
//! panics or returns never leaves others reading freed memory; copying in costs one copy of the
//! buffer per call, and the slots grow to the largest call and are then reused (no allocation
//! per call once warm).
//!
//! # All-reduce paths
//!
//! - **Direct** (small buffers, decode): publish `buf`, one phase, then every rank sums all
//!   slots in rank order into its own `buf`.
//! - **Scatter** (large buffers, prefill): publish `buf`; after phase `m`, rank `r` sums its
//!   slice `r` of all slots in rank order into its *other* slot (parity `m + 1`, inside that
//!   slot's write window), enters phase `m + 1`, then copies every rank's reduced slice into
//!   `buf`. Each rank adds `1/world` of the elements instead of all of them.
//!
//! Both paths compute each element as `((x₀ + x₁) + x₂) + …`, so they give identical bits.
//!
//! # Failure
//!
//! [`LocalComm::abort`] sets a group-wide flag that every wait checks: the waiting ranks panic
//! with "a tensor-parallel rank failed" instead of spinning forever. A handle aborts its group
//! by itself when a panic unwinds through a collective or drops the handle, so a rank thread
//! that panics with its handle releases the others. Once aborted, a group stays unusable.

use super::{CommStats, Communicator, StatsCounter};
use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// All-reduces of at least this many floats (128 KiB) take the scatter path.
const SCATTER_MIN_LEN: usize = 1 << 15;

/// Busy-wait iterations between `yield_now`s (ranks may outnumber cores).
const SPINS_PER_YIELD: u32 = 256;

/// What a waiting rank panics with once its group is aborted.
const ABORT_MESSAGE: &str = "a tensor-parallel rank failed (its group was aborted); stopping this rank";

/// A value alone on its cache line, so one rank's writes do not slow other ranks' reads.
#[repr(align(64))]
struct Padded<T>(T);

/// One rank's published data for one phase parity.
#[derive(Default)]
struct Slot {
    /// Storage, grown to the largest publication and never shrunk.
    data: Vec<f32>,
    /// Floats published (a prefix of `data`).
    len: usize,
}

impl Slot {
    /// The published floats.
    fn published(&self) -> &[f32] {
        &self.data[..self.len]
    }

    /// Makes room for `len` floats, marks them published and returns them for writing.
    fn publish_len(&mut self, len: usize) -> &mut [f32] {
        if self.data.len() < len {
            // Contents are about to be overwritten: a fresh buffer, not a copying resize.
            self.data = vec![0.0; len.max(2 * self.data.len())];
        }
        self.len = len;
        &mut self.data[..len]
    }

    /// Publishes a copy of `src`.
    fn publish(&mut self, src: &[f32]) {
        self.publish_len(src.len()).copy_from_slice(src);
    }
}

/// State shared by a group's handles.
struct Shared {
    /// Per rank: the last phase it arrived at.
    arrived: Vec<Padded<AtomicU64>>,
    /// Per rank: its two slots, by phase parity.
    slots: Vec<Padded<[UnsafeCell<Slot>; 2]>>,
    /// Set by [`LocalComm::abort`]; checked by every wait.
    aborted: AtomicBool,
}

// SAFETY: the only non-`Sync` parts are the slots, and they are accessed under the protocol in
// the module docs: a slot is written by its owning rank only inside its write window, read by
// other ranks only inside read windows, and those windows never overlap; the arrival counters'
// release/acquire order each read after the write it reads. Each handle is used by one thread at
// a time (`LocalComm::enter` enforces it), so a rank's own accesses are sequential.
unsafe impl Sync for Shared {}

/// One rank's handle on an in-process group; see the [module docs](self) for the protocol.
///
/// Create a group with [`LocalComm::group`] and move each handle into its rank's thread.
pub struct LocalComm {
    shared: Arc<Shared>,
    rank: usize,
    /// The last phase this rank entered (only touched while `busy` is held).
    phase: AtomicU64,
    /// Held during a collective, so two threads cannot act as the same rank at once.
    busy: AtomicBool,
    stats: StatsCounter,
}

/// Which all-reduce algorithm to run.
#[derive(Clone, Copy, Debug)]
enum ReducePath {
    /// Every rank sums every slot.
    Direct,
    /// Reduce-scatter then all-gather.
    Scatter,
}

/// Releases a handle at the end of a collective, aborting the group if a panic unwinds.
struct Busy<'a>(&'a LocalComm);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort();
        }
        self.0.busy.store(false, Ordering::Release);
    }
}

/// The slice of `0..len` that rank `rank` of `world` reduces: balanced, the first `len % world`
/// ranks one element longer.
fn share(len: usize, world: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (len / world, len % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// `acc[i] += x[i]` for every `i`.
fn add_into(acc: &mut [f32], x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

impl LocalComm {
    /// A group of `world` ranks: one handle per rank, in rank order.
    pub fn group(world: usize) -> Vec<LocalComm> {
        assert!(world > 0, "a communicator group needs at least one rank");
        let shared = Arc::new(Shared {
            arrived: (0..world).map(|_| Padded(AtomicU64::new(0))).collect(),
            slots: (0..world).map(|_| Padded(Default::default())).collect(),
            aborted: AtomicBool::new(false),
        });
        (0..world)
            .map(|rank| LocalComm {
                shared: shared.clone(),
                rank,
                phase: AtomicU64::new(0),
                busy: AtomicBool::new(false),
                stats: StatsCounter::default(),
            })
            .collect()
    }

    /// Marks the group failed: every rank waiting in (or later entering) a collective panics
    /// with "a tensor-parallel rank failed". Call it when a rank's work fails without a panic.
    pub fn abort(&self) {
        self.shared.aborted.store(true, Ordering::Release);
    }

    /// Whether some rank aborted the group.
    pub fn is_aborted(&self) -> bool {
        self.shared.aborted.load(Ordering::Acquire)
    }

    /// Claims the handle for one collective (panics if another thread holds it).
    fn enter(&self) -> Busy<'_> {
        let taken = self.busy.swap(true, Ordering::Acquire);
        assert!(!taken, "a LocalComm handle was used by two threads at once; each rank's handle belongs to one thread");
        Busy(self)
    }

    /// The phase the next [`sync`](Self::sync) enters.
    fn next_phase(&self) -> u64 {
        self.phase.load(Ordering::Relaxed) + 1
    }

    /// Enters the next phase and waits until every rank has; returns it.
    fn sync(&self) -> u64 {
        let m = self.next_phase();
        self.phase.store(m, Ordering::Relaxed);
        self.shared.arrived[self.rank].0.store(m, Ordering::Release);
        for (j, arrived) in self.shared.arrived.iter().enumerate() {
            if j == self.rank {
                continue;
            }
            let mut spins = 0u32;
            while arrived.0.load(Ordering::Acquire) < m {
                if self.shared.aborted.load(Ordering::Relaxed) {
                    panic!("{ABORT_MESSAGE}");
                }
                spins += 1;
                if spins == SPINS_PER_YIELD {
                    spins = 0;
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        m
    }

    /// Rank `rank`'s slot for phase `phase`; dereference it only inside that slot's write window
    /// (own slot) or read window (see the module docs).
    fn slot(&self, rank: usize, phase: u64) -> *mut Slot {
        self.shared.slots[rank].0[(phase % 2) as usize].get()
    }

    /// Aborts the group and panics with `msg` (argument mismatch between ranks).
    fn fail(&self, msg: String) -> ! {
        self.abort();
        panic!("{msg}");
    }

    /// All-reduce by `path` (the trait method picks it by size; tests force each).
    fn all_reduce_by(&self, buf: &mut [f32], path: ReducePath) {
        let start = Instant::now();
        if self.world() > 1 {
            let _busy = self.enter();
            match path {
                ReducePath::Direct => self.reduce_direct(buf),
                ReducePath::Scatter => self.reduce_scatter(buf),
            }
        }
        self.stats.record(std::mem::size_of_val(buf), start);
    }

    /// Publishes `buf` for the next phase and enters it; returns the phase.
    fn publish_and_sync(&self, buf: &[f32]) -> u64 {
        // SAFETY: our own slot for the next phase, inside its write window (we passed the
        // previous phase and have not arrived at this one).
        unsafe { (*self.slot(self.rank, self.next_phase())).publish(buf) };
        self.sync()
    }

    /// Rank `j`'s slot published at `phase`, checked to hold `len` floats (as this rank's).
    ///
    /// # Safety
    /// Only inside the read window of `phase`, and the slice must not outlive it.
    unsafe fn input(&self, j: usize, phase: u64, len: usize) -> &[f32] {
        // SAFETY: the caller is inside the read window of `phase`.
        let s = unsafe { &*self.slot(j, phase) }.published();
        if s.len() != len {
            self.fail(format!("all_reduce_sum: rank {j} passed {} floats but rank {} passed {len}", s.len(), self.rank));
        }
        s
    }

    /// The direct path: one phase, every rank sums everything.
    fn reduce_direct(&self, buf: &mut [f32]) {
        let (len, m) = (buf.len(), self.publish_and_sync(buf));
        // SAFETY (every `input` below): inside the read window of `m` until we return.
        if self.rank != 0 {
            buf.copy_from_slice(unsafe { self.input(0, m, len) });
        }
        for j in 1..self.world() {
            add_into(buf, unsafe { self.input(j, m, len) });
        }
    }

    /// The scatter path: reduce our share into our other slot, then gather every share.
    fn reduce_scatter(&self, buf: &mut [f32]) {
        let (len, world) = (buf.len(), self.world());
        let m = self.publish_and_sync(buf);
        let mine = share(len, world, self.rank);
        // SAFETY: our own slot of parity `m + 1`, inside its write window (passed `m`, not
        // arrived at `m + 1`); it is none of the inputs (those have parity `m`).
        let acc = unsafe { (*self.slot(self.rank, m + 1)).publish_len(mine.len()) };
        // SAFETY (every `input` here): inside the read window of `m`; nothing read is kept past
        // the next `sync`.
        acc.copy_from_slice(&unsafe { self.input(0, m, len) }[mine.clone()]);
        for j in 1..world {
            add_into(acc, &unsafe { self.input(j, m, len) }[mine.clone()]);
        }
        let m1 = self.sync();
        for j in 0..world {
            // SAFETY: inside the read window of `m1` until we return.
            let reduced = unsafe { &*self.slot(j, m1) }.published();
            buf[share(len, world, j)].copy_from_slice(reduced);
        }
    }
}

impl Drop for LocalComm {
    /// A handle dropped by a panicking thread aborts its group, releasing the other ranks.
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort();
        }
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.arrived.len()
    }

    /// Direct path below 32 Ki floats, reduce-scatter + all-gather from there; same bits either way.
    fn all_reduce_sum(&self, buf: &mut [f32]) {
        let path = if buf.len() >= SCATTER_MIN_LEN { ReducePath::Scatter } else { ReducePath::Direct };
        self.all_reduce_by(buf, path);
    }

    fn all_gather(&self, part: &[f32], out: &mut Vec<f32>) {
        let start = Instant::now();
        out.clear();
        if self.world() == 1 {
            out.extend_from_slice(part);
        } else {
            let _busy = self.enter();
            let m = self.publish_and_sync(part);
            let world = self.world();
            // SAFETY (both loops): inside the read window of `m` until we return.
            let part_of = |j: usize| unsafe { &*self.slot(j, m) }.published();
            out.reserve((0..world).map(|j| part_of(j).len()).sum());
            for j in 0..world {
                out.extend_from_slice(part_of(j));
            }
        }
        self.stats.record(std::mem::size_of_val(part), start);
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) {
        let start = Instant::now();
        if root >= self.world() {
            self.fail(format!("broadcast from rank {root} in a group of {}", self.world()));
        }
        if self.world() > 1 {
            let _busy = self.enter();
            if self.rank == root {
                self.publish_and_sync(buf);
            } else {
                let m = self.sync();
                // SAFETY: inside the read window of `m` until we return.
                let src = unsafe { &*self.slot(root, m) }.published();
                if src.len() != buf.len() {
                    self.fail(format!("broadcast: root {root} sent {} floats but rank {} expects {}", src.len(), self.rank, buf.len()));
                }
                buf.copy_from_slice(src);
            }
        }
        let contributed = if self.rank == root { std::mem::size_of_val(buf) } else { 0 };
        self.stats.record(contributed, start);
    }

    fn barrier(&self) {
        let start = Instant::now();
        if self.world() > 1 {
            let _busy = self.enter();
            self.sync();
        }
        self.stats.record(0, start);
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }
}

#[cfg(test)]
mod tests {
    //! Exactness: all-reduce is compared bit for bit (tolerance 0) with a scalar sum in rank
    //! order, since the order is fixed; gather and broadcast only copy, so they are exact too.
    //! Inputs are N(0, 1)-ish random floats (never zero), different on every rank.

    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc;
    use std::time::Duration;

    /// `n` random floats in ±[0.5, 4), never zero, with both signs so sums cancel.
    fn random(r: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| r.gen_range(0.5f32..4.0) * if r.gen() { 1.0 } else { -1.0 }).collect()
    }

    /// The reference: per element, `x₀ + x₁ + …` left to right.
    fn rank_order_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
        let mut acc = inputs[0].clone();
        for x in &inputs[1..] {
            for (a, b) in acc.iter_mut().zip(x) {
                *a += b;
            }
        }
        acc
    }

    /// Bitwise equality, naming the first differing element.
    fn assert_bits(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!("{what}: element {i} is {} but the rank-order sum is {}", got[i], want[i]);
        }
    }

    /// Runs `f(comm)` on one thread per rank of a fresh group; returns each rank's result.
    fn on_ranks<T: Send>(world: usize, f: impl Fn(&LocalComm) -> T + Sync) -> Vec<T> {
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = LocalComm::group(world).into_iter().map(|c| s.spawn(move || f(&c))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn share_covers_every_element_once() {
        for (len, world) in [(0, 3), (1, 4), (7, 3), (1000, 3), (65536, 4)] {
            let mut next = 0;
            for r in 0..world {
                let s = share(len, world, r);
                assert_eq!(s.start, next);
                assert!(s.len() == len / world || s.len() == len / world + 1);
                next = s.end;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn all_reduce_is_the_rank_order_sum_on_both_paths() {
        for world in [2, 3, 4] {
            for len in [1usize, 7, 1000, 1 << 16, 1 << 20] {
                let mut r = ChaCha8Rng::seed_from_u64((world * 1_000_003 + len) as u64);
                let inputs: Vec<Vec<f32>> = (0..world).map(|_| random(&mut r, len)).collect();
                let want = rank_order_sum(&inputs);
                let results = on_ranks(world, |c| {
                    let mut auto = inputs[c.rank()].clone();
                    c.all_reduce_sum(&mut auto);
                    let mut direct = inputs[c.rank()].clone();
                    c.all_reduce_by(&mut direct, ReducePath::Direct);
                    let mut scatter = inputs[c.rank()].clone();
                    c.all_reduce_by(&mut scatter, ReducePath::Scatter);
                    [auto, direct, scatter]
                });
                for (rank, per_path) in results.iter().enumerate() {
                    for (path, got) in ["auto", "direct", "scatter"].iter().zip(per_path) {
                        assert_bits(got, &want, &format!("world {world} len {len} rank {rank} {path}"));
                    }
                }
            }
        }
    }

    #[test]
    fn slot_reuse_survives_many_calls_of_changing_sizes() {
        let world = 3;
        let iters = 1000;
        // Mostly decode-sized, some scatter-sized, so both paths and slot growth interleave.
        let mut r = ChaCha8Rng::seed_from_u64(7);
        let sizes: Vec<usize> = (0..iters)
            .map(|i| if i % 50 == 49 { r.gen_range(SCATTER_MIN_LEN..SCATTER_MIN_LEN + 5000) } else { r.gen_range(1..3000) })
            .collect();
        let failures = on_ranks(world, |c| {
            let mut r = ChaCha8Rng::seed_from_u64(100);
            let mut bad = 0;
            for &n in &sizes {
                // Every rank draws all ranks' inputs from one stream, so each knows the answer.
                let inputs: Vec<Vec<f32>> = (0..world).map(|_| random(&mut r, n)).collect();
                let mut buf = inputs[c.rank()].clone();
                c.all_reduce_sum(&mut buf);
                let want = rank_order_sum(&inputs);
                bad += usize::from(buf.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()));
            }
            bad
        });
        assert_eq!(failures, vec![0; world], "calls with a wrong result, per rank");
    }

    #[test]
    fn all_gather_concatenates_uneven_parts_in_rank_order() {
        for world in [1, 2, 3, 4] {
            let lens: Vec<usize> = (0..world).map(|r| [5, 0, 1000, 3][r]).collect();
            let mut r = ChaCha8Rng::seed_from_u64(world as u64);
            let parts: Vec<Vec<f32>> = lens.iter().map(|&n| random(&mut r, n)).collect();
            let want: Vec<f32> = parts.concat();
            let got = on_ranks(world, |c| {
                // Start from stale contents, which must be replaced.
                let mut out = vec![9.0; 17];
                c.all_gather(&parts[c.rank()], &mut out);
                c.all_gather(&parts[c.rank()], &mut out);
                out
            });
            for (rank, out) in got.iter().enumerate() {
                assert_bits(out, &want, &format!("world {world} rank {rank}"));
            }
        }
    }

    #[test]
    fn broadcast_from_each_root() {
        let world = 3;
        let mut r = ChaCha8Rng::seed_from_u64(11);
        let inputs: Vec<Vec<f32>> = (0..world).map(|_| random(&mut r, 777)).collect();
        let got = on_ranks(world, |c| {
            (0..world)
                .map(|root| {
                    let mut buf = inputs[c.rank()].clone();
                    c.broadcast(&mut buf, root);
                    buf
                })
                .collect::<Vec<_>>()
        });
        for (rank, per_root) in got.iter().enumerate() {
            for (root, buf) in per_root.iter().enumerate() {
                assert_bits(buf, &inputs[root], &format!("rank {rank} root {root}"));
            }
        }
    }

    #[test]
    fn barrier_waits_for_every_rank() {
        let world = 4;
        let rounds = 50;
        let arrived: Vec<AtomicUsize> = (0..rounds).map(|_| AtomicUsize::new(0)).collect();
        on_ranks(world, |c| {
            for count in &arrived {
                count.fetch_add(1, Ordering::SeqCst);
                c.barrier();
                assert_eq!(count.load(Ordering::SeqCst), world, "a rank left the barrier early");
            }
        });
    }

    #[test]
    fn stats_count_calls_bytes_and_time() {
        let stats = on_ranks(2, |c| {
            let mut buf = vec![1.5f32; 100];
            c.all_reduce_sum(&mut buf);
            c.all_reduce_sum(&mut buf[..10]);
            let mut out = Vec::new();
            c.all_gather(&buf[..c.rank() + 1], &mut out);
            c.broadcast(&mut buf, 1);
            c.barrier();
            c.stats()
        });
        for (rank, s) in stats.iter().enumerate() {
            assert_eq!(s.calls, 5);
            let broadcast = if rank == 1 { 400 } else { 0 };
            assert_eq!(s.bytes, 400 + 40 + 4 * (rank as u64 + 1) + broadcast, "rank {rank}");
            assert!(s.nanos > 0);
        }
        // World 1: counted, no waiting.
        let solo = LocalComm::group(1).pop().unwrap();
        let mut buf = vec![2.5f32; 8];
        solo.all_reduce_sum(&mut buf);
        assert_eq!(buf, vec![2.5f32; 8]);
        solo.barrier();
        assert_eq!((solo.stats().calls, solo.stats().bytes), (2, 32));
    }

    /// Runs `rank0` on its own thread and returns its panic message, failing if it takes more
    /// than 10 s (it would otherwise hang forever).
    fn panic_message_within_timeout(rank0: LocalComm) -> String {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut buf = vec![1.25f32; 64];
                rank0.all_reduce_sum(&mut buf);
            }));
            let msg = match res {
                Ok(()) => "no panic".to_string(),
                Err(e) => e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default(),
            };
            tx.send(msg).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("the surviving rank hung instead of panicking")
    }

    #[test]
    fn abort_releases_a_waiting_rank() {
        let mut comms = LocalComm::group(2);
        let rank1 = comms.pop().unwrap();
        let rank0 = comms.pop().unwrap();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            rank1.abort();
        });
        let msg = panic_message_within_timeout(rank0);
        aborter.join().unwrap();
        assert!(msg.contains("a tensor-parallel rank failed"), "{msg}");
    }

    #[test]
    fn a_panicking_rank_releases_the_others() {
        let mut comms = LocalComm::group(2);
        let rank1 = comms.pop().unwrap();
        let rank0 = comms.pop().unwrap();
        let failing = std::thread::spawn(move || {
            let _comm = rank1;
            std::thread::sleep(Duration::from_millis(20));
            panic!("rank 1's forward pass failed (deliberately, in a test)");
        });
        let msg = panic_message_within_timeout(rank0);
        assert!(failing.join().is_err());
        assert!(msg.contains("a tensor-parallel rank failed"), "{msg}");
    }

    #[test]
    fn mismatched_lengths_panic_on_every_rank() {
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = LocalComm::group(2)
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let mut buf = vec![0.75f32; 10 + c.rank()];
                        c.all_reduce_sum(&mut buf);
                        c.barrier();
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().is_err()).collect::<Vec<_>>()
        });
        assert_eq!(results, vec![true, true]);
    }
}
