//! Each syntax: finished outputs with 0, 1 and 2 calls (and random ones) parse back to the
//! calls written, anything else stays content, streaming holds back every prefix of a call's
//! start and never lets a call out as content, and the forced-call grammars compile with
//! llguidance over the default model's vocabulary and produce calls that parse back and match
//! the tools' schemas.

use super::*;
use crate::http::openai::tools::ToolCalling;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_engine::fuzzing::{default_tokenizer, default_tokenizer_with_special};
use tessera_engine::tokenizer::Tokenizer;
use tessera_engine::structured::{Constraint, Grammars};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        }, "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "additionalProperties": false}}},
        {"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object", "properties": {
            "at": {"type": "object", "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["h"], "additionalProperties": false},
            "loud": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["work", "home"]}, "maxItems": 2},
        }, "required": ["at"], "additionalProperties": false}}},
    ])
}

fn calling(p: ToolParser, choice: Value) -> ToolCalling {
    let body = json!({"tools": tools(), "tool_choice": choice});
    ToolCalling::from_request(&body, p).unwrap().unwrap()
}

/// `calls` written in `p`'s syntax, as its models write them.
fn render(p: ToolParser, calls: &[(&str, Value)]) -> String {
    let objects = |key: &str| calls.iter().map(|(n, a)| json!({"name": n, key: a})).collect::<Vec<_>>();
    match p {
        ToolParser::Hermes => objects("arguments").iter().map(|o| format!("<tool_call>\n{o}\n</tool_call>")).collect::<Vec<_>>().join("\n"),
        ToolParser::Llama3Json => format!("<|python_tag|>{}", objects("parameters").iter().map(Value::to_string).collect::<Vec<_>>().join("; ")),
        ToolParser::Mistral => format!("[TOOL_CALLS] {}", Value::Array(objects("arguments"))),
        ToolParser::MistralArgs => calls.iter().map(|(n, a)| format!("[TOOL_CALLS]{n}[ARGS]{a}")).collect(),
        ToolParser::Qwen3Coder => calls
            .iter()
            .map(|(n, a)| {
                let params: String = a
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| format!("<parameter={k}>\n{}\n</parameter>\n", v.as_str().map_or_else(|| v.to_string(), str::to_owned)))
                    .collect();
                format!("<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
            })
            .collect::<Vec<_>>()
            .join("\n"),
    }
}

/// The parsed calls as (name, arguments as JSON).
fn parsed(t: &ToolCalling, text: &str) -> (Option<String>, Vec<(String, Value)>) {
    let (content, calls) = t.parse(text, "c");
    let calls = calls.into_iter().map(|c| (c.function.name, serde_json::from_str(&c.function.arguments).unwrap())).collect();
    (content, calls)
}

fn owned(calls: &[(&str, Value)]) -> Vec<(String, Value)> {
    calls.iter().map(|(n, a)| (n.to_string(), a.clone())).collect()
}

#[test]
fn outputs_with_no_one_or_two_calls_parse_and_text_before_is_content() {
    let weather = ("get_weather", json!({"city": "42", "unit": "celsius", "days": 3}));
    let alarm = ("set_alarm", json!({"at": {"h": 7}, "loud": true, "tags": ["work"]}));
    for p in ToolParser::SYNTAXES {
        let t = calling(p, json!("auto"));
        assert_eq!(parsed(&t, "Just text."), (Some("Just text.".into()), vec![]), "{p}");
        assert_eq!(parsed(&t, ""), (None, vec![]), "{p}");
        for calls in [vec![weather.clone()], vec![weather.clone(), alarm.clone()], vec![("get_time", json!({}))]] {
            let text = render(p, &calls);
            assert_eq!(parsed(&t, &text), (None, owned(&calls)), "{p}: {text}");
            let text = format!("Let me check.\n{text}\n");
            assert_eq!(parsed(&t, &text), (Some("Let me check.".into()), owned(&calls)), "{p}: {text}");
        }
    }
}

#[test]
fn syntax_variants_each_model_family_writes() {
    let t = calling(ToolParser::Llama3Json, json!("auto"));
    let bare = "{\"name\": \"get_time\", \"arguments\": {}} ; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"unit\": \"celsius\"}}";
    assert_eq!(parsed(&t, bare), (None, owned(&[("get_time", json!({})), ("get_weather", json!({"city": "Oslo", "unit": "celsius"}))])));
    // Mistral's arguments may be a JSON text; it is passed on as written.
    let t = calling(ToolParser::Mistral, json!("auto"));
    let (_, calls) = t.parse("[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": \"{\\\"zone\\\": 1}\"}]", "c");
    assert_eq!(calls[0].function.arguments, "{\"zone\": 1}");
    // Mistral v11+ writes name and arguments apart, v13 with a call id of its own between;
    // either Mistral parser reads both forms.
    for p in [ToolParser::Mistral, ToolParser::MistralArgs] {
        let t = calling(p, json!("auto"));
        let text = "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{} [TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\", \"unit\": \"celsius\"}";
        assert_eq!(parsed(&t, text).1, owned(&[("get_time", json!({})), ("get_weather", json!({"city": "Rome", "unit": "celsius"}))]), "{p:?}");
        assert_eq!(parsed(&t, "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}}]").1, owned(&[("get_time", json!({}))]), "{p:?}");
    }
    // Qwen3-Coder: text stays text where the schema says string (or says nothing), typed
    // values are JSON, and a typed value that is not JSON is kept as text.
    let t = calling(ToolParser::Qwen3Coder, json!("auto"));
    let text = "<tool_call>\n<function=set_alarm>\n<parameter=at>\n{\"h\": 5}\n</parameter>\n<parameter=loud>\nmaybe\n</parameter>\n<parameter=note>\n[1]\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(parsed(&t, text).1, owned(&[("set_alarm", json!({"at": {"h": 5}, "loud": "maybe", "note": "[1]"}))]));
}

#[test]
fn malformed_calls_unknown_tools_and_text_after_stay_content() {
    let cases: [(ToolParser, &[&str]); 5] = [
        (ToolParser::Hermes, &["<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}", "<tool_call>{\"name\": \"get_time\", \"arguments\": {}</tool_call>"]),
        (
            ToolParser::Llama3Json,
            &[
                "{\"name\": \"get_time\", \"parameters\": {}",
                "{\"value\": 3}",
                "<|python_tag|>{\"name\": \"get_time\", \"parameters\": {}};",
                "Here: {\"name\": \"get_time\", \"parameters\": {}}",
            ],
        ),
        (ToolParser::Mistral, &["[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}}", "[TOOL_CALLS]{\"name\": \"get_time\", \"arguments\": {}}", "[TOOL_CALLS][3]"]),
        (ToolParser::MistralArgs, &["[TOOL_CALLS]get_time[ARGS]{", "[TOOL_CALLS]get_time{}", "[TOOL_CALLS]get_time[ARGS]{} get_time[ARGS]{}"]),
        (
            ToolParser::Qwen3Coder,
            &[
                "<tool_call>\n<function=get_time>\n</tool_call>",
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
                "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
            ],
        ),
    ];
    for (p, bad) in cases {
        let t = calling(p, json!("auto"));
        let unknown = render(p, &[("rm_rf", json!({}))]);
        let after = format!("{} and then text", render(p, &[("get_time", json!({}))]));
        for text in bad.iter().copied().chain([unknown.as_str(), after.as_str()]) {
            assert_eq!(t.parse(text, "c"), (Some(text.to_owned()), vec![]), "{p}: {text}");
        }
    }
}

#[test]
fn streaming_holds_back_every_prefix_of_a_call_start() {
    for p in ToolParser::SYNTAXES {
        let marker = p.marker();
        for k in 1..=marker.len() {
            let text = format!("Hi {}", &marker[..k]);
            assert_eq!(p.streamable(&text, 0), 3, "{p}: {text:?}");
            assert_eq!(p.streamable(&text, 1), 3, "{p}: {text:?}");
            let broken = format!("{text}~");
            let expect = if k == marker.len() { 3 } else { broken.len() };
            assert_eq!(p.streamable(&broken, 0), expect, "{p}: {broken:?}");
        }
        assert_eq!(p.streamable("é", 0), "é".len(), "{p}");
    }
    // Llama 3 may answer with a bare JSON call: blank text and text opening with `{` wait.
    for text in ["", "  \n", "{", " {\"name\": \"get_time\"", "{\"a\": 1} and more"] {
        assert_eq!(ToolParser::Llama3Json.streamable(text, 0), 0, "{text:?}");
    }
    assert_eq!(ToolParser::Llama3Json.streamable(" a {", 0), 4);
}

/// A random string of characters that mean something to the syntaxes.
fn random_text(rng: &mut StdRng, max: usize) -> String {
    const CHARS: &[char] = &['a', 'Z', '7', ' ', 'é', '"', '\\', '{', '}', '[', ']', ';', ',', ':', '=', '>', '/'];
    (0..rng.gen_range(0..=max)).map(|_| CHARS[rng.gen_range(0..CHARS.len())]).collect()
}

/// One to three random calls of the test tools, with arguments valid against their schemas.
fn random_calls(rng: &mut StdRng) -> Vec<(&'static str, Value)> {
    (0..rng.gen_range(1..=3))
        .map(|_| match rng.gen_range(0..3) {
            0 => ("get_weather", json!({"city": random_text(rng, 12), "unit": "fahrenheit", "days": rng.gen_range(1..=7)})),
            1 => ("get_time", json!({})),
            _ => ("set_alarm", json!({"at": {"h": rng.gen_range(0..24)}, "tags": ["home"], "loud": rng.gen_bool(0.5)})),
        })
        .collect()
}

#[test]
fn random_calls_round_trip_and_never_stream_as_content() {
    let mut rng = StdRng::seed_from_u64(26);
    for round in 0..400 {
        let p = ToolParser::SYNTAXES[round % ToolParser::SYNTAXES.len()];
        let t = calling(p, json!("auto"));
        let calls = random_calls(&mut rng);
        // Content that cannot be taken for a call: no `<`, and not opening with `{`.
        let content = format!("x{}", random_text(&mut rng, 20).replace("[TOOL_CALLS]", "")).trim_end().to_owned();
        let text = format!("{content}\n{}", render(p, &calls));
        assert_eq!(parsed(&t, &text), (Some(content.clone()), owned(&calls)), "{p}: {text:?}");
        // Streamed in random pieces: what goes out never reaches into the calls.
        let (mut full, mut sent) = (String::new(), 0);
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(rng.gen_range(1..6)) {
            full.extend(piece);
            let upto = t.streamable(&full, sent);
            assert!(upto >= sent && upto <= content.len() + 1, "{p}: {full:?} streamed to {upto}");
            sent = upto;
        }
    }
}

fn grammars() -> &'static Grammars {
    static G: std::sync::OnceLock<Grammars> = std::sync::OnceLock::new();
    G.get_or_init(|| Grammars::new(default_tokenizer(), default_tokenizer().vocab_size()).unwrap())
}

/// A sentence of `c` drawn token by token at random from the allowed ones (ending when EOS
/// is allowed and drawn, or the grammar is complete).
fn sample(c: &Constraint, rng: &mut StdRng) -> String {
    sample_ids(c, rng, grammars(), default_tokenizer()).1
}

/// [`sample`] over `tok`'s vocabulary: the ids drawn and their text.
fn sample_ids(c: &Constraint, rng: &mut StdRng, grammars: &Grammars, tok: &Tokenizer) -> (Vec<u32>, String) {
    let eos = tok.special().eos[0];
    let mut guide = grammars.compile(c).unwrap_or_else(|e| panic!("{e}: {c:?}"));
    let mut ids = Vec::new();
    while !guide.is_complete() {
        assert!(ids.len() < 400, "no end in sight: {:?}", tok.decode(&ids));
        let allowed = guide.allowed().unwrap().to_list();
        if allowed.contains(&eos) && rng.gen_bool(0.5) {
            break;
        }
        let choices: Vec<u32> = allowed.into_iter().filter(|&id| id != eos).collect();
        let id = choices[rng.gen_range(0..choices.len())];
        guide.advance(id).unwrap();
        ids.push(id);
    }
    (ids.clone(), tok.decode(&ids))
}

/// Checks arguments against the test tools' schemas.
fn check_args(name: &str, args: &Value) {
    let o = args.as_object().unwrap_or_else(|| panic!("{name}: {args}"));
    match name {
        "get_weather" => {
            assert!(o["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{args}");
            assert!(["celsius", "fahrenheit"].contains(&o["unit"].as_str().unwrap()), "{args}");
            assert!(o.get("days").is_none_or(|d| d.as_i64().is_some_and(|d| (1..=7).contains(&d))), "{args}");
            assert!(o.keys().all(|k| ["city", "unit", "days"].contains(&k.as_str())), "{args}");
        }
        "get_time" => assert!(o.is_empty(), "{args}"),
        "set_alarm" => {
            assert!(o["at"]["h"].as_i64().is_some_and(|h| (0..24).contains(&h)), "{args}");
            assert!(o.get("loud").is_none_or(Value::is_boolean), "{args}");
            assert!(o.get("tags").is_none_or(|t| t.as_array().is_some_and(|t| t.len() <= 2 && t.iter().all(|x| x == "work" || x == "home"))), "{args}");
        }
        other => panic!("unknown tool {other}"),
    }
}

#[test]
fn forced_call_grammars_compile_and_their_sentences_parse_back() {
    let mut rng = StdRng::seed_from_u64(6);
    for p in ToolParser::SYNTAXES {
        for (choice, parallel) in [(json!("required"), true), (json!("required"), false), (json!({"type": "function", "function": {"name": "get_weather"}}), true)] {
            let body = json!({"tools": tools(), "tool_choice": choice, "parallel_tool_calls": parallel});
            let t = ToolCalling::from_request(&body, p).unwrap().unwrap();
            let c = t.constraint(default_tokenizer()).unwrap();
            for _ in 0..4 {
                let text = sample(&c, &mut rng);
                let (content, calls) = parsed(&t, &text);
                assert!(content.is_none() && !calls.is_empty(), "{p}: {text:?} -> {content:?} {calls:?}");
                assert!(parallel || calls.len() == 1, "{p}: {text:?}");
                for (name, args) in &calls {
                    assert!(choice.is_string() || name == "get_weather", "{p}: {text:?}");
                    check_args(name, args);
                }
            }
        }
    }
}

#[test]
fn names_parse_and_unknown_ones_list_the_valid() {
    for p in ToolParser::ALL {
        assert_eq!(p.name().parse::<ToolParser>(), Ok(p));
        assert_eq!(serde_json::to_value(p).unwrap(), p.name());
    }
    let e = "hermes2".parse::<ToolParser>().unwrap_err();
    assert!(e.contains("hermes, llama3_json, mistral, qwen3_coder"), "{e}");
}

#[test]
fn the_chat_template_picks_the_default() {
    let cases = [
        ("{{ '<tool_call>\\n<function=' + name }}", ToolParser::Qwen3Coder),
        ("<tool_call>\\n{{ tool_call | tojson }}\\n</tool_call>", ToolParser::Hermes),
        ("{{ '<|python_tag|>' }}", ToolParser::Llama3Json),
        ("{\"name\": function name, \"parameters\": ...} {% if role == 'ipython' %}", ToolParser::Llama3Json),
        ("[AVAILABLE_TOOLS] ... [TOOL_CALLS]", ToolParser::Mistral),
        ("[AVAILABLE_TOOLS] ... [TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}", ToolParser::MistralArgs),
        ("{{ messages }}", ToolParser::Hermes),
    ];
    for (template, want) in cases {
        assert_eq!(ToolParser::for_template(template), want, "{template}");
        // Named on the command line, Mistral still takes the template's form.
        assert_eq!(ToolParser::resolve(Some(ToolParser::Hermes), template), ToolParser::Hermes);
        let mistral = ToolParser::resolve(Some(ToolParser::Mistral), template);
        assert_eq!(mistral == ToolParser::MistralArgs, template.contains("[ARGS]"), "{template}");
    }
}

/// Accumulates streamed call chunks by index, as the openai client's users do: (id, name,
/// arguments) per call.
fn accumulate(deltas: &[crate::http::openai::tools::ToolCallDelta]) -> Vec<(String, String, String)> {
    let mut calls: Vec<(String, String, String)> = Vec::new();
    for d in deltas {
        if d.index == calls.len() {
            calls.push(Default::default());
        }
        let c = &mut calls[d.index];
        c.0 += d.id.as_deref().unwrap_or("");
        c.1 += d.function.name.as_deref().unwrap_or("");
        c.2 += &d.function.arguments;
    }
    calls
}

#[test]
fn arguments_stream_as_written_and_add_up_to_the_finished_calls() {
    use crate::http::openai::tools::CallsSent;
    let mut rng = StdRng::seed_from_u64(28);
    for round in 0..400 {
        let p = ToolParser::SYNTAXES[round % ToolParser::SYNTAXES.len()];
        let t = calling(p, json!("auto"));
        let calls = random_calls(&mut rng);
        // Spaces inside the JSON, as models write it.
        let text = format!("x\n{}", render(p, &calls).replace("\":", "\": ").replace(",\"", ", \""));
        let (_, whole) = t.parse(&text, "c");
        assert_eq!(whole.len(), calls.len(), "{p:?}: {text:?}");
        let (mut full, mut sent, mut deltas) = (String::new(), CallsSent::default(), Vec::new());
        let chars: Vec<char> = text.chars().collect();
        let mut begun_at = Vec::new();
        for piece in chars.chunks(rng.gen_range(1..8)) {
            full.extend(piece);
            let new = t.stream_calls(&full, &mut sent, "c");
            begun_at.extend(new.iter().filter(|d| d.id.is_some()).map(|_| full.len()));
            deltas.extend(new);
        }
        deltas.extend(ToolCalling::finish_calls(whole.clone(), &sent));
        let streamed = accumulate(&deltas);
        let expect: Vec<(String, String, String)> = whole.iter().map(|c| (c.id.clone(), c.function.name.clone(), c.function.arguments.clone())).collect();
        assert_eq!(streamed, expect, "{p:?}: {text:?}");
        // Calls went out while the text was being written, not all at the end (a first call
        // with arguments longer than a piece).
        assert!(!begun_at.is_empty(), "{p:?}: {text:?}");
        assert!(calls[0].0 == "get_time" || begun_at[0] < text.len(), "{p:?}: {text:?}");
    }
}

#[test]
fn markers_that_are_special_tokens_are_forced_as_those_tokens() {
    // A vocabulary where every syntax's markers are special tokens, as in Qwen's, Llama 3's
    // and Mistral's tokenizers.
    let markers = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]"];
    let tok = default_tokenizer_with_special(&markers);
    let ids: Vec<u32> = markers.iter().map(|m| tok.special_token_id(m).unwrap()).collect();
    assert!(ids.iter().all(|&id| id as usize >= default_tokenizer().vocab_size()), "{ids:?}");
    assert_eq!(tok.special_token_id("<|im_start|>"), default_tokenizer().special_token_id("<|im_start|>"));
    assert_eq!(tok.special_token_id("hello"), None);
    let grammars = Grammars::new(&tok, tok.vocab_size()).unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    for p in [ToolParser::Hermes, ToolParser::Qwen3Coder, ToolParser::Mistral, ToolParser::MistralArgs] {
        let t = calling(p, json!("required"));
        let Some(Constraint::Lark(g)) = t.constraint(&tok) else { panic!("{p:?}") };
        assert!(!markers.iter().any(|m| g.contains(&lit(m))), "{p:?} spells a marker out: {g}");
        for _ in 0..3 {
            let (drawn, text) = sample_ids(&Constraint::Lark(g.clone()), &mut rng, &grammars, &tok);
            // The call opens with the marker's one token, and the text parses back.
            assert!(ids.contains(&drawn[0]), "{p:?}: {text:?} opens with {}", drawn[0]);
            let (content, calls) = parsed(&t, &text);
            assert!(content.is_none() && !calls.is_empty(), "{p:?}: {text:?}");
            for (name, args) in &calls {
                check_args(name, args);
            }
        }
    }
}

#[test]
fn qwen3_coder_text_values_follow_their_pattern() {
    let body = json!({"tools": [{"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
        "note": {"type": "string", "pattern": "ok/fine", "maxLength": 12},
    }, "required": ["code", "note"]}}}], "tool_choice": "required", "parallel_tool_calls": false});
    let t = ToolCalling::from_request(&body, ToolParser::Qwen3Coder).unwrap().unwrap();
    let c = t.constraint(default_tokenizer()).unwrap();
    let code = regex::Regex::new("^[A-Z]{3}-[0-9]{2,4}$").unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..12 {
        let text = sample(&c, &mut rng);
        let (_, calls) = parsed(&t, &text);
        let args = &calls[0].1;
        assert!(code.is_match(args["code"].as_str().unwrap()), "{text:?}");
        let note = args["note"].as_str().unwrap();
        assert!(note.contains("ok/fine") && note.chars().count() <= 12 && !note.contains('<'), "{text:?}");
    }
    assert_eq!(searched("^ab$"), "(?:ab)");
    assert_eq!(searched("^a|b$"), ".*(?:^a|b$).*");
    assert_eq!(searched("x\\$"), ".*(?:x\\$).*");
}

#[test]
fn what_streamed_first_is_what_the_finished_text_is_read_as() {
    // Llama 3: an answer opening with a call is read from its start, even when a tag follows
    // (then it is not a call sequence at all: text follows the first call).
    let t = calling(ToolParser::Llama3Json, json!("auto"));
    let text = "{\"name\": \"get_time\", \"parameters\": {}}<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {}}";
    for end in (1..=text.len()).filter(|&e| text.is_char_boundary(e)) {
        let names: Vec<String> = ToolParser::Llama3Json.partial_calls(&text[..end], &[]).into_iter().map(|c| c.name).collect();
        assert!(names.is_empty() || names == ["get_time"], "{:?}: {names:?}", &text[..end]);
    }
    assert_eq!(t.parse(text, "c"), (Some(text.to_owned()), vec![]));
    // A JSON text opening the answer that is no call: the tagged calls count.
    let tagged = "{\"x\": 1} <|python_tag|>{\"name\": \"get_time\", \"parameters\": {}}";
    assert_eq!(parsed(&t, tagged), (Some("{\"x\": 1}".into()), owned(&[("get_time", json!({}))])));
    // The first `name` names the call, streamed or finished.
    let t = calling(ToolParser::Hermes, json!("auto"));
    let twice = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}, \"name\": \"get_weather\"}\n</tool_call>";
    assert_eq!(ToolParser::Hermes.partial_calls(twice, &[])[0].name, "get_time");
    assert_eq!(parsed(&t, twice).1, owned(&[("get_time", json!({}))]));
    // Mistral v11: arguments must be JSON as written (`1 2` is not `12`).
    let t = calling(ToolParser::MistralArgs, json!("auto"));
    for bad in ["[TOOL_CALLS]get_time[ARGS]{\"a\": 1 2}", "[TOOL_CALLS]get_time[ARGS]{\"a\": tr ue}"] {
        assert_eq!(t.parse(bad, "c"), (Some(bad.to_owned()), vec![]), "{bad}");
    }
}
