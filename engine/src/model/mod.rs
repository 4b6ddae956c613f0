//! Model architectures and their layers.

pub mod linear;
pub mod llama;
pub mod mlp;
pub mod moe;
pub mod routing;

pub use linear::{Linear, PlanEntry};
pub use llama::{ForwardError, LlamaModel, SeqInput};
