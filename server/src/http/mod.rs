//! The HTTP front end of `tessera serve`: an OpenAI-compatible API over the engine.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models[/{id}]`
//! (behind the API key when one is set), `GET /health`, `GET /version`, `GET /metrics`.
//! Every error is OpenAI-shaped JSON ([`errors`]), unknown routes and methods included; a
//! panicking handler answers a JSON 500 and the server keeps running.

mod auth;
pub mod chat_template;
pub mod errors;
pub(crate) mod json;
mod models;
pub(crate) mod openai;
mod ops;
mod sse;

use axum::routing::{get, post};
use axum::Router;
use chat_template::ChatTemplate;
use errors::ApiError;
use std::future::{Future, IntoFuture};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tessera_engine::serve::Engine;
use tokio::net::TcpListener;
use tower_http::catch_panic::CatchPanicLayer;

/// Settings of the HTTP layer.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The model name clients use (`model` in requests and `/v1/models`).
    pub served_model_name: String,
    /// Bearer token required on `/v1/*` (`None`: open).
    pub api_key: Option<String>,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
}

/// What every handler shares.
pub struct AppState {
    engine: Engine,
    options: ServerOptions,
    chat_template: Result<ChatTemplate, String>,
    created: u64,
    shutting_down: AtomicBool,
}

impl AppState {
    /// State over a running engine; the model's chat template is compiled here (a template
    /// that does not compile only disables chat, with its error as the answer).
    pub fn new(engine: Engine, options: ServerOptions) -> Arc<Self> {
        let chat_template = chat_template_of(&engine);
        if let Err(e) = &chat_template {
            tracing::warn!("chat completions are disabled: {e}");
        }
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Arc::new(AppState { engine, options, chat_template, created, shutting_down: AtomicBool::new(false) })
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    fn model_name(&self) -> &str {
        &self.options.served_model_name
    }

    fn max_body_bytes(&self) -> usize {
        self.options.max_body_bytes
    }

    fn chat_template(&self) -> Result<&ChatTemplate, String> {
        self.chat_template.as_ref().map_err(Clone::clone)
    }

    /// A request's `model` must be the served name (or absent).
    fn check_model(&self, requested: Option<&str>) -> Result<(), ApiError> {
        match requested {
            Some(m) if m != self.model_name() => Err(ApiError::model_not_found(m)),
            _ => Ok(()),
        }
    }
}

fn chat_template_of(engine: &Engine) -> Result<ChatTemplate, String> {
    let model = engine.model();
    let special = &model.checkpoint.special;
    let source = special.chat_template.as_deref().ok_or("the model has no chat template; use /v1/completions")?;
    let text = |id: Option<u32>| id.and_then(|id| model.tokenizer.id_to_token(id)).unwrap_or_default();
    ChatTemplate::new(source, &text(special.bos), &text(special.eos.first().copied()))
}

/// All routes with their layers.
pub fn router(state: Arc<AppState>) -> Router {
    let mut v1 = Router::new()
        .route("/v1/completions", post(openai::completions::completions))
        .route("/v1/chat/completions", post(openai::chat::chat_completions))
        .route("/v1/models", get(models::list))
        .route("/v1/models/:id", get(models::retrieve));
    if state.options.api_key.is_some() {
        v1 = v1.route_layer(axum::middleware::from_fn_with_state(state.clone(), auth::require_api_key));
    }
    let routes = Router::new()
        .merge(v1)
        .route("/health", get(ops::health))
        .route("/version", get(ops::version))
        .route("/metrics", get(ops::metrics));
    json_everywhere(routes).with_state(state)
}

/// JSON answers for unknown paths (404), unsupported methods (405) and panics (500).
fn json_everywhere<S: Clone + Send + Sync + 'static>(routes: Router<S>) -> Router<S> {
    routes
        .method_not_allowed_fallback(errors::method_not_allowed)
        .fallback(errors::unknown_route)
        .layer(CatchPanicLayer::custom(errors::panic_response))
}

/// How long connections may stay open after the engine has stopped (clients that neither
/// read nor close are cut off then).
const DRAIN_SLACK: Duration = Duration::from_secs(5);

/// Serves until `shutdown` resolves, then shuts down gracefully: the listener closes, running
/// requests get `grace` to finish (the engine aborts the rest, whose clients get their final
/// chunks), open connections are drained, and the engine thread stops.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let app = router(state.clone());
    let mut server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.await;
            })
            .into_future(),
    );
    tokio::select! {
        () = shutdown => {}
        r = &mut server => return r.map_err(std::io::Error::other)?,
    }
    tracing::info!(grace_secs = grace.as_secs_f64(), "shutting down: not accepting connections; running requests may finish");
    state.shutting_down.store(true, Ordering::SeqCst);
    let _ = stop_tx.send(());
    let engine = state.engine.clone();
    let engine_stopped = tokio::task::spawn_blocking(move || engine.shutdown(grace));
    match tokio::time::timeout(grace + DRAIN_SLACK, &mut server).await {
        Ok(r) => r.map_err(std::io::Error::other)??,
        Err(_) => tracing::warn!("connections still open after the grace period; closing them"),
    }
    engine_stopped.await.map_err(std::io::Error::other)?;
    tracing::info!("server stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fallbacks_and_panics_answer_json() {
        let app = json_everywhere(Router::new().route("/boom", get(|| async { panic!("handler bug") as &str })));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let client = reqwest::Client::new();
        for (method, path, status, message) in [
            ("GET", "/boom", 500, "The server had an internal error while processing the request."),
            ("GET", "/nowhere", 404, "Invalid URL (GET /nowhere)"),
            ("POST", "/boom", 405, "Method POST is not allowed for /boom"),
        ] {
            let resp = client.request(method.parse().unwrap(), format!("{base}{path}")).send().await.unwrap();
            assert_eq!(resp.status().as_u16(), status, "{method} {path}");
            assert_eq!(resp.headers()["content-type"], "application/json");
            let v: serde_json::Value = resp.json().await.unwrap();
            assert_eq!(v["error"]["message"], message);
        }
        // The server survived the panic.
        assert_eq!(client.get(format!("{base}/boom")).send().await.unwrap().status(), 500);
    }
}
