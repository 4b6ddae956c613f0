//! Tool calling over HTTP: `required` and a named function always give calls whose arguments
//! match the tool's schema, streamed or not (the same calls either way), a tool result comes
//! back as a `tool` turn and the model answers it, and malformed tool fields are 400s naming
//! the field. The default model's chat template does not show tools to the model; the grammar
//! makes the calls well-formed regardless. The same holds with `--tool-call-parser mistral`
//! and `qwen3_coder`, whose grammars force their own syntax.

use crate::harness::{shared, Server};
use serde_json::{json, Value};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                           "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"], "additionalProperties": false}}},
    ])
}

fn ask(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": tools(), "max_tokens": 80, "temperature": 0});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// Checks one call against the tools' schemas; returns (name, arguments).
fn checked(call: &Value) -> (String, Value) {
    assert_eq!(call["type"], "function", "{call}");
    assert!(call["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{call}");
    let name = call["function"]["name"].as_str().unwrap().to_owned();
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap_or_else(|e| panic!("{call}: {e}"));
    match name.as_str() {
        "get_weather" => {
            assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 20), "{args}");
            assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()), "{args}");
            assert_eq!(args.as_object().unwrap().len(), 2, "{args}");
        }
        "get_time" => assert!(args["zone"].as_str().is_some() && args.as_object().unwrap().len() == 1, "{args}"),
        other => panic!("unknown tool {other}"),
    }
    (name, args)
}

/// `tool_choice: "required"` without parallel calls gives one call that matches its schema,
/// the same streamed (no content; the call's arguments as they are written) or not.
async fn one_required_call_streamed_or_not(s: &Server) {
    let v = s.chat(ask(json!({"tool_choice": "required", "parallel_tool_calls": false}))).await;
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], Value::Null, "{v}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    let whole = checked(&calls[0]);
    // Streamed: no content, the call as it is written, and finish_reason tool_calls.
    let events = s.stream("/v1/chat/completions", ask(json!({"tool_choice": "required", "parallel_tool_calls": false, "stream": true}))).await;
    let content: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, "", "{events:?}");
    // The call streams as OpenAI's do: a first chunk with its id, type and name, then pieces
    // of its arguments, which add up to the whole call's.
    let deltas: Vec<&Value> = events.iter().filter_map(|e| e["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert!(deltas.iter().all(|d| d["index"] == 0), "{events:?}");
    assert!(deltas[0]["id"].is_string() && deltas[0]["function"]["name"].is_string(), "{events:?}");
    assert!(deltas[1..].iter().all(|d| d.get("id").is_none() && d["function"].get("name").is_none()), "{events:?}");
    assert!(deltas.len() > 2, "the arguments came in pieces: {events:?}");
    let arguments: String = deltas.iter().map(|d| d["function"]["arguments"].as_str().unwrap()).collect();
    let streamed = json!({"id": deltas[0]["id"], "type": deltas[0]["type"], "function": {"name": deltas[0]["function"]["name"], "arguments": arguments}});
    assert_eq!(checked(&streamed), whole, "streamed and whole calls differ");
    let last = events.iter().rev().find(|e| e["choices"][0]["finish_reason"].is_string()).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
}

#[tokio::test]
async fn required_calls_parse_streamed_or_not() {
    one_required_call_streamed_or_not(shared()).await;
}

#[tokio::test]
async fn other_parsers_force_and_parse_their_own_syntax() {
    for parser in ["mistral", "qwen3_coder"] {
        let s = Server::start(&["--tool-call-parser", parser]);
        let logged = s.wait_for_logs(|l| l.iter().find(|x| x.contains("tool-call parser")).cloned()).await;
        assert!(logged.contains(parser), "{logged}");
        one_required_call_streamed_or_not(&s).await;
        // A named function, sampled: always that one, its arguments matching its schema.
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let v = s.chat(ask(json!({"tool_choice": named, "n": 3, "temperature": 1, "seed": 5}))).await;
        for i in 0..3 {
            let calls = v["choices"][i]["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("{parser}: {v}"));
            assert_eq!((calls.len(), checked(&calls[0]).0.as_str()), (1, "get_weather"), "{parser}: {v}");
        }
    }
}

#[tokio::test]
async fn a_named_function_is_always_called() {
    let s = shared();
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let v = s.chat(ask(json!({"tool_choice": named, "n": 4, "temperature": 1, "seed": 3}))).await;
    for i in 0..4 {
        let calls = v["choices"][i]["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("{v}"));
        assert_eq!(calls.len(), 1, "{v}");
        assert_eq!(checked(&calls[0]).0, "get_time");
        assert_eq!(v["choices"][i]["finish_reason"], "tool_calls");
    }
}

#[tokio::test]
async fn a_tool_result_comes_back_and_is_answered() {
    let s = shared();
    let first = s.chat(ask(json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))).await;
    let call = first["choices"][0]["message"]["tool_calls"][0].clone();
    checked(&call);
    let messages = json!([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [call.clone()]},
        {"role": "tool", "tool_call_id": call["id"], "content": "{\"temperature\": 21, \"sky\": \"sunny\"}"},
    ]);
    // With tool_choice none the answer is text; with auto it is text or calls that parse.
    for choice in ["none", "auto"] {
        let v = s.chat(json!({"messages": messages, "tools": tools(), "tool_choice": choice, "max_tokens": 30, "temperature": 0})).await;
        let m = &v["choices"][0]["message"];
        match m["tool_calls"].as_array() {
            Some(calls) => {
                assert_eq!(choice, "auto", "{v}");
                for c in calls {
                    checked(c);
                }
            }
            None => assert!(m["content"].as_str().is_some_and(|t| !t.is_empty()), "{v}"),
        }
    }
    // The tool turn changes the prompt: the count grows by the tool message's tokens.
    let plain = s.chat(json!({"messages": [messages[0].clone()], "tools": tools(), "max_tokens": 1})).await;
    let two = s.chat(json!({"messages": messages, "tools": tools(), "max_tokens": 1})).await;
    assert!(two["usage"]["prompt_tokens"].as_u64() > plain["usage"]["prompt_tokens"].as_u64(), "{plain} {two}");
}

#[tokio::test]
async fn malformed_tool_fields_are_refused_by_name() {
    let s = shared();
    let m = json!([{"role": "user", "content": "Hi"}]);
    let cases = [
        (json!({"messages": m, "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": m, "tools": []}), "tools"),
        (json!({"messages": m, "tools": [{"type": "function", "function": {"name": "a b"}}]}), "tools[0].function.name"),
        (json!({"messages": m, "tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice.function.name"),
        (json!({"messages": m, "tools": tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}), "tool_choice"),
        (json!({"messages": m, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}], "tool_choice": "required"}), "tools"),
    ];
    for (body, param) in cases {
        let (status, v) = s.post("/v1/chat/completions", &body).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{body} -> {v}");
    }
}
