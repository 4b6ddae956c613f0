//! Tool calling on chat: `tools`, `tool_choice` and `parallel_tool_calls` checked into a
//! [`ToolCalling`]; the tools reach the chat template as transformers passes them; the model's
//! calls are parsed from its text in the server's [`ToolParser`] syntax (`--tool-call-parser`:
//! hermes, llama3_json, mistral or qwen3_coder, as vLLM names them). `tool_choice: "required"`
//! or a named function is enforced with a grammar over that syntax, so the calls always parse
//! and their arguments match the tool's schema.

use super::tool_parsers::ToolParser;
use crate::http::errors::ApiError;
use serde::Serialize;
use serde_json::{json, Value};
use tessera_engine::structured::Constraint;
use tessera_engine::tokenizer::Tokenizer;

/// What `tool_choice` asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// No calls: the text is the answer.
    None,
    /// The model decides; calls in its text are parsed.
    Auto,
    /// At least one call (one, without `parallel_tool_calls`).
    Required,
    /// A call of this function.
    Named(String),
}

/// A request's tools and how they may be called.
#[derive(Clone, Debug)]
pub struct ToolCalling {
    /// `tools` as sent (what the chat template receives).
    tools: Value,
    /// Each tool's name and parameter schema.
    specs: Vec<(String, Value)>,
    /// `tool_choice`.
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true).
    parallel: bool,
    /// The syntax of the model's calls.
    parser: ToolParser,
}

/// One parsed call, as OpenAI's `tool_calls[i]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCall {
    /// `call_...`, unique in the response.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// A call's function and arguments.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionCall {
    /// The tool's name.
    pub name: String,
    /// The arguments as a JSON text.
    pub arguments: String,
}

/// A chunk's `delta.tool_calls[i]`, as OpenAI streams a call: its first chunk carries the id,
/// type and name (with the arguments written so far), the next ones more of its arguments.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallDelta {
    /// Position of the call in the message.
    pub index: usize,
    /// The call's id (first chunk only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function` (first chunk only).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The name (first chunk only) and a piece of the arguments.
    pub function: FunctionDelta,
}

/// A piece of a streamed call's function.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionDelta {
    /// The function's name (first chunk only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The next piece of the arguments' text.
    pub arguments: String,
}

impl ToolCallDelta {
    /// A call's first chunk.
    fn head(index: usize, id: String, name: String, arguments: String) -> Self {
        ToolCallDelta { index, id: Some(id), kind: Some("function"), function: FunctionDelta { name: Some(name), arguments } }
    }

    /// More of call `index`'s arguments.
    fn more(index: usize, arguments: String) -> Self {
        ToolCallDelta { index, id: None, kind: None, function: FunctionDelta { name: None, arguments } }
    }
}

/// What a stream has sent of its calls: each begun call's arguments so far.
#[derive(Clone, Debug, Default)]
pub struct CallsSent(Vec<String>);

fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl ToolCalling {
    /// The body's tool fields, or `None` without `tools` (then `tool_choice` may only be
    /// `none` or `auto`), calls written in `parser`'s syntax. Every malformed part is a 400
    /// naming it.
    pub fn from_request(body: &Value, parser: ToolParser) -> Result<Option<Self>, ApiError> {
        let choice_v = body.get("tool_choice").filter(|v| !v.is_null());
        let parallel = match body.get("parallel_tool_calls") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::invalid("parallel_tool_calls", "parallel_tool_calls must be a boolean")),
        };
        let tools = match body.get("tools") {
            None | Some(Value::Null) => {
                return match choice_v.map(|c| c.as_str()) {
                    None | Some(Some("none" | "auto")) => Ok(None),
                    _ => Err(ApiError::invalid("tool_choice", "tool_choice other than none or auto needs tools")),
                };
            }
            Some(Value::Array(t)) if !t.is_empty() => t,
            Some(_) => return Err(ApiError::invalid("tools", "tools must be a non-empty list of functions")),
        };
        let mut specs: Vec<(String, Value)> = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let param = format!("tools[{i}]");
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::invalid(format!("{param}.type"), "only tools of type function are supported"));
            }
            let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| ApiError::invalid(format!("{param}.function"), "a tool needs a function object"))?;
            let name = f.get("name").and_then(Value::as_str).filter(|n| valid_name(n)).ok_or_else(|| {
                ApiError::invalid(format!("{param}.function.name"), "a function name is 1-64 letters, digits, underscores or dashes")
            })?;
            if specs.iter().any(|(n, _)| n == name) {
                return Err(ApiError::invalid(format!("{param}.function.name"), format!("two tools are named {name:?}")));
            }
            let params = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object"}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => return Err(ApiError::invalid(format!("{param}.function.parameters"), "parameters must be a JSON schema (an object)")),
            };
            specs.push((name.to_owned(), params));
        }
        let choice = match choice_v {
            None => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => return Err(ApiError::invalid("tool_choice", format!("tool_choice {other:?} is not none, auto, required or a function"))),
            },
            Some(c) => {
                let name = c
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|_| c.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| ApiError::invalid("tool_choice", "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}"))?;
                if !specs.iter().any(|(n, _)| n == name) {
                    return Err(ApiError::invalid("tool_choice.function.name", format!("no tool is named {name:?}")));
                }
                ToolChoice::Named(name.to_owned())
            }
        };
        Ok(Some(ToolCalling { tools: Value::Array(tools.clone()), specs, choice, parallel, parser }))
    }

    /// The tools for the chat template.
    pub fn template_tools(&self) -> &Value {
        &self.tools
    }

    /// Whether the answer's text is searched for calls.
    pub fn parses(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The grammar that enforces `required` or a named function: one call (several with
    /// `parallel_tool_calls` and `required`) in the parser's syntax, each naming a tool and
    /// with arguments that match that tool's parameter schema; markers that are special tokens
    /// of `tok` are forced as those tokens.
    pub fn constraint(&self, tok: &Tokenizer) -> Option<Constraint> {
        let (specs, many): (Vec<&(String, Value)>, bool) = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => (self.specs.iter().collect(), self.parallel),
            ToolChoice::Named(n) => (self.specs.iter().filter(|(s, _)| s == n).collect(), false),
        };
        Some(Constraint::Lark(self.parser.grammar(&specs, many, |m| tok.special_token_id(m))))
    }

    /// The calls in `text` and the text before the first one (`None` when empty). Calls that
    /// do not parse, that name no tool of the request or that text follows leave the whole
    /// text as content, as vLLM does. Ids are `{id}-{i}`.
    pub fn parse(&self, text: &str, id: &str) -> (Option<String>, Vec<ToolCall>) {
        let found = self.parser.calls(text, &self.specs).filter(|(_, calls)| calls.iter().all(|(n, _)| self.specs.iter().any(|(s, _)| s == n)));
        let Some((start, found)) = found else { return (Some(text.to_owned()).filter(|t| !t.is_empty()), Vec::new()) };
        let calls = found
            .into_iter()
            .enumerate()
            .map(|(i, (name, arguments))| ToolCall { id: format!("{id}-{i}"), kind: "function", function: FunctionCall { name, arguments } })
            .collect();
        let content = text[..start].trim_end();
        (Some(content.to_owned()).filter(|c| !c.is_empty()), calls)
    }

    /// What a stream sends for `text` (all generated so far): the content that can go out now
    /// (`sent` bytes had gone out; advanced) and the calls' chunks ([`ToolCalling::stream_calls`]).
    /// A call is always held back from content, so while all text has gone out there is none
    /// to look for (the calls are not parsed again on every token of a plain answer).
    pub fn stream(&self, text: &str, sent: &mut usize, calls: &mut CallsSent, id: &str) -> (String, Vec<ToolCallDelta>) {
        let upto = self.streamable(text, *sent);
        let piece = text[*sent..upto].to_owned();
        *sent = upto;
        let deltas = if upto < text.len() { self.stream_calls(text, calls, id) } else { Vec::new() };
        (piece, deltas)
    }

    /// The calls `text` (all generated so far) shows beyond what `sent` holds: a new call's
    /// first chunk (ids `{id}-{i}`, as [`ToolCalling::parse`] gives them), more arguments of
    /// one already begun. Only calls of the request's tools, in order, are streamed.
    pub fn stream_calls(&self, text: &str, sent: &mut CallsSent, id: &str) -> Vec<ToolCallDelta> {
        let known = |n: &str| self.specs.iter().any(|(s, _)| s == n);
        let mut out = Vec::new();
        for (i, call) in self.parser.partial_calls(text, &self.specs).into_iter().enumerate().take_while(|(_, c)| known(&c.name)) {
            match sent.0.get_mut(i) {
                None => {
                    sent.0.push(call.arguments.clone());
                    out.push(ToolCallDelta::head(i, format!("{id}-{i}"), call.name, call.arguments));
                }
                Some(so_far) => {
                    if let Some(more) = call.arguments.strip_prefix(so_far.as_str()).filter(|m| !m.is_empty()) {
                        out.push(ToolCallDelta::more(i, more.to_owned()));
                        *so_far = call.arguments.clone();
                    }
                }
            }
        }
        out
    }

    /// The last chunks of a stream whose text parsed into `calls`: the rest of each call begun
    /// (the whole of each call not yet begun).
    pub fn finish_calls(calls: Vec<ToolCall>, sent: &CallsSent) -> Vec<ToolCallDelta> {
        let mut out = Vec::new();
        for (i, call) in calls.into_iter().enumerate() {
            match sent.0.get(i) {
                None => out.push(ToolCallDelta::head(i, call.id, call.function.name, call.function.arguments)),
                Some(so_far) => match call.function.arguments.strip_prefix(so_far.as_str()) {
                    Some("") => {}
                    Some(rest) => out.push(ToolCallDelta::more(i, rest.to_owned())),
                    None => tracing::warn!(call = i, "a streamed call's arguments differ from the finished call's; the stream keeps what it sent"),
                },
            }
        }
        out
    }

    /// How much of `text` can be streamed as content now, `sent` bytes having gone out: the
    /// text before the calls, less a tail that could begin them and the whitespace before it
    /// (content before calls is sent trimmed, so what streams is what a whole answer holds).
    pub fn streamable(&self, text: &str, sent: usize) -> usize {
        let upto = self.parser.streamable(text, sent);
        sent + text[sent..upto].trim_end().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_engine::fuzzing::default_tokenizer;

    fn weather() -> Value {
        json!({
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
                {"type": "function", "function": {"name": "get_time"}},
            ],
        })
    }

    fn hermes(body: &Value) -> Result<Option<ToolCalling>, ApiError> {
        ToolCalling::from_request(body, ToolParser::Hermes)
    }

    fn with(mut body: Value, k: &str, v: Value) -> Value {
        body[k] = v;
        body
    }

    #[test]
    fn tool_fields_are_checked_and_name_themselves() {
        assert!(hermes(&json!({})).unwrap().is_none());
        assert!(hermes(&json!({"tool_choice": "none"})).unwrap().is_none());
        let t = hermes(&weather()).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        let named = with(weather(), "tool_choice", json!({"type": "function", "function": {"name": "get_time"}}));
        assert_eq!(hermes(&named).unwrap().unwrap().choice, ToolChoice::Named("get_time".into()));
        let cases = [
            (json!({"tool_choice": "required"}), "tool_choice"),
            (with(weather(), "tool_choice", json!("sometimes")), "tool_choice"),
            (with(weather(), "tool_choice", json!({"type": "function", "function": {"name": "nope"}})), "tool_choice.function.name"),
            (with(weather(), "tools", json!([])), "tools"),
            (with(weather(), "tools", json!([{"type": "retrieval"}])), "tools[0].type"),
            (with(weather(), "tools", json!([{"type": "function", "function": {"name": "a b"}}])), "tools[0].function.name"),
            (with(weather(), "tools", json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}])), "tools[1].function.name"),
            (with(weather(), "tools", json!([{"type": "function", "function": {"name": "a", "parameters": 3}}])), "tools[0].function.parameters"),
            (with(weather(), "parallel_tool_calls", json!("yes")), "parallel_tool_calls"),
        ];
        for (body, param) in cases {
            let e = hermes(&body).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}: {}", e.message);
        }
    }

    #[test]
    fn hermes_calls_parse_and_anything_else_stays_content() {
        let t = hermes(&weather()).unwrap().unwrap();
        let (content, calls) = t.parse("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>", "call_x");
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!((calls[0].id.as_str(), calls[0].function.name.as_str(), calls[0].function.arguments.as_str()), ("call_x-0", "get_weather", "{\"city\":\"Paris\"}"));
        assert_eq!(calls[1].function.arguments, "{}");
        for text in [
            "no calls here",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}",        // never closed
            "<tool_call>{not json}</tool_call>",                                 // bad JSON
            "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",   // unknown tool
            "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call> and then text",
        ] {
            assert_eq!(t.parse(text, "c"), (Some(text.to_owned()), vec![]), "{text}");
        }
        assert_eq!(t.parse("", "c"), (None, vec![]));
    }

    #[test]
    fn streaming_holds_back_a_possible_tag() {
        assert_eq!(ToolParser::Hermes.streamable("Hello", 0), 5);
        assert_eq!(ToolParser::Hermes.streamable("Hello <tool", 0), 6);
        assert_eq!(ToolParser::Hermes.streamable("Hello <", 0), 6);
        assert_eq!(ToolParser::Hermes.streamable("a <tool_call>{", 0), 2);
        assert_eq!(ToolParser::Hermes.streamable("<b>", 0), 3);
        assert_eq!(ToolParser::Hermes.streamable("é<", 0), "é".len());
    }

    #[test]
    fn required_and_named_choices_have_a_grammar_auto_and_none_do_not() {
        let t = hermes(&weather()).unwrap().unwrap();
        assert_eq!(t.constraint(default_tokenizer()), None);
        let none = hermes(&with(weather(), "tool_choice", json!("none"))).unwrap().unwrap();
        assert!(!none.parses() && none.constraint(default_tokenizer()).is_none());
        let Some(Constraint::Lark(g)) = hermes(&with(weather(), "tool_choice", json!("required"))).unwrap().unwrap().constraint(default_tokenizer()) else { panic!() };
        assert!(g.starts_with("start: call (\"\\n\" call)*") && g.contains("get_weather") && g.contains("get_time"), "{g}");
        let one = with(with(weather(), "tool_choice", json!("required")), "parallel_tool_calls", json!(false));
        let Some(Constraint::Lark(g)) = hermes(&one).unwrap().unwrap().constraint(default_tokenizer()) else { panic!() };
        assert!(g.starts_with("start: call\n"), "{g}");
        let named = with(weather(), "tool_choice", json!({"type": "function", "function": {"name": "get_time"}}));
        let Some(Constraint::Lark(g)) = hermes(&named).unwrap().unwrap().constraint(default_tokenizer()) else { panic!() };
        assert!(g.contains("get_time") && !g.contains("get_weather"), "{g}");
    }
}
