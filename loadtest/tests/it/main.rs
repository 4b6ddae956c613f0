//! `loadtest`'s integration tests: one binary (one link) for all of them, one module per
//! area; `cargo test -p tessera-loadtest --test it MODULE::` runs one area.

mod common;
mod dataset;
mod serve;
