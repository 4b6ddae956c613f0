//! Model architectures and their layers ([`cuda`]: the Llama decoder on an NVIDIA GPU).

pub mod cuda;
pub mod key_calibration;
pub mod linear;
pub mod llama;
pub mod mlp;
pub mod moe;
pub mod routing;
pub mod shard;

pub use linear::{Linear, PlanEntry};
pub use llama::{ActivationObserver, ForwardError, LinearSite, LlamaModel, SeqInput};
