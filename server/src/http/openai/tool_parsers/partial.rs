//! Calls as far as a growing text shows them, for streaming each call's arguments as they are
//! written. A call is shown once its name is complete; its arguments are the JSON text written
//! so far with the whitespace outside strings taken out. The finished call's `arguments` are
//! that same compaction of the whole value ([`compact_value`]), so what was streamed is always
//! a prefix of the final arguments and the rest can follow.

use super::{ToolParser, MISTRAL_ARGS, MISTRAL_CALLS, MISTRAL_CALL_ID, PYTHON_TAG, TOOL_CALL, TOOL_CALL_END};
use serde_json::Value;

/// A call begun in the text: its name and its arguments' text so far.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PartialCall {
    /// The function's name (complete).
    pub name: String,
    /// A prefix of the finished call's `arguments`.
    pub arguments: String,
}

/// One JSON value at the start of a text (after whitespace), as far as the text holds it.
#[derive(Debug, Default)]
pub(super) struct Scanned {
    /// The value's text without whitespace outside strings.
    pub compact: String,
    /// Bytes of the text up to the value's end (or to the text's end).
    pub end: usize,
    /// The value ended within the text.
    pub complete: bool,
    /// Nothing seen so far rules out JSON (brackets match, only JSON's characters outside strings).
    pub valid: bool,
}

/// Scans the JSON value at the start of `s`. A scalar at the top level is complete only once
/// something follows it.
pub(super) fn scan_value(s: &str) -> Scanned {
    let start = s.len() - s.trim_start().len();
    let mut out = Scanned { valid: true, ..Scanned::default() };
    let mut stack: Vec<char> = Vec::new();
    let (mut in_string, mut escaped) = (false, false);
    let done = |mut out: Scanned, end: usize| {
        out.end = end;
        out.complete = true;
        out
    };
    for (off, c) in s[start..].char_indices() {
        let pos = start + off;
        if in_string {
            out.compact.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
                if stack.is_empty() {
                    return done(out, pos + 1);
                }
            }
            continue;
        }
        match c {
            ' ' | '\n' | '\t' | '\r' | ',' | ':' | '}' | ']' if stack.is_empty() => {
                return if out.compact.is_empty() { Scanned { valid: false, end: pos, ..out } } else { done(out, pos) };
            }
            ' ' | '\n' | '\t' | '\r' => {}
            '"' => {
                if stack.is_empty() && !out.compact.is_empty() {
                    return Scanned { valid: false, end: pos, ..out };
                }
                in_string = true;
                out.compact.push(c);
            }
            '{' | '[' => {
                stack.push(c);
                out.compact.push(c);
            }
            '}' | ']' => {
                let open = if c == '}' { '{' } else { '[' };
                if stack.pop() != Some(open) {
                    return Scanned { valid: false, end: pos, ..out };
                }
                out.compact.push(c);
                if stack.is_empty() {
                    return done(out, pos + 1);
                }
            }
            ',' | ':' => out.compact.push(c),
            c if c.is_ascii_alphanumeric() || c == '+' || c == '-' || c == '.' => out.compact.push(c),
            _ => return Scanned { valid: false, end: pos, ..out },
        }
    }
    out.end = s.len();
    out
}

/// A call object `{"name": ..., ARG_KEY: ...}` at the start of a text, as far as written.
#[derive(Debug, Default)]
pub(super) struct CallScan {
    /// The name, once its string is complete.
    pub name: Option<String>,
    /// The first of the argument keys the object has: its value so far, and whether that
    /// value is a JSON string (arguments sent as a JSON text, reported decoded).
    pub args: Option<(Scanned, bool)>,
    /// Bytes up to the object's end, when it ended.
    pub end: Option<usize>,
    /// Nothing so far rules the object out.
    pub valid: bool,
}

/// Scans a call object at the start of `s`, its arguments under the first of `arg_keys` it has.
pub(super) fn scan_call(s: &str, arg_keys: &[&str]) -> CallScan {
    let mut out = CallScan { valid: true, ..CallScan::default() };
    let mut at = s.len() - s.trim_start().len();
    if !s[at..].starts_with('{') {
        out.valid = s[at..].is_empty();
        return out;
    }
    at += 1;
    loop {
        at += s[at..].len() - s[at..].trim_start().len();
        match s[at..].chars().next() {
            None => return out,
            Some('}') => {
                out.end = Some(at + 1);
                return out;
            }
            Some('"') => {}
            Some(_) => {
                out.valid = false;
                return out;
            }
        }
        let key = scan_value(&s[at..]);
        if !key.complete {
            out.valid &= key.valid;
            return out;
        }
        let key_name: String = serde_json::from_str(&key.compact).unwrap_or_default();
        at += key.end;
        at += s[at..].len() - s[at..].trim_start().len();
        match s[at..].chars().next() {
            None => return out,
            Some(':') => at += 1,
            Some(_) => {
                out.valid = false;
                return out;
            }
        }
        let value = scan_value(&s[at..]);
        let value_start = at + (s[at..].len() - s[at..].trim_start().len());
        if !value.valid {
            out.valid = false;
            return out;
        }
        if key_name == "name" && value.complete && out.name.is_none() {
            out.name = serde_json::from_str::<String>(&value.compact).ok();
        }
        let complete = value.complete;
        at += value.end;
        if out.args.is_none() && arg_keys.contains(&key_name.as_str()) {
            let is_string = s[value_start..].starts_with('"');
            out.args = Some((value, is_string));
        }
        if !complete {
            return out;
        }
        at += s[at..].len() - s[at..].trim_start().len();
        match s[at..].chars().next() {
            None => return out,
            Some(',') => at += 1,
            Some('}') => {
                out.end = Some(at + 1);
                return out;
            }
            Some(_) => {
                out.valid = false;
                return out;
            }
        }
    }
}

/// The arguments a finished call object reports: the compact JSON of its arguments, or the
/// text of a JSON string holding them (as written).
pub(super) fn call_arguments(object: &str, arg_keys: &[&str]) -> Option<String> {
    let scan = scan_call(object, arg_keys);
    let (args, is_string) = scan.args.filter(|(a, _)| a.complete && scan.valid)?;
    if is_string {
        serde_json::from_str::<String>(&args.compact).ok()
    } else {
        Some(args.compact)
    }
}

/// A call scan as a partial call (named, and arguments shown only when they are not a JSON
/// string, which is reported decoded once complete).
fn shown(scan: &CallScan) -> Option<PartialCall> {
    let name = scan.name.clone()?;
    let arguments = match &scan.args {
        Some((a, false)) => a.compact.clone(),
        _ => String::new(),
    };
    Some(PartialCall { name, arguments })
}

/// Skips whitespace.
fn ws(s: &str) -> &str {
    s.trim_start()
}

/// Strips `prefix`; `Err(())` when `s` cannot start with it, `Ok(None)` while `s` is a proper
/// prefix of it (more text is needed).
fn expect<'a>(s: &'a str, prefix: &str) -> Result<Option<&'a str>, ()> {
    match s.strip_prefix(prefix) {
        Some(rest) => Ok(Some(rest)),
        None if prefix.starts_with(s) => Ok(None),
        None => Err(()),
    }
}

impl ToolParser {
    /// The calls begun in `text` as far as it shows them, in order: a call appears once its
    /// name is complete. Empty while no call has begun, or when the text stops looking like
    /// calls in this syntax (the finished text then decides).
    pub(crate) fn partial_calls(self, text: &str, specs: &[(String, Value)]) -> Vec<PartialCall> {
        if self == ToolParser::Qwen3Coder {
            return xml_calls(text, specs);
        }
        let mut calls = Vec::new();
        let _ = self.walk(text, &mut calls);
        calls
    }

    /// Collects the calls of `text`; `Err` where it stops looking like calls.
    fn walk(self, text: &str, calls: &mut Vec<PartialCall>) -> Result<(), ()> {
        match self {
            ToolParser::Hermes => {
                let Some(p) = text.find(TOOL_CALL) else { return Ok(()) };
                let mut rest = &text[p..];
                loop {
                    let Some(body) = expect(rest, TOOL_CALL)? else { return Ok(()) };
                    let scan = scan_call(body, &["arguments"]);
                    calls.extend(shown(&scan));
                    let Some(end) = scan.end.filter(|_| scan.valid) else { return if scan.valid { Ok(()) } else { Err(()) } };
                    let Some(after) = expect(ws(&body[end..]), TOOL_CALL_END)? else { return Ok(()) };
                    rest = ws(after);
                }
            }
            ToolParser::Llama3Json => {
                // As the finished text is read: from the start when it opens with a named call.
                let mut rest = if super::starts_with_named_call(text) {
                    text
                } else {
                    match text.find(PYTHON_TAG) {
                        Some(p) => &text[p + PYTHON_TAG.len()..],
                        None => return Ok(()),
                    }
                };
                loop {
                    let scan = scan_call(rest, &["parameters", "arguments"]);
                    calls.extend(shown(&scan));
                    let Some(end) = scan.end.filter(|_| scan.valid) else { return if scan.valid { Ok(()) } else { Err(()) } };
                    match ws(&rest[end..]).strip_prefix(';') {
                        Some(r) => rest = r,
                        None => return Ok(()),
                    }
                }
            }
            ToolParser::Mistral | ToolParser::MistralArgs => {
                let Some(p) = text.find(MISTRAL_CALLS) else { return Ok(()) };
                let after = ws(&text[p + MISTRAL_CALLS.len()..]);
                if let Some(mut rest) = after.strip_prefix('[') {
                    loop {
                        let scan = scan_call(rest, &["arguments"]);
                        calls.extend(shown(&scan));
                        let Some(end) = scan.end.filter(|_| scan.valid) else { return if scan.valid { Ok(()) } else { Err(()) } };
                        match ws(&rest[end..]).strip_prefix(',') {
                            Some(r) => rest = r,
                            None => return Ok(()),
                        }
                    }
                }
                let mut rest = &text[p..];
                loop {
                    let Some(call) = expect(rest, MISTRAL_CALLS)? else { return Ok(()) };
                    let Some((head, args)) = call.split_once(MISTRAL_ARGS) else { return Ok(()) };
                    let name = head.split_once(MISTRAL_CALL_ID).map_or(head, |(n, _)| n).trim();
                    let value = scan_value(args);
                    if !value.valid {
                        return Err(());
                    }
                    calls.push(PartialCall { name: name.to_owned(), arguments: value.compact.clone() });
                    if !value.complete {
                        return Ok(());
                    }
                    rest = ws(&args[value.end..]);
                }
            }
            ToolParser::Qwen3Coder => unreachable!("Qwen3-Coder's calls are XML"),
        }
    }
}

/// Qwen3-Coder's calls as far as written: a parameter shows once it is complete, written as
/// the finished call's arguments are ([`super::xml_arguments`]).
fn xml_calls(text: &str, specs: &[(String, Value)]) -> Vec<PartialCall> {
    let mut calls = Vec::new();
    let Some(p) = text.find(TOOL_CALL) else { return calls };
    let mut rest = &text[p..];
    while let Some(after) = rest.strip_prefix(TOOL_CALL) {
        let Some(inner) = ws(after).strip_prefix("<function=") else { break };
        let Some((name, body)) = inner.split_once('>') else { break };
        let (arguments, after, closed) = super::xml_arguments(body, name, specs);
        calls.push(PartialCall { name: name.to_owned(), arguments });
        let Some(next) = closed.then(|| ws(after).strip_prefix(TOOL_CALL_END)).flatten() else { break };
        rest = ws(next);
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_scan_compactly_and_know_their_end() {
        let v = scan_value(" { \"a\" : [1, 2 ,{\"b c\": \" x \\\" y\"}] } tail");
        assert!(v.complete && v.valid);
        assert_eq!(v.compact, "{\"a\":[1,2,{\"b c\":\" x \\\" y\"}]}");
        assert_eq!(&" { \"a\" : [1, 2 ,{\"b c\": \" x \\\" y\"}] } tail"[v.end..], " tail");
        let v = scan_value("{\"a\": [1, ");
        assert!(!v.complete && v.valid && v.compact == "{\"a\":[1,");
        assert!(!scan_value("{\"a\": 1]").valid);
        assert!(!scan_value("{\"a\": <x>}").valid);
        let n = scan_value("42");
        assert!(!n.complete && n.compact == "42");
        let n = scan_value("42}");
        assert!(n.complete && n.end == 2);
        // Strings as written, escapes and all.
        assert_eq!(scan_value("\"é \\u00e9\" rest").compact, "\"é \\u00e9\"");
    }

    #[test]
    fn call_objects_give_name_and_arguments_as_written() {
        let s = "{\"arguments\": {\"x\": [1, 2]}, \"name\": \"f\"} after";
        let c = scan_call(s, &["arguments"]);
        assert_eq!((c.name.as_deref(), c.args.as_ref().map(|(a, _)| a.compact.as_str()), c.valid), (Some("f"), Some("{\"x\":[1,2]}"), true));
        assert_eq!(&s[c.end.unwrap()..], " after");
        assert_eq!(call_arguments(s, &["arguments"]).as_deref(), Some("{\"x\":[1,2]}"));
        assert_eq!(call_arguments("{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}", &["arguments"]).as_deref(), Some("{\"x\": 1}"));
        let partial = scan_call("{\"name\": \"f\", \"arguments\": {\"x\": \"ab", &["arguments"]);
        assert_eq!((partial.name.as_deref(), partial.args.unwrap().0.compact, partial.end), (Some("f"), "{\"x\":\"ab".to_owned(), None));
        assert!(scan_call("{\"name\" \"f\"}", &["arguments"]).valid.then_some(()).is_none());
        assert!(scan_call("[1]", &["arguments"]).valid.then_some(()).is_none());
    }
}
