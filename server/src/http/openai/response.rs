//! The envelope every OpenAI response and stream chunk shares, and token usage.

use serde::Serialize;
use serde_json::Value;
use std::time::{SystemTime, UNIX_EPOCH};
use tessera_engine::serve::StopReason;

/// What all responses and chunks of one request share.
#[derive(Clone, Debug)]
pub struct Meta {
    /// Request id (`cmpl-…`, `chatcmpl-…`).
    pub id: String,
    /// Unix seconds when the request arrived.
    pub created: u64,
    /// Served model name.
    pub model: String,
}

/// A response body or a stream chunk.
#[derive(Debug, Serialize)]
pub struct Envelope<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<C>,
    /// Absent unless usage is reported; `Some(None)` serializes as `null` (chunks before the
    /// usage chunk when `stream_options.include_usage` is set).
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<Usage>>,
}

impl Meta {
    /// Metadata for a new request with a fresh id under `prefix`.
    pub fn new(prefix: &str, model: &str) -> Self {
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Meta { id: format!("{prefix}-{:032x}", rand::random::<u128>()), created, model: model.to_owned() }
    }

    /// An envelope around `choices`.
    pub fn envelope<C>(&self, object: &'static str, choices: Vec<C>, usage: Option<Option<Usage>>) -> Envelope<'_, C> {
        Envelope { id: &self.id, object, created: self.created, model: &self.model, choices, usage }
    }
}

/// Token counts of a request (prompts counted once each, completions over all choices).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// Usage from the two counts.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Usage { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}

/// vLLM's `stop_reason`: the stop string, the stop token id, or `null`.
pub fn stop_reason_json(r: Option<&StopReason>) -> Value {
    match r {
        Some(StopReason::Text(s)) => Value::from(s.as_str()),
        Some(StopReason::Token(id)) => Value::from(*id),
        None => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn envelope_shapes() {
        let meta = Meta::new("cmpl", "m");
        assert!(meta.id.starts_with("cmpl-") && meta.id.len() == 5 + 32, "{}", meta.id);
        assert_ne!(Meta::new("cmpl", "m").id, meta.id);
        let plain = serde_json::to_value(meta.envelope("text_completion", vec![1], None)).unwrap();
        assert_eq!(plain, json!({"id": meta.id, "object": "text_completion", "created": meta.created, "model": "m", "choices": [1]}));
        let null_usage = serde_json::to_value(meta.envelope("x", Vec::<u8>::new(), Some(None))).unwrap();
        assert_eq!(null_usage["usage"], Value::Null);
        assert!(null_usage.as_object().unwrap().contains_key("usage"));
        let usage = serde_json::to_value(meta.envelope("x", Vec::<u8>::new(), Some(Some(Usage::new(3, 4))))).unwrap();
        assert_eq!(usage["usage"], json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}));
    }

    #[test]
    fn stop_reasons() {
        assert_eq!(stop_reason_json(Some(&StopReason::Text("###".into()))), json!("###"));
        assert_eq!(stop_reason_json(Some(&StopReason::Token(2))), json!(2));
        assert_eq!(stop_reason_json(None), Value::Null);
    }
}
