//! Elementwise and normalization ops.

pub mod activation;
pub mod norm;
pub mod rope;
pub mod transform;

pub use activation::silu_mul;
pub use norm::rms_norm;
pub use rope::Rope;
pub use transform::BlockTransform;
