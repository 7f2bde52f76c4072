//! Recovery as the pipeline applies it: load sled, settle the layout from the commit markers
//! (intent, fencing, take-over), restore a savepoint, let `recovery::decide` choose, make sled
//! agree, and assign the source at the start positions (docs/design.md, "Recovery" and
//! "Layouts"). Whose state is whose is judged by `recovery::Slot` alone.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use tracing::{error, info, warn};

use super::{now_ms, Pipeline, CONNECT_DEADLINE};
use crate::checkpoint::{Checkpoint, CheckpointState};
use crate::config::{OutOfRange, StartPosition};
use crate::error::{BridgeError, Result};
use crate::failpoint;
use crate::identity::Identity;
use crate::marker::{layout_transactional_id, read_bridge_markers, Layout, Marker, MARKER_VERSION};
use crate::positions::Positions;
use crate::recovery::{decide, plan_layout, Decision, LayoutPlan, RecoveryOutcome, Slot};
use crate::savepoint::{Restore, RESTORED_PREFIX};
use crate::sink::{fence, Openers};
use crate::status::{self, RunState};

impl Pipeline<'_> {
    /// The instance slot this process runs as: the judge of whose state it finds.
    fn slot(&self) -> Slot<'_> {
        let b = &self.cfg.bridge;
        Slot {
            bridge_id: &b.id,
            instance: b.instance,
            instances: b.instances,
        }
    }

    /// Recovery: decide the starting positions from sled and the newest committed marker, make
    /// sled agree with the decision, and assign the source there.
    pub(super) fn recover(&mut self) -> Result<()> {
        status::update(&self.shared.status, |s| {
            s.state = RunState::Recovering;
            s.partitions_assigned = false;
        });
        // After a rebuild the last commits' checkpoints may still be on the store's writer thread.
        self.store.wait_synced()?;
        let loaded = self.store.load()?;
        for c in &loaded.corrupt {
            warn!(key = %c.key, id = ?c.id, reason = %c.reason, "skipping a corrupt checkpoint");
            self.shared.metrics.corrupt_checkpoints.inc();
            self.store.remove_key(&c.key)?;
        }
        let mut marker = None;
        if self.protocol.recovers_from_markers() {
            match self.settle_layout()? {
                LayoutPlan::Resume { own, .. } => marker = own,
                // No lower layout to take over from: a late instance of the first layout, which
                // starts like the others did, from source.start.
                LayoutPlan::TakeOver { fence, .. } if fence.is_empty() => {}
                LayoutPlan::TakeOver {
                    positions,
                    next_id,
                    identity,
                    layout,
                    ..
                } => {
                    // A restore into this layout before its first commit: the restored checkpoint
                    // is newer than every marker and decides.
                    let restored_here = loaded.checkpoints.iter().any(|c| {
                        c.savepoint
                            .as_deref()
                            .is_some_and(|n| n.starts_with(RESTORED_PREFIX))
                            && self.slot().owns_checkpoint(c)
                            && c.id >= next_id
                    });
                    if self.restore.is_none() && !restored_here {
                        return self.take_over(
                            layout,
                            &loaded.checkpoints,
                            positions,
                            next_id,
                            identity,
                        );
                    }
                }
            }
        }
        let cfg = self.cfg.clone();
        self.pending = None;

        if let Some(restore) = self.restore.take() {
            let tag = restore.tag();
            if loaded
                .checkpoints
                .iter()
                .any(|c| c.savepoint.as_deref() == Some(tag.as_str()))
            {
                info!(tag = %tag, "this state directory already restored these savepoints; resuming normally");
            } else {
                return self.restore_from(&restore, &loaded.checkpoints, marker.as_ref());
            }
        }
        // After a restore into a new layout, the marker partition can still hold the old layout's
        // last marker until the first commit: the restored checkpoint is newer and wins.
        if let Some(m) = &marker {
            let foreign = !self.slot().owns_marker(m);
            let restored_after = loaded.checkpoints.iter().any(|c| {
                c.savepoint
                    .as_deref()
                    .is_some_and(|n| n.starts_with(RESTORED_PREFIX))
                    && c.id > m.checkpoint_id
            });
            if foreign && restored_after {
                marker = None;
            }
        }

        let decision = decide(
            &cfg.bridge.id,
            cfg.bridge.instance,
            cfg.bridge.instances,
            &loaded.checkpoints,
            marker.as_ref(),
            now_ms(),
        )?;
        for w in &decision.warnings {
            warn!(warning = %w, "recovery");
        }
        // Judged before sled is repaired, so that a stop leaves the state directory as it was.
        let positions = self.judge_recovered_identity(&decision)?;
        for id in &decision.discard {
            self.store.discard(*id)?;
        }
        if let Some(id) = decision.confirm {
            self.store.mark_committed(id)?;
        }
        if let Some(c) = &decision.adopt {
            self.store.put_committed(c)?;
        }
        self.last_id = decision.last_committed_id;
        self.start_from(positions, decision.outcome.as_str())
    }

    /// Reads the committed markers of the bridge and settles this process's layout: when the
    /// instance has not committed in its layout yet, it commits the layout's intent marker, fences
    /// the lower layouts' owners of its partitions and reads again, until a read asks to fence no
    /// one new (docs/design.md, "Rescaling"). A newer layout found stops the process.
    fn settle_layout(&mut self) -> Result<LayoutPlan> {
        let cfg = self.cfg.clone();
        let partitions: Vec<(String, i32)> = self
            .topics
            .iter()
            .flat_map(|(t, n)| (0..*n).map(move |p| (t.clone(), p)))
            .collect();
        loop {
            self.refresh_marker_partitions()?;
            let status = &self.shared.status;
            let metrics = &self.shared.metrics;
            let mut waited = Duration::ZERO;
            let found = read_bridge_markers(
                self.sink.settings(),
                self.marker_partitions,
                true,
                CONNECT_DEADLINE,
                &mut |wait| {
                    if let Some(w) = wait {
                        metrics
                            .marker_wait_seconds
                            .inc_by(w.waited.saturating_sub(waited).as_secs_f64());
                        waited = w.waited;
                    }
                    let why = wait.map(|w| {
                        format!(
                            "waiting for another producer's transaction on marker partition {}/{} \
                             (last stable offset {} < high watermark {}) for {:?}",
                            w.topic, w.partition, w.last_stable_offset, w.high_watermark, w.waited
                        )
                    });
                    status::update(status, |s| s.recovery_wait = why);
                },
            );
            status::update(status, |s| s.recovery_wait = None);
            let found = found?;
            let plan = plan_layout(
                &cfg.bridge.id,
                cfg.bridge.instance,
                cfg.bridge.instances,
                self.layout,
                &found,
                &partitions,
            )?;
            let LayoutPlan::TakeOver {
                layout,
                fence: owners,
                ..
            } = &plan
            else {
                status::update(status, |s| s.takeover = None);
                return Ok(plan);
            };
            let layout = *layout;
            if !self.intent_committed {
                status::update(status, |s| {
                    s.takeover = Some(format!("committing the intent marker of {layout}"))
                });
                self.commit_intent(layout)?;
                failpoint::hit("after-intent");
                self.intent_committed = true;
                continue;
            }
            let ids: Vec<String> = owners
                .iter()
                .map(|(l, i)| layout_transactional_id(&cfg.bridge.id, *l, *i))
                .filter(|id| !self.fenced.contains(id))
                .collect();
            if ids.is_empty() {
                status::update(status, |s| s.takeover = None);
                return Ok(plan);
            }
            for id in ids {
                status::update(status, |s| {
                    s.takeover = Some(format!("fencing {id} of an older layout"))
                });
                fence(self.sink.settings(), &id, CONNECT_DEADLINE)?;
                failpoint::hit("after-fence");
                self.fenced.insert(id);
            }
        }
    }

    /// Commits a transaction holding only this instance's intent marker: from its commit on, a
    /// process of a lower layout that starts finds the layout and stops.
    fn commit_intent(&mut self, layout: Layout) -> Result<()> {
        let cfg = &self.cfg.bridge;
        let intent = Marker {
            version: MARKER_VERSION,
            bridge_id: cfg.id.clone(),
            instance: cfg.instance,
            instances: layout.instances,
            checkpoint_id: 0,
            positions: Positions::new(),
            time_ms: now_ms(),
            identity: None,
        };
        self.sink.begin(Openers::default())?;
        let sent = self
            .sink
            .send_marker(&intent)
            .and_then(|()| self.sink.commit(Instant::now() + CONNECT_DEADLINE));
        if let Err(e) = sent {
            let _ = self.sink.abort(CONNECT_DEADLINE);
            return Err(e);
        }
        info!(layout = %layout, "committed the intent marker of a new layout");
        Ok(())
    }

    /// Starts a layout's instance that has not committed in it yet from the positions its
    /// partitions were last committed at in lower layouts. The state directory's checkpoints
    /// belong to a lower layout (or to an earlier attempt of this take-over) and go.
    fn take_over(
        &mut self,
        layout: Layout,
        checkpoints: &[Checkpoint],
        positions: Positions,
        next_id: u64,
        identity: Option<Identity>,
    ) -> Result<()> {
        let cfg = self.cfg.clone();
        let decision = Decision {
            outcome: RecoveryOutcome::TakenOver,
            positions: Some(positions),
            last_committed_id: next_id,
            discard: Vec::new(),
            confirm: None,
            adopt: None,
            warnings: Vec::new(),
            identity: identity.clone(),
            identity_origin: "the commit markers of the previous layout".to_string(),
        };
        let positions = self
            .judge_recovered_identity(&decision)?
            .unwrap_or_default();
        for c in checkpoints {
            self.store.forget(c.id)?;
        }
        self.store.put_committed(&Checkpoint {
            id: next_id,
            bridge_id: cfg.bridge.id.clone(),
            instance: cfg.bridge.instance,
            instances: cfg.bridge.instances,
            state: CheckpointState::Committed,
            positions: positions.clone(),
            created_ms: now_ms(),
            savepoint: None,
            identity,
        })?;
        failpoint::hit("after-takeover");
        info!(
            layout = %layout,
            checkpoint = next_id,
            partitions = positions.len(),
            fenced = ?self.fenced,
            "taking over the partitions of the previous layout"
        );
        self.last_id = next_id;
        self.start_from(Some(positions), RecoveryOutcome::TakenOver.as_str())
    }

    /// Learns the marker topic's partition count anew: a layout with more instances grows it
    /// before it writes its intent there, and a read must cover every partition that exists when it
    /// begins (the intent argument in docs/design.md, "Rescaling").
    fn refresh_marker_partitions(&mut self) -> Result<()> {
        if let Some(n) = self.admin.partitions(&self.cfg.sink.marker_topic)? {
            self.marker_partitions = self.marker_partitions.max(n);
        }
        Ok(())
    }

    /// A fenced process looks for the newer layout that fenced it, to say so.
    pub(super) fn explain_fencing(&mut self, result: Result<()>) -> Result<()> {
        let Err(BridgeError::Fenced { .. }) = &result else {
            return result;
        };
        let Some(layout) = self.layout else {
            return result;
        };
        let found = self.refresh_marker_partitions().and_then(|()| {
            read_bridge_markers(
                self.sink.settings(),
                self.marker_partitions,
                true,
                CONNECT_DEADLINE,
                &mut |_| {},
            )
        });
        if let Ok(found) = found {
            let cfg = &self.cfg.bridge;
            if let Err(e) = plan_layout(
                &cfg.id,
                cfg.instance,
                cfg.instances,
                Some(layout),
                &found,
                &[],
            ) {
                error!(error = %e, "fenced by a newer layout");
                return Err(e.into());
            }
        }
        result
    }

    /// `run --from-savepoint`: the savepoints' positions (of the partitions this instance owns)
    /// become a committed checkpoint numbered above everything seen so far, and the bridge starts
    /// there. Its first commit writes a marker in the new layout.
    fn restore_from(
        &mut self,
        restore: &Restore,
        checkpoints: &[Checkpoint],
        marker: Option<&Marker>,
    ) -> Result<()> {
        let cfg = self.cfg.clone();
        let merged = restore
            .positions(&cfg.bridge.id, cfg.bridge.instance, cfg.bridge.instances)
            .map_err(|e| BridgeError::Restore(e.to_string()))?;
        if let Some(c) = checkpoints.iter().find(|c| !self.slot().owns_checkpoint(c)) {
            return Err(BridgeError::Restore(format!(
                "state directory {} holds checkpoints of bridge '{}' instance {} of {}; restore a savepoint into a \
                 new layout with an empty state directory",
                cfg.bridge.state_dir.display(),
                c.bridge_id,
                c.instance,
                c.instances
            )));
        }
        for c in checkpoints
            .iter()
            .filter(|c| c.state == CheckpointState::Pending)
        {
            self.store.discard(c.id)?;
        }
        let owned = self.source.owned(&self.topics);
        let positions: Positions = owned
            .iter()
            .filter_map(|(t, p)| merged.get(t, *p).map(|o| (t.clone(), *p, o)))
            .collect();
        let id = checkpoints
            .iter()
            .map(|c| c.id)
            .chain(marker.map(|m| m.checkpoint_id))
            .chain([restore.max_checkpoint_id()])
            .max()
            .unwrap_or(0)
            + 1;
        let now = self.restored_identity(restore, &positions)?;
        self.store.put_committed(&self.committed_checkpoint(
            id,
            positions.clone(),
            Some(restore.tag()),
            Some(now),
        ))?;
        info!(tag = %restore.tag(), checkpoint = id, partitions = positions.len(), "restored from savepoint");
        self.last_id = id;
        self.start_from(Some(positions), "restored_from_savepoint")
    }

    /// A committed checkpoint of this instance's layout, stamped now.
    fn committed_checkpoint(
        &self,
        id: u64,
        positions: Positions,
        savepoint: Option<String>,
        identity: Option<Identity>,
    ) -> Checkpoint {
        Checkpoint {
            id,
            bridge_id: self.cfg.bridge.id.clone(),
            instance: self.cfg.bridge.instance,
            instances: self.cfg.bridge.instances,
            state: CheckpointState::Committed,
            positions,
            created_ms: now_ms(),
            savepoint,
            identity,
        }
    }

    /// Assigns the source at `saved` (None: the configured start position), with every owned
    /// partition the positions do not know read from its beginning.
    fn start_from(&mut self, saved: Option<Positions>, outcome: &'static str) -> Result<()> {
        let cfg = self.cfg.clone();
        self.shared
            .metrics
            .recoveries
            .with_label_values(&[outcome])
            .inc();
        let owned = self.source.owned(&self.topics);
        // Nothing committed yet: the start positions an earlier run resolved, if it kept any.
        let first_run = saved.is_none();
        let saved = match saved {
            Some(s) => Some(s),
            None => self.kept_start()?,
        };
        let had_state = saved.is_some();
        let saved = saved.unwrap_or_default();
        let mut positions = Positions::new();
        let mut missing = Vec::new();
        for (t, p) in &owned {
            match saved.get(t, *p) {
                Some(o) => positions.set(t, *p, o),
                None => missing.push((t.clone(), *p)),
            }
        }
        // Partitions a checkpoint does not know appeared after it: read them from their start.
        let start = if had_state {
            StartPosition::Earliest
        } else {
            cfg.source.start
        };
        for (t, p, o) in self.source.resolve(start, &missing)?.iter() {
            positions.set(t, p, o);
        }
        self.check_out_of_range(&mut positions)?;
        if first_run {
            self.store.put_resolved_start(&self.committed_checkpoint(
                0,
                positions.clone(),
                None,
                None,
            ))?;
            if had_state {
                info!(
                    "no checkpoint yet: starting from the start positions kept by an earlier run"
                );
            } else {
                info!(start = %cfg.source.start, "resolved source.start; the positions are kept until the first checkpoint");
            }
        }
        self.source.assign(&positions)?;
        for (t, p, _) in positions.iter() {
            self.shared.metrics.preset_partition(t, p);
        }
        self.committed = positions;
        info!(
            outcome,
            last_checkpoint = self.last_id,
            partitions = self.committed.len(),
            "recovered"
        );
        self.publish_positions();
        status::update(&self.shared.status, |s| {
            s.state = RunState::Running;
            s.partitions_assigned = true;
            s.last_checkpoint_id = self.last_id;
        });
        Ok(())
    }

    /// The start positions a run before the first commit resolved and kept, if they are this
    /// instance's. An unreadable or foreign entry is as good as none: resolve again.
    fn kept_start(&self) -> Result<Option<Positions>> {
        match self.store.resolved_start() {
            Ok(Some(c)) if self.slot().owns_checkpoint(&c) => Ok(Some(c.positions)),
            Ok(Some(c)) => {
                warn!(
                    bridge_id = %c.bridge_id, instance = c.instance, instances = c.instances,
                    "ignoring start positions kept for another bridge or layout; resolving source.start again"
                );
                Ok(None)
            }
            Ok(None) => Ok(None),
            Err(e @ crate::checkpoint::StoreError::Corrupt { .. }) => {
                warn!(error = %e, "ignoring unreadable kept start positions; resolving source.start again");
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Positions that retention has deleted under us: fail, or continue from the earliest record
    /// and count what was lost, as configured.
    pub(super) fn check_out_of_range(&mut self, positions: &mut Positions) -> Result<()> {
        let snapshot: Vec<(String, i32, i64)> = positions
            .iter()
            .map(|(t, p, o)| (t.to_string(), p, o))
            .collect();
        let mut explained = BTreeSet::new();
        let mut restarted = BTreeSet::new();
        for (t, p, o) in snapshot {
            if restarted.contains(&t) {
                continue;
            }
            let (lo, hi) = self.source.watermarks(&t, p)?;
            if o >= lo && o <= hi {
                continue;
            }
            if explained.insert(t.clone()) {
                restarted.extend(self.identity_explains(&t, positions)?);
                if restarted.contains(&t) {
                    continue;
                }
            }
            let lost = if o < lo { lo - o } else { 0 };
            match self.cfg.source.on_offset_out_of_range {
                OutOfRange::Fail => {
                    return Err(BridgeError::OffsetOutOfRange {
                        topic: t,
                        partition: p,
                        position: o,
                        earliest: lo,
                        lost,
                    })
                }
                OutOfRange::Earliest => {
                    error!(
                        topic = %t, partition = p, position = o, earliest = lo, lost,
                        "source records were deleted by retention before they were read; continuing from the earliest"
                    );
                    self.shared
                        .metrics
                        .records_lost
                        .with_label_values(&[t.as_str(), &p.to_string()])
                        .inc_by(lost as u64);
                    positions.set(&t, p, lo);
                }
            }
        }
        Ok(())
    }
}
