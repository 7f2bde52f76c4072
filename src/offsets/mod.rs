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
pub struct Built {
    pub records: Vec<(String, Vec<u8>)>,
    pub runs: usize,
    sink_next: Vec<((String, i32), (i32, i64))>,
}

/// The pipeline's side of the mapping: the sink position after the newest bridged record of each
/// source partition, carried from checkpoint to checkpoint in memory.
pub struct Tracker {
    bridge_id: String,
    topic: String,
    max_runs: usize,
    sink_next: HashMap<(String, i32), (i32, i64)>,
}

impl Tracker {
    pub fn new(cfg: &Config) -> Tracker {
        Tracker {
            bridge_id: cfg.bridge.id.clone(),
            topic: cfg.offsets.topic.clone(),
            max_runs: cfg.offsets.max_runs,
            sink_next: HashMap::new(),
        }
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Whether the epoch should end: its mapping reached `offsets.max_runs`.
    pub fn full(&self, runs: usize) -> bool {
        runs >= self.max_runs
    }

    /// The mapping of checkpoint `id` of `writer` (its marker key), which read every partition from
    /// `before` to `after`, with the runs the delivery reports gave. Partitions the checkpoint did
    /// not move are left out: the previous record still describes them.
    #[allow(clippy::too_many_arguments)]
    pub fn build(
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
        for (t, p, end) in after.iter() {
            let start = before.get(t, p).unwrap_or(end);
            if end == start {
                continue;
            }
            let sink_topic = sink_topic_for(t);
            let runs = runs.take(t, p, &sink_topic);
            let key = (t.to_string(), p);
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
                let m = OffsetMap {
                    version: MAPPING_VERSION,
                    bridge_id: self.bridge_id.clone(),
                    writer: writer.to_string(),
                    checkpoint_id: id,
                    time_ms,
                    partitions,
                };
                (format!("{writer}/{id}/{i}"), m.encode())
            })
            .collect();
        Built {
            records,
            runs,
            sink_next,
        }
    }

    /// The checkpoint of `built` committed.
    pub fn committed(&mut self, built: Built) {
        self.sink_next.extend(built.sink_next);
    }
}
