//! Replays the stored fuzz corpora through the engine's fuzz entry points
//! (`tessera_engine::fuzzing`), without libFuzzer: every file of fuzz/corpus/<target>/ and
//! fuzz/regressions/<target>/ must load or fail with an error, never panic. Long fuzzing runs:
//! scripts/fuzz.sh.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use tessera_engine::fuzzing;

/// Runs `f` on every stored input of `target`; fails naming each input that panicked.
fn replay(target: &str, f: impl Fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut inputs = 0;
    let mut failed = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else { continue };
        let mut paths: Vec<_> = entries.map(|e| e.unwrap().path()).collect();
        paths.sort();
        for p in paths {
            let data = std::fs::read(&p).unwrap();
            inputs += 1;
            if catch_unwind(AssertUnwindSafe(|| f(&data))).is_err() {
                failed.push(p.display().to_string());
            }
        }
    }
    assert!(inputs > 0, "no stored inputs for {target}");
    assert!(failed.is_empty(), "{} of {inputs} {target} inputs panicked: {failed:?}", failed.len());
}

#[test]
fn gguf_corpus() {
    replay("gguf", |d| {
        let _ = fuzzing::gguf(d);
    });
}

#[test]
fn hf_checkpoint_corpus() {
    replay("hf_checkpoint", |d| {
        let _ = fuzzing::hf_checkpoint(d);
    });
}

#[test]
fn tokenizer_decode_corpus() {
    let tok = fuzzing::default_tokenizer();
    replay("tokenizer_decode", |d| fuzzing::tokenizer_decode(tok, d));
}
