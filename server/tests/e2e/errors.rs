//! Every bad input answers OpenAI-shaped JSON with the right status and `param`.

use crate::harness::{json_of, shared};
use serde_json::{json, Value};

fn assert_error(status: u16, v: &Value, want_status: u16, want_type: &str, want_param: Option<&str>, case: &str) {
    assert_eq!(status, want_status, "{case}: {v}");
    let e = v["error"].as_object().unwrap_or_else(|| panic!("{case}: not an error object: {v}"));
    let mut keys: Vec<&str> = e.keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(keys, ["code", "message", "param", "type"], "{case}");
    assert!(!e["message"].as_str().unwrap().is_empty(), "{case}");
    assert_eq!(e["type"], want_type, "{case}");
    assert_eq!(e["param"].as_str(), want_param, "{case}: {v}");
}

#[tokio::test]
async fn invalid_completion_parameters() {
    let s = shared();
    let p = "Hello";
    let cases = [
        (json!({}), "prompt"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": {"text": p}}), "prompt"),
        (json!({"prompt": [1, -2]}), "prompt"),
        (json!({"prompt": ""}), "prompt"),
        (json!({"prompt": [999_999]}), "prompt"),
        (json!({"prompt": p, "max_tokens": -1}), "max_tokens"),
        (json!({"prompt": p, "max_tokens": "many"}), "max_tokens"),
        (json!({"prompt": p, "max_tokens": u64::MAX}), "max_tokens"),
        (json!({"prompt": p, "temperature": -0.5}), "temperature"),
        (json!({"prompt": p, "temperature": "hot"}), "temperature"),
        (json!({"prompt": p, "top_p": 1.5}), "top_p"),
        (json!({"prompt": p, "top_k": -3}), "top_k"),
        (json!({"prompt": p, "min_p": -0.1}), "min_p"),
        (json!({"prompt": p, "presence_penalty": 5}), "presence_penalty"),
        (json!({"prompt": p, "frequency_penalty": -5}), "frequency_penalty"),
        (json!({"prompt": p, "repetition_penalty": 0}), "repetition_penalty"),
        (json!({"prompt": p, "n": 0}), "n"),
        (json!({"prompt": p, "n": 1000}), "n"),
        (json!({"prompt": p, "best_of": 3}), "best_of"),
        (json!({"prompt": p, "logprobs": 21}), "logprobs"),
        (json!({"prompt": p, "logprobs": true}), "logprobs"),
        (json!({"prompt": p, "stop": 5}), "stop"),
        (json!({"prompt": p, "stop": [""]}), "stop"),
        (json!({"prompt": p, "stop_token_ids": ["a"]}), "stop_token_ids[0]"),
        (json!({"prompt": p, "seed": -1}), "seed"),
        (json!({"prompt": p, "stream": "yes"}), "stream"),
        (json!({"prompt": p, "echo": 1}), "echo"),
        (json!({"prompt": p, "ignore_eos": "no"}), "ignore_eos"),
        (json!({"prompt": p, "min_tokens": 10, "max_tokens": 5}), "min_tokens"),
        (json!({"prompt": p, "suffix": "!"}), "suffix"),
        (json!({"prompt": p, "stream_options": {"include_usage": 3}}), "stream_options.include_usage"),
    ];
    for (body, param) in cases {
        let (status, v) = s.post("/v1/completions", &body).await;
        assert_error(status, &v, 400, "invalid_request_error", Some(param), &body.to_string());
    }
}

#[tokio::test]
async fn invalid_chat_parameters() {
    let s = shared();
    let m = json!([{"role": "user", "content": "Hi"}]);
    let cases = [
        (json!({}), "messages"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": "Hi"}), "messages"),
        (json!({"messages": [{"content": "Hi"}]}), "messages[0]"),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), "messages[0].content"),
        (json!({"messages": m, "top_logprobs": 3}), "top_logprobs"),
        (json!({"messages": m, "logprobs": true, "top_logprobs": 30}), "top_logprobs"),
        (json!({"messages": m, "max_completion_tokens": -1}), "max_completion_tokens"),
        (json!({"messages": m, "temperature": -1}), "temperature"),
        (json!({"messages": m, "n": 0}), "n"),
        (json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Hi"}]}), "messages[1].role"),
        (json!({"messages": [{"role": "", "content": "Hi"}]}), "messages[0].role"),
        (json!({"messages": [{"role": "function", "content": "Hi"}]}), "messages[0].role"),
        // Fields that would change the answer and are not supported are refused, not ignored.
        (json!({"messages": m, "functions": [{"name": "f"}]}), "functions"),
        (json!({"messages": m, "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": m, "logit_bias": {"42": 5}}), "logit_bias"),
        (json!({"messages": m, "chat_template": "{{ 1 }}"}), "chat_template"),
        (json!({"messages": m, "reasoning_effort": "extreme"}), "reasoning_effort"),
    ];
    for (body, param) in cases {
        let (status, v) = s.post("/v1/chat/completions", &body).await;
        assert_error(status, &v, 400, "invalid_request_error", Some(param), &body.to_string());
    }
}

#[tokio::test]
async fn too_long_prompts_report_the_counts() {
    let s = shared();
    let (_, models) = s.get("/v1/models").await;
    let max_len = serde_json::from_str::<Value>(&models).unwrap()["data"][0]["max_model_len"].as_u64().unwrap();
    let ids = vec![42u32; max_len as usize + 10];
    let (status, v) = s.post("/v1/completions", &json!({"prompt": ids, "max_tokens": 5})).await;
    assert_error(status, &v, 400, "invalid_request_error", Some("prompt"), "too long");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&max_len.to_string()) && msg.contains(&(max_len + 10).to_string()), "{msg}");
    // Prompt + max_tokens over the context.
    let (status, v) = s.post("/v1/completions", &json!({"prompt": "Hello there, friend", "max_tokens": max_len - 1})).await;
    assert_error(status, &v, 400, "invalid_request_error", Some("prompt"), "prompt + max_tokens");
    // Chat: an explicit max_tokens over the rest of the context, and a conversation longer
    // than the context (whose default max_tokens is what is left of it).
    let long = "hello ".repeat(max_len as usize);
    for body in [
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_len - 1}),
        json!({"messages": [{"role": "user", "content": long}]}),
    ] {
        let (status, v) = s.post("/v1/chat/completions", &body).await;
        assert_error(status, &v, 400, "invalid_request_error", Some("messages"), "chat too long");
        assert!(v["error"]["message"].as_str().unwrap().contains(&max_len.to_string()));
    }
}

#[tokio::test]
async fn malformed_bodies_unknown_models_routes_and_methods() {
    let s = shared();
    let c = s.client();
    for (body, case) in [("{\"prompt\": ", "truncated"), ("not json", "garbage"), ("[1, 2]", "not an object"), ("", "empty")] {
        let resp = c.post(s.url("/v1/completions")).header("content-type", "application/json").body(body).send().await.unwrap();
        let (status, v) = json_of(resp).await;
        assert_error(status, &v, 400, "invalid_request_error", None, case);
    }
    let (status, v) = s.post("/v1/completions", &json!({"prompt": "Hi", "model": "gpt-4"})).await;
    assert_error(status, &v, 404, "invalid_request_error", Some("model"), "unknown model");
    assert_eq!(v["error"]["message"], "The model `gpt-4` does not exist.");
    assert_eq!(v["error"]["code"], "model_not_found");
    let (status, v) = s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Hi"}], "model": "x"})).await;
    assert_error(status, &v, 404, "invalid_request_error", Some("model"), "unknown chat model");
    let (status, v) = json_of(c.get(s.url("/v1/models/gpt-4")).send().await.unwrap()).await;
    assert_error(status, &v, 404, "invalid_request_error", Some("model"), "unknown model id");
    for path in ["/v1/nothing", "/", "/v2/completions"] {
        let (status, v) = json_of(c.post(s.url(path)).send().await.unwrap()).await;
        assert_error(status, &v, 404, "invalid_request_error", None, path);
    }
    for (method, path) in [("GET", "/v1/completions"), ("DELETE", "/v1/chat/completions"), ("POST", "/health"), ("PUT", "/v1/models")] {
        let req = c.request(method.parse().unwrap(), s.url(path));
        let (status, v) = json_of(req.send().await.unwrap()).await;
        assert_error(status, &v, 405, "invalid_request_error", None, &format!("{method} {path}"));
    }
}

#[tokio::test]
async fn extractor_and_routing_rejections_are_json() {
    let s = shared();
    let c = s.client();
    for (path, want) in [("/v1/models/%ff", 400), ("/v1/models/%ff%fe", 400), ("/v1/nothing%ff", 404), ("/v1/models/a%2Fb", 404)] {
        let (status, v) = json_of(c.get(s.url(path)).send().await.unwrap()).await;
        assert_error(status, &v, want, "invalid_request_error", if want == 404 && path.starts_with("/v1/models/") { Some("model") } else { None }, path);
    }
    // Plain-text answers of any layer become JSON with their status.
    let resp = c.request("OPTIONS".parse().unwrap(), s.url("/v1/completions")).send().await.unwrap();
    let (status, v) = json_of(resp).await;
    assert_error(status, &v, 405, "invalid_request_error", None, "OPTIONS");
}

#[tokio::test]
async fn the_server_survives_bad_input() {
    let s = shared();
    let (status, _) = s.post("/v1/completions", &json!({"prompt": "x", "temperature": f64::MAX})).await;
    assert_eq!(status, 400);
    let (status, _) = s.get("/health").await;
    assert_eq!(status, 200);
}

/// More sequences (prompts times `n`) than the waiting queue holds can never be admitted:
/// 400 naming the limit and the parameter, not a 503 to retry. A request at the limit runs
/// (its choices share each prompt's prefill).
#[tokio::test]
async fn more_choices_than_the_queue_holds_is_a_400_not_a_503() {
    let s = shared();
    let c = s.client();
    let body = json!({"prompt": ["a", "b", "c"], "n": 128, "max_tokens": 1});
    let resp = c.post(s.url("/v1/completions")).json(&body).send().await.unwrap();
    assert!(resp.headers().get("retry-after").is_none(), "nothing to retry");
    let (status, v) = json_of(resp).await;
    assert_error(status, &v, 400, "invalid_request_error", Some("n"), "3 prompts x 128");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("384") && msg.contains("256"), "{msg}");
    // One choice per prompt: the prompts are at fault.
    let (status, v) = s.post("/v1/completions", &json!({"prompt": vec!["a"; 300], "max_tokens": 1})).await;
    assert_error(status, &v, 400, "invalid_request_error", Some("prompt"), "300 prompts");
    // Exactly the queue's capacity is served.
    let v = s.complete(json!({"prompt": ["a", "b"], "n": 128, "max_tokens": 1})).await;
    assert_eq!(v["choices"].as_array().unwrap().len(), 256);
    assert_eq!(v["usage"]["completion_tokens"], 256);
}
