//! Source positions: for every source topic and partition, the next offset to read.
//!
//! The one type shared by checkpoints, commit markers, the recovery decision and the pipeline.
//! Offsets are always "next offset to read" (never "last offset read"), because control records
//! of transactions take offsets too.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Positions(BTreeMap<String, BTreeMap<i32, i64>>);

impl Positions {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&self, topic: &str, partition: i32) -> Option<i64> {
        self.0.get(topic).and_then(|p| p.get(&partition)).copied()
    }

    pub fn set(&mut self, topic: &str, partition: i32, next_offset: i64) {
        match self.0.get_mut(topic) {
            Some(parts) => {
                parts.insert(partition, next_offset);
            }
            None => {
                self.0.insert(
                    topic.to_string(),
                    BTreeMap::from([(partition, next_offset)]),
                );
            }
        }
    }

    pub fn remove(&mut self, topic: &str, partition: i32) -> Option<i64> {
        let parts = self.0.get_mut(topic)?;
        let removed = parts.remove(&partition);
        if parts.is_empty() {
            self.0.remove(topic);
        }
        removed
    }

    /// (topic, partition, next offset) in topic then partition order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, i32, i64)> + '_ {
        self.0
            .iter()
            .flat_map(|(t, parts)| parts.iter().map(move |(p, o)| (t.as_str(), *p, *o)))
    }

    /// Number of partitions held.
    pub fn len(&self) -> usize {
        self.0.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl FromIterator<(String, i32, i64)> for Positions {
    fn from_iter<I: IntoIterator<Item = (String, i32, i64)>>(iter: I) -> Self {
        let mut p = Positions::new();
        for (t, part, off) in iter {
            p.set(&t, part, off);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_keeps_every_partition() {
        let p: Positions = [
            ("a".to_string(), 0, 5),
            ("a".to_string(), 3, 7),
            ("b".to_string(), 1, 0),
        ]
        .into_iter()
        .collect();
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(json, r#"{"a":{"0":5,"3":7},"b":{"1":0}}"#);
        let back: Positions = serde_json::from_str(&json).unwrap();
        assert_eq!(back, p);
        assert_eq!(back.len(), 3);
        assert_eq!(back.get("a", 3), Some(7));
        assert_eq!(back.get("a", 1), None);
    }

    #[test]
    fn remove_drops_empty_topics() {
        let mut p = Positions::new();
        p.set("t", 0, 1);
        assert_eq!(p.remove("t", 0), Some(1));
        assert!(p.is_empty());
        assert_eq!(serde_json::to_string(&p).unwrap(), "{}");
    }
}
