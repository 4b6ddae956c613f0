//! `/v1/chat/completions`: the template, streaming, logprobs and parameters.

use crate::harness::{shared, streamed_texts, texts, tokenizer};
use serde_json::{json, Value};

const QUESTION: &str = "What is the capital of France?";

/// What SmolLM2-Instruct's template renders for one user message.
fn rendered(question: &str) -> String {
    format!(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )
}

fn ask(max_tokens: usize) -> Value {
    json!({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens, "temperature": 0})
}

fn contents(v: &Value) -> Vec<String> {
    v["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].as_str().unwrap().to_owned()).collect()
}

#[tokio::test]
async fn the_chat_template_renders_the_prompt() {
    let s = shared();
    let v = s.chat(ask(12)).await;
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert!(!c["message"]["content"].as_str().unwrap().is_empty());
    assert_eq!(c["logprobs"], Value::Null);
    let prompt = rendered(QUESTION);
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, tokenizer().encode(&prompt).unwrap().len());
    // The same prompt through /v1/completions gives the same greedy answer.
    let n = v["usage"]["completion_tokens"].clone();
    let raw = s.complete(json!({"prompt": prompt, "max_tokens": n, "temperature": 0})).await;
    assert_eq!(texts(&raw), contents(&v));
    // A system message replaces the template's default one.
    let sys = s
        .chat(json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}], "max_tokens": 1}))
        .await;
    let sys_prompt = format!("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(sys["usage"]["prompt_tokens"].as_u64().unwrap() as usize, tokenizer().encode(&sys_prompt).unwrap().len());
}

#[tokio::test]
async fn chat_streams_role_then_content() {
    let s = shared();
    let whole = s.chat(ask(10)).await;
    let events =
        s.stream("/v1/chat/completions", json!({"stream": true, "stream_options": {"include_usage": true}, "messages": ask(10)["messages"], "max_tokens": 10, "temperature": 0})).await;
    let first = &events[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert!(events[1..].iter().all(|e| e["choices"].as_array().unwrap().iter().all(|c| c["delta"].get("role").is_none())));
    let (usage, chunks) = events.split_last().unwrap();
    assert_eq!((usage["choices"].clone(), usage["usage"].clone()), (json!([]), whole["usage"].clone()));
    assert_eq!(streamed_texts(chunks, 1, true), contents(&whole));
    let last = &chunks.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], whole["choices"][0]["finish_reason"]);
    assert_eq!(last["delta"], json!({}));
}

#[tokio::test]
async fn chat_logprobs_in_the_chat_format() {
    let s = shared();
    let mut body = ask(6);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    let v = s.chat(body).await;
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    let mut text = String::new();
    for entry in content {
        let token = entry["token"].as_str().unwrap();
        text.push_str(token);
        assert_eq!(entry["bytes"], json!(token.as_bytes()));
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["token"], entry["token"], "greedy: the chosen token is the most likely");
        assert_eq!(top[0]["logprob"], entry["logprob"]);
        assert_eq!(top[1]["bytes"], json!(top[1]["token"].as_str().unwrap().as_bytes()));
    }
    assert!(text.starts_with(contents(&v)[0].as_str()));
}

#[tokio::test]
async fn chat_parameters() {
    let s = shared();
    let mut body = ask(100);
    body["max_completion_tokens"] = json!(3);
    body["ignore_eos"] = json!(true);
    let v = s.chat(body).await;
    assert_eq!((v["usage"]["completion_tokens"].clone(), v["choices"][0]["finish_reason"].clone()), (json!(3), json!("length")));
    let sampled = json!({"messages": ask(0)["messages"], "max_tokens": 8, "temperature": 1.0, "seed": 9, "n": 2});
    let a = s.chat(sampled.clone()).await;
    assert_eq!(contents(&a), contents(&s.chat(sampled).await));
    assert_eq!(a["choices"][1]["index"], 1);
    let greedy = contents(&s.chat(ask(12)).await)[0].clone();
    let word: String = greedy.split_whitespace().nth(1).unwrap_or_else(|| panic!("short answer {greedy:?}")).to_owned();
    let mut stopped = ask(12);
    stopped["stop"] = json!([word]);
    let v = s.chat(stopped).await;
    assert_eq!(contents(&v)[0], greedy[..greedy.find(&word).unwrap()]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn every_openai_role_is_accepted() {
    let s = shared();
    let v = s
        .chat(json!({"messages": [
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "Let me check."},
            {"role": "tool", "content": "Paris"},
        ], "max_tokens": 2, "temperature": 0}))
        .await;
    assert_eq!(v["usage"]["completion_tokens"], 2);
}
