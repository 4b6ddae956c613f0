//! The model's vocabulary as llguidance sees it: every token's bytes in a `toktrie` trie,
//! special tokens marked, and a tokenizer for the bytes llguidance forces.

use crate::tokenizer::Tokenizer;
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// Each token's bytes (special tokens: [`TokTrie::SPECIAL_TOKEN_MARKER`] then their name), as
/// llguidance reads them from the tokenizer's JSON form, ids without a token (padding up to
/// `vocab_size`, the model's logit rows) become unreachable special tokens.
fn token_bytes(tok: &Tokenizer, vocab_size: usize) -> Result<Vec<Vec<u8>>, String> {
    let json = serde_json::to_value(tok.inner()).map_err(|e| e.to_string())?;
    let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| format!("structured outputs are unavailable: {e}"))?;
    words.resize(vocab_size.max(words.len()), Vec::new());
    for (id, w) in words.iter_mut().enumerate().filter(|(_, w)| w.is_empty()) {
        *w = [&[TokTrie::SPECIAL_TOKEN_MARKER], format!("<[{id}]>").as_bytes()].concat();
    }
    Ok(words)
}

/// The tokenizer environment llguidance compiles grammars against.
struct Env {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| self.tokenizer.encode(s, false).map(|e| e.get_ids().to_vec()).unwrap_or_default())
    }
}

/// The environment for `tok`, over `vocab_size` logits, with the checkpoint's EOS tokens.
pub fn tok_env(tok: &Tokenizer, vocab_size: usize) -> Result<TokEnv, String> {
    let words = token_bytes(tok, vocab_size)?;
    let eos = &tok.special().eos;
    let first = *eos.first().ok_or("structured outputs need an EOS token")?;
    let mut trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, first), &words);
    if eos.len() > 1 {
        trie = trie.with_eos_tokens(eos);
    }
    Ok(Arc::new(Env { trie, tokenizer: tok.inner().clone() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_model_tokens_are_their_text() {
        let tok = crate::fuzzing::default_tokenizer();
        let words = token_bytes(tok, tok.vocab_size()).unwrap();
        for text in ["Hello world", " {\"a\": [1, 2]}\n", "naïve café"] {
            let ids = tok.encode_with(text, false).unwrap();
            let bytes: Vec<u8> = ids.iter().flat_map(|&i| words[i as usize].clone()).collect();
            assert_eq!(String::from_utf8(bytes).unwrap(), text);
        }
        let eos = tok.special().eos[0] as usize;
        assert_eq!(words[eos][0], TokTrie::SPECIAL_TOKEN_MARKER);
    }
}
