//! Tokenization: a `tokenizers::Tokenizer` built from the checkpoint (GGUF vocabulary or
//! tokenizer.json), the checkpoint's BOS policy, and UTF-8-safe incremental decoding.

mod gguf_vocab;
mod incremental;

pub use incremental::IncrementalDecoder;

use crate::checkpoint::{Checkpoint, LoadError, SpecialTokens, TokenizerSource};

/// The model's tokenizer with its special-token policy.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab", &self.vocab_size()).field("special", &self.special).finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer a checkpoint carries.
    pub fn from_checkpoint(ckpt: &Checkpoint) -> Result<Self, LoadError> {
        let inner = match &ckpt.tokenizer {
            TokenizerSource::Gguf(v) => gguf_vocab::build(v)?,
            TokenizerSource::HfJson(t) => (**t).clone(),
        };
        Ok(Tokenizer { inner, special: ckpt.special.clone() })
    }

    /// Encodes text; special tokens written in the text (e.g. `<|im_start|>`) are recognised,
    /// and BOS is prepended only when the checkpoint asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode_with(text, self.special.add_bos)
    }

    /// Encodes text as [`Tokenizer::encode`] does, prepending BOS only when `add_bos` (and the
    /// checkpoint has one): vLLM's `add_special_tokens`.
    pub fn encode_with(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, String> {
        let enc = self.inner.encode(text, false).map_err(|e| e.to_string())?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos {
            ids.extend(self.special.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    /// The token string of one id (for logprob displays).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of the special token whose text is exactly `text` (an added token the vocabulary
    /// marks special, such as `<|python_tag|>` or `[TOOL_CALLS]`), if there is one.
    pub fn special_token_id(&self, text: &str) -> Option<u32> {
        let added = self.inner.get_added_vocabulary().get_added_tokens_decoder();
        added.iter().find(|(_, t)| t.special && t.content == text).map(|(id, _)| *id)
    }

    /// Whether `id` is a special token of the vocabulary (BOS, EOS, chat markers).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.get_added_vocabulary().get_added_tokens_decoder().get(&id).is_some_and(|t| t.special)
    }

    /// Adds special tokens to the vocabulary (test vocabularies, [`crate::fuzzing`]).
    pub(crate) fn add_special_tokens(&mut self, texts: &[&str]) {
        let tokens: Vec<tokenizers::AddedToken> = texts.iter().map(|t| tokenizers::AddedToken::from(t.to_string(), true)).collect();
        self.inner.add_special_tokens(&tokens);
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Special tokens and BOS policy.
    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// The underlying `tokenizers` object (e.g. to save as tokenizer.json).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
