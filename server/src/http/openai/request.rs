//! Parameters both generation endpoints take (OpenAI's plus vLLM's extensions), their
//! validation, and how they become engine requests.

use crate::http::errors::ApiError;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use std::fmt;
use std::time::Duration;
use tessera_engine::sample::SamplingParams;
use tessera_engine::serve::GenRequest;
use tessera_engine::structured::Guide;

/// Most choices one request may ask for (`n`).
pub const MAX_N: usize = 128;

/// Parameters shared by `/v1/completions` and `/v1/chat/completions` (unknown fields are ignored,
/// as OpenAI-compatible servers do).
#[derive(Debug, Default, Deserialize)]
pub struct CommonParams {
    /// Served model name (may be omitted).
    pub model: Option<String>,
    /// Choices per prompt.
    pub n: Option<usize>,
    /// Answer as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Stop strings (never emitted).
    pub stop: Option<StopStrings>,
    /// Token ids that end generation.
    pub stop_token_ids: Option<Vec<u32>>,
    /// RNG seed (choice `i` uses `seed + i`).
    pub seed: Option<u64>,
    /// Sampling temperature (default 1; 0 is greedy).
    pub temperature: Option<f32>,
    /// Nucleus sampling threshold.
    pub top_p: Option<f32>,
    /// Top-k (`-1` or `0`: off).
    pub top_k: Option<i64>,
    /// Min-p.
    pub min_p: Option<f32>,
    /// Presence penalty.
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// Repetition penalty (1: off).
    pub repetition_penalty: Option<f32>,
    /// Keep generating past EOS.
    pub ignore_eos: Option<bool>,
    /// EOS and stop strings are ignored until this many tokens are generated.
    pub min_tokens: Option<usize>,
    /// End-user id (logged only).
    pub user: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<usize>,
    /// Seconds the request may take, from its arrival to its last token (an extension, as
    /// vLLM's are; at most the server's `--request-timeout-secs` when that is set).
    pub request_timeout: Option<f64>,
}

/// Fields of vLLM's generation requests that would change the output and are not supported
/// (refused when set, see [`refuse_set`]).
pub const UNSUPPORTED: [&str; 9] = [
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "include_stop_str_in_output",
    "use_beam_search",
    "length_penalty",
    "truncate_prompt_tokens",
    "prompt_logprobs",
    "logits_processors",
];

/// A 400 naming the first of `fields` the body sets (to anything but null, false or an empty
/// list or object): fields a client may send that Tessera does not honour.
pub fn refuse_set(value: &Value, fields: &[&str]) -> Result<(), ApiError> {
    let set = |v: &Value| match v {
        Value::Null | Value::Bool(false) => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => true,
    };
    match fields.iter().find(|f| value.get(**f).is_some_and(set)) {
        Some(f) => Err(ApiError::invalid(*f, format!("{f} is not supported"))),
        None => Ok(()),
    }
}

/// Longest `request_timeout` accepted (seconds).
pub const MAX_REQUEST_TIMEOUT: f64 = 1e6;

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `usage: null` on the others).
    pub include_usage: Option<bool>,
}

/// `stop`: one string or a list of strings.
#[derive(Debug, Default, PartialEq)]
pub struct StopStrings(pub Vec<String>);

impl<'de> Deserialize<'de> for StopStrings {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StopStrings;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of strings")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<StopStrings, E> {
                Ok(StopStrings(vec![s.to_owned()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<StopStrings, A::Error> {
                let mut v = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    v.push(s);
                }
                Ok(StopStrings(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// What each endpoint decides on top of [`CommonParams`] for its requests.
#[derive(Clone, Copy, Debug)]
pub struct RequestShape<'a> {
    /// The engine's context length (chat's default `max_tokens` is what the prompt leaves of it;
    /// the engine checks prompt + `max_tokens` against it).
    pub max_model_len: usize,
    /// Top alternatives per generated token (`None`: no logprobs).
    pub logprobs: Option<usize>,
    /// Top alternatives per prompt token (`None`: no prompt logprobs).
    pub prompt_logprobs: Option<usize>,
    /// Tokens to generate when the request does not say.
    pub default_max_tokens: DefaultMaxTokens,
    /// The structured output's guide at its start (each choice gets a copy).
    pub guide: Option<&'a Guide>,
}

/// The default for `max_tokens`.
#[derive(Clone, Copy, Debug)]
pub enum DefaultMaxTokens {
    /// A fixed number (OpenAI's completions default is 16).
    Fixed(usize),
    /// What is left of the context after the prompt (chat's default).
    RestOfContext,
}

impl CommonParams {
    /// Choices per prompt, validated.
    pub fn n(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_N => Ok(n),
            n => Err(ApiError::invalid("n", format!("n must be between 1 and {MAX_N}, got {n}"))),
        }
    }

    /// How long the request may take: its `request_timeout`, at most `server` (the server's
    /// default and limit); `None`: no deadline.
    pub fn timeout(&self, server: Option<Duration>) -> Result<Option<Duration>, ApiError> {
        let Some(secs) = self.request_timeout else { return Ok(server) };
        if !(secs > 0.0 && secs <= MAX_REQUEST_TIMEOUT) {
            return Err(ApiError::invalid(
                "request_timeout",
                format!("request_timeout must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT}], got {secs}"),
            ));
        }
        let asked = Duration::from_secs_f64(secs);
        Ok(Some(server.map_or(asked, |s| s.min(asked))))
    }

    /// Whether the answer streams.
    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Whether a streamed answer ends with a usage chunk.
    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }

    /// Sampling parameters as asked (the seed is per choice; see [`Self::requests`]); their
    /// ranges are checked once, by the engine at submission (`SubmitError::Invalid`).
    pub fn sampling(&self, logprobs: Option<usize>) -> Result<SamplingParams, ApiError> {
        let top_k = match self.top_k.unwrap_or(0) {
            -1 | 0 => 0,
            k if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            k => return Err(ApiError::invalid("top_k", format!("top_k must be -1 (off) or positive, got {k}"))),
        };
        let d = SamplingParams::default();
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k,
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: self.seed,
            logprobs,
        };
        Ok(p)
    }

    /// Validated stop strings.
    fn stop(&self) -> Result<Vec<String>, ApiError> {
        let stop = self.stop.as_ref().map(|s| s.0.clone()).unwrap_or_default();
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "stop strings must not be empty"));
        }
        Ok(stop)
    }

    /// One engine request per (prompt, choice), choice index `prompt_index * n + i`; with a
    /// seed, choice `i` of each prompt samples with `seed + i`.
    pub fn requests(&self, id: &str, prompts: &[Vec<u32>], shape: RequestShape) -> Result<Vec<GenRequest>, ApiError> {
        let n = self.n()?;
        let sampling = self.sampling(shape.logprobs)?;
        let stop = self.stop()?;
        let min_tokens = self.min_tokens.unwrap_or(0);
        let ignore_eos = self.ignore_eos.unwrap_or(false);
        if shape.guide.is_some() {
            // The grammar decides when the output ends.
            for (param, set) in [("min_tokens", min_tokens > 0), ("ignore_eos", ignore_eos)] {
                if set {
                    return Err(ApiError::invalid(param, format!("{param} cannot be combined with a structured output")));
                }
            }
        }
        let mut out = Vec::with_capacity(prompts.len() * n);
        for prompt in prompts {
            let max_tokens = match (self.max_tokens, shape.default_max_tokens) {
                (Some(m), _) => m,
                (None, DefaultMaxTokens::Fixed(m)) => m,
                (None, DefaultMaxTokens::RestOfContext) => shape.max_model_len.saturating_sub(prompt.len()).max(1),
            };
            for i in 0..n {
                let mut sampling = sampling.clone();
                sampling.seed = self.seed.map(|s| s.wrapping_add(i as u64));
                let mut req = GenRequest::new(format!("{id}-{}", out.len()), prompt.clone(), sampling, max_tokens);
                req.min_tokens = min_tokens;
                req.stop = stop.clone();
                req.stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
                req.ignore_eos = ignore_eos;
                req.prompt_logprobs = shape.prompt_logprobs;
                req.guide = shape.guide.cloned();
                out.push(req);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::json::fields;
    use serde_json::json;

    const SHAPE: RequestShape = RequestShape {
        max_model_len: 100,
        logprobs: None,
        prompt_logprobs: None,
        default_max_tokens: DefaultMaxTokens::Fixed(16),
        guide: None,
    };

    fn parse(v: serde_json::Value) -> CommonParams {
        fields(&v).unwrap()
    }

    #[test]
    fn stop_accepts_a_string_or_a_list() {
        assert_eq!(parse(json!({"stop": "\n"})).stop.unwrap().0, vec!["\n"]);
        assert_eq!(parse(json!({"stop": ["a", "bc"]})).stop.unwrap().0, vec!["a", "bc"]);
        let e = fields::<CommonParams>(&json!({"stop": 3})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        assert!(e.message.contains("a string or a list of strings"), "{}", e.message);
        let e = fields::<CommonParams>(&json!({"stop": ["a", 3]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop[1]"));
        let e = parse(json!({"stop": ["a", ""]})).requests("x", &[vec![1]], SHAPE).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
    }

    #[test]
    fn defaults_follow_openai() {
        let reqs = parse(json!({})).requests("cmpl-1", &[vec![1, 2]], SHAPE).unwrap();
        assert_eq!(reqs.len(), 1);
        let r = &reqs[0];
        assert_eq!((r.id.as_str(), r.max_tokens, r.min_tokens, r.ignore_eos), ("cmpl-1-0", 16, 0, false));
        assert_eq!(r.sampling, SamplingParams::default());
        assert!(r.stop.is_empty() && r.stop_token_ids.is_empty() && r.prompt_logprobs.is_none());
    }

    #[test]
    fn every_parameter_reaches_the_engine_request() {
        let p = parse(json!({
            "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": 7, "stop": "END",
            "stop_token_ids": [5, 6], "ignore_eos": true, "min_tokens": 3, "max_tokens": 9
        }));
        let shape = RequestShape { logprobs: Some(2), prompt_logprobs: Some(2), ..SHAPE };
        let r = &p.requests("c", &[vec![1]], shape).unwrap()[0];
        let s = &r.sampling;
        assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p), (0.7, 0.9, 40, 0.05));
        assert_eq!((s.presence_penalty, s.frequency_penalty, s.repetition_penalty), (0.5, -0.5, 1.1));
        assert_eq!((s.seed, s.logprobs, r.prompt_logprobs), (Some(7), Some(2), Some(2)));
        assert_eq!((r.stop.clone(), r.stop_token_ids.clone()), (vec!["END".to_string()], vec![5, 6]));
        assert_eq!((r.ignore_eos, r.min_tokens, r.max_tokens), (true, 3, 9));
    }

    #[test]
    fn choices_are_prompt_major_with_per_choice_seeds() {
        let p = parse(json!({"n": 3, "seed": 10}));
        let reqs = p.requests("c", &[vec![1], vec![2, 3]], SHAPE).unwrap();
        let got: Vec<_> = reqs.iter().map(|r| (r.id.as_str(), r.prompt.len(), r.sampling.seed)).collect();
        assert_eq!(
            got,
            vec![
                ("c-0", 1, Some(10)),
                ("c-1", 1, Some(11)),
                ("c-2", 1, Some(12)),
                ("c-3", 2, Some(10)),
                ("c-4", 2, Some(11)),
                ("c-5", 2, Some(12)),
            ]
        );
        let unseeded = parse(json!({"n": 2})).requests("c", &[vec![1]], SHAPE).unwrap();
        assert!(unseeded.iter().all(|r| r.sampling.seed.is_none()));
    }

    #[test]
    fn rest_of_context_default() {
        let shape = RequestShape { max_model_len: 10, default_max_tokens: DefaultMaxTokens::RestOfContext, ..SHAPE };
        let p = parse(json!({}));
        assert_eq!(p.requests("c", &[vec![1, 2, 3]], shape).unwrap()[0].max_tokens, 7);
        // A prompt that fills the context still asks for one token, so the engine reports it too long.
        assert_eq!(p.requests("c", &[vec![0; 10]], shape).unwrap()[0].max_tokens, 1);
    }

    #[test]
    fn invalid_values_name_their_parameter() {
        let cases = [
            (json!({"n": 0}), "n"),
            (json!({"n": MAX_N + 1}), "n"),
            (json!({"top_k": -2}), "top_k"),
        ];
        for (body, param) in cases {
            let e = parse(body.clone()).requests("c", &[vec![1]], SHAPE).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}");
        }
        // Ranges (temperature, top_p, logprobs, min_tokens against max_tokens, the context...)
        // are the engine's to check, once, at submission: the e2e tests send each one.
        let r = parse(json!({"temperature": -1.0, "min_tokens": 20, "max_tokens": 10})).requests("c", &[vec![1]], SHAPE).unwrap();
        assert_eq!((r[0].sampling.temperature, r[0].min_tokens, r[0].max_tokens), (-1.0, 20, 10));
        for (body, param) in [(json!({"n": -1}), "n"), (json!({"seed": "x"}), "seed"), (json!({"stream": 1}), "stream")] {
            assert_eq!(fields::<CommonParams>(&body).unwrap_err().param.as_deref(), Some(param));
        }
    }

    #[test]
    fn request_timeouts_are_validated_and_capped_by_the_server() {
        let secs = |v: serde_json::Value, server: Option<u64>| parse(v).timeout(server.map(Duration::from_secs));
        assert_eq!(secs(json!({}), None).unwrap(), None);
        assert_eq!(secs(json!({}), Some(5)).unwrap(), Some(Duration::from_secs(5)));
        assert_eq!(secs(json!({"request_timeout": 2.5}), None).unwrap(), Some(Duration::from_millis(2500)));
        assert_eq!(secs(json!({"request_timeout": 60}), Some(5)).unwrap(), Some(Duration::from_secs(5)));
        for bad in [json!(0), json!(-1), json!(1e7)] {
            let e = secs(json!({"request_timeout": bad}), None).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("request_timeout")), "{bad}");
        }
        let e = fields::<CommonParams>(&json!({"request_timeout": "soon"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("request_timeout"));
    }

    #[test]
    fn set_unsupported_fields_are_named() {
        assert!(refuse_set(&json!({"logit_bias": {}, "bad_words": [], "use_beam_search": false, "x": null}), &UNSUPPORTED).is_ok());
        for body in [json!({"logit_bias": {"5": 10}}), json!({"prompt_logprobs": 0})] {
            let e = refuse_set(&body, &UNSUPPORTED).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, body.as_object().unwrap().keys().next().map(String::as_str)));
        }
    }

    #[test]
    fn stream_flags() {
        let p = parse(json!({"stream": true, "stream_options": {"include_usage": true}}));
        assert!(p.stream() && p.include_usage());
        assert!(!parse(json!({})).stream() && !parse(json!({"stream_options": {}})).include_usage());
    }
}
