//! Logprobs in the two OpenAI formats: the completions API's parallel lists and the chat
//! API's list of token objects.

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use tessera_engine::serve::TokenLogprob;

/// What non-finite logprobs (a token the sampler could never pick) are reported as; JSON has
/// no `-Infinity` (vLLM uses the same value).
const FLOOR: f32 = -9999.0;

fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        FLOOR
    }
}

/// `{token_text: logprob, ...}` in the engine's order (most likely first).
#[derive(Clone, Debug, PartialEq)]
pub struct TopMap(Vec<(String, f32)>);

impl Serialize for TopMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// The completions API's `logprobs` object.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Each token's logprob (`null` for the first prompt token).
    pub token_logprobs: Vec<Option<f32>>,
    /// The top alternatives of each token plus the token itself (`null` for the first prompt token).
    pub top_logprobs: Vec<Option<TopMap>>,
    /// Character offset of each token in the returned text.
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Appends tokens; `offset` is the character offset of the first one and is advanced past
    /// them (so successive streamed chunks continue where the last one stopped).
    pub fn extend(&mut self, tokens: &[TokenLogprob], offset: &mut usize) {
        for t in tokens {
            self.tokens.push(t.text.clone());
            self.token_logprobs.push(t.logprob.map(finite));
            self.top_logprobs.push(t.logprob.map(|lp| {
                let mut top: Vec<(String, f32)> = t.top.iter().map(|(s, l)| (s.clone(), finite(*l))).collect();
                if !top.iter().any(|(s, _)| *s == t.text) {
                    top.push((t.text.clone(), finite(lp)));
                }
                TopMap(top)
            }));
            self.text_offset.push(*offset);
            *offset += t.text.chars().count();
        }
    }

    /// The lists for `tokens`, starting at character `offset` (advanced past them).
    pub fn of(tokens: &[TokenLogprob], offset: &mut usize) -> Self {
        let mut l = Self::default();
        l.extend(tokens, offset);
        l
    }
}

/// The chat API's `logprobs` object.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<ChatTokenLogprob>,
}

/// One token in the chat format.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    /// Token text.
    pub token: String,
    /// Its logprob.
    pub logprob: f32,
    /// Its UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// The most likely alternatives (`top_logprobs` of them).
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// One alternative in the chat format.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    /// Token text.
    pub token: String,
    /// Its logprob.
    pub logprob: f32,
    /// Its UTF-8 bytes.
    pub bytes: Vec<u8>,
}

impl ChatLogprobs {
    /// The chat-format entries of generated tokens.
    pub fn of(tokens: &[TokenLogprob]) -> Self {
        let content = tokens
            .iter()
            .map(|t| ChatTokenLogprob {
                token: t.text.clone(),
                logprob: finite(t.logprob.unwrap_or(FLOOR)),
                bytes: t.text.as_bytes().to_vec(),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|(s, l)| ChatTopLogprob { token: s.clone(), logprob: finite(*l), bytes: s.as_bytes().to_vec() })
                    .collect(),
            })
            .collect();
        ChatLogprobs { content }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tok(text: &str, logprob: Option<f32>, top: &[(&str, f32)]) -> TokenLogprob {
        TokenLogprob {
            id: 0,
            text: text.into(),
            logprob,
            top: top.iter().map(|(s, l)| (s.to_string(), *l)).collect(),
        }
    }

    #[test]
    fn completion_lists_are_parallel_with_char_offsets() {
        let prompt = [tok("Hé", None, &[]), tok("llo", Some(-0.5), &[("llo", -0.5), ("y", -1.5)])];
        let gen = [tok(" wor", Some(-2.0), &[("ld", -0.25)]), tok("ld", Some(f32::NEG_INFINITY), &[])];
        let mut offset = 0;
        let mut l = CompletionLogprobs::of(&prompt, &mut offset);
        assert_eq!(offset, 5);
        l.extend(&gen, &mut offset);
        assert_eq!(
            serde_json::to_value(&l).unwrap(),
            json!({
                "tokens": ["Hé", "llo", " wor", "ld"],
                "token_logprobs": [null, -0.5, -2.0, -9999.0],
                // the chosen token is added when it is not among the top alternatives
                "top_logprobs": [null, {"llo": -0.5, "y": -1.5}, {"ld": -0.25, " wor": -2.0}, {"ld": -9999.0}],
                "text_offset": [0, 2, 5, 9],
            })
        );
        assert_eq!(offset, 11);
    }

    #[test]
    fn top_map_keeps_the_engine_order() {
        let m = TopMap(vec![("z".into(), -0.1), ("a".into(), -0.2)]);
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"z":-0.1,"a":-0.2}"#);
    }

    #[test]
    fn chat_format() {
        let l = ChatLogprobs::of(&[tok("é", Some(-0.5), &[("é", -0.5), ("e", -1.0)])]);
        assert_eq!(
            serde_json::to_value(&l).unwrap(),
            json!({"content": [{"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": [
                {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
                {"token": "e", "logprob": -1.0, "bytes": [101]},
            ]}]})
        );
    }
}
