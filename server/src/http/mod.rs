//! The HTTP front end of `tessera serve`: an OpenAI-compatible API over the engine.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models[/{id}]`,
//! `POST /tokenize`, `POST /detokenize` (behind the API key when one is set), `GET /health`, `GET /version`, `GET /metrics`.
//! Every error is OpenAI-shaped JSON ([`errors`]), unknown routes and methods included; a
//! panicking handler answers a JSON 500 and the server keeps running.

mod auth;
pub mod chat_template;
pub mod conn;
pub mod errors;
pub(crate) mod json;
mod models;
pub(crate) mod openai;
mod ops;
mod sse;

pub use openai::tool_parsers::ToolParser;

use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use chat_template::ChatTemplate;
use conn::{ConnOptions, Phase, ServerMetrics, Tracker};
use errors::ApiError;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
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
    /// Deadline of a generation request that sets none (`request_timeout`), and the longest
    /// one a request may set (`None`: requests without one have no deadline).
    pub request_timeout: Option<Duration>,
    /// Connection limit and timeouts.
    pub conn: ConnOptions,
    /// The syntax of the model's tool calls.
    pub tool_parser: ToolParser,
}

/// What every handler shares.
pub struct AppState {
    engine: Engine,
    options: ServerOptions,
    chat_template: Result<ChatTemplate, String>,
    created: u64,
    shutting_down: AtomicBool,
    draining: tokio::sync::watch::Sender<bool>,
    tracker: Tracker,
    metrics: ServerMetrics,
}

impl AppState {
    /// State over a running engine; the model's chat template is compiled here (a template
    /// that does not compile only disables chat, with its error as the answer). The server's
    /// metrics join the engine's registry.
    pub fn new(engine: Engine, options: ServerOptions) -> Arc<Self> {
        let chat_template = chat_template_of(&engine);
        if let Err(e) = &chat_template {
            tracing::warn!("chat completions are disabled: {e}");
        }
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let metrics = ServerMetrics::register(engine.registry()).expect("the server's metrics register once");
        Arc::new(AppState {
            engine,
            options,
            chat_template,
            created,
            shutting_down: AtomicBool::new(false),
            draining: tokio::sync::watch::channel(false).0,
            tracker: Tracker::default(),
            metrics,
        })
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

    fn tool_parser(&self) -> ToolParser {
        self.options.tool_parser
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

    /// Resolves once shutdown has begun.
    async fn drain_started(&self) {
        let _ = self.draining.subscribe().wait_for(|d| *d).await;
    }

    /// Refuses new work once shutdown has begun (503 with Retry-After).
    fn check_accepting(&self) -> Result<(), ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::shutting_down());
        }
        Ok(())
    }
}

fn chat_template_of(engine: &Engine) -> Result<ChatTemplate, String> {
    let model = engine.model();
    let special = &model.weights.checkpoint.special;
    let source = special.chat_template.as_deref().ok_or("the model has no chat template; use /v1/completions")?;
    let text = |id: Option<u32>| id.and_then(|id| model.tokenizer.id_to_token(id)).unwrap_or_default();
    ChatTemplate::new(source, &text(special.bos), &text(special.eos.first().copied()))
}

/// All routes with their layers.
pub fn router(state: Arc<AppState>) -> Router {
    let mut v1 = Router::new()
        .route("/v1/completions", post(openai::completions::completions))
        .route("/v1/chat/completions", post(openai::chat::chat_completions))
        .route("/v1/responses", post(openai::responses::responses))
        .route("/v1/models", get(models::list))
        .route("/v1/models/:id", get(models::retrieve))
        .route("/tokenize", post(openai::tokenize::tokenize))
        .route("/detokenize", post(openai::tokenize::detokenize));
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

/// JSON answers for unknown paths (404), unsupported methods (405), panics (500), and every
/// other error a layer or extractor answers in plain text (e.g. a path that is not UTF-8).
fn json_everywhere<S: Clone + Send + Sync + 'static>(routes: Router<S>) -> Router<S> {
    routes
        .method_not_allowed_fallback(errors::method_not_allowed)
        .fallback(errors::unknown_route)
        .layer(axum::middleware::map_response(errors_as_json))
        .layer(CatchPanicLayer::custom(errors::panic_response))
}

/// Rewrites an error response that is not JSON (an extractor's or layer's plain-text
/// rejection) as an OpenAI-shaped error with the same status and message.
async fn errors_as_json(resp: Response) -> Response {
    let status = resp.status();
    let is_json = resp.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let text = match axum::body::to_bytes(resp.into_body(), 64 << 10).await {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_owned(),
        Err(_) => String::new(),
    };
    let message = if text.is_empty() { status.canonical_reason().unwrap_or("error").to_owned() } else { text };
    ApiError::from_status(status, message).into_response()
}

/// How a shutdown proceeds.
#[derive(Clone, Copy, Debug)]
pub struct DrainOptions {
    /// How long running requests may take to finish (the engine aborts the rest).
    pub grace: Duration,
    /// Least time the listener stays open after the signal (answering health 503), for load
    /// balancers to notice.
    pub delay: Duration,
}

/// How long responses may take to reach their clients after the engine has stopped
/// (clients that neither read nor close are cut off then).
const DRAIN_SLACK: Duration = Duration::from_secs(5);

/// Serves until `shutdown` resolves, then drains: `/health` answers 503 `shutting_down` and
/// new generation requests 503 with Retry-After, idle and half-sent connections close at
/// once, running requests get `grace` to finish (the engine aborts the rest, whose clients
/// get their final chunks), and once their responses are out (and `delay` has passed) the
/// listener and every connection close and the engine thread stops.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    drain: DrainOptions,
) -> std::io::Result<()> {
    let (phase_tx, phase_rx) = tokio::sync::watch::channel(Phase::Serving);
    let app = router(state.clone());
    let overflow = conn::overflow_router(state.clone());
    let mut accepting = tokio::spawn(conn::accept_loop(listener, app, overflow, state.clone(), state.options.conn.clone(), phase_rx));
    tokio::select! {
        () = shutdown => {}
        r = &mut accepting => return r.map_err(std::io::Error::other),
    }
    let t0 = Instant::now();
    tracing::info!(
        grace_secs = drain.grace.as_secs_f64(),
        delay_secs = drain.delay.as_secs_f64(),
        "shutting down: health answers 503, new requests are refused, running requests may finish"
    );
    state.shutting_down.store(true, Ordering::SeqCst);
    state.draining.send_replace(true);
    let _ = phase_tx.send(Phase::Draining);
    let engine = state.engine.clone();
    let (stopped_tx, mut engine_stopped) = tokio::sync::watch::channel(false);
    tokio::task::spawn_blocking(move || {
        engine.shutdown(drain.grace);
        let _ = stopped_tx.send(true);
    });
    let mut stopped = engine_stopped.clone();
    let drained = async {
        let _ = stopped.wait_for(|s| *s).await;
        state.tracker.idle().await;
    };
    if tokio::time::timeout(drain.grace + DRAIN_SLACK, drained).await.is_err() {
        tracing::warn!("responses still being sent after the grace period; closing their connections");
    }
    tokio::time::sleep_until((t0 + drain.delay).into()).await;
    let _ = phase_tx.send(Phase::Closed);
    accepting.await.map_err(std::io::Error::other)?;
    let _ = engine_stopped.wait_for(|s| *s).await;
    tracing::info!("server stopped");
    Ok(())
}

/// A response with a JSON body (for handlers building their own).
fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    let bytes = serde_json::to_vec(body).expect("JSON values serialize");
    (status, [(header::CONTENT_TYPE, "application/json")], Body::from(bytes)).into_response()
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
