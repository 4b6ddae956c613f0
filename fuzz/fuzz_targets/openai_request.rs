//! Completions and chat request bodies through parsing and validation
//! (`tessera_server::fuzzing::openai_request`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tessera_server::fuzzing::openai_request(data);
});
