//! Cluster and topic identity on a real broker: the ids the bridge reads are the ones Kafka's own
//! tools print, a source topic deleted and created again under the same name is caught (stop by
//! default, bridged again exactly once under `restart`), and so is a source cluster rebuilt
//! behind the same address. Judged by Kafka's console consumer with read_committed.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::bridge::*;
use common::*;

/// The topic id Kafka's TopicCommand prints for `topic`.
fn kafka_topic_id(bootstrap: &str, topic: &str) -> Option<String> {
    let out = kafka_tool(
        "TopicCommand",
        &[
            "--bootstrap-server",
            bootstrap,
            "--describe",
            "--topic",
            topic,
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.split_whitespace()
        .skip_while(|w| *w != "TopicId:")
        .nth(1)
        .map(str::to_string)
}

/// The cluster id Kafka's ClusterTool prints.
fn kafka_cluster_id(bootstrap: &str) -> String {
    let out = kafka_tool(
        "ClusterTool",
        &["cluster-id", "--bootstrap-server", bootstrap],
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .find_map(|l| l.strip_prefix("Cluster ID:"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| panic!("ClusterTool printed no cluster id: {text}"))
}

#[test]
fn the_ids_read_are_the_ones_kafka_prints() {
    let b = bootstrap();
    let a = unique("ids-a");
    let c = unique("ids-c");
    create_topic(b, &a, 1);
    create_topic(b, &c, 2);
    let missing = unique("ids-missing");
    let admin = eos_bridge::admin::Admin::new(b, &[]).unwrap();

    let ids = admin
        .ids(&[a.clone(), c.clone(), missing.clone(), a.clone()])
        .unwrap();
    assert_eq!(
        ids.cluster_id.as_deref(),
        Some(kafka_cluster_id(b).as_str())
    );
    let want: BTreeMap<String, String> = [&a, &c]
        .iter()
        .map(|t| {
            let id = kafka_topic_id(b, t).expect("TopicCommand prints a topic id");
            (t.to_string(), id)
        })
        .collect();
    assert_eq!(ids.topic_ids, want, "a missing topic is left out");

    // The per-checkpoint check costs one such request per cluster: keep it cheap.
    let started = Instant::now();
    let rounds = 20;
    for _ in 0..rounds {
        assert_eq!(admin.ids(&[a.clone(), c.clone()]).unwrap().topic_ids, want);
    }
    let each = started.elapsed() / rounds;
    eprintln!("cluster and topic ids: {each:?} per request");
    assert!(each < Duration::from_millis(200), "{each:?} per request");
}

fn produce_ok(bootstrap: &str, topic: &str, count: u64, prefix: u32) {
    let out = verifiable_produce(bootstrap, topic, count, -1, Some(prefix));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn delete_topic(bootstrap: &str, topic: &str) {
    let out = kafka_tool(
        "TopicCommand",
        &[
            "--bootstrap-server",
            bootstrap,
            "--delete",
            "--topic",
            topic,
        ],
    );
    assert!(
        out.status.success(),
        "deleting {topic}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Creates `topic` again once its deletion has completed (Kafka deletes asynchronously).
fn create_again(bootstrap: &str, topic: &str, partitions: u32) {
    let created = wait_until(Duration::from_secs(45), || {
        try_create_topic(bootstrap, topic, partitions, &[])
            .status
            .success()
    });
    assert!(created, "{topic} could not be created again");
}

/// Per partition, the values of `first` followed by those of `then`.
fn concat(
    first: &BTreeMap<i32, Vec<String>>,
    then: &BTreeMap<i32, Vec<String>>,
) -> BTreeMap<i32, Vec<String>> {
    let mut all = first.clone();
    for (p, values) in then {
        all.entry(*p).or_default().extend(values.iter().cloned());
    }
    all
}

fn read(bootstrap: &str, topic: &str) -> BTreeMap<i32, Vec<String>> {
    by_partition(&console_consume(
        bootstrap,
        topic,
        true,
        Duration::from_secs(4),
    ))
}

/// Waits for a bridge that must stop on its own, and returns its log; panics if it keeps running
/// or exits otherwise than with 1.
fn expect_exit_1(bridge: &mut Bridge) -> String {
    let status = bridge.wait_exit(Duration::from_secs(60));
    let log = bridge.log_text();
    let status = status.unwrap_or_else(|| panic!("the bridge kept running:\n{}", tail(&log, 30)));
    assert_eq!(status.code(), Some(1), "{status}:\n{}", tail(&log, 30));
    eprintln!("the bridge stopped with: {}", tail(&log, 1));
    log
}

#[test]
fn a_recreated_source_topic_stops_the_bridge_or_is_bridged_again_under_restart() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("recreated-in");
    let output = unique("recreated-out");
    create_topic(b, &input, 4);
    produce_ok(b, &input, 10_000, 1);
    let old_records = read(b, &input);
    let home = BridgeHome::new(BridgeSpec::new(&input, &output));
    let mut bridge = home.start(&[]);
    bridge.wait_committed(10_000, Duration::from_secs(60));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());

    let old_id = kafka_topic_id(b, &input).expect("topic id");
    delete_topic(b, &input);
    create_again(b, &input, 4);
    produce_ok(b, &input, 8_000, 2);
    let new_id = kafka_topic_id(b, &input).expect("topic id");
    assert_ne!(old_id, new_id, "a topic created again has a new id");

    // Default policy: stop, naming the topic and both ids; nothing of the new topic is bridged.
    let mut bridge = home.start(&[]);
    let log = expect_exit_1(&mut bridge);
    for needle in [
        format!("source topic \"{input}\""),
        old_id.clone(),
        new_id.clone(),
        "on_identity_change".to_string(),
    ] {
        assert!(
            log.contains(&needle),
            "{needle:?} missing:\n{}",
            tail(&log, 20)
        );
    }
    assert_same_sequences(&old_records, &read(b, &output));

    // restart: the 8,000 new records are bridged once each, after the 10,000 old ones.
    let new_records = read(b, &input);
    assert_eq!(new_records.values().map(Vec::len).sum::<usize>(), 8_000);
    let mut bridge = home.start(&[("EOS_BRIDGE__BRIDGE__ON_IDENTITY_CHANGE", "restart")]);
    bridge.wait_committed(8_000, Duration::from_secs(60));
    assert_eq!(
        bridge.metric("eos_bridge_identity_changes_total{kind=\"source_topic\"}"),
        Some(1.0)
    );
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    let log = bridge.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains(&new_id) && l.contains("restart")),
        "no error line names the change:\n{}",
        tail(&log, 20)
    );
    assert_same_sequences(&concat(&old_records, &new_records), &read(b, &output));
}

#[test]
fn a_rebuilt_source_cluster_stops_the_bridge() {
    let _serial = serial();
    let source = Broker::start_private("rebuilt");
    let sink = bootstrap();
    let input = unique("rebuilt-in");
    let output = unique("rebuilt-out");
    create_topic(&source.bootstrap, &input, 2);
    produce_ok(&source.bootstrap, &input, 3_000, 1);
    let old_records = read(&source.bootstrap, &input);
    let mut spec = BridgeSpec::new(&input, &output);
    spec.source_bootstrap = source.bootstrap.clone();
    let home = BridgeHome::new(spec);
    let mut bridge = home.start(&[]);
    bridge.wait_committed(3_000, Duration::from_secs(60));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());

    let old_cluster = kafka_cluster_id(&source.bootstrap);
    source.rebuild();
    let new_cluster = kafka_cluster_id(&source.bootstrap);
    assert_ne!(old_cluster, new_cluster);
    create_topic(&source.bootstrap, &input, 2);
    produce_ok(&source.bootstrap, &input, 2_000, 2);

    let mut bridge = home.start(&[]);
    let log = expect_exit_1(&mut bridge);
    let needle = format!("source cluster id changed from \"{old_cluster}\" to \"{new_cluster}\"");
    assert!(
        log.contains(&needle),
        "{needle:?} missing:\n{}",
        tail(&log, 20)
    );
    assert_same_sequences(&old_records, &read(sink, &output));
    source.stop();
}

#[test]
fn a_topic_recreated_while_running_is_bridged_again_under_restart() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("live-in");
    let output = unique("live-out");
    create_topic(b, &input, 2);
    produce_ok(b, &input, 3_000, 1);
    let old_records = read(b, &input);
    let home = BridgeHome::new(BridgeSpec::new(&input, &output));
    // A pattern, so that the moment the topic does not exist is no error of its own.
    let mut bridge = home.start(&[
        ("EOS_BRIDGE__SOURCE__TOPICS", ""),
        ("EOS_BRIDGE__SOURCE__TOPIC_PATTERN", input.as_str()),
        ("EOS_BRIDGE__BRIDGE__ON_IDENTITY_CHANGE", "restart"),
    ]);
    bridge.wait_committed(3_000, Duration::from_secs(60));

    delete_topic(b, &input);
    create_again(b, &input, 2);
    // More records than before: the old positions fall inside the new topic's offsets, where
    // librdkafka would go on reading.
    produce_ok(b, &input, 4_000, 2);
    let new_records = read(b, &input);
    bridge.wait_committed(4_000, Duration::from_secs(60));
    assert_eq!(
        bridge.metric("eos_bridge_identity_changes_total{kind=\"source_topic\"}"),
        Some(1.0)
    );
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    let log = bridge.log_text();
    let changed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains("has a new topic id"))
        .collect();
    assert_eq!(
        changed.len(),
        1,
        "one error line per change:\n{}",
        tail(&log, 30)
    );
    eprintln!("{}", changed[0]);
    assert_same_sequences(&concat(&old_records, &new_records), &read(b, &output));
}

#[test]
fn a_rebuilt_sink_cluster_stops_the_bridge() {
    let _serial = serial();
    let source = bootstrap();
    let sink = Broker::start_private("rebuilt-sink");
    let input = unique("sinkgone-in");
    let output = unique("sinkgone-out");
    create_topic(source, &input, 2);
    produce_ok(source, &input, 2_000, 1);
    let mut spec = BridgeSpec::new(&input, &output);
    spec.sink_bootstrap = sink.bootstrap.clone();
    let home = BridgeHome::new(spec);
    let mut bridge = home.start(&[]);
    bridge.wait_committed(2_000, Duration::from_secs(60));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());

    // The output and the commit markers go with the old cluster; the state directory remains.
    let old_cluster = kafka_cluster_id(&sink.bootstrap);
    sink.rebuild();
    let new_cluster = kafka_cluster_id(&sink.bootstrap);
    assert_ne!(old_cluster, new_cluster);

    let mut bridge = home.start(&[]);
    let log = expect_exit_1(&mut bridge);
    let needle = format!("sink cluster id changed from \"{old_cluster}\" to \"{new_cluster}\"");
    assert!(
        log.contains(&needle),
        "{needle:?} missing:\n{}",
        tail(&log, 20)
    );
    // Not even an aborted transaction's records: the new cluster's output topic is untouched.
    assert_eq!(end_offsets_total(&sink.bootstrap, &output), 0);
    sink.stop();
}
