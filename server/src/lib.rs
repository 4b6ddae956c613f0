//! Tessera's server crate: the `tessera` binary's subcommands ([`cli`]) and the
//! OpenAI-compatible HTTP front end ([`http`]), as a library so that the fuzz targets in
//! `fuzz/` and their corpus replay tests reach the request parsing and the chat template.

#[doc(hidden)]
#[allow(missing_docs)]
pub mod cli;
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
