//! The target model's tokenizer: builds token-exact prompts and counts output tokens when the
//! server reports no usage. Counts never include special tokens a server adds (such as BOS).

use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use tessera_engine::weights::ModelWeights;

/// A tokenizer and the ids that are ordinary text (no added or special tokens).
pub struct Tokens {
    inner: tokenizers::Tokenizer,
    added: HashSet<u32>,
}

impl Tokens {
    /// Loads `--tokenizer` (a tokenizer.json) when given, else `--model`'s tokenizer, else
    /// that of `$TESSERA_MODEL`, else the project's default model.
    pub fn load(tokenizer: Option<&Path>, model: Option<&Path>) -> Result<Self> {
        if let Some(path) = tokenizer {
            let inner = tokenizers::Tokenizer::from_file(path)
                .map_err(|e| anyhow!("reading tokenizer {}: {e}", path.display()))?;
            return Ok(Self::new(inner));
        }
        let path = match model {
            Some(p) => p.to_path_buf(),
            None => default_model()?,
        };
        let weights = ModelWeights::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let tok = tessera_engine::tokenizer::Tokenizer::from_checkpoint(&weights.checkpoint)
            .with_context(|| format!("tokenizer of {}", path.display()))?;
        Ok(Self::new(tok.inner().clone()))
    }

    /// Wraps a `tokenizers` tokenizer.
    pub fn new(inner: tokenizers::Tokenizer) -> Self {
        let added = inner.get_added_tokens_decoder().into_keys().collect();
        Tokens { inner, added }
    }

    /// Token ids of `text` as a server would see them in a prompt, without added BOS/EOS.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The number of tokens in `text`.
    pub fn count(&self, text: &str) -> Result<usize> {
        Ok(self.encode(text)?.len())
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| anyhow!("detokenizing: {e}"))
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether `id` is an added (control, special or user-defined) token.
    pub fn is_added(&self, id: u32) -> bool {
        self.added.contains(&id)
    }
}

/// `$TESSERA_MODEL`, else the project's default model ([`tessera_engine::default_model::fetched`]).
fn default_model() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("TESSERA_MODEL") {
        return Ok(PathBuf::from(p));
    }
    let path = tessera_engine::default_model::fetched();
    if !path.exists() {
        bail!(
            "no tokenizer: pass --tokenizer or --model (the default model {} is missing; \
             scripts/fetch-default-model.sh fetches it)",
            path.display()
        );
    }
    Ok(path)
}
