//! CPU kernels: feature detection, SIMD helpers and row dot products.

pub mod affinity;
pub mod aligned;
pub mod caps;
pub mod dot;
pub mod exp;
pub(crate) mod flush;
pub mod pool;
pub mod scratch;
pub(crate) mod simd;
pub mod softmax;

pub use caps::{Bf16Products, CpuCaps, GemmLevel, Isa};

/// A raw output pointer shared by parallel tasks that each write a disjoint part of one buffer.
/// Tasks reach the pointer through [`SyncPtr::get`], so closures capture the wrapper (which is
/// `Send + Sync`), not the bare pointer.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(*mut f32);

// SAFETY: every user documents why its tasks' writes are disjoint and in bounds.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// Wraps the start of a buffer.
    pub(crate) fn new(p: *mut f32) -> Self {
        SyncPtr(p)
    }

    /// The pointer.
    pub(crate) fn get(&self) -> *mut f32 {
        self.0
    }
}
