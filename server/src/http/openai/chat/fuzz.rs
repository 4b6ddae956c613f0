//! The chat handler's request validation without an engine, for the `openai_request` fuzz
//! target ([`crate::fuzzing`]): the same steps as `run`, in the same order (the template
//! rendered, the conversation tokenized), up to the engine requests.

use super::{chat_logprobs, messages, ChatParams, CommonParams, DefaultMaxTokens, RequestShape};
use crate::http::chat_template::ChatTemplate;
use crate::http::errors::ApiError;
use crate::http::json;
use serde_json::Value;
use tessera_engine::serve::GenRequest;
use tessera_engine::tokenizer::Tokenizer;

/// The engine requests a chat body becomes, or the error it is answered with.
pub(crate) fn requests(
    value: &Value,
    template: &ChatTemplate,
    tok: &Tokenizer,
    max_model_len: usize,
) -> Result<Vec<GenRequest>, ApiError> {
    let mut common: CommonParams = json::fields(value)?;
    let own: ChatParams = json::fields(value)?;
    common.max_tokens = own.max_completion_tokens.or(common.max_tokens);
    let logprobs = chat_logprobs(own.logprobs, own.top_logprobs)?;
    let messages = messages(own.messages)?;
    let rendered = template.render(&messages).map_err(|e| ApiError::invalid("messages", e))?;
    let text = template.without_duplicate_bos(&rendered, tok.special().add_bos);
    let prompt = tok
        .encode(text)
        .map_err(|e| ApiError::invalid("messages", format!("tokenizing the conversation failed: {e}")))?;
    let shape = RequestShape { max_model_len, logprobs, prompt_logprobs: None, default_max_tokens: DefaultMaxTokens::RestOfContext };
    common.requests("chatcmpl-fuzz", &[prompt], shape)
}
