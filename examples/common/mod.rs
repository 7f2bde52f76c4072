//! What the benchmark examples share: the wall clock they print, the two kinds of clients they
//! build (a producer with the bridge's batching settings, a read_committed consumer), partition
//! discovery, reading in batches as the bridge's source reads, a send that waits out a full local
//! queue, delivery counting, and the pseudo-random capital letters the load generators write.
//!
//! Included by each example with `mod common;`; an example uses only part of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::bindings as rdsys;
use rdkafka::client::Client;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Message, OwnedHeaders, ToBytes};
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
/// librdkafka's statistics every that many ms, printed by [`Deliveries`] as `S` lines; with
/// `BENCH_QUEUE_MESSAGES`, that queue.buffering.max.messages instead of the bridge's default (to
/// measure a default before the bridge takes it).
pub fn bridge_producer(bootstrap: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap)
        .set("linger.ms", "1")
        .set("compression.type", "lz4")
        .set(
            "queue.buffering.max.messages",
            std::env::var("BENCH_QUEUE_MESSAGES").unwrap_or_else(|_| "20000".into()),
        )
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

/// Reads a consumer's records up to `n` per call of librdkafka's rd_kafka_consume_batch_queue, as
/// the bridge's source does since session 38 (src/source/records.rs), but from the consumer's own
/// queue: the copiers assign once and never rewind, so they need none of the bridge's forwarding.
/// Other events on that queue (statistics, logs, commit results) are served without callbacks,
/// that is dropped; a consumer error is printed and skipped.
pub struct BatchReader<'c> {
    queue: *mut rdsys::rd_kafka_queue_t,
    buf: Vec<*mut rdsys::rd_kafka_message_t>,
    _consumer: PhantomData<&'c BaseConsumer>,
}

impl<'c> BatchReader<'c> {
    pub fn new(consumer: &'c BaseConsumer, n: usize) -> Self {
        assert!(n > 0, "a batch of at least one record");
        // SAFETY: the handle is destroyed on drop, which the lifetime puts before the consumer's.
        let queue = unsafe { rdsys::rd_kafka_queue_get_consumer(consumer.client().native_ptr()) };
        BatchReader {
            queue,
            buf: vec![std::ptr::null_mut(); n],
            _consumer: PhantomData,
        }
    }

    /// Waits up to `wait` (rounded up to whole ms, so that a wait under 1 ms does not spin) for
    /// records and hands each one read, as a copy for the same partition of `output` (key,
    /// payload, timestamp, and with `copy_headers` its headers, parsed for every record as the
    /// bridge's data path parses them), to `f` with its partition and offset. Returns the records
    /// read.
    pub fn copy_each(
        &mut self,
        wait: Duration,
        output: &str,
        copy_headers: bool,
        mut f: impl FnMut(i32, i64, BaseRecord<'_, [u8], [u8], ()>),
    ) -> usize {
        let ms = i32::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        // SAFETY: the consumer outlives the queue handle (the lifetime) and only this reader
        // reads that queue. Each message is handed out as a borrowed record, which `f` must
        // consume (a produce copies key and payload), and destroyed after `f` returns.
        unsafe {
            let got = rdsys::rd_kafka_consume_batch_queue(
                self.queue,
                ms,
                self.buf.as_mut_ptr(),
                self.buf.len(),
            );
            assert!(got >= 0, "rd_kafka_consume_batch_queue failed");
            let got = got as usize;
            for &mp in &self.buf[..got] {
                let m = &*mp;
                if m.err == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
                    let mut rec = BaseRecord::<[u8], [u8], ()>::to(output).partition(m.partition);
                    if let Some(k) = raw_bytes(m.key, m.key_len) {
                        rec = rec.key(k);
                    }
                    if let Some(v) = raw_bytes(m.payload, m.len) {
                        rec = rec.payload(v);
                    }
                    let ts = rdsys::rd_kafka_message_timestamp(mp, std::ptr::null_mut());
                    if ts >= 0 {
                        rec = rec.timestamp(ts);
                    }
                    if let Some(h) = copy_headers.then(|| headers_of(mp)).flatten() {
                        rec = rec.headers(owned_copy(h));
                    }
                    f(m.partition, m.offset, rec);
                } else {
                    eprintln!("consumer error {:?}", m.err);
                }
                rdsys::rd_kafka_message_destroy(mp);
            }
            got
        }
    }
}

impl Drop for BatchReader<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from rd_kafka_queue_get_consumer and is released once.
        unsafe { rdsys::rd_kafka_queue_destroy(self.queue) }
    }
}

/// `n` bytes at `p`, or None for a null pointer (a null key or payload).
///
/// # Safety
/// `p` is null or points at `n` bytes that outlive the returned slice.
pub unsafe fn raw_bytes<'a>(p: *mut std::ffi::c_void, n: usize) -> Option<&'a [u8]> {
    (!p.is_null()).then(|| std::slice::from_raw_parts(p as *const u8, n))
}

/// The headers of the live message `mp` (parsed on this first call), None when it has none.
///
/// SAFETY: `mp` is a live message of a consumer; the pointer lives as long as the message.
unsafe fn headers_of(mp: *mut rdsys::rd_kafka_message_t) -> Option<*mut rdsys::rd_kafka_headers_t> {
    let mut hdrs = std::ptr::null_mut();
    let found = rdsys::rd_kafka_message_headers(mp, &mut hdrs)
        == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR;
    (found && rdsys::rd_kafka_header_cnt(hdrs) > 0).then_some(hdrs)
}

/// A copy of `hdrs`, header by header (rdkafka has no public constructor from librdkafka's).
///
/// SAFETY: `hdrs` is live.
unsafe fn owned_copy(hdrs: *mut rdsys::rd_kafka_headers_t) -> OwnedHeaders {
    let count = rdsys::rd_kafka_header_cnt(hdrs);
    let mut out = OwnedHeaders::new_with_capacity(count);
    for i in 0..count {
        let (mut name, mut value, mut size) = (std::ptr::null(), std::ptr::null(), 0);
        let err = rdsys::rd_kafka_header_get_all(hdrs, i, &mut name, &mut value, &mut size);
        assert!(
            err == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR,
            "header {i} of {count}: {err:?}"
        );
        let key = std::ffi::CStr::from_ptr(name).to_string_lossy();
        out = out.insert(Header {
            key: &key,
            value: raw_bytes(value as *mut _, size),
        });
    }
    out
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
/// The maxima and `int_latency_p99_us` are what eos-bridge logs per window ("sink broker
/// latency", target eos_bridge::sink), for a comparison in the same runs.
/// `S <epoch ms> rtt_avg_us=.. rtt_p99_us=.. int_latency_avg_us=.. outbuf_latency_avg_us=..
///  waitresp_cnt=.. batchcnt_avg=.. batchsize_avg=.. tx=.. txbytes=.. rtt_max_us=..
///  int_latency_p99_us=.. int_latency_max_us=..`
impl ClientContext for Deliveries {
    fn stats(&self, s: rdkafka::Statistics) {
        let w = |x: &Option<rdkafka::statistics::Window>| {
            x.as_ref().map_or((0, 0, 0), |w| (w.avg, w.p99, w.max))
        };
        for b in s.brokers.values().filter(|b| b.nodeid >= 0) {
            let (rtt, rtt99, rtt_max) = w(&b.rtt);
            let (int_lat, int_lat99, int_lat_max) = w(&b.int_latency);
            let (outbuf, _, _) = w(&b.outbuf_latency);
            let (cnt, size) = s
                .topics
                .values()
                .map(|t| (t.batchcnt.avg, t.batchsize.avg))
                .max()
                .unwrap_or((0, 0));
            eprintln!(
                "S {} rtt_avg_us={rtt} rtt_p99_us={rtt99} int_latency_avg_us={int_lat} \
                 outbuf_latency_avg_us={outbuf} waitresp_cnt={} batchcnt_avg={cnt} \
                 batchsize_avg={size} tx={} txbytes={} rtt_max_us={rtt_max} \
                 int_latency_p99_us={int_lat99} int_latency_max_us={int_lat_max}",
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
