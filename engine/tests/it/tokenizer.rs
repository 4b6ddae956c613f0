//! The GGUF-built tokenizer against a reference tokenization of a few hundred varied strings
//! (engine/tests/fixtures/make_tokenizer_fixture.py; its header records the reference used), and
//! the incremental decoder's UTF-8 safety.

use crate::common;

use common::{fixture, model};
use serde_json::Value;
use tessera_engine::tokenizer::IncrementalDecoder;

fn cases() -> Vec<(String, Vec<u32>, Option<String>)> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(fixture("tokenizer/smollm2_cases.json")).unwrap()).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["text"].as_str().unwrap().to_string(),
                c["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
                c.get("decoded").and_then(Value::as_str).map(str::to_owned),
            )
        })
        .collect()
}

#[test]
fn encodes_like_the_reference() {
    let tok = &model().tokenizer;
    let cases = cases();
    assert!(cases.len() >= 200);
    let mut failures = Vec::new();
    for (text, ids, _) in &cases {
        let got = tok.encode(text).unwrap();
        if &got != ids {
            failures.push(format!("{text:?}: got {got:?}, want {ids:?}"));
        }
    }
    assert!(failures.is_empty(), "{} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn add_bos_false_is_honoured() {
    let tok = &model().tokenizer;
    assert!(!tok.special().add_bos);
    assert_eq!(tok.encode("").unwrap(), Vec::<u32>::new());
    assert_ne!(tok.encode("Hello").unwrap()[0], tok.special().bos.unwrap());
    // Special tokens written in text are single tokens.
    assert_eq!(tok.encode("<|im_start|>").unwrap().len(), 1);
}

#[test]
fn decodes_like_the_reference() {
    let tok = &model().tokenizer;
    for (text, ids, decoded) in cases() {
        let want = decoded.unwrap_or(text);
        assert_eq!(tok.decode(&ids), want);
    }
}

/// Feeding tokens one at a time yields exactly the full decode, and no piece ever contains
/// U+FFFD unless the full text does (a split multi-byte character is held back).
#[test]
fn incremental_decoding_is_utf8_safe() {
    let tok = &model().tokenizer;
    let mut split_chars = 0;
    for (_, ids, _) in cases() {
        let full = tok.decode(&ids);
        let mut dec = IncrementalDecoder::new();
        let mut out = String::new();
        for (i, &id) in ids.iter().enumerate() {
            let piece = dec.push(tok, id);
            if !full.contains('\u{FFFD}') {
                assert!(!piece.contains('\u{FFFD}'), "half a character emitted in {full:?}");
            }
            if piece.is_empty() && tok.decode(&ids[..=i]).ends_with('\u{FFFD}') {
                split_chars += 1;
            }
            out.push_str(&piece);
        }
        out.push_str(&dec.flush(tok));
        assert_eq!(out, full);
    }
    assert!(split_chars > 0, "the cases must include characters split across tokens");
}
