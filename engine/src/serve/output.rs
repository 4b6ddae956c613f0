//! Turning sampled tokens into the text a client may see: incremental detokenization plus
//! stop strings, which are matched across token boundaries and never emitted.
//!
//! Text that could still turn out to be the start of a stop string is held back until the
//! next tokens decide; whatever is held back when the request ends for another reason is
//! released.

use crate::tokenizer::{IncrementalDecoder, Tokenizer};

/// The visible-text state of one request.
#[derive(Debug, Clone)]
pub struct OutputText {
    decoder: IncrementalDecoder,
    stop: Vec<String>,
    /// All text decoded so far (cut at a stop string once one matched).
    text: String,
    /// Bytes of `text` already emitted.
    emitted: usize,
}

impl OutputText {
    /// State for a request with these stop strings (empty strings are ignored).
    pub fn new(stop: &[String]) -> Self {
        OutputText {
            decoder: IncrementalDecoder::new(),
            stop: stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
            text: String::new(),
            emitted: 0,
        }
    }

    /// Adds a token. Returns the text that is now safe to emit and the stop string if one
    /// matched (the text is then final: the stop string and everything after it are dropped).
    /// `check_stop: false` (before `min_tokens`) only accumulates.
    pub fn push(&mut self, tok: &Tokenizer, id: u32, check_stop: bool) -> (String, Option<String>) {
        let piece = self.decoder.push(tok, id);
        self.extend(&piece, check_stop)
    }

    /// Ends the request: flushes held-back text (a last stop-string check included).
    pub fn finish(&mut self, tok: &Tokenizer, check_stop: bool) -> (String, Option<String>) {
        let piece = self.decoder.flush(tok);
        let (mut out, hit) = self.extend(&piece, check_stop);
        if hit.is_none() {
            out.push_str(&self.text[self.emitted..]);
            self.emitted = self.text.len();
        }
        (out, hit)
    }

    fn extend(&mut self, piece: &str, check_stop: bool) -> (String, Option<String>) {
        // A match can start at most (longest stop - 1) bytes before the new piece.
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.text.len().saturating_sub(longest.saturating_sub(1)).max(self.emitted);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        self.text.push_str(piece);
        if check_stop {
            let earliest = self.stop.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| (from + i, s))).min_by_key(|&(i, _)| i);
            if let Some((at, s)) = earliest {
                let s = s.clone();
                let out = self.text[self.emitted..at].to_string();
                self.text.truncate(at);
                self.emitted = at;
                return (out, Some(s));
            }
        }
        let safe = self.text.len() - if check_stop { self.held_back() } else { 0 };
        let out = self.text[self.emitted..safe].to_string();
        self.emitted = safe;
        (out, None)
    }

    /// Bytes at the end of the unemitted text that start some stop string.
    fn held_back(&self) -> usize {
        let tail = &self.text[self.emitted..];
        let mut keep = 0;
        for s in &self.stop {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && tail.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        keep
    }

    /// All text so far (after a stop match: up to the stop string).
    pub fn text(&self) -> &str {
        &self.text
    }
}
