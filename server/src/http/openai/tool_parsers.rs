//! The syntaxes models write tool calls in, named as vLLM's `--tool-call-parser`s. Each
//! [`ToolParser`] knows three things about its syntax: which text may begin a call (held back
//! while streaming), how a finished output splits into content and calls, and a Lark grammar
//! (llguidance's dialect) that makes the model write calls in it, with arguments matching each
//! tool's JSON schema.

use serde::{Serialize, Serializer};
use serde_json::{json, Value};
use std::fmt;
use std::str::FromStr;
use tessera_engine::structured::compact_schema;


/// Hermes and Qwen3-Coder open a call with this tag.
const TOOL_CALL: &str = "<tool_call>";
/// And close it with this one.
const TOOL_CALL_END: &str = "</tool_call>";
/// Llama 3's tool-call token.
const PYTHON_TAG: &str = "<|python_tag|>";
/// Mistral's tool-call token.
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
/// Mistral's (tokenizer v11 and later) token between a call's name and its arguments.
const MISTRAL_ARGS: &str = "[ARGS]";
/// Mistral's (v13) token before a call id it writes itself, between the name and `[ARGS]`.
const MISTRAL_CALL_ID: &str = "[CALL_ID]";

/// A tool-call syntax (`--tool-call-parser`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolParser {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Hermes, Qwen 2.5 / 3).
    Hermes,
    /// `{"name": ..., "parameters": {...}}` (or `"arguments"`), several separated by `;`,
    /// possibly after `<|python_tag|>` (Llama 3.1 / 3.2).
    Llama3Json,
    /// `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": ...}` (Mistral up to
    /// tokenizer v7: Mistral 7B v0.3, Mixtral 8x22B).
    Mistral,
    /// `[TOOL_CALLS]NAME[ARGS]{...}`, once per call (Mistral tokenizer v11 and later: Mistral
    /// Small 3.2, Magistral, Devstral). Also named `mistral`: chosen when the chat template
    /// writes `[ARGS]`.
    MistralArgs,
    /// `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`
    /// (Qwen3-Coder); values are text unless the parameter's schema types them otherwise.
    Qwen3Coder,
}

impl ToolParser {
    /// Every parser name (`--tool-call-parser`).
    pub const ALL: [ToolParser; 4] = [ToolParser::Hermes, ToolParser::Llama3Json, ToolParser::Mistral, ToolParser::Qwen3Coder];
    /// Every syntax (Mistral's has two forms under one name).
    pub const SYNTAXES: [ToolParser; 5] =
        [ToolParser::Hermes, ToolParser::Llama3Json, ToolParser::Mistral, ToolParser::MistralArgs, ToolParser::Qwen3Coder];

    /// vLLM's name for it.
    pub fn name(self) -> &'static str {
        match self {
            ToolParser::Hermes => "hermes",
            ToolParser::Llama3Json => "llama3_json",
            ToolParser::Mistral | ToolParser::MistralArgs => "mistral",
            ToolParser::Qwen3Coder => "qwen3_coder",
        }
    }

    /// The syntax a chat template teaches its model (hermes when it shows none of them).
    pub fn for_template(source: &str) -> ToolParser {
        let has = |s: &str| source.contains(s);
        if has(TOOL_CALL) && has("<function=") {
            ToolParser::Qwen3Coder
        } else if has(TOOL_CALL) {
            ToolParser::Hermes
        } else if has(PYTHON_TAG) || (has("\"parameters\"") && has("ipython")) {
            ToolParser::Llama3Json
        } else if has(MISTRAL_CALLS) {
            ToolParser::Mistral.form_for(source)
        } else {
            ToolParser::Hermes
        }
    }

    /// The parser named on the command line (`None`: the template's), in the form the chat
    /// template shows (Mistral's with `[ARGS]` when it writes that token).
    pub fn resolve(named: Option<ToolParser>, template: &str) -> ToolParser {
        named.map_or_else(|| ToolParser::for_template(template), |p| p.form_for(template))
    }

    fn form_for(self, template: &str) -> ToolParser {
        match self {
            ToolParser::Mistral | ToolParser::MistralArgs if template.contains(MISTRAL_ARGS) => ToolParser::MistralArgs,
            ToolParser::MistralArgs => ToolParser::Mistral,
            p => p,
        }
    }

    /// The text whose appearance starts the calls.
    fn marker(self) -> &'static str {
        match self {
            ToolParser::Hermes | ToolParser::Qwen3Coder => TOOL_CALL,
            ToolParser::Llama3Json => PYTHON_TAG,
            ToolParser::Mistral | ToolParser::MistralArgs => MISTRAL_CALLS,
        }
    }

    /// How far `text` (of which `sent` bytes already went out as content) can be streamed as
    /// content now: up to the marker that starts the calls, and, while none has appeared, all
    /// but a tail that could begin one. Llama 3 may also answer with a bare JSON call: while
    /// the text is blank or starts with `{`, all of it is held back.
    pub(crate) fn streamable(self, text: &str, sent: usize) -> usize {
        if self == ToolParser::Llama3Json {
            let lead = text.trim_start();
            if lead.is_empty() || lead.starts_with('{') {
                return sent;
            }
        }
        let rest = &text[sent..];
        let marker = self.marker();
        if let Some(p) = rest.find(marker) {
            return sent + p;
        }
        let held = (1..marker.len().min(rest.len() + 1))
            .rev()
            .find(|&k| rest.is_char_boundary(rest.len() - k) && marker.starts_with(&rest[rest.len() - k..]));
        sent + rest.len() - held.unwrap_or(0)
    }

    /// The calls in a finished output, as (where they start, each call's name and arguments),
    /// or `None` when the text holds no calls in this syntax (then it is all content). The
    /// calls must run to the end of the text. `specs` (each tool's name and parameter schema)
    /// type Qwen3-Coder's parameter values.
    pub(crate) fn calls(self, text: &str, specs: &[(String, Value)]) -> Option<(usize, Vec<(String, String)>)> {
        match self {
            ToolParser::Hermes => tagged(text, |body| {
                let (call, end) = json_object_call(body, &["arguments"])?;
                body[end..].trim().is_empty().then_some(call)
            }),
            ToolParser::Qwen3Coder => tagged(text, |body| xml_call(body, specs)),
            // Either of Mistral's forms, whichever the model wrote.
            ToolParser::Mistral | ToolParser::MistralArgs => {
                let start = text.find(MISTRAL_CALLS)?;
                let after = &text[start + MISTRAL_CALLS.len()..];
                if let Some(mut rest) = after.trim_start().strip_prefix('[') {
                    let mut calls = Vec::new();
                    loop {
                        let (call, end) = json_object_call(rest, &["arguments"])?;
                        calls.push(call);
                        rest = rest[end..].trim_start();
                        match rest.strip_prefix(',') {
                            Some(r) => rest = r,
                            None => break,
                        }
                    }
                    return rest.strip_prefix(']')?.trim().is_empty().then_some((start, calls));
                }
                let mut calls = Vec::new();
                let mut rest = &text[start..];
                while let Some(call) = rest.strip_prefix(MISTRAL_CALLS) {
                    let (head, args) = call.split_once(MISTRAL_ARGS)?;
                    let name = head.split_once(MISTRAL_CALL_ID).map_or(head, |(n, _)| n).trim();
                    let value = partial::scan_value(args);
                    serde_json::from_str::<Value>(&args[..value.end]).ok().filter(|_| value.complete && value.valid)?;
                    calls.push((name.to_owned(), value.compact));
                    rest = args[value.end..].trim_start();
                }
                rest.is_empty().then_some((start, calls))
            }
            ToolParser::Llama3Json => {
                // An answer that opens with a named call object is read from its start (as it
                // streamed); otherwise the calls follow `<|python_tag|>`.
                let (start, mut rest) = if starts_with_named_call(text) {
                    (0, text)
                } else {
                    let p = text.find(PYTHON_TAG)?;
                    (p, &text[p + PYTHON_TAG.len()..])
                };
                let mut calls = Vec::new();
                loop {
                    let (call, end) = json_object_call(rest, &["parameters", "arguments"])?;
                    calls.push(call);
                    rest = rest[end..].trim_start();
                    match rest.strip_prefix(';') {
                        Some(r) => rest = r,
                        None => break,
                    }
                }
                rest.is_empty().then_some((start, calls))
            }
        }
    }

    /// A Lark grammar whose sentences are calls of `specs` in this syntax: one, or with `many`
    /// one or more, each naming a tool and with arguments valid against its schema. A marker
    /// that is a special token of the vocabulary (`special(text)` gives its id) is written as
    /// that token, as the model was trained to write it, not spelled out in text.
    pub(crate) fn grammar(self, specs: &[&(String, Value)], many: bool, special: impl Fn(&str) -> Option<u32>) -> String {
        let mark = |s: &str| special(s).map_or_else(|| lit(s), |id| format!("<[{id}]>"));
        let (before, sep, after) = match self {
            ToolParser::Hermes | ToolParser::Qwen3Coder => (String::new(), "\n", ""),
            ToolParser::Llama3Json => (String::new(), "; ", ""),
            ToolParser::Mistral => (format!("{} \"[\" ", mark(MISTRAL_CALLS)), ", ", "]"),
            ToolParser::MistralArgs => (String::new(), "", ""),
        };
        let more = match (many, sep) {
            (false, _) => String::new(),
            (true, "") => " call*".to_owned(),
            (true, sep) => format!(" ({} call)*", lit(sep)),
        };
        let start = format!("start: {before}call{more}{}", if after.is_empty() { String::new() } else { format!(" {}", lit(after)) });
        let (open, close) = (mark(TOOL_CALL), mark(TOOL_CALL_END));
        let rules = match self {
            ToolParser::Hermes => format!("call: {open} \"\\n\" body \"\\n\" {close}\nbody: %json {}", json_calls(specs, "arguments")),
            ToolParser::Llama3Json => format!("call: %json {}", json_calls(specs, "parameters")),
            ToolParser::Mistral => format!("call: %json {}", json_calls(specs, "arguments")),
            ToolParser::MistralArgs => mistral_args_rules(specs, &mark),
            ToolParser::Qwen3Coder => xml_rules(specs, &open, &close),
        };
        format!("{start}\n{rules}\n")
    }
}

impl fmt::Display for ToolParser {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ToolParser {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        ToolParser::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| {
            let names: Vec<&str> = ToolParser::ALL.iter().map(|p| p.name()).collect();
            format!("unknown tool-call parser {s:?} (valid: {})", names.join(", "))
        })
    }
}

impl Serialize for ToolParser {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// `s` as a Lark string literal.
fn lit(s: &str) -> String {
    Value::from(s).to_string()
}

/// Whether `text` opens (after whitespace) with a call object whose name is written.
fn starts_with_named_call(text: &str) -> bool {
    text.trim_start().starts_with('{') && partial::scan_call(text, &["parameters", "arguments"]).name.is_some()
}

/// A call written as a JSON object at the start of `text` (after whitespace): its `name` and
/// its arguments (under the first of `arg_keys` it has) as [`partial::call_arguments`] reports
/// them, and the bytes up to the object's end. The object must be valid JSON.
fn json_object_call(text: &str, arg_keys: &[&str]) -> Option<((String, String), usize)> {
    let scan = partial::scan_call(text, arg_keys);
    let end = scan.end.filter(|_| scan.valid)?;
    serde_json::from_str::<Value>(&text[..end]).ok()?;
    let args = partial::call_arguments(&text[..end], arg_keys)?;
    Some(((scan.name?, args), end))
}

/// Calls each inside `<tool_call>...</tool_call>`, separated by whitespace, the body of each
/// read by `call`.
fn tagged(text: &str, mut call: impl FnMut(&str) -> Option<(String, String)>) -> Option<(usize, Vec<(String, String)>)> {
    let first = text.find(TOOL_CALL)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(after) = rest.strip_prefix(TOOL_CALL) {
        let end = after.find(TOOL_CALL_END)?;
        calls.push(call(&after[..end])?);
        rest = after[end + TOOL_CALL_END.len()..].trim_start();
    }
    rest.is_empty().then_some((first, calls))
}

/// A Qwen3-Coder call body: `<function=NAME>` and its `<parameter=KEY>\nVALUE\n</parameter>`s,
/// as the name and the arguments' JSON text.
fn xml_call(body: &str, specs: &[(String, Value)]) -> Option<(String, String)> {
    let (name, rest) = body.trim_start().strip_prefix("<function=")?.split_once('>')?;
    let (args, after, closed) = xml_arguments(rest, name, specs);
    (closed && after.trim().is_empty()).then(|| (name.to_owned(), args))
}

/// The parameters at the start of `body` (of a call of `name`) as the arguments' JSON text so
/// far, `{"key":value` for the first complete one and `,"key":value` for each next (the value
/// typed by the tool's schema), closed by `}` at `</function>`; the text after what was read;
/// whether `</function>` was reached.
fn xml_arguments<'a>(mut body: &'a str, name: &str, specs: &[(String, Value)]) -> (String, &'a str, bool) {
    let properties = specs.iter().find(|(n, _)| n == name).and_then(|(_, s)| s.get("properties"));
    let mut args = String::new();
    loop {
        body = body.trim_start();
        if let Some(after) = body.strip_prefix("</function>") {
            if args.is_empty() {
                args.push('{');
            }
            args.push('}');
            return (args, after, true);
        }
        let Some((key, after)) = body.strip_prefix("<parameter=").and_then(|b| b.split_once('>')) else { return (args, body, false) };
        let Some(end) = after.find("</parameter>") else { return (args, body, false) };
        let raw = after[..end].strip_prefix('\n').unwrap_or(&after[..end]);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let schema = properties.and_then(|p| p.get(key));
        let value = if is_text(schema) { Value::from(raw) } else { serde_json::from_str(raw).unwrap_or_else(|_| Value::from(raw)) };
        args.push(if args.is_empty() { '{' } else { ',' });
        args.push_str(&Value::from(key).to_string());
        args.push(':');
        args.push_str(&value.to_string());
        body = &after[end + "</parameter>".len()..];
    }
}

/// Whether a Qwen3-Coder parameter with this schema is written as bare text (a string, or an
/// untyped value whose allowed values are all strings); others are written as JSON.
fn is_text(schema: Option<&Value>) -> bool {
    let Some(s) = schema else { return true };
    match s.get("type") {
        Some(t) => t == "string",
        None => match (s.get("enum").and_then(Value::as_array), s.get("const")) {
            (Some(e), _) => e.iter().all(Value::is_string),
            (None, Some(c)) => c.is_string(),
            (None, None) => true,
        },
    }
}

/// The JSON schema of one call object: a tool's `name` and its arguments under `arg_key`.
fn json_calls(specs: &[&(String, Value)], arg_key: &str) -> Value {
    let calls: Vec<Value> = specs
        .iter()
        .map(|(name, params)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, arg_key: params},
                "required": ["name", arg_key],
                "additionalProperties": false,
            })
        })
        .collect();
    compact_schema(json!({"anyOf": calls}))
}

/// Mistral v11's call rules: `[TOOL_CALLS]NAME[ARGS]` and arguments valid against that tool's
/// schema, one rule per tool.
fn mistral_args_rules(specs: &[&(String, Value)], mark: &dyn Fn(&str) -> String) -> String {
    let funcs: Vec<String> = (0..specs.len()).map(|i| format!("f{i}")).collect();
    let mut rules = vec![format!("call: {}", funcs.join(" | "))];
    let (calls, args) = (mark(MISTRAL_CALLS), mark(MISTRAL_ARGS));
    for (i, (name, params)) in specs.iter().enumerate() {
        rules.push(format!("f{i}: {calls} {} {args} %json {}", lit(name), compact_schema(params.clone())));
    }
    rules.join("\n")
}

/// Qwen3-Coder's call rules: one function rule per tool, with its required parameters in
/// order and the others optional. A text value follows its `enum` or `const`, its
/// `minLength`/`maxLength` and its `pattern`, on one line without `<`; a typed value is JSON
/// valid against its schema.
fn xml_rules(specs: &[&(String, Value)], open: &str, close: &str) -> String {
    let mut rules = Vec::new();
    let funcs: Vec<String> = (0..specs.len()).map(|i| format!("f{i}")).collect();
    rules.push(format!("call: {open} \"\\n\" ({}) {close}", funcs.join(" | ")));
    for (i, (name, params)) in specs.iter().enumerate() {
        let required: Vec<&str> = params.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
        let mut items = Vec::new();
        for (j, (key, schema)) in params.get("properties").and_then(Value::as_object).into_iter().flatten().enumerate() {
            // Text values are lexemes (upper-case names: the pattern's `&` needs one), typed
            // values rules.
            let p = format!("p{i}_{j}");
            let v = if is_text(Some(schema)) { format!("V{i}_{j}") } else { format!("v{i}_{j}") };
            items.push(if required.contains(&key.as_str()) { p.clone() } else { format!("{p}?") });
            rules.push(format!("{p}: {} {v} \"\\n</parameter>\\n\"", lit(&format!("<parameter={key}>\n"))));
            rules.push(format!("{v}: {}", xml_value(schema)));
        }
        rules.push(format!("f{i}: {} {} \"</function>\\n\"", lit(&format!("<function={name}>\n")), items.join(" ")));
    }
    rules.join("\n")
}

/// The rule body of one Qwen3-Coder parameter value.
fn xml_value(schema: &Value) -> String {
    if !is_text(Some(schema)) {
        return format!("%json {}", compact_schema(schema.clone()));
    }
    let choices = schema.get("enum").and_then(Value::as_array).cloned().or_else(|| schema.get("const").map(|c| vec![c.clone()]));
    if let Some(c) = choices {
        return c.iter().filter_map(Value::as_str).map(lit).collect::<Vec<_>>().join(" | ");
    }
    let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
    let max = schema.get("maxLength").and_then(Value::as_u64).map_or(String::new(), |m| m.to_string());
    let line = format!("/[^<\\n]{{{min},{max}}}/");
    match schema.get("pattern").and_then(Value::as_str) {
        // Both: a line that the pattern also matches (llguidance intersects the two lexemes).
        Some(pattern) => format!("{line} & /{}/", searched(pattern).replace('/', "\\/")),
        None => line,
    }
}

/// A JSON-schema `pattern` (which matches anywhere in the string unless anchored) as a regular
/// expression the whole value must match (a pattern the grammar compiler cannot take, say with
/// anchors inside an alternation, makes the request a 400).
fn searched(pattern: &str) -> String {
    // With an alternation the anchors may belong to one branch: left as they are.
    if pattern.contains('|') {
        return format!(".*(?:{pattern}).*");
    }
    let start = pattern.strip_prefix('^');
    let inner = start.unwrap_or(pattern);
    let end = inner.strip_suffix('$').filter(|i| !i.ends_with('\\'));
    let inner = end.unwrap_or(inner);
    format!("{}(?:{inner}){}", if start.is_some() { "" } else { ".*" }, if end.is_some() { "" } else { ".*" })
}

mod partial;

#[cfg(test)]
mod tests;
