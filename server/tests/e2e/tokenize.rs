//! `/tokenize` and `/detokenize`: vLLM's request and response shapes, agreement with what the
//! generation endpoints count, and OpenAI-shaped 400s.

use crate::harness::{shared, tokenizer};
use serde_json::{json, Value};

fn ids(v: &Value) -> Vec<u32> {
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

#[tokio::test]
async fn tokenize_a_prompt_and_detokenize_it_back() {
    let s = shared();
    let text = "The capital of France is Paris.";
    let (status, v) = s.post("/tokenize", &json!({"prompt": text})).await;
    assert_eq!(status, 200, "{v}");
    let tokens = ids(&v);
    assert_eq!(tokens, tokenizer().encode(text).unwrap());
    assert_eq!(v["count"].as_u64().unwrap() as usize, tokens.len());
    let (_, models) = s.get("/v1/models").await;
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(v["max_model_len"], models["data"][0]["max_model_len"]);
    assert_eq!(v["token_strs"], Value::Null);
    // The completions endpoint counts the same tokens.
    let c = s.complete(json!({"prompt": text, "max_tokens": 1})).await;
    assert_eq!(c["usage"]["prompt_tokens"], v["count"]);
    let (status, d) = s.post("/detokenize", &json!({"tokens": tokens})).await;
    assert_eq!((status, d), (200, json!({"prompt": text})));
    // Token strings on request, the model's name accepted.
    let (_, v) = s.post("/tokenize", &json!({"prompt": "Hello world", "return_token_strs": true, "model": "SmolLM2-135M-Instruct.Q4_1"})).await;
    assert_eq!(v["token_strs"], json!(["Hello", "Ġworld"]));
}

#[tokio::test]
async fn tokenize_messages_as_chat_does() {
    let s = shared();
    let messages = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let (status, v) = s.post("/tokenize", &json!({"messages": messages})).await;
    assert_eq!(status, 200, "{v}");
    let chat = s.chat(json!({"messages": messages, "max_tokens": 1})).await;
    assert_eq!(chat["usage"]["prompt_tokens"], v["count"]);
    let (_, text) = s.post("/detokenize", &json!({"tokens": v["tokens"]})).await;
    assert!(text["prompt"].as_str().unwrap().ends_with("<|im_start|>assistant\n"), "{text}");
    // Without the generation prompt the assistant's opener is missing.
    let (_, bare) = s.post("/tokenize", &json!({"messages": messages, "add_generation_prompt": false})).await;
    let (_, text) = s.post("/detokenize", &json!({"tokens": bare["tokens"]})).await;
    assert!(text["prompt"].as_str().unwrap().ends_with("<|im_end|>\n"), "{text}");
    assert!(bare["count"].as_u64() < v["count"].as_u64());
    // Tools go to the template as chat sends them, checked as chat checks them.
    let tools = json!([{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]);
    let (status, with_tools) = s.post("/tokenize", &json!({"messages": messages, "tools": tools})).await;
    assert_eq!(status, 200, "{with_tools}");
    let chat = s.chat(json!({"messages": messages, "tools": tools, "max_tokens": 1})).await;
    assert_eq!(chat["usage"]["prompt_tokens"], with_tools["count"]);
}

#[tokio::test]
async fn bad_tokenize_requests_are_400s_naming_the_field() {
    let s = shared();
    let cases = [
        ("/tokenize", json!({}), "prompt"),
        ("/tokenize", json!({"prompt": 3}), "prompt"),
        ("/tokenize", json!({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), "messages"),
        ("/tokenize", json!({"messages": [{"role": "robot", "content": "b"}]}), "messages[0].role"),
        ("/tokenize", json!({"messages": [{"role": "user", "content": "b"}], "chat_template": "{{ 1 }}"}), "chat_template"),
        ("/tokenize", json!({"prompt": "a", "add_special_tokens": "yes"}), "add_special_tokens"),
        ("/tokenize", json!({"messages": [{"role": "user", "content": "b"}], "tools": [{"type": "retrieval"}]}), "tools[0].type"),
        ("/tokenize", json!({"messages": [{"role": "user", "content": "b"}], "tool_choice": "required"}), "tool_choice"),
        ("/tokenize", json!({"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}), "tools"),
        ("/tokenize", json!({"messages": [{"role": "user", "content": "b"}], "reasoning_effort": "max"}), "reasoning_effort"),
        ("/detokenize", json!({}), "tokens"),
        ("/detokenize", json!({"tokens": [1, -2]}), "tokens[1]"),
        ("/detokenize", json!({"tokens": [1, 4000000]}), "tokens[1]"),
    ];
    for (path, body, param) in cases {
        let (status, v) = s.post(path, &body).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{path} {body} -> {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let (status, v) = s.post("/tokenize", &json!({"prompt": "a", "model": "gpt-9"})).await;
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("model_not_found")));
}
