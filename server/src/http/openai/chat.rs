//! `POST /v1/chat/completions`: messages rendered with the model's chat template, `n` choices,
//! chat-format logprobs, tool calls ([`tools`](super::tools)), streaming as
//! `chat.completion.chunk`s (role first, then content, then any tool calls).

use super::generation::{self, ChoiceOutput, ChunkShaper, Finish};
use super::logprobs::ChatLogprobs;
use super::request::{self, refuse_set, CommonParams, DefaultMaxTokens, RequestShape};
use super::response::{stop_reason_json, Meta};
use super::structured;
use super::tool_parsers::ToolParser;
use super::tools::{CallsSent, ToolCall, ToolCallDelta, ToolCalling};
use crate::http::chat_template::{ChatMessage, ChatTemplate};
use crate::http::errors::ApiError;
use crate::http::conn::PeerSocket;
use crate::http::{json, AppState};
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::sync::Arc;
use std::time::Instant;
use tessera_engine::serve::{FinishReason, GenRequest, TokenLogprob};
use tessera_engine::structured::Grammars;
use tessera_engine::tokenizer::Tokenizer;


const ROLE: &str = "assistant";

/// The roles a message may have (OpenAI's; `developer` and `tool` reach the template as given).
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Chat fields (OpenAI's and vLLM's) that change the prompt or the answer and are not
/// supported: refused when set (`functions` and `function_call` are OpenAI's deprecated form
/// of `tools` and `tool_choice`).
pub(crate) const UNSUPPORTED: [&str; 9] = [
    "functions",
    "function_call",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "documents",
    "echo",
    "audio",
    "prediction",
];

/// Fields only the chat endpoint has.
#[derive(Debug, Deserialize)]
struct ChatParams {
    messages: Option<Vec<MessageIn>>,
    logprobs: Option<bool>,
    top_logprobs: Option<usize>,
    max_completion_tokens: Option<usize>,
    add_generation_prompt: Option<bool>,
    add_special_tokens: Option<bool>,
}

/// A message as a client sends it.
#[derive(Debug, Deserialize)]
pub(crate) struct MessageIn {
    role: String,
    content: Option<Content>,
    name: Option<String>,
    /// An assistant turn's calls (passed to the template as sent).
    tool_calls: Option<Value>,
    /// A `tool` turn's answer to this call.
    tool_call_id: Option<String>,
}

/// A message's content: text, or a list of parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Debug, Serialize)]
struct Message {
    role: &'static str,
    /// `null` when the answer is only tool calls.
    content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Serialize)]
struct Choice {
    index: usize,
    message: Message,
    logprobs: Option<ChatLogprobs>,
    finish_reason: &'static str,
    stop_reason: Value,
}

#[derive(Debug, Default, Serialize)]
struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Serialize)]
struct ChunkChoice {
    index: usize,
    delta: Delta,
    logprobs: Option<ChatLogprobs>,
    finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<Value>,
}

impl ChunkChoice {
    fn delta(index: usize, delta: Delta, logprobs: Option<ChatLogprobs>) -> Self {
        ChunkChoice { index, delta, logprobs, finish_reason: None, stop_reason: None }
    }
}

/// The handler.
pub async fn chat_completions(State(state): State<Arc<AppState>>, peer: Option<Extension<PeerSocket>>, body: Body) -> Response {
    let started = Instant::now();
    let meta = Meta::new("chatcmpl", state.model_name());
    super::respond(meta.id.clone(), run(state, body, meta, started, peer.map(|Extension(p)| p))).await
}

async fn run(state: Arc<AppState>, body: Body, meta: Meta, started: Instant, peer: Option<PeerSocket>) -> Result<Response, ApiError> {
    let value = super::read_body(&state, body, started).await?;
    let (st, id) = (state.clone(), meta.id.clone());
    let v = super::off_the_runtime(move || {
        let template = st.chat_template().map_err(ApiError::bad_request)?;
        let engine = st.engine();
        validate(&value, &id, template, st.tool_parser(), &engine.model().tokenizer, engine.grammars(), engine.info().max_model_len)
    })
    .await?;
    state.check_model(v.common.model.as_deref())?;
    let interrupts = super::Interrupts::new(&state, &v.common, started, peer)?;
    let (common, logprobs, prompt_tokens, reqs, tools) = (v.common, v.logprobs, v.prompt_tokens, v.reqs, v.tools);
    super::log_request(&common, 1, reqs.len(), prompt_tokens);
    let choices = reqs.len();
    // The prompt is the conversation: errors about it name `messages`.
    let events = generation::submit_all(state.engine(), reqs).map_err(|e| match e.param.as_deref() {
        Some("prompt") => ApiError { param: Some("messages".into()), ..e },
        _ => e,
    })?;
    let shaper = Shaper::new(logprobs.is_some(), tools.filter(ToolCalling::parses), &meta.id);
    super::deliver(shaper, meta, events, choices, prompt_tokens, &common, interrupts).await
}

/// `logprobs: true` with `top_logprobs` alternatives becomes the engine's top-n.
/// A chat body checked and turned into engine requests: what the handler submits, and what
/// the `openai_request` fuzz target exercises ([`crate::fuzzing`]).
pub(crate) struct Validated {
    /// The parameters chat shares with completions.
    pub common: CommonParams,
    /// Top logprobs per token, when logprobs were asked for.
    pub logprobs: Option<usize>,
    /// Tokens of the rendered conversation.
    pub prompt_tokens: usize,
    /// One engine request per choice.
    pub reqs: Vec<GenRequest>,
    /// The request's tools, when it has any.
    pub tools: Option<ToolCalling>,
}

/// Checks a chat body (parsed JSON), renders the conversation with `template` and builds its
/// engine requests, ids from `id`; tool calls are written in `parser`'s syntax.
pub(crate) fn validate(
    value: &Value,
    id: &str,
    template: &ChatTemplate,
    parser: ToolParser,
    tok: &Tokenizer,
    grammars: Result<&Grammars, &str>,
    max_model_len: usize,
) -> Result<Validated, ApiError> {
    let mut common: CommonParams = json::fields(value)?;
    let own: ChatParams = json::fields(value)?;
    common.max_tokens = own.max_completion_tokens.or(common.max_tokens);
    let logprobs = chat_logprobs(own.logprobs, own.top_logprobs)?;
    refuse_set(value, &request::UNSUPPORTED)?;
    refuse_set(value, &UNSUPPORTED)?;
    let tools = ToolCalling::from_request(value, parser)?;
    let messages = messages(own.messages)?;
    let how = Conversation {
        add_generation_prompt: own.add_generation_prompt.unwrap_or(true),
        add_special_tokens: own.add_special_tokens.unwrap_or(true),
        reasoning_effort: reasoning_effort(value.get("reasoning_effort"), "reasoning_effort")?,
    };
    let prompt = conversation_tokens(template, tok, &messages, how, tools.as_ref().map(ToolCalling::template_tools))?;
    let guide = match tools.as_ref().and_then(|t| t.constraint(tok)) {
        Some(c) => {
            if structured::is_set(value)? {
                return Err(ApiError::invalid("tool_choice", "tool_choice required or a named function cannot be combined with a structured-output constraint"));
            }
            let grammars = grammars.map_err(|e| ApiError::invalid("tool_choice", format!("tool_choice needs structured outputs, unavailable for this model: {e}")))?;
            Some(grammars.compile(&c).map_err(|e| ApiError::invalid("tools", format!("the tools' parameter schemas were refused by the grammar compiler: {e}")))?)
        }
        None => structured::guide(value, grammars)?,
    };
    let shape = RequestShape {
        max_model_len,
        logprobs,
        prompt_logprobs: None,
        default_max_tokens: DefaultMaxTokens::RestOfContext,
        guide: guide.as_ref(),
    };
    let prompt_tokens = prompt.len();
    let reqs = common.requests(id, &[prompt], shape)?;
    Ok(Validated { common, logprobs, prompt_tokens, reqs, tools })
}

/// How a conversation becomes prompt tokens (vLLM's fields; both default to true here).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Conversation {
    /// End with the assistant's turn opener.
    pub add_generation_prompt: bool,
    /// Prepend BOS when the checkpoint asks for it (never twice when the template writes it).
    pub add_special_tokens: bool,
    /// `reasoning_effort`, for templates that read it (gpt-oss's).
    pub reasoning_effort: Option<&'static str>,
}

/// The `reasoning_effort` values OpenAI's API takes.
const EFFORTS: [&str; 5] = ["none", "minimal", "low", "medium", "high"];

/// A request's `reasoning_effort` (`param` names it in errors), checked against [`EFFORTS`].
pub(crate) fn reasoning_effort(value: Option<&Value>, param: &str) -> Result<Option<&'static str>, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => EFFORTS.iter().find(|e| **e == s.as_str()).map(|e| Some(*e)).ok_or_else(|| {
            ApiError::invalid(param, format!("{param} {s:?} is not one of {}", EFFORTS.join(", ")))
        }),
        Some(_) => Err(ApiError::invalid(param, format!("{param} must be a string"))),
    }
}

/// The prompt tokens of `messages` (and `tools`, as the template shows them) rendered with
/// `template`; errors name `messages`.
pub(crate) fn conversation_tokens(
    template: &ChatTemplate,
    tok: &Tokenizer,
    messages: &[ChatMessage],
    how: Conversation,
    tools: Option<&Value>,
) -> Result<Vec<u32>, ApiError> {
    let rendered = template.render(messages, how.add_generation_prompt, tools, how.reasoning_effort).map_err(|e| ApiError::invalid("messages", e))?;
    let add_bos = how.add_special_tokens && tok.special().add_bos;
    let text = template.without_duplicate_bos(&rendered, add_bos);
    tok.encode_with(text, add_bos).map_err(|e| ApiError::invalid("messages", format!("tokenizing the conversation failed: {e}")))
}

fn chat_logprobs(logprobs: Option<bool>, top: Option<usize>) -> Result<Option<usize>, ApiError> {
    match (logprobs.unwrap_or(false), top) {
        (_, Some(t)) if t > 20 => Err(ApiError::invalid("top_logprobs", format!("top_logprobs must be in [0, 20], got {t}"))),
        (false, Some(_)) => Err(ApiError::invalid("top_logprobs", "top_logprobs requires logprobs to be true")),
        (true, t) => Ok(Some(t.unwrap_or(0))),
        (false, None) => Ok(None),
    }
}

/// Messages as the template sees them (content parts joined, text only).
pub(crate) fn messages(input: Option<Vec<MessageIn>>) -> Result<Vec<ChatMessage>, ApiError> {
    let input = input.ok_or_else(|| ApiError::invalid("messages", "messages is required"))?;
    if input.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    input
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!("Invalid role {:?}: a message's role must be one of {}", m.role, ROLES.join(", ")),
                ));
            }
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => parts
                    .into_iter()
                    .map(|p| match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => Ok(t),
                        _ => Err(ApiError::invalid(
                            format!("messages[{i}].content"),
                            "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join("\n"),
            };
            Ok(ChatMessage { role: m.role, content, name: m.name, tool_calls: m.tool_calls, tool_call_id: m.tool_call_id })
        })
        .collect()
}

/// Shapes chat choices.
struct Shaper {
    logprobs: bool,
    /// Set when the answer is searched for tool calls.
    tools: Option<ToolCalling>,
    /// Tool-call ids start with this (`call_` and the response id's tail).
    call_id: String,
    /// Streaming with tools: per choice, what it generated and sent.
    streamed: Vec<ChoiceStream>,
}

/// A streamed choice with tools: its text so far, how much went out as content, and the calls
/// begun.
#[derive(Debug, Default)]
struct ChoiceStream {
    text: String,
    sent: usize,
    calls: CallsSent,
}

impl Shaper {
    fn new(logprobs: bool, tools: Option<ToolCalling>, response_id: &str) -> Self {
        let tail = response_id.rsplit('-').next().unwrap_or(response_id);
        Shaper { logprobs, tools, call_id: format!("call_{tail}"), streamed: Vec::new() }
    }

}

impl ChunkShaper for Shaper {
    type Choice = ChunkChoice;
    const OBJECT: &'static str = "chat.completion.chunk";
    type Whole = Choice;
    const WHOLE_OBJECT: &'static str = "chat.completion";

    fn whole(&self, index: usize, o: ChoiceOutput) -> Choice {
        let finish = o.finish.expect("collected choices are finished");
        let (content, tool_calls) = match &self.tools {
            Some(t) => t.parse(&o.text, &format!("{}-{index}", self.call_id)),
            None => (Some(o.text), Vec::new()),
        };
        Choice {
            index,
            finish_reason: finish_reason(&finish, !tool_calls.is_empty()),
            message: Message { role: ROLE, content, tool_calls },
            logprobs: self.logprobs.then(|| ChatLogprobs::of(&o.tokens)),
            stop_reason: stop_reason_json(finish.stop_reason.as_ref()),
        }
    }

    fn start(&mut self, i: usize) -> Option<ChunkChoice> {
        Some(ChunkChoice::delta(i, Delta { role: Some(ROLE), content: Some(String::new()), tool_calls: None }, None))
    }

    fn prompt_logprobs(&mut self, _: usize, _: Vec<TokenLogprob>) -> Option<ChunkChoice> {
        None
    }

    fn delta(&mut self, i: usize, text: String, tokens: Vec<TokenLogprob>) -> Option<ChunkChoice> {
        // With tools, text that may be a call is held back; a call goes out as it is written
        // (its name once complete, then its arguments).
        let (text, calls) = match &self.tools {
            Some(t) => {
                if self.streamed.len() <= i {
                    self.streamed.resize_with(i + 1, Default::default);
                }
                let st = &mut self.streamed[i];
                st.text.push_str(&text);
                t.stream(&st.text, &mut st.sent, &mut st.calls, &format!("{}-{i}", self.call_id))
            }
            None => (text, Vec::new()),
        };
        if text.is_empty() && calls.is_empty() && (tokens.is_empty() || !self.logprobs) {
            return None;
        }
        let logprobs = self.logprobs.then(|| ChatLogprobs::of(&tokens));
        let content = Some(text).filter(|t| !t.is_empty() || calls.is_empty());
        Some(ChunkChoice::delta(i, Delta { content, tool_calls: Some(calls).filter(|c| !c.is_empty()), ..Delta::default() }, logprobs))
    }

    fn finish(&mut self, i: usize, f: Finish) -> ChunkChoice {
        // The held-back text: the rest of the calls it holds, or else the rest of the content.
        let mut delta = Delta::default();
        let mut called = false;
        if let Some(t) = &self.tools {
            let st = self.streamed.get_mut(i).map(std::mem::take).unwrap_or_default();
            let (content, calls) = t.parse(&st.text, &format!("{}-{i}", self.call_id));
            called = !calls.is_empty();
            if called {
                // Content before the calls that was held back (llama3_json's text opening with `{`).
                delta.content = content.and_then(|c| c.get(st.sent..).filter(|c| !c.is_empty()).map(str::to_owned));
                delta.tool_calls = Some(ToolCalling::finish_calls(calls, &st.calls)).filter(|d: &Vec<ToolCallDelta>| !d.is_empty());
            } else {
                // No calls after all: the held-back text is content, as a whole answer has it
                // (a call begun in the stream stays as far as it went, and the finish reason
                // says no call was made).
                delta.content = Some(st.text[st.sent..].to_owned()).filter(|c| !c.is_empty());
            }
        }
        ChunkChoice {
            finish_reason: Some(finish_reason(&f, called)),
            stop_reason: Some(stop_reason_json(f.stop_reason.as_ref())),
            ..ChunkChoice::delta(i, delta, None)
        }
    }
}

/// `tool_calls` when the answer ended by itself with calls in it; the engine's reason otherwise.
fn finish_reason(f: &Finish, called: bool) -> &'static str {
    match f.reason {
        FinishReason::Stop if called => "tool_calls",
        r => r.as_str(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::json::fields;
    use serde_json::json;
    use tessera_engine::serve::StopReason;

    fn parse(v: Value) -> Result<Vec<ChatMessage>, ApiError> {
        messages(fields::<ChatParams>(&v)?.messages)
    }

    #[test]
    fn message_content_forms() {
        let m = parse(json!({"messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
            {"role": "assistant", "content": null},
        ]}))
        .unwrap();
        let msg = |role: &str, content: &str, name: Option<&str>| ChatMessage {
            role: role.into(),
            content: content.into(),
            name: name.map(Into::into),
            tool_calls: None,
            tool_call_id: None,
        };
        assert_eq!(m[0], msg("system", "s", None));
        assert_eq!(m[1], msg("user", "a\nb", Some("u")));
        assert_eq!(m[2].content, "");
    }

    #[test]
    fn bad_messages_name_the_parameter() {
        let cases = [
            (json!({}), "messages"),
            (json!({"messages": []}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": [{"content": "hi"}]}), "messages[0]"),
            (json!({"messages": [{"role": "user", "content": 5}]}), "messages[0].content"),
            (json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "messages[0].content"),
        ];
        for (body, param) in cases {
            let e = parse(body.clone()).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}: {}", e.message);
        }
    }

    #[test]
    fn logprobs_flags() {
        assert_eq!(chat_logprobs(None, None).unwrap(), None);
        assert_eq!(chat_logprobs(Some(true), None).unwrap(), Some(0));
        assert_eq!(chat_logprobs(Some(true), Some(5)).unwrap(), Some(5));
        for (lp, top) in [(Some(false), Some(2)), (None, Some(2)), (Some(true), Some(21))] {
            assert_eq!(chat_logprobs(lp, top).unwrap_err().param.as_deref(), Some("top_logprobs"));
        }
    }

    #[test]
    fn a_stream_whose_calls_do_not_parse_sends_its_text_as_the_whole_answer_has_it() {
        let body = json!({"tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]});
        let tools = || ToolCalling::from_request(&body, crate::http::openai::tool_parsers::ToolParser::Hermes).unwrap();
        let f = Finish { reason: FinishReason::Stop, stop_reason: None, completion_tokens: 9, cached_tokens: 0 };
        let text = "Sure. <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\nLet me know!";
        let whole = serde_json::to_value(Shaper::new(false, tools(), "chatcmpl-x").whole(0, ChoiceOutput { text: text.into(), finish: Some(f.clone()), ..Default::default() })).unwrap();
        assert_eq!((whole["message"]["content"].as_str(), whole["finish_reason"].as_str()), (Some(text), Some("stop")));
        let mut s = Shaper::new(false, tools(), "chatcmpl-x");
        let mut chunks: Vec<Value> = text.as_bytes().chunks(5).filter_map(|c| s.delta(0, String::from_utf8(c.to_vec()).unwrap(), vec![])).map(|c| serde_json::to_value(c).unwrap()).collect();
        chunks.push(serde_json::to_value(s.finish(0, f)).unwrap());
        let content: String = chunks.iter().filter_map(|c| c["delta"]["content"].as_str()).collect();
        assert_eq!(content, text, "nothing is lost: {chunks:?}");
        assert!(chunks.iter().any(|c| c["delta"]["tool_calls"].is_array()), "the call streamed as it was written");
        assert_eq!(chunks.last().unwrap()["finish_reason"], "stop");
    }

    #[test]
    fn chunk_and_response_shapes() {
        let mut s = Shaper::new(false, None, "chatcmpl-x");
        let start = serde_json::to_value(s.start(1).unwrap()).unwrap();
        assert_eq!(
            start,
            json!({"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})
        );
        let d = serde_json::to_value(s.delta(1, "Hi".into(), vec![]).unwrap()).unwrap();
        assert_eq!(d["delta"], json!({"content": "Hi"}));
        assert!(s.delta(1, String::new(), vec![]).is_none());
        let f = Finish { reason: FinishReason::Stop, stop_reason: Some(StopReason::Token(2)), completion_tokens: 1, cached_tokens: 0 };
        let end = serde_json::to_value(s.finish(1, f.clone())).unwrap();
        assert_eq!(end, json!({"index": 1, "delta": {}, "logprobs": null, "finish_reason": "stop", "stop_reason": 2}));
        let tok = TokenLogprob { id: 3, text: "Hi".into(), logprob: Some(-0.1), top: vec![("Hi".into(), -0.1)] };
        let out = ChoiceOutput { prompt_logprobs: None, text: "Hi".into(), tokens: vec![tok], finish: Some(f) };
        let whole = serde_json::to_value(Shaper::new(true, None, "chatcmpl-x").whole(0, out)).unwrap();
        assert_eq!(whole["message"], json!({"role": "assistant", "content": "Hi"}));
        assert_eq!(whole["logprobs"]["content"][0]["token"], "Hi");
        assert_eq!(whole["logprobs"]["content"][0]["top_logprobs"][0]["logprob"], json!(-0.1f32));
    }
}
