//! Structured outputs over HTTP: every spelling of a constraint holds, constrained and free
//! requests batch together without changing the free ones, and refused constraints are 400s
//! naming the field (the Python client's checks are in python.rs).

use crate::harness::{shared, texts};
use serde_json::{json, Value};

fn ask(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Tell me about a city."}], "max_tokens": 120, "temperature": 0});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

fn content(v: &Value, i: usize) -> String {
    v["choices"][i]["message"]["content"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn a_json_schema_is_followed_and_the_choice_stops_when_complete() {
    let s = shared();
    let schema = json!({
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
        "required": ["city", "population"],
        "additionalProperties": false
    });
    let v = s.chat(ask(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": true}}, "n": 3, "temperature": 1, "seed": 1}))).await;
    for i in 0..3 {
        let text = content(&v, i);
        let parsed: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let keys: Vec<&String> = parsed.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["city", "population"], "{text}");
        assert!(parsed["population"].as_u64().is_some(), "{text}");
        assert_eq!(v["choices"][i]["finish_reason"], "stop");
        assert_eq!(v["choices"][i]["stop_reason"], Value::Null, "the grammar ended it, not EOS");
    }
}

#[tokio::test]
async fn regex_choice_and_lark_hold_on_both_endpoints() {
    let s = shared();
    let v = s.complete(json!({"prompt": "Year:", "max_tokens": 10, "n": 8, "temperature": 1, "guided_regex": "(19|20)[0-9]{2}"})).await;
    for t in texts(&v) {
        assert!(t.len() == 4 && (t.starts_with("19") || t.starts_with("20")) && t.bytes().all(|b| b.is_ascii_digit()), "{t:?}");
    }
    let choices = ["yes", "no", "maybe"];
    let v = s.chat(ask(json!({"structured_outputs": {"choice": choices}, "n": 8, "temperature": 1}))).await;
    for i in 0..8 {
        assert!(choices.contains(&content(&v, i).as_str()), "{v}");
    }
    let lark = r#"start: "The answer is " NUMBER "."
NUMBER: /[0-9]{1,4}/"#;
    let v = s.complete(json!({"prompt": "6 times 7?", "max_tokens": 12, "structured_outputs": {"grammar": lark}})).await;
    let t = &texts(&v)[0];
    let digits = t.strip_prefix("The answer is ").and_then(|r| r.strip_suffix('.')).unwrap_or_else(|| panic!("{t:?}"));
    assert!(!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()), "{t:?}");
    // Streaming: the chunks add up to a valid object.
    let events = s.stream("/v1/chat/completions", ask(json!({"response_format": {"type": "json_object"}, "stream": true}))).await;
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert!(serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{text:?}: {e}")).is_object());
}

/// Free requests batched with constrained ones produce what they produce alone.
#[tokio::test]
async fn constrained_and_free_requests_share_batches() {
    let s = shared();
    let free = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let alone = texts(&s.complete(free.clone()).await);
    let constrained = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "guided_regex": "[a-z ]{1,60}\\."});
    let (a, b, c, d) = tokio::join!(s.complete(free.clone()), s.complete(constrained.clone()), s.complete(free.clone()), s.complete(constrained));
    assert_eq!(texts(&a), alone);
    assert_eq!(texts(&c), alone);
    for v in [b, d] {
        let t = &texts(&v)[0];
        assert!(t.bytes().all(|ch| ch == b' ' || ch == b'.' || ch.is_ascii_lowercase()), "{t:?}");
    }
}

#[tokio::test]
async fn refused_constraints_are_400s_naming_the_field() {
    let s = shared();
    let cases = [
        ("/v1/chat/completions", ask(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}})), "response_format.json_schema.schema"),
        ("/v1/chat/completions", ask(json!({"structured_outputs": {"regex": "("}})), "structured_outputs.regex"),
        ("/v1/completions", json!({"prompt": "a", "guided_grammar": "start: ("}), "guided_grammar"),
        ("/v1/completions", json!({"prompt": "a", "guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
        ("/v1/completions", json!({"prompt": "a", "guided_regex": "a", "min_tokens": 2}), "min_tokens"),
        ("/v1/completions", json!({"prompt": "a", "response_format": {"type": "yaml"}}), "response_format.type"),
    ];
    for (path, body, param) in cases {
        let (status, v) = s.post(path, &body).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{body} -> {v}");
    }
    let (_, v) = s.post("/v1/completions", &json!({"prompt": "a", "guided_grammar": "start: ("})).await;
    assert!(v["error"]["message"].as_str().unwrap().contains("refused by the grammar compiler"), "{v}");
}
