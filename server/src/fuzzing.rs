//! Entry points of the server's fuzz targets (`fuzz/fuzz_targets/`), also run over the stored
//! corpora by the replay tests (`tests/e2e/fuzz_corpus.rs`) in the ordinary test suite.
//!
//! Each takes arbitrary bytes and must return (an error is a fine answer) without panicking,
//! hanging or allocating without bound.

use crate::http::chat_template::{ChatMessage, ChatTemplate, RenderLimits};
use crate::http::json;
use crate::http::openai::tool_parsers::ToolParser;
use crate::http::openai::{chat, completions, responses};
use axum::body::Body;
use axum::response::IntoResponse;
use std::sync::OnceLock;
use serde_json::Value;
use tessera_engine::structured::Grammars;
use tessera_engine::tokenizer::Tokenizer;

/// Request bodies the target reads at most (the server's default `--max-body-bytes` is 8 MiB;
/// libFuzzer's inputs are far smaller).
const MAX_BODY: usize = 1 << 20;

/// Context length the request target validates against (the default model's).
const MAX_MODEL_LEN: usize = 8192;

/// What the request target needs of the default model: its tokenizer, chat template and
/// structured-output compiler.
pub struct RequestContext {
    tokenizer: &'static Tokenizer,
    template: ChatTemplate,
    grammars: Grammars,
    runtime: tokio::runtime::Runtime,
}

impl RequestContext {
    /// The default model's, built once ([`tessera_engine::default_model::for_tests`]).
    pub fn get() -> &'static RequestContext {
        static CTX: OnceLock<RequestContext> = OnceLock::new();
        CTX.get_or_init(|| {
            let tokenizer = tessera_engine::fuzzing::default_tokenizer();
            let special = tokenizer.special();
            let text = |id: Option<u32>| id.and_then(|id| tokenizer.id_to_token(id)).unwrap_or_default();
            let source = special.chat_template.as_deref().expect("the default model has a chat template");
            let template = ChatTemplate::new(source, &text(special.bos), &text(special.eos.first().copied()))
                .expect("the default model's chat template compiles");
            let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a tokio runtime");
            let grammars = Grammars::new(tokenizer, tokenizer.vocab_size()).expect("the default model's vocabulary suits llguidance");
            RequestContext { tokenizer, template, grammars, runtime }
        })
    }
}

/// A request body through the endpoints' parsing and validation up to the engine requests:
/// the first byte picks the endpoint (odd: `/v1/chat/completions`, 2 modulo 4:
/// `/v1/responses`, else `/v1/completions`) and, for chat and responses, the tool-call parser
/// (the byte halved, modulo their number), the rest is the body. Refusals become their JSON error response, as in the server.
pub fn openai_request(data: &[u8]) {
    let Some((&endpoint, body)) = data.split_first() else { return };
    let ctx = RequestContext::get();
    let value = ctx.runtime.block_on(json::read_object(Body::from(body.to_vec()), MAX_BODY));
    let result = value.and_then(|v| {
        let parser = ToolParser::SYNTAXES[usize::from(endpoint / 2) % ToolParser::SYNTAXES.len()];
        let chat = |v: &Value| chat::validate(v, "chatcmpl-fuzz", &ctx.template, parser, ctx.tokenizer, Ok(&ctx.grammars), MAX_MODEL_LEN).map(|v| v.reqs);
        if endpoint % 2 == 1 {
            chat(&v)
        } else if endpoint % 4 == 2 {
            responses::to_chat(&v).and_then(|c| chat(&c)).map_err(responses::renamed)
        } else {
            completions::validate(&v, "cmpl-fuzz", ctx.tokenizer, Ok(&ctx.grammars), MAX_MODEL_LEN).map(|v| v.reqs)
        }
    });
    match result {
        Ok(reqs) => {
            std::hint::black_box(reqs);
        }
        Err(e) => {
            std::hint::black_box(e.into_response());
        }
    }
}

/// Limits of the chat-template target: the server's depth limit, less fuel and output (the
/// same checks, reached sooner, so that hostile templates do not slow the fuzzer down).
pub const TEMPLATE_FUZZ_LIMITS: RenderLimits = RenderLimits { fuel: 50_000, max_output_bytes: 1 << 20, max_depth: 64 };

/// A template and a conversation through compilation and rendering: the input is
/// `template NUL role NUL content NUL role NUL content ...` (invalid UTF-8 replaced).
pub fn chat_template(data: &[u8]) -> Result<String, String> {
    let mut parts = data.split(|&b| b == 0).map(String::from_utf8_lossy);
    let source = parts.next().unwrap_or_default();
    let mut messages = Vec::new();
    while let Some(role) = parts.next() {
        let content = parts.next().unwrap_or_default().into_owned();
        let name = (role.len() % 7 == 6).then(|| "fuzz".to_owned());
        messages.push(ChatMessage { role: role.into_owned(), content, name, ..Default::default() });
    }
    let t = ChatTemplate::with_limits(&source, "<|endoftext|>", "<|im_end|>", TEMPLATE_FUZZ_LIMITS)?;
    let rendered = t.render(&messages, true, None, None)?;
    std::hint::black_box(t.without_duplicate_bos(&rendered, true));
    Ok(rendered)
}
