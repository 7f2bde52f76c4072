//! A sink slower than checkpoint.timeout allows for a whole backlog: the bridge's producer is
//! throttled by a client quota (producer_byte_rate = 128 KiB/s, set with kafka-configs) and faces
//! 3,000 incompressible records of about 1 KB, with checkpoint.timeout = 4s. Unbounded epochs
//! would time out at "flush" and replay at the same size forever; bounded ones must bridge
//! everything, exactly once and in order per partition (judged by Kafka's read_committed console
//! consumer), in several checkpoints.

mod common;

use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::producer::{DefaultProducerContext, Producer, ThreadedProducer};

use common::bridge::*;
use common::scenario::*;
use common::*;

const PARTITIONS: i32 = 2;
const PER_PARTITION: usize = 1_500;
const PAD: usize = 1_000;
const QUOTA_BYTES_PER_S: &str = "131072";

/// Where the limit starts: the default sink.max_in_flight_bytes, read from the config, not restated.
fn default_cap() -> u64 {
    eos_bridge::config::SinkConfig::default().max_in_flight_bytes
}

/// A client quota on one client id, removed again when dropped (also when the test fails).
struct Quota {
    client_id: String,
}

impl Quota {
    fn set(bootstrap: &str, client_id: &str) -> Quota {
        let out = kafka_tool(
            "kafka.admin.ConfigCommand",
            &[
                "--bootstrap-server",
                bootstrap,
                "--alter",
                "--add-config",
                &format!("producer_byte_rate={QUOTA_BYTES_PER_S}"),
                "--entity-type",
                "clients",
                "--entity-name",
                client_id,
            ],
        );
        assert!(
            out.status.success(),
            "setting the quota failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Quota {
            client_id: client_id.to_string(),
        }
    }
}

impl Drop for Quota {
    fn drop(&mut self) {
        let out = kafka_tool(
            "kafka.admin.ConfigCommand",
            &[
                "--bootstrap-server",
                bootstrap(),
                "--alter",
                "--delete-config",
                "producer_byte_rate",
                "--entity-type",
                "clients",
                "--entity-name",
                &self.client_id,
            ],
        );
        if !out.status.success() {
            eprintln!(
                "removing the quota on {} failed (harmless, the client id is unique): {}",
                self.client_id,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// PER_PARTITION records per partition, "p<partition>-<seq>:" and PAD random letters and digits:
/// lz4 leaves them about as large as they are, so the quota sees every byte.
fn fill_input(bootstrap: &str, topic: &str) {
    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "20")
        .create()
        .unwrap();
    for i in 0..PER_PARTITION {
        for p in 0..PARTITIONS {
            let value = format!("p{p}-{i:06}:{}", random_alnum(PAD));
            send_to_partition(&producer, topic, p, &value);
        }
    }
    producer.flush(Duration::from_secs(60)).unwrap();
}

#[test]
fn a_sink_throttled_by_a_quota_makes_slow_progress_exactly_once() {
    let _serial = serial();
    let client_id = unique("slow-sink");
    let mut s = Scenario::new("slow", PARTITIONS as u32).with(|spec| {
        spec.interval = "1s";
        spec.checkpoint_timeout = "4s";
        spec.transaction_timeout = "30s";
        spec.extra = format!("\n[sink.kafka]\n\"client.id\" = \"{client_id}\"\n");
    });
    create_topic(&s.sink, &s.output, PARTITIONS as u32);
    fill_input(&s.source, &s.input);
    let total = (PER_PARTITION * PARTITIONS as usize) as i64;

    let _quota = Quota::set(&s.sink, &client_id);
    let started = Instant::now();
    let bridge = s.start(&[]);
    bridge.wait_committed(total, Duration::from_secs(75));
    let took = started.elapsed();

    let metric = |series: &str| bridge.metric(series).unwrap_or(0.0);
    let completed = metric("eos_bridge_checkpoints_total{result=\"completed\"}");
    let aborted = metric("eos_bridge_checkpoints_total{result=\"aborted\"}");
    let by_interval = metric("eos_bridge_epochs_ended_total{trigger=\"interval\"}");
    let by_size = metric("eos_bridge_epochs_ended_total{trigger=\"size\"}");
    let limit = metric("eos_bridge_in_flight_limit_bytes");
    let held = metric("eos_bridge_read_wait_seconds_total{reason=\"in_flight_limit\"}")
        + metric("eos_bridge_read_wait_seconds_total{reason=\"producer_queue\"}")
        + metric("eos_bridge_read_wait_seconds_total{reason=\"transaction_start\"}");
    let starved = metric("eos_bridge_read_wait_seconds_total{reason=\"source\"}");
    let hold = bridge.metric("eos_bridge_first_send_hold_seconds");
    let status_limit = bridge.status().expect("status answers")["in_flight_limit_bytes"]
        .as_u64()
        .expect("status names the in-flight limit");
    let status = bridge.stop_gracefully(Duration::from_secs(30));
    eprintln!(
        "throttled sink: {total} records of ~{PAD} B bridged in {took:?}; checkpoints completed {completed}, \
         aborted {aborted}; epochs ended by interval {by_interval}, by size {by_size}; \
         in-flight limit at the end {limit} B; reading held by the sink {held:.1} s, waiting for \
         the source {starved:.1} s"
    );
    assert!(status.success(), "{}", tail(&bridge.log_text(), 20));

    assert_eq!(s.judge(), total);
    // 3 MB through 128 KiB/s with a 4 s timeout cannot fit few checkpoints: the epochs were bounded.
    assert!(
        completed >= 4.0,
        "only {completed} checkpoints completed:\n{}",
        tail(&s.log(), 30)
    );
    // A cap-sized flush takes 64 s at this rate: the limit must have come down to the sink's pace.
    assert!(
        (limit as u64) < default_cap() && limit > 0.0,
        "in-flight limit {limit}"
    );
    assert_eq!(status_limit, limit as u64, "status and gauge agree");
    // Whatever a throttled sink's acknowledgements teach it, the first send after a commit is
    // never held longer than the ladder's top rung (docs/design.md, "The first send after a
    // commit"), and the gauge is there.
    let hold = hold.expect("eos_bridge_first_send_hold_seconds is exported");
    assert!((0.0..=0.014).contains(&hold), "first send held {hold} s");
    // The input was all there before the bridge started, so what held reading back was the sink:
    // each epoch reads for at least a quarter of the interval, and reaches the limit at once. The
    // source is waited for at the start, once everything is read, and when an epoch after an
    // abort reads its rewound input again (up to the source's fetch.wait.max.ms: with
    // librdkafka's 500 ms, four aborts once brought the source's share up to the sink's in CI,
    // 2.3 s against 2.3), so the bound takes half of every epoch's quarter (with `completed`
    // epochs' whole quarters it failed at its edge in CI, 2.0 s against 2.0, and the build
    // before that run's change came within 0.2 s of it in one run of four).
    assert!(
        held > starved && held >= 0.5 * 0.25 * by_interval,
        "reading held by the sink {held:.1} s, by the source {starved:.1} s, in {took:?}"
    );
}
