//! Hostile chat templates and conversations through compilation and bounded rendering
//! (`tessera_server::fuzzing::chat_template`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = tessera_server::fuzzing::chat_template(data);
});
