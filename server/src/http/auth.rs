//! The optional API key (vLLM's `--api-key`): `Authorization: Bearer <key>` on `/v1/*`.

use super::errors::ApiError;
use super::AppState;
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use std::sync::Arc;

/// Middleware: passes requests carrying the key, answers 401 to the others.
pub async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let given = req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok());
    match &state.options.api_key {
        Some(key) if !bearer_matches(given, key) => ApiError::unauthorized().into_response(),
        _ => next.run(req).await,
    }
}

/// Whether `header` is `Bearer <key>`. The SHA-256 digests of the token and the key are
/// compared in constant time, so neither where they differ nor their lengths show in timing.
fn bearer_matches(header: Option<&str>, key: &str) -> bool {
    let token = header.and_then(|h| h.strip_prefix("Bearer ")).unwrap_or("");
    let given = Sha256::digest(token.as_bytes());
    let wanted = Sha256::digest(key.as_bytes());
    // A missing header hashes the empty token and is refused below (keys are never empty).
    bool::from(given.as_slice().ct_eq(wanted.as_slice())) && header.is_some_and(|h| h.starts_with("Bearer "))
}

#[cfg(test)]
mod tests {
    use super::bearer_matches;

    #[test]
    fn bearer_tokens() {
        assert!(bearer_matches(Some("Bearer s3cret"), "s3cret"));
        let long = format!("Bearer {}", "s".repeat(10_000));
        for bad in [None, Some("s3cret"), Some("Bearer s3cre"), Some("Bearer s3cret2"), Some("Bearer s3creT"), Some("Basic s3cret"), Some("Bearer "), Some(&long)] {
            assert!(!bearer_matches(bad, "s3cret"), "{bad:?}");
        }
    }
}
