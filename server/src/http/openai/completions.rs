//! `POST /v1/completions`: prompts as text or token ids, `n` choices each, optional echo and
//! logprobs (prompt logprobs with echo: lm-eval-harness's log-likelihood requests).

use super::generation::{self, ChoiceOutput, ChunkShaper, Finish};
use super::logprobs::CompletionLogprobs;
use super::request::{refuse_set, CommonParams, DefaultMaxTokens, RequestShape, UNSUPPORTED};
use super::response::{stop_reason_json, Meta};
use super::structured;
use crate::http::errors::ApiError;
use crate::http::conn::PeerSocket;
use crate::http::{json, AppState};
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::response::Response;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::sync::Arc;
use std::time::Instant;
use tessera_engine::serve::{GenRequest, TokenLogprob};
use tessera_engine::structured::Grammars;
use tessera_engine::tokenizer::Tokenizer;


const OBJECT: &str = "text_completion";

/// Fields only the completions endpoint has.
#[derive(Debug, Deserialize)]
struct CompletionParams {
    prompt: Option<Value>,
    logprobs: Option<usize>,
    echo: Option<bool>,
    best_of: Option<usize>,
    suffix: Option<String>,
}

/// One prompt: its tokens and the text echoed for it.
#[derive(Debug, PartialEq)]
pub(crate) struct Prompt {
    ids: Vec<u32>,
    text: String,
}

/// A choice, in responses and in chunks.
#[derive(Debug, Serialize)]
struct Choice {
    index: usize,
    text: String,
    logprobs: Option<CompletionLogprobs>,
    finish_reason: Option<&'static str>,
    stop_reason: Value,
}

impl Choice {
    fn text(index: usize, text: String, logprobs: Option<CompletionLogprobs>) -> Self {
        Choice { index, text, logprobs, finish_reason: None, stop_reason: Value::Null }
    }
}

/// The handler.
pub async fn completions(State(state): State<Arc<AppState>>, peer: Option<Extension<PeerSocket>>, body: Body) -> Response {
    let started = Instant::now();
    let meta = Meta::new("cmpl", state.model_name());
    super::respond(meta.id.clone(), run(state, body, meta, started, peer.map(|Extension(p)| p))).await
}

async fn run(state: Arc<AppState>, body: Body, meta: Meta, started: Instant, peer: Option<PeerSocket>) -> Result<Response, ApiError> {
    let value = super::read_body(&state, body, started).await?;
    let (st, id) = (state.clone(), meta.id.clone());
    let v = super::off_the_runtime(move || {
        let engine = st.engine();
        validate(&value, &id, &engine.model().tokenizer, engine.grammars(), engine.info().max_model_len)
    })
    .await?;
    state.check_model(v.common.model.as_deref())?;
    let interrupts = super::Interrupts::new(&state, &v.common, started, peer)?;
    let prompt_tokens: usize = v.prompts.iter().map(|p| p.ids.len()).sum();
    super::log_request(&v.common, v.prompts.len(), v.reqs.len(), prompt_tokens);
    let choices = v.reqs.len();
    // Too many sequences for the queue: with one choice per prompt, the prompts are at fault.
    let events = generation::submit_all(state.engine(), v.reqs).map_err(|e| match e.param.as_deref() {
        Some("n") if v.n == 1 => ApiError { param: Some("prompt".into()), ..e },
        _ => e,
    })?;
    let texts = v.prompts.into_iter().map(|p| p.text).collect();
    let shaper = Shaper { n: v.n, echo: v.echo, logprobs: v.logprobs, prompt_texts: texts, offsets: vec![0; choices] };
    super::deliver(shaper, meta, events, choices, prompt_tokens, &v.common, interrupts).await
}

/// A completions body checked and turned into engine requests: what the handler submits,
/// and what the `openai_request` fuzz target exercises ([`crate::fuzzing`]).
pub(crate) struct Validated {
    /// The parameters completions share with chat.
    pub common: CommonParams,
    /// Choices per prompt.
    pub n: usize,
    /// Whether the prompt is echoed before each choice.
    pub echo: bool,
    /// Whether logprobs were asked for.
    pub logprobs: bool,
    /// The prompts, as text and tokens.
    pub prompts: Vec<Prompt>,
    /// One engine request per (prompt, choice).
    pub reqs: Vec<GenRequest>,
}

/// Checks a completions body (parsed JSON) and builds its engine requests, ids from `id`.
pub(crate) fn validate(value: &Value, id: &str, tok: &Tokenizer, grammars: Result<&Grammars, &str>, max_model_len: usize) -> Result<Validated, ApiError> {
    let common: CommonParams = json::fields(value)?;
    let own: CompletionParams = json::fields(value)?;
    refuse_set(value, &UNSUPPORTED)?;
    if own.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let n = common.n()?;
    if own.best_of.is_some_and(|b| b != n) {
        return Err(ApiError::invalid("best_of", "best_of must equal n: ranking extra candidates is not supported"));
    }
    let echo = own.echo.unwrap_or(false);
    let prompts = parse_prompts(own.prompt.as_ref(), tok)?;
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| p.ids.clone()).collect();
    let guide = structured::guide(value, grammars)?;
    let shape = RequestShape {
        guide: guide.as_ref(),
        max_model_len,
        logprobs: own.logprobs,
        prompt_logprobs: own.logprobs.filter(|_| echo),
        default_max_tokens: DefaultMaxTokens::Fixed(16),
    };
    let reqs = common.requests(id, &ids, shape)?;
    Ok(Validated { common, n, echo, logprobs: own.logprobs.is_some(), prompts, reqs })
}

fn parse_prompts(v: Option<&Value>, tok: &Tokenizer) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
        )
    };
    let text = |s: &str| -> Result<Prompt, ApiError> {
        let ids = tok.encode(s).map_err(|e| ApiError::invalid("prompt", format!("tokenizing the prompt failed: {e}")))?;
        Ok(Prompt { ids, text: s.to_owned() })
    };
    let ids = |items: &[Value]| -> Result<Prompt, ApiError> {
        let ids = items
            .iter()
            .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| ApiError::invalid("prompt", "prompt token ids must be non-negative 32-bit integers"))?;
        Ok(Prompt { text: tok.decode(&ids), ids })
    };
    match v.ok_or_else(|| ApiError::invalid("prompt", "prompt is required"))? {
        Value::String(s) => Ok(vec![text(s)?]),
        Value::Array(items) if items.is_empty() => Err(ApiError::invalid("prompt", "prompt must not be an empty list")),
        Value::Array(items) if items[0].is_number() => Ok(vec![ids(items)?]),
        Value::Array(items) => items
            .iter()
            .map(|x| match x {
                Value::String(s) => text(s),
                Value::Array(l) => ids(l),
                _ => Err(bad()),
            })
            .collect(),
        _ => Err(bad()),
    }
}

/// Shapes choices: choice `i` answers prompt `i / n`.
struct Shaper {
    n: usize,
    echo: bool,
    logprobs: bool,
    prompt_texts: Vec<String>,
    /// Per choice: character offset of the next token in the choice's text so far.
    offsets: Vec<usize>,
}

impl Shaper {
    fn echoed(&self, i: usize) -> String {
        if self.echo {
            self.prompt_texts[i / self.n].clone()
        } else {
            String::new()
        }
    }

    fn finished(i: usize, f: &Finish, text: String, logprobs: Option<CompletionLogprobs>) -> Choice {
        Choice { finish_reason: Some(f.reason.as_str()), stop_reason: stop_reason_json(f.stop_reason.as_ref()), ..Choice::text(i, text, logprobs) }
    }
}

impl ChunkShaper for Shaper {
    type Choice = Choice;
    const OBJECT: &'static str = OBJECT;
    type Whole = Choice;
    const WHOLE_OBJECT: &'static str = OBJECT;

    /// A non-streamed choice.
    fn whole(&self, i: usize, o: ChoiceOutput) -> Choice {
        let logprobs = self.logprobs.then(|| {
            let mut offset = 0;
            let mut l = CompletionLogprobs::default();
            if self.echo {
                l.extend(o.prompt_logprobs.as_deref().unwrap_or_default(), &mut offset);
            }
            l.extend(&o.tokens, &mut offset);
            l
        });
        let finish = o.finish.expect("collected choices are finished");
        Self::finished(i, &finish, self.echoed(i) + &o.text, logprobs)
    }

    fn start(&mut self, i: usize) -> Option<Choice> {
        // With logprobs the echo waits for the prompt's logprobs.
        (self.echo && !self.logprobs).then(|| Choice::text(i, self.echoed(i), None))
    }

    fn prompt_logprobs(&mut self, i: usize, logprobs: Vec<TokenLogprob>) -> Option<Choice> {
        let lists = CompletionLogprobs::of(&logprobs, &mut self.offsets[i]);
        self.echo.then(|| Choice::text(i, self.echoed(i), Some(lists)))
    }

    fn delta(&mut self, i: usize, text: String, tokens: Vec<TokenLogprob>) -> Option<Choice> {
        if text.is_empty() && (tokens.is_empty() || !self.logprobs) {
            return None;
        }
        let lists = self.logprobs.then(|| CompletionLogprobs::of(&tokens, &mut self.offsets[i]));
        Some(Choice::text(i, text, lists))
    }

    fn finish(&mut self, i: usize, f: Finish) -> Choice {
        Self::finished(i, &f, String::new(), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tessera_engine::serve::FinishReason;

    fn tokenizer() -> &'static Tokenizer {
        tessera_engine::fuzzing::default_tokenizer()
    }

    #[test]
    fn prompt_forms() {
        let tok = tokenizer();
        let hello = tok.encode("Hello").unwrap();
        let p = parse_prompts(Some(&json!("Hello")), tok).unwrap();
        assert_eq!(p, vec![Prompt { ids: hello.clone(), text: "Hello".into() }]);
        let p = parse_prompts(Some(&json!(["Hello", "Hi"])), tok).unwrap();
        assert_eq!((p.len(), p[1].text.as_str()), (2, "Hi"));
        let p = parse_prompts(Some(&json!(hello)), tok).unwrap();
        assert_eq!((p[0].ids.clone(), p[0].text.as_str()), (hello.clone(), "Hello"));
        let p = parse_prompts(Some(&json!([hello, [1, 2]])), tok).unwrap();
        assert_eq!(p[1].ids, vec![1, 2]);
        for bad in [json!(null), json!(3), json!([]), json!([1.5]), json!([-1]), json!([[1], {}]), json!([4294967296u64])] {
            let e = parse_prompts(Some(&bad), tok).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("prompt")), "{bad}");
        }
        assert_eq!(parse_prompts(None, tok).unwrap_err().message, "prompt is required");
    }

    fn tok(text: &str, lp: f32) -> TokenLogprob {
        TokenLogprob { id: 1, text: text.into(), logprob: Some(lp), top: vec![] }
    }

    fn shaper(echo: bool, logprobs: bool) -> Shaper {
        Shaper { n: 2, echo, logprobs, prompt_texts: vec!["P0".into(), "P1".into()], offsets: vec![0; 4] }
    }

    fn finish() -> Finish {
        Finish { reason: FinishReason::Length, stop_reason: None, completion_tokens: 2, cached_tokens: 0 }
    }

    #[test]
    fn whole_choice_with_echo_and_logprobs() {
        let out = ChoiceOutput {
            prompt_logprobs: Some(vec![TokenLogprob { logprob: None, ..tok("P1", 0.0) }]),
            text: "ab".into(),
            tokens: vec![tok("a", -1.0), tok("b", -2.0)],
            finish: Some(finish()),
        };
        // Choice 3 answers prompt 1 (n = 2).
        let c = serde_json::to_value(shaper(true, true).whole(3, out.clone())).unwrap();
        assert_eq!(c["text"], "P1ab");
        assert_eq!(c["index"], 3);
        assert_eq!(c["finish_reason"], "length");
        assert_eq!(c["logprobs"]["tokens"], json!(["P1", "a", "b"]));
        assert_eq!(c["logprobs"]["token_logprobs"], json!([null, -1.0, -2.0]));
        assert_eq!(c["logprobs"]["text_offset"], json!([0, 2, 3]));
        let plain = serde_json::to_value(shaper(false, false).whole(0, out)).unwrap();
        assert_eq!((plain["text"].clone(), plain["logprobs"].clone()), (json!("ab"), Value::Null));
    }

    #[test]
    fn streamed_chunks_continue_offsets_and_echo_first() {
        let mut s = shaper(true, true);
        assert!(s.start(0).is_none(), "echo waits for prompt logprobs");
        let first = s.prompt_logprobs(0, vec![TokenLogprob { logprob: None, ..tok("P0", 0.0) }]).unwrap();
        assert_eq!(first.text, "P0");
        let d = s.delta(0, "a".into(), vec![tok("a", -1.0)]).unwrap();
        assert_eq!(d.logprobs.unwrap().text_offset, vec![2]);
        assert!(s.delta(0, String::new(), vec![]).is_none());
        // Held-back text (a possible stop string) still reports its token's logprob.
        let held = s.delta(0, String::new(), vec![tok("#", -0.5)]).unwrap();
        assert_eq!(held.logprobs.unwrap().text_offset, vec![3]);
        let f = serde_json::to_value(s.finish(0, finish())).unwrap();
        assert_eq!((f["text"].clone(), f["finish_reason"].clone()), (json!(""), json!("length")));
        let mut no_lp = shaper(true, false);
        assert_eq!(no_lp.start(2).unwrap().text, "P1");
        assert!(no_lp.delta(2, String::new(), vec![tok("#", -0.5)]).is_none());
    }
}
