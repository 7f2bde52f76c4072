//! What the pipeline tells the outside world: its state, positions, lag and last checkpoint,
//! shared with the HTTP API. The pipeline writes it at epoch boundaries only; readers never block
//! the pipeline for longer than a copy.

use std::sync::{Arc, RwLock};
use std::time::Instant;

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum RunState {
    Starting,
    Recovering,
    Running,
    Draining,
    Stopped,
    Failed,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct PartitionStatus {
    pub topic: String,
    pub partition: i32,
    /// Next offset to read, as of the last completed checkpoint.
    pub position: i64,
    pub last_stable_offset: Option<i64>,
    pub lag: Option<i64>,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct Status {
    pub bridge_id: String,
    pub instance: u32,
    pub instances: u32,
    pub delivery: &'static str,
    pub state: RunState,
    pub transactions_ready: bool,
    pub partitions_assigned: bool,
    pub partitions: Vec<PartitionStatus>,
    pub last_checkpoint_id: u64,
    pub last_checkpoint_time_ms: Option<i64>,
    pub failure: Option<String>,
    /// Why recovery is waiting, while it waits (e.g. for another producer's transaction on the
    /// marker partition).
    pub recovery_wait: Option<String>,
    /// The bound on output bytes in flight to the sink, fitted to its delivery rate.
    pub in_flight_limit_bytes: u64,
    /// The layout this process runs in (exactly-once): its generation and instance count.
    pub layout_generation: Option<u64>,
    pub layout_instances: Option<u32>,
    /// While a new layout takes over: what it waits for (fencing, reading the old markers).
    pub takeover: Option<String>,
    #[serde(skip)]
    pub last_checkpoint_at: Option<Instant>,
    #[serde(skip)]
    pub epoch_started_at: Option<Instant>,
    /// Updated by every turn of the pipeline's loop: liveness.
    #[serde(skip)]
    pub heartbeat: Instant,
}

pub(crate) type SharedStatus = Arc<RwLock<Status>>;

impl Status {
    pub(crate) fn new(
        bridge_id: &str,
        instance: u32,
        instances: u32,
        delivery: &'static str,
    ) -> Status {
        Status {
            bridge_id: bridge_id.to_string(),
            instance,
            instances,
            delivery,
            state: RunState::Starting,
            transactions_ready: false,
            partitions_assigned: false,
            partitions: Vec::new(),
            last_checkpoint_id: 0,
            last_checkpoint_time_ms: None,
            failure: None,
            recovery_wait: None,
            in_flight_limit_bytes: 0,
            layout_generation: None,
            layout_instances: None,
            takeover: None,
            last_checkpoint_at: None,
            epoch_started_at: None,
            heartbeat: Instant::now(),
        }
    }

    pub(crate) fn shared(self) -> SharedStatus {
        Arc::new(RwLock::new(self))
    }
}

/// Runs `f` on the status under its write lock (a poisoned lock still holds usable data).
pub(crate) fn update(status: &SharedStatus, f: impl FnOnce(&mut Status)) {
    let mut guard = status.write().unwrap_or_else(|p| p.into_inner());
    f(&mut guard);
}

pub(crate) fn snapshot(status: &SharedStatus) -> Status {
    status.read().unwrap_or_else(|p| p.into_inner()).clone()
}
