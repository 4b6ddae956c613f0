//! Streaming detokenization that never emits half a UTF-8 character.
//!
//! Byte-level BPE tokens can split a multi-byte character; decoding token by token would
//! emit U+FFFD. Like vLLM and TGI, we decode a short window `[prefix, read)` and
//! `[prefix, end)` and emit only the difference, holding back text that ends in an
//! incomplete character until the next token completes it.

use super::Tokenizer;

/// Turns a growing token sequence into text deltas.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl IncrementalDecoder {
    /// A decoder with no tokens yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a token; returns the new text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read]);
        let after = tok.decode(&self.ids[self.prefix..]);
        match after.get(before.len()..) {
            Some(delta) if after.len() > before.len() && !after.ends_with('\u{FFFD}') => {
                let delta = delta.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                delta
            }
            _ => String::new(),
        }
    }

    /// Text still held back (an incomplete character at the end), emitted as is.
    pub fn flush(&mut self, tok: &Tokenizer) -> String {
        let before = tok.decode(&self.ids[self.prefix..self.read]);
        let after = tok.decode(&self.ids[self.prefix..]);
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        after.get(before.len()..).unwrap_or("").to_string()
    }
}
