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
use common::scenario::*;
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
        p0.get(POISON_OFFSET).map(String::len) == Some(POISON_BYTES),
        "the poison record is at offset {POISON_OFFSET} of partition 0: {}",
        input_read_back(p0)
    );
    p0.remove(POISON_OFFSET);
    expected
}

/// What the console consumer read of partition 0, for a failed check of the input itself (seen
/// once in CI, under load, not understood): where the poison is, and the first record out of the
/// writer's sequence, which tells a gap or a record read twice from a poison that was not read.
fn input_read_back(p0: &[String]) -> String {
    let poisons: Vec<usize> = (0..p0.len())
        .filter(|&i| p0[i].len() == POISON_BYTES)
        .collect();
    let seq = |i: usize| if i < POISON_OFFSET { i } else { i - 1 };
    let out_of_sequence = (0..p0.len())
        .find(|&i| i != POISON_OFFSET && !p0[i].starts_with(&format!("p0-{:07}-", seq(i))));
    let around = |i: usize| {
        (i.saturating_sub(2)..(i + 3).min(p0.len()))
            .map(|j| format!("{j}: {}", p0[j].chars().take(12).collect::<String>()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "{} records read, the poison (by its size) at {poisons:?}, first out of sequence {:?} [{}]",
        p0.len(),
        out_of_sequence,
        out_of_sequence.map(around).unwrap_or_default()
    )
}

/// A scenario whose sink topic takes no record above SINK_LIMIT, with the input written.
fn behind_a_backlog(name: &str) -> (Scenario, String) {
    let s = Scenario::new(name, PARTITIONS as u32);
    let limit = format!("max.message.bytes={SINK_LIMIT}");
    create_topic_with(&s.sink, &s.output, PARTITIONS as u32, &[&limit]);
    let poison = fill_input(&s.source, &s.input);
    (s, poison)
}

#[test]
fn a_bad_record_behind_a_backlog_stops_the_bridge_naming_it() {
    let _serial = serial();
    let (mut s, _) = behind_a_backlog("bad-stop");
    let started = Instant::now();
    s.start(&[]);
    let status = s.wait_exit(Duration::from_secs(90));
    let took = started.elapsed();
    let log = s.log();
    assert_eq!(status.code(), Some(1), "{}", tail(&log, 20));
    let named = format!("{}/0@{POISON_OFFSET}", s.input);
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
    let state = transaction_state(&s.sink, &s.transactional_id());
    assert!(
        matches!(state.as_deref(), Some("CompleteAbort" | "Empty")),
        "the open transaction is aborted before the bridge exits, found {state:?}"
    );

    let (source, sink) = s.input_and_output_records();
    let expected = source_without_poison(&source);
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
    let (mut s, poison) = behind_a_backlog("bad-dlq");
    let input = s.input.clone();
    let dlq = format!("{input}.dlq");
    let started = Instant::now();
    s.run(&[StartWith(&DEAD_LETTER), CommittedWithin(90)]);
    let took = started.elapsed();
    assert_eq!(
        s.bridge().metric(&format!(
            "eos_bridge_records_dead_lettered_total{{topic=\"{input}\"}}"
        )),
        Some(1.0)
    );
    s.stop();
    let log = s.log();
    assert!(
        log.contains(&format!("{input}/0@{POISON_OFFSET}")),
        "the log names the dead-lettered record:\n{}",
        tail(&log, 20)
    );

    let (source, sink) = s.input_and_output_records();
    let expected = source_without_poison(&source);
    assert_same_sequences(&expected, &sink);

    let dead = dead_letters(&s.sink, &dlq);
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
    let properties = [
        "print.partition=true",
        "print.headers=true",
        "key.separator=|",
    ];
    console_lines(bootstrap, topic, Duration::from_secs(5), &properties)
}

/// `on_bad_record = "dead-letter"`, set through the environment so that the rendered file keeps
/// its one [sink] table.
const DEAD_LETTER: [(&str, &str); 1] = [("EOS_BRIDGE__SINK__ON_BAD_RECORD", "dead-letter")];

/// At-most-once checkpoints an epoch before writing its records. A send that fails part-way (here
/// a record larger than the producer's message.max.bytes, refused on the spot) must never lead to
/// the records already written being written again: not by a replay in the same process, nor
/// after a restart.
#[test]
fn at_most_once_never_writes_a_record_twice_after_a_send_error() {
    let _serial = serial();
    let mut s = Scenario::new("amo-bad", 1).with(|spec| {
        spec.delivery = "at-most-once";
        spec.extra = "[sink.kafka]\n\"message.max.bytes\" = \"10000\"\n".to_string();
    });
    let input = s.input.clone();
    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", &s.source)
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

    s.start(&[]);
    let status = s.wait_exit(Duration::from_secs(60));
    let log = s.log();
    assert_eq!(status.code(), Some(1), "{}", tail(&log, 20));

    // A restart continues after the checkpointed epoch, and bridges what comes next once.
    for i in 20..30 {
        send(&format!("small-{i}"));
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    s.run(&[Start, CommittedTo(30), Stop]);

    let sink = console_consume(&s.sink, &s.output, true, Duration::from_secs(4));
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
