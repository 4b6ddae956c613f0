//! CPU kernels: feature detection, SIMD helpers and row dot products.

pub mod caps;
pub mod dot;
pub(crate) mod simd;

pub use caps::{CpuCaps, Isa};
