//! Savepoints: named checkpoints that retention never prunes, their portable JSON form, and the
//! rules for restoring a bridge from them, including into a different instance layout.
//!
//! A restore writes the savepoint's positions into the state directory as a committed checkpoint
//! tagged `restored:<names>`; the tag makes a restore idempotent (a restarted process that still
//! has `--from-savepoint` on its command line does not rewind a second time).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::checkpoint::{Checkpoint, CheckpointState};
use crate::identity::Identity;
use crate::positions::Positions;

pub const FORMAT: &str = "eos-bridge-savepoint";
pub const VERSION: u32 = 1;
/// Prefix of the savepoint tag that marks a checkpoint written by a restore.
pub const RESTORED_PREFIX: &str = "restored:";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Savepoint {
    pub format: String,
    pub version: u32,
    pub name: String,
    pub bridge_id: String,
    pub instance: u32,
    pub instances: u32,
    pub checkpoint_id: u64,
    pub created_ms: i64,
    pub positions: Positions,
    /// Where the positions were taken, for the operator and the restore's log. A restore does not
    /// require the same clusters: moving between clusters is what a savepoint is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<Identity>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SavepointError {
    #[error("{file}: not an eos-bridge savepoint: {reason}")]
    Invalid { file: String, reason: String },
    #[error(
        "savepoint '{name}' was taken by bridge '{found_id}' instance {found_instance} of {found_instances}, \
         but this bridge is '{bridge_id}' instance {instance} of {instances}; pass --allow-layout-change to \
         restore it anyway (positions are then redistributed by partition)"
    )]
    Layout {
        name: String,
        found_id: String,
        found_instance: u32,
        found_instances: u32,
        bridge_id: String,
        instance: u32,
        instances: u32,
    },
    #[error(
        "without --allow-layout-change exactly one savepoint can be restored (got {0}); give one file per \
         instance of the old layout together with --allow-layout-change to merge them"
    )]
    Count(usize),
    #[error(
        "savepoints '{a}' and '{b}' both hold {topic}/{partition}: they are not from one layout"
    )]
    Overlap {
        a: String,
        b: String,
        topic: String,
        partition: i32,
    },
    #[error(
        "savepoint name '{0}' is not allowed: use 1 to 100 characters of letters, digits, '.', '_' or '-'"
    )]
    Name(String),
}

pub fn valid_name(name: &str) -> Result<(), SavepointError> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(SavepointError::Name(name.to_string()))
    }
}

impl Savepoint {
    /// The portable form of a checkpoint that is a savepoint. A pending checkpoint is none yet:
    /// until its commit is proven its positions may be past what the sink holds, and restoring
    /// them would skip records.
    pub fn from_checkpoint(c: &Checkpoint) -> Option<Savepoint> {
        if c.state != CheckpointState::Committed {
            return None;
        }
        Some(Savepoint {
            format: FORMAT.to_string(),
            version: VERSION,
            name: c.savepoint.clone()?,
            bridge_id: c.bridge_id.clone(),
            instance: c.instance,
            instances: c.instances,
            checkpoint_id: c.id,
            created_ms: c.created_ms,
            positions: c.positions.clone(),
            identity: c.identity.clone(),
        })
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a savepoint always serializes")
    }

    pub fn from_json(file: &str, text: &str) -> Result<Savepoint, SavepointError> {
        let invalid = |reason: String| SavepointError::Invalid {
            file: file.to_string(),
            reason,
        };
        let sp: Savepoint = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if sp.format != FORMAT {
            return Err(invalid(format!(
                "format is '{}', expected '{FORMAT}'",
                sp.format
            )));
        }
        if sp.version != VERSION {
            return Err(invalid(format!(
                "version {} is not supported by this build (reads {VERSION}); upgrade eos-bridge",
                sp.version
            )));
        }
        Ok(sp)
    }
}

/// What `run --from-savepoint` asked for.
#[derive(Clone, Debug)]
pub struct Restore {
    pub savepoints: Vec<Savepoint>,
    pub allow_layout_change: bool,
}

impl Restore {
    /// The tag of the checkpoint a restore writes: the same set of savepoints gives the same tag.
    pub fn tag(&self) -> String {
        let names: BTreeSet<String> = self
            .savepoints
            .iter()
            .map(|s| format!("{}.{}.{}", s.bridge_id, s.instance, s.name))
            .collect();
        let joined = names.into_iter().collect::<Vec<_>>().join("+");
        format!("{RESTORED_PREFIX}{joined}")
    }

    /// The positions to start from, checked against this bridge's identity and layout. With a
    /// layout change the savepoints' positions are merged; the caller keeps the partitions this
    /// instance owns.
    pub fn positions(
        &self,
        bridge_id: &str,
        instance: u32,
        instances: u32,
    ) -> Result<Positions, SavepointError> {
        if !self.allow_layout_change {
            if self.savepoints.len() != 1 {
                return Err(SavepointError::Count(self.savepoints.len()));
            }
            let sp = &self.savepoints[0];
            if sp.bridge_id != bridge_id || sp.instance != instance || sp.instances != instances {
                return Err(SavepointError::Layout {
                    name: sp.name.clone(),
                    found_id: sp.bridge_id.clone(),
                    found_instance: sp.instance,
                    found_instances: sp.instances,
                    bridge_id: bridge_id.to_string(),
                    instance,
                    instances,
                });
            }
            return Ok(sp.positions.clone());
        }
        let mut merged = Positions::new();
        let mut owner: std::collections::HashMap<(String, i32), &str> = Default::default();
        for sp in &self.savepoints {
            for (t, p, o) in sp.positions.iter() {
                if let Some(prev) = owner.insert((t.to_string(), p), &sp.name) {
                    return Err(SavepointError::Overlap {
                        a: prev.to_string(),
                        b: sp.name.clone(),
                        topic: t.to_string(),
                        partition: p,
                    });
                }
                merged.set(t, p, o);
            }
        }
        Ok(merged)
    }

    /// The newest checkpoint id among the savepoints: a restore continues numbering above it.
    pub fn max_checkpoint_id(&self) -> u64 {
        self.savepoints
            .iter()
            .map(|s| s.checkpoint_id)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(name: &str, instance: u32, instances: u32, parts: &[(i32, i64)]) -> Savepoint {
        let c = Checkpoint {
            id: 10 + instance as u64,
            bridge_id: "b".into(),
            instance,
            instances,
            state: CheckpointState::Committed,
            positions: parts
                .iter()
                .map(|(p, o)| ("t".to_string(), *p, *o))
                .collect(),
            created_ms: 1,
            savepoint: Some(name.into()),
            identity: None,
        };
        Savepoint::from_checkpoint(&c).unwrap()
    }

    #[test]
    fn a_pending_checkpoint_is_not_a_savepoint_yet() {
        let mut c = Checkpoint {
            id: 3,
            bridge_id: "b".into(),
            instance: 0,
            instances: 1,
            state: CheckpointState::Pending,
            positions: Positions::new(),
            created_ms: 1,
            savepoint: Some("sp".into()),
            identity: None,
        };
        assert_eq!(Savepoint::from_checkpoint(&c), None);
        c.state = CheckpointState::Committed;
        assert_eq!(Savepoint::from_checkpoint(&c).unwrap().name, "sp");
    }

    #[test]
    fn json_round_trip_and_format_checks() {
        let s = sp("x", 0, 1, &[(0, 5)]);
        assert_eq!(Savepoint::from_json("f", &s.to_json()).unwrap(), s);
        let bad = s.to_json().replace(FORMAT, "other");
        assert!(matches!(
            Savepoint::from_json("f", &bad),
            Err(SavepointError::Invalid { .. })
        ));
    }

    #[test]
    fn same_layout_restores_and_other_layouts_need_the_flag() {
        let r = Restore {
            savepoints: vec![sp("x", 0, 1, &[(0, 5), (1, 7)])],
            allow_layout_change: false,
        };
        assert_eq!(r.positions("b", 0, 1).unwrap().get("t", 1), Some(7));
        let err = r.positions("b", 1, 2).unwrap_err();
        assert!(err.to_string().contains("--allow-layout-change"), "{err}");
        let err = r.positions("other", 0, 1).unwrap_err();
        assert!(matches!(err, SavepointError::Layout { .. }));
        let r = Restore {
            allow_layout_change: true,
            ..r
        };
        assert_eq!(r.positions("b", 1, 2).unwrap().len(), 2);
    }

    #[test]
    fn merging_needs_disjoint_savepoints() {
        let r = Restore {
            savepoints: vec![sp("a", 0, 2, &[(0, 1)]), sp("b", 1, 2, &[(1, 2)])],
            allow_layout_change: true,
        };
        let merged = r.positions("b", 0, 1).unwrap();
        assert_eq!((merged.get("t", 0), merged.get("t", 1)), (Some(1), Some(2)));
        assert_eq!(r.max_checkpoint_id(), 11);
        assert_eq!(r.tag(), "restored:b.0.a+b.1.b");
        let r = Restore {
            savepoints: vec![sp("a", 0, 2, &[(0, 1)]), sp("b", 1, 2, &[(0, 2)])],
            allow_layout_change: true,
        };
        assert!(matches!(
            r.positions("b", 0, 1),
            Err(SavepointError::Overlap { .. })
        ));
        let r = Restore {
            savepoints: vec![sp("a", 0, 2, &[(0, 1)]), sp("b", 1, 2, &[(1, 2)])],
            allow_layout_change: false,
        };
        assert_eq!(r.positions("b", 0, 1), Err(SavepointError::Count(2)));
    }

    #[test]
    fn names_are_checked() {
        assert!(valid_name("before-upgrade_1.2").is_ok());
        assert!(valid_name("").is_err());
        assert!(valid_name("a/b").is_err());
    }
}
