//! Consumer-group offset translation: what the pipeline records with each checkpoint so that a
//! group's committed source offsets can be turned into the exact sink offsets of the same
//! records, and the `offsets translate` command that does it (docs/design.md, "Offset
//! translation"; docs/operations.md, "Moving consumers to the sink cluster").
//!
//! The pipeline calls this module at three points only: the sink's delivery reports feed a
//! `RunCollector` (sink.rs), after the flush `Tracker::build` turns the epoch's runs into mapping
//! records that go into the checkpoint's transaction, and after the commit `Tracker::committed`
//! carries the sink position of each partition forward.

pub mod mapping;
pub mod monitor;
pub mod translate;

use std::collections::HashMap;
use std::time::Duration;

use crate::admin::Admin;
use crate::config::{Config, Delivery, Partitioning};
use crate::error::Result;
use crate::positions::Positions;
use mapping::{chunk, OffsetMap, PartitionMap, RunCollector, MAPPING_VERSION};

/// Whether a bridge with this configuration keeps an offset mapping: only exactly-once output is
/// one sink record per source record, and only `preserve` keeps one source partition's records
/// alone and in order in one sink partition (why `key` cannot: docs/design.md).
pub fn kept(cfg: &Config) -> bool {
    cfg.bridge.delivery == Delivery::ExactlyOnce && cfg.sink.partitioning == Partitioning::Preserve
}

/// Creates the mapping topic if missing: one partition, deleted by time after `retention`.
/// Not compacted: every record has a key of its own (writer and checkpoint), so compaction would
/// never drop one; time-based deletion is what bounds it. Segments roll at a tenth of the
/// retention, so records leave within about 110% of it.
pub async fn ensure_topic(admin: &Admin, cfg: &Config) -> Result<()> {
    if admin.partitions(&cfg.offsets.topic)?.is_some() {
        return Ok(());
    }
    let retention = cfg.offsets.retention.as_millis().to_string();
    let segment = (cfg.offsets.retention / 10)
        .max(Duration::from_secs(60))
        .as_millis()
        .to_string();
    admin
        .create_topic(
            &cfg.offsets.topic,
            1,
            &[
                ("cleanup.policy", "delete"),
                ("retention.ms", &retention),
                ("segment.ms", &segment),
            ],
        )
        .await
}

/// The mapping records of one checkpoint, ready to send, and what its commit carries forward.
pub(crate) struct Built {
    pub records: Vec<(String, Vec<u8>)>,
    pub runs: usize,
    sink_next: Vec<((String, i32), (i32, i64))>,
    ends: Vec<((String, i32), i64)>,
}

/// The pipeline's side of the mapping: the sink position after the newest bridged record of each
/// source partition, carried from checkpoint to checkpoint in memory.
pub(crate) struct Tracker {
    bridge_id: String,
    topic: String,
    max_runs: usize,
    sink_next: HashMap<(String, i32), (i32, i64)>,
    /// The end of the newest committed map of each partition: a checkpoint that moves no
    /// partition beyond it writes nothing.
    ends: HashMap<(String, i32), i64>,
}

impl Tracker {
    pub(crate) fn new(cfg: &Config) -> Tracker {
        Tracker {
            bridge_id: cfg.bridge.id.clone(),
            topic: cfg.offsets.topic.clone(),
            max_runs: cfg.offsets.max_runs,
            sink_next: HashMap::new(),
            ends: HashMap::new(),
        }
    }

    pub(crate) fn topic(&self) -> &str {
        &self.topic
    }

    /// Whether the epoch should end: its mapping reached `offsets.max_runs`.
    pub(crate) fn full(&self, runs: usize) -> bool {
        runs >= self.max_runs
    }

    /// The mapping of checkpoint `id` of `writer` (its marker key), which read every partition from
    /// `before` (the previous checkpoint's positions) to `after` (its own, moved over trailing
    /// transaction markers: `Source::positions_past_markers`), with the runs the delivery reports
    /// gave. Partitions without records whose end is unchanged are left out: the previous record
    /// still describes them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn build(
        &self,
        writer: &str,
        id: u64,
        time_ms: i64,
        before: &Positions,
        after: &Positions,
        runs: &mut RunCollector,
        sink_topic_for: impl Fn(&str) -> String,
    ) -> Built {
        let mut parts = Vec::new();
        let mut sink_next = Vec::new();
        let mut ends = Vec::new();
        for (t, p, end) in after.iter() {
            let start = before.get(t, p).unwrap_or(end);
            let key = (t.to_string(), p);
            let sink_topic = sink_topic_for(t);
            let runs = runs.take(t, p, &sink_topic);
            // Nothing bridged and nothing new: a partition resting after a transaction marker has
            // its consumer position ahead of its checkpoint position at every barrier.
            if runs.is_empty() && (end == start || self.ends.get(&key) == Some(&end)) {
                continue;
            }
            ends.push((key.clone(), end));
            let next = runs
                .iter()
                .max_by_key(|r| r.source_start())
                .map(|r| (r.sink_partition(), r.sink_end()))
                .or_else(|| self.sink_next.get(&key).copied());
            if let Some(n) = next {
                sink_next.push((key, n));
            }
            parts.push(PartitionMap {
                topic: t.to_string(),
                partition: p,
                sink_topic,
                start,
                end,
                runs,
                sink_next: next,
            });
        }
        let runs = parts.iter().map(|p| p.runs.len()).sum();
        let records = chunk(parts, self.max_runs)
            .into_iter()
            .enumerate()
            .map(|(i, partitions)| {
                (
                    format!("{writer}/{id}/{i}"),
                    self.encode(writer, id, time_ms, partitions),
                )
            })
            .collect();
        Built {
            records,
            runs,
            sink_next,
            ends,
        }
    }

    /// The opener of checkpoint `id`'s transaction on the mapping topic (`sink::Openers`): topic,
    /// key and a mapping of no partition, which translation reads as saying nothing.
    pub(crate) fn opener(&self, writer: &str, id: u64, time_ms: i64) -> (String, String, Vec<u8>) {
        (
            self.topic.clone(),
            format!("{writer}/{id}/open"),
            self.encode(writer, id, time_ms, Vec::new()),
        )
    }

    fn encode(
        &self,
        writer: &str,
        id: u64,
        time_ms: i64,
        partitions: Vec<PartitionMap>,
    ) -> Vec<u8> {
        OffsetMap {
            version: MAPPING_VERSION,
            bridge_id: self.bridge_id.clone(),
            writer: writer.to_string(),
            checkpoint_id: id,
            time_ms,
            partitions,
        }
        .encode()
    }

    /// The checkpoint of `built` committed.
    pub(crate) fn committed(&mut self, built: Built) {
        self.sink_next.extend(built.sink_next);
        self.ends.extend(built.ends);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn tracker(max_runs: usize) -> Tracker {
        Tracker {
            bridge_id: "b".into(),
            topic: "m".into(),
            max_runs,
            sink_next: HashMap::new(),
            ends: HashMap::new(),
        }
    }

    fn maps(built: &Built) -> Vec<OffsetMap> {
        built
            .records
            .iter()
            .map(|(_, v)| OffsetMap::decode(v).unwrap())
            .collect()
    }

    #[test]
    fn a_resting_partition_is_written_once_and_its_sink_position_carried() {
        let mut t = tracker(4);
        let topic: Arc<str> = "in".into();
        let mut runs = RunCollector::default();
        // Checkpoint 1: records 0..3 of in/0 at sink 10..13 and one at 5 (a marker at 3, 4).
        for (s, k) in [(0, 10), (1, 11), (2, 12), (5, 14)] {
            runs.record(&topic, 0, s, "out", 0, k);
        }
        let before: Positions = [("in".to_string(), 0, 0)].into_iter().collect();
        let after: Positions = [("in".to_string(), 0, 7)].into_iter().collect();
        let b = t.build("b/0", 1, 1, &before, &after, &mut runs, |_| "out".into());
        assert_eq!(b.runs, 2);
        let m = maps(&b);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].partitions[0].sink_next, Some((0, 15)));
        assert_eq!((m[0].partitions[0].start, m[0].partitions[0].end), (0, 7));
        t.committed(b);
        // Checkpoint 2 read nothing (positions 6 → consumer at 7): nothing to write.
        let committed: Positions = [("in".to_string(), 0, 6)].into_iter().collect();
        let b = t.build("b/0", 2, 2, &committed, &after, &mut runs, |_| "out".into());
        assert!(b.records.is_empty());
        // Checkpoint 3 passed a marker only (end 8): written, with the carried sink position.
        let after: Positions = [("in".to_string(), 0, 8)].into_iter().collect();
        let b = t.build("b/0", 3, 3, &committed, &after, &mut runs, |_| "out".into());
        let m = maps(&b);
        assert_eq!(m[0].partitions[0].runs, vec![]);
        assert_eq!(m[0].partitions[0].sink_next, Some((0, 15)));
    }

    #[test]
    fn the_opener_is_a_mapping_of_no_partition_under_a_key_no_part_has() {
        let t = tracker(4);
        let (topic, key, payload) = t.opener("b/0", 9, 5);
        assert_eq!(topic, "m");
        let m = OffsetMap::decode(&payload).unwrap();
        assert_eq!((m.checkpoint_id, m.writer.as_str()), (9, "b/0"));
        assert!(m.partitions.is_empty(), "{m:?}");
        // The parts of checkpoint 9 are keyed b/0/9/0, b/0/9/1, ...
        assert_eq!(key, "b/0/9/open");
    }
}
