//! Replays the stored fuzz corpora through the server's fuzz entry points
//! (`tessera_server::fuzzing`), without libFuzzer: every file of fuzz/corpus/<target>/ and
//! fuzz/regressions/<target>/ must be answered (an error is an answer), never panic. Long
//! fuzzing runs: scripts/fuzz.sh.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use tessera_server::fuzzing;

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
fn openai_request_corpus() {
    replay("openai_request", fuzzing::openai_request);
}

#[test]
fn chat_template_corpus() {
    replay("chat_template", |d| {
        let _ = fuzzing::chat_template(d);
    });
}
