//! Serving: a continuous-batching engine over a paged KV cache.
//!
//! [`Engine::start`] moves a loaded model onto its own thread. Callers [`Engine::submit`]
//! tokenized [`GenRequest`]s (or [`Engine::submit_all`] one client request's choices, which
//! share each prompt's prefill) and read [`Event`]s from the returned [`RequestStream`]s;
//! dropping a stream aborts its request. Each engine step admits waiting requests under a
//! token budget and a sequence cap, mixes prefill chunks with decodes in one batched forward
//! pass, samples, detokenizes, checks stop conditions and streams the results. The forward
//! passes run on a backend: the CPU model over a host block pool, or the model on a GPU
//! (`EngineConfig::device`).

mod backend;
mod config;
mod engine_loop;
mod handle;
mod metrics;
mod output;
mod request;
mod scheduler;
mod sequence;

pub use config::{EngineConfig, EngineInfo};
pub use handle::{Engine, RequestStream, SubmitError};
pub use metrics::{vllm_families, VLLM_ALIASES};
pub use output::OutputText;
pub use request::{Event, FinishReason, GenRequest, StopReason, TokenLogprob, Usage};
