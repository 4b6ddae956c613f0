//! Dataset construction with the default model's tokenizer: token-exact random prompts without
//! accidental shared prefixes, the shared-prefix option, ShareGPT and prompts-file parsing.

use crate::common;

use common::{default_model, prompts_file};
use std::sync::OnceLock;
use tessera_loadtest::dataset::{prompts_file as read_prompts, random, sharegpt, RandomSpec};
use tessera_loadtest::tokens::Tokens;

fn tokens() -> &'static Tokens {
    static T: OnceLock<Tokens> = OnceLock::new();
    T.get_or_init(|| Tokens::load(None, Some(&default_model())).unwrap())
}

fn spec(num_prompts: usize, input_len: usize, range_ratio: f64, shared_prefix_len: usize) -> RandomSpec {
    RandomSpec { num_prompts, input_len, output_len: 64, range_ratio, shared_prefix_len, seed: 11 }
}

/// Length of the common prefix of two id sequences.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn random_prompts_reencode_to_exactly_the_requested_length() {
    let t = tokens();
    let reqs = random(t, &spec(48, 100, 0.5, 0)).unwrap();
    assert_eq!(reqs.len(), 48);
    let mut lengths = std::collections::BTreeSet::new();
    let ids: Vec<Vec<u32>> = reqs.iter().map(|r| t.encode(&r.prompt).unwrap()).collect();
    for (r, ids) in reqs.iter().zip(&ids) {
        assert_eq!(ids.len(), r.prompt_len, "prompt {:?}", r.prompt);
        assert!((50..=150).contains(&r.prompt_len) && (32..=96).contains(&r.output_len));
        assert!(ids.iter().all(|&id| !t.is_added(id)), "no special tokens");
        lengths.insert(r.prompt_len);
    }
    assert!(lengths.len() > 10, "lengths are drawn across the range: {lengths:?}");
    // Uniform ids over a 49k vocabulary: two prompts sharing even their first 2 tokens has
    // probability below 48^2/2 / 49152^2 = 5e-4, so any shared prefix here is a bug.
    for i in 0..ids.len() {
        for j in i + 1..ids.len() {
            assert!(common_prefix(&ids[i], &ids[j]) < 2, "prompts {i} and {j} share a prefix");
        }
    }
    assert_eq!(reqs, random(t, &spec(48, 100, 0.5, 0)).unwrap(), "seeded");
    let fixed = random(t, &spec(4, 37, 0.0, 0)).unwrap();
    assert!(fixed.iter().all(|r| r.prompt_len == 37 && t.count(&r.prompt).unwrap() == 37 && r.output_len == 64));
}

#[test]
fn shared_prefix_is_shared_and_nothing_more() {
    let t = tokens();
    let reqs = random(t, &spec(16, 64, 0.0, 24)).unwrap();
    let ids: Vec<Vec<u32>> = reqs.iter().map(|r| t.encode(&r.prompt).unwrap()).collect();
    for (i, a) in ids.iter().enumerate() {
        assert_eq!(a.len(), 64);
        for b in &ids[i + 1..] {
            let shared = common_prefix(a, b);
            assert!((24..26).contains(&shared), "shared {shared} tokens");
        }
    }
    assert!(random(t, &spec(2, 20, 0.0, 20)).is_err(), "a prefix as long as the prompt");
}

#[test]
fn sharegpt_takes_first_turns_and_filters_like_bench_serving() {
    let t = tokens();
    let long_answer = "word ".repeat(30);
    let file = tempfile::NamedTempFile::new().unwrap();
    let json = serde_json::json!([
        {"id": "a", "conversations": [
            {"from": "human", "value": "Tell me about the history of the city of Lyon."},
            {"from": "gpt", "value": long_answer},
            {"from": "human", "value": "ignored third turn"}]},
        {"id": "short", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": long_answer}]},
        {"id": "one-turn", "conversations": [{"from": "human", "value": "Only a question with no answer here."}]},
        {"id": "no-conversations", "text": "other shape"},
        {"id": "b", "messages": [
            {"role": "user", "content": "Write a short poem about the sea at night."},
            {"role": "assistant", "content": "The sea is dark and calm tonight."}]},
    ]);
    std::fs::write(file.path(), json.to_string()).unwrap();
    let reqs = sharegpt(file.path(), t, 2, None, 0).unwrap();
    let mut prompts: Vec<&str> = reqs.iter().map(|r| r.prompt.as_str()).collect();
    prompts.sort();
    assert_eq!(
        prompts,
        ["Tell me about the history of the city of Lyon.", "Write a short poem about the sea at night."]
    );
    for r in &reqs {
        assert_eq!(r.prompt_len, t.count(&r.prompt).unwrap());
        let answer =
            if r.prompt.starts_with("Tell") { long_answer.as_str() } else { "The sea is dark and calm tonight." };
        assert_eq!(r.output_len, t.count(answer).unwrap(), "output length is the reference answer's");
    }
    let fixed = sharegpt(file.path(), t, 5, Some(7), 0).unwrap();
    assert_eq!(fixed.len(), 5, "two usable prompts are reused up to --num-prompts");
    assert!(fixed.iter().all(|r| r.output_len == 7));
    std::fs::write(file.path(), "{\"not\": \"an array\"}").unwrap();
    assert!(sharegpt(file.path(), t, 1, None, 0).is_err());
}

#[test]
fn prompts_file_skips_blank_lines() {
    let t = tokens();
    let f = prompts_file(&["first prompt", "", "   ", "second prompt"]);
    let reqs = read_prompts(f.path(), t, 3, None).unwrap();
    let texts: Vec<&str> = reqs.iter().map(|r| r.prompt.as_str()).collect();
    assert_eq!(texts, ["first prompt", "second prompt", "first prompt"]);
    assert!(reqs.iter().all(|r| r.output_len == 128 && r.prompt_len == 2));
    assert_eq!(read_prompts(f.path(), t, 1, Some(9)).unwrap()[0].output_len, 9);
    let empty = prompts_file(&[""]);
    assert!(read_prompts(empty.path(), t, 1, None).is_err());
}
