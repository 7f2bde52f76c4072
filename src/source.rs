//! The source side: an rdkafka consumer that is assigned partitions (never balanced by a consumer
//! group), reads them read_committed from positions the pipeline gives it, rewinds on demand, and
//! discovers partitions and topics as they appear.
//!
//! Which partitions an instance owns follows from the topic name, the partition number and
//! `instance` of `instances` alone, so it is stable across restarts and unaffected by other topics.
//!
//! While a checkpoint completes, the consumer's own fetcher reads on into its bounded prefetch,
//! which the next epoch polls (docs/design.md "Reading on during a checkpoint"); nothing here polls
//! then. Records are taken off librdkafka a batch at a time (`records`), so up to one batch read
//! past the barrier waits in the source's buffer for the next epoch, and librdkafka's position of
//! their partitions is already past them (`positions_past_markers` leaves those alone).

mod records;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use integer_encoding::VarInt;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{BorrowedHeaders, Headers, Message};
use rdkafka::statistics::Statistics;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use regex::Regex;

use crate::config::{Config, OnBadRecord, StartPosition, SOURCE_TOPIC_PLACEHOLDER};
use crate::error::{is_auth, BridgeError, Result};
use crate::positions::Positions;

use records::Batches;
pub(crate) use records::SourceRecord;

const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether `instance` of `instances` owns a partition.
pub(crate) fn owns(instance: u32, instances: u32, topic: &str, partition: i32) -> bool {
    let spread = murmur2::murmur2(topic.as_bytes(), murmur2::KAFKA_SEED) as u64;
    ((spread + partition as u64) % instances.max(1) as u64) as u32 == instance
}

/// Keeps the last stable offset of every partition from librdkafka's periodic statistics, so
/// that lag is known without a round trip to the broker.
#[derive(Default)]
pub(crate) struct SourceContext {
    last_stable: Mutex<HashMap<(String, i32), i64>>,
}

impl ClientContext for SourceContext {
    fn error(&self, error: KafkaError, reason: &str) {
        crate::connectivity::on_error(crate::connectivity::Cluster::Source, &error, reason);
    }

    fn stats(&self, statistics: Statistics) {
        let mut map = self.last_stable.lock().unwrap_or_else(|p| p.into_inner());
        for (topic, t) in statistics.topics {
            for (partition, p) in t.partitions {
                if partition >= 0 && p.ls_offset >= 0 {
                    map.insert((topic.clone(), partition), p.ls_offset);
                }
            }
        }
    }
}

impl ConsumerContext for SourceContext {}

enum Selector {
    List(Vec<String>),
    Pattern(Regex),
}

/// Which topics are read: the listed ones; or those the pattern matches, minus
/// `source.topic_exclude`'s and (on one cluster) the bridge's own output, which a pattern would
/// otherwise feed back to it. (An exclusion that hits a listed topic is a config error.)
struct Selection {
    selector: Selector,
    exclude: Option<Regex>,
    /// Topics the bridge writes on the source cluster: its marker and offset-mapping topics, the sink and
    /// dead-letter topic templates (rendered per topic seen). Empty across clusters.
    own: Option<OwnOutput>,
}

struct OwnOutput {
    marker_topic: String,
    offsets_topic: String,
    sink_template: String,
    dead_letter_template: Option<String>,
}

impl Selection {
    fn new(cfg: &Config) -> Result<Selection> {
        let regex = |key: &str, p: &str| {
            Regex::new(&format!("^(?:{p})$"))
                .map_err(|e| BridgeError::InvalidTopicPattern(format!("{key}: {e}")))
        };
        let selector = match &cfg.source.topic_pattern {
            Some(p) => Selector::Pattern(regex("source.topic_pattern", p)?),
            None => Selector::List(cfg.source.topics.clone()),
        };
        let exclude = match &cfg.source.topic_exclude {
            Some(p) => Some(regex("source.topic_exclude", p)?),
            None => None,
        };
        let own =
            crate::config::same_cluster(&cfg.source.bootstrap_servers, &cfg.sink.bootstrap_servers)
                .then(|| OwnOutput {
                    marker_topic: cfg.sink.marker_topic.clone(),
                    offsets_topic: cfg.offsets.topic.clone(),
                    sink_template: cfg.sink.topic.clone(),
                    dead_letter_template: (cfg.sink.on_bad_record == OnBadRecord::DeadLetter)
                        .then(|| cfg.sink.dead_letter_topic.clone()),
                });
        Ok(Selection {
            selector,
            exclude,
            own,
        })
    }

    /// Whether `name` is one of the bridge's own output topics, given every topic the cluster has.
    fn is_own(&self, name: &str, seen: &[TopicMetadata]) -> bool {
        let Some(own) = &self.own else {
            return false;
        };
        let render = |template: &str, t: &str| template.replace(SOURCE_TOPIC_PLACEHOLDER, t);
        name == own.marker_topic
            || name == own.offsets_topic
            || seen.iter().any(|t| {
                t.name != name
                    && (render(&own.sink_template, &t.name) == name
                        || own
                            .dead_letter_template
                            .as_deref()
                            .is_some_and(|d| render(d, &t.name) == name))
            })
    }
}

/// Which topic a consumed record is from, without reading the topic's name: the address of
/// librdkafka's handle for the topic. `Message::topic()` measures the name and checks that it is
/// UTF-8 on every call, ~160 instructions per record at 100 B for a check the read loop makes
/// per record (bench/README.md, "Session 15").
///
/// Equal handles are the same topic for as long as the topic stays assigned: every assigned
/// partition holds a reference to its topic's handle, so no other topic's handle can take that
/// address meanwhile. The read loop compares handles within one epoch only, and the assignment
/// changes only between epochs (on the pipeline's own thread).
pub(crate) fn topic_handle(m: &SourceRecord<'_>) -> usize {
    // SAFETY: `ptr` is the live message `m` borrows; only its topic handle field is read, and the
    // address is only compared, never dereferenced.
    unsafe { (*m.ptr()).rkt as usize }
}

/// The headers of a consumed record; None when it has none.
///
/// librdkafka parses a consumed record's headers on first access, and for a record without any
/// it still allocates, zeroes and frees a parse buffer to read the count of zero: ~980
/// instructions per record, 9 % of the bridge's at 100 B (bench/README.md, "Session 31"). Most
/// records can be told headerless without that: see [`headerless_in_place`].
pub(crate) fn headers_of<'m>(m: &'m SourceRecord<'_>) -> Option<&'m BorrowedHeaders> {
    // SAFETY: the payload is a consumed record's value as librdkafka hands it out.
    if m.payload()
        .is_some_and(|v| unsafe { headerless_in_place(v) })
    {
        return None;
    }
    m.headers().filter(|h| h.count() > 0)
}

/// Whether a consumed record is a v2 record with a header count of zero, read where librdkafka
/// fetched it; false when that cannot be told this way (then librdkafka parses the headers).
///
/// librdkafka hands a non-empty value out in place, inside the fetched (or decompressed) record
/// set, one contiguous buffer (`rd_kafka_op_new_fetch_msg`, librdkafka 2.12). In the v2 record
/// format the value is preceded by its length as a zigzag varint and followed by the header
/// count, another one, whose single byte 0 means none. So a value whose bytes before it encode
/// its own length that way, and whose byte after it is 0, is a v2 record without headers. A v0 or
/// v1 message (no headers at all) never passes: its value is preceded by a four-byte big-endian
/// length L, and no k-byte varint of L > 0 matches the bytes there. For k = 1 the varint is 2L
/// where the length's last byte is L. For k > 1 every varint byte but the last has its high bit
/// set, and the length's byte under the first of them, (L >> 8(k-1)) & 0xff, reaches 0x80 only
/// for L >= 2^(8k-1), more than k varint bytes hold (for k = 5, the second of them is under the
/// length's top byte, below 0x80 for any length). An empty value is excluded: librdkafka hands it
/// out as a static empty string, not in place.
///
/// # Safety
///
/// `value` must be the payload of a message a librdkafka consumer returned, still alive. The up
/// to five bytes before it are then within its record (v2: the length varint; v0/v1: the length
/// and the fields before it), and the byte after it is read only once those bytes say v2, where
/// the header count is within the record.
unsafe fn headerless_in_place(value: &[u8]) -> bool {
    let len = value.len();
    if len == 0 || len > i32::MAX as usize {
        return false;
    }
    let mut varint = [0u8; 5];
    let k = (len as i64).encode_var(&mut varint);
    let start = value.as_ptr();
    // SAFETY: per the contract, the k <= 5 bytes before the value are within its record.
    let before = unsafe { std::slice::from_raw_parts(start.sub(k), k) };
    // SAFETY: read only for a v2 record, whose header count follows its value.
    before == &varint[..k] && unsafe { *start.add(len) } == 0
}

/// Key and payload bytes of a record: what the epoch's size bound counts.
pub(crate) fn record_bytes(m: &impl Message) -> u64 {
    (m.key().map_or(0, <[u8]>::len) + m.payload().map_or(0, <[u8]>::len)) as u64
}

pub(crate) struct Source {
    // Before the consumer: fields drop in order, and the buffered records and the queue must be
    // released before the consumer is destroyed.
    batches: RefCell<Batches>,
    consumer: BaseConsumer<SourceContext>,
    selection: Selection,
    instance: u32,
    instances: u32,
}

/// Our fetch.max.bytes when [source.kafka] sizes neither messages nor the prefetch.
const FETCH_MAX_BYTES: usize = 2 * 1024 * 1024;

impl Source {
    pub(crate) fn new(cfg: &Config) -> Result<Source> {
        let mut cc = ClientConfig::new();
        // Defaults [source.kafka] may override (docs/sizing.md has the measurements). librdkafka
        // prefetches up to 64 MiB or 100,000 records, most of the bridge's memory; 4 MiB or
        // 20,000 records keeps the pipeline fed (small records cost more in librdkafka's per-record
        // overhead than in payload, hence the count). Whenever the prefetch is full it postpones
        // the partition's next fetch by fetch.queue.backoff.ms, 1 s by default: the bridge, whose
        // reading waits on the sink, fills it every checkpoint, and then read nothing for up to a
        // second (2x the records/s at 100 B, and at 1 KB, with 10 ms).
        cc.set("queued.max.messages.kbytes", "4096")
            .set("queued.min.messages", "20000")
            .set("fetch.queue.backoff.ms", "10");
        // A caught-up consumer keeps one fetch parked at the broker for fetch.wait.max.ms (500 ms
        // by default), and librdkafka sends the next fetch to that broker only once it returns.
        // So a rewind (every abort) or a new partition read nothing for up to half a second, all
        // of the quarter-interval an epoch reads after a slow checkpoint (tests/slow_sink.rs:
        // 236-249 ms of 250 after each of the first two aborts; 0.4-53 ms with 50). A parked
        // fetch still returns as soon as a record arrives, so 100 ms costs only idle requests.
        cc.set("fetch.wait.max.ms", "100");
        // A fetch in flight when the prefetch fills lands on top of it: librdkafka sizes fetches
        // at the prefetch's bytes (4 MiB), so the peak was twice the prefetch. 2 MiB took 100 B
        // peak RSS from 67 to 51 MB (with the 20,000 records above) at the same records/s, at 1 KB
        // too. Left to librdkafka when the operator sizes messages or the prefetch: it refuses a
        // fetch.max.bytes below message.max.bytes.
        let user = &cfg.source.kafka;
        if [
            "fetch.max.bytes",
            "message.max.bytes",
            "queued.max.messages.kbytes",
        ]
        .iter()
        .all(|k| user.get(k).is_none())
        {
            cc.set("fetch.max.bytes", FETCH_MAX_BYTES.to_string());
        }
        for (k, v) in cfg.source.kafka.iter() {
            cc.set(k, v);
        }
        cc.set("bootstrap.servers", &cfg.source.bootstrap_servers)
            // Never committed to by this consumer: positions live in our checkpoints, and the
            // monitoring group (by default this same id) has a client of its own, offsets::monitor.
            .set("group.id", crate::acl::source_group(&cfg.bridge.id))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // Aborted source transactions must never be bridged.
            .set("isolation.level", "read_committed")
            // An out-of-range position is an error we handle (fail or count the loss), never a
            // silent reset.
            .set("auto.offset.reset", "error")
            .set("enable.partition.eof", "false")
            .set("statistics.interval.ms", "2000");
        let consumer: BaseConsumer<SourceContext> = cc
            .create_with_context(SourceContext::default())
            .map_err(|e| BridgeError::kafka("create source consumer", e))?;
        Ok(Source {
            batches: RefCell::new(Batches::new(consumer.client().native_ptr())),
            consumer,
            selection: Selection::new(cfg)?,
            instance: cfg.bridge.instance,
            instances: cfg.bridge.instances,
        })
    }

    /// Source topics that exist now, with their partition counts. Listed topics that do not exist
    /// are an error naming them (`SourceTopicsMissing`); listed topics the cluster reports an
    /// error for are `SourceTopicsUnavailable`, a passing state; a pattern may match nothing yet.
    pub(crate) fn discover(&self) -> Result<BTreeMap<String, i32>> {
        let md = self
            .consumer
            .fetch_metadata(None, METADATA_TIMEOUT)
            .map_err(|e| BridgeError::kafka("fetch source metadata", e))?;
        let seen: Vec<TopicMetadata> = md
            .topics()
            .iter()
            .map(|t| TopicMetadata {
                name: t.name().to_string(),
                error: t.error().map(RDKafkaErrorCode::from),
                partitions: t.partitions().len() as i32,
            })
            .collect();
        select_topics(&self.selection, &seen)
    }

    /// The (topic, partition) pairs this instance owns among the discovered ones.
    pub(crate) fn owned(&self, topics: &BTreeMap<String, i32>) -> Vec<(String, i32)> {
        topics
            .iter()
            .flat_map(|(t, n)| (0..*n).map(move |p| (t.clone(), p)))
            .filter(|(t, p)| owns(self.instance, self.instances, t, *p))
            .collect()
    }

    /// (earliest, last stable) offsets of a partition, asked of the broker.
    pub(crate) fn watermarks(&self, topic: &str, partition: i32) -> Result<(i64, i64)> {
        self.consumer
            .fetch_watermarks(topic, partition, METADATA_TIMEOUT)
            .map_err(|e| BridgeError::kafka("fetch source watermarks", e))
    }

    /// The last stable offset from the latest statistics: no network round trip.
    pub(crate) fn cached_high_watermark(&self, topic: &str, partition: i32) -> Option<i64> {
        let map = self
            .consumer
            .context()
            .last_stable
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        map.get(&(topic.to_string(), partition)).copied()
    }

    /// Concrete positions for partitions that have no committed position yet.
    pub(crate) fn resolve(
        &self,
        start: StartPosition,
        parts: &[(String, i32)],
    ) -> Result<Positions> {
        let mut out = Positions::new();
        match start {
            StartPosition::Earliest | StartPosition::Latest => {
                for (t, p) in parts {
                    let (lo, hi) = self.watermarks(t, *p)?;
                    out.set(
                        t,
                        *p,
                        if start == StartPosition::Earliest {
                            lo
                        } else {
                            hi
                        },
                    );
                }
            }
            StartPosition::Timestamp(ms) => {
                let mut tpl = TopicPartitionList::new();
                for (t, p) in parts {
                    tpl.add_partition_offset(t, *p, Offset::Offset(ms))
                        .map_err(|e| BridgeError::kafka("offsets_for_times", e))?;
                }
                let found = self
                    .consumer
                    .offsets_for_times(tpl, METADATA_TIMEOUT)
                    .map_err(|e| BridgeError::kafka("offsets_for_times", e))?;
                for e in found.elements() {
                    let off = match e.offset() {
                        Offset::Offset(o) => o,
                        // No record at or after the timestamp: start at the end.
                        _ => self.watermarks(e.topic(), e.partition())?.1,
                    };
                    out.set(e.topic(), e.partition(), off);
                }
            }
        }
        Ok(out)
    }

    /// Assigns exactly these partitions at these positions; also the way to rewind, since a new
    /// assignment drops whatever was prefetched (librdkafka's queue by version, our buffer here).
    pub(crate) fn assign(&self, positions: &Positions) -> Result<()> {
        self.batches
            .borrow_mut()
            .assigning(positions.iter().map(|(t, p, _)| (t, p)))?;
        let mut tpl = TopicPartitionList::new();
        for (t, p, o) in positions.iter() {
            tpl.add_partition_offset(t, p, Offset::Offset(o))
                .map_err(|e| BridgeError::kafka("assign", e))?;
        }
        self.consumer
            .assign(&tpl)
            .map_err(|e| BridgeError::kafka("assign", e))
    }

    /// The next record, the consumer's own message (not copied), waiting up to `timeout` when
    /// none is ready; or a consumer error. Whenever its buffer of records runs dry it first lets
    /// rdkafka serve the consumer's own queue (statistics, logs and errors: see `records`).
    ///
    /// Err: a record arrived on the consumer's own queue, outside the forwarding, so that the
    /// order of its partition is no longer ours to keep; the epoch must abort and rewind.
    pub(crate) fn poll(&self, timeout: Duration) -> Result<Option<KafkaResult<SourceRecord<'_>>>> {
        let mut batches = self.batches.borrow_mut();
        if batches.is_empty() {
            match self.consumer.poll(Duration::ZERO) {
                None => {}
                Some(Err(e)) => return Ok(Some(Err(e))),
                Some(Ok(stray)) => {
                    tracing::error!(
                        topic = stray.topic(),
                        partition = stray.partition(),
                        offset = stray.offset(),
                        "a source record arrived outside the bridge's record queue; the epoch \
                         aborts and reads it again in order"
                    );
                    return Err(BridgeError::kafka(
                        "consume (a record outside the record queue)",
                        KafkaError::MessageConsumption(RDKafkaErrorCode::Fail),
                    ));
                }
            }
            batches.fill(timeout)?;
        }
        Ok(batches.next())
    }

    /// `positions` (what the epoch read, record offset + 1), each moved to the consumer's position
    /// where that is ahead. At a barrier only transaction markers or aborted records lie between
    /// the two (librdkafka moves the position over those as it reads them, and no record was
    /// polled since), so both stand for the same place in the partition. Lag tools get it (a
    /// caught-up transactional partition shows lag 0, not 1 forever: they count to the log end),
    /// and so does the offset mapping (a group caught up to the log end translates without asking
    /// the source cluster).
    pub(crate) fn positions_past_markers(&self, positions: &Positions) -> Positions {
        let read = self.consumer.position().unwrap_or_default();
        // librdkafka's position is past the records buffered here too.
        let pending = self.batches.borrow().pending_partitions();
        positions
            .iter()
            .map(|(t, p, o)| {
                let at = match read.find_partition(t, p).map(|e| e.offset()) {
                    Some(Offset::Offset(r)) if r > o && !pending.contains(&(t.to_string(), p)) => r,
                    _ => o,
                };
                (t.to_string(), p, at)
            })
            .collect()
    }
}

/// What the source cluster said about one topic.
struct TopicMetadata {
    name: String,
    error: Option<RDKafkaErrorCode>,
    partitions: i32,
}

/// The topics the selector wants among those the cluster reported. A listed topic the cluster
/// does not know is missing; one it knows but reports an error for (or without partitions) is
/// unavailable for now; one the bridge may not describe is an authorization failure.
fn select_topics(selection: &Selection, seen: &[TopicMetadata]) -> Result<BTreeMap<String, i32>> {
    let selector = &selection.selector;
    let mut found = BTreeMap::new();
    let mut unavailable = Vec::new();
    for t in seen {
        let wanted = match selector {
            Selector::List(list) => list.contains(&t.name),
            Selector::Pattern(re) => {
                !t.name.starts_with("__")
                    && re.is_match(&t.name)
                    && !selection
                        .exclude
                        .as_ref()
                        .is_some_and(|x| x.is_match(&t.name))
                    && !selection.is_own(&t.name, seen)
            }
        };
        if !wanted {
            continue;
        }
        match t.error {
            None if t.partitions > 0 => {
                found.insert(t.name.clone(), t.partitions);
            }
            Some(code) if is_auth(code) => {
                return Err(BridgeError::Unauthorized {
                    op: "describe source topic",
                    code,
                })
            }
            Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => {}
            _ => unavailable.push(t.name.clone()),
        }
    }
    if let Selector::List(list) = selector {
        let missing: Vec<String> = list
            .iter()
            .filter(|t| !found.contains_key(*t) && !unavailable.contains(t))
            .cloned()
            .collect();
        if !missing.is_empty() {
            return Err(BridgeError::SourceTopicsMissing { topics: missing });
        }
        if !unavailable.is_empty() {
            return Err(BridgeError::SourceTopicsUnavailable {
                topics: unavailable,
            });
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Action;

    /// A zigzag varint, as the v2 record format writes its lengths and counts.
    fn zigzag(n: i64, out: &mut Vec<u8>) {
        out.extend(n.encode_var_vec());
    }

    /// A v2 record from its attributes on (a key "k", `len` bytes of value, `headers` header
    /// entries), followed by the start of another record; and where its value starts.
    fn v2_record(len: usize, headers: i64) -> (Vec<u8>, usize) {
        let mut b = vec![0, 2, 4];
        zigzag(1, &mut b);
        b.push(b'k');
        zigzag(len as i64, &mut b);
        let at = b.len();
        b.resize(at + len, b'v');
        zigzag(headers, &mut b);
        for _ in 0..headers {
            zigzag(1, &mut b);
            b.push(b'h');
            zigzag(0, &mut b);
        }
        b.extend([0x20, 0]);
        (b, at)
    }

    /// A v1 message from its CRC on (null key, `len` bytes of value), followed by `after`.
    fn v1_message(len: usize, after: u8) -> (Vec<u8>, usize) {
        let mut b = vec![0xde, 0xad, 0xbe, 0xef, 1, 0];
        b.extend(1_700_000_000_000i64.to_be_bytes());
        b.extend((-1i32).to_be_bytes());
        b.extend((len as i32).to_be_bytes());
        let at = b.len();
        b.resize(at + len, after ^ 0x55);
        b.extend([after; 8]);
        (b, at)
    }

    fn headerless(record: &(Vec<u8>, usize), len: usize) -> bool {
        let (b, at) = record;
        // SAFETY: the bytes before and after the value are in `b`, as in a fetched record set.
        unsafe { headerless_in_place(&b[*at..*at + len]) }
    }

    #[test]
    fn a_v2_record_without_headers_is_told_from_the_bytes_around_its_value() {
        for len in (1..=300).chain([8_191, 8_192, 1 << 14, 1_048_575, 1_048_576, 3 << 20]) {
            assert!(headerless(&v2_record(len, 0), len), "{len} bytes");
            for headers in [1, 2, 63, 64] {
                assert!(
                    !headerless(&v2_record(len, headers), len),
                    "{len} bytes, {headers}"
                );
            }
        }
    }

    #[test]
    fn an_empty_value_and_an_old_format_message_go_to_librdkafka() {
        // An empty value is librdkafka's static "", not in place: nothing can be read around it.
        assert!(!headerless(&v2_record(0, 0), 0));
        for len in (1..=20_000).chain([32_767, 32_768, 1 << 20, 1 << 23, 1 << 24]) {
            for after in [0, 1] {
                assert!(
                    !headerless(&v1_message(len, after), len),
                    "{len} bytes, then {after}"
                );
            }
        }
    }

    /// A tripwire for upgrades: `headerless_in_place` relies on how this librdkafka hands out a
    /// consumed value (in place, inside its record: `rd_kafka_op_new_fetch_msg`). Re-check that in
    /// the new version's source, then update the version here.
    #[test]
    fn librdkafka_is_the_version_whose_value_layout_was_checked() {
        assert_eq!(rdkafka::util::get_rdkafka_version().1, "2.12.1");
    }

    proptest::proptest! {
        #[test]
        fn no_old_format_length_reads_as_the_varint_of_itself(len in 1usize..(1 << 27)) {
            let mut varint = Vec::new();
            zigzag(len as i64, &mut varint);
            let mut before = vec![0xff];
            before.extend((len as i32).to_be_bytes());
            proptest::prop_assert!(!before.ends_with(&varint));
        }
    }

    fn md(name: &str, error: Option<RDKafkaErrorCode>, partitions: i32) -> TopicMetadata {
        TopicMetadata {
            name: name.into(),
            error,
            partitions,
        }
    }

    #[test]
    fn listed_topics_are_found_missing_or_unavailable() {
        let list = only(Selector::List(vec!["a".into(), "b".into()]));
        let ok = select_topics(
            &list,
            &[md("a", None, 3), md("b", None, 1), md("c", None, 2)],
        )
        .unwrap();
        assert_eq!(
            ok.into_iter().collect::<Vec<_>>(),
            [("a".to_string(), 3), ("b".to_string(), 1)]
        );

        let err = select_topics(&list, &[md("a", None, 3)]).unwrap_err();
        assert!(
            matches!(&err, BridgeError::SourceTopicsMissing { topics } if topics == &["b"]),
            "{err}"
        );
        assert_eq!(err.action(), Action::Stop);
        assert!(!err.is_transient());
        assert!(err.to_string().contains("do not exist"), "{err}");
        let err = select_topics(
            &list,
            &[
                md("a", None, 3),
                md("b", Some(RDKafkaErrorCode::UnknownTopicOrPartition), 0),
            ],
        )
        .unwrap_err();
        assert!(
            matches!(err, BridgeError::SourceTopicsMissing { .. }),
            "{err}"
        );

        // A broker restarting: the topic is there, its leader is not (yet).
        for (error, partitions) in [(Some(RDKafkaErrorCode::LeaderNotAvailable), 3), (None, 0)] {
            let err =
                select_topics(&list, &[md("a", None, 3), md("b", error, partitions)]).unwrap_err();
            assert!(
                matches!(err, BridgeError::SourceTopicsUnavailable { .. }),
                "{err}"
            );
            assert_ne!(err.action(), Action::Stop);
            assert!(err.is_transient());
        }

        let err = select_topics(
            &list,
            &[
                md("a", None, 3),
                md("b", Some(RDKafkaErrorCode::TopicAuthorizationFailed), 0),
            ],
        )
        .unwrap_err();
        assert!(matches!(err, BridgeError::Unauthorized { .. }), "{err}");
        assert_eq!(err.action(), Action::Stop);
    }

    #[test]
    fn a_pattern_skips_topics_in_error_and_internal_topics() {
        let re = only(Selector::Pattern(Regex::new("^(?:t.*|__.*)$").unwrap()));
        let found = select_topics(
            &re,
            &[
                md("t1", None, 2),
                md("t2", Some(RDKafkaErrorCode::LeaderNotAvailable), 2),
                md("__consumer_offsets", None, 50),
                md("other", None, 1),
            ],
        )
        .unwrap();
        assert_eq!(
            found.into_iter().collect::<Vec<_>>(),
            [("t1".to_string(), 2)]
        );
    }

    fn only(selector: Selector) -> Selection {
        Selection {
            selector,
            exclude: None,
            own: None,
        }
    }

    #[test]
    fn exclusions_and_own_output_are_never_selected() {
        let selection = Selection {
            selector: Selector::Pattern(Regex::new("^(?:orders.*)$").unwrap()),
            exclude: Some(Regex::new("^(?:orders\\.tmp.*)$").unwrap()),
            own: Some(OwnOutput {
                marker_topic: "orders.markers".into(),
                offsets_topic: "orders.offsets".into(),
                sink_template: "{source_topic}-copy".into(),
                dead_letter_template: Some("{source_topic}-dlq".into()),
            }),
        };
        let seen = [
            md("orders.eu", None, 2),
            md("orders.eu-copy", None, 2),
            md("orders.eu-dlq", None, 2),
            md("orders.markers", None, 1),
            md("orders.offsets", None, 1),
            md("orders.tmp1", None, 1),
        ];
        let found = select_topics(&selection, &seen).unwrap();
        assert_eq!(
            found.into_iter().collect::<Vec<_>>(),
            [("orders.eu".to_string(), 2)]
        );
    }

    #[test]
    fn every_partition_has_exactly_one_owner() {
        for instances in 1..6 {
            for p in 0..50 {
                let owners = (0..instances)
                    .filter(|i| owns(*i, instances, "orders", p))
                    .count();
                assert_eq!(owners, 1, "partition {p} of {instances} instances");
            }
        }
    }

    #[test]
    fn ownership_spreads_partitions() {
        let mine = (0..60).filter(|p| owns(0, 3, "events", *p)).count();
        assert_eq!(mine, 20, "consecutive partitions rotate over the instances");
    }
}
