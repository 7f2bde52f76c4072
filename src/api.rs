//! The HTTP API (axum): health, readiness, Prometheus metrics, status, checkpoints and savepoints.
//! Handlers read the shared status, the metrics registry and the checkpoint store; a savepoint
//! request is handed to the pipeline, which serves it at its next checkpoint. Nothing here blocks
//! the pipeline. Mutating endpoints need the admin bearer token and are closed without one.

use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::checkpoint::{CheckpointState, CheckpointStore, StoreError};
use crate::config::Secret;
use crate::metrics::Metrics;
use crate::pipeline::Command;
use crate::savepoint::{valid_name, Savepoint};
use crate::status::{snapshot, RunState, SharedStatus};

#[derive(Clone)]
pub struct ApiState {
    pub metrics: Arc<Metrics>,
    pub status: SharedStatus,
    /// A checkpoint older than this makes the bridge unready.
    pub ready_max_age: Duration,
    /// A pipeline loop silent for longer than this is not alive.
    pub live_max_silence: Duration,
    pub store: Arc<CheckpointStore>,
    pub commands: Sender<Command>,
    pub admin_token: Option<Secret>,
    /// How long a savepoint request waits for its checkpoint.
    pub savepoint_wait: Duration,
}

pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/health/live", get(live))
        .route("/health/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/api/v1/status", get(status))
        .route("/api/v1/checkpoints", get(checkpoints))
        .route("/api/v1/savepoints", get(savepoints).post(take_savepoint))
        .route(
            "/api/v1/savepoints/{name}",
            get(one_savepoint).delete(delete_savepoint),
        )
        .with_state(state)
}

async fn live(State(s): State<ApiState>) -> Response {
    let st = snapshot(&s.status);
    let silent = st.heartbeat.elapsed();
    if st.state != RunState::Failed && silent <= s.live_max_silence {
        (StatusCode::OK, Json(json!({"status": "alive"}))).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "dead", "state": st.state, "silent_ms": silent.as_millis() as u64})),
        )
            .into_response()
    }
}

/// Why the bridge is not ready; empty when it is.
pub fn unready_reasons(st: &crate::status::Status, max_age: Duration) -> Vec<String> {
    let mut reasons = Vec::new();
    if !st.transactions_ready {
        reasons.push("transactions are not initialised".to_string());
    }
    if !st.partitions_assigned {
        reasons.push("source partitions are not assigned".to_string());
    }
    if st.state != RunState::Running {
        reasons.push(format!("state is {:?}", st.state).to_lowercase());
    }
    match st.last_checkpoint_at {
        Some(at) if at.elapsed() <= max_age => {}
        Some(at) => reasons.push(format!(
            "the last checkpoint completed {} ms ago, more than {} ms",
            at.elapsed().as_millis(),
            max_age.as_millis()
        )),
        None => reasons.push("no checkpoint has completed yet".to_string()),
    }
    reasons
}

async fn ready(State(s): State<ApiState>) -> Response {
    let st = snapshot(&s.status);
    let mut reasons = unready_reasons(&st, s.ready_max_age);
    reasons.extend(crate::connectivity::unready_reasons(st.last_checkpoint_at));
    if reasons.is_empty() {
        (StatusCode::OK, Json(json!({"status": "ready"}))).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "not ready", "reasons": reasons})),
        )
            .into_response()
    }
}

async fn metrics(State(s): State<ApiState>) -> Response {
    let (content_type, body) = s.metrics.render();
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

async fn status(State(s): State<ApiState>) -> Response {
    let st = snapshot(&s.status);
    let epoch_age_ms = st.epoch_started_at.map(|t| t.elapsed().as_millis() as u64);
    let mut body = serde_json::to_value(&st).unwrap_or_else(|_| json!({}));
    body["epoch_age_ms"] = json!(epoch_age_ms);
    Json(body).into_response()
}

/// An error answer: a status and a JSON body with a message.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({"error": self.1}))).into_response()
    }
}

fn error(code: StatusCode, message: impl Into<String>) -> Response {
    ApiError(code, message.into()).into_response()
}

fn store_error(e: StoreError) -> Response {
    error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// Mutating endpoints: closed (403) without a configured token, 401 without the right one.
fn authorize(s: &ApiState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = &s.admin_token else {
        return Err(ApiError(
            StatusCode::FORBIDDEN,
            "mutating endpoints are disabled: set [api] admin_token (or EOS_BRIDGE__API__ADMIN_TOKEN)"
                .into(),
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Compare without an early exit, so the time taken says nothing about the token.
    let matches = given.is_some_and(|g| {
        let (a, b) = (g.as_bytes(), token.expose().as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    });
    if matches {
        Ok(())
    } else {
        Err(ApiError(
            StatusCode::UNAUTHORIZED,
            "missing or wrong token: send Authorization: Bearer <[api] admin_token>".into(),
        ))
    }
}

async fn checkpoints(State(s): State<ApiState>) -> Response {
    match s.store.load() {
        Ok(loaded) => {
            let list: Vec<_> = loaded
                .checkpoints
                .iter()
                .map(|c| {
                    json!({
                        "id": c.id,
                        "state": c.state,
                        "created_ms": c.created_ms,
                        "savepoint": c.savepoint,
                        "positions": c.positions,
                    })
                })
                .collect();
            let corrupt: Vec<_> = loaded
                .corrupt
                .iter()
                .map(|c| json!({"key": c.key, "reason": c.reason}))
                .collect();
            Json(json!({"checkpoints": list, "corrupt": corrupt})).into_response()
        }
        Err(e) => store_error(e),
    }
}

/// The usable savepoints: those whose checkpoint is committed.
fn find_savepoints(s: &ApiState) -> Result<Vec<Savepoint>, ApiError> {
    Ok(load(s)?
        .checkpoints
        .iter()
        .filter_map(Savepoint::from_checkpoint)
        .collect())
}

fn load(s: &ApiState) -> Result<crate::checkpoint::Loaded, ApiError> {
    s.store
        .load()
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// "No savepoint named NAME", saying so when its checkpoint exists but is not committed yet.
fn not_a_savepoint(loaded: &crate::checkpoint::Loaded, name: &str) -> Response {
    match loaded
        .checkpoints
        .iter()
        .find(|c| c.savepoint.as_deref() == Some(name) && c.state == CheckpointState::Pending)
    {
        Some(c) => error(
            StatusCode::NOT_FOUND,
            format!(
                "no savepoint named '{name}' yet: checkpoint {} carrying that name is not committed",
                c.id
            ),
        ),
        None => error(
            StatusCode::NOT_FOUND,
            format!("no savepoint named '{name}'"),
        ),
    }
}

async fn savepoints(State(s): State<ApiState>) -> Response {
    match find_savepoints(&s) {
        Ok(list) => Json(json!({"savepoints": list})).into_response(),
        Err(r) => r.into_response(),
    }
}

async fn one_savepoint(State(s): State<ApiState>, Path(name): Path<String>) -> Response {
    let loaded = match load(&s) {
        Ok(l) => l,
        Err(r) => return r.into_response(),
    };
    match loaded
        .checkpoints
        .iter()
        .filter_map(Savepoint::from_checkpoint)
        .find(|sp| sp.name == name)
    {
        Some(sp) => Json(sp).into_response(),
        None => not_a_savepoint(&loaded, &name),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SavepointRequest {
    name: String,
    /// Stop the bridge right after the savepoint's checkpoint.
    #[serde(default)]
    stop: bool,
}

async fn take_savepoint(
    State(s): State<ApiState>,
    headers: HeaderMap,
    body: Option<Json<SavepointRequest>>,
) -> Response {
    if let Err(r) = authorize(&s, &headers) {
        return r.into_response();
    }
    let Some(Json(req)) = body else {
        return error(
            StatusCode::BAD_REQUEST,
            "send a JSON body {\"name\": \"...\"} with Content-Type: application/json",
        );
    };
    if let Err(e) = valid_name(&req.name) {
        return error(StatusCode::BAD_REQUEST, e.to_string());
    }
    // A pending checkpoint's name counts too: it becomes a savepoint when it commits.
    match load(&s) {
        Ok(loaded)
            if loaded
                .checkpoints
                .iter()
                .any(|c| c.savepoint.as_deref() == Some(req.name.as_str())) =>
        {
            return error(
                StatusCode::CONFLICT,
                format!("a savepoint named '{}' exists already", req.name),
            )
        }
        Ok(_) => {}
        Err(r) => return r.into_response(),
    }
    let (reply, answer) = tokio::sync::oneshot::channel();
    let sent = s.commands.send(Command::Savepoint {
        name: req.name.clone(),
        stop: req.stop,
        reply,
    });
    if sent.is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the pipeline is not running",
        );
    }
    match tokio::time::timeout(s.savepoint_wait, answer).await {
        Ok(Ok(Ok(sp))) => (StatusCode::CREATED, Json(sp)).into_response(),
        Ok(Ok(Err(msg))) => error(StatusCode::INTERNAL_SERVER_ERROR, msg),
        Ok(Err(_)) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the pipeline stopped before the savepoint's checkpoint completed",
        ),
        Err(_) => error(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "no checkpoint completed within {} ms; the savepoint '{}' will still be taken at the next one",
                s.savepoint_wait.as_millis(),
                req.name
            ),
        ),
    }
}

async fn delete_savepoint(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    if let Err(r) = authorize(&s, &headers) {
        return r.into_response();
    }
    let loaded = match s.store.load() {
        Ok(l) => l,
        Err(e) => return store_error(e),
    };
    let Some(c) = loaded.checkpoints.iter().find(|c| {
        c.savepoint.as_deref() == Some(name.as_str()) && c.state == CheckpointState::Committed
    }) else {
        return not_a_savepoint(&loaded, &name);
    };
    match s.store.set_savepoint(c.id, None) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => store_error(e),
    }
}
