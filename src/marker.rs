//! Commit markers: the record written to the marker topic inside every checkpoint's transaction.
//!
//! A marker is visible to read_committed readers exactly when its transaction committed, so the
//! newest committed marker of an instance is the authority on what that instance committed, on
//! any cluster and whatever happened to the local state directory. This module owns the marker's
//! wire format, its key and its partition, and reading markers back from Kafka
//! (`read_bridge_markers`); writing them is the sink's, inside its transactions.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tracing::warn;

use crate::error::{BridgeError, Result};
use crate::identity::Identity;
use crate::positions::Positions;
use crate::sink::{is_client_wide, SinkSettings};
use crate::stable::Report;

/// Version of the marker format; a reader refuses versions it does not know.
pub(crate) const MARKER_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Marker {
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
pub(crate) enum MarkerError {
    #[error("commit marker is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("commit marker has version {found}, this build reads version {MARKER_VERSION}: upgrade eos-bridge")]
    Version { found: u32 },
}

impl Marker {
    pub(crate) fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a marker always serializes")
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Marker, MarkerError> {
        let m: Marker = serde_json::from_slice(bytes)?;
        if m.version != MARKER_VERSION {
            return Err(MarkerError::Version { found: m.version });
        }
        Ok(m)
    }
}

/// The key of an instance's markers: with a compacted marker topic only the newest survives.
pub(crate) fn marker_key(bridge_id: &str, instance: u32) -> String {
    format!("{bridge_id}/{instance}")
}

/// A layout of a bridge: how many instances share its partitions, and its generation, which grows
/// with every change of `instances`. Ordered by generation, then instances (docs/design.md,
/// "Rescaling"): a higher layout fences the lower ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Layout {
    pub generation: u64,
    pub instances: u32,
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "generation {} ({} instances)",
            self.generation, self.instances
        )
    }
}

/// The marker key of an instance in a layout. Generation 0 keeps the key of builds that predate
/// layouts, so that their markers are read as generation 0 and an upgrade changes nothing; later
/// generations name the layout, so that markers of two layouts never share a key.
pub(crate) fn layout_marker_key(bridge_id: &str, layout: Layout, instance: u32) -> String {
    if layout.generation == 0 {
        marker_key(bridge_id, instance)
    } else {
        format!(
            "{bridge_id}/g{}n{}/{instance}",
            layout.generation, layout.instances
        )
    }
}

/// The transactional id of an instance in a layout; generation 0 keeps the id of older builds
/// (`Config::transactional_id`), so that an upgraded process fences the one it replaces. Ids of
/// different layouts differ, so a new layout's instance never fences its own layout's neighbour
/// while it fences the previous layout.
pub(crate) fn layout_transactional_id(bridge_id: &str, layout: Layout, instance: u32) -> String {
    if layout.generation == 0 {
        format!("eos-bridge-{bridge_id}-{instance}")
    } else {
        format!(
            "eos-bridge-{bridge_id}-g{}n{}-{instance}",
            layout.generation, layout.instances
        )
    }
}

/// The layout and instance a marker key of `bridge_id` names (None: the key is another bridge's).
/// A generation-0 key does not name the instance count: the marker's body does.
pub(crate) fn parse_marker_key(bridge_id: &str, key: &str) -> Option<(Option<Layout>, u32)> {
    let rest = key.strip_prefix(bridge_id)?.strip_prefix('/')?;
    match rest.split_once('/') {
        None => Some((None, rest.parse().ok()?)),
        Some((layout, instance)) => {
            let (g, n) = layout.strip_prefix('g')?.split_once('n')?;
            let layout = Layout {
                generation: g.parse().ok()?,
                instances: n.parse().ok()?,
            };
            Some((Some(layout), instance.parse().ok()?))
        }
    }
}

/// A newest committed marker found on the marker topic, with the layout its key names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FoundMarker {
    pub layout: Layout,
    pub marker: Marker,
}

impl FoundMarker {
    /// An intent marker claims a layout before any of its output: it carries checkpoint id 0 (real
    /// checkpoints start at 1) and no positions.
    pub(crate) fn is_intent(&self) -> bool {
        self.marker.checkpoint_id == 0
    }
}

/// The marker-topic partition of an instance. Each instance of a bridge writes to a partition of
/// its own, so one instance's open transaction never holds back the last stable offset that
/// another instance's recovery reads up to.
pub(crate) fn marker_partition(instance: u32, partitions: i32) -> i32 {
    (instance % partitions.max(1) as u32) as i32
}

fn marker_reader(s: &SinkSettings, isolation: &str) -> Result<BaseConsumer> {
    let mut cc = ClientConfig::new();
    for (k, v) in &s.kafka {
        if is_client_wide(k) {
            cc.set(k, v);
        }
    }
    cc.set("bootstrap.servers", &s.bootstrap_servers)
        .set("group.id", crate::acl::marker_reader_group(&s.bridge_id))
        .set("enable.auto.commit", "false")
        .set("isolation.level", isolation)
        .set("enable.partition.eof", "true")
        // A marker partition ends in a transaction's commit record, which is never handed out
        // as a message: its read ends at the end-of-partition event, which comes with the first
        // fetch that finds nothing new, and the broker holds such a fetch for fetch.wait.max.ms
        // (500 ms by default). Every start-up reads the marker partitions twice (layout, then
        // recovery), so this was a second of every restart (bench/recovery).
        .set("fetch.wait.max.ms", "10")
        .set("auto.offset.reset", "earliest")
        .create()
        .map_err(|e| BridgeError::kafka("create marker reader", e))
}

/// Waits until the marker partition's last stable offset reaches the high watermark that the
/// partition had when the wait began, and returns that offset.
///
/// Why this proves the read complete (the rule is `stable`'s): the caller has run
/// init_transactions, which returns only once the coordinator has finished every earlier
/// transaction of our transactional id, so every marker we ever committed lies below the high
/// watermark read first.
fn wait_for_stable_marker_partition(
    s: &SinkSettings,
    committed: &BaseConsumer,
    deadline: Instant,
    report: Report<'_>,
) -> Result<i64> {
    let uncommitted = marker_reader(s, "read_uncommitted")?;
    crate::stable::wait_until_stable(
        committed,
        &uncommitted,
        &s.marker_topic,
        s.marker_partition,
        "the marker partition",
        deadline,
        report,
    )?
    .map_err(|held| BridgeError::MarkerPartitionUnstable {
        topic: held.topic,
        partition: held.partition,
        last_stable_offset: held.last_stable_offset,
        high_watermark: held.high_watermark,
        waited: held.waited,
    })
}

/// Reads the newest committed marker of every key of this bridge on marker partitions
/// `0..partitions`, each partition read completely up to its last stable offset once that reached
/// the high watermark (the completeness rule of [`wait_for_stable_marker_partition`]). The whole
/// partition is read because a partition holds the markers of every layout that used its instance
/// slot and the reader cannot know how many there were; compaction keeps it short.
///
/// With `committed = false` it reads everything written, open and aborted transactions included,
/// without waiting: a guess of the layouts in use, good for choosing the transactional id before
/// init_transactions, never for positions.
pub(crate) fn read_bridge_markers(
    s: &SinkSettings,
    partitions: i32,
    committed: bool,
    timeout: Duration,
    report: Report<'_>,
) -> Result<Vec<FoundMarker>> {
    let consumer = marker_reader(
        s,
        if committed {
            "read_committed"
        } else {
            "read_uncommitted"
        },
    )?;
    let mut newest: BTreeMap<String, FoundMarker> = BTreeMap::new();
    for partition in 0..partitions.max(1) {
        let ps = SinkSettings {
            marker_partition: partition,
            ..s.clone()
        };
        // A partition the bridge has just created or added can be unknown to the broker we ask
        // for a moment: wait for it rather than stop.
        let known_by = Instant::now() + timeout;
        let (low, high) = loop {
            match consumer.fetch_watermarks(&ps.marker_topic, partition, timeout) {
                Ok(w) => break w,
                Err(e) if Instant::now() < known_by => {
                    warn!(topic = %ps.marker_topic, partition, error = %e, "marker partition not known yet; retrying");
                    std::thread::sleep(Duration::from_millis(200));
                    // The watermark query answers from this client's metadata cache, which does
                    // not learn of a partition added since it was filled (a CI run retried for the
                    // whole minute while the broker knew it): ask the broker again. Failing here
                    // only means the next retry asks once more.
                    let _ = consumer.fetch_metadata(Some(&ps.marker_topic), Duration::from_secs(5));
                }
                Err(e) => return Err(BridgeError::kafka("fetch marker watermarks", e)),
            }
        };
        let lso = if committed {
            wait_for_stable_marker_partition(
                &ps,
                &consumer,
                Instant::now() + s.foreign_transaction_wait,
                report,
            )?
        } else {
            high
        };
        if lso <= low {
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&ps.marker_topic, partition, Offset::Offset(low))
            .map_err(|e| BridgeError::kafka("assign marker partition", e))?;
        consumer
            .assign(&tpl)
            .map_err(|e| BridgeError::kafka("assign marker partition", e))?;
        let end_at = Instant::now() + timeout;
        loop {
            if Instant::now() >= end_at {
                return Err(BridgeError::MarkerRead {
                    key: format!("{}/*", s.bridge_id),
                    topic: ps.marker_topic.clone(),
                    partition,
                    timeout,
                });
            }
            let m = match consumer.poll(Duration::from_millis(200)) {
                None => continue,
                Some(Err(KafkaError::PartitionEOF(_))) => break,
                Some(Err(e)) => return Err(BridgeError::kafka("read marker topic", e)),
                Some(Ok(m)) => m,
            };
            if m.offset() >= lso {
                break;
            }
            let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
            let parsed = parse_marker_key(&s.bridge_id, &key);
            if parsed.is_none() && !committed {
                // Possibly an aborted or still open record: the committed read judges it.
                continue;
            }
            let Some((layout, _)) = parsed else {
                return Err(BridgeError::MarkerTopicShared {
                    topic: ps.marker_topic.clone(),
                    partition,
                    offset: m.offset(),
                    found_key: key,
                    our_key: s.marker_key.clone(),
                });
            };
            match m.payload().map(Marker::decode) {
                Some(Ok(marker)) => {
                    let layout = layout.unwrap_or(Layout {
                        generation: 0,
                        instances: marker.instances,
                    });
                    if newest
                        .get(&key)
                        .is_none_or(|f| marker.checkpoint_id >= f.marker.checkpoint_id)
                    {
                        newest.insert(key, FoundMarker { layout, marker });
                    }
                }
                Some(Err(e)) => {
                    warn!(offset = m.offset(), error = %e, "skipping undecodable commit marker")
                }
                None => {}
            }
            if m.offset() + 1 >= lso {
                break;
            }
        }
    }
    Ok(newest.into_values().collect())
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

    #[test]
    fn layout_keys_and_ids_round_trip_and_keep_generation_zero() {
        let g0 = Layout {
            generation: 0,
            instances: 2,
        };
        let g3 = Layout {
            generation: 3,
            instances: 5,
        };
        assert_eq!(layout_marker_key("b.x", g0, 1), "b.x/1");
        assert_eq!(layout_marker_key("b.x", g3, 4), "b.x/g3n5/4");
        assert_eq!(layout_transactional_id("b", g0, 1), "eos-bridge-b-1");
        assert_eq!(layout_transactional_id("b", g3, 4), "eos-bridge-b-g3n5-4");
        assert_eq!(parse_marker_key("b.x", "b.x/1"), Some((None, 1)));
        assert_eq!(parse_marker_key("b.x", "b.x/g3n5/4"), Some((Some(g3), 4)));
        assert_eq!(parse_marker_key("b", "bb/1"), None);
        assert_eq!(parse_marker_key("b", "b/x"), None);
        assert_eq!(parse_marker_key("b", "b/g1/0"), None);
        assert!(g3 > g0);
        assert!(
            Layout {
                generation: 1,
                instances: 3
            } > Layout {
                generation: 1,
                instances: 2
            }
        );
    }
}
