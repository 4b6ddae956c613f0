//! Tessera engine: checkpoint loaders, tokenizer, model forward pass, KV cache, sampling.
//!
//! - [`checkpoint`]: GGUF and Hugging Face readers producing one [`checkpoint::Checkpoint`];
//! - [`tokenizer`]: the checkpoint's tokenizer and streaming detokenization;
//! - [`schemes`]: reading checkpoint quantization schemes (compressed-tensors, Quark, FP8, GPTQ, AWQ)
//!   into kernel matrices ([`quantize`] writes them);
//! - [`weights`]: a checkpoint opened for a model, its quantized layers and KV cache decoded;
//! - [`device`]: `--device cpu | cuda[:N]`; [`default_model`]: where the default model lives;
//! - [`model`]: architectures (Llama and its MoE relatives) built from a checkpoint with a kernel per layer;
//! - [`kv_cache`]: the paged KV cache (per-layer formats from `tessera_kernels::kv`, block pool,
//!   cache manager with prefix caching) and the per-sequence KV seam;
//! - [`sample`]: logits processors, samplers and logprobs;
//! - [`structured`]: structured outputs (JSON schema, regex, choice, Lark) with llguidance;
//! - [`serve`]: the engine: continuous batching over a paged KV cache; the server, `tessera
//!   generate` and `bench` drive it;
//! - [`perplexity`]: llama.cpp-compatible perplexity evaluation, windows run through [`serve`];
//! - [`convert`], [`upcycle`], [`quantize`]: checkpoint writers (GGUF to HF, dense to MoE, quantization).
//!
//! The modules form layers: each imports only modules below it (`scripts/check-module-cycles.py`
//! fails on any import cycle). `a <- b`: `b` imports `a`.
//!
//! ```text
//! checkpoint <- tokenizer, schemes, kv_cache, convert (<- upcycle), synthetic
//! checkpoint, schemes, kv_cache <- weights <- model <- parallel <- loaded (LoadedModel)
//! model <- fuzzing (<- structured <- sample);  loaded <- quantize, serve <- perplexity
//! ```

pub mod checkpoint;
pub mod convert;
pub mod default_model;
pub mod device;
pub mod float_dtype;
#[doc(hidden)]
pub mod fuzzing;
pub mod kv_cache;
mod loaded;
pub mod model;
pub mod parallel;
pub mod perplexity;
pub mod quantize;
pub mod schemes;
pub mod sample;
pub mod serve;
pub mod structured;
pub mod synthetic;
pub mod tokenizer;
pub mod upcycle;
pub mod weights;

pub use loaded::LoadedModel;
