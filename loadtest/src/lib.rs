//! `tessera-bench`, the serving load generator (TTFT, TPOT, ITL, throughput) for any
//! OpenAI-compatible server. The crate is reserved in the workspace by the engine-spine issue;
//! its implementation is the load-tester issue's work and depends on no other Tessera crate.
