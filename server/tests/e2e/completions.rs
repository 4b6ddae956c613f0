//! `/v1/completions`: every parameter, with its effect visible.

use crate::harness::{model_path, shared, streamed_texts, texts, tokenizer, Server};
use serde_json::{json, Value};
use tessera_engine::model::SeqInput;
use tessera_engine::perplexity::{perplexity, PerplexityOptions};
use tessera_engine::sample::logsumexp;
use tessera_engine::LoadedModel;
use tessera_kernels::linear::LinearPolicy;

const PROMPT: &str = "The capital of France is";
const STORY: &str = "Once upon a time, in a small village,";

fn greedy(prompt: &str, max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

fn with(mut body: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn greedy_is_deterministic_and_max_tokens_ends_with_length() {
    let s = shared();
    let a = s.complete(greedy(PROMPT, 8)).await;
    let b = s.complete(greedy(PROMPT, 8)).await;
    assert_eq!(texts(&a), texts(&b));
    assert!(a["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_ne!(a["id"], b["id"]);
    assert_eq!(a["object"], "text_completion");
    assert_eq!(a["model"], "SmolLM2-135M-Instruct.Q4_1");
    assert!(a["created"].as_u64().unwrap() > 1_600_000_000);
    let c = &a["choices"][0];
    assert_eq!((c["index"].clone(), c["finish_reason"].clone(), c["logprobs"].clone()), (json!(0), json!("length"), Value::Null));
    assert!(!c["text"].as_str().unwrap().is_empty());
    let prompt_tokens = tokenizer().encode(PROMPT).unwrap().len();
    assert_eq!(a["usage"], json!({"prompt_tokens": prompt_tokens, "completion_tokens": 8, "total_tokens": prompt_tokens + 8}));
    // Default max_tokens is OpenAI's 16.
    let d = s.complete(json!({"prompt": PROMPT, "temperature": 0, "ignore_eos": true})).await;
    assert_eq!(d["usage"]["completion_tokens"], 16);
}

#[tokio::test]
async fn seeds_reproduce_and_choice_i_samples_with_seed_plus_i() {
    let s = shared();
    let body = json!({"prompt": STORY, "max_tokens": 12, "temperature": 1.0, "seed": 123, "n": 3, "ignore_eos": true});
    let a = s.complete(body.clone()).await;
    let b = s.complete(body).await;
    assert_eq!(texts(&a), texts(&b), "same seed, same choices");
    let idx: Vec<_> = a["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(idx, [0, 1, 2]);
    let t = texts(&a);
    assert!(t[0] != t[1] || t[1] != t[2], "choices should differ: {t:?}");
    let single = json!({"prompt": STORY, "max_tokens": 12, "temperature": 1.0, "seed": 124, "ignore_eos": true});
    assert_eq!(texts(&s.complete(single).await)[0], t[1], "choice 1 of seed 123 is seed 124");
    assert_eq!(a["usage"]["completion_tokens"], 36);
}

/// Echo + logprobs with n > 1 (the prompt is computed once and shared): every choice, prompt
/// logprobs included, equals the single request with its seed.
#[tokio::test]
async fn echo_logprobs_choices_equal_single_requests_with_their_seeds() {
    let s = shared();
    let body = |n: usize, seed: u64| {
        json!({"prompt": STORY, "max_tokens": 5, "temperature": 1.0, "seed": seed, "n": n, "echo": true, "logprobs": 2, "ignore_eos": true})
    };
    let all = s.complete(body(3, 7)).await;
    for i in 0..3 {
        let single = s.complete(body(1, 7 + i as u64)).await;
        let (mut got, want) = (all["choices"][i].clone(), single["choices"][0].clone());
        got["index"] = json!(0);
        assert_eq!(got, want, "choice {i}");
    }
}

#[tokio::test]
async fn prompt_lists_token_ids_and_choice_order() {
    let s = shared();
    let one = texts(&s.complete(greedy(PROMPT, 6)).await)[0].clone();
    let two = texts(&s.complete(greedy(STORY, 6)).await)[0].clone();
    let v = s.complete(with(greedy(PROMPT, 6), json!({"prompt": [PROMPT, STORY], "n": 2}))).await;
    assert_eq!(texts(&v), [one.clone(), one.clone(), two.clone(), two.clone()], "index = prompt_index * n + i");
    let (p1, p2) = (tokenizer().encode(PROMPT).unwrap(), tokenizer().encode(STORY).unwrap());
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, p1.len() + p2.len(), "each prompt counted once");
    assert_eq!(v["usage"]["completion_tokens"], 24);
    let ids = s.complete(with(greedy(PROMPT, 6), json!({"prompt": p1}))).await;
    assert_eq!(texts(&ids)[0], one);
    let lists = s.complete(with(greedy(PROMPT, 6), json!({"prompt": [p1, p2]}))).await;
    assert_eq!(texts(&lists), [one, two]);
}

#[tokio::test]
async fn logprobs_lists_are_parallel_and_hold_the_chosen_token() {
    let s = shared();
    let v = s.complete(with(greedy(PROMPT, 6), json!({"logprobs": 3}))).await;
    let c = &v["choices"][0];
    let lp = &c["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.len(), 6);
    for key in ["token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().unwrap().len(), 6, "{key}");
    }
    assert_eq!(tokens.concat(), c["text"].as_str().unwrap());
    let mut offset = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i].as_u64().unwrap() as usize, offset);
        offset += t.chars().count();
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(chosen <= 0.0);
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!((3..=4).contains(&top.len()), "{top:?}");
        assert!((top[*t].as_f64().unwrap() - chosen).abs() < 1e-6, "the chosen token is in top_logprobs");
        let best = top.values().map(|x| x.as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert!(chosen >= best - 1e-6, "greedy picks the most likely token: {chosen} vs {top:?}");
    }
    let zero = s.complete(with(greedy(PROMPT, 3), json!({"logprobs": 0}))).await;
    for top in zero["choices"][0]["logprobs"]["top_logprobs"].as_array().unwrap() {
        assert_eq!(top.as_object().unwrap().len(), 1, "logprobs 0: only the chosen token");
    }
}

#[tokio::test]
async fn echo_prepends_the_prompt_and_its_logprobs() {
    let s = shared();
    let plain = texts(&s.complete(greedy(PROMPT, 4)).await)[0].clone();
    let echoed = s.complete(with(greedy(PROMPT, 4), json!({"echo": true}))).await;
    assert_eq!(texts(&echoed)[0], format!("{PROMPT}{plain}"));
    let v = s.complete(with(greedy(PROMPT, 4), json!({"echo": true, "logprobs": 1}))).await;
    let c = &v["choices"][0];
    assert_eq!(c["text"].as_str().unwrap(), format!("{PROMPT}{plain}"));
    let n_prompt = tokenizer().encode(PROMPT).unwrap().len();
    let lp = &c["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n_prompt + 4);
    assert_eq!((lp["token_logprobs"][0].clone(), lp["top_logprobs"][0].clone()), (Value::Null, Value::Null));
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.concat(), c["text"].as_str().unwrap());
}

/// lm-eval-harness's log-likelihood request: echo + logprobs + max_tokens 0.
#[tokio::test]
async fn echo_logprobs_with_zero_max_tokens_scores_the_prompt_like_the_perplexity_api() {
    let s = shared();
    let text = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.";
    let body = json!({"prompt": text, "max_tokens": 0, "echo": true, "logprobs": 1, "temperature": 0});
    let v = s.complete(body.clone()).await;
    let again = s.complete(body).await;
    let c = &v["choices"][0];
    assert_eq!(c["text"], text);
    assert_eq!((c["finish_reason"].clone(), v["usage"]["completion_tokens"].clone()), (json!("length"), json!(0)));
    let ids = tokenizer().encode(text).unwrap();
    let lp = &c["logprobs"];
    assert_eq!(lp, &again["choices"][0]["logprobs"], "scoring is deterministic");
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), ids.len());
    assert_eq!((lp["token_logprobs"][0].clone(), lp["top_logprobs"][0].clone()), (Value::Null, Value::Null));
    let logprobs: Vec<f64> = (1..ids.len()).map(|i| lp["token_logprobs"][i].as_f64().unwrap()).collect();
    assert!(logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
    for i in 1..ids.len() {
        let top = lp["top_logprobs"][i].as_object().unwrap();
        let token = tokens[i].as_str().unwrap();
        assert!(top.contains_key(token), "top_logprobs[{i}] holds the token itself");
        assert!(top.len() <= 2);
        if top.len() == 1 {
            // The token is the argmax: its own entry is the top-1.
            assert_eq!(top[token].as_f64(), lp["token_logprobs"][i].as_f64());
        }
    }
    // An independent computation, a plain forward pass over the prompt, token by token; and the
    // perplexity API (llama.cpp's method: one window of exactly the prompt scores tokens
    // ctx/2+1 .. ctx-1, on an engine of its own that computes only those rows' logits). Both sides use the float kernels: with int8 activations a one-ulp
    // difference in attention order (paged vs contiguous cache) can move an activation across
    // a quantization step and blur the comparison.
    let float = Server::start(&["--compute", "float"]);
    let v = float.complete(json!({"prompt": text, "max_tokens": 0, "echo": true, "logprobs": 1})).await;
    let exact: Vec<f64> =
        v["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap()[1..].iter().map(|l| l.as_f64().unwrap()).collect();
    let lm = LoadedModel::load(&model_path(), LinearPolicy::ALWAYS_GEMM).unwrap();
    let mut kv = lm.model.local_kv(ids.len());
    let logits = lm.model.forward(&mut [SeqInput { tokens: &ids, kv: &mut kv, logits_from: Some(0) }]).unwrap().remove(0);
    let vocab = lm.model.config().vocab_size;
    for (i, lp) in exact.iter().enumerate() {
        let row = &logits[i * vocab..(i + 1) * vocab];
        let want = row[ids[i + 1] as usize] as f64 - logsumexp(row);
        assert!((lp - want).abs() < 1e-3, "token {} of {}: server {lp}, forward pass {want}", i + 1, ids.len());
    }
    let ctx = ids.len();
    let opts = PerplexityOptions { chunks: Some(1), ..PerplexityOptions::new(ctx, 1) };
    // The perplexity API blocks on the engine's streams: off the test's async runtime.
    let lm = std::sync::Arc::new(lm);
    let report = tokio::task::spawn_blocking({
        let ids = ids.clone();
        move || perplexity(lm, &ids, &opts, |_| {}).unwrap()
    })
    .await
    .unwrap();
    let ours: f64 = exact[ctx / 2..].iter().sum();
    assert_eq!(report.count, ctx - 1 - ctx / 2);
    assert!((ours + report.nll).abs() < 1e-3 * report.count as f64, "server {ours} vs perplexity API {}", -report.nll);
}

#[tokio::test]
async fn stop_strings_spanning_tokens_are_cut_and_never_emitted() {
    let s = shared();
    let full = s.complete(with(greedy(PROMPT, 24), json!({"logprobs": 0}))).await;
    let text = texts(&full)[0].clone();
    let tokens: Vec<String> =
        full["choices"][0]["logprobs"]["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_owned()).collect();
    assert_eq!(tokens.concat(), text);
    // A stop string made of the last two characters of one token and the first two of the
    // next, whose first occurrence is at that boundary.
    let mut boundary = 0;
    let mut found = None;
    for k in 0..tokens.len() - 1 {
        boundary += tokens[k].len();
        let (a, b): (Vec<char>, Vec<char>) = (tokens[k].chars().collect(), tokens[k + 1].chars().collect());
        if a.len() < 2 || b.len() < 2 {
            continue;
        }
        let tail: String = a[a.len() - 2..].iter().collect();
        let stop = format!("{tail}{}", b[..2].iter().collect::<String>());
        let start = boundary - tail.len();
        if text.find(&stop) == Some(start) {
            found = Some((stop, start));
            break;
        }
    }
    let (stop, cut) = found.unwrap_or_else(|| panic!("no token boundary to stop at in {tokens:?}"));
    let expected = &text[..cut];
    for stop_param in [json!(stop), json!(["@@never@@", stop])] {
        let v = s.complete(with(greedy(PROMPT, 24), json!({"stop": stop_param}))).await;
        let c = &v["choices"][0];
        assert_eq!(c["text"].as_str().unwrap(), expected, "stop {stop:?}");
        assert_eq!((c["finish_reason"].clone(), c["stop_reason"].clone()), (json!("stop"), json!(stop)));
    }
    let events = s.stream("/v1/completions", with(greedy(PROMPT, 24), json!({"stop": stop, "stream": true}))).await;
    assert_eq!(streamed_texts(&events, 1, false)[0], expected);
    assert!(events.iter().all(|e| !e["choices"][0]["text"].as_str().unwrap_or("").contains(&stop)));
    assert_eq!(events.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn penalties_change_greedy_output() {
    let s = shared();
    let prompt = "I like apples. I like apples. I like apples. I like";
    let base = texts(&s.complete(greedy(prompt, 16)).await)[0].clone();
    for penalty in [json!({"presence_penalty": 2.0}), json!({"frequency_penalty": 2.0}), json!({"repetition_penalty": 2.0})] {
        let t = texts(&s.complete(with(greedy(prompt, 16), penalty.clone())).await)[0].clone();
        assert_ne!(t, base, "{penalty} had no effect");
    }
}

#[tokio::test]
async fn sampling_filters_act() {
    let s = shared();
    let base = texts(&s.complete(greedy(STORY, 10)).await)[0].clone();
    let hot = with(greedy(STORY, 10), json!({"temperature": 1.5, "seed": 5}));
    assert_ne!(texts(&s.complete(hot.clone()).await)[0], base, "temperature 1.5 samples");
    // Filters that leave only the top token make sampling greedy.
    for filter in [json!({"top_k": 1}), json!({"top_p": 1e-6}), json!({"min_p": 1.0})] {
        assert_eq!(texts(&s.complete(with(hot.clone(), filter.clone())).await)[0], base, "{filter}");
    }
    // top_k -1 means off, as in vLLM.
    let off = texts(&s.complete(with(hot.clone(), json!({"top_k": -1}))).await)[0].clone();
    assert_eq!(off, texts(&s.complete(hot).await)[0]);
}

#[tokio::test]
async fn eos_ignore_eos_min_tokens_and_stop_token_ids() {
    let s = shared();
    let prompt = "<|im_start|>user\nWhat is 2+2? Answer with one number.<|im_end|>\n<|im_start|>assistant\n";
    let natural = s.complete(json!({"prompt": prompt, "max_tokens": 40, "temperature": 0})).await;
    let c = &natural["choices"][0];
    let n = natural["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(c["finish_reason"], "stop", "premise: the model ends its answer: {natural}");
    assert!(n < 40);
    let ignored = s.complete(json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true})).await;
    assert_eq!((ignored["usage"]["completion_tokens"].clone(), ignored["choices"][0]["finish_reason"].clone()), (json!(40), json!("length")));
    let min = n + 3;
    let forced = s.complete(json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "min_tokens": min})).await;
    assert!(forced["usage"]["completion_tokens"].as_u64().unwrap() >= min, "{forced}");
    let answer = tokenizer().encode(c["text"].as_str().unwrap()).unwrap();
    assert!(answer.len() >= 2, "{answer:?}");
    let stop_id = answer[1];
    let stopped = s.complete(json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop_token_ids": [stop_id]})).await;
    let sc = &stopped["choices"][0];
    assert_eq!((sc["finish_reason"].clone(), sc["stop_reason"].clone()), (json!("stop"), json!(stop_id)));
    assert!(stopped["usage"]["completion_tokens"].as_u64().unwrap() <= 2, "{stopped}");
}

#[tokio::test]
async fn streaming_matches_non_streaming() {
    let s = shared();
    let body = with(greedy(STORY, 8), json!({"n": 2}));
    let whole = s.complete(body.clone()).await;
    let events = s.stream("/v1/completions", with(body.clone(), json!({"stream": true, "stream_options": {"include_usage": true}}))).await;
    assert_eq!(streamed_texts(&events, 2, false), texts(&whole));
    let (usage_chunk, chunks) = events.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"], whole["usage"]);
    for e in chunks {
        assert_eq!((e["object"].clone(), e["id"].clone()), (json!("text_completion"), events[0]["id"].clone()));
        assert_eq!(e["usage"], Value::Null);
        assert!(e.as_object().unwrap().contains_key("usage"));
        assert_eq!(e["choices"].as_array().unwrap().len(), 1);
    }
    for i in 0..2u64 {
        let mine: Vec<&Value> = chunks.iter().map(|e| &e["choices"][0]).filter(|c| c["index"] == i).collect();
        let (last, rest) = mine.split_last().unwrap();
        assert_eq!(last["finish_reason"], "length");
        assert!(rest.iter().all(|c| c["finish_reason"].is_null()));
    }
    let plain = s.stream("/v1/completions", with(body, json!({"stream": true}))).await;
    assert!(plain.iter().all(|e| !e.as_object().unwrap().contains_key("usage")), "no usage unless asked");
}

#[tokio::test]
async fn streamed_logprobs_and_echo_match_non_streamed() {
    let s = shared();
    let body = with(greedy(PROMPT, 6), json!({"logprobs": 2, "echo": true}));
    let whole = s.complete(body.clone()).await;
    let events = s.stream("/v1/completions", with(body, json!({"stream": true}))).await;
    let first = &events[0]["choices"][0];
    assert_eq!(first["text"], PROMPT, "the echo comes first");
    let mut tokens = Vec::new();
    let mut offsets = Vec::new();
    for e in &events {
        if let Some(lp) = e["choices"][0]["logprobs"].as_object() {
            tokens.extend(lp["tokens"].as_array().unwrap().iter().cloned());
            offsets.extend(lp["text_offset"].as_array().unwrap().iter().cloned());
        }
    }
    let lp = &whole["choices"][0]["logprobs"];
    assert_eq!(Value::from(tokens), lp["tokens"]);
    assert_eq!(Value::from(offsets), lp["text_offset"]);
    assert_eq!(streamed_texts(&events, 1, false), texts(&whole));
}

#[tokio::test]
async fn model_user_and_best_of_equal_to_n_are_accepted() {
    let s = shared();
    let body = with(greedy(PROMPT, 2), json!({"model": "SmolLM2-135M-Instruct.Q4_1", "user": "u-1", "best_of": 1, "suffix": null}));
    s.complete(body).await;
}
