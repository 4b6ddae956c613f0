//! [`NcclComm`]: collectives between GPU ranks on device buffers, through NCCL.
//!
//! NCCL is loaded at run time (cudarc's `nccl` module with dynamic loading), so this builds
//! everywhere; [`NcclComm::available`] says whether `libnccl` can be loaded. The collectives are
//! queued on each device's engine stream, ordered with its kernels, and return before the GPU
//! has run them.
//!
//! Unlike [`LocalComm`](super::LocalComm), NCCL does not promise a fixed summation order across
//! world sizes or algorithms (ring vs tree), so results are deterministic for a given
//! configuration but are not the rank-order sum.
//!
//! Tested only on a GPU machine, and only at world size 1 (a single-GPU machine cannot form a
//! larger group: NCCL rejects two ranks on one device); `tests/it/cuda_comm.rs` checks it and
//! skips, saying so, without a GPU or `libnccl`.

use super::CommStats;
use super::StatsCounter;
use crate::cuda::{CudaDevice, CudaSlice};
use cudarc::nccl::result::NcclError as RawNcclError;
use cudarc::nccl::{Comm, Id, ReduceOp};
use std::sync::Arc;
use std::time::Instant;

/// The identifier every rank of a multi-process (or one-thread-per-rank) NCCL group joins with:
/// made by one rank with [`NcclComm::new_id`], shared with the others.
pub use cudarc::nccl::Id as NcclId;

/// Why an NCCL operation failed.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    /// `libnccl` is not loadable.
    #[error("NCCL (libnccl.so) was not found on LD_LIBRARY_PATH (it ships in the nvidia-nccl wheel)")]
    NoNccl,
    /// An NCCL call returned an error.
    #[error("NCCL call failed: {0:?}")]
    Call(cudarc::nccl::sys::ncclResult_t),
    /// Buffer lengths that do not fit the collective.
    #[error("{0}")]
    Shape(String),
}

impl From<RawNcclError> for NcclError {
    fn from(e: RawNcclError) -> Self {
        NcclError::Call(e.0)
    }
}

/// One GPU rank's NCCL communicator, with [`CommStats`] counters.
///
/// Movable to its rank's thread but not shareable between threads (an NCCL communicator must
/// not be used by two threads at once).
pub struct NcclComm {
    comm: Comm,
    stats: StatsCounter,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `NcclComm` is not `Sync` and its methods need `&self` of one owner, so moving it to
// another thread keeps every call on one thread at a time. The stream it holds is `Send`.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Whether `libnccl` can be loaded (never panics, unlike the first NCCL call without it).
    pub fn available() -> bool {
        // SAFETY: only probes for the shared library with libloading.
        unsafe { cudarc::nccl::sys::is_culib_present() }
    }

    /// A group with one rank per device, created from one thread (`ncclCommInitAll`); rank `i`
    /// uses `devices[i]`'s engine stream. The devices must be distinct GPUs.
    pub fn group_single_process(devices: &[Arc<CudaDevice>]) -> Result<Vec<NcclComm>, NcclError> {
        Self::check_available()?;
        let streams = devices.iter().map(|d| d.stream().clone()).collect();
        let comms = Comm::from_devices(streams)?;
        Ok(comms.into_iter().map(|comm| NcclComm { comm, stats: StatsCounter::default() }).collect())
    }

    /// A fresh group identifier, made by one rank and given to every rank's [`from_id`](Self::from_id).
    pub fn new_id() -> Result<NcclId, NcclError> {
        Self::check_available()?;
        Ok(Id::new()?)
    }

    /// Joins group `id` as rank `rank` of `world` on `device`'s engine stream. Blocks until
    /// every rank has joined, so each rank must call it from its own thread (or process).
    pub fn from_id(device: &CudaDevice, rank: usize, world: usize, id: NcclId) -> Result<NcclComm, NcclError> {
        Self::check_available()?;
        if rank >= world {
            return Err(NcclError::Shape(format!("rank {rank} in a group of {world}")));
        }
        let comm = Comm::from_rank(device.stream().clone(), rank, world, id)?;
        Ok(NcclComm { comm, stats: StatsCounter::default() })
    }

    fn check_available() -> Result<(), NcclError> {
        if Self::available() {
            Ok(())
        } else {
            Err(NcclError::NoNccl)
        }
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks in the group.
    pub fn world(&self) -> usize {
        self.comm.world_size()
    }

    /// This rank's counters; `nanos` is host time spent queuing collectives, not GPU time.
    pub fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    /// Sums `buf` over all ranks, in place (queued on the stream).
    pub fn all_reduce_sum(&self, buf: &mut CudaSlice<f32>) -> Result<(), NcclError> {
        let start = Instant::now();
        self.comm.all_reduce_in_place(buf, &ReduceOp::Sum)?;
        self.stats.record(buf.len() * size_of::<f32>(), start);
        Ok(())
    }

    /// Concatenates every rank's `part` into `out` in rank order. NCCL needs equal parts:
    /// `out.len()` must be `world × part.len()` (pad an uneven vocabulary split).
    pub fn all_gather(&self, part: &CudaSlice<f32>, out: &mut CudaSlice<f32>) -> Result<(), NcclError> {
        if out.len() != part.len() * self.world() {
            return Err(NcclError::Shape(format!("all_gather of {} floats per rank into {} (world {})", part.len(), out.len(), self.world())));
        }
        let start = Instant::now();
        self.comm.all_gather(part, out)?;
        self.stats.record(part.len() * size_of::<f32>(), start);
        Ok(())
    }

    /// Copies rank `root`'s `buf` into every rank's `buf`.
    pub fn broadcast(&self, buf: &mut CudaSlice<f32>, root: usize) -> Result<(), NcclError> {
        if root >= self.world() {
            return Err(NcclError::Shape(format!("broadcast from rank {root} in a group of {}", self.world())));
        }
        let start = Instant::now();
        self.comm.broadcast_in_place(buf, root as i32)?;
        let contributed = if self.rank() == root { buf.len() * size_of::<f32>() } else { 0 };
        self.stats.record(contributed, start);
        Ok(())
    }
}
