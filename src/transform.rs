//! Routing of source records to sink topics and partitions.
//!
//! `preserve` keeps the source partition (full order per source partition); `key` uses Kafka's
//! murmur2 partitioner, so a record lands where any Java producer would have put it. Records
//! without a key under `key` stay on their source partition (modulo the sink's partition count),
//! which keeps their order instead of scattering them.

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::Partitioning;

/// The partition Kafka's Java producer picks for a keyed record.
pub(crate) fn kafka_key_partition(key: &[u8], partitions: i32) -> i32 {
    let hash = murmur2::murmur2(key, murmur2::KAFKA_SEED);
    ((hash & 0x7fff_ffff) % partitions as u32) as i32
}

pub(crate) struct Router {
    template: String,
    partitioning: Partitioning,
    topics: HashMap<String, Arc<str>>,
    sink_partitions: HashMap<String, i32>,
}

impl Router {
    pub(crate) fn new(template: &str, partitioning: Partitioning) -> Router {
        Router {
            template: template.to_string(),
            partitioning,
            topics: HashMap::new(),
            sink_partitions: HashMap::new(),
        }
    }

    /// The sink topic of a source topic (the template rendered once per source topic).
    pub(crate) fn sink_topic(&mut self, source_topic: &str) -> Arc<str> {
        if let Some(t) = self.topics.get(source_topic) {
            return t.clone();
        }
        let t: Arc<str> = self.template.replace("{source_topic}", source_topic).into();
        self.topics.insert(source_topic.to_string(), t.clone());
        t
    }

    /// Tells the router how many partitions a sink topic has.
    pub(crate) fn set_sink_partitions(&mut self, sink_topic: &str, partitions: i32) {
        self.sink_partitions
            .insert(sink_topic.to_string(), partitions);
    }

    /// Where a source topic's records go: resolved once per run of records from one source
    /// partition, not per record (the read loop's lanes).
    pub(crate) fn route_of(&mut self, source_topic: &str) -> Route {
        let topic = self.sink_topic(source_topic);
        let by_key = match self.partitioning {
            Partitioning::Preserve => None,
            Partitioning::Key => Some(
                self.sink_partitions
                    .get(&*topic)
                    .copied()
                    .unwrap_or(1)
                    .max(1),
            ),
        };
        Route { topic, by_key }
    }

    /// Sink topic and partition of one record.
    pub(crate) fn route(
        &mut self,
        source_topic: &str,
        source_partition: i32,
        key: Option<&[u8]>,
    ) -> (Arc<str>, i32) {
        let route = self.route_of(source_topic);
        let partition = route.partition(source_partition, key);
        (route.topic, partition)
    }
}

/// A source topic's sink topic, and how a record's sink partition is picked.
#[derive(Clone, Debug)]
pub(crate) struct Route {
    pub(crate) topic: Arc<str>,
    /// The sink topic's partition count, when records are placed by key.
    by_key: Option<i32>,
}

impl Route {
    pub(crate) fn partition(&self, source_partition: i32, key: Option<&[u8]>) -> i32 {
        match (self.by_key, key) {
            (None, _) => source_partition,
            (Some(n), Some(k)) => kafka_key_partition(k, n),
            (Some(n), None) => source_partition % n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values from the Java client's own murmur2 tests (org.apache.kafka.common.utils.Utils).
    #[test]
    fn murmur2_matches_the_java_client() {
        let cases: [(&str, i32); 6] = [
            ("21", -973932308),
            ("foobar", -790332482),
            ("a-little-bit-long-string", -985981536),
            ("a-little-bit-longer-string", -1486304829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58897971,
            ),
            ("abc", 479470107),
        ];
        for (input, java) in cases {
            assert_eq!(
                murmur2::murmur2(input.as_bytes(), murmur2::KAFKA_SEED) as i32,
                java,
                "murmur2({input})"
            );
        }
    }

    #[test]
    fn key_partition_is_positive_modulo() {
        // toPositive(-973932308) % 7, as the Java partitioner computes it.
        let expected = ((-973932308i32 as u32 & 0x7fff_ffff) % 7) as i32;
        assert_eq!(kafka_key_partition(b"21", 7), expected);
        for n in 1..20 {
            let p = kafka_key_partition(b"some-key", n);
            assert!((0..n).contains(&p));
        }
    }

    #[test]
    fn routes_by_template_and_partitioning() {
        let mut r = Router::new("{source_topic}-copy", Partitioning::Preserve);
        assert_eq!(r.route("orders", 3, Some(b"k")), ("orders-copy".into(), 3));

        let mut r = Router::new("out", Partitioning::Key);
        r.set_sink_partitions("out", 4);
        let (t, p) = r.route("in", 3, Some(b"21"));
        assert_eq!(&*t, "out");
        assert_eq!(p, kafka_key_partition(b"21", 4));
        assert_eq!(
            r.route("in", 6, None).1,
            2,
            "keyless records stay on source partition mod n"
        );
    }
}
