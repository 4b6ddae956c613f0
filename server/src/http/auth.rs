//! The optional API key (vLLM's `--api-key`): `Authorization: Bearer <key>` on `/v1/*`.

use super::errors::ApiError;
use super::AppState;
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// Middleware: passes requests carrying the key, answers 401 to the others.
pub async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let given = req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok());
    match &state.options.api_key {
        Some(key) if !bearer_matches(given, key) => ApiError::unauthorized().into_response(),
        _ => next.run(req).await,
    }
}

/// Whether `header` is `Bearer <key>` (compared in time independent of where they differ).
fn bearer_matches(header: Option<&str>, key: &str) -> bool {
    let Some(token) = header.and_then(|h| h.strip_prefix("Bearer ")) else { return false };
    token.len() == key.len() && token.bytes().zip(key.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

#[cfg(test)]
mod tests {
    use super::bearer_matches;

    #[test]
    fn bearer_tokens() {
        assert!(bearer_matches(Some("Bearer s3cret"), "s3cret"));
        for bad in [None, Some("s3cret"), Some("Bearer s3cre"), Some("Bearer s3cret2"), Some("Bearer s3creT"), Some("Basic s3cret")] {
            assert!(!bearer_matches(bad, "s3cret"), "{bad:?}");
        }
    }
}
