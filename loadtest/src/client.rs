//! One request to an OpenAI-compatible server, timed: the request body for the completions and
//! chat endpoints, and the reading of streamed (SSE) or whole responses.

use crate::dataset::BenchRequest;
use crate::sse::{SseEvent, SseParser};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::Instant;

/// Where and how requests are sent.
#[derive(Clone, Debug)]
pub struct Target {
    client: reqwest::Client,
    url: String,
    /// The `model` field of each request.
    pub model: String,
    chat: bool,
    stream: bool,
    ignore_eos: bool,
}

/// What one request measured. Times are seconds from just before the request was sent.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// The error text when the request failed.
    pub error: Option<String>,
    /// Generated text.
    pub text: String,
    /// Time to the first chunk with text (streaming only).
    pub ttft: Option<f64>,
    /// Gaps between successive chunks with text (streaming only).
    pub itl: Vec<f64>,
    /// Time to the end of the response.
    pub e2e: f64,
    /// `usage.prompt_tokens`, when the server sent it.
    pub usage_prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`, when the server sent it.
    pub usage_completion_tokens: Option<u64>,
}

impl Outcome {
    /// A request that failed before or without a response.
    pub fn failed(error: String, e2e: f64) -> Self {
        Outcome { error: Some(error), e2e, ..Default::default() }
    }
}

impl Target {
    /// A target at `base_url` + `endpoint`.
    pub fn new(
        client: reqwest::Client,
        base_url: &str,
        endpoint: &str,
        model: String,
        stream: bool,
        ignore_eos: bool,
    ) -> Self {
        let chat = endpoint.trim_end_matches('/').ends_with("chat/completions");
        Target { client, url: format!("{base_url}{endpoint}"), model, chat, stream, ignore_eos }
    }

    /// The JSON body for `req`: greedy, `max_tokens` = the requested output length, usage
    /// asked for in streams, and `ignore_eos` unless turned off.
    pub fn body(&self, req: &BenchRequest) -> Value {
        let mut body = json!({
            "model": self.model,
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "stream": self.stream,
        });
        if self.chat {
            body["messages"] = json!([{ "role": "user", "content": req.prompt }]);
        } else {
            body["prompt"] = json!(req.prompt);
        }
        if self.stream {
            body["stream_options"] = json!({ "include_usage": true });
        }
        if self.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        body
    }

    /// Sends `req` and measures it; never panics or returns early on a server's misbehaviour.
    pub async fn send(&self, req: &BenchRequest) -> Outcome {
        let start = Instant::now();
        let resp = match self.client.post(&self.url).json(&self.body(req)).send().await {
            Ok(r) => r,
            Err(e) => return Outcome::failed(error_chain(&e), start.elapsed().as_secs_f64()),
        };
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Outcome::failed(format!("HTTP {status}: {}", clip(body.trim())), start.elapsed().as_secs_f64());
        }
        let mut out = Outcome::default();
        if self.stream {
            read_stream(resp, start, &mut out).await;
        } else {
            match resp.text().await {
                Ok(body) => match serde_json::from_str::<Value>(&body) {
                    Ok(v) => absorb_chunk(&v, &mut out),
                    Err(e) => out.error = Some(format!("response is not JSON ({e}): {}", clip(&body))),
                },
                Err(e) => out.error = Some(error_chain(&e)),
            }
        }
        out.e2e = start.elapsed().as_secs_f64();
        out
    }
}

/// Reads an SSE body into `out`, timing each chunk that carries text.
async fn read_stream(resp: reqwest::Response, start: Instant, out: &mut Outcome) {
    let mut parser = SseParser::new();
    let mut last: Option<Instant> = None;
    let mut body = resp.bytes_stream();
    let mut done = false;
    while !done {
        let (events, now) = match body.next().await {
            Some(Ok(bytes)) => (parser.push(&bytes), Instant::now()),
            Some(Err(e)) => {
                out.error = Some(error_chain(&e));
                return;
            }
            None => {
                done = true;
                (parser.finish().into_iter().collect(), Instant::now())
            }
        };
        for ev in events {
            let (event, data) = match ev {
                SseEvent::Done => return,
                SseEvent::Message { event, data } => (event, data),
            };
            if event.as_deref() == Some("error") {
                out.error = Some(clip(&data));
                return;
            }
            let v: Value = match serde_json::from_str(&data) {
                Ok(v) => v,
                Err(e) => {
                    out.error = Some(format!("stream chunk is not JSON ({e}): {}", clip(&data)));
                    return;
                }
            };
            let before = out.text.len();
            absorb_chunk(&v, out);
            if out.error.is_some() {
                return;
            }
            if out.text.len() > before {
                match last {
                    None => out.ttft = Some((now - start).as_secs_f64()),
                    Some(prev) => out.itl.push((now - prev).as_secs_f64()),
                }
                last = Some(now);
            }
        }
    }
}

/// Takes a response or stream chunk's text, usage and error into `out`.
///
/// Text is each choice's `text` (completions), or its `delta`/`message` `content` and
/// `reasoning_content` (chat).
fn absorb_chunk(v: &Value, out: &mut Outcome) {
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        let msg = err.get("message").and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| err.to_string());
        out.error = Some(clip(&msg));
        return;
    }
    for choice in v.get("choices").and_then(Value::as_array).into_iter().flatten() {
        if let Some(t) = choice.get("text").and_then(Value::as_str) {
            out.text.push_str(t);
        }
        for key in ["delta", "message"] {
            for field in ["reasoning_content", "content"] {
                if let Some(t) = choice.get(key).and_then(|m| m.get(field)).and_then(Value::as_str) {
                    out.text.push_str(t);
                }
            }
        }
    }
    if let Some(usage) = v.get("usage").filter(|u| u.is_object()) {
        out.usage_prompt_tokens = usage.get("prompt_tokens").and_then(Value::as_u64).or(out.usage_prompt_tokens);
        out.usage_completion_tokens =
            usage.get("completion_tokens").and_then(Value::as_u64).or(out.usage_completion_tokens);
    }
}

/// An error with its causes, `a: b: c`.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// At most 500 characters of a server's text, for error messages.
fn clip(s: &str) -> String {
    const MAX: usize = 500;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(endpoint: &str, stream: bool) -> Target {
        Target::new(reqwest::Client::new(), "http://127.0.0.1:1", endpoint, "m".into(), stream, true)
    }

    #[test]
    fn bodies_for_each_endpoint() {
        let req = BenchRequest { prompt: "hi".into(), prompt_len: 1, output_len: 7 };
        let b = target("/v1/completions", true).body(&req);
        assert_eq!(b["prompt"], "hi");
        assert_eq!(b["max_tokens"], 7);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert!(b.get("messages").is_none());
        let b = target("/v1/chat/completions", false).body(&req);
        assert_eq!(b["messages"][0]["content"], "hi");
        assert!(b.get("prompt").is_none());
        assert!(b.get("stream_options").is_none(), "servers reject stream_options without stream");
    }

    #[test]
    fn chunks_give_text_usage_and_errors() {
        let mut out = Outcome::default();
        absorb_chunk(&json!({"choices":[{"text":"a"}]}), &mut out);
        absorb_chunk(&json!({"choices":[{"delta":{"role":"assistant"}}]}), &mut out);
        absorb_chunk(&json!({"choices":[{"delta":{"content":"b"}}], "usage": null}), &mut out);
        absorb_chunk(&json!({"choices":[], "usage":{"prompt_tokens":3,"completion_tokens":2}}), &mut out);
        assert_eq!(out.text, "ab");
        assert_eq!((out.usage_prompt_tokens, out.usage_completion_tokens), (Some(3), Some(2)));
        assert!(out.error.is_none());
        absorb_chunk(&json!({"error":{"message":"boom","code":500}}), &mut out);
        assert_eq!(out.error.as_deref(), Some("boom"));
    }

    #[test]
    fn clip_keeps_short_text_and_cuts_on_a_char_boundary() {
        assert_eq!(clip("abc"), "abc");
        let long = "\u{e9}".repeat(600);
        assert_eq!(clip(&long).chars().count(), 503);
    }
}
