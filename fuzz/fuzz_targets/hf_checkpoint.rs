//! config.json, tokenizer_config.json and model.safetensors through the Hugging Face
//! directory loader (`tessera_engine::fuzzing::hf_checkpoint`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = tessera_engine::fuzzing::hf_checkpoint(data);
});
