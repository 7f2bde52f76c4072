//! The pipeline's identity checks (see `crate::identity`): what the clusters report now, the
//! verdict under `bridge.on_identity_change`, and where the pipeline asks: at recovery, before a
//! checkpoint commits, when a position is out of range, and every discovery interval.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, error, info, warn};

use super::Pipeline;
use crate::admin::Admin;
use crate::config::StartPosition;
use crate::error::{Action, BridgeError, Result};
use crate::identity::{self, Identity, IdentityError, Restart};
use crate::positions::Positions;
use crate::recovery::Decision;
use crate::savepoint::Restore;

/// The abort-class error that makes an epoch or a rewind under `on_identity_change = "restart"`
/// start over from the restarted positions.
fn restart_error(restart: &Restart) -> BridgeError {
    BridgeError::IdentityRestart {
        changes: restart
            .changes
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join("; "),
        topics: format!("{:?} are", restart.topics),
    }
}

impl Pipeline<'_> {
    /// At recovery: the decision's positions, judged against what the clusters report now; under
    /// `restart` without the positions of the topics to bridge again (they start at their
    /// earliest offset). The identity of the positions is set from here on.
    pub(super) fn judge_recovered_identity(
        &mut self,
        decision: &Decision,
    ) -> Result<Option<Positions>> {
        let mut positions = decision.positions.clone();
        let known: BTreeSet<String> = self
            .topics
            .keys()
            .cloned()
            .chain(
                positions
                    .iter()
                    .flat_map(|p| p.iter().map(|(t, _, _)| t.to_string())),
            )
            .collect();
        let now = self.identity_now(&known)?;
        let stored = decision.identity.clone();
        if let Some(restart) =
            self.judge_identity(&decision.identity_origin, stored.as_ref(), &now, &known)?
        {
            if let Some(p) = positions.as_mut() {
                let drop: Vec<(String, i32)> = p
                    .iter()
                    .filter(|(t, _, _)| restart.topics.contains(*t))
                    .map(|(t, part, _)| (t.to_string(), part))
                    .collect();
                for (t, part) in drop {
                    p.remove(&t, part);
                }
            }
        }
        if stored.is_none() && positions.is_some() {
            info!(
                origin = %decision.identity_origin,
                "the committed state predates recorded cluster and topic ids; recording them from the next checkpoint on"
            );
        }
        self.identity = identity::merge(&stored.unwrap_or_default(), &now);
        Ok(positions)
    }

    /// At a restore: what the clusters report now, which the restored checkpoint records. A
    /// restore is the explicit way onto other clusters or topic incarnations: it is not judged,
    /// only logged.
    pub(super) fn restored_identity(
        &mut self,
        restore: &Restore,
        positions: &Positions,
    ) -> Result<Identity> {
        let known: BTreeSet<String> = self
            .topics
            .keys()
            .cloned()
            .chain(positions.iter().map(|(t, _, _)| t.to_string()))
            .collect();
        let now = self.identity_now(&known)?;
        for sp in &restore.savepoints {
            let Some(was) = &sp.identity else { continue };
            for c in identity::compare(was, &now) {
                warn!(savepoint = %sp.name, change = %c, "the savepoint was taken on another cluster or topic incarnation; restoring its positions as they are");
            }
        }
        self.identity = now.clone();
        Ok(now)
    }

    /// What the clusters report now about `sources` and the sink topics they are written to.
    pub(super) fn identity_now(&self, sources: &BTreeSet<String>) -> Result<Identity> {
        let src: Vec<String> = sources.iter().cloned().collect();
        let sinks: Vec<String> = sources
            .iter()
            .map(|t| self.cfg.sink_topic_for(t))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        identity_of(&self.source_admin, &self.admin, &(src, sinks))
    }

    /// The identity verdict under the configured policy. Every change is counted once, whatever
    /// the policy; under `restart` each is also logged at error level once (the caller moves the
    /// positions). Once: a restart found while running is found again by the recovery that
    /// follows an abort, from the marker that still holds the old ids.
    pub(super) fn judge_identity(
        &mut self,
        origin: &str,
        stored: Option<&Identity>,
        now: &Identity,
        known: &BTreeSet<String>,
    ) -> Result<Option<Restart>> {
        let cfg = self.cfg.clone();
        let sink_of = |t: &str| cfg.sink_topic_for(t);
        let metrics = self.shared.metrics.clone();
        let count = |c: &identity::Change| {
            metrics
                .identity_changes
                .with_label_values(&[c.kind()])
                .inc();
        };
        match identity::judge(
            origin,
            stored,
            now,
            cfg.bridge.on_identity_change,
            known,
            &sink_of,
        ) {
            Ok(None) => Ok(None),
            Ok(Some(restart)) => {
                for c in &restart.changes {
                    if !self.reported.insert(c.clone()) {
                        continue;
                    }
                    count(c);
                    error!(
                        kind = c.kind(),
                        change = %c,
                        topics = ?restart.topics,
                        "cluster or topic identity changed; bridge.on_identity_change = \"restart\": \
                         bridging the affected source topics again from their earliest offset"
                    );
                }
                Ok(Some(restart))
            }
            Err(e @ IdentityError { .. }) => {
                e.changes.iter().for_each(count);
                Err(e.into())
            }
        }
    }

    /// Source topics that positions or the last discovery know.
    pub(super) fn known_source_topics(&self) -> BTreeSet<String> {
        self.topics
            .keys()
            .cloned()
            .chain(self.committed.iter().map(|(t, _, _)| t.to_string()))
            .collect()
    }

    /// While running: compares `now` with what the committed positions refer to. Under `restart`
    /// the affected topics' positions move to their earliest offset in `committed` (the caller
    /// assigns or rewinds) and the identity moves on; with no change, ids seen for the first time
    /// (new topics) join the identity.
    pub(super) fn check_identity_now(&mut self, now: &Identity) -> Result<Option<Restart>> {
        let known = self.known_source_topics();
        let origin = format!("checkpoint {}", self.last_id);
        let stored = self.identity.clone();
        let Some(restart) = self.judge_identity(&origin, Some(&stored), now, &known)? else {
            self.identity = identity::merge(&self.identity, now);
            return Ok(None);
        };
        // The partitions the new incarnations have now, which may not be those known so far.
        let found = self.source.discover()?;
        let affected: BTreeMap<String, i32> = found
            .into_iter()
            .filter(|(t, _)| restart.topics.contains(t))
            .collect();
        let start = self
            .source
            .resolve(StartPosition::Earliest, &self.source.owned(&affected))?;
        let mut positions: Positions = self
            .committed
            .iter()
            .filter(|(t, _, _)| !restart.topics.contains(*t))
            .map(|(t, p, o)| (t.to_string(), p, o))
            .collect();
        for (t, p, o) in start.iter() {
            positions.set(t, p, o);
        }
        self.committed = positions;
        self.identity = identity::merge(&self.identity, now);
        Ok(Some(restart))
    }

    /// The periodic check, after discovery so that new topics' ids are recorded at once: another
    /// cluster behind an address (after a reconnect), or a topic created again, found within a
    /// discovery interval even while nothing is read. A failure to ask is retried at the next
    /// interval.
    pub(super) fn check_identity(&mut self) -> Result<()> {
        let now = match self.identity_now(&self.known_source_topics()) {
            Ok(now) => now,
            Err(e) if e.action() == Action::Stop => return Err(e),
            Err(e) => {
                warn!(error = %e, "asking the clusters for their cluster and topic ids failed; will retry");
                return Ok(());
            }
        };
        if self.check_identity_now(&now)?.is_some() {
            self.source.assign(&self.committed)?;
            self.publish_positions();
        }
        Ok(())
    }

    /// Before a checkpoint commits: the topics its epoch read and wrote are still the incarnations
    /// the positions refer to. librdkafka keeps fetching at the old offsets from a topic deleted
    /// and created again when the new one already reaches them (the FIXME in its
    /// rd_kafka_topic_metadata_update), so without this an epoch could commit records of the new
    /// incarnation read from old positions, skipping those before; the periodic check alone would
    /// find that only after the commit. The ids are asked at the barrier, on a thread of their own
    /// while the checkpoint flushes (`identity_of`), and judged here, before the commit.
    pub(super) fn verify_epoch(&mut self, now: &Identity) -> Result<()> {
        match self.check_identity_now(now)? {
            None => Ok(()),
            Some(restart) => Err(restart_error(&restart)),
        }
    }
}

/// The topics an epoch read and wrote, whose ids its checkpoint's commit waits for (None: it read
/// nothing, so it cannot have read a new incarnation).
pub(super) fn epoch_topics(
    consumed: &HashMap<Arc<str>, u64>,
    produced: &HashMap<Arc<str>, u64>,
) -> Option<(Vec<String>, Vec<String>)> {
    if consumed.is_empty() {
        return None;
    }
    let sources = consumed.keys().map(|t| t.to_string()).collect();
    let sinks = produced.keys().map(|t| t.to_string()).collect();
    Some((sources, sinks))
}

/// What the clusters report now about these source and sink topics. Asked through the admin
/// clients, never the consumer: a broker answers one connection's requests in order, so on the
/// consumer's connection this waited behind a fetch held for fetch.wait.max.ms (500 ms) whenever
/// the partitions it fetched had nothing new, and every epoch took half a second.
///
/// The two clusters are asked at once. A checkpoint's commit waits for this answer, and on a busy
/// broker one ask took 1-2 ms at the median but 28-41 ms at its p99, up to 104 ms in a warm-up
/// (session 33, bench/results/20261205-s33-checkpoint-tail.txt); source and sink were seldom slow
/// together, so asking one after the other made the commit wait for the sum of two tails.
pub(super) fn identity_of(
    source_admin: &Admin,
    admin: &Admin,
    (sources, sinks): &(Vec<String>, Vec<String>),
) -> Result<Identity> {
    let started = Instant::now();
    let ask_sink = || (admin.ids(sinks), started.elapsed());
    let (s, k) = std::thread::scope(|scope| {
        let sink = std::thread::Builder::new()
            .name("eos-bridge-ids-sink".into())
            .spawn_scoped(scope, ask_sink);
        let s = (source_admin.ids(sources), started.elapsed());
        let k = match sink {
            Ok(asked) => asked
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            // No thread to spare: ask after the source, as before.
            Err(_) => ask_sink(),
        };
        (s, k)
    });
    debug!(
        source_ms = s.1.as_secs_f64() * 1e3,
        sink_ms = k.1.as_secs_f64() * 1e3,
        "topic ids asked"
    );
    let (s, k) = (s.0?, k.0?);
    Ok(Identity {
        source_cluster: s.cluster_id,
        sink_cluster: k.cluster_id,
        source_topics: s.topic_ids,
        sink_topics: k.topic_ids,
    })
}

impl Pipeline<'_> {
    /// A position outside its partition's offsets is also what a topic deleted and created again
    /// looks like (its offsets start over), so the topic's id is asked before retention is
    /// blamed. Under `stop` a change is the error; under `restart` the restarted topics are set to
    /// their earliest offsets in `positions` too, and returned.
    pub(super) fn identity_explains(
        &mut self,
        topic: &str,
        positions: &mut Positions,
    ) -> Result<BTreeSet<String>> {
        let ids = self.source_admin.ids(&[topic.to_string()])?;
        let now = Identity {
            source_cluster: ids.cluster_id,
            source_topics: ids.topic_ids,
            ..Identity::default()
        };
        let Some(restart) = self.check_identity_now(&now)? else {
            return Ok(BTreeSet::new());
        };
        // `committed` now holds the restarted topics at their earliest offsets.
        let stale: Vec<(String, i32)> = positions
            .iter()
            .filter(|(t, _, _)| restart.topics.contains(*t))
            .map(|(t, p, _)| (t.to_string(), p))
            .collect();
        for (t, p) in stale {
            positions.remove(&t, p);
        }
        for (t, p, o) in self.committed.iter() {
            if restart.topics.contains(t) {
                positions.set(t, p, o);
            }
        }
        Ok(restart.topics)
    }
}
