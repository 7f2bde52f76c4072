//! The recovery decision at start-up, as a pure function of what was observed.
//!
//! This module owns step 4 of recovery (docs/design.md): from the checkpoints that sled still holds
//! and the newest committed commit marker, decide where to resume and how to repair sled. It does
//! no I/O, so every crash interleaving can be tested exhaustively here; the caller loads, reads the
//! marker, and applies the decision.
//!
//! The marker is the authority on what was committed: it is written inside the transaction, so it
//! is visible exactly when the transaction committed. sled's "committed" state is also proof of a
//! commit (it is only set after `commit_transaction` returned), but sled can lose updates or its
//! whole directory, so it is never the only record. A pending checkpoint is proof of nothing.

use std::collections::BTreeSet;

use thiserror::Error;

use crate::checkpoint::{Checkpoint, CheckpointState};
use crate::identity::Identity;
use crate::marker::{marker_key, FoundMarker, Layout, Marker};
use crate::positions::Positions;
use crate::source::owns;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecoveryOutcome {
    /// Nothing was ever committed: start from the configured start position.
    Fresh,
    /// Resume from a checkpoint whose commit is proven; nothing uncommitted was found.
    Committed,
    /// Checkpoints that never committed were discarded: their epoch is redone.
    RolledBack,
    /// The marker is ahead of sled: its positions are adopted and written back to sled.
    AdoptedFromMarker,
    /// A new layout: the partitions' positions were taken over from the previous layout's markers.
    TakenOver,
}

impl RecoveryOutcome {
    pub(crate) const ALL: [RecoveryOutcome; 5] = [
        RecoveryOutcome::Fresh,
        RecoveryOutcome::Committed,
        RecoveryOutcome::RolledBack,
        RecoveryOutcome::AdoptedFromMarker,
        RecoveryOutcome::TakenOver,
    ];

    /// The value of the `outcome` label of the recoveries metric.
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            RecoveryOutcome::Fresh => "fresh",
            RecoveryOutcome::Committed => "committed",
            RecoveryOutcome::RolledBack => "rolled_back",
            RecoveryOutcome::AdoptedFromMarker => "adopted_from_marker",
            RecoveryOutcome::TakenOver => "taken_over",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decision {
    pub outcome: RecoveryOutcome,
    /// Where to start; None means "no committed state: use the configured start position".
    pub positions: Option<Positions>,
    /// Id of the last committed checkpoint (0 if none); the next epoch is last_committed_id + 1.
    pub last_committed_id: u64,
    /// Pending checkpoint ids to delete from sled (never committed), ascending.
    pub discard: Vec<u64>,
    /// A pending checkpoint that the marker proves committed: mark it committed in sled.
    pub confirm: Option<u64>,
    /// When the marker is ahead of sled: the checkpoint to write to sled as committed (built from the marker).
    pub adopt: Option<Checkpoint>,
    /// Human-readable warnings for the log (e.g. marker topic lost).
    pub warnings: Vec<String>,
    /// The clusters and topic incarnations the chosen positions refer to, when recorded, and
    /// what recorded them ("commit marker 12"), for `identity::judge`.
    pub identity: Option<Identity>,
    pub identity_origin: String,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RecoveryError {
    #[error(
        "{origin} belongs to bridge {found_bridge_id:?} instance {found_instance} of \
         {found_instances}, but this process is configured as bridge {bridge_id:?} instance \
         {instance} of {instances}. To change the number of instances, take a savepoint with the \
         old layout and start the new one from it; to start over, use a fresh state directory and \
         a new bridge id; otherwise fix bridge.id, bridge.instance and bridge.instances"
    )]
    LayoutMismatch {
        /// What carried the foreign layout, e.g. "checkpoint 12 in the state directory".
        origin: String,
        found_bridge_id: String,
        found_instance: u32,
        found_instances: u32,
        bridge_id: String,
        instance: u32,
        instances: u32,
    },
}

/// The instance slot a process runs as: bridge id, instance, and the number of instances of its
/// layout. It is the one judge of whether a checkpoint, a commit marker or kept start positions
/// are this process's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot<'a> {
    pub bridge_id: &'a str,
    pub instance: u32,
    pub instances: u32,
}

impl Slot<'_> {
    /// Whether state written by `bridge_id` instance `instance` of `instances` is this slot's.
    pub(crate) fn is(&self, bridge_id: &str, instance: u32, instances: u32) -> bool {
        (bridge_id, instance, instances) == (self.bridge_id, self.instance, self.instances)
    }

    pub(crate) fn owns_checkpoint(&self, c: &Checkpoint) -> bool {
        self.is(&c.bridge_id, c.instance, c.instances)
    }

    pub(crate) fn owns_marker(&self, m: &Marker) -> bool {
        self.is(&m.bridge_id, m.instance, m.instances)
    }

    /// A layout mismatch as the error that stops recovery; `origin` names what carried it.
    fn judge(
        &self,
        origin: impl FnOnce() -> String,
        found: (&str, u32, u32),
    ) -> Result<(), RecoveryError> {
        if self.is(found.0, found.1, found.2) {
            return Ok(());
        }
        Err(RecoveryError::LayoutMismatch {
            origin: origin(),
            found_bridge_id: found.0.to_string(),
            found_instance: found.1,
            found_instances: found.2,
            bridge_id: self.bridge_id.to_string(),
            instance: self.instance,
            instances: self.instances,
        })
    }
}

/// Decides where to resume. `checkpoints` are the decodable checkpoints of the state directory in
/// any order; `marker` is this instance's newest committed marker, if the marker topic has one.
pub(crate) fn decide(
    bridge_id: &str,
    instance: u32,
    instances: u32,
    checkpoints: &[Checkpoint],
    marker: Option<&Marker>,
    now_ms: i64,
) -> Result<Decision, RecoveryError> {
    let slot = Slot {
        bridge_id,
        instance,
        instances,
    };
    if let Some(m) = marker {
        slot.judge(
            || format!("commit marker {}", m.checkpoint_id),
            (&m.bridge_id, m.instance, m.instances),
        )?;
    }
    for c in checkpoints {
        slot.judge(
            || format!("checkpoint {} in the state directory", c.id),
            (&c.bridge_id, c.instance, c.instances),
        )?;
    }

    let newest_committed = checkpoints
        .iter()
        .filter(|c| c.state == CheckpointState::Committed)
        .max_by_key(|c| c.id);
    let mut warnings = Vec::new();

    // Choose the checkpoint to resume from: the newer of the marker and sled's newest committed
    // checkpoint, both being proof of a commit. Ties go to the marker, the authority.
    let mut confirm = None;
    let mut adopt = None;
    let (chosen_id, positions, adopted) = match (marker, newest_committed) {
        (Some(m), Some(c)) if c.id > m.checkpoint_id => {
            warnings.push(format!(
                "the newest commit marker of {} is for checkpoint {} ({}), older than committed \
                 checkpoint {} in the state directory: the marker topic was reset or truncated; \
                 resuming from checkpoint {}, whose commit was confirmed",
                marker_key(bridge_id, instance),
                m.checkpoint_id,
                age(m.time_ms, now_ms),
                c.id,
                c.id
            ));
            (Some(c.id), Some(c.positions.clone()), false)
        }
        (Some(m), _) => {
            let id = m.checkpoint_id;
            match checkpoints.iter().find(|c| c.id == id) {
                Some(same) => {
                    if same.state == CheckpointState::Pending
                        && !checkpoints
                            .iter()
                            .any(|c| c.id == id && c.state == CheckpointState::Committed)
                    {
                        confirm = Some(id);
                    }
                    if same.positions != m.positions {
                        warnings.push(format!(
                            "checkpoint {id} in the state directory holds other positions than \
                             its commit marker; resuming from the marker's, which were committed"
                        ));
                    }
                    (Some(id), Some(m.positions.clone()), false)
                }
                None => {
                    let newest_usable = checkpoints
                        .iter()
                        .filter(|c| c.id <= id)
                        .map(|c| c.id)
                        .max()
                        .map_or_else(|| "none".to_string(), |n| n.to_string());
                    warnings.push(format!(
                        "the state directory holds no checkpoint {id} (newest usable one at or \
                         below it: {newest_usable}), but the commit marker proves it committed \
                         ({}): the process stopped before the fsync that follows each commit, \
                         or the state directory is new or its entry corrupt; adopting the \
                         marker's positions",
                        age(m.time_ms, now_ms)
                    ));
                    adopt = Some(Checkpoint {
                        id,
                        bridge_id: m.bridge_id.clone(),
                        instance: m.instance,
                        instances: m.instances,
                        state: CheckpointState::Committed,
                        positions: m.positions.clone(),
                        created_ms: m.time_ms,
                        savepoint: None,
                        identity: m.identity.clone(),
                    });
                    (Some(id), Some(m.positions.clone()), true)
                }
            }
        }
        (None, Some(c)) => {
            warnings.push(format!(
                "the marker topic holds no marker for this instance (key {}): it was deleted or \
                 recreated; resuming from committed checkpoint {} in the state directory",
                marker_key(bridge_id, instance),
                c.id
            ));
            (Some(c.id), Some(c.positions.clone()), false)
        }
        (None, None) => (None, None, false),
    };

    // Every pending checkpoint other than a confirmed one goes: those above the chosen id never
    // committed (the marker or a committed checkpoint would say so), those below are settled
    // epochs. Stale savepoints are kept, as retention keeps them.
    let mut discard = BTreeSet::new();
    let mut rolled_back = false;
    for c in checkpoints {
        if c.state != CheckpointState::Pending || Some(c.id) == confirm {
            continue;
        }
        match chosen_id {
            Some(chosen) if c.id > chosen => {
                discard.insert(c.id);
                rolled_back = true;
            }
            Some(chosen) if c.id == chosen => {}
            Some(_) if c.savepoint.is_some() => {}
            Some(_) => {
                discard.insert(c.id);
            }
            None => {
                discard.insert(c.id);
                rolled_back = true;
            }
        }
    }
    // A committed checkpoint of the same id as a pending one is the one that counts.
    discard.retain(|id| {
        !checkpoints
            .iter()
            .any(|c| c.id == *id && c.state == CheckpointState::Committed)
    });

    // The identity comes with the positions: the marker's when they are the marker's, unless the
    // marker predates recorded identities and sled's copy of the same checkpoint has one.
    let sled_identity = |id: u64| {
        checkpoints
            .iter()
            .filter(|c| c.id == id)
            .find_map(|c| c.identity.clone())
    };
    let in_sled = |id: u64| format!("checkpoint {id} in the state directory");
    let (identity, identity_origin) = match (chosen_id, marker) {
        (Some(id), Some(m)) if m.checkpoint_id == id => match &m.identity {
            Some(i) => (Some(i.clone()), format!("commit marker {id}")),
            None => (sled_identity(id), in_sled(id)),
        },
        (Some(id), _) => (sled_identity(id), in_sled(id)),
        (None, _) => (None, String::new()),
    };

    let outcome = if adopted {
        RecoveryOutcome::AdoptedFromMarker
    } else if rolled_back {
        RecoveryOutcome::RolledBack
    } else if chosen_id.is_some() {
        RecoveryOutcome::Committed
    } else {
        RecoveryOutcome::Fresh
    };

    Ok(Decision {
        outcome,
        positions,
        last_committed_id: chosen_id.unwrap_or(0),
        discard: discard.into_iter().collect(),
        confirm,
        adopt,
        warnings,
        identity,
        identity_origin,
    })
}

/// What an instance does about layouts at start-up (docs/design.md, "Rescaling").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LayoutPlan {
    /// The instance has committed in its layout before: recover from its own newest marker
    /// (`decide`); None only for a bridge with no marker at all.
    Resume { layout: Layout, own: Option<Marker> },
    /// The instance has not committed in its layout yet. Before reading a record it commits an
    /// intent marker of `layout`, fences every transactional id in `fence`, reads the markers
    /// again and plans again with `running = Some(layout)`; once a plan asks to fence nothing new,
    /// it starts from `positions` (partitions they lack from their earliest offset) as checkpoint
    /// `next_id`.
    TakeOver {
        layout: Layout,
        fence: Vec<(Layout, u32)>,
        positions: Positions,
        next_id: u64,
        /// The identity recorded with the newest of the markers the positions come from.
        identity: Option<Identity>,
    },
}

impl LayoutPlan {
    pub(crate) fn layout(&self) -> Layout {
        match self {
            LayoutPlan::Resume { layout, .. } | LayoutPlan::TakeOver { layout, .. } => *layout,
        }
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error(
        "bridge {bridge_id:?} runs in a newer layout, {newer} (commit marker key {origin}), than \
         this process, {mine}: stopping without committing anything more. If {mine} is what you \
         want, set bridge.instances to {mine_instances} on every instance and restart them; \
         otherwise this instance is not part of the bridge any more, or waits for its new \
         configuration"
    )]
    Superseded {
        bridge_id: String,
        mine: Layout,
        mine_instances: u32,
        newer: Layout,
        origin: String,
    },
}

/// Decides this instance's layout and, when it has not committed in it yet, whom to fence and
/// where each partition it owns was last committed. Pure: `found` are the newest committed markers
/// of every key of the bridge on every marker partition (read after init_transactions of our own
/// id, each partition read once its last stable offset reached its high watermark); `partitions`
/// are the source partitions; `running` is the layout this process already chose, if it did.
///
/// Rules: (1) a layout is newer when its (generation, instances) is greater; (2) an instance
/// whose chosen layout is below the newest found stops; (3) without a chosen layout, the newest
/// layout is joined when it has the configured instance count, otherwise the new layout is one
/// generation above the newest; (4) no marker at all: generation 0, nothing to take over;
/// (5) the position of a partition is the one in the newest (layout, checkpoint id) real marker
/// of a lower layout that holds it, and the owners of our partitions in every lower layout found
/// are fenced.
pub(crate) fn plan_layout(
    bridge_id: &str,
    instance: u32,
    instances: u32,
    running: Option<Layout>,
    found: &[FoundMarker],
    partitions: &[(String, i32)],
) -> Result<LayoutPlan, LayoutError> {
    let newest = found.iter().map(|f| f.layout).max();
    let layout = match (running, newest) {
        (Some(mine), Some(newer)) if newer > mine => {
            let origin = found
                .iter()
                .find(|f| f.layout == newer)
                .map(|f| crate::marker::layout_marker_key(bridge_id, f.layout, f.marker.instance))
                .unwrap_or_default();
            return Err(LayoutError::Superseded {
                bridge_id: bridge_id.to_string(),
                mine,
                mine_instances: mine.instances,
                newer,
                origin,
            });
        }
        (Some(mine), _) => mine,
        (None, None) => Layout {
            generation: 0,
            instances,
        },
        (None, Some(newest)) if newest.instances == instances => newest,
        (None, Some(newest)) => Layout {
            generation: newest.generation + 1,
            instances,
        },
    };
    let own = found
        .iter()
        .filter(|f| f.layout == layout && f.marker.instance == instance && !f.is_intent())
        .map(|f| &f.marker)
        .max_by_key(|m| m.checkpoint_id);
    if own.is_some() || found.is_empty() {
        return Ok(LayoutPlan::Resume {
            layout,
            own: own.cloned(),
        });
    }

    let mine: Vec<&(String, i32)> = partitions
        .iter()
        .filter(|(t, p)| owns(instance, layout.instances, t, *p))
        .collect();
    let lower: BTreeSet<Layout> = found
        .iter()
        .map(|f| f.layout)
        .filter(|l| *l < layout)
        .collect();
    let mut fence = Vec::new();
    for l in &lower {
        for i in 0..l.instances {
            if mine.iter().any(|(t, p)| owns(i, l.instances, t, *p)) {
                fence.push((*l, i));
            }
        }
    }
    let mut positions = Positions::new();
    let mut identity: Option<((Layout, u64), Option<Identity>)> = None;
    for (t, p) in &mine {
        let newest_holding = found
            .iter()
            .filter(|f| f.layout < layout && !f.is_intent())
            .filter_map(|f| {
                f.marker
                    .positions
                    .get(t, *p)
                    .map(|o| ((f.layout, f.marker.checkpoint_id), o, &f.marker.identity))
            })
            .max_by_key(|(order, _, _)| *order);
        if let Some((order, o, id)) = newest_holding {
            positions.set(t, *p, o);
            if identity.as_ref().is_none_or(|(best, _)| order > *best) {
                identity = Some((order, id.clone()));
            }
        }
    }
    let next_id = found
        .iter()
        .map(|f| f.marker.checkpoint_id)
        .max()
        .unwrap_or(0)
        + 1;
    Ok(LayoutPlan::TakeOver {
        layout,
        fence,
        positions,
        next_id,
        identity: identity.and_then(|(_, i)| i),
    })
}

fn age(time_ms: i64, now_ms: i64) -> String {
    let ms = now_ms.saturating_sub(time_ms);
    if ms < 0 {
        format!("written {} s in the future: check the clocks", -ms / 1000)
    } else {
        format!("written {} s ago", ms / 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::marker::MARKER_VERSION;
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use CheckpointState::{Committed, Pending};

    const NOW: i64 = 1_700_000_100_000;

    fn positions(id: u64) -> Positions {
        let mut p = Positions::new();
        p.set("orders", 0, id as i64 * 100);
        p.set("orders", 1, id as i64 * 100 + 1);
        p
    }

    fn ckpt(id: u64, state: CheckpointState) -> Checkpoint {
        Checkpoint {
            id,
            bridge_id: "b".into(),
            instance: 1,
            instances: 2,
            state,
            positions: positions(id),
            created_ms: NOW - 1000,
            savepoint: None,
            identity: None,
        }
    }

    fn marker(id: u64) -> Marker {
        Marker {
            version: MARKER_VERSION,
            bridge_id: "b".into(),
            instance: 1,
            instances: 2,
            checkpoint_id: id,
            positions: positions(id),
            time_ms: NOW - 5000,
            identity: None,
        }
    }

    fn run(checkpoints: &[Checkpoint], m: Option<&Marker>) -> Decision {
        decide("b", 1, 2, checkpoints, m, NOW).unwrap()
    }

    #[test]
    fn labels() {
        assert_eq!(RecoveryOutcome::Fresh.as_str(), "fresh");
        assert_eq!(RecoveryOutcome::Committed.as_str(), "committed");
        assert_eq!(RecoveryOutcome::RolledBack.as_str(), "rolled_back");
        assert_eq!(
            RecoveryOutcome::AdoptedFromMarker.as_str(),
            "adopted_from_marker"
        );
    }

    #[test]
    fn rule1_nothing_at_all_is_fresh() {
        let d = run(&[], None);
        assert_eq!(d.outcome, RecoveryOutcome::Fresh);
        assert_eq!(d.positions, None);
        assert_eq!(d.last_committed_id, 0);
        assert!(d.discard.is_empty() && d.confirm.is_none() && d.adopt.is_none());
        assert!(d.warnings.is_empty());
    }

    #[test]
    fn rule2_marker_matches_committed_checkpoint() {
        let d = run(&[ckpt(4, Committed), ckpt(5, Committed)], Some(&marker(5)));
        assert_eq!(d.outcome, RecoveryOutcome::Committed);
        assert_eq!(d.positions, Some(positions(5)));
        assert_eq!(d.last_committed_id, 5);
        assert_eq!((d.confirm, d.adopt, d.discard.len()), (None, None, 0));
        assert!(d.warnings.is_empty());
    }

    #[test]
    fn rule2_marker_confirms_a_pending_checkpoint() {
        // Crash between commit_transaction and mark_committed.
        let d = run(&[ckpt(4, Committed), ckpt(5, Pending)], Some(&marker(5)));
        assert_eq!(d.outcome, RecoveryOutcome::Committed);
        assert_eq!(d.confirm, Some(5));
        assert_eq!(d.positions, Some(positions(5)));
        assert_eq!(d.last_committed_id, 5);
        assert!(d.discard.is_empty());
    }

    #[test]
    fn rule2_pending_newer_than_marker_is_rolled_back() {
        // Crash between the pre-commit write and commit_transaction.
        let d = run(&[ckpt(4, Committed), ckpt(5, Pending)], Some(&marker(4)));
        assert_eq!(d.outcome, RecoveryOutcome::RolledBack);
        assert_eq!(d.positions, Some(positions(4)));
        assert_eq!(d.last_committed_id, 4);
        assert_eq!(d.discard, vec![5]);
        assert_eq!(d.confirm, None);

        let d = run(
            &[ckpt(3, Pending), ckpt(4, Pending), ckpt(6, Pending)],
            Some(&marker(4)),
        );
        assert_eq!(d.outcome, RecoveryOutcome::RolledBack);
        assert_eq!(d.confirm, Some(4));
        assert_eq!(d.discard, vec![3, 6]);
    }

    #[test]
    fn rule3_marker_ahead_of_sled_is_adopted() {
        // The sled update after the commit was lost.
        let d = run(
            &[ckpt(4, Committed), ckpt(3, Pending), ckpt(7, Pending)],
            Some(&marker(5)),
        );
        assert_eq!(d.outcome, RecoveryOutcome::AdoptedFromMarker);
        assert_eq!(d.positions, Some(positions(5)));
        assert_eq!(d.last_committed_id, 5);
        assert_eq!(d.discard, vec![3, 7]);
        assert_eq!(d.confirm, None);
        let adopt = d.adopt.unwrap();
        assert_eq!(adopt.id, 5);
        assert_eq!(adopt.state, Committed);
        assert_eq!(adopt.savepoint, None);
        assert_eq!(adopt.created_ms, marker(5).time_ms);
        assert_eq!(adopt.positions, positions(5));
        assert_eq!(
            (adopt.bridge_id.as_str(), adopt.instance, adopt.instances),
            ("b", 1, 2)
        );
        assert_eq!(d.warnings.len(), 1);
        assert!(
            d.warnings[0].contains("no checkpoint 5"),
            "{}",
            d.warnings[0]
        );
    }

    #[test]
    fn rule3_deleted_state_directory_adopts_the_marker() {
        let d = run(&[], Some(&marker(9)));
        assert_eq!(d.outcome, RecoveryOutcome::AdoptedFromMarker);
        assert_eq!(d.positions, Some(positions(9)));
        assert_eq!(d.last_committed_id, 9);
        assert_eq!(d.adopt.map(|c| c.id), Some(9));
    }

    #[test]
    fn rule4_lost_marker_topic_resumes_from_sled_with_a_warning() {
        let d = run(&[ckpt(2, Committed), ckpt(3, Committed)], None);
        assert_eq!(d.outcome, RecoveryOutcome::Committed);
        assert_eq!(d.positions, Some(positions(3)));
        assert_eq!(d.last_committed_id, 3);
        assert_eq!(d.warnings.len(), 1);
        assert!(
            d.warnings[0].contains("holds no marker for this instance"),
            "{}",
            d.warnings[0]
        );
        assert!(d.warnings[0].contains("b/1"), "{}", d.warnings[0]);

        let d = run(&[ckpt(3, Committed), ckpt(4, Pending)], None);
        assert_eq!(d.outcome, RecoveryOutcome::RolledBack);
        assert_eq!(d.positions, Some(positions(3)));
        assert_eq!(d.discard, vec![4]);
        assert_eq!(d.warnings.len(), 1);
    }

    #[test]
    fn rule5_sled_committed_newer_than_marker_is_trusted() {
        let d = run(&[ckpt(7, Committed), ckpt(8, Pending)], Some(&marker(5)));
        assert_eq!(d.outcome, RecoveryOutcome::RolledBack);
        assert_eq!(d.positions, Some(positions(7)));
        assert_eq!(d.last_committed_id, 7);
        assert_eq!(d.discard, vec![8]);
        assert_eq!((d.confirm, d.adopt), (None, None));
        assert_eq!(d.warnings.len(), 1);
        assert!(
            d.warnings[0].contains("reset or truncated"),
            "{}",
            d.warnings[0]
        );

        let d = run(&[ckpt(7, Committed)], Some(&marker(5)));
        assert_eq!(d.outcome, RecoveryOutcome::Committed);
    }

    #[test]
    fn rule6_only_pending_and_no_marker_rolls_back_to_the_start_position() {
        let d = run(&[ckpt(1, Pending), ckpt(2, Pending)], None);
        assert_eq!(d.outcome, RecoveryOutcome::RolledBack);
        assert_eq!(d.positions, None);
        assert_eq!(d.last_committed_id, 0);
        assert_eq!(d.discard, vec![1, 2]);
        assert_eq!((d.confirm, d.adopt), (None, None));
    }

    #[test]
    fn stale_pending_savepoints_are_kept() {
        let mut sp = ckpt(2, Pending);
        sp.savepoint = Some("sp".into());
        let d = run(
            &[sp.clone(), ckpt(3, Pending), ckpt(4, Committed)],
            Some(&marker(4)),
        );
        assert_eq!(d.discard, vec![3]);
        assert_eq!(d.outcome, RecoveryOutcome::Committed);

        // One newer than the marker never committed, savepoint or not.
        sp.id = 5;
        let d = run(&[ckpt(4, Committed), sp], Some(&marker(4)));
        assert_eq!(d.discard, vec![5]);
        assert_eq!(d.outcome, RecoveryOutcome::RolledBack);
    }

    #[test]
    fn diverging_positions_warn_and_follow_the_marker() {
        let mut c = ckpt(5, Committed);
        c.positions.set("orders", 0, 1);
        let d = run(&[c], Some(&marker(5)));
        assert_eq!(d.positions, Some(positions(5)));
        assert_eq!(d.warnings.len(), 1);
    }

    fn ident(cluster: &str) -> Option<Identity> {
        Some(Identity {
            source_cluster: Some(cluster.into()),
            ..Identity::default()
        })
    }

    #[test]
    fn the_identity_comes_with_the_chosen_positions() {
        let mut m = marker(5);
        m.identity = ident("from-marker");
        let mut c5 = ckpt(5, Committed);
        c5.identity = ident("from-sled-5");
        let mut c7 = ckpt(7, Committed);
        c7.identity = ident("from-sled-7");

        let d = run(&[c5.clone()], Some(&m));
        assert_eq!(d.identity, ident("from-marker"));
        assert_eq!(d.identity_origin, "commit marker 5");

        // A marker of an older build: sled's copy of the same checkpoint speaks.
        let d = run(&[c5.clone()], Some(&marker(5)));
        assert_eq!(d.identity, ident("from-sled-5"));
        assert_eq!(d.identity_origin, "checkpoint 5 in the state directory");

        // sled newer than the marker, and no marker at all (the sink cluster was rebuilt).
        let d = run(&[c5.clone(), c7.clone()], Some(&m));
        assert_eq!(d.identity, ident("from-sled-7"));
        let d = run(&[c5, c7], None);
        assert_eq!(d.identity, ident("from-sled-7"));
        assert_eq!(d.identity_origin, "checkpoint 7 in the state directory");

        // Adopted from the marker: the adopted checkpoint keeps the marker's identity.
        let d = run(&[], Some(&m));
        assert_eq!(d.identity, ident("from-marker"));
        assert_eq!(d.adopt.unwrap().identity, ident("from-marker"));

        let d = run(&[], None);
        assert_eq!(d.identity, None);
    }

    #[test]
    fn rule7_layout_mismatches_are_refused() {
        let mut other = ckpt(3, Committed);
        other.instances = 3;
        let err = decide("b", 1, 2, &[other], None, NOW).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("checkpoint 3"), "{text}");
        assert!(
            text.contains("instance 1 of 3") && text.contains("instance 1 of 2"),
            "{text}"
        );
        assert!(
            text.contains("savepoint") && text.contains("fresh state directory"),
            "{text}"
        );

        let mut other = ckpt(3, Committed);
        other.bridge_id = "a".into();
        let err = decide("b", 1, 2, &[other], None, NOW).unwrap_err();
        assert!(err.to_string().contains("bridge \"a\""), "{err}");

        let mut m = marker(3);
        m.instance = 0;
        let err = decide("b", 1, 2, &[], Some(&m), NOW).unwrap_err();
        assert!(
            matches!(&err, RecoveryError::LayoutMismatch { origin, found_instance: 0, .. } if origin.contains("marker")),
            "{err}"
        );
    }

    fn lay(generation: u64, instances: u32) -> Layout {
        Layout {
            generation,
            instances,
        }
    }

    fn parts() -> Vec<(String, i32)> {
        (0..6).map(|p| ("orders".to_string(), p)).collect()
    }

    /// The newest marker of `instance` in `layout`, holding `offset + p` for the partitions it owns.
    fn found(layout: Layout, instance: u32, id: u64, offset: i64) -> FoundMarker {
        let mut positions = Positions::new();
        if id > 0 {
            for (t, p) in parts() {
                if owns(instance, layout.instances, &t, p) {
                    positions.set(&t, p, offset + p as i64);
                }
            }
        }
        FoundMarker {
            layout,
            marker: Marker {
                version: MARKER_VERSION,
                bridge_id: "b".into(),
                instance,
                instances: layout.instances,
                checkpoint_id: id,
                positions,
                time_ms: NOW,
                identity: None,
            },
        }
    }

    fn owned_by(instance: u32, instances: u32) -> Vec<(String, i32)> {
        parts()
            .into_iter()
            .filter(|(t, p)| owns(instance, instances, t, *p))
            .collect()
    }

    #[test]
    fn layout_fresh_bridge_is_generation_zero_and_resumes_nothing() {
        let plan = plan_layout("b", 0, 2, None, &[], &parts()).unwrap();
        assert_eq!(
            plan,
            LayoutPlan::Resume {
                layout: lay(0, 2),
                own: None
            }
        );
    }

    #[test]
    fn layout_same_instances_joins_and_resumes_its_own_marker() {
        let f = [found(lay(0, 2), 0, 7, 100), found(lay(0, 2), 1, 9, 200)];
        let plan = plan_layout("b", 1, 2, None, &f, &parts()).unwrap();
        assert_eq!(
            plan,
            LayoutPlan::Resume {
                layout: lay(0, 2),
                own: Some(f[1].marker.clone())
            }
        );
    }

    #[test]
    fn layout_upscale_takes_over_the_old_owners_positions() {
        let f = [found(lay(0, 1), 0, 7, 100)];
        for i in 0..2 {
            let LayoutPlan::TakeOver {
                layout,
                fence,
                positions,
                next_id,
                ..
            } = plan_layout("b", i, 2, None, &f, &parts()).unwrap()
            else {
                panic!("expected a take-over")
            };
            assert_eq!(layout, lay(1, 2));
            assert_eq!(fence, vec![(lay(0, 1), 0)]);
            assert_eq!(next_id, 8);
            let mine = owned_by(i, 2);
            assert!(!mine.is_empty());
            assert_eq!(positions.len(), mine.len());
            for (t, p) in mine {
                assert_eq!(positions.get(&t, p), Some(100 + p as i64));
            }
        }
    }

    #[test]
    fn layout_a_late_instance_of_the_new_layout_joins_and_still_takes_over() {
        // Instance 0 of the new layout committed already; instance 1 starts later.
        let f = [
            found(lay(0, 1), 0, 7, 100),
            found(lay(1, 2), 0, 12, 500),
            found(lay(1, 2), 1, 0, 0),
        ];
        let LayoutPlan::TakeOver {
            layout,
            fence,
            positions,
            ..
        } = plan_layout("b", 1, 2, None, &f, &parts()).unwrap()
        else {
            panic!("expected a take-over")
        };
        assert_eq!(layout, lay(1, 2));
        assert_eq!(fence, vec![(lay(0, 1), 0)]);
        for (t, p) in owned_by(1, 2) {
            assert_eq!(positions.get(&t, p), Some(100 + p as i64));
        }
    }

    #[test]
    fn layout_downscale_fences_every_old_owner_and_takes_the_newest_positions() {
        // 1 -> 3 -> 1: the newest layout holding a partition decides, not an older one with a
        // higher checkpoint id.
        let f = [
            found(lay(0, 1), 0, 40, 100),
            found(lay(1, 3), 0, 41, 300),
            found(lay(1, 3), 1, 45, 300),
            found(lay(1, 3), 2, 0, 0), // instance 2 crashed after its intent
        ];
        let LayoutPlan::TakeOver {
            layout,
            fence,
            positions,
            next_id,
            ..
        } = plan_layout("b", 0, 1, None, &f, &parts()).unwrap()
        else {
            panic!("expected a take-over")
        };
        assert_eq!(layout, lay(2, 1));
        assert_eq!(next_id, 46);
        let mut expect = vec![(lay(0, 1), 0)];
        expect.extend((0..3).map(|i| (lay(1, 3), i)));
        assert_eq!(fence, expect);
        for (t, p) in parts() {
            let want = if owns(2, 3, &t, p) { 100 } else { 300 } + p as i64;
            assert_eq!(positions.get(&t, p), Some(want), "partition {p}");
        }
    }

    #[test]
    fn layout_running_process_of_an_older_layout_stops_naming_the_newer_one() {
        let f = [found(lay(0, 1), 0, 7, 100), found(lay(1, 2), 1, 0, 0)];
        let err = plan_layout("b", 0, 1, Some(lay(0, 1)), &f, &parts()).unwrap_err();
        assert_eq!(
            err,
            LayoutError::Superseded {
                bridge_id: "b".into(),
                mine: lay(0, 1),
                mine_instances: 1,
                newer: lay(1, 2),
                origin: "b/g1n2/1".into()
            }
        );
        let text = err.to_string();
        assert!(text.contains("generation 1 (2 instances)"), "{text}");
        assert!(text.contains("generation 0 (1 instances)"), "{text}");
    }

    #[test]
    fn layout_rivals_of_one_generation_are_ordered_by_instances() {
        // Layouts 2 and 3 both derived from layout 1 before either committed: the one with more
        // instances is newer and fences the other's owners; the other stops once it sees it.
        let f = [
            found(lay(0, 1), 0, 7, 100),
            found(lay(1, 2), 0, 0, 0),
            found(lay(1, 2), 1, 9, 200),
            found(lay(1, 3), 2, 0, 0),
        ];
        let plan = plan_layout("b", 2, 3, Some(lay(1, 3)), &f, &parts()).unwrap();
        let LayoutPlan::TakeOver {
            fence, positions, ..
        } = plan
        else {
            panic!("expected a take-over")
        };
        assert!(fence.contains(&(lay(0, 1), 0)));
        for (t, p) in owned_by(2, 3) {
            let rival_owner = (0..2).find(|i| owns(*i, 2, &t, p)).unwrap();
            assert!(fence.contains(&(lay(1, 2), rival_owner)));
            let want = if owns(1, 2, &t, p) { 200 } else { 100 } + p as i64;
            assert_eq!(positions.get(&t, p), Some(want), "partition {p}");
        }
        let err = plan_layout("b", 1, 2, Some(lay(1, 2)), &f, &parts()).unwrap_err();
        assert!(matches!(err, LayoutError::Superseded { newer, .. } if newer == lay(1, 3)));
    }

    #[test]
    fn layout_a_late_instance_of_the_first_layout_has_no_one_to_take_over_from() {
        // The caller starts it from source.start, as its neighbours did.
        let f = [found(lay(0, 2), 0, 7, 100)];
        let plan = plan_layout("b", 1, 2, None, &f, &parts()).unwrap();
        let LayoutPlan::TakeOver {
            layout,
            fence,
            positions,
            ..
        } = plan
        else {
            panic!("expected a take-over")
        };
        assert_eq!(layout, lay(0, 2));
        assert!(fence.is_empty() && positions.is_empty());
    }

    #[test]
    fn layout_crash_after_the_intent_takes_over_again() {
        let f = [found(lay(0, 1), 0, 7, 100), found(lay(1, 2), 0, 0, 0)];
        let plan = plan_layout("b", 0, 2, None, &f, &parts()).unwrap();
        assert!(matches!(plan, LayoutPlan::TakeOver { layout, .. } if layout == lay(1, 2)));
    }

    #[test]
    fn layout_new_partitions_and_a_new_bridge_id_are_not_taken_from_markers() {
        // A partition no marker holds gets no position (the caller reads it from its earliest
        // offset, never from source.start while markers exist).
        let mut f = found(lay(0, 1), 0, 7, 100);
        f.marker.positions = Positions::new();
        f.marker.positions.set("orders", 0, 5);
        let plan = plan_layout("b", 0, 2, None, &[f], &parts()).unwrap();
        let LayoutPlan::TakeOver { positions, .. } = plan else {
            panic!("expected a take-over")
        };
        for (t, p) in owned_by(0, 2) {
            assert_eq!(positions.get(&t, p), (p == 0).then_some(5));
        }
    }

    proptest! {
        /// Any sequence of layout changes, each instance starting in any order after the previous
        /// change committed some of its instances: every partition's start position is the newest
        /// committed position of the partition, and every older owner that committed it is fenced.
        #[test]
        fn prop_takeover_continues_the_newest_commit(
            sizes in prop::collection::vec(1u32..5, 1..5),
            committed in prop::collection::vec(any::<bool>(), 20),
        ) {
            let mut found_markers: Vec<FoundMarker> = Vec::new();
            let mut truth: BTreeMap<i32, (i64, Vec<(Layout, u32)>)> = BTreeMap::new();
            let mut next = 1u64;
            let mut k = 0;
            for n in sizes {
                let mut layout = None;
                for i in 0..n {
                    let plan = plan_layout("b", i, n, None, &found_markers, &parts()).unwrap();
                    let l = plan.layout();
                    layout.get_or_insert(l);
                    prop_assert_eq!(Some(l), layout, "instances of one change agree");
                    let resumes = matches!(plan, LayoutPlan::Resume { own: Some(_), .. });
                    if let LayoutPlan::TakeOver { fence, positions, .. } = plan {
                        for (t, p) in owned_by(i, n) {
                            let (pos, owners) = truth.get(&p).cloned().unwrap_or((-1, vec![]));
                            prop_assert_eq!(positions.get(&t, p).unwrap_or(-1), pos);
                            for o in owners {
                                prop_assert!(fence.contains(&o), "{:?} not fenced", o);
                            }
                        }
                    }
                    // Commit (or only claim) in the new layout; a restart that resumes and commits
                    // nothing leaves its marker as it was.
                    let commits = committed[k % committed.len()];
                    k += 1;
                    if resumes && !commits {
                        continue;
                    }
                    let mut m = found(l, i, if commits { next } else { 0 }, 0);
                    if commits {
                        next += 1;
                        for (t, p) in owned_by(i, n) {
                            let pos = truth.get(&p).map_or(0, |x| x.0) + 10;
                            m.marker.positions.set(&t, p, pos);
                            let entry = truth.entry(p).or_insert((0, vec![]));
                            entry.0 = pos;
                            entry.1.push((l, i));
                        }
                    }
                    found_markers.retain(|f| !(f.layout == l && f.marker.instance == i));
                    found_markers.push(m);
                }
            }
        }
    }

    /// Checkpoints with distinct ids, each pending or committed, and maybe a marker.
    fn scenario() -> impl Strategy<Value = (Vec<Checkpoint>, Option<Marker>)> {
        (
            prop::collection::btree_map(1u64..40, any::<(bool, bool)>(), 0..10),
            prop::option::of(1u64..45),
        )
            .prop_map(|(ids, m)| {
                let checkpoints = ids
                    .into_iter()
                    .map(|(id, (committed, savepoint))| {
                        let mut c = ckpt(id, if committed { Committed } else { Pending });
                        if savepoint {
                            c.savepoint = Some(format!("sp-{id}"));
                        }
                        c
                    })
                    .collect();
                (checkpoints, m.map(marker))
            })
    }

    proptest! {
        #[test]
        fn prop_recovery_invariants((checkpoints, m) in scenario()) {
            let d = run(&checkpoints, m.as_ref());
            let marker_id = m.as_ref().map(|m| m.checkpoint_id);
            let newest_committed = checkpoints
                .iter()
                .filter(|c| c.state == Committed)
                .map(|c| c.id)
                .max();

            // (a) Never resume from a pending checkpoint newer than the marker.
            for c in checkpoints.iter().filter(|c| c.state == Pending) {
                if marker_id.is_none_or(|mid| c.id > mid) {
                    prop_assert_ne!(d.last_committed_id, c.id);
                    if newest_committed.is_none_or(|n| n != c.id) {
                        prop_assert_ne!(d.positions.as_ref(), Some(&c.positions));
                    }
                }
            }
            // (b) The marker decides unless sled proves a newer commit.
            if let Some(m) = &m {
                if newest_committed.is_none_or(|n| n <= m.checkpoint_id) {
                    prop_assert_eq!(d.positions.as_ref(), Some(&m.positions));
                }
            }
            // (c) Every pending id above the chosen one is discarded.
            for c in checkpoints.iter().filter(|c| c.state == Pending && c.id > d.last_committed_id) {
                prop_assert!(d.discard.contains(&c.id), "{} not discarded: {:?}", c.id, d);
            }
            // (d) The last committed id is the newest proof of a commit.
            let expected = marker_id.unwrap_or(0).max(newest_committed.unwrap_or(0));
            prop_assert_eq!(d.last_committed_id, expected);

            // Repairs agree with the chosen id and with each other.
            if let Some(id) = d.confirm {
                prop_assert_eq!(id, d.last_committed_id);
                prop_assert!(d.adopt.is_none());
                prop_assert!(!d.discard.contains(&id));
            }
            if let Some(c) = &d.adopt {
                prop_assert_eq!(c.id, d.last_committed_id);
                prop_assert_eq!(c.state, Committed);
                prop_assert_eq!(d.outcome, RecoveryOutcome::AdoptedFromMarker);
                prop_assert!(checkpoints.iter().all(|k| k.id != c.id));
            }
            for id in &d.discard {
                prop_assert!(checkpoints.iter().any(|c| c.id == *id && c.state == Pending));
            }
            prop_assert_eq!(d.positions.is_none(), d.last_committed_id == 0);
            let fresh_like = d.positions.is_none();
            prop_assert_eq!(
                d.outcome == RecoveryOutcome::Fresh,
                fresh_like && d.discard.is_empty()
            );
        }
    }
}
