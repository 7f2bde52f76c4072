//! Mirror-grade sink topics: which source topic configs a new sink topic gets, and whether an
//! existing sink topic can hold what its source topic holds. Pure functions over what the two
//! clusters reported (`admin::Admin::topic_configs`), so every rule is unit-tested.
//!
//! A sink topic the bridge creates gets the source topic's partition count and every config the
//! source cluster reports as not its hard-coded default (topic overrides and broker-level ones,
//! as MirrorMaker 2 does), minus [`EXCLUDED`] and `sink.topic_config_exclude`. A sink topic that
//! already exists is judged by [`judge`]: a mismatch that loses or refuses records the source
//! keeps is a refusal at start-up (exit 2) and a FAIL in `check`; one that only changes how long
//! or how large is a warning.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::Partitioning;

/// Topic configs never copied to a sink topic, each with why. An entry ending in `*` is a prefix.
pub(crate) const EXCLUDED: &[(&str, &str)] = &[
    (
        "follower.replication.throttled.replicas",
        "names broker ids of the source cluster",
    ),
    (
        "leader.replication.throttled.replicas",
        "names broker ids of the source cluster",
    ),
    (
        "min.insync.replicas",
        "depends on the sink cluster's size and sink.replication_factor: a source value above \
         them would refuse every write",
    ),
    (
        "unclean.leader.election.enable",
        "a durability choice of the sink cluster's operators, not of the source",
    ),
    (
        "message.timestamp.type",
        "LogAppendTime at the sink would replace the source timestamps the bridge keeps",
    ),
    (
        "message.timestamp.difference.max.ms",
        "bridged records keep their source timestamps, which are older than the sink's append \
         time by the bridge's lag: a bound the source checked at append would refuse a backlog",
    ),
    (
        "message.timestamp.before.max.ms",
        "as message.timestamp.difference.max.ms",
    ),
    (
        "message.timestamp.after.max.ms",
        "as message.timestamp.difference.max.ms (the sink's clock is not the source's)",
    ),
    (
        "remote.storage.enable",
        "tiered storage is a capability of the sink cluster; creating the topic fails without it",
    ),
    ("local.retention.ms", "only meaningful with tiered storage"),
    (
        "local.retention.bytes",
        "only meaningful with tiered storage",
    ),
    (
        "confluent.*",
        "vendor settings (placement constraints, tiering) that name the source cluster's racks \
         and features",
    ),
];

/// What a cluster reported about one topic's configs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TopicConfigs {
    /// Every config with a value: name → (value, whether it is the hard-coded default).
    pub entries: BTreeMap<String, (String, bool)>,
}

impl TopicConfigs {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.entries.get(name).map(|(v, _)| v.as_str())
    }

    fn number(&self, name: &str) -> Option<i64> {
        self.get(name).and_then(|v| v.trim().parse().ok())
    }

    fn policy(&self) -> BTreeSet<String> {
        self.get("cleanup.policy")
            .unwrap_or("delete")
            .split(',')
            .map(|p| p.trim().to_ascii_lowercase())
            .filter(|p| !p.is_empty())
            .collect()
    }

    fn compacted(&self) -> bool {
        self.policy().contains("compact")
    }

    fn deletes(&self) -> bool {
        self.policy().contains("delete")
    }
}

/// Whether `name` is excluded by [`EXCLUDED`] or by one of `extra` (same `*` rule).
pub(crate) fn excluded(name: &str, extra: &[String]) -> bool {
    let hit = |pattern: &str| match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == pattern,
    };
    EXCLUDED.iter().any(|(p, _)| hit(p)) || extra.iter().any(|p| hit(p))
}

/// The configs a new sink topic of this source topic is created with.
pub(crate) fn copied(source: &TopicConfigs, extra_exclude: &[String]) -> Vec<(String, String)> {
    source
        .entries
        .iter()
        .filter(|(name, (_, is_default))| !is_default && !excluded(name, extra_exclude))
        .map(|(name, (value, _))| (name.clone(), value.clone()))
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Severity {
    /// Records the source keeps would be lost or refused at the sink: do not start.
    Refuse,
    /// The sink keeps less, or differently: start, and say so.
    Warn,
}

/// One way an existing sink topic differs from its source topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Breach {
    pub severity: Severity,
    pub sink_topic: String,
    pub setting: &'static str,
    /// What differs and what it does to the records.
    pub problem: String,
    pub fix: String,
}

impl std::fmt::Display for Breach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "sink topic '{}' {}: {}; fix: {}",
            self.sink_topic, self.setting, self.problem, self.fix
        )
    }
}

fn alter(sink_topic: &str, config: &str) -> String {
    format!(
        "kafka-configs.sh --bootstrap-server <sink> --alter --entity-type topics --entity-name {sink_topic} \
         --add-config {config}"
    )
}

fn finite(v: Option<i64>) -> Option<i64> {
    v.filter(|n| *n >= 0)
}

/// Judges an existing sink topic against its source topic. Partition counts under `preserve`
/// are the pipeline's business (it grows the sink), so only configs are judged here.
pub(crate) fn judge(
    source_topic: &str,
    sink_topic: &str,
    source: &TopicConfigs,
    sink: &TopicConfigs,
) -> Vec<Breach> {
    let mut out = Vec::new();
    let mut breach = |severity, setting, problem: String, fix: String| {
        out.push(Breach {
            severity,
            sink_topic: sink_topic.to_string(),
            setting,
            problem,
            fix,
        })
    };
    let source_policy = source.get("cleanup.policy").unwrap_or("delete").to_string();
    let sink_policy = sink.get("cleanup.policy").unwrap_or("delete").to_string();
    let sink_retention_ms = finite(sink.number("retention.ms"));
    let sink_retention_bytes = finite(sink.number("retention.bytes"));
    if source.compacted() && !sink.compacted() {
        let limit = match (sink_retention_ms, sink_retention_bytes) {
            (Some(ms), _) => Some(format!("retention.ms={ms}")),
            (None, Some(bytes)) => Some(format!("retention.bytes={bytes}")),
            (None, None) => None,
        };
        let fix = alter(sink_topic, &format!("cleanup.policy=[{source_policy}]"));
        match limit {
            // A key's only record, older than retention (timestamps are the source's), vanishes
            // at the sink while the compacted source keeps it for good.
            Some(limit) => breach(
                Severity::Refuse,
                "cleanup.policy",
                format!(
                    "is {sink_policy} with {limit} but source topic '{source_topic}' is {source_policy}: the \
                     latest record of a key is deleted at the sink by retention (at once, if its timestamp \
                     is old) while the source keeps it"
                ),
                fix,
            ),
            None => breach(
                Severity::Warn,
                "cleanup.policy",
                format!(
                    "is {sink_policy} without retention but source topic '{source_topic}' is {source_policy}: \
                     nothing is lost, but overwritten values and tombstones are never cleaned up"
                ),
                fix,
            ),
        }
    }
    if !source.compacted() && sink.compacted() {
        breach(
            Severity::Refuse,
            "cleanup.policy",
            format!(
                "is {sink_policy} but source topic '{source_topic}' is {source_policy}: records with the same \
                 key collapse to the newest at the sink, and a compacted topic refuses records without a key"
            ),
            alter(sink_topic, &format!("cleanup.policy={source_policy}")),
        );
    }
    // A compacted source into a non-compacted sink is reported above, with the fix that makes the
    // sink's retention moot.
    if sink.deletes() && (sink.compacted() || !source.compacted()) {
        let source_ms = if source.deletes() {
            finite(source.number("retention.ms"))
        } else {
            None
        };
        if let Some(sink_ms) = sink_retention_ms {
            if source_ms.is_none_or(|s| s > sink_ms) {
                breach(
                    Severity::Warn,
                    "retention.ms",
                    format!(
                        "is {sink_ms} but source topic '{source_topic}' keeps records {}: records are deleted at \
                         the sink before the source deletes them, at once if their timestamps are that old",
                        source_ms.map_or("for good".to_string(), |s| format!("for {s} ms"))
                    ),
                    alter(
                        sink_topic,
                        &format!("retention.ms={}", source_ms.unwrap_or(-1)),
                    ),
                );
            }
        }
    }
    if let (Some(src), Some(snk)) = (
        source.number("max.message.bytes"),
        sink.number("max.message.bytes"),
    ) {
        if snk < src {
            breach(
                Severity::Warn,
                "max.message.bytes",
                format!(
                    "is {snk} but source topic '{source_topic}' accepts {src}: a record larger than {snk} is \
                     refused by the sink and handled by sink.on_bad_record"
                ),
                alter(sink_topic, &format!("max.message.bytes={src}")),
            );
        }
    }
    if sink
        .get("message.timestamp.type")
        .is_some_and(|t| t.eq_ignore_ascii_case("LogAppendTime"))
    {
        breach(
            Severity::Warn,
            "message.timestamp.type",
            "is LogAppendTime: the sink broker replaces the source timestamps the bridge writes"
                .into(),
            alter(sink_topic, "message.timestamp.type=CreateTime"),
        );
    }
    out
}

/// What a sink topic with `sink_partitions` needs under `partitioning`, for a source topic with
/// `source_partitions`: None when it fits.
pub(crate) fn partition_note(
    partitioning: Partitioning,
    source_topic: &str,
    source_partitions: i32,
    sink_topic: &str,
    sink_partitions: i32,
) -> Option<String> {
    (partitioning == Partitioning::Preserve && sink_partitions < source_partitions).then(|| {
        format!(
            "sink topic '{sink_topic}' has {sink_partitions} partitions but source topic '{source_topic}' has \
             {source_partitions}: sink.partitioning = \"preserve\" grows it to {source_partitions} at start-up \
             (the bridge needs Alter on the topic)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configs(set: &[(&str, &str)], defaults: &[(&str, &str)]) -> TopicConfigs {
        let mut c = TopicConfigs::default();
        for (k, v) in defaults {
            c.entries.insert(k.to_string(), (v.to_string(), true));
        }
        for (k, v) in set {
            c.entries.insert(k.to_string(), (v.to_string(), false));
        }
        c
    }

    #[test]
    fn only_set_and_not_excluded_configs_are_copied() {
        let source = configs(
            &[
                ("cleanup.policy", "compact"),
                ("retention.ms", "86400000"),
                ("min.insync.replicas", "2"),
                ("leader.replication.throttled.replicas", "0:1"),
                ("confluent.placement.constraints", "{}"),
                ("segment.ms", "60000"),
            ],
            &[
                ("max.message.bytes", "1048588"),
                ("compression.type", "producer"),
            ],
        );
        let got = copied(&source, &["segment.*".to_string()]);
        assert_eq!(
            got,
            vec![
                ("cleanup.policy".to_string(), "compact".to_string()),
                ("retention.ms".to_string(), "86400000".to_string()),
            ]
        );
    }

    #[test]
    fn a_compacted_source_into_a_delete_sink_with_retention_is_refused() {
        let source = configs(&[("cleanup.policy", "compact")], &[]);
        let sink = configs(
            &[],
            &[("cleanup.policy", "delete"), ("retention.ms", "604800000")],
        );
        let b = judge("s", "k", &source, &sink);
        assert_eq!(b.len(), 1, "{b:?}");
        assert_eq!(b[0].severity, Severity::Refuse);
        assert_eq!(b[0].setting, "cleanup.policy");
        assert!(b[0].fix.contains("cleanup.policy=[compact]"), "{}", b[0]);
        // compact,delete keeps the source's retention: a shorter one at the sink is a warning.
        let both = configs(
            &[("cleanup.policy", "compact,delete"), ("retention.ms", "10")],
            &[],
        );
        let sink = configs(
            &[("cleanup.policy", "compact,delete"), ("retention.ms", "5")],
            &[],
        );
        let b = judge("s", "k", &both, &sink);
        assert_eq!(b.len(), 1, "{b:?}");
        assert_eq!(
            (b[0].setting, b[0].severity),
            ("retention.ms", Severity::Warn)
        );

        let forever = configs(&[("retention.ms", "-1")], &[("cleanup.policy", "delete")]);
        let b = judge("s", "k", &source, &forever);
        assert_eq!(b.len(), 1, "{b:?}");
        assert_eq!(b[0].severity, Severity::Warn);
    }

    #[test]
    fn a_delete_source_into_a_compacted_sink_is_refused() {
        let source = configs(
            &[],
            &[("cleanup.policy", "delete"), ("retention.ms", "1000")],
        );
        let sink = configs(&[("cleanup.policy", "compact")], &[]);
        let b = judge("s", "k", &source, &sink);
        assert_eq!(b.len(), 1, "{b:?}");
        assert_eq!(b[0].severity, Severity::Refuse);
        assert!(b[0].problem.contains("without a key"), "{}", b[0]);
    }

    #[test]
    fn matching_topics_pass_and_smaller_limits_warn() {
        let source = configs(
            &[
                ("cleanup.policy", "compact,delete"),
                ("retention.ms", "1000"),
                ("max.message.bytes", "2000000"),
            ],
            &[],
        );
        assert!(judge("s", "k", &source, &source).is_empty());
        let sink = configs(
            &[
                ("cleanup.policy", "compact,delete"),
                ("retention.ms", "500"),
                ("max.message.bytes", "1000000"),
                ("message.timestamp.type", "LogAppendTime"),
            ],
            &[],
        );
        let b = judge("s", "k", &source, &sink);
        let settings: Vec<_> = b.iter().map(|b| (b.setting, b.severity)).collect();
        assert_eq!(
            settings,
            vec![
                ("retention.ms", Severity::Warn),
                ("max.message.bytes", Severity::Warn),
                ("message.timestamp.type", Severity::Warn),
            ]
        );
    }

    #[test]
    fn preserve_needs_as_many_partitions() {
        assert!(partition_note(Partitioning::Preserve, "s", 3, "k", 2).is_some());
        assert!(partition_note(Partitioning::Preserve, "s", 3, "k", 4).is_none());
        assert!(partition_note(Partitioning::Key, "s", 3, "k", 1).is_none());
    }

    #[test]
    fn every_exclusion_has_a_reason() {
        assert!(EXCLUDED.iter().all(|(_, why)| !why.is_empty()));
        assert!(excluded("confluent.tier.enable", &[]));
        assert!(!excluded("cleanup.policy", &[]));
        assert!(excluded("segment.bytes", &["segment.bytes".into()]));
    }
}
