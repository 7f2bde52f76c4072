//! What the benchmark examples share: the wall clock they print, the two kinds of clients they
//! build (a producer with the bridge's batching settings, a read_committed consumer), partition
//! discovery, a send that waits out a full local queue, delivery counting, and the pseudo-random
//! capital letters the load generators write.
//!
//! Included by each example with `mod common;`; an example uses only part of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::client::Client;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message, ToBytes};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

// The cluster and topic most examples take (a plain comment: clap would print a doc comment as the
// about text of every example that flattens this).
#[derive(clap::Args)]
pub struct Target {
    #[arg(long)]
    pub bootstrap: String,
    #[arg(long)]
    pub topic: String,
}

// The two topics a copier takes.
#[derive(clap::Args)]
pub struct CopyTopics {
    #[arg(long)]
    pub bootstrap: String,
    #[arg(long)]
    pub input: String,
    #[arg(long)]
    pub output: String,
}

fn since_epoch() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap()
}

pub fn now_ms() -> u128 {
    since_epoch().as_millis()
}

pub fn now_us() -> u64 {
    since_epoch().as_micros() as u64
}

/// The defaults of eos-bridge's sink producer (src/sink.rs, build_producer), so that a copy or a
/// fill costs what the bridge's writes cost. With `BENCH_PRODUCER_STATS_MS` in the environment,
/// librdkafka's statistics every that many ms, printed by [`Deliveries`] as `S` lines.
pub fn bridge_producer(bootstrap: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap)
        .set("linger.ms", "1")
        .set("compression.type", "lz4")
        .set("queue.buffering.max.messages", "10000")
        .set("batch.size", "1000000")
        .set("enable.idempotence", "true");
    if let Ok(ms) = std::env::var("BENCH_PRODUCER_STATS_MS") {
        c.set("statistics.interval.ms", ms);
    }
    c
}

/// A consumer that sees committed records only, starts at the beginning where it has no position,
/// and commits nothing by itself.
pub fn read_committed_consumer(bootstrap: &str, group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", "earliest");
    c
}

/// A read_committed consumer with the prefetch defaults of eos-bridge's source (src/source.rs):
/// a copier that waits on its sink fills librdkafka's default prefetch and then fetches nothing for
/// fetch.queue.backoff.ms, 1 s by default, which halved a copy's records/s (C1 before session 21).
pub fn bridge_consumer(bootstrap: &str, group: &str) -> ClientConfig {
    let mut c = read_committed_consumer(bootstrap, group);
    c.set("enable.auto.offset.store", "false")
        .set("queued.max.messages.kbytes", "4096")
        .set("queued.min.messages", "20000")
        .set("fetch.queue.backoff.ms", "10")
        .set("fetch.max.bytes", "2097152");
    c
}

/// The partition ids of `topic` (none for a topic that does not exist).
pub fn partitions<C: ClientContext>(client: &Client<C>, topic: &str) -> Vec<i32> {
    let md = client
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    md.topics()[0].partitions().iter().map(|p| p.id()).collect()
}

/// Assigns every partition of `topic` to `consumer` from its beginning; returns each partition's
/// high watermark, the end of "every record present at start".
pub fn assign_all_from_start<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
) -> HashMap<i32, i64> {
    let parts = partitions(consumer.client(), topic);
    assert!(!parts.is_empty(), "input topic {topic} has no partitions");
    let mut tpl = TopicPartitionList::new();
    let mut ends = HashMap::new();
    for &p in &parts {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
        let (_, hi) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .expect("watermarks");
        ends.insert(p, hi);
    }
    consumer.assign(&tpl).expect("assign");
    ends
}

/// The copy of `msg` for the same partition of `topic`: key, payload and timestamp (headers are
/// the caller's: they must be detached first).
pub fn copy_of<'a>(msg: &'a BorrowedMessage<'_>, topic: &'a str) -> BaseRecord<'a, [u8], [u8], ()> {
    let mut rec = BaseRecord::to(topic).partition(msg.partition());
    if let Some(k) = msg.key() {
        rec = rec.key(k);
    }
    if let Some(v) = msg.payload() {
        rec = rec.payload(v);
    }
    if let Some(ts) = msg.timestamp().to_millis() {
        rec = rec.timestamp(ts);
    }
    rec
}

/// Hands `rec` to the producer, sleeping `backoff` whenever its local queue is full.
pub fn send_waiting<K, P, C>(
    producer: &ThreadedProducer<C>,
    mut rec: BaseRecord<'_, K, P, C::DeliveryOpaque>,
    backoff: Duration,
) where
    K: ToBytes + ?Sized,
    P: ToBytes + ?Sized,
    C: ProducerContext,
{
    loop {
        match producer.send(rec) {
            Ok(()) => return,
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                rec = back;
                std::thread::sleep(backoff);
            }
            Err((e, _)) => panic!("produce: {e}"),
        }
    }
}

/// Waits until every record sent is acknowledged. Not `Producer::flush`: rdkafka's flush polls the
/// producer's queue in 100 ms slices, and with a `ThreadedProducer` its own thread takes the
/// delivery events, so each flush sleeps a whole slice (see examples/flush_latency.rs).
pub fn wait_acked<C: ProducerContext>(producer: &impl Producer<C>) {
    let end = Instant::now() + Duration::from_secs(60);
    while producer.in_flight_count() > 0 {
        assert!(Instant::now() < end, "records not acknowledged within 60 s");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// A producer context counting acknowledged and failed deliveries.
#[derive(Default)]
pub struct Deliveries {
    pub acked: AtomicU64,
    pub failed: AtomicU64,
}

/// One stderr line per statistics interval (see [`bridge_producer`]): what a bounded window of
/// records in flight delivers depends on how long the broker takes to acknowledge them, which
/// bench/ab's CPU figures cannot show. Windows are librdkafka's, reset every interval, in µs:
/// `rtt` of the requests to the broker (Produce, for a copier), `int_latency` of a record in the
/// producer's queue, records and bytes per batch (the busiest topic's); `tx` and `txbytes` are the
/// requests and bytes sent so far.
/// `S <epoch ms> rtt_avg_us=.. rtt_p99_us=.. int_latency_avg_us=.. outbuf_latency_avg_us=..
///  waitresp_cnt=.. batchcnt_avg=.. batchsize_avg=.. tx=.. txbytes=..`
impl ClientContext for Deliveries {
    fn stats(&self, s: rdkafka::Statistics) {
        let w =
            |x: &Option<rdkafka::statistics::Window>| x.as_ref().map_or((0, 0), |w| (w.avg, w.p99));
        for b in s.brokers.values().filter(|b| b.nodeid >= 0) {
            let (rtt, rtt99) = w(&b.rtt);
            let (int_lat, _) = w(&b.int_latency);
            let (outbuf, _) = w(&b.outbuf_latency);
            let (cnt, size) = s
                .topics
                .values()
                .map(|t| (t.batchcnt.avg, t.batchsize.avg))
                .max()
                .unwrap_or((0, 0));
            eprintln!(
                "S {} rtt_avg_us={rtt} rtt_p99_us={rtt99} int_latency_avg_us={int_lat} \
                 outbuf_latency_avg_us={outbuf} waitresp_cnt={} batchcnt_avg={cnt} \
                 batchsize_avg={size} tx={} txbytes={}",
                now_ms(),
                b.waitresp_cnt,
                b.tx,
                b.txbytes
            );
        }
    }
}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();
    fn delivery(&self, r: &DeliveryResult<'_>, _: ()) {
        match r {
            Ok(_) => self.acked.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.failed.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// `len` pseudo-random capital letters (xorshift from `seed`): cheap filler that lz4 cannot shrink
/// much, taken at varying offsets so that records differ.
pub fn letters(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b'A' + (x % 26) as u8
        })
        .collect()
}
