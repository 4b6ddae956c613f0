//! `POST /tokenize` and `POST /detokenize`: vLLM's tokenizer endpoints, for routers and
//! evaluation harnesses that count or align tokens without generating.
//!
//! `/tokenize` takes a `prompt` (tokenized as `/v1/completions` does) or `messages` with
//! optional `tools` (rendered and tokenized as `/v1/chat/completions` does) and answers `count`,
//! `max_model_len`, `tokens` and, with `return_token_strs`, `token_strs`. `/detokenize`
//! turns `tokens` back into `prompt`.

use super::chat::{self, Conversation, MessageIn};
use super::request::refuse_set;
use super::tools::ToolCalling;
use crate::http::errors::ApiError;
use crate::http::{json, AppState};
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;
use tessera_engine::tokenizer::Tokenizer;

#[derive(Debug, Deserialize)]
struct TokenizeParams {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<MessageIn>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    return_token_strs: Option<bool>,
}

#[derive(Debug, Serialize, PartialEq)]
struct Tokenized {
    count: usize,
    max_model_len: usize,
    tokens: Vec<u32>,
    token_strs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
struct DetokenizeParams {
    model: Option<String>,
    tokens: Option<Vec<u32>>,
}

#[derive(Debug, Serialize)]
struct Detokenized {
    prompt: String,
}

/// The `/tokenize` handler.
pub async fn tokenize(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let started = Instant::now();
    let id = format!("tokenize-{:032x}", rand::random::<u128>());
    super::respond(id, async move {
        let value = super::read_body(&state, body, started).await?;
        let p: TokenizeParams = json::fields(&value)?;
        state.check_model(p.model.as_deref())?;
        let tok = &state.engine().model().tokenizer;
        let tokens = match (p.prompt.as_deref(), p.messages.is_some()) {
            (Some(text), false) => {
                if value.get("tools").is_some_and(|t| !t.is_null()) {
                    return Err(ApiError::invalid("tools", "tools are rendered with messages, not with a prompt"));
                }
                let add_bos = p.add_special_tokens.unwrap_or(true) && tok.special().add_bos;
                tok.encode_with(text, add_bos).map_err(|e| ApiError::invalid("prompt", format!("tokenizing the prompt failed: {e}")))?
            }
            (None, true) => {
                refuse_set(&value, &chat::UNSUPPORTED)?;
                let template = state.chat_template().map_err(ApiError::bad_request)?;
                let tools = ToolCalling::from_request(&value, state.tool_parser())?;
                let how = Conversation {
                    add_generation_prompt: p.add_generation_prompt.unwrap_or(true),
                    add_special_tokens: p.add_special_tokens.unwrap_or(true),
                    reasoning_effort: chat::reasoning_effort(value.get("reasoning_effort"), "reasoning_effort")?,
                };
                chat::conversation_tokens(template, tok, &chat::messages(p.messages)?, how, tools.as_ref().map(ToolCalling::template_tools))?
            }
            (Some(_), true) => return Err(ApiError::invalid("messages", "give either prompt or messages, not both")),
            (None, false) => return Err(ApiError::invalid("prompt", "prompt (a string) or messages is required")),
        };
        let token_strs = p.return_token_strs.unwrap_or(false).then(|| token_strs(tok, &tokens));
        let max_model_len = state.engine().info().max_model_len;
        Ok(Json(Tokenized { count: tokens.len(), max_model_len, tokens, token_strs }).into_response())
    })
    .await
}

/// The `/detokenize` handler.
pub async fn detokenize(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let started = Instant::now();
    let id = format!("detokenize-{:032x}", rand::random::<u128>());
    super::respond(id, async move {
        let value = super::read_body(&state, body, started).await?;
        let p: DetokenizeParams = json::fields(&value)?;
        state.check_model(p.model.as_deref())?;
        let tok = &state.engine().model().tokenizer;
        let tokens = p.tokens.ok_or_else(|| ApiError::invalid("tokens", "tokens (a list of token ids) is required"))?;
        check_ids(&tokens, tok.vocab_size())?;
        Ok(Json(Detokenized { prompt: tok.decode(&tokens) }).into_response())
    })
    .await
}

/// Every id must be in the vocabulary.
fn check_ids(tokens: &[u32], vocab: usize) -> Result<(), ApiError> {
    match tokens.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(ApiError::invalid(format!("tokens[{i}]"), format!("token id {} is not in the vocabulary (size {vocab})", tokens[i]))),
        None => Ok(()),
    }
}

/// Each token's vocabulary string (as vLLM's `token_strs`).
fn token_strs(tok: &Tokenizer, tokens: &[u32]) -> Vec<String> {
    tokens.iter().map(|&t| tok.id_to_token(t).unwrap_or_default()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_outside_the_vocabulary_are_named() {
        assert!(check_ids(&[0, 9], 10).is_ok());
        let e = check_ids(&[0, 10], 10).unwrap_err();
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("tokens[1]")));
    }
}
