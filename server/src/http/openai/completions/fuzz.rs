//! The completions handler's request validation without an engine, for the `openai_request`
//! fuzz target ([`crate::fuzzing`]): the same steps as `run`, in the same order, up to the
//! engine requests (submitting them needs a running engine).

use super::{parse_prompts, CommonParams, CompletionParams, DefaultMaxTokens, RequestShape};
use crate::http::errors::ApiError;
use crate::http::json;
use serde_json::Value;
use tessera_engine::serve::GenRequest;
use tessera_engine::tokenizer::Tokenizer;

/// The engine requests a completions body becomes, or the error it is answered with.
pub(crate) fn requests(value: &Value, tok: &Tokenizer, max_model_len: usize) -> Result<Vec<GenRequest>, ApiError> {
    let common: CommonParams = json::fields(value)?;
    let own: CompletionParams = json::fields(value)?;
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
    let shape = RequestShape {
        max_model_len,
        logprobs: own.logprobs,
        prompt_logprobs: own.logprobs.filter(|_| echo),
        default_max_tokens: DefaultMaxTokens::Fixed(16),
    };
    common.requests("cmpl-fuzz", &ids, shape)
}
