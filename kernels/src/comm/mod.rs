//! Collectives between the ranks of one tensor-parallel model.
//!
//! Tensor parallelism runs N ranks of a model in one process, each rank a long-lived thread,
//! and every rank calls the same collectives at the same points of its forward pass (Megatron:
//! an all-reduce sum after the attention output projection and after the MLP down projection,
//! an all-gather of vocab-parallel logits). The forward pass sees them through [`Communicator`]:
//! - [`local`]: [`LocalComm`], ranks as threads exchanging through shared memory (CPU ranks);
//! - [`nccl`]: [`NcclComm`], GPU ranks through NCCL on device buffers (its own methods, since the
//!   trait works on host slices).

pub mod local;
pub mod nccl;

pub use local::LocalComm;
pub use nccl::NcclComm;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// One rank's collective counters since its handle was created (for metrics: all-reduce time
/// per step, bytes moved).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    /// Collective calls made by this rank (barriers included).
    pub calls: u64,
    /// Bytes this rank contributed: its buffer or part size (a broadcast counts on its root only).
    pub bytes: u64,
    /// Wall time spent inside collectives, waiting for other ranks included, in nanoseconds.
    pub nanos: u64,
}

/// The collectives a tensor-parallel rank calls on host `f32` buffers.
///
/// Every rank of a group must call the same collectives in the same order with matching
/// arguments (equal buffer lengths for [`all_reduce_sum`](Self::all_reduce_sum) and
/// [`broadcast`](Self::broadcast), the same root); a mismatch panics or gives garbage, never
/// memory unsafety. A group of world size 1 never synchronizes.
pub trait Communicator: Send + Sync {
    /// This rank's index, `0..world()`.
    fn rank(&self) -> usize;

    /// The number of ranks in the group.
    fn world(&self) -> usize;

    /// Replaces `buf` on every rank by the element-wise sum of every rank's `buf`.
    ///
    /// Deterministic: each element is summed in rank order, `((x₀ + x₁) + x₂) + …`, whatever
    /// the buffer size or path taken, so every rank ends with the same bits and a run is
    /// reproducible.
    fn all_reduce_sum(&self, buf: &mut [f32]);

    /// Sets `out` to the concatenation of every rank's `part`, in rank order. Parts may have
    /// different lengths (an uneven vocabulary split).
    fn all_gather(&self, part: &[f32], out: &mut Vec<f32>);

    /// Copies rank `root`'s `buf` into every other rank's `buf` (all of the same length).
    fn broadcast(&self, buf: &mut [f32], root: usize);

    /// Returns once every rank has called it.
    fn barrier(&self);

    /// This rank's counters so far.
    fn stats(&self) -> CommStats;
}

/// [`CommStats`] updated from `&self` (collectives take `&self`).
#[derive(Debug, Default)]
struct StatsCounter {
    calls: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
}

impl StatsCounter {
    /// Counts one call of `bytes` that started at `start`.
    fn record(&self, bytes: usize, start: Instant) {
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// The counters now.
    fn snapshot(&self) -> CommStats {
        CommStats {
            calls: self.calls.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            nanos: self.nanos.load(Ordering::Relaxed),
        }
    }
}
