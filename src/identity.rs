//! Which clusters and which topic incarnations committed positions refer to, and the judgement
//! when the clusters or topics seen now are other ones.
//!
//! An offset means something only in one incarnation of a topic: a source cluster rebuilt behind
//! the same address, or a topic deleted and created again under the same name, numbers its
//! records from 0 again, and resuming at the old positions would silently skip (or re-copy) them.
//! Kafka tells incarnations apart by ids: the cluster id every broker reports, and the topic id
//! (a UUID) a topic gets at creation. Every checkpoint and commit marker records them; recovery
//! and the running pipeline compare them with what the clusters report now.
//!
//! This module is pure, like `recovery`: the pipeline fetches the ids (admin.rs) and applies the
//! verdict. A cluster or topic whose id is not known on one side (a record written before ids were
//! recorded, a topic deleted for the moment) is not a change: nothing can be compared.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::config::IdentityPolicy;

/// How many changed topics a message lists by name before it only counts the others.
const LISTED: usize = 5;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The source cluster's cluster id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_cluster: Option<String>,
    /// The sink cluster's cluster id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sink_cluster: Option<String>,
    /// Source topic name → topic id, in the form Kafka's tools print.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub source_topics: BTreeMap<String, String>,
    /// Sink topic name → topic id.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sink_topics: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Change {
    SourceCluster {
        old: String,
        new: String,
    },
    SinkCluster {
        old: String,
        new: String,
    },
    SourceTopic {
        topic: String,
        old: String,
        new: String,
    },
    SinkTopic {
        topic: String,
        old: String,
        new: String,
    },
}

impl Change {
    pub const KINDS: [&'static str; 4] = [
        "source_cluster",
        "sink_cluster",
        "source_topic",
        "sink_topic",
    ];

    /// The value of the `kind` label of the identity-changes metric.
    pub fn kind(&self) -> &'static str {
        match self {
            Change::SourceCluster { .. } => "source_cluster",
            Change::SinkCluster { .. } => "sink_cluster",
            Change::SourceTopic { .. } => "source_topic",
            Change::SinkTopic { .. } => "sink_topic",
        }
    }

    fn is_topic(&self) -> bool {
        matches!(self, Change::SourceTopic { .. } | Change::SinkTopic { .. })
    }
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Change::SourceCluster { old, new } => write!(
                f,
                "the source cluster id changed from {old:?} to {new:?} (the cluster was rebuilt, or \
                 source.bootstrap_servers now reaches another cluster)"
            ),
            Change::SinkCluster { old, new } => write!(
                f,
                "the sink cluster id changed from {old:?} to {new:?} (the cluster was rebuilt, or \
                 sink.bootstrap_servers now reaches another cluster): the output and commit markers \
                 committed before are not on it"
            ),
            Change::SourceTopic { topic, old, new } => write!(
                f,
                "source topic {topic:?} has a new topic id ({old:?} is now {new:?}): it was \
                 deleted and created again, or its cluster rebuilt, and its offsets start over"
            ),
            Change::SinkTopic { topic, old, new } => write!(
                f,
                "sink topic {topic:?} has a new topic id ({old:?} is now {new:?}): it was deleted \
                 and created again, or its cluster rebuilt, and the output committed to it before \
                 is gone"
            ),
        }
    }
}

/// The changes from `stored` to `now`. Only ids known on both sides are compared.
pub(crate) fn compare(stored: &Identity, now: &Identity) -> Vec<Change> {
    let mut changes = Vec::new();
    if let (Some(old), Some(new)) = (&stored.source_cluster, &now.source_cluster) {
        if old != new {
            changes.push(Change::SourceCluster {
                old: old.clone(),
                new: new.clone(),
            });
        }
    }
    if let (Some(old), Some(new)) = (&stored.sink_cluster, &now.sink_cluster) {
        if old != new {
            changes.push(Change::SinkCluster {
                old: old.clone(),
                new: new.clone(),
            });
        }
    }
    for (topic, old) in &stored.source_topics {
        if let Some(new) = now.source_topics.get(topic).filter(|new| *new != old) {
            changes.push(Change::SourceTopic {
                topic: topic.clone(),
                old: old.clone(),
                new: new.clone(),
            });
        }
    }
    for (topic, old) in &stored.sink_topics {
        if let Some(new) = now.sink_topics.get(topic).filter(|new| *new != old) {
            changes.push(Change::SinkTopic {
                topic: topic.clone(),
                old: old.clone(),
                new: new.clone(),
            });
        }
    }
    changes
}

/// The identity to record from now on: what is seen now, plus the stored ids of what is not seen
/// now (a topic deleted for the moment: positions kept for it still refer to its old incarnation).
pub(crate) fn merge(stored: &Identity, now: &Identity) -> Identity {
    let mut merged = stored.clone();
    if now.source_cluster.is_some() {
        merged.source_cluster = now.source_cluster.clone();
    }
    if now.sink_cluster.is_some() {
        merged.sink_cluster = now.sink_cluster.clone();
    }
    merged.source_topics.extend(
        now.source_topics
            .iter()
            .map(|(t, id)| (t.clone(), id.clone())),
    );
    merged.sink_topics.extend(
        now.sink_topics
            .iter()
            .map(|(t, id)| (t.clone(), id.clone())),
    );
    merged
}

/// The source topics whose positions a change makes meaningless: every one for a cluster, the
/// topic itself for a source topic, and every source topic written to it for a sink topic.
pub(crate) fn affected_topics(
    changes: &[Change],
    source_topics: &BTreeSet<String>,
    sink_topic_of: &dyn Fn(&str) -> String,
) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for c in changes {
        match c {
            Change::SourceCluster { .. } | Change::SinkCluster { .. } => {
                out.extend(source_topics.iter().cloned());
            }
            Change::SourceTopic { topic, .. } => {
                out.insert(topic.clone());
            }
            Change::SinkTopic { topic, .. } => out.extend(
                source_topics
                    .iter()
                    .filter(|s| sink_topic_of(s) == *topic)
                    .cloned(),
            ),
        }
    }
    out
}

/// Under `restart`: the changes, for the log and the metric, and the source topics to bridge
/// again from their earliest offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Restart {
    pub changes: Vec<Change>,
    pub topics: BTreeSet<String>,
}

/// The stop under the default policy: what changed since `origin` was committed, and the ways out.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub struct IdentityError {
    /// What carried the stored identity, e.g. "commit marker 12".
    pub origin: String,
    pub changes: Vec<Change>,
}

impl fmt::Display for IdentityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the positions of {} refer to other clusters or topics than the bridge sees now: ",
            self.origin
        )?;
        // A rebuilt cluster recreates every topic; its cluster change says it all, so long lists
        // of topics are cut short.
        let topics = self.changes.iter().filter(|c| c.is_topic()).count();
        let mut shown = 0;
        let mut parts = Vec::new();
        for c in &self.changes {
            if c.is_topic() {
                if shown == LISTED {
                    continue;
                }
                shown += 1;
            }
            parts.push(c.to_string());
        }
        if topics > shown {
            parts.push(format!("and {} more topics", topics - shown));
        }
        write!(
            f,
            "{}. Resuming at those positions would skip or copy again records, so the bridge stops \
             (bridge.on_identity_change = \"stop\"). To bridge the new topics again from their \
             earliest offset, set bridge.on_identity_change = \"restart\"; to start over, use a \
             fresh state directory and a new bridge.id; if the new cluster holds the same records \
             at the same offsets (a migration that kept offsets), start from a savepoint with \
             run --from-savepoint (see docs/operations.md)",
            parts.join("; ")
        )
    }
}

/// The verdict: Ok(None) when nothing changed, Ok(Some) what to bridge again under `restart`, or
/// the stop under `stop`. `stored` is None when the committed state predates recorded identities
/// (or nothing was committed): then there is nothing to compare.
pub(crate) fn judge(
    origin: &str,
    stored: Option<&Identity>,
    now: &Identity,
    policy: IdentityPolicy,
    source_topics: &BTreeSet<String>,
    sink_topic_of: &dyn Fn(&str) -> String,
) -> Result<Option<Restart>, IdentityError> {
    let Some(stored) = stored else {
        return Ok(None);
    };
    let changes = compare(stored, now);
    if changes.is_empty() {
        return Ok(None);
    }
    match policy {
        IdentityPolicy::Stop => Err(IdentityError {
            origin: origin.to_string(),
            changes,
        }),
        IdentityPolicy::Restart => {
            let topics = affected_topics(&changes, source_topics, sink_topic_of);
            Ok(Some(Restart { changes, topics }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident(cluster: &str, topics: &[(&str, &str)]) -> Identity {
        Identity {
            source_cluster: Some(format!("src-{cluster}")),
            sink_cluster: Some("sink-1".into()),
            source_topics: topics
                .iter()
                .map(|(t, id)| (t.to_string(), id.to_string()))
                .collect(),
            sink_topics: topics
                .iter()
                .map(|(t, id)| (format!("{t}-copy"), format!("s{id}")))
                .collect(),
        }
    }

    fn topics(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn copy_of(t: &str) -> String {
        format!("{t}-copy")
    }

    #[test]
    fn the_same_identity_is_no_change() {
        let a = ident("1", &[("orders", "AAA"), ("payments", "BBB")]);
        assert!(compare(&a, &a).is_empty());
        let v = judge(
            "checkpoint 3",
            Some(&a),
            &a,
            IdentityPolicy::Stop,
            &topics(&["orders"]),
            &copy_of,
        );
        assert_eq!(v, Ok(None));
    }

    #[test]
    fn unknown_ids_are_not_compared() {
        let stored = ident("1", &[("orders", "AAA"), ("gone", "GGG")]);
        // A topic deleted for the moment, and a cluster id the broker did not report.
        let mut now = ident("1", &[("orders", "AAA"), ("new", "NNN")]);
        now.sink_cluster = None;
        assert!(compare(&stored, &now).is_empty());
        assert!(compare(&Identity::default(), &now).is_empty());
        // Nothing stored (a checkpoint written before identities were recorded).
        assert_eq!(
            judge(
                "x",
                None,
                &now,
                IdentityPolicy::Stop,
                &topics(&[]),
                &copy_of
            ),
            Ok(None)
        );
    }

    #[test]
    fn a_recreated_source_topic_is_named_with_both_ids() {
        let stored = ident("1", &[("orders", "AAA"), ("payments", "BBB")]);
        let mut now = stored.clone();
        now.source_topics.insert("orders".into(), "CCC".into());
        let changes = compare(&stored, &now);
        assert_eq!(
            changes,
            vec![Change::SourceTopic {
                topic: "orders".into(),
                old: "AAA".into(),
                new: "CCC".into()
            }]
        );
        let err = judge(
            "commit marker 12",
            Some(&stored),
            &now,
            IdentityPolicy::Stop,
            &topics(&["orders", "payments"]),
            &copy_of,
        )
        .unwrap_err();
        let text = err.to_string();
        for needle in [
            "commit marker 12",
            "source topic \"orders\"",
            "(\"AAA\" is now \"CCC\")",
            "on_identity_change = \"restart\"",
            "fresh state directory",
            "--from-savepoint",
        ] {
            assert!(text.contains(needle), "{needle:?} missing: {text}");
        }
        assert!(!text.contains("payments"), "{text}");

        let restart = judge(
            "commit marker 12",
            Some(&stored),
            &now,
            IdentityPolicy::Restart,
            &topics(&["orders", "payments"]),
            &copy_of,
        )
        .unwrap()
        .unwrap();
        assert_eq!(restart.topics, topics(&["orders"]));
        assert_eq!(restart.changes, changes);
    }

    #[test]
    fn a_rebuilt_source_cluster_touches_every_topic() {
        let stored = ident("1", &[("orders", "AAA"), ("payments", "BBB")]);
        let mut now = ident("2", &[("orders", "XXX"), ("payments", "YYY")]);
        now.sink_topics = stored.sink_topics.clone();
        let changes = compare(&stored, &now);
        let kinds: Vec<&str> = changes.iter().map(Change::kind).collect();
        assert_eq!(kinds, ["source_cluster", "source_topic", "source_topic"]);
        let all = topics(&["orders", "payments", "quiet"]);
        assert_eq!(affected_topics(&changes, &all, &copy_of), all);
        let text = judge(
            "checkpoint 7 in the state directory",
            Some(&stored),
            &now,
            IdentityPolicy::Stop,
            &all,
            &copy_of,
        )
        .unwrap_err()
        .to_string();
        assert!(
            text.contains("source cluster id changed from \"src-1\" to \"src-2\""),
            "{text}"
        );
    }

    #[test]
    fn sink_changes_touch_the_source_topics_written_there() {
        let stored = ident("1", &[("orders", "AAA"), ("payments", "BBB")]);
        let mut now = stored.clone();
        now.sink_topics
            .insert("payments-copy".into(), "sNEW".into());
        let changes = compare(&stored, &now);
        assert_eq!(changes.len(), 1);
        assert_eq!(changes[0].kind(), "sink_topic");
        assert!(changes[0]
            .to_string()
            .contains("output committed to it before is gone"));
        let all = topics(&["orders", "payments"]);
        assert_eq!(
            affected_topics(&changes, &all, &copy_of),
            topics(&["payments"])
        );
        // Many source topics into one sink topic: all of them.
        let into_one = |_: &str| "orders-copy".to_string();
        let changes = vec![Change::SinkTopic {
            topic: "orders-copy".into(),
            old: "a".into(),
            new: "b".into(),
        }];
        assert_eq!(affected_topics(&changes, &all, &into_one), all);

        let mut now = stored.clone();
        now.sink_cluster = Some("sink-2".into());
        let changes = compare(&stored, &now);
        assert_eq!(changes[0].kind(), "sink_cluster");
        assert_eq!(affected_topics(&changes, &all, &copy_of), all);
    }

    #[test]
    fn long_lists_are_cut_short() {
        let names: Vec<String> = (0..12).map(|i| format!("t{i:02}")).collect();
        let old: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "OLD")).collect();
        let new: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "NEW")).collect();
        let stored = ident("1", &old);
        let now = ident("2", &new);
        let err = IdentityError {
            origin: "checkpoint 1".into(),
            changes: compare(&stored, &now),
        };
        let text = err.to_string();
        assert!(text.contains("t04") && !text.contains("t05"), "{text}");
        // 12 source topics and 12 sink topics, 5 named.
        assert!(text.contains("and 19 more topics"), "{text}");
        assert!(text.contains("source cluster id changed"), "{text}");
    }

    #[test]
    fn merge_keeps_what_is_not_seen_now() {
        let stored = ident("1", &[("orders", "AAA"), ("gone", "GGG")]);
        let mut now = ident("2", &[("orders", "CCC"), ("new", "NNN")]);
        now.sink_cluster = None;
        let m = merge(&stored, &now);
        assert_eq!(m.source_cluster.as_deref(), Some("src-2"));
        assert_eq!(m.sink_cluster.as_deref(), Some("sink-1"));
        assert_eq!(m.source_topics["orders"], "CCC");
        assert_eq!(m.source_topics["gone"], "GGG");
        assert_eq!(m.source_topics["new"], "NNN");
        assert_eq!(m.sink_topics["new-copy"], "sNNN");
        assert!(compare(&m, &now).is_empty());
    }

    #[test]
    fn json_form_is_compact_and_tolerant() {
        let a = ident("1", &[("orders", "AAA")]);
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<Identity>(&json).unwrap(), a);
        assert_eq!(serde_json::to_string(&Identity::default()).unwrap(), "{}");
        assert_eq!(
            serde_json::from_str::<Identity>("{}").unwrap(),
            Identity::default()
        );
    }
}
