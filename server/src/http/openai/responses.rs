//! `POST /v1/responses`: OpenAI's Responses API over the chat endpoint's machinery, without
//! state (nothing is stored: `store` is answered `false`, `previous_response_id` refused).
//!
//! A request becomes a chat body ([`to_chat`]): `input` (text, or message, `function_call`
//! and `function_call_output` items) and `instructions` become `messages`,
//! `max_output_tokens` becomes `max_tokens`, `text.format` becomes `response_format`, the
//! flat function `tools` and `tool_choice` take chat's nested form, and `top_logprobs` with
//! `include: ["message.output_text.logprobs"]` becomes chat logprobs. The chat endpoint's
//! checks then apply, with their errors naming the Responses field. The answer is one
//! `response` object whose `output` holds a `message` item (its `output_text`) and a
//! `function_call` item per parsed tool call; streamed, the Responses events in order
//! (`response.created` ... `response.output_text.delta` ... `response.completed`), each with
//! its `sequence_number`. A choice cut by `max_output_tokens` ends `incomplete`.

use super::chat;
use super::generation::{self, Deadline, Events, Finish};
use super::logprobs::{ChatLogprobs, ChatTokenLogprob};
use super::tools::{CallsSent, FunctionCall, ToolCall, ToolCallDelta, ToolCalling};
use super::request::refuse_set;
use super::Interrupts;
use crate::http::conn::PeerSocket;
use crate::http::errors::ApiError;
use crate::http::sse::{self, SseSender};
use crate::http::AppState;
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tessera_engine::serve::{Event, FinishReason, TokenLogprob};
use tracing::Instrument;

/// Responses fields that would change the answer and are not supported (refused when set).
const UNSUPPORTED: [&str; 5] = ["previous_response_id", "conversation", "background", "prompt", "max_tool_calls"];

/// Chat and completions fields a Responses body does not take, and what it takes instead.
const CHAT_ONLY: [(&str, &str); 8] = [
    ("messages", "input"),
    ("max_tokens", "max_output_tokens"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
    ("logprobs", "top_logprobs with include [\"message.output_text.logprobs\"]"),
    ("n", "one request per answer"),
    ("functions", "tools"),
    ("function_call", "tool_choice"),
];

/// Responses fields that are taken and dropped before the body goes to chat: echoed in the
/// answer or without effect on it.
const RESPONSES_ONLY: [&str; 14] = [
    "input",
    "reasoning",
    "instructions",
    "max_output_tokens",
    "text",
    "tools",
    "tool_choice",
    "store",
    "metadata",
    "include",
    "top_logprobs",
    "truncation",
    "service_tier",
    "stream_options",
];

/// What `include` may ask for.
const LOGPROBS_INCLUDE: &str = "message.output_text.logprobs";

/// The handler.
pub async fn responses(State(state): State<Arc<AppState>>, peer: Option<Extension<PeerSocket>>, body: Body) -> Response {
    let started = Instant::now();
    let id = format!("resp_{:032x}", rand::random::<u128>());
    super::respond(id.clone(), run(state, body, id, started, peer.map(|Extension(p)| p))).await
}

async fn run(state: Arc<AppState>, body: Body, id: String, started: Instant, peer: Option<PeerSocket>) -> Result<Response, ApiError> {
    let value = super::read_body(&state, body, started).await?;
    let chat_body = to_chat(&value)?;
    let (st, req_id) = (state.clone(), id.clone());
    let v = super::off_the_runtime(move || {
        let template = st.chat_template().map_err(ApiError::bad_request)?;
        let engine = st.engine();
        chat::validate(&chat_body, &req_id, template, st.tool_parser(), &engine.model().tokenizer, engine.grammars(), engine.info().max_model_len)
    })
    .await
    .map_err(renamed)?;
    state.check_model(v.common.model.as_deref())?;
    let interrupts = Interrupts::new(&state, &v.common, started, peer)?;
    super::log_request(&v.common, 1, 1, v.prompt_tokens);
    let events = generation::submit_all(state.engine(), v.reqs).map_err(renamed)?;
    let shape = Shape {
        id,
        created_at: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        model: state.model_name().to_owned(),
        echo: echo(&value),
        tools: v.tools.filter(ToolCalling::parses),
        logprobs: v.logprobs.is_some(),
        prompt_tokens: v.prompt_tokens,
    };
    if !v.common.stream() {
        let mut outputs = super::collect(events, 1, &interrupts).await?;
        let o = outputs.pop().expect("one choice");
        let finish = o.finish.clone().expect("collected choices are finished");
        super::log_done(finish.completion_tokens);
        let output = shape.output(&o.text, &o.tokens, &finish);
        return Ok(axum::Json(shape.response(output, Some(&finish))).into_response());
    }
    let (tx, resp) = sse::channel();
    let task = async move {
        let (completion_tokens, disconnected) = stream(shape, events, interrupts.deadline, tx).await;
        if disconnected {
            tracing::info!(completion_tokens, "client disconnected before the end of the stream");
        } else {
            super::log_done(completion_tokens);
        }
    };
    tokio::spawn(task.instrument(tracing::Span::current()));
    Ok(resp)
}

/// The chat body a Responses body asks for; refusals name the Responses field.
pub(crate) fn to_chat(body: &Value) -> Result<Value, ApiError> {
    let o = body.as_object().ok_or_else(|| ApiError::bad_request("the body must be a JSON object"))?;
    refuse_set(body, &UNSUPPORTED)?;
    for (field, instead) in CHAT_ONLY {
        if o.contains_key(field) {
            return Err(ApiError::invalid(field, format!("{field} is not a Responses API field; use {instead}")));
        }
    }
    if o.get("truncation").is_some_and(|t| !t.is_null() && t != "disabled") {
        return Err(ApiError::invalid("truncation", "only truncation \"disabled\" is supported (an input too long for the context is a 400)"));
    }
    let mut chat: Map<String, Value> = o.iter().filter(|(k, _)| !RESPONSES_ONLY.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut messages = Vec::new();
    match o.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(ApiError::invalid("instructions", "instructions must be a string")),
    }
    messages.extend(input_messages(o.get("input"))?);
    chat.insert("messages".into(), Value::Array(messages));
    match o.get("reasoning") {
        None | Some(Value::Null) => {}
        Some(Value::Object(r)) => {
            if let Some(k) = r.keys().find(|k| k.as_str() != "effort" && !r[k.as_str()].is_null()) {
                return Err(ApiError::invalid(format!("reasoning.{k}"), format!("reasoning.{k} is not supported")));
            }
            if let Some(effort) = chat::reasoning_effort(r.get("effort"), "reasoning.effort")? {
                chat.insert("reasoning_effort".into(), Value::from(effort));
            }
        }
        Some(_) => return Err(ApiError::invalid("reasoning", "reasoning must be an object")),
    }
    if let Some(m) = o.get("max_output_tokens").filter(|m| !m.is_null()) {
        chat.insert("max_tokens".into(), m.clone());
    }
    if let Some(f) = text_format(o.get("text"))? {
        chat.insert("response_format".into(), f);
    }
    if let Some(tools) = o.get("tools").filter(|t| !t.is_null()) {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = o.get("tool_choice").filter(|c| !c.is_null()) {
        chat.insert("tool_choice".into(), chat_tool_choice(choice)?);
    }
    let include = o.get("include").filter(|i| !i.is_null());
    let wants_logprobs = match include {
        None => false,
        Some(Value::Array(items)) => {
            if let Some((i, _)) = items.iter().enumerate().find(|(_, x)| x.as_str() != Some(LOGPROBS_INCLUDE)) {
                return Err(ApiError::invalid(format!("include[{i}]"), format!("only {LOGPROBS_INCLUDE:?} can be included")));
            }
            !items.is_empty()
        }
        Some(_) => return Err(ApiError::invalid("include", "include must be a list")),
    };
    match o.get("top_logprobs").filter(|t| !t.is_null()) {
        Some(t) if !wants_logprobs && t != 0 => {
            return Err(ApiError::invalid("top_logprobs", format!("top_logprobs needs include [{LOGPROBS_INCLUDE:?}]")));
        }
        // `top_logprobs: 0` without `include`: no logprobs.
        Some(_) if !wants_logprobs => {}
        Some(t) => {
            chat.insert("logprobs".into(), Value::Bool(true));
            chat.insert("top_logprobs".into(), t.clone());
        }
        None if wants_logprobs => {
            chat.insert("logprobs".into(), Value::Bool(true));
        }
        None => {}
    }
    Ok(Value::Object(chat))
}

/// `input` as chat messages.
fn input_messages(input: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Some(Value::String(s)) => return Ok(vec![json!({"role": "user", "content": s})]),
        Some(Value::Array(items)) if !items.is_empty() => items,
        _ => return Err(ApiError::invalid("input", "input (a string or a non-empty list of items) is required")),
    };
    let mut messages: Vec<Value> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = |field: &str| format!("input[{i}]{field}");
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).ok_or_else(|| ApiError::invalid(at(".role"), "a message needs a role"))?;
                let content = match item.get("content") {
                    Some(Value::String(s)) => Value::from(s.as_str()),
                    Some(Value::Array(parts)) => {
                        let mut text = Vec::new();
                        for (j, p) in parts.iter().enumerate() {
                            match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                                (Some("input_text" | "output_text"), Some(t)) => text.push(json!({"type": "text", "text": t})),
                                _ => return Err(ApiError::invalid(at(&format!(".content[{j}]")), "only input_text and output_text content parts are supported")),
                            }
                        }
                        Value::Array(text)
                    }
                    _ => return Err(ApiError::invalid(at(".content"), "a message's content is a string or a list of parts")),
                };
                messages.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let field = |k: &str| item.get(k).and_then(Value::as_str).ok_or_else(|| ApiError::invalid(at(&format!(".{k}")), format!("a function_call item needs {k} (a string)")));
                let call = json!({"id": field("call_id")?, "type": "function", "function": {"name": field("name")?, "arguments": field("arguments")?}});
                // Calls in a row are one assistant turn.
                match messages.last_mut() {
                    Some(m) if m["role"] == "assistant" && m["tool_calls"].is_array() => m["tool_calls"].as_array_mut().expect("checked").push(call),
                    _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let call_id = item.get("call_id").and_then(Value::as_str).ok_or_else(|| ApiError::invalid(at(".call_id"), "a function_call_output item needs call_id"))?;
                let output = item.get("output").and_then(Value::as_str).ok_or_else(|| ApiError::invalid(at(".output"), "a function_call_output's output must be a string"))?;
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            other => return Err(ApiError::invalid(at(".type"), format!("input items of type {other:?} are not supported (message, function_call, function_call_output)"))),
        }
    }
    Ok(messages)
}

/// `text.format` as chat's `response_format` (`None` for plain text).
fn text_format(text: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(text) = text.filter(|t| !t.is_null()) else { return Ok(None) };
    let t = text.as_object().ok_or_else(|| ApiError::invalid("text", "text must be an object"))?;
    if let Some(k) = t.keys().find(|k| k.as_str() != "format") {
        return Err(ApiError::invalid(format!("text.{k}"), format!("text.{k} is not supported")));
    }
    let Some(f) = t.get("format").filter(|f| !f.is_null()) else { return Ok(None) };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for k in ["name", "schema", "strict", "description"] {
                if let Some(v) = f.get(k) {
                    schema.insert(k.into(), v.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(ApiError::invalid("text.format.type", "text.format.type is text, json_object or json_schema")),
    }
}

/// Responses' flat function tools in chat's nested form.
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let list = tools.as_array().ok_or_else(|| ApiError::invalid("tools", "tools must be a list"))?;
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(format!("tools[{i}].type"), "only tools of type function are supported"));
        }
        let mut function = Map::new();
        for k in ["name", "description", "parameters", "strict"] {
            if let Some(v) = t.get(k) {
                function.insert(k.into(), v.clone());
            }
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

/// `tool_choice` in chat's form (`{"type": "function", "name": ...}` nests its name).
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        Value::Object(c) if c.get("type").and_then(Value::as_str) == Some("function") => match c.get("name") {
            Some(name) => Ok(json!({"type": "function", "function": {"name": name}})),
            None => Err(ApiError::invalid("tool_choice.name", "a function tool_choice names the function")),
        },
        _ => Err(ApiError::invalid("tool_choice", "tool_choice is none, auto, required or {\"type\": \"function\", \"name\": ...}")),
    }
}

/// A chat error's parameter under its Responses name.
pub(crate) fn renamed(mut e: ApiError) -> ApiError {
    if let Some(p) = e.param.take() {
        let (head, rest) = p.split_at(p.find(['[', '.']).unwrap_or(p.len()));
        e.param = Some(match head {
            "messages" | "prompt" => "input".to_owned(),
            "max_tokens" | "max_completion_tokens" => "max_output_tokens".to_owned(),
            "response_format" => "text.format".to_owned(),
            "logprobs" => "include".to_owned(),
            "reasoning_effort" => "reasoning.effort".to_owned(),
            "tools" => format!("tools{}", rest.replacen(".function.", ".", 1)),
            "tool_choice" => format!("tool_choice{}", rest.replacen(".function.", ".", 1)),
            _ => p,
        });
    }
    e
}

/// The request's fields a `response` object repeats, with OpenAI's defaults.
fn echo(body: &Value) -> Map<String, Value> {
    let get = |k: &str, default: Value| body.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(default);
    let mut m = Map::new();
    m.insert("instructions".into(), get("instructions", Value::Null));
    m.insert("max_output_tokens".into(), get("max_output_tokens", Value::Null));
    m.insert("metadata".into(), get("metadata", json!({})));
    m.insert("parallel_tool_calls".into(), get("parallel_tool_calls", json!(true)));
    m.insert("temperature".into(), get("temperature", json!(1.0)));
    m.insert("top_p".into(), get("top_p", json!(1.0)));
    m.insert("tool_choice".into(), get("tool_choice", json!("auto")));
    m.insert("tools".into(), get("tools", json!([])));
    m.insert("text".into(), get("text", json!({"format": {"type": "text"}})));
    m.insert("top_logprobs".into(), get("top_logprobs", json!(0)));
    m.insert("user".into(), get("user", Value::Null));
    m.insert("previous_response_id".into(), Value::Null);
    m.insert("reasoning".into(), get("reasoning", Value::Null));
    m.insert("store".into(), json!(false));
    m.insert("truncation".into(), json!("disabled"));
    m
}

/// Everything a response's objects are made from.
struct Shape {
    id: String,
    created_at: u64,
    model: String,
    echo: Map<String, Value>,
    /// Set when the answer is searched for tool calls.
    tools: Option<ToolCalling>,
    logprobs: bool,
    prompt_tokens: usize,
}

/// A fresh item id under `prefix` (`msg`, `fc`).
fn item_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

impl Shape {
    /// The `response` object: in progress without `finish`, else completed or incomplete.
    fn response(&self, output: Vec<Value>, finish: Option<&Finish>) -> Value {
        let (status, incomplete, usage) = match finish {
            None => ("in_progress", Value::Null, Value::Null),
            Some(f) => {
                let usage = json!({
                    "input_tokens": self.prompt_tokens,
                    "input_tokens_details": {"cached_tokens": f.cached_tokens},
                    "output_tokens": f.completion_tokens,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": self.prompt_tokens + f.completion_tokens,
                });
                match f.reason {
                    FinishReason::Length => ("incomplete", json!({"reason": "max_output_tokens"}), usage),
                    _ => ("completed", Value::Null, usage),
                }
            }
        };
        let mut r = Map::new();
        r.insert("id".into(), Value::from(self.id.as_str()));
        r.insert("object".into(), json!("response"));
        r.insert("created_at".into(), json!(self.created_at));
        r.insert("status".into(), json!(status));
        r.insert("error".into(), Value::Null);
        r.insert("incomplete_details".into(), incomplete);
        r.insert("model".into(), Value::from(self.model.as_str()));
        r.insert("output".into(), Value::Array(output));
        r.insert("usage".into(), usage);
        r.extend(self.echo.clone());
        Value::Object(r)
    }

    /// The prefix of the calls' ids.
    fn call_id(&self) -> String {
        format!("call_{}", &self.id["resp_".len()..])
    }

    /// The text and the calls in a finished output (all text without tools).
    fn split(&self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        match &self.tools {
            Some(t) => t.parse(text, &self.call_id()),
            None => (Some(text.to_owned()), Vec::new()),
        }
    }

    /// The tokens' logprobs as `output_text.logprobs` (none unless asked for).
    fn token_logprobs(&self, tokens: &[TokenLogprob]) -> Vec<ChatTokenLogprob> {
        if self.logprobs {
            ChatLogprobs::of(tokens).content
        } else {
            Vec::new()
        }
    }

    /// A finished output's items: the message (when there is text, or no call) and the calls.
    fn output(&self, text: &str, tokens: &[TokenLogprob], finish: &Finish) -> Vec<Value> {
        let (content, calls) = self.split(text);
        let mut items = Vec::new();
        if content.is_some() || calls.is_empty() {
            let logprobs = self.token_logprobs(tokens);
            items.push(message_item(&item_id("msg"), content.as_deref().unwrap_or(""), logprobs, item_status(finish)));
        }
        items.extend(calls.iter().map(|c| call_item(&item_id("fc"), c, &c.function.arguments, "completed")));
        items
    }
}

/// `completed`, or `incomplete` for an answer cut short.
fn item_status(f: &Finish) -> &'static str {
    if f.reason == FinishReason::Length {
        "incomplete"
    } else {
        "completed"
    }
}

fn text_part(text: &str, logprobs: Vec<ChatTokenLogprob>) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
}

fn message_item(id: &str, text: &str, logprobs: Vec<ChatTokenLogprob>, status: &str) -> Value {
    let content = if status == "in_progress" { json!([]) } else { json!([text_part(text, logprobs)]) };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(id: &str, call: &ToolCall, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call.id, "name": call.function.name, "arguments": arguments, "status": status})
}

/// A streamed response's events, built as the engine's events arrive.
struct Streamer {
    shape: Shape,
    /// The next event's `sequence_number`.
    seq: u64,
    /// All generated text, and how much of it went out as message text.
    text: String,
    sent: usize,
    /// The message item while it is open: its id, output index, text and logprobs so far.
    message: Option<(String, usize, String, Vec<ChatTokenLogprob>)>,
    /// Output items done, by output index (the message once closed, each call once finished).
    items: Vec<(usize, Value)>,
    /// The calls begun: what the tool parsing has streamed of them.
    calls: CallsSent,
    /// Each call begun: its item id, output index, call id, name and arguments so far.
    call_items: Vec<(String, usize, ToolCall)>,
}

impl Streamer {
    fn new(shape: Shape) -> Self {
        Streamer { shape, seq: 0, text: String::new(), sent: 0, message: None, items: Vec::new(), calls: CallsSent::default(), call_items: Vec::new() }
    }

    /// An event of `kind` with `fields`, numbered.
    fn event(&mut self, kind: &str, fields: Value) -> (String, Value) {
        let mut e = json!({"type": kind, "sequence_number": self.seq});
        e.as_object_mut().expect("an object").extend(fields.as_object().expect("fields are an object").clone());
        self.seq += 1;
        (kind.to_owned(), e)
    }

    /// `response.created` and `response.in_progress`.
    fn start(&mut self) -> Vec<(String, Value)> {
        let r = self.shape.response(Vec::new(), None);
        vec![self.event("response.created", json!({"response": r})), self.event("response.in_progress", json!({"response": r}))]
    }

    /// The output index a new item takes.
    fn next_index(&self) -> usize {
        self.items.len() + self.call_items.len() + usize::from(self.message.is_some())
    }

    /// Sends `piece` (and its tokens' logprobs) as message text, opening the message first.
    fn message_text(&mut self, piece: &str, logprobs: Vec<ChatTokenLogprob>, out: &mut Vec<(String, Value)>) {
        if self.message.is_none() {
            let (id, index) = (item_id("msg"), self.next_index());
            let item = message_item(&id, "", Vec::new(), "in_progress");
            out.push(self.event("response.output_item.added", json!({"output_index": index, "item": item})));
            out.push(self.event("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": text_part("", Vec::new())})));
            self.message = Some((id, index, String::new(), Vec::new()));
        }
        let (id, index, text, all) = self.message.as_mut().expect("opened above");
        text.push_str(piece);
        all.extend(logprobs.iter().cloned());
        let (id, index) = (id.clone(), *index);
        out.push(self.event("response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": piece, "logprobs": logprobs})));
    }

    /// Closes the message, if open.
    fn close_message(&mut self, status: &str, out: &mut Vec<(String, Value)>) {
        let Some((id, index, text, logprobs)) = self.message.take() else { return };
        out.push(self.event("response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": logprobs})));
        out.push(self.event("response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": text_part(&text, logprobs.clone())})));
        let item = message_item(&id, &text, logprobs, status);
        out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
        self.items.push((index, item));
    }

    /// A streamed call chunk: a new call's item (the message, before it, closed), or more of
    /// a call's arguments.
    fn call_chunk(&mut self, d: ToolCallDelta, out: &mut Vec<(String, Value)>) {
        if let (Some(id), Some(name)) = (d.id, d.function.name) {
            self.close_message("completed", out);
            let (item, index) = (item_id("fc"), self.next_index());
            let call = ToolCall { id, kind: "function", function: FunctionCall { name, arguments: String::new() } };
            out.push(self.event("response.output_item.added", json!({"output_index": index, "item": call_item(&item, &call, "", "in_progress")})));
            self.call_items.push((item, index, call));
        }
        let Some((item, index, call)) = self.call_items.get_mut(d.index) else { return };
        if d.function.arguments.is_empty() {
            return;
        }
        call.function.arguments.push_str(&d.function.arguments);
        let (item, index) = (item.clone(), *index);
        out.push(self.event("response.function_call_arguments.delta", json!({"item_id": item, "output_index": index, "delta": d.function.arguments})));
    }

    /// New text: what can go out as message text (with tools, text that may be a call is held
    /// back) and the calls as they are written.
    fn delta(&mut self, text: &str, tokens: &[TokenLogprob]) -> Vec<(String, Value)> {
        self.text.push_str(text);
        let mut out = Vec::new();
        let logprobs = self.shape.token_logprobs(tokens);
        // Taken out while the stream's state changes, and put back.
        let Some(t) = self.shape.tools.take() else {
            self.sent = self.text.len();
            if !text.is_empty() || !logprobs.is_empty() {
                self.message_text(text, logprobs, &mut out);
            }
            return out;
        };
        let (piece, calls) = t.stream(&self.text, &mut self.sent, &mut self.calls, &self.shape.call_id());
        if !piece.is_empty() || (!logprobs.is_empty() && self.message.is_some()) {
            self.message_text(&piece, logprobs, &mut out);
        }
        for d in calls {
            self.call_chunk(d, &mut out);
        }
        self.shape.tools = Some(t);
        out
    }

    /// The end: the held-back text, the rest of the calls, every item closed, then
    /// `response.completed` (or `response.incomplete`) with the whole output.
    fn finish(&mut self, finish: &Finish) -> Vec<(String, Value)> {
        let (content, calls) = self.shape.split(&self.text);
        let mut out = Vec::new();
        let status = item_status(finish);
        if calls.is_empty() {
            // No calls after all: the held-back text is the message's, as a whole answer has it
            // (a call begun in the stream stays, `incomplete`, as far as it went).
            let rest = self.text[self.sent..].to_owned();
            if !rest.is_empty() || self.next_index() == 0 {
                self.message_text(&rest, Vec::new(), &mut out);
            }
        } else if let Some(rest) = content.as_deref().and_then(|c| c.get(self.sent..)).filter(|r| !r.is_empty()) {
            // Content before the calls that was held back (llama3_json's text opening with `{`).
            let rest = rest.to_owned();
            self.message_text(&rest, Vec::new(), &mut out);
        }
        self.close_message(status, &mut out);
        // A call begun and never finished (cut short, or malformed) stays as streamed.
        let parsed = !calls.is_empty();
        for d in ToolCalling::finish_calls(calls, &self.calls) {
            self.call_chunk(d, &mut out);
        }
        let call_status = if parsed { "completed" } else { "incomplete" };
        for (item, index, call) in std::mem::take(&mut self.call_items) {
            let args = call.function.arguments.clone();
            out.push(self.event("response.function_call_arguments.done", json!({"item_id": item, "output_index": index, "arguments": args})));
            let done = call_item(&item, &call, &args, call_status);
            out.push(self.event("response.output_item.done", json!({"output_index": index, "item": done})));
            self.items.push((index, done));
        }
        let kind = if finish.reason == FinishReason::Length { "response.incomplete" } else { "response.completed" };
        let mut items = std::mem::take(&mut self.items);
        items.sort_by_key(|(index, _)| *index);
        let r = self.shape.response(items.into_iter().map(|(_, item)| item).collect(), Some(finish));
        out.push(self.event(kind, json!({"response": r})));
        out
    }

    /// An `error` event (the engine failed, or the deadline passed).
    fn error(&mut self, e: &ApiError) -> (String, Value) {
        let code = if e.status.as_u16() == 408 { "timeout" } else { "server_error" };
        self.event("error", json!({"code": code, "message": e.message, "param": null}))
    }
}

/// Streams the events; returns the tokens generated and whether the client went away.
async fn stream(shape: Shape, mut events: Events, deadline: Option<Deadline>, sse: SseSender) -> (usize, bool) {
    let mut s = Streamer::new(shape);
    let mut open = true;
    for (kind, e) in s.start() {
        open = open && sse.send_named(&kind, &e).await.is_ok();
    }
    let mut tokens = 0;
    while open {
        let next = tokio::select! {
            next = sse.next_or_closed(&mut events) => next,
            () = generation::until(deadline.as_ref()) => {
                let e = s.error(&deadline.as_ref().map(Deadline::expired).expect("only a deadline expires"));
                open = sse.send_named(&e.0, &e.1).await.is_ok();
                break;
            }
        };
        let Some((_, event)) = next else { break };
        let out = match event {
            Event::PromptLogprobs(_) => Vec::new(),
            Event::Delta { text, tokens } => s.delta(&text, &tokens),
            Event::Error(msg) => {
                tracing::error!(error = %msg, "engine error while streaming");
                let e = s.error(&ApiError::internal(format!("The engine failed the request: {msg}")));
                open = sse.send_named(&e.0, &e.1).await.is_ok();
                break;
            }
            finished => match generation::finish_of(&finished) {
                Some(f) => {
                    tokens = f.completion_tokens;
                    s.finish(&f)
                }
                None => Vec::new(),
            },
        };
        for (kind, e) in out {
            open = open && sse.send_named(&kind, &e).await.is_ok();
        }
    }
    drop(events);
    (tokens, !open)
}

#[cfg(test)]
mod tests;
