//! Structured outputs: output constrained to a JSON schema, a regular expression, a list of
//! choices or a Lark grammar, with llguidance.
//!
//! [`Grammars`] is built once per model from its tokenizer (the vocabulary as a token trie);
//! it compiles a request's [`Constraint`] into a [`Guide`] before anything is queued, so a
//! constraint llguidance refuses is the client's error. Each constrained sequence owns its
//! guide: before every sampling step the guide gives the set of allowed tokens (EOS only once
//! the output is complete), the sampler draws only from it, and the guide advances with the
//! chosen token; once the grammar allows nothing more the sequence finishes.

mod masker;
mod vocab;

use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::Value;

/// A set of token ids (a bit per vocabulary entry), as llguidance computes it.
pub use toktrie::SimpleVob as TokenSet;
pub use masker::{Guides, Masker, Masks};

/// What a constrained request's output must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// JSON valid against this JSON schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// A full match of this regular expression (Rust `regex` syntax).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A sentence of this Lark grammar (llguidance's dialect).
    Lark(String),
}

impl Constraint {
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact_schema(s.clone())),
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(compact_schema(serde_json::json!({"type": "object"}))),
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Choice(c) => TopLevelGrammar::from_regex(&c.iter().map(|s| regex::escape(s)).collect::<Vec<_>>().join("|")),
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// JSON laid out one way (`{"a": 1, "b": [1, 2]}`), unless the schema sets llguidance's own
/// `x-guidance` options: with free whitespace a small model can pad the output with newlines
/// until `max_tokens`. Public for schemas embedded in Lark grammars (`%json {...}`).
pub fn compact_schema(mut schema: Value) -> Value {
    if schema.as_object().is_some_and(|o| !o.contains_key("x-guidance")) {
        let opts = JsonCompileOptions { whitespace_flexible: false, item_separator: ", ".into(), key_separator: ": ".into(), ..Default::default() };
        opts.apply_to(&mut schema);
    }
    schema
}

/// Compiles constraints against one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// The compiler for `tok`'s vocabulary over `vocab_size` logits (the model's rows; ids
    /// past the tokenizer's are never allowed). Fails for tokenizers that are neither
    /// byte-level nor byte-fallback, or without an EOS token.
    pub fn new(tok: &Tokenizer, vocab_size: usize) -> Result<Self, String> {
        let env = vocab::tok_env(tok, vocab_size)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A guide at the start of `c`; the error is llguidance's reason for refusing it.
    pub fn compile(&self, c: &Constraint) -> Result<Guide, String> {
        let matcher = Matcher::new(self.factory.create_parser(c.grammar()));
        match matcher.get_error() {
            Some(e) => Err(e),
            None => Ok(Guide { matcher }),
        }
    }
}

/// One sequence's place in its grammar.
pub struct Guide {
    matcher: Matcher,
}

impl Clone for Guide {
    /// An independent guide in the same state (each choice of a request advances its own).
    fn clone(&self) -> Self {
        Guide { matcher: self.matcher.deep_clone() }
    }
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").field("complete", &self.is_complete()).finish()
    }
}

impl Guide {
    /// The tokens that may come next; EOS is among them only when the output so far is a
    /// complete sentence.
    pub fn allowed(&mut self) -> Result<TokenSet, String> {
        self.matcher.compute_mask().map_err(|e| format!("structured output: {e}"))
    }

    /// Moves past `id` (one of [`Guide::allowed`]'s tokens).
    pub fn advance(&mut self, id: u32) -> Result<(), String> {
        self.matcher.consume_token(id).map_err(|e| format!("structured output: {e}"))
    }

    /// Whether the grammar allows nothing more (the output is complete).
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests;
