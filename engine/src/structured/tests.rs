//! The guide's token masks over the default model's real vocabulary, against brute-force
//! checks: for choices and a bounded regex by an independent prefix test, for a JSON schema
//! by llguidance's own token validation. Where the grammar forces the next bytes, llguidance
//! allows only the first token of their canonical tokenization (so the model is never led
//! into a tokenization it was not trained on): there the mask is that one valid token.

use super::*;
use crate::fuzzing::default_tokenizer;
use std::sync::OnceLock;

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| {
        let tok = default_tokenizer();
        Grammars::new(tok, tok.vocab_size()).unwrap()
    })
}

/// A guide for `c` advanced through `prefix` (tokenized as the model would).
fn guide_after(c: &Constraint, prefix: &str) -> Guide {
    let mut g = grammars().compile(c).unwrap();
    for id in default_tokenizer().encode_with(prefix, false).unwrap() {
        g.advance(id).unwrap();
    }
    g
}

/// The token the grammar forces next (the first of the forced bytes' canonical tokens), if any.
fn forced(g: &Guide) -> Option<u32> {
    g.matcher.deep_clone().compute_ff_tokens().first().copied()
}

/// Every token of the vocabulary is allowed after `prefix` exactly when `valid(prefix + token)`
/// holds, and EOS exactly when `complete(prefix)`; other special tokens never. Where bytes are
/// forced, the forced token alone is allowed, and it is valid.
fn check_mask(c: &Constraint, prefix: &str, valid: impl Fn(&[u8]) -> bool, complete: impl Fn(&[u8]) -> bool) {
    let mut g = guide_after(c, prefix);
    let allowed = g.allowed().unwrap();
    let env = grammars().factory.tok_env().clone();
    let trie = env.tok_trie();
    if let Some(t) = forced(&g) {
        assert_eq!(allowed.num_set(), 1, "{c:?} after {prefix:?}: bytes are forced");
        assert!(allowed.is_allowed(t) && valid(&[prefix.as_bytes(), trie.token(t)].concat()), "{c:?} after {prefix:?}");
        return;
    }
    let eos = default_tokenizer().special().eos[0];
    let mut n_allowed = 0;
    for id in 0..trie.vocab_size() as u32 {
        let want = if id == eos {
            complete(prefix.as_bytes())
        } else if trie.is_special_token(id) {
            false
        } else {
            valid(&[prefix.as_bytes(), trie.token(id)].concat())
        };
        assert_eq!(allowed.is_allowed(id), want, "{c:?} after {prefix:?}: token {id} {:?}", trie.token_dbg(id));
        n_allowed += usize::from(want);
    }
    assert!(n_allowed > 0, "{c:?} after {prefix:?} allows nothing");
}

#[test]
fn choice_masks_match_brute_force() {
    let choices = ["Paris", "London", "New York", "Newcastle"];
    let c = Constraint::Choice(choices.iter().map(|s| s.to_string()).collect());
    let is_prefix = |t: &[u8]| !t.is_empty() && choices.iter().any(|c| c.as_bytes().starts_with(t));
    let is_choice = |t: &[u8]| choices.iter().any(|c| c.as_bytes() == t);
    for prefix in ["", "New", "New Y", "Lon"] {
        check_mask(&c, prefix, is_prefix, is_choice);
    }
    assert!(forced(&guide_after(&c, "New")).is_none() && forced(&guide_after(&c, "New Y")).is_some(), "both cases are checked");
    let done = guide_after(&c, "London");
    assert!(done.is_complete());
}

#[test]
fn regex_masks_match_brute_force() {
    let c = Constraint::Regex("[0-9]{1,3}".into());
    let digits = |t: &[u8]| (1..=3).contains(&t.len()) && t.iter().all(u8::is_ascii_digit);
    for prefix in ["", "4", "42"] {
        check_mask(&c, prefix, digits, |t| !t.is_empty());
    }
    assert!(guide_after(&c, "424").is_complete());
}

/// The mask agrees with llguidance's validation of each token on its own, along a document.
#[test]
fn json_schema_masks_agree_with_token_validation() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let c = Constraint::JsonSchema(schema);
    for prefix in ["", "{\"name\": \"Al", "{\"name\": \"Al\", \"age\": 4"] {
        let mut g = guide_after(&c, prefix);
        let allowed = g.allowed().unwrap();
        let vocab = grammars().factory.tok_env().tok_trie().vocab_size() as u32;
        let forced = forced(&g);
        for id in 0..vocab {
            let ok = g.matcher.validate_tokens(&[id]).unwrap() == 1;
            match forced {
                Some(t) => assert!(allowed.is_allowed(id) == (id == t) && (id != t || ok), "after {prefix:?}: token {id}"),
                None => assert_eq!(allowed.is_allowed(id), ok, "after {prefix:?}: token {id}"),
            }
        }
    }
    assert!(guide_after(&c, "{\"name\": \"Al\", \"age\": 4}").is_complete());
}

#[test]
fn refused_constraints_say_why() {
    let bad = [
        Constraint::Regex("(".into()),
        Constraint::Lark("start: (".into()),
        Constraint::JsonSchema(serde_json::json!({"type": "no-such-type"})),
    ];
    for c in bad {
        let e = grammars().compile(&c).unwrap_err();
        assert!(!e.is_empty(), "{c:?}");
    }
}

#[test]
fn clones_advance_independently() {
    let c = Constraint::Choice(vec!["yes".into(), "no".into()]);
    let mut a = grammars().compile(&c).unwrap();
    let mut b = a.clone();
    let tok = default_tokenizer();
    for id in tok.encode_with("yes", false).unwrap() {
        a.advance(id).unwrap();
    }
    assert!(a.is_complete() && !b.is_complete());
    let no = tok.encode_with("no", false).unwrap();
    assert!(b.allowed().unwrap().is_allowed(no[0]));
}

#[test]
fn the_mask_thread_gives_each_guide_its_own_mask_and_it_back_in_order() {
    let choice = Constraint::Choice(vec!["apple pie".into(), "banana split".into()]);
    let regex = Constraint::Regex("[0-9]{2,6}".into());
    let mut masker = Masker::new();
    assert_eq!(masker.wait().0.len(), 0, "nothing started, nothing to wait for");
    for step in 0..3 {
        let prefixes = ["", "apple ", "12"];
        let guides: Guides = vec![(7, guide_after(&choice, prefixes[step % 2])), (3, guide_after(&regex, prefixes[2])), (9, guide_after(&choice, ""))];
        let mut direct: Vec<TokenSet> = guides.iter().map(|(_, g)| g.clone().allowed().unwrap()).collect();
        masker.start(guides);
        let (back, masks) = masker.wait();
        assert_eq!(back.iter().map(|(k, _)| *k).collect::<Vec<_>>(), [7, 3, 9]);
        for (m, d) in masks.into_iter().zip(direct.drain(..)) {
            let m = m.unwrap();
            assert!(m.num_set() > 0);
            assert!(m == d, "step {step}: the thread's mask differs from the guide's own");
        }
    }
}
