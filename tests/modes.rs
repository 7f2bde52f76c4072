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
use common::*;

/// Runs a bridge in `delivery` mode with `kills` kill -9s at random instants, then to the end.
/// Returns (source per partition, sink per partition).
fn run_with_kills(
    delivery: &'static str,
    kills: u32,
) -> (BTreeMap<i32, Vec<String>>, BTreeMap<i32, Vec<String>>) {
    let b = bootstrap();
    let input = unique(&format!("{delivery}-in"));
    let output = unique(&format!("{delivery}-out"));
    create_topic(b, &input, 2);
    let mut spec = BridgeSpec::new(&input, &output);
    spec.delivery = delivery;
    let home = BridgeHome::new(spec);
    let mut rng = rand::rng();
    for round in 0..kills {
        assert!(verifiable_produce(b, &input, 1500, -1, Some(round))
            .status
            .success());
        let mut bridge = home.start(&[]);
        bridge.wait_checkpoint(1, Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(rng.random_range(0..600)));
        bridge.kill9();
    }
    let total = end_offsets_total(b, &input);
    let mut bridge = home.start(&[]);
    bridge.wait_committed(total, Duration::from_secs(60));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    let source = by_partition(&console_consume(b, &input, true, Duration::from_secs(5)));
    let sink = by_partition(&console_consume(b, &output, true, Duration::from_secs(5)));
    (source, sink)
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
    let b = bootstrap();
    let input = unique("poison-in");
    let output = unique("poison-out");
    create_topic(b, &input, 1);
    let out = kafka_tool(
        "TopicCommand",
        &[
            "--bootstrap-server",
            b,
            "--create",
            "--topic",
            &output,
            "--partitions",
            "1",
            "--config",
            "max.message.bytes=4096",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", b)
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

    let home = BridgeHome::new(BridgeSpec::new(&input, &output));
    let mut bridge = home.start(&[]);
    let status = bridge
        .wait_exit(Duration::from_secs(120))
        .unwrap_or_else(|| panic!("the bridge kept looping:\n{}", tail(&bridge.log_text(), 30)));
    assert!(!status.success());
    let log = bridge.log_text();
    assert!(
        log.contains(&format!("{input}/0@12")),
        "the error names the record's topic, partition and offset:\n{}",
        tail(&log, 20)
    );
    // Nothing of the failed epochs became visible.
    assert!(console_consume(b, &output, true, Duration::from_secs(3)).is_empty());
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
    let b = bootstrap();
    let input = unique("oor-in");
    let output = unique("oor-out");
    create_topic(b, &input, 1);
    let mut home = BridgeHome::new(BridgeSpec::new(&input, &output));
    assert!(verifiable_produce(b, &input, 1000, -1, Some(1))
        .status
        .success());
    let mut bridge = home.start(&[]);
    bridge.wait_committed(1000, Duration::from_secs(60));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());

    assert!(verifiable_produce(b, &input, 1000, -1, Some(2))
        .status
        .success());
    delete_records_before(b, &input, 0, 1500, home.dir.path());

    let mut bridge = home.start(&[]);
    let status = bridge
        .wait_exit(Duration::from_secs(60))
        .expect("the bridge refuses to go on");
    assert!(!status.success());
    let log = bridge.log_text();
    assert!(log.contains("on_offset_out_of_range"), "{}", tail(&log, 20));
    assert!(
        log.contains("500 records"),
        "the loss is counted in the message:\n{}",
        tail(&log, 20)
    );

    home.spec.on_offset_out_of_range = "earliest";
    let mut bridge = home.start(&[]);
    bridge.wait_committed(2000, Duration::from_secs(60));
    let (_, metrics) = bridge.get("/metrics").unwrap();
    assert!(
        metrics.contains(&format!(
            "eos_bridge_records_lost_to_retention_total{{partition=\"0\",topic=\"{input}\"}} 500"
        )),
        "{metrics}"
    );
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    let sink = console_consume(b, &output, true, Duration::from_secs(5));
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
