//! End-to-end tests of `tessera serve` (the built binary, the default model, real HTTP), and
//! the replay of the server's fuzz corpora: the server's one integration-test binary.

mod chat;
mod completions;
mod config;
mod connections;
mod deadlines;
mod deploy;
mod device;
mod errors;
mod fuzz_corpus;
mod harness;
mod loadtest;
mod ops;
mod python;
mod quantized;
mod resilience;
mod routers;
mod scheduling;
mod structured;
mod tokenize;
mod tensor_parallel;
mod tools;
