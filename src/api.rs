//! The HTTP API (axum): health, readiness, Prometheus metrics and status. Handlers only read the
//! shared status and the metrics registry, so the API never blocks the pipeline.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::metrics::Metrics;
use crate::status::{snapshot, RunState, SharedStatus};

#[derive(Clone)]
pub struct ApiState {
    pub metrics: Arc<Metrics>,
    pub status: SharedStatus,
    /// A checkpoint older than this makes the bridge unready.
    pub ready_max_age: Duration,
    /// A pipeline loop silent for longer than this is not alive.
    pub live_max_silence: Duration,
}

pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/health/live", get(live))
        .route("/health/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/api/v1/status", get(status))
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
    let reasons = unready_reasons(&st, s.ready_max_age);
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
