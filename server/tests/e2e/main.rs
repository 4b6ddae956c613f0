//! End-to-end tests of `tessera serve`: the built binary, the default model, real HTTP.

mod chat;
mod completions;
mod config;
mod connections;
mod deadlines;
mod deploy;
mod device;
mod errors;
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
