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
use crate::marker::{marker_key, Marker};
use crate::positions::Positions;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryOutcome {
    /// Nothing was ever committed: start from the configured start position.
    Fresh,
    /// Resume from a checkpoint whose commit is proven; nothing uncommitted was found.
    Committed,
    /// Checkpoints that never committed were discarded: their epoch is redone.
    RolledBack,
    /// The marker is ahead of sled: its positions are adopted and written back to sled.
    AdoptedFromMarker,
}

impl RecoveryOutcome {
    pub const ALL: [RecoveryOutcome; 4] = [
        RecoveryOutcome::Fresh,
        RecoveryOutcome::Committed,
        RecoveryOutcome::RolledBack,
        RecoveryOutcome::AdoptedFromMarker,
    ];

    /// The value of the `outcome` label of the recoveries metric.
    pub fn as_str(&self) -> &'static str {
        match self {
            RecoveryOutcome::Fresh => "fresh",
            RecoveryOutcome::Committed => "committed",
            RecoveryOutcome::RolledBack => "rolled_back",
            RecoveryOutcome::AdoptedFromMarker => "adopted_from_marker",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
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

/// Decides where to resume. `checkpoints` are the decodable checkpoints of the state directory in
/// any order; `marker` is this instance's newest committed marker, if the marker topic has one.
pub fn decide(
    bridge_id: &str,
    instance: u32,
    instances: u32,
    checkpoints: &[Checkpoint],
    marker: Option<&Marker>,
    now_ms: i64,
) -> Result<Decision, RecoveryError> {
    let mismatch = |origin: String, found: (&str, u32, u32)| {
        if found == (bridge_id, instance, instances) {
            return Ok(());
        }
        Err(RecoveryError::LayoutMismatch {
            origin,
            found_bridge_id: found.0.to_string(),
            found_instance: found.1,
            found_instances: found.2,
            bridge_id: bridge_id.to_string(),
            instance,
            instances,
        })
    };
    if let Some(m) = marker {
        mismatch(
            format!("commit marker {}", m.checkpoint_id),
            (&m.bridge_id, m.instance, m.instances),
        )?;
    }
    for c in checkpoints {
        mismatch(
            format!("checkpoint {} in the state directory", c.id),
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
                         ({}): the state directory lost its update, is new, or its entry is \
                         corrupt; adopting the marker's positions",
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
