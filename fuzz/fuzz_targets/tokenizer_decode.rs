//! Token ids through the default model's decode and streaming decode
//! (`tessera_engine::fuzzing::tokenizer_decode`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tessera_engine::fuzzing::tokenizer_decode(tessera_engine::fuzzing::default_tokenizer(), data);
});
