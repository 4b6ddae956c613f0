//! GGUF bytes through the whole GGUF load (`tessera_engine::fuzzing::gguf`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = tessera_engine::fuzzing::gguf(data);
});
