//! A record the sink can never take, behind a backlog: 200,000 small records with one 500 KB
//! record in the middle of partition 0, into a sink topic with max.message.bytes = 65536. With
//! `on_bad_record = "stop"` the bridge must name exactly that record and stop, its transaction
//! aborted; with `"dead-letter"` it must write that record once to the dead-letter topic and
//! everything else once to the sink. Judged by Kafka's console consumer with read_committed.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rand::Rng;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};

use common::bridge::*;
use common::*;

const PARTITIONS: i32 = 2;
const PER_PARTITION: usize = 100_000;
/// Offset of the poison record in partition 0: in the middle, behind half the backlog.
const POISON_OFFSET: usize = 50_000;
const POISON_BYTES: usize = 500_000;
const SINK_LIMIT: &str = "65536";

/// Random printable text without '|': incompressible enough that lz4 leaves it far above the sink
/// topic's limit, and one line of the console consumer's output, comparable as it is.
fn poison_value() -> String {
    let mut rng = rand::rng();
    (0..POISON_BYTES)
        .map(|_| loop {
            let c = rng.random_range(b' '..=b'~');
            if c != b'|' {
                break c as char;
            }
        })
        .collect()
}

/// Writes the input: PER_PARTITION records of 100 bytes into each partition, and the poison record
/// at POISON_OFFSET of partition 0, in front of the rest. Returns the poison's value.
fn fill_input(bootstrap: &str, topic: &str) -> String {
    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .set("linger.ms", "20")
        .set("queue.buffering.max.messages", "500000")
        .create()
        .unwrap();
    let poison = poison_value();
    const PAD: usize = 88;
    let started = Instant::now();
    for i in 0..PER_PARTITION {
        for p in 0..PARTITIONS {
            let small = format!("p{p}-{i:07}-{}", random_alnum(PAD));
            let values: &[&str] = if p == 0 && i == POISON_OFFSET {
                &[&poison, &small]
            } else {
                &[&small]
            };
            for value in values {
                send_to_partition(&producer, topic, p, value);
            }
        }
    }
    producer.flush(Duration::from_secs(60)).unwrap();
    eprintln!(
        "input: {} small records and the poison written in {:?}",
        PER_PARTITION * PARTITIONS as usize,
        started.elapsed()
    );
    poison
}

/// The checks every variant shares: no sink partition holds anything twice, and each is a prefix
/// (stop) or the whole (dead-letter) of its source partition without the poison record, in order.
fn source_without_poison(source: &BTreeMap<i32, Vec<String>>) -> BTreeMap<i32, Vec<String>> {
    let mut expected = source.clone();
    let p0 = expected.get_mut(&0).expect("partition 0 read back");
    assert!(
        p0[POISON_OFFSET].len() == POISON_BYTES,
        "the poison record is at offset {POISON_OFFSET} of partition 0"
    );
    p0.remove(POISON_OFFSET);
    expected
}

fn transactional_id(spec: &BridgeSpec) -> String {
    format!("eos-bridge-{}-{}", spec.id, spec.instance)
}

#[test]
fn a_bad_record_behind_a_backlog_stops_the_bridge_naming_it() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("bad-stop-in");
    let output = unique("bad-stop-out");
    create_topic(b, &input, PARTITIONS as u32);
    create_topic_with(
        b,
        &output,
        PARTITIONS as u32,
        &[&format!("max.message.bytes={SINK_LIMIT}")],
    );
    fill_input(b, &input);

    let spec = BridgeSpec::new(&input, &output);
    let txn_id = transactional_id(&spec);
    let home = BridgeHome::new(spec);
    let started = Instant::now();
    let mut bridge = home.start(&[]);
    let status = bridge
        .wait_exit(Duration::from_secs(90))
        .unwrap_or_else(|| {
            panic!(
                "the bridge did not stop within 90 s:\n{}",
                tail(&bridge.log_text(), 30)
            )
        });
    let took = started.elapsed();
    assert_eq!(status.code(), Some(1), "{}", tail(&bridge.log_text(), 20));
    let log = bridge.log_text();
    let named = format!("{input}/0@{POISON_OFFSET}");
    let last = log
        .lines()
        .rev()
        .find(|l| l.starts_with("eos-bridge: "))
        .unwrap_or_default();
    assert!(
        last.contains(&named),
        "the final error names {named}:\n{}",
        tail(&log, 20)
    );
    assert!(
        last.contains("MessageSizeTooLarge") || last.contains("too large"),
        "the final error gives the broker's error:\n{last}"
    );
    assert!(
        last.contains("max.message.bytes") && last.contains("dead-letter"),
        "the final error gives the fixes:\n{last}"
    );
    // No other record is blamed anywhere in the log.
    for line in log.lines().filter(|l| l.contains("delivery of")) {
        assert!(
            line.contains(&named),
            "an innocent record was blamed: {line}"
        );
    }
    // Aborted before the exit, not left open for the coordinator's timeout (30 s here): an abort
    // that bumps the producer epoch ends in Empty, a plain one in CompleteAbort.
    let state = transaction_state(b, &txn_id);
    assert!(
        matches!(state.as_deref(), Some("CompleteAbort" | "Empty")),
        "the open transaction is aborted before the bridge exits, found {state:?}"
    );

    let source = by_partition(&console_consume(b, &input, true, Duration::from_secs(5)));
    let expected = source_without_poison(&source);
    let sink = by_partition(&console_consume(b, &output, true, Duration::from_secs(5)));
    let mut visible = 0;
    for (p, want) in &expected {
        let got = sink.get(p).cloned().unwrap_or_default();
        assert!(
            got.len() <= want.len() && want[..got.len()] == got[..],
            "partition {p}: the sink ({} records) is not a prefix of the source",
            got.len()
        );
        visible += got.len();
    }
    let p0 = sink.get(&0).map_or(0, Vec::len);
    assert!(
        p0 <= POISON_OFFSET,
        "nothing at or after the poison record of partition 0 is visible ({p0} records)"
    );
    eprintln!(
        "stop: exit 1 after {took:?}; {visible} records committed before the failed epoch ({p0} of partition 0)\n{last}"
    );
}

#[test]
fn a_bad_record_behind_a_backlog_is_dead_lettered_exactly_once() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("bad-dlq-in");
    let output = unique("bad-dlq-out");
    let dlq = format!("{input}.dlq");
    create_topic(b, &input, PARTITIONS as u32);
    create_topic_with(
        b,
        &output,
        PARTITIONS as u32,
        &[&format!("max.message.bytes={SINK_LIMIT}")],
    );
    let poison = fill_input(b, &input);

    let spec = BridgeSpec::new(&input, &output);
    let home = BridgeHome::new(spec);
    let started = Instant::now();
    let mut bridge = home.start_dead_letter();
    let total = end_offsets_total(b, &input);
    bridge.wait_committed(total, Duration::from_secs(90));
    let took = started.elapsed();
    assert_eq!(
        bridge.metric(&format!(
            "eos_bridge_records_dead_lettered_total{{topic=\"{input}\"}}"
        )),
        Some(1.0)
    );
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    let log = bridge.log_text();
    assert!(
        log.contains(&format!("{input}/0@{POISON_OFFSET}")),
        "the log names the dead-lettered record:\n{}",
        tail(&log, 20)
    );

    let source = by_partition(&console_consume(b, &input, true, Duration::from_secs(5)));
    let expected = source_without_poison(&source);
    let sink = by_partition(&console_consume(b, &output, true, Duration::from_secs(5)));
    assert_same_sequences(&expected, &sink);

    let dead = dead_letters(b, &dlq);
    assert_eq!(dead.len(), 1, "exactly one dead letter, read_committed");
    let line = &dead[0];
    for header in [
        format!("eos-bridge.source.topic:{input}"),
        "eos-bridge.source.partition:0".to_string(),
        format!("eos-bridge.source.offset:{POISON_OFFSET}"),
        "eos-bridge.error:".to_string(),
        "eos-bridge.error.time:".to_string(),
    ] {
        assert!(
            line.contains(&header),
            "dead letter lacks {header}: {}",
            &line[..line.len().min(600)]
        );
    }
    assert!(line.ends_with(&poison), "the dead letter keeps the value");
    let records: usize = sink.values().map(Vec::len).sum();
    assert_eq!(records, PER_PARTITION * PARTITIONS as usize);
    eprintln!(
        "dead-letter: {records} records bridged exactly once, 1 dead letter, all committed after {took:?}"
    );
    for line in log.lines().filter(|l| {
        l.contains("dead-letter") || l.contains("batch.size") || l.contains("rebuilding")
    }) {
        eprintln!("{line}");
    }
}

/// The dead-letter topic's records, read_committed, each as the console consumer prints it with
/// its headers.
fn dead_letters(bootstrap: &str, topic: &str) -> Vec<String> {
    let out = kafka_tool(
        "ConsoleConsumer",
        &[
            "--bootstrap-server",
            bootstrap,
            "--topic",
            topic,
            "--from-beginning",
            "--isolation-level",
            "read_committed",
            "--timeout-ms",
            "5000",
            "--property",
            "print.partition=true",
            "--property",
            "print.headers=true",
            "--property",
            "key.separator=|",
        ],
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("Partition:"))
        .map(str::to_string)
        .collect()
}

trait DeadLetterStart {
    fn start_dead_letter(&self) -> Bridge;
}

impl DeadLetterStart for BridgeHome {
    /// The bridge with `on_bad_record = "dead-letter"`, set through the environment so that the
    /// rendered file keeps its one [sink] table.
    fn start_dead_letter(&self) -> Bridge {
        self.start(&[("EOS_BRIDGE__SINK__ON_BAD_RECORD", "dead-letter")])
    }
}

/// At-most-once checkpoints an epoch before writing its records. A send that fails part-way (here
/// a record larger than the producer's message.max.bytes, refused on the spot) must never lead to
/// the records already written being written again: not by a replay in the same process, nor
/// after a restart.
#[test]
fn at_most_once_never_writes_a_record_twice_after_a_send_error() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("amo-bad-in");
    let output = unique("amo-bad-out");
    create_topic(b, &input, 1);
    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", b)
        .create()
        .unwrap();
    let big: String = poison_value()[..20_000].to_string();
    let send = |value: &str| {
        producer
            .send(
                BaseRecord::<(), str>::to(&input)
                    .payload(value)
                    .partition(0),
            )
            .map_err(|(e, _)| e)
            .unwrap();
    };
    for i in 0..20 {
        if i == 12 {
            send(&big);
        } else {
            send(&format!("small-{i}"));
        }
    }
    producer.flush(Duration::from_secs(30)).unwrap();

    let mut spec = BridgeSpec::new(&input, &output);
    spec.delivery = "at-most-once";
    spec.extra = "[sink.kafka]\n\"message.max.bytes\" = \"10000\"\n".to_string();
    let home = BridgeHome::new(spec);
    let mut bridge = home.start(&[]);
    let status = bridge
        .wait_exit(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("the bridge kept going:\n{}", tail(&bridge.log_text(), 30)));
    assert_eq!(status.code(), Some(1), "{}", tail(&bridge.log_text(), 20));
    let log = bridge.log_text();

    // A restart continues after the checkpointed epoch, and bridges what comes next once.
    for i in 20..30 {
        send(&format!("small-{i}"));
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    let mut bridge = home.start(&[]);
    bridge.wait_committed(30, Duration::from_secs(60));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());

    let sink = console_consume(b, &output, true, Duration::from_secs(4));
    let mut seen = std::collections::HashMap::new();
    for r in &sink {
        *seen.entry(r.value.as_str()).or_insert(0) += 1;
    }
    for (v, n) in &seen {
        assert_eq!(*n, 1, "{v} written {n} times");
        assert!(v.starts_with("small-"), "only source records are written");
    }
    for i in 20..30 {
        assert!(
            seen.contains_key(format!("small-{i}").as_str()),
            "small-{i}, after the restart, is bridged"
        );
    }
    // Checked last, so that duplicates are what an older build fails on first.
    assert!(
        log.contains(&format!("{input}/0@12")) && log.contains("lost"),
        "the error names the record and says what at-most-once lost:\n{}",
        tail(&log, 10)
    );
    eprintln!(
        "at-most-once: {} records in the sink, none twice ({} of the 19 small records of the failed epoch)",
        sink.len(),
        (0..12).filter(|i| seen.contains_key(format!("small-{i}").as_str())).count()
            + (13..20).filter(|i| seen.contains_key(format!("small-{i}").as_str())).count()
    );
}
