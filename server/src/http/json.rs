//! Request bodies: read under the size limit, parse as JSON, deserialize with the failing
//! field named (so a wrong type answers 400 with `param`, never axum's plain-text rejection).

use super::errors::ApiError;
use axum::body::Body;
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// How far past the limit an oversized body is read (and discarded) before answering 413, so
/// that a client still writing it receives the answer instead of a reset connection.
const DRAIN_FACTOR: usize = 4;

/// Reads the whole body (at most `limit` bytes) and parses it as a JSON object.
pub async fn read_object(body: Body, limit: usize) -> Result<Value, ApiError> {
    let bytes = read_limited(body, limit).await?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("The request body must be a JSON object."));
    }
    Ok(value)
}

async fn read_limited(mut body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let mut buf = Vec::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ApiError::bad_request(format!("Failed to read the request body: {e}")))?;
        let Ok(data) = frame.into_data() else { continue };
        seen += data.len();
        if seen > limit.saturating_mul(DRAIN_FACTOR) {
            break;
        }
        if seen <= limit {
            buf.extend_from_slice(&data);
        }
    }
    if seen > limit {
        return Err(ApiError::body_too_large(limit));
    }
    Ok(buf)
}

/// Deserializes `T` from a parsed body; a type error names the field (`param`) it occurred in.
pub fn fields<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let param = e.path().to_string();
        let inner = e.into_inner();
        ApiError::invalid(param.clone(), format!("Invalid value for `{param}`: {inner}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize, Debug)]
    struct Params {
        temperature: Option<f32>,
        messages: Option<Vec<Message>>,
    }

    #[derive(Deserialize, Debug)]
    struct Message {
        role: String,
    }

    #[tokio::test]
    async fn parses_objects_within_the_limit() {
        let v = read_object(Body::from(r#"{"temperature": 0.5, "messages": [{"role": "user"}]}"#), 100).await.unwrap();
        let p: Params = fields(&v).unwrap();
        assert_eq!(p.temperature, Some(0.5));
        assert_eq!(p.messages.unwrap()[0].role, "user");
    }

    #[tokio::test]
    async fn rejects_malformed_non_object_and_oversized_bodies() {
        let e = read_object(Body::from("{\"temperature\": "), 100).await.unwrap_err();
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, None));
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        let e = read_object(Body::from("[1, 2]"), 100).await.unwrap_err();
        assert!(e.message.contains("JSON object"), "{}", e.message);
        let big = format!("{{\"x\": \"{}\"}}", "a".repeat(200));
        assert_eq!(read_object(Body::from(big.clone()), 100).await.unwrap_err().status, 413);
        // Far past the drain window: still 413.
        assert_eq!(read_object(Body::from(big), 10).await.unwrap_err().status, 413);
    }

    #[test]
    fn type_errors_name_the_field() {
        let v = serde_json::json!({"temperature": "hot"});
        let e = fields::<Params>(&v).unwrap_err();
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("temperature")));
        assert!(e.message.contains("invalid type"), "{}", e.message);
        let v = serde_json::json!({"messages": [{"role": 3}]});
        assert_eq!(fields::<Params>(&v).unwrap_err().param.as_deref(), Some("messages[0].role"));
    }
}
