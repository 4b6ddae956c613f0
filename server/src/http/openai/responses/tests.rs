//! A Responses body becomes the chat body it asks for, refusals name the Responses field, and
//! the streamed events add up to the whole response (text, held-back calls, cut short).

use super::*;
use crate::http::openai::tool_parsers::ToolParser;
use tessera_engine::serve::StopReason;

fn chat_of(body: Value) -> Value {
    to_chat(&body).unwrap_or_else(|e| panic!("{body}: {}", e.message))
}

fn refused(body: Value) -> String {
    let e = to_chat(&body).map(|_| ()).expect_err("refused");
    assert_eq!(e.status.as_u16(), 400, "{body}");
    e.param.unwrap_or_default()
}

#[test]
fn a_responses_body_becomes_its_chat_body() {
    let c = chat_of(json!({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5, "seed": 3, "store": true, "metadata": {"a": "b"}}));
    assert_eq!(
        c,
        json!({"model": "m", "temperature": 0.5, "seed": 3, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 9})
    );
    let items = json!([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It rains."}]},
    ]);
    let c = chat_of(json!({"input": items, "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true}], "tool_choice": {"type": "function", "name": "get_weather"}}));
    assert_eq!(
        c["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "assistant", "content": [{"type": "text", "text": "It rains."}]},
        ])
    );
    assert_eq!(c["tools"], json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}, "strict": true}}]));
    assert_eq!(c["tool_choice"], json!({"type": "function", "function": {"name": "get_weather"}}));
    let schema = json!({"type": "object"});
    let c = chat_of(json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema, "strict": true}}}));
    assert_eq!(c["response_format"], json!({"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": true}}));
    assert_eq!(chat_of(json!({"input": "x", "text": {"format": {"type": "json_object"}}}))["response_format"], json!({"type": "json_object"}));
    assert!(chat_of(json!({"input": "x", "text": {"format": {"type": "text"}}})).get("response_format").is_none());
    let c = chat_of(json!({"input": "x", "top_logprobs": 3, "include": [LOGPROBS_INCLUDE]}));
    assert_eq!((c["logprobs"].clone(), c["top_logprobs"].clone()), (json!(true), json!(3)));
    assert_eq!(chat_of(json!({"input": "x", "include": [LOGPROBS_INCLUDE]}))["logprobs"], json!(true));
    assert!(chat_of(json!({"input": "x", "top_logprobs": 0})).get("logprobs").is_none(), "no logprobs unless included");
    assert_eq!(chat_of(json!({"input": "x", "reasoning": {"effort": "low"}}))["reasoning_effort"], json!("low"));
}

#[test]
fn what_cannot_be_honoured_is_refused_by_its_responses_name() {
    let cases = [
        (json!({}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": 3}), "input"),
        (json!({"input": "x", "previous_response_id": "resp_1"}), "previous_response_id"),
        (json!({"input": "x", "background": true}), "background"),
        (json!({"input": "x", "reasoning": {"summary": "auto"}}), "reasoning.summary"),
        (json!({"input": "x", "reasoning": {"effort": "max"}}), "reasoning.effort"),
        (json!({"input": "x", "reasoning": "high"}), "reasoning"),
        (json!({"input": "x", "messages": []}), "messages"),
        (json!({"input": "x", "max_tokens": 3}), "max_tokens"),
        (json!({"input": "x", "n": 2}), "n"),
        (json!({"input": "x", "truncation": "auto"}), "truncation"),
        (json!({"input": "x", "instructions": 3}), "instructions"),
        (json!({"input": [{"type": "input_image"}]}), "input[0].type"),
        (json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}), "input[0].content[0]"),
        (json!({"input": [{"content": "x"}]}), "input[0].role"),
        (json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}), "input[0].call_id"),
        (json!({"input": [{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]}), "input[0].output"),
        (json!({"input": "x", "text": {"verbosity": "low"}}), "text.verbosity"),
        (json!({"input": "x", "text": {"format": {"type": "grammar"}}}), "text.format.type"),
        (json!({"input": "x", "tools": [{"type": "file_search"}]}), "tools[0].type"),
        (json!({"input": "x", "tool_choice": {"type": "function"}}), "tool_choice.name"),
        (json!({"input": "x", "tool_choice": 3}), "tool_choice"),
        (json!({"input": "x", "include": ["reasoning.encrypted_content"]}), "include[0]"),
        (json!({"input": "x", "top_logprobs": 2}), "top_logprobs"),
    ];
    for (body, param) in cases {
        assert_eq!(refused(body.clone()), param, "{body}");
    }
    // The chat endpoint's own errors, renamed.
    let rename = |p: &str| renamed(ApiError::invalid(p, "x")).param.unwrap();
    assert_eq!(rename("messages[2].role"), "input");
    assert_eq!(rename("max_tokens"), "max_output_tokens");
    assert_eq!(rename("response_format"), "text.format");
    assert_eq!(rename("tools[1].function.name"), "tools[1].name");
    assert_eq!(rename("tool_choice.function.name"), "tool_choice.name");
    assert_eq!(rename("temperature"), "temperature");
}

fn shape(tools: Option<ToolCalling>) -> Shape {
    Shape { id: "resp_ab12".into(), created_at: 1, model: "m".into(), echo: echo(&json!({"input": "x"})), tools, logprobs: false, prompt_tokens: 7 }
}

fn finish(reason: FinishReason, n: usize) -> Finish {
    Finish { reason, stop_reason: (reason == FinishReason::Stop).then_some(StopReason::Token(2)), completion_tokens: n, cached_tokens: 4 }
}

/// Feeds `pieces` and the finish to a streamer; returns its events (checked numbered in order).
fn run(s: &mut Streamer, pieces: &[&str], f: &Finish) -> Vec<Value> {
    let mut events = s.start();
    for p in pieces {
        events.extend(s.delta(p, &[]));
    }
    events.extend(s.finish(f));
    let events: Vec<Value> = events.into_iter().map(|(kind, e)| {
        assert_eq!(e["type"], kind);
        e
    }).collect();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i, "{e}");
    }
    events
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

/// Items without their random ids.
fn without_ids(mut items: Value) -> Value {
    for item in items.as_array_mut().unwrap() {
        item.as_object_mut().unwrap().remove("id");
    }
    items
}

#[test]
fn streamed_text_adds_up_to_the_whole_response() {
    for (reason, status, last) in [(FinishReason::Stop, "completed", "response.completed"), (FinishReason::Length, "incomplete", "response.incomplete")] {
        let f = finish(reason, 3);
        let mut s = Streamer::new(shape(None));
        let events = run(&mut s, &["Hel", "", "lo, ", "world"], &f);
        assert_eq!(
            types(&events),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                last,
            ]
        );
        assert_eq!(events[0]["response"]["status"], "in_progress");
        let text: String = events.iter().filter(|e| e["type"] == "response.output_text.delta").map(|e| e["delta"].as_str().unwrap()).collect();
        assert_eq!(text, "Hello, world");
        let done = &events[events.len() - 1]["response"];
        assert_eq!(done["status"], status);
        assert_eq!(done["usage"], json!({"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10}));
        let whole = shape(None).response(shape(None).output("Hello, world", &[], &f), Some(&f));
        assert_eq!(without_ids(done["output"].clone()), without_ids(whole["output"].clone()));
        assert_eq!(whole["output"][0]["status"], status);
        // An empty answer is still one (empty) message.
        let events = run(&mut Streamer::new(shape(None)), &[], &f);
        assert_eq!(events.last().unwrap()["response"]["output"][0]["content"][0]["text"], "");
    }
}

#[test]
fn streamed_calls_go_out_as_items_as_they_are_written() {
    let body = json!({"tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]});
    let tools = || ToolCalling::from_request(&body, ToolParser::Hermes).unwrap();
    let f = finish(FinishReason::Stop, 20);
    let pieces = ["Let me look.", " <tool", "_call>\n{\"name\": \"get_time\", ", "\"arguments\": {}}\n</tool_call>"];
    let events = run(&mut Streamer::new(shape(tools())), &pieces, &f);
    let text: String = events.iter().filter(|e| e["type"] == "response.output_text.delta").map(|e| e["delta"].as_str().unwrap()).collect();
    assert!(text.starts_with("Let me look.") && !text.contains('<'), "{text:?}");
    let done = &events.last().unwrap()["response"];
    let items = done["output"].as_array().unwrap();
    assert_eq!((items[0]["type"].as_str(), items[0]["content"][0]["text"].as_str()), (Some("message"), Some("Let me look.")));
    assert_eq!((items[1]["type"].as_str(), items[1]["name"].as_str(), items[1]["arguments"].as_str()), (Some("function_call"), Some("get_time"), Some("{}")));
    assert_eq!(items[1]["call_id"], "call_ab12-0");
    // The message closes when the call begins; the call's arguments stream as written.
    let at = |kind: &str, item: &str| events.iter().position(|e| e["type"] == kind && (e["item"]["type"] == item || item.is_empty())).unwrap();
    assert!(at("response.output_item.done", "message") < at("response.output_item.added", "function_call"));
    let streamed: String = events.iter().filter(|e| e["type"] == "response.function_call_arguments.delta").map(|e| e["delta"].as_str().unwrap()).collect();
    assert_eq!(streamed, "{}");
    let mut s = Streamer::new(shape(tools()));
    s.start();
    let early: Vec<String> = pieces[..3].iter().flat_map(|p| s.delta(p, &[])).map(|(k, _)| k).collect();
    assert!(early.contains(&"response.output_item.added".to_owned()), "the call's item is added once its name is written: {early:?}");
    let args: Vec<&Value> = events.iter().filter(|e| e["type"] == "response.function_call_arguments.done").collect();
    assert_eq!((args.len(), args[0]["output_index"].as_u64(), args[0]["arguments"].as_str()), (1, Some(1), Some("{}")));
    let whole = shape(tools()).output(&pieces.concat(), &[], &f);
    assert_eq!(without_ids(done["output"].clone()), without_ids(Value::Array(whole)));
    // Only a call: no message item at all.
    let events = run(&mut Streamer::new(shape(tools())), &pieces[1..], &f);
    assert!(!types(&events).contains(&"response.output_text.delta"), "{events:?}");
    assert_eq!(events.last().unwrap()["response"]["output"].as_array().unwrap().len(), 1);
    // Text that looked like a call and was not goes out at the end, as text.
    let events = run(&mut Streamer::new(shape(tools())), &["a <tool", "box>"], &f);
    let text: String = events.iter().filter(|e| e["type"] == "response.output_text.delta").map(|e| e["delta"].as_str().unwrap()).collect();
    assert_eq!(text, "a <toolbox>");
}

#[test]
fn output_indexes_follow_the_order_items_began_in() {
    // Llama 3 content held back (it opens with `{`) and a tagged call streamed first: the
    // message, opened at the end, comes after the call, in the events and in the output.
    let body = json!({"tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]});
    let tools = ToolCalling::from_request(&body, ToolParser::Llama3Json).unwrap();
    let f = finish(FinishReason::Stop, 9);
    let events = run(&mut Streamer::new(shape(tools)), &["{\"a\": 1}", " <|python_tag|>", "{\"name\": \"get_time\", ", "\"parameters\": {}}"], &f);
    let added: Vec<(u64, &str)> = events.iter().filter(|e| e["type"] == "response.output_item.added").map(|e| (e["output_index"].as_u64().unwrap(), e["item"]["type"].as_str().unwrap())).collect();
    assert_eq!(added, [(0, "function_call"), (1, "message")]);
    let output = &events.last().unwrap()["response"]["output"];
    assert_eq!((output[0]["type"].as_str(), output[1]["type"].as_str(), output[1]["content"][0]["text"].as_str()), (Some("function_call"), Some("message"), Some("{\"a\": 1}")));
    for e in events.iter().filter(|e| e.get("output_index").is_some()) {
        let item = e.get("item_id").or(e["item"].get("id")).unwrap();
        let at = e["output_index"].as_u64().unwrap() as usize;
        assert_eq!(&output[at]["id"], item, "{e}");
    }
}
