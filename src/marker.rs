//! Commit markers: the record written to the marker topic inside every checkpoint's transaction.
//!
//! A marker is visible to read_committed readers exactly when its transaction committed, so the
//! newest committed marker of an instance is the authority on what that instance committed, on
//! any cluster and whatever happened to the local state directory. This module owns the marker's
//! wire format, its key and its partition; reading it back from Kafka lives with the sink.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::identity::Identity;
use crate::positions::Positions;

/// Version of the marker format; a reader refuses versions it does not know.
pub const MARKER_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    pub version: u32,
    pub bridge_id: String,
    pub instance: u32,
    pub instances: u32,
    pub checkpoint_id: u64,
    /// Positions P(N): the next offset to read per source partition after this checkpoint.
    pub positions: Positions,
    /// Wall-clock time of the barrier, milliseconds since the epoch.
    pub time_ms: i64,
    /// The clusters and topic incarnations the positions refer to. Optional within version 1:
    /// markers written before it decode with None, and older builds ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<Identity>,
}

#[derive(Debug, Error)]
pub enum MarkerError {
    #[error("commit marker is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("commit marker has version {found}, this build reads version {MARKER_VERSION}: upgrade eos-bridge")]
    Version { found: u32 },
}

impl Marker {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a marker always serializes")
    }

    pub fn decode(bytes: &[u8]) -> Result<Marker, MarkerError> {
        let m: Marker = serde_json::from_slice(bytes)?;
        if m.version != MARKER_VERSION {
            return Err(MarkerError::Version { found: m.version });
        }
        Ok(m)
    }
}

/// The key of an instance's markers: with a compacted marker topic only the newest survives.
pub fn marker_key(bridge_id: &str, instance: u32) -> String {
    format!("{bridge_id}/{instance}")
}

/// The marker-topic partition of an instance. Each instance of a bridge writes to a partition of
/// its own, so one instance's open transaction never holds back the last stable offset that
/// another instance's recovery reads up to.
pub fn marker_partition(instance: u32, partitions: i32) -> i32 {
    (instance % partitions.max(1) as u32) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marker() -> Marker {
        let mut positions = Positions::new();
        positions.set("orders", 2, 41);
        Marker {
            version: MARKER_VERSION,
            bridge_id: "b".into(),
            instance: 1,
            instances: 2,
            checkpoint_id: 7,
            positions,
            time_ms: 1_700_000_000_000,
            identity: None,
        }
    }

    #[test]
    fn round_trip() {
        let m = marker();
        assert_eq!(Marker::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn markers_without_identity_still_decode() {
        let m = marker();
        let json = String::from_utf8(m.encode()).unwrap();
        assert!(!json.contains("identity"), "{json}");
        let mut with = marker();
        with.identity = Some(Identity {
            source_cluster: Some("c1".into()),
            ..Identity::default()
        });
        let json = String::from_utf8(with.encode()).unwrap();
        assert!(
            json.contains(r#""identity":{"source_cluster":"c1"}"#),
            "{json}"
        );
        assert_eq!(Marker::decode(json.as_bytes()).unwrap(), with);
    }

    #[test]
    fn unknown_version_is_refused() {
        let mut m = marker();
        m.version = 99;
        let err = Marker::decode(&m.encode()).unwrap_err();
        assert!(err.to_string().contains("version 99"), "{err}");
    }

    #[test]
    fn instances_get_partitions_of_their_own() {
        assert_eq!(marker_partition(0, 4), 0);
        assert_eq!(marker_partition(3, 4), 3);
        assert_eq!(marker_partition(5, 4), 1);
        assert_eq!(marker_key("bridge", 3), "bridge/3");
    }
}
