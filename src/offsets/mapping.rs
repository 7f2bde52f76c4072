//! The offset mapping of a checkpoint, and the translation of a source offset through it.
//!
//! Pure code: no Kafka here. The pipeline collects, from the sink's delivery reports, where each
//! bridged record landed; this module keeps that as runs (consecutive source offsets written at
//! consecutive sink offsets of one sink partition), so a checkpoint costs one run per stretch of
//! source log without transaction markers, compacted gaps or aborted records in it, not one entry
//! per record. `translate` answers, for a consumer group's committed source offset, the sink
//! offset at which the same group resumes with no record repeated and none skipped
//! (docs/design.md, "Offset translation").

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Version of the mapping record; a reader refuses versions it does not know.
pub const MAPPING_VERSION: u32 = 1;

/// `count` records with source offsets `source_start..source_start + count`, written to sink
/// partition `sink_partition` at offsets `sink_start..sink_start + count`, in that order.
/// Serialised as a four-number array: a checkpoint can hold thousands of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run(pub i64, pub i32, pub i64, pub i64);

impl Run {
    pub fn source_start(&self) -> i64 {
        self.0
    }
    pub fn sink_partition(&self) -> i32 {
        self.1
    }
    pub fn sink_start(&self) -> i64 {
        self.2
    }
    pub fn count(&self) -> i64 {
        self.3
    }
    /// The source offset after the run's last record.
    pub fn source_end(&self) -> i64 {
        self.0 + self.3
    }
    /// The sink offset after the run's last record.
    pub fn sink_end(&self) -> i64 {
        self.2 + self.3
    }
}

/// What one checkpoint bridged of one source partition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionMap {
    pub topic: String,
    pub partition: i32,
    pub sink_topic: String,
    /// The checkpoint read the partition from this position (the previous checkpoint's)...
    pub start: i64,
    /// ...up to this one (its own): every committed source record in `start..end` is in `runs`,
    /// except records written to a dead-letter topic.
    pub end: i64,
    /// By ascending source offset.
    pub runs: Vec<Run>,
    /// The sink position right after the newest record of this source partition bridged up to
    /// this checkpoint (sink partition, offset), this checkpoint's or an earlier one's; None when
    /// this process has bridged none since it started.
    pub sink_next: Option<(i32, i64)>,
}

/// The mapping record of a checkpoint (or one part of it: a checkpoint with many runs is written
/// as several records, each under `max_runs`, so that none outgrows a Kafka message).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsetMap {
    pub version: u32,
    pub bridge_id: String,
    /// The marker key of the instance and layout that committed it.
    pub writer: String,
    pub checkpoint_id: u64,
    pub time_ms: i64,
    pub partitions: Vec<PartitionMap>,
}

#[derive(Debug, thiserror::Error)]
pub enum MappingError {
    #[error("offset mapping record is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error(
        "offset mapping record has version {found}, this build reads version {MAPPING_VERSION}: upgrade eos-bridge"
    )]
    Version { found: u32 },
}

impl OffsetMap {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a mapping always serializes")
    }

    pub fn decode(bytes: &[u8]) -> Result<OffsetMap, MappingError> {
        let m: OffsetMap = serde_json::from_slice(bytes)?;
        if m.version != MAPPING_VERSION {
            return Err(MappingError::Version { found: m.version });
        }
        Ok(m)
    }
}

/// Runs of one epoch, built from delivery reports as they arrive. Reports of one sink partition
/// arrive in offset order, and under `preserve` a source partition writes to one sink partition,
/// so a run grows record by record; a report that does not continue the newest run starts a new
/// one, which keeps every run true whatever the order (only the count of runs grows).
/// The runs of one source partition, per sink topic it wrote to (its sink topic, and its
/// dead-letter topic if any).
type PerSinkTopic = Vec<(String, Vec<Run>)>;

#[derive(Default, Debug)]
pub struct RunCollector {
    /// Where in `by_source` each source partition's runs are.
    index: HashMap<(Arc<str>, i32), usize>,
    by_source: Vec<PerSinkTopic>,
    /// The source partition and sink topic of the last report, with where their runs are: reports
    /// come a produce batch (one sink partition, hundreds of records) at a time, so nearly every
    /// report finds its runs here without hashing the topic name (at 100 B the delivery report
    /// thread cost 3.5 times the transaction floor's: bench/README.md, "Where the gap goes").
    recent: Option<(Arc<str>, i32, usize, usize)>,
    runs: usize,
}

impl RunCollector {
    pub fn record(
        &mut self,
        source_topic: &Arc<str>,
        source_partition: i32,
        source_offset: i64,
        sink_topic: &str,
        sink_partition: i32,
        sink_offset: i64,
    ) {
        let (s, k) = match &self.recent {
            Some((t, p, s, k))
                if *p == source_partition
                    && (Arc::ptr_eq(t, source_topic) || **t == **source_topic)
                    && self.by_source[*s][*k].0 == sink_topic =>
            {
                (*s, *k)
            }
            _ => {
                let (s, k) = self.locate(source_topic, source_partition, sink_topic);
                self.recent = Some((source_topic.clone(), source_partition, s, k));
                (s, k)
            }
        };
        let runs = &mut self.by_source[s][k].1;
        if let Some(last) = runs.last_mut() {
            if last.sink_partition() == sink_partition
                && last.source_end() == source_offset
                && last.sink_end() == sink_offset
            {
                last.3 += 1;
                return;
            }
        }
        runs.push(Run(source_offset, sink_partition, sink_offset, 1));
        self.runs += 1;
    }

    /// Where the runs of a source partition written to `sink_topic` go, made if new.
    fn locate(&mut self, topic: &Arc<str>, partition: i32, sink_topic: &str) -> (usize, usize) {
        let next = self.by_source.len();
        let s = *self.index.entry((topic.clone(), partition)).or_insert(next);
        if s == next {
            self.by_source.push(Vec::new());
        }
        let per_sink = &mut self.by_source[s];
        let k = match per_sink.iter().position(|(t, _)| t == sink_topic) {
            Some(k) => k,
            None => {
                per_sink.push((sink_topic.to_string(), Vec::new()));
                per_sink.len() - 1
            }
        };
        (s, k)
    }

    /// Runs collected so far.
    pub fn runs(&self) -> usize {
        self.runs
    }

    /// The runs of a source partition written to `sink_topic`, by ascending source offset.
    pub fn take(
        &mut self,
        source_topic: &str,
        source_partition: i32,
        sink_topic: &str,
    ) -> Vec<Run> {
        let key: (Arc<str>, i32) = (source_topic.into(), source_partition);
        let Some(&s) = self.index.get(&key) else {
            return Vec::new();
        };
        let per_sink = &mut self.by_source[s];
        let Some(i) = per_sink.iter().position(|(t, _)| t == sink_topic) else {
            return Vec::new();
        };
        // The sink topics after `i` move: the cached place may be stale.
        self.recent = None;
        let mut runs = per_sink.swap_remove(i).1;
        self.runs -= runs.len();
        runs.sort_by_key(|r| r.source_start());
        runs
    }

    pub fn clear(&mut self) {
        self.index.clear();
        self.by_source.clear();
        self.recent = None;
        self.runs = 0;
    }
}

/// Splits a checkpoint's partition maps into records of at most `max_runs` entries each, counting
/// a run and a partition map's own fields as one entry each (a partition with more runs than fit is
/// split into several maps with the same range), so that neither many runs nor many partitions make
/// a record outgrow a Kafka message.
pub fn chunk(parts: Vec<PartitionMap>, max_runs: usize) -> Vec<Vec<PartitionMap>> {
    let max = max_runs.max(2);
    let mut out: Vec<Vec<PartitionMap>> = Vec::new();
    let mut current: Vec<PartitionMap> = Vec::new();
    let mut used = 0usize;
    for mut p in parts {
        loop {
            if used + 1 >= max && !current.is_empty() {
                out.push(std::mem::take(&mut current));
                used = 0;
            }
            // At least 1: either the record is empty (used = 0, max >= 2) or there was room.
            let room = max - used - 1;
            if p.runs.len() <= room {
                used += 1 + p.runs.len();
                current.push(p);
                break;
            }
            let rest = p.runs.split_off(room);
            let mut head = p.clone();
            head.runs = std::mem::replace(&mut p.runs, rest);
            current.push(head);
            out.push(std::mem::take(&mut current));
            used = 0;
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// Where a group resumes on the sink, or why that cannot be said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Translation {
    /// The record at source offset `record` (the first bridged record at or after the group's
    /// offset) is at this sink offset.
    Record {
        sink_partition: i32,
        sink_offset: i64,
        record: i64,
    },
    /// The group's offset is past every bridged record of the partition up to a checkpoint's end:
    /// it resumes right after the newest of them on the sink.
    AfterLast {
        sink_partition: i32,
        sink_offset: i64,
    },
    /// The group is ahead of what the bridge has committed (the bridge committed up to `bridged`).
    NotYetBridged { bridged: i64 },
    /// The group's offset is below the oldest retained mapping of the partition.
    OlderThanRetained { oldest: i64 },
    /// The mapping covers the offset, but no record of the partition bridged since the bridge's
    /// last start is retained, so the sink position after the last one is unknown.
    NoRecordRetained,
    /// The partition was never seen in the mapping.
    Unknown,
}

/// The mapping of one source partition across the retained checkpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartitionHistory {
    /// Ranges covered, merged; runs by ascending source offset.
    pub start: Option<i64>,
    pub end: Option<i64>,
    pub runs: Vec<Run>,
    /// The `sink_next` of the map with the highest end that has one.
    pub sink_next: Option<(i32, i64)>,
    sink_next_at: i64,
}

impl PartitionHistory {
    /// Adds a checkpoint's map of this partition; maps may come in any order.
    pub fn add(&mut self, m: &PartitionMap) {
        self.start = Some(self.start.map_or(m.start, |s| s.min(m.start)));
        self.end = Some(self.end.map_or(m.end, |e| e.max(m.end)));
        self.runs.extend_from_slice(&m.runs);
        if let Some(next) = m.sink_next {
            if self.sink_next.is_none() || m.end >= self.sink_next_at {
                self.sink_next = Some(next);
                self.sink_next_at = m.end;
            }
        }
    }

    /// Sorts the runs; call once every map is added.
    pub fn seal(&mut self) {
        self.runs.sort_by_key(|r| r.source_start());
        self.runs.dedup();
    }

    /// Translates a group's committed source offset `o` (the next offset it would read).
    pub fn translate(&self, o: i64) -> Translation {
        let (Some(start), Some(end)) = (self.start, self.end) else {
            return Translation::Unknown;
        };
        if o < start {
            return Translation::OlderThanRetained { oldest: start };
        }
        if o > end {
            return Translation::NotYetBridged { bridged: end };
        }
        // The first run holding a record at or after o.
        let i = self.runs.partition_point(|r| r.source_end() <= o);
        if let Some(r) = self.runs.get(i) {
            let record = o.max(r.source_start());
            return Translation::Record {
                sink_partition: r.sink_partition(),
                sink_offset: r.sink_start() + (record - r.source_start()),
                record,
            };
        }
        // Nothing bridged at or after o up to the end: o stands for the position after the last
        // record (it is a transaction marker, an aborted record or a compacted gap).
        match (self.runs.last(), self.sink_next) {
            (_, Some((sink_partition, sink_offset))) => Translation::AfterLast {
                sink_partition,
                sink_offset,
            },
            (Some(r), None) => Translation::AfterLast {
                sink_partition: r.sink_partition(),
                sink_offset: r.sink_end(),
            },
            (None, None) => Translation::NoRecordRetained,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(reports: &[(i64, i32, i64)]) -> Vec<Run> {
        let t: Arc<str> = "in".into();
        let mut c = RunCollector::default();
        for (s, q, k) in reports {
            c.record(&t, 0, *s, "out", *q, *k);
        }
        // Dead letters go to another sink topic and are kept apart.
        c.record(&t, 0, 999, "in.dlq", 0, 5);
        assert_eq!(c.take("in", 0, "in.dlq"), vec![Run(999, 0, 5, 1)]);
        c.take("in", 0, "out")
    }

    #[test]
    fn consecutive_reports_make_one_run_and_gaps_break_it() {
        // Source 10..13, a transaction marker at 13, 14..16; the sink has a marker at 103.
        let runs = collect(&[
            (10, 0, 100),
            (11, 0, 101),
            (12, 0, 102),
            (14, 0, 104),
            (15, 0, 105),
        ]);
        assert_eq!(runs, vec![Run(10, 0, 100, 3), Run(14, 0, 104, 2)]);
        // A source gap alone breaks a run too, and so does a sink gap alone.
        assert_eq!(
            collect(&[(1, 0, 50), (3, 0, 51), (4, 0, 53)]),
            vec![Run(1, 0, 50, 1), Run(3, 0, 51, 1), Run(4, 0, 53, 1)]
        );
        // Out of order reports still give true runs, sorted.
        assert_eq!(
            collect(&[(5, 0, 9), (3, 0, 7), (4, 0, 8)]),
            vec![Run(3, 0, 7, 2), Run(5, 0, 9, 1)]
        );
    }

    proptest::proptest! {
        /// Whatever the interleaving of source partitions, sink topics and takes, the runs are
        /// those of the reports of each (source partition, sink topic) taken on their own.
        #[test]
        fn runs_are_those_of_each_source_partition_and_sink_topic_alone(
            steps in proptest::collection::vec((0usize..2, 0i32..2, 0usize..2, 0i64..3, 0u8..20), 1..200)
        ) {
            let topics: [Arc<str>; 2] = ["a".into(), "b".into()];
            let sinks = ["out", "out.dlq"];
            let mut c = RunCollector::default();
            // Per (topic, partition, sink topic): the reports since its last take, and the next
            // source and sink offsets.
            type Reports = (Vec<(i64, i64)>, i64, i64);
            let mut model: HashMap<(usize, i32, usize), Reports> = HashMap::new();
            for (t, p, k, gap, op) in steps {
                let e = model.entry((t, p, k)).or_insert((Vec::new(), 0, 1000));
                if op == 0 {
                    let runs = c.take(&topics[t], p, sinks[k]);
                    let mut want = RunCollector::default();
                    for (so, ko) in std::mem::take(&mut e.0) {
                        want.record(&topics[t], p, so, sinks[k], 0, ko);
                    }
                    proptest::prop_assert_eq!(runs, want.take(&topics[t], p, sinks[k]));
                } else {
                    // A gap in the source and in the sink sometimes (markers, aborted records).
                    e.1 += gap;
                    e.2 += i64::from(op % 2);
                    c.record(&topics[t], p, e.1, sinks[k], 0, e.2);
                    e.0.push((e.1, e.2));
                    e.1 += 1;
                    e.2 += 1;
                }
            }
            let left: usize = model.values().map(|e| e.0.len()).sum();
            proptest::prop_assert!(c.runs() <= left);
        }
    }

    /// (start, end, runs, sink_next) of a checkpoint's map.
    type Map = (i64, i64, Vec<Run>, Option<(i32, i64)>);

    fn history(maps: &[Map]) -> PartitionHistory {
        let mut h = PartitionHistory::default();
        for (start, end, runs, next) in maps {
            h.add(&PartitionMap {
                topic: "in".into(),
                partition: 0,
                sink_topic: "out".into(),
                start: *start,
                end: *end,
                runs: runs.clone(),
                sink_next: *next,
            });
        }
        h.seal();
        h
    }

    #[test]
    fn translation_of_records_gaps_markers_and_ends() {
        // Checkpoint 1 read 0..6: records 0,1,2 (marker at 3), 4 (aborted 5 has no record... the
        // marker of the aborted transaction at 6 is after end). Checkpoint 2 read 6..12: records
        // 7, 8 then a compacted gap 9..11, record 11; end 12.
        let h = history(&[
            (
                6,
                12,
                vec![Run(7, 2, 20, 2), Run(11, 2, 22, 1)],
                Some((2, 23)),
            ),
            (
                0,
                6,
                vec![Run(0, 2, 10, 3), Run(4, 2, 14, 1)],
                Some((2, 15)),
            ),
        ]);
        let rec = |k, record| Translation::Record {
            sink_partition: 2,
            sink_offset: k,
            record,
        };
        assert_eq!(h.translate(0), rec(10, 0));
        assert_eq!(h.translate(2), rec(12, 2));
        // A transaction marker: the next record.
        assert_eq!(h.translate(3), rec(14, 4));
        // Aborted records and markers between checkpoints.
        assert_eq!(h.translate(5), rec(20, 7));
        assert_eq!(h.translate(6), rec(20, 7));
        assert_eq!(h.translate(8), rec(21, 8));
        // Inside a compacted gap: the first record after it.
        assert_eq!(h.translate(9), rec(22, 11));
        assert_eq!(h.translate(10), rec(22, 11));
        // At the end: after the last record.
        assert_eq!(
            h.translate(12),
            Translation::AfterLast {
                sink_partition: 2,
                sink_offset: 23
            }
        );
        assert_eq!(h.translate(13), Translation::NotYetBridged { bridged: 12 });
        let h = history(&[(6, 12, vec![Run(7, 2, 20, 2)], Some((2, 22)))]);
        assert_eq!(h.translate(2), Translation::OlderThanRetained { oldest: 6 });
        assert_eq!(
            PartitionHistory::default().translate(0),
            Translation::Unknown
        );
    }

    #[test]
    fn a_quiet_checkpoint_carries_the_sink_position_forward() {
        // The newest checkpoint read only a transaction marker (12..13): its sink_next is the
        // carried position; without any retained record or carried position nothing can be said.
        let h = history(&[
            (6, 12, vec![Run(7, 0, 20, 5)], Some((0, 25))),
            (12, 13, vec![], Some((0, 25))),
        ]);
        assert_eq!(
            h.translate(13),
            Translation::AfterLast {
                sink_partition: 0,
                sink_offset: 25
            }
        );
        let h = history(&[(12, 13, vec![], None)]);
        assert_eq!(h.translate(13), Translation::NoRecordRetained);
        assert_eq!(h.translate(12), Translation::NoRecordRetained);
    }

    #[test]
    fn chunks_respect_the_run_bound_and_keep_every_run() {
        let part = |p: i32, n: i64| PartitionMap {
            topic: "in".into(),
            partition: p,
            sink_topic: "out".into(),
            start: 0,
            end: 2 * n,
            runs: (0..n).map(|i| Run(2 * i, p, 3 * i, 1)).collect(),
            sink_next: None,
        };
        let chunks = chunk(vec![part(0, 5), part(1, 0), part(2, 7)], 4);
        assert!(chunks
            .iter()
            .all(|c| c.iter().map(|p| 1 + p.runs.len()).sum::<usize>() <= 4));
        let mut h0 = PartitionHistory::default();
        let mut h2 = PartitionHistory::default();
        for m in chunks.iter().flatten() {
            match m.partition {
                0 => h0.add(m),
                2 => h2.add(m),
                _ => assert!(m.runs.is_empty()),
            }
        }
        assert_eq!(h0.runs.len(), 5);
        assert_eq!(h2.runs.len(), 7);
        assert_eq!(chunks.len(), 5);
        // Many partitions without runs are split too.
        let many: Vec<PartitionMap> = (0..10).map(|p| part(p, 0)).collect();
        assert_eq!(chunk(many, 4).len(), 4);
        assert_eq!(chunk(vec![part(0, 3)], 1).len(), 3);
    }

    #[test]
    fn mapping_records_round_trip_and_refuse_unknown_versions() {
        let m = OffsetMap {
            version: MAPPING_VERSION,
            bridge_id: "b".into(),
            writer: "b/0".into(),
            checkpoint_id: 3,
            time_ms: 1,
            partitions: vec![PartitionMap {
                topic: "in".into(),
                partition: 1,
                sink_topic: "out".into(),
                start: 0,
                end: 4,
                runs: vec![Run(0, 1, 7, 4)],
                sink_next: Some((1, 11)),
            }],
        };
        let bytes = m.encode();
        assert!(String::from_utf8_lossy(&bytes).contains("[[0,1,7,4]]"));
        assert_eq!(OffsetMap::decode(&bytes).unwrap(), m);
        let mut v = m.clone();
        v.version = 9;
        assert!(OffsetMap::decode(&v.encode())
            .unwrap_err()
            .to_string()
            .contains("version 9"));
    }
}
