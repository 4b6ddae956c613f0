//! Replays the stored fuzz corpora through the server's fuzz entry points
//! (`tessera_server::fuzzing`), without libFuzzer: every file of fuzz/corpus/<target>/ and
//! fuzz/regressions/<target>/ must be answered (an error is an answer), never panic. Long
//! fuzzing runs: scripts/fuzz.sh.

use tessera_server::fuzzing;

/// Runs `f` over the stored inputs of `target`; fails naming each input that panicked.
fn replay(target: &str, f: impl Fn(&[u8])) {
    if let Err(e) = tessera_engine::fuzzing::replay_corpus(target, f) {
        panic!("{e}");
    }
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
