//! CPU kernels: feature detection, SIMD helpers and row dot products.

pub mod caps;
pub mod dot;
#[cfg(target_arch = "x86_64")]
pub mod sgemm;
pub(crate) mod simd;

pub use caps::{CpuCaps, Isa};
