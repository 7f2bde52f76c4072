//! `eos-bridge offsets translate`: a consumer group's committed source offsets, turned into the
//! sink offsets of the same records through the offset mapping, printed, and with `--apply`
//! committed for the group on the sink cluster.
//!
//! The mapping is read from the mapping topic on the sink cluster (read_committed, so only
//! committed checkpoints count), not from a state directory: it works from any machine, while
//! the bridge runs, and after the source cluster is gone. The source cluster is needed for the
//! group's committed offsets, and for a group that is ahead of the bridge's last checkpoint only by
//! records that are no records (transaction markers, aborted records), which it checks there.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Message, Offset, TopicPartitionList};

use super::mapping::{OffsetMap, PartitionHistory, Translation};
use crate::config::{Config, Delivery, Partitioning};
use crate::error::{BridgeError, Result};
use crate::sink::is_client_wide;
use crate::source::Source;

const TIMEOUT: Duration = Duration::from_secs(15);
/// How long reading the mapping topic to its last stable offset may take.
const READ_DEADLINE: Duration = Duration::from_secs(120);

/// One source partition's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub topic: String,
    pub partition: i32,
    pub source_offset: i64,
    /// (sink topic, sink partition, sink offset) when translated.
    pub sink: Option<(String, i32, i64)>,
    pub detail: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub group: String,
    pub rows: Vec<Row>,
}

impl Report {
    pub fn untranslated(&self) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(|r| r.sink.is_none())
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<32} {:>12}    {:<32} {:>12}  detail",
            "source partition", "offset", "sink partition", "offset"
        );
        for r in &self.rows {
            let (sp, so) = match &r.sink {
                Some((t, p, o)) => (format!("{t}/{p}"), o.to_string()),
                None => ("-".to_string(), "-".to_string()),
            };
            let _ = writeln!(
                out,
                "{:<32} {:>12} -> {:<32} {:>12}  {}",
                format!("{}/{}", r.topic, r.partition),
                r.source_offset,
                sp,
                so,
                r.detail
            );
        }
        out
    }
}

fn client(bootstrap: &str, kafka: &[(String, String)], group: &str) -> ClientConfig {
    let mut cc = ClientConfig::new();
    for (k, v) in kafka {
        if is_client_wide(k) {
            cc.set(k, v);
        }
    }
    cc.set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", "read_committed")
        // No partition EOF events (rdkafka logs each as an error): ends are found by position.
        .set("enable.partition.eof", "false")
        .set("auto.offset.reset", "earliest");
    cc
}

fn props(kafka: &crate::config::KafkaProps) -> Vec<(String, String)> {
    kafka.pairs()
}

/// Why `key` partitioning has no exact translation (docs/design.md, "Offset translation").
pub const KEY_PARTITIONING_REFUSAL: &str = "sink.partitioning = \"key\" spreads the records of \
     each source partition over every sink partition and interleaves several source partitions in \
     each sink partition, so one sink offset per sink partition cannot stand for the group's \
     offsets of several source partitions at once: no exact translation exists, and the bridge \
     keeps no mapping for it. Move such a group by resetting it on the sink (kafka-consumer-groups \
     --reset-offsets --to-datetime) and expect records to be processed again, or use \
     partitioning = \"preserve\"";

/// Parses group offsets in the CSV form `kafka-consumer-groups --reset-offsets --to-current
/// --export --dry-run` prints: `topic,partition,offset` per line.
pub fn parse_offsets_csv(text: &str) -> std::result::Result<BTreeMap<(String, i32), i64>, String> {
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = || format!("line {}: {line:?} is not topic,partition,offset", i + 1);
        let mut parts = line.rsplitn(3, ',');
        let offset = parts
            .next()
            .and_then(|o| o.trim().parse().ok())
            .ok_or_else(bad)?;
        let partition = parts
            .next()
            .and_then(|p| p.trim().parse().ok())
            .ok_or_else(bad)?;
        let topic = parts.next().filter(|t| !t.is_empty()).ok_or_else(bad)?;
        out.insert((topic.to_string(), partition), offset);
    }
    Ok(out)
}

/// Reads the mapping and translates `group`'s committed source offsets: read from the source
/// cluster, or `given` (failover: the source is gone, and the offsets were saved before).
pub fn translate(
    cfg: &Config,
    group: &str,
    given: Option<BTreeMap<(String, i32), i64>>,
) -> Result<Report> {
    if cfg.sink.partitioning == Partitioning::Key {
        return Err(BridgeError::Translate(format!(
            "cannot translate group '{group}': {KEY_PARTITIONING_REFUSAL}"
        )));
    }
    if cfg.bridge.delivery != Delivery::ExactlyOnce {
        return Err(BridgeError::Translate(format!(
            "cannot translate group '{group}': bridge.delivery = \"{}\" writes records more or less than \
             once, so a sink offset does not stand for one source record; only exactly-once keeps a mapping",
            cfg.bridge.delivery
        )));
    }
    let histories = read_mapping(cfg)?;
    let from_source = given.is_none();
    let committed = match given {
        Some(g) => g,
        None => group_offsets(cfg, group)?,
    };

    // A sink partition written from several source partitions (several source topics into one
    // sink topic) cannot take one offset for all of them.
    let mut writers: HashMap<(String, i32), BTreeSet<(String, i32)>> = HashMap::new();
    for ((t, p), (sink_topic, h)) in &histories {
        for q in h
            .runs
            .iter()
            .map(|r| r.sink_partition())
            .chain(h.sink_next.map(|n| n.0))
        {
            writers
                .entry((sink_topic.clone(), q))
                .or_default()
                .insert((t.clone(), *p));
        }
    }

    let source_check = if from_source {
        Some(source_reader(cfg)?)
    } else {
        None
    };
    let mut rows = Vec::new();
    for ((t, p), o) in committed {
        let sink_topic = cfg.sink_topic_for(&t);
        let row = |sink: Option<(i32, i64)>, detail: String| Row {
            topic: t.clone(),
            partition: p,
            source_offset: o,
            sink: sink.map(|(q, k)| (sink_topic.clone(), q, k)),
            detail,
        };
        let Some((_, h)) = histories.get(&(t.clone(), p)) else {
            rows.push(row(
                None,
                "not yet bridged: no retained checkpoint of the bridge read this partition".into(),
            ));
            continue;
        };
        let mut answer = h.translate(o);
        if let (Translation::NotYetBridged { bridged }, Some(c)) = (&answer, &source_check) {
            // Ahead only by offsets that hold no record: the same position as the bridge's.
            if no_records_between(c, &t, p, *bridged, o)? {
                answer = h.translate(*bridged);
            }
        }
        let r = match answer {
            Translation::Record {
                sink_partition,
                sink_offset,
                record,
            } => row(
                Some((sink_partition, sink_offset)),
                if record == o {
                    format!("record {t}/{p}@{o}")
                } else {
                    format!(
                        "next record {t}/{p}@{record} ({} no record: transaction markers, aborted or compacted)",
                        if record - 1 == o {
                            format!("offset {o} holds")
                        } else {
                            format!("offsets {o} to {} hold", record - 1)
                        }
                    )
                },
            ),
            Translation::AfterLast {
                sink_partition,
                sink_offset,
            } => row(
                Some((sink_partition, sink_offset)),
                "after the last bridged record (the group has read everything bridged)".into(),
            ),
            Translation::NotYetBridged { bridged } if from_source => row(
                None,
                format!(
                    "not yet bridged: the bridge has committed this partition up to {bridged}; wait for it \
                     (stop the producers first for a cutover)"
                ),
            ),
            Translation::NotYetBridged { bridged } => row(
                None,
                format!(
                    "beyond what the bridge committed ({bridged}); without the source cluster it cannot be \
                     checked that only transaction markers lie in between, so the group read records the \
                     sink does not have"
                ),
            ),
            Translation::OlderThanRetained { oldest } => row(
                None,
                format!(
                    "older than the retained mapping, which starts at {oldest} (offsets.retention = {:?})",
                    cfg.offsets.retention
                ),
            ),
            Translation::NoRecordRetained | Translation::Unknown => row(
                None,
                "no bridged record of this partition is retained in the mapping, so its sink position is \
                 unknown"
                    .into(),
            ),
        };
        let shared = r.sink.as_ref().and_then(|(st, q, _)| {
            writers
                .get(&(st.clone(), *q))
                .filter(|w| w.len() > 1)
                .cloned()
        });
        match shared {
            Some(w) => rows.push(Row {
                sink: None,
                detail: format!(
                    "sink partition {sink_topic}/{} also receives records of {}: one sink offset cannot stand \
                     for several source partitions' offsets (give each source topic a sink topic of its own)",
                    r.sink.as_ref().map_or(0, |s| s.1),
                    w.iter()
                        .map(|(t, p)| format!("{t}/{p}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                ..r
            }),
            None => rows.push(r),
        }
    }
    Ok(Report {
        group: group.to_string(),
        rows,
    })
}

/// Every retained mapping record of this bridge, by source partition (with its sink topic).
fn read_mapping(cfg: &Config) -> Result<BTreeMap<(String, i32), (String, PartitionHistory)>> {
    let mut cc = client(
        &cfg.sink.bootstrap_servers,
        &props(&cfg.sink.kafka),
        &format!("eos-bridge.{}.offsets-reader", cfg.bridge.id),
    );
    let consumer: BaseConsumer = cc
        .create()
        .map_err(|e| BridgeError::kafka("create mapping reader", e))?;
    // Only for the high watermark the wait below starts from.
    let uncommitted: BaseConsumer = cc
        .set("isolation.level", "read_uncommitted")
        .create()
        .map_err(|e| BridgeError::kafka("create mapping reader", e))?;
    let topic = &cfg.offsets.topic;
    // A checkpoint's mapping records become visible only once its commit is written to the
    // topic, which the coordinator does after the bridge's commit has returned: read now, a
    // checkpoint the bridge reports committed could still be missing (and a prefilled source is
    // often all in the first one). So wait for every record written before this call to be
    // committed or aborted, the bridge's own open transaction included: at most its
    // transaction.timeout, plus the coordinator's sweep when the bridge died with it open.
    let deadline = Instant::now() + cfg.transaction.timeout + crate::stable::EXPIRY_MARGIN;
    let lso = crate::stable::wait_until_stable(
        &consumer,
        &uncommitted,
        topic,
        0,
        "the offset mapping topic",
        deadline,
        &mut |_| {},
    )?
    .map_err(|held| {
        BridgeError::Translate(format!(
            "an open transaction has held back the offset mapping topic '{topic}' for {:?} (last stable \
             offset {}, high watermark {}), longer than transaction.timeout ({:?}) allows a transaction of \
             this bridge: another producer writes to the topic or a transaction hangs. Find it with \
             kafka-transactions.sh find-hanging, abort it (abort --topic {topic} --partition 0 \
             --start-offset OFFSET), then run the translation again",
            held.waited, held.last_stable_offset, held.high_watermark, cfg.transaction.timeout
        ))
    })?;
    let (low, _) = consumer
        .fetch_watermarks(topic, 0, TIMEOUT)
        .map_err(|e| BridgeError::kafka("read the offset mapping topic's offsets", e))?;
    let mut out: BTreeMap<(String, i32), (String, PartitionHistory)> = BTreeMap::new();
    if lso > low {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, 0, Offset::Offset(low))
            .map_err(|e| BridgeError::kafka("assign", e))?;
        consumer
            .assign(&tpl)
            .map_err(|e| BridgeError::kafka("assign", e))?;
        let end = Instant::now() + READ_DEADLINE;
        let mut next = low;
        while next < lso {
            if Instant::now() >= end {
                return Err(BridgeError::Translate(format!(
                    "reading the offset mapping topic '{topic}' did not reach offset {lso} within {READ_DEADLINE:?} \
                     (at {next})"
                )));
            }
            match consumer.poll(Duration::from_millis(200)) {
                // Transaction markers and aborted records are no message: the position says.
                None => next = next.max(position(&consumer, topic, 0).unwrap_or(next)),
                Some(Err(e)) => return Err(BridgeError::kafka("read the offset mapping", e)),
                Some(Ok(m)) => {
                    next = m.offset() + 1;
                    let Some(bytes) = m.payload() else { continue };
                    let map = OffsetMap::decode(bytes).map_err(|e| {
                        BridgeError::Translate(format!("{topic}/0@{}: {e}", m.offset()))
                    })?;
                    if map.bridge_id != cfg.bridge.id {
                        continue;
                    }
                    for pm in &map.partitions {
                        out.entry((pm.topic.clone(), pm.partition))
                            .or_insert_with(|| (pm.sink_topic.clone(), PartitionHistory::default()))
                            .1
                            .add(pm);
                    }
                }
            }
        }
    }
    for (_, h) in out.values_mut() {
        h.seal();
    }
    Ok(out)
}

/// The group's committed offsets on the source cluster, for every partition of the bridge's
/// source topics it has one for.
fn group_offsets(cfg: &Config, group: &str) -> Result<BTreeMap<(String, i32), i64>> {
    let topics = Source::new(cfg)?.discover()?;
    let consumer: BaseConsumer = client(
        &cfg.source.bootstrap_servers,
        &props(&cfg.source.kafka),
        group,
    )
    .create()
    .map_err(|e| BridgeError::kafka("create source group reader", e))?;
    let mut tpl = TopicPartitionList::new();
    for (t, n) in &topics {
        for p in 0..*n {
            tpl.add_partition(t, p);
        }
    }
    let got = consumer
        .committed_offsets(tpl, TIMEOUT)
        .map_err(|e| BridgeError::kafka("read the group's committed offsets", e))?;
    Ok(got
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some(((e.topic().to_string(), e.partition()), o)),
            _ => None,
        })
        .collect())
}

fn source_reader(cfg: &Config) -> Result<BaseConsumer> {
    client(
        &cfg.source.bootstrap_servers,
        &props(&cfg.source.kafka),
        &format!("eos-bridge.{}.offsets-check", cfg.bridge.id),
    )
    .create()
    .map_err(|e| BridgeError::kafka("create source reader", e))
}

/// The consumer's position in a partition: librdkafka moves it over transaction markers and
/// aborted records as it reads them, though they are never returned.
fn position(c: &BaseConsumer, topic: &str, partition: i32) -> Option<i64> {
    match c
        .position()
        .ok()?
        .find_partition(topic, partition)?
        .offset()
    {
        Offset::Offset(o) => Some(o),
        _ => None,
    }
}

/// Whether the source partition holds no committed record in `from..to` (read_committed).
fn no_records_between(c: &BaseConsumer, topic: &str, p: i32, from: i64, to: i64) -> Result<bool> {
    let (_, lso) = c
        .fetch_watermarks(topic, p, TIMEOUT)
        .map_err(|e| BridgeError::kafka("read source offsets", e))?;
    if lso < to {
        return Ok(false);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, p, Offset::Offset(from))
        .map_err(|e| BridgeError::kafka("assign", e))?;
    c.assign(&tpl)
        .map_err(|e| BridgeError::kafka("assign", e))?;
    let end = Instant::now() + TIMEOUT;
    while Instant::now() < end {
        match c.poll(Duration::from_millis(200)) {
            // Past `to` with no record returned: only markers or aborted records lay between.
            None if position(c, topic, p).is_some_and(|at| at >= to) => return Ok(true),
            None => {}
            Some(Ok(m)) => return Ok(m.offset() >= to),
            Some(Err(e)) => return Err(BridgeError::kafka("read the source partition", e)),
        }
    }
    Err(BridgeError::Translate(format!(
        "reading {topic}/{p} from offset {from} on the source returned nothing within {TIMEOUT:?}"
    )))
}

/// Commits the translated offsets for the group on the sink cluster; refuses while the group has
/// members there (a live member would overwrite them, or read from positions about to change).
pub fn apply(cfg: &Config, report: &Report) -> Result<usize> {
    let missing: Vec<String> = report
        .untranslated()
        .map(|r| format!("{}/{}", r.topic, r.partition))
        .collect();
    if !missing.is_empty() {
        return Err(BridgeError::Translate(format!(
            "not applying: {} cannot be translated (see above); a partial cutover would start those partitions \
             from auto.offset.reset",
            missing.join(", ")
        )));
    }
    let consumer: BaseConsumer = client(
        &cfg.sink.bootstrap_servers,
        &props(&cfg.sink.kafka),
        &report.group,
    )
    .create()
    .map_err(|e| BridgeError::kafka("create sink group client", e))?;
    let groups = consumer
        .fetch_group_list(Some(&report.group), TIMEOUT)
        .map_err(|e| BridgeError::kafka("describe the group on the sink", e))?;
    if let Some(g) = groups
        .groups()
        .iter()
        .find(|g| g.name() == report.group && !g.members().is_empty())
    {
        return Err(BridgeError::Translate(format!(
            "not applying: group '{}' has {} active member(s) on the sink cluster (state {}); stop its consumers \
             there first",
            report.group,
            g.members().len(),
            g.state()
        )));
    }
    let mut tpl = TopicPartitionList::new();
    for r in &report.rows {
        if let Some((t, q, k)) = &r.sink {
            tpl.add_partition_offset(t, *q, Offset::Offset(*k))
                .map_err(|e| BridgeError::kafka("commit", e))?;
        }
    }
    consumer
        .commit(&tpl, CommitMode::Sync)
        .map_err(|e| match e {
            KafkaError::ConsumerCommit(
                RDKafkaErrorCode::UnknownMemberId | RDKafkaErrorCode::IllegalGeneration,
            ) => BridgeError::Translate(format!(
                "group '{}' gained members on the sink while applying; stop them and run again",
                report.group
            )),
            e => BridgeError::kafka("commit the translated offsets on the sink", e),
        })?;
    Ok(tpl.count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exported_group_offsets_parse_and_bad_lines_are_named() {
        let got = parse_offsets_csv("orders,0,42\n\nmy,topic.x,11,7\n").unwrap();
        assert_eq!(got[&("orders".to_string(), 0)], 42);
        // Topic names cannot hold commas, but parsing from the right never depends on it.
        assert_eq!(got[&("my,topic.x".to_string(), 11)], 7);
        let err = parse_offsets_csv("orders,0,42\norders,x,1").unwrap_err();
        assert!(err.starts_with("line 2:"), "{err}");
        assert!(parse_offsets_csv("orders,1").is_err());
    }
}
