//! Builds a `tokenizers::Tokenizer` equivalent to a GGUF-embedded vocabulary.
//!
//! Supported: `tokenizer.ggml.model = gpt2` (byte-level BPE) with the pre-tokenizers
//! `default`/`gpt-2` (GPT-2 regex), `smollm` (single digits, then the GPT-2 regex, as
//! SmolLM2's tokenizer.json) and `llama-bpe` (Llama 3's regex). Other models or
//! pre-tokenizers are load errors rather than silently different tokenizations.

use crate::checkpoint::{GgufVocab, LoadError};
use std::collections::HashMap;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// llama.cpp token type of control tokens (`<|im_start|>` etc.).
const TOKEN_TYPE_CONTROL: i32 = 3;
/// llama.cpp token type of user-defined tokens.
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn tok_err(e: impl std::fmt::Display) -> LoadError {
    LoadError::Tokenizer(e.to_string())
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, LoadError> {
    let byte_level = |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    Ok(match pre {
        "default" | "gpt-2" | "gpt2" => byte_level(true),
        "smollm" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ])),
        "llama-bpe" | "llama3" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Split(
                Split::new(SplitPattern::Regex(LLAMA3_REGEX.into()), SplitDelimiterBehavior::Isolated, false)
                    .map_err(tok_err)?,
            ),
            byte_level(false),
        ])),
        other => return Err(LoadError::Tokenizer(format!("tokenizer.ggml.pre {other:?} is not supported"))),
    })
}

/// Builds the tokenizer for a GGUF vocabulary.
pub fn build(v: &GgufVocab) -> Result<Tokenizer, LoadError> {
    if v.model != "gpt2" {
        return Err(LoadError::Tokenizer(format!("tokenizer.ggml.model {:?} is not supported (supported: gpt2)", v.model)));
    }
    let mut vocab = HashMap::with_capacity(v.tokens.len());
    for (id, t) in v.tokens.iter().enumerate() {
        if vocab.insert(t.clone(), id as u32).is_some() {
            return Err(LoadError::Tokenizer(format!("token {t:?} appears twice in tokenizer.ggml.tokens")));
        }
    }
    let merges = v
        .merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| LoadError::Tokenizer(format!("merge {m:?} is not two tokens")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre_tokenizer(v.pre.as_deref().unwrap_or("default"))?));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let added: Vec<AddedToken> = v
        .tokens
        .iter()
        .zip(&v.token_types)
        .filter(|(_, &ty)| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
        .map(|(t, &ty)| AddedToken::from(t.clone(), ty == TOKEN_TYPE_CONTROL).normalized(false))
        .collect();
    tok.add_special_tokens(&added);
    Ok(tok)
}
