//! OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::any::Any;
use tessera_engine::serve::SubmitError;

/// An error answered to the client.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// The request parameter at fault, if any.
    pub param: Option<String>,
    /// Machine-readable code (`model_not_found`, `invalid_api_key`, ...), if any.
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None }
    }

    /// 400 `invalid_request_error` naming the parameter at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.into()), ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    /// 400 `invalid_request_error` about the request as a whole (e.g. malformed JSON).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 404 for a model this server does not serve (vLLM's wording).
    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("The model `{model}` does not exist."))
        }
    }

    /// 401 for a missing or wrong API key.
    pub fn unauthorized() -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", "Incorrect or missing API key.")
        }
    }

    /// 413 for a body over the limit.
    pub fn body_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("The request body is larger than the limit of {limit} bytes."),
        )
    }

    /// 503 once shutdown has begun (code `shutting_down`; Retry-After is added).
    pub fn shutting_down() -> Self {
        ApiError {
            code: Some("shutting_down"),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "The server is shutting down; retry on another instance.")
        }
    }

    /// 503 for a connection over `--max-connections` (code `too_many_connections`).
    pub fn too_many_connections() -> Self {
        ApiError {
            code: Some("too_many_connections"),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "The server has too many open connections; retry shortly.")
        }
    }

    /// 408 for a request past its deadline (`request_timeout`) or whose body came too slowly.
    pub fn timeout(message: impl Into<String>) -> Self {
        ApiError { code: Some("request_timeout"), ..Self::new(StatusCode::REQUEST_TIMEOUT, "timeout_error", message) }
    }

    /// 499 (nginx's "client closed request") for a client that closed its side of the
    /// connection before its answer was ready; the request was aborted.
    pub fn client_closed() -> Self {
        ApiError {
            code: Some("client_closed_request"),
            ..Self::new(
                StatusCode::from_u16(499).expect("499 is a valid status"),
                "invalid_request_error",
                "The client closed its side of the connection before the response was ready; the request was aborted.",
            )
        }
    }

    /// An error with the given status and message (a plain-text rejection made JSON).
    pub fn from_status(status: StatusCode, message: impl Into<String>) -> Self {
        let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
        Self::new(status, kind, message)
    }

    /// 500 for a failure on the server's side (never caused by the request's content).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        let message = e.to_string();
        match e {
            SubmitError::QueueFull { .. } | SubmitError::ShuttingDown => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            }
            // The engine checks prompt + max_tokens against the context, once for every
            // endpoint; the parameter named is the one that cannot fit on its own.
            SubmitError::TooLong { max_tokens, max_model_len, .. } if max_tokens > max_model_len => ApiError::invalid("max_tokens", message),
            SubmitError::TooLong { .. } | SubmitError::EmptyPrompt | SubmitError::TokenOutOfRange { .. } => {
                ApiError::invalid("prompt", message)
            }
            SubmitError::Invalid { param, .. } => ApiError::invalid(param, message),
            SubmitError::TooManyChoices { .. } => ApiError::invalid("n", message),
        }
    }
}

impl ApiError {
    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn to_json(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let json = serde_json::to_vec(&self.to_json()).expect("error bodies serialize");
        let mut resp = (self.status, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], json)
            .into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// Fallback for paths no route matches (404, JSON like OpenAI's).
pub async fn unknown_route(method: Method, uri: Uri) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("Invalid URL ({method} {})", uri.path()))
}

/// Fallback for known paths called with an unsupported method (405, JSON).
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("Method {method} is not allowed for {}", uri.path()),
    )
}

/// The catch-panic layer's response: a JSON 500 (a panic is a bug; the server keeps running).
pub fn panic_response(payload: Box<dyn Any + Send + 'static>) -> Response {
    let detail = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("unknown panic");
    tracing::error!(panic = detail, "request handler panicked");
    ApiError::internal("The server had an internal error while processing the request.").into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn body_json(e: ApiError) -> (StatusCode, serde_json::Value, Option<HeaderValue>) {
        let resp = e.into_response();
        let status = resp.status();
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
        let retry = resp.headers().get(header::RETRY_AFTER).cloned();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap(), retry)
    }

    #[tokio::test]
    async fn openai_shape_with_param_and_code() {
        let (status, v, retry) = body_json(ApiError::invalid("temperature", "bad")).await;
        assert_eq!(status, 400);
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": null}})
        );
        assert!(retry.is_none());
        let (status, v, _) = body_json(ApiError::model_not_found("gpt-4")).await;
        assert_eq!(status, 404);
        assert_eq!(v["error"]["message"], "The model `gpt-4` does not exist.");
        assert_eq!(v["error"]["code"], "model_not_found");
    }

    #[tokio::test]
    async fn submit_errors_map_to_statuses() {
        let (status, v, retry) = body_json(SubmitError::QueueFull { waiting: 3 }.into()).await;
        assert_eq!((status, v["error"]["type"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("server_error")));
        assert_eq!(retry.unwrap(), "1");
        let (status, _, _) = body_json(SubmitError::ShuttingDown.into()).await;
        assert_eq!(status, 503);
        let too_long = SubmitError::TooLong { prompt: 9000, max_tokens: 16, max_model_len: 8192 };
        let (status, v, _) = body_json(too_long.into()).await;
        assert_eq!((status, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("prompt")));
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("8192") && msg.contains("9016") && msg.contains("9000"), "{msg}");
        let too_many = SubmitError::TooLong { prompt: 3, max_tokens: usize::MAX, max_model_len: 8192 };
        let (status, v, _) = body_json(too_many.into()).await;
        assert_eq!((status, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("max_tokens")));
        let invalid = SubmitError::Invalid { param: "top_p", msg: "top_p must be in (0, 1]".into() };
        let (status, v, _) = body_json(invalid.into()).await;
        assert_eq!((status, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("top_p")));
        let (_, v, _) = body_json(SubmitError::TokenOutOfRange { id: 99999, vocab: 49152 }.into()).await;
        assert_eq!(v["error"]["param"], "prompt");
        // A request the queue can never hold is the client's to fix: 400, no Retry-After.
        let (status, v, retry) = body_json(SubmitError::TooManyChoices { choices: 384, max_waiting: 256 }.into()).await;
        assert_eq!((status, v["error"]["param"].as_str(), retry), (StatusCode::BAD_REQUEST, Some("n"), None));
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("384") && msg.contains("256"), "{msg}");
    }

    #[tokio::test]
    async fn panic_payloads_become_json_500() {
        for payload in [Box::new("boom") as Box<dyn Any + Send>, Box::new(String::from("boom"))] {
            let resp = panic_response(payload);
            assert_eq!(resp.status(), 500);
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(v["error"]["type"], "server_error");
        }
    }
}
