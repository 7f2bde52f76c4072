//! The other delivery modes, and the ways a bridge must refuse to go on: a record the sink can
//! never take, positions deleted by retention, and configurations that cannot work.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::time::Duration;

use rand::Rng;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};

use common::bridge::*;
use common::scenario::*;
use common::*;

/// Runs a bridge in `delivery` mode with `kills` kill -9s at random instants, then to the end.
/// Returns (source per partition, sink per partition).
fn run_with_kills(
    delivery: &'static str,
    kills: u32,
) -> (BTreeMap<i32, Vec<String>>, BTreeMap<i32, Vec<String>>) {
    let mut s = Scenario::new(delivery, 2).with(|spec| spec.delivery = delivery);
    for round in 0..kills {
        s.run(&[
            Produce(1500, round),
            Start,
            WaitCheckpoint(1),
            Jitter(0, 600),
            Kill9,
        ]);
    }
    s.run(&[Start, Committed, Stop]);
    s.input_and_output_records()
}

fn counts(values: &[String]) -> HashMap<&str, usize> {
    let mut c = HashMap::new();
    for v in values {
        *c.entry(v.as_str()).or_default() += 1;
    }
    c
}

#[test]
fn at_least_once_loses_nothing() {
    let _serial = serial();
    let (source, sink) = run_with_kills("at-least-once", 3);
    for (p, want) in &source {
        let got = counts(sink.get(p).map(Vec::as_slice).unwrap_or_default());
        let missing: Vec<&String> = want
            .iter()
            .filter(|v| !got.contains_key(v.as_str()))
            .collect();
        assert!(
            missing.is_empty(),
            "partition {p}: {} records missing",
            missing.len()
        );
    }
    assert!(!source.is_empty());
}

#[test]
fn at_most_once_duplicates_nothing() {
    let _serial = serial();
    let (source, sink) = run_with_kills("at-most-once", 3);
    for (p, got) in &sink {
        let want = counts(source.get(p).map(Vec::as_slice).unwrap_or_default());
        for (v, n) in counts(got) {
            assert_eq!(n, 1, "partition {p}: {v} written {n} times");
            assert!(
                want.contains_key(v),
                "partition {p}: {v} is not a source record"
            );
        }
    }
    let written: usize = sink.values().map(Vec::len).sum();
    assert!(written > 0, "at-most-once still bridges records");
}

#[test]
fn a_record_the_sink_never_takes_stops_the_bridge_naming_it() {
    let _serial = serial();
    let mut s = Scenario::new("poison", 1);
    create_topic_with(&s.sink, &s.output, 1, &["max.message.bytes=4096"]);
    let (b, input) = (s.source.clone(), s.input.clone());

    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", &b)
        .create()
        .unwrap();
    // Random bytes: the sink producer compresses, and a compressible record would fit.
    let mut rng = rand::rng();
    let big: Vec<u8> = (0..20_000).map(|_| rng.random::<u8>()).collect();
    for i in 0..20 {
        let small = format!("small-{i}");
        let payload: &[u8] = if i == 12 { &big } else { small.as_bytes() };
        producer
            .send(
                BaseRecord::<(), [u8]>::to(&input)
                    .payload(payload)
                    .partition(0),
            )
            .map_err(|(e, _)| e)
            .unwrap();
    }
    producer.flush(Duration::from_secs(30)).unwrap();

    s.start(&[]);
    let status = s.wait_exit(Duration::from_secs(120));
    assert!(!status.success());
    let log = s.log();
    assert!(
        log.contains(&format!("{input}/0@12")),
        "the error names the record's topic, partition and offset:\n{}",
        tail(&log, 20)
    );
    // Nothing of the failed epochs became visible.
    assert!(console_consume(&s.sink, &s.output, true, Duration::from_secs(3)).is_empty());
}

fn delete_records_before(
    bootstrap: &str,
    topic: &str,
    partition: i32,
    offset: i64,
    dir: &std::path::Path,
) {
    let file = dir.join("delete.json");
    std::fs::write(
        &file,
        format!(r#"{{"partitions":[{{"topic":"{topic}","partition":{partition},"offset":{offset}}}],"version":1}}"#),
    )
    .unwrap();
    let out = kafka_tool(
        "DeleteRecordsCommand",
        &[
            "--bootstrap-server",
            bootstrap,
            "--offset-json-file",
            file.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn positions_deleted_by_retention_fail_or_are_counted() {
    let _serial = serial();
    let mut s = Scenario::new("oor", 1);
    s.run(&[
        Produce(1000, 1),
        Start,
        CommittedTo(1000),
        Stop,
        Produce(1000, 2),
    ]);
    delete_records_before(&s.source, &s.input, 0, 1500, s.home.dir.path());

    s.start(&[]);
    let status = s.wait_exit(Duration::from_secs(60));
    assert!(!status.success(), "the bridge refuses to go on");
    let log = s.log();
    assert!(log.contains("on_offset_out_of_range"), "{}", tail(&log, 20));
    assert!(
        log.contains("500 records"),
        "the loss is counted in the message:\n{}",
        tail(&log, 20)
    );

    s.spec().on_offset_out_of_range = "earliest";
    s.run(&[Start, CommittedTo(2000)]);
    let (_, metrics) = s.bridge().get("/metrics").unwrap();
    assert!(
        metrics.contains(&format!(
            "eos_bridge_records_lost_to_retention_total{{partition=\"0\",topic=\"{}\"}} 500",
            s.input
        )),
        "{metrics}"
    );
    s.stop();
    let sink = console_consume(&s.sink, &s.output, true, Duration::from_secs(5));
    assert_eq!(sink.len(), 1500, "1000 before the deletion, 500 after it");
    let distinct: std::collections::HashSet<&String> = sink.iter().map(|r| &r.value).collect();
    assert_eq!(distinct.len(), 1500);
}

fn run_expecting_refusal(toml: &str) -> (i32, String) {
    let dir = temp_state_dir();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, toml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_eos-bridge"))
        .args(["run", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn bad_configurations_are_refused_with_every_error_named() {
    let b = bootstrap();
    let spec = BridgeSpec::new("some-in", "some-out");
    let dir = temp_state_dir();
    let good = spec.toml(dir.path(), free_port());

    let unknown = good.replace("[checkpoint]\n", "[checkpoint]\nintervall = \"1s\"\n");
    let bad_rule = unknown.replace("timeout = \"30s\"", "timeout = \"5s\"");
    let (code, err) = run_expecting_refusal(&bad_rule);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("intervall"), "the unknown key is named: {err}");
    assert!(
        err.contains("transaction.timeout"),
        "the timeout rule is named too: {err}"
    );

    // Above the broker's transaction.max.timeout.ms (15 minutes by default): found at start-up.
    let too_long = good.replace(
        "[transaction]\ntimeout = \"30s\"",
        "[transaction]\ntimeout = \"20m\"",
    );
    assert_ne!(too_long, good);
    let (code, err) = run_expecting_refusal(&too_long);
    assert_eq!(
        code, 2,
        "the broker's limit is a configuration error: {err}"
    );
    assert!(err.contains("transaction.max.timeout.ms"), "{err}");
    let _ = b;
}
