//! `engine`'s integration tests: one binary (one link) for all of them, one module per
//! area; `cargo test -p tessera-engine --test it MODULE::` runs one area.

mod common;
mod calibrated_quantize;
mod convert;
mod cuda_model;
mod fuzz_corpus;
mod gguf;
mod hf_dir;
mod model;
mod moe;
mod quant_fixtures;
mod quantize;
mod serve;
mod tensor_parallel;
mod tokenizer;
