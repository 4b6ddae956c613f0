//! Model architectures and their layers.

pub mod linear;
pub mod llama;

pub use linear::{Linear, PlanEntry};
pub use llama::{ForwardError, LlamaModel, SeqInput};
