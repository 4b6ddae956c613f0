//! Tool calling on chat: `tools`, `tool_choice` and `parallel_tool_calls` checked into a
//! [`ToolCalling`]; the tools reach the chat template as transformers passes them; the model's
//! calls are parsed from its text in the hermes syntax (Hermes, Qwen 2.5 / 3:
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`), vLLM's default parser for
//! those families. `tool_choice: "required"` or a named function is enforced with a grammar
//! over that syntax, so the calls always parse and their arguments match the tool's schema.

use crate::http::errors::ApiError;
use serde::Serialize;
use serde_json::{json, Value};
use tessera_engine::structured::{compact_schema, Constraint};

/// The opening tag of a hermes tool call.
const OPEN: &str = "<tool_call>";
/// Its closing tag.
const CLOSE: &str = "</tool_call>";

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

/// A chunk's `delta.tool_calls[i]` (the whole call in one chunk, as vLLM sends a call it has
/// parsed completely).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallDelta {
    /// Position of the call in the message.
    pub index: usize,
    /// The call.
    #[serde(flatten)]
    pub call: ToolCall,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl ToolCalling {
    /// The body's tool fields, or `None` without `tools` (then `tool_choice` may only be
    /// `none` or `auto`). Every malformed part is a 400 naming it.
    pub fn from_request(body: &Value) -> Result<Option<Self>, ApiError> {
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
        Ok(Some(ToolCalling { tools: Value::Array(tools.clone()), specs, choice, parallel }))
    }

    /// The tools for the chat template.
    pub fn template_tools(&self) -> &Value {
        &self.tools
    }

    /// Whether the answer's text is searched for calls.
    pub fn parses(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The grammar that enforces `required` or a named function: one call (several, one per
    /// line, with `parallel_tool_calls` and `required`), each a JSON object whose `name` is a
    /// tool's and whose `arguments` match that tool's parameter schema.
    pub fn constraint(&self) -> Option<Constraint> {
        let (specs, many): (Vec<&(String, Value)>, bool) = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => (self.specs.iter().collect(), self.parallel),
            ToolChoice::Named(n) => (self.specs.iter().filter(|(s, _)| s == n).collect(), false),
        };
        let calls: Vec<Value> = specs
            .iter()
            .map(|(name, params)| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = compact_schema(json!({"anyOf": calls}));
        let start = if many { "start: call (\"\\n\" call)*" } else { "start: call" };
        Some(Constraint::Lark(format!("{start}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {schema}\n")))
    }

    /// The calls in `text` (hermes syntax) and the text before the first one (`None` when
    /// empty). A call whose JSON does not parse, or that names no tool of the request, leaves
    /// the whole text as content, as vLLM does. Ids are `{id}-{i}`.
    pub fn parse(&self, text: &str, id: &str) -> (Option<String>, Vec<ToolCall>) {
        let whole = || (Some(text.to_owned()).filter(|t| !t.is_empty()), Vec::new());
        let Some(first) = text.find(OPEN) else { return whole() };
        let mut calls = Vec::new();
        let mut rest = &text[first..];
        while let Some(after) = rest.strip_prefix(OPEN) {
            let Some(end) = after.find(CLOSE) else { return whole() };
            let Ok(v) = serde_json::from_str::<Value>(after[..end].trim()) else { return whole() };
            let (Some(name), Some(args)) = (v.get("name").and_then(Value::as_str), v.get("arguments")) else { return whole() };
            if !self.specs.iter().any(|(n, _)| n == name) {
                return whole();
            }
            // Arguments sent as a JSON text stay as they are; an object is written out.
            let arguments = match args {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            calls.push(ToolCall { id: format!("{id}-{}", calls.len()), kind: "function", function: FunctionCall { name: name.to_owned(), arguments } });
            rest = after[end + CLOSE.len()..].trim_start();
        }
        if !rest.is_empty() {
            return whole();
        }
        let content = text[..first].trim_end();
        (Some(content.to_owned()).filter(|c| !c.is_empty()), calls)
    }
}

/// How much of `text` can be streamed as content now: everything before a call's opening tag,
/// and, while no tag has started, all but a tail that could begin one.
pub fn streamable_prefix(text: &str) -> usize {
    if let Some(p) = text.find(OPEN) {
        return p;
    }
    (1..OPEN.len().min(text.len() + 1))
        .rev()
        .find(|&k| text.is_char_boundary(text.len() - k) && OPEN.starts_with(&text[text.len() - k..]))
        .map_or(text.len(), |k| text.len() - k)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
                {"type": "function", "function": {"name": "get_time"}},
            ],
        })
    }

    fn with(mut body: Value, k: &str, v: Value) -> Value {
        body[k] = v;
        body
    }

    #[test]
    fn tool_fields_are_checked_and_name_themselves() {
        assert!(ToolCalling::from_request(&json!({})).unwrap().is_none());
        assert!(ToolCalling::from_request(&json!({"tool_choice": "none"})).unwrap().is_none());
        let t = ToolCalling::from_request(&weather()).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        let named = with(weather(), "tool_choice", json!({"type": "function", "function": {"name": "get_time"}}));
        assert_eq!(ToolCalling::from_request(&named).unwrap().unwrap().choice, ToolChoice::Named("get_time".into()));
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
            let e = ToolCalling::from_request(&body).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}: {}", e.message);
        }
    }

    #[test]
    fn hermes_calls_parse_and_anything_else_stays_content() {
        let t = ToolCalling::from_request(&weather()).unwrap().unwrap();
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
        assert_eq!(streamable_prefix("Hello"), 5);
        assert_eq!(streamable_prefix("Hello <tool"), 6);
        assert_eq!(streamable_prefix("Hello <"), 6);
        assert_eq!(streamable_prefix("a <tool_call>{"), 2);
        assert_eq!(streamable_prefix("<b>"), 3);
        assert_eq!(streamable_prefix("é<"), "é".len());
    }

    #[test]
    fn required_and_named_choices_have_a_grammar_auto_and_none_do_not() {
        let t = ToolCalling::from_request(&weather()).unwrap().unwrap();
        assert_eq!(t.constraint(), None);
        let none = ToolCalling::from_request(&with(weather(), "tool_choice", json!("none"))).unwrap().unwrap();
        assert!(!none.parses() && none.constraint().is_none());
        let Some(Constraint::Lark(g)) = ToolCalling::from_request(&with(weather(), "tool_choice", json!("required"))).unwrap().unwrap().constraint() else { panic!() };
        assert!(g.starts_with("start: call (\"\\n\" call)*") && g.contains("get_weather") && g.contains("get_time"), "{g}");
        let one = with(with(weather(), "tool_choice", json!("required")), "parallel_tool_calls", json!(false));
        let Some(Constraint::Lark(g)) = ToolCalling::from_request(&one).unwrap().unwrap().constraint() else { panic!() };
        assert!(g.starts_with("start: call\n"), "{g}");
        let named = with(weather(), "tool_choice", json!({"type": "function", "function": {"name": "get_time"}}));
        let Some(Constraint::Lark(g)) = ToolCalling::from_request(&named).unwrap().unwrap().constraint() else { panic!() };
        assert!(g.contains("get_time") && !g.contains("get_weather"), "{g}");
    }
}
