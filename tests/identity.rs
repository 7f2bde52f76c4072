//! Cluster and topic identity on a real broker: the ids the bridge reads are the ones Kafka's own
//! tools print, a source topic deleted and created again under the same name is caught (stop by
//! default, bridged again exactly once under `restart`), and so is a source cluster rebuilt
//! behind the same address. Judged by Kafka's console consumer with read_committed.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::bridge::*;
use common::scenario::*;
use common::*;

/// The topic id Kafka's TopicCommand prints for `topic`.
fn kafka_topic_id(bootstrap: &str, topic: &str) -> Option<String> {
    let text = describe_topic(bootstrap, topic);
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

/// Deletes the input topic and creates it again, empty, under the same name.
fn recreate_input(s: &Scenario, partitions: u32) {
    delete_topic(&s.source, &s.input);
    create_again(&s.source, &s.input, partitions);
}

/// Checks that the bridge counted one change of a source topic's id, stops it, returns its log.
fn stop_after_one_topic_change(s: &mut Scenario) -> String {
    assert_eq!(
        s.bridge()
            .metric("eos_bridge_identity_changes_total{kind=\"source_topic\"}"),
        Some(1.0)
    );
    s.stop();
    s.log()
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
    let mut s = Scenario::new("recreated", 4);
    let (b, input) = (bootstrap(), s.input.clone());
    s.produce(10_000, 1);
    let old_records = s.input_records();
    s.run(&[Start, CommittedTo(10_000), Stop]);

    let old_id = kafka_topic_id(b, &input).expect("topic id");
    recreate_input(&s, 4);
    s.produce(8_000, 2);
    let new_id = kafka_topic_id(b, &input).expect("topic id");
    assert_ne!(old_id, new_id, "a topic created again has a new id");

    // Default policy: stop, naming the topic and both ids; nothing of the new topic is bridged.
    let log = expect_exit_1(s.start(&[]));
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
    s.assert_output(&old_records);

    // restart: the 8,000 new records are bridged once each, after the 10,000 old ones.
    let new_records = s.input_records();
    assert_eq!(new_records.values().map(Vec::len).sum::<usize>(), 8_000);
    s.run(&[
        StartWith(&[("EOS_BRIDGE__BRIDGE__ON_IDENTITY_CHANGE", "restart")]),
        CommittedTo(8_000),
    ]);
    let log = stop_after_one_topic_change(&mut s);
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains(&new_id) && l.contains("restart")),
        "no error line names the change:\n{}",
        tail(&log, 20)
    );
    s.assert_output(&concat(&old_records, &new_records));
}

#[test]
fn a_rebuilt_source_cluster_stops_the_bridge() {
    let _serial = serial();
    let source = Broker::start_private("rebuilt");
    let sink = bootstrap();
    let mut s = Scenario::between(&source.bootstrap, sink, "rebuilt", 2);
    s.produce(3_000, 1);
    let old_records = s.input_records();
    s.run(&[Start, CommittedTo(3_000), Stop]);

    let old_cluster = kafka_cluster_id(&source.bootstrap);
    source.rebuild();
    let new_cluster = kafka_cluster_id(&source.bootstrap);
    assert_ne!(old_cluster, new_cluster);
    create_topic(&source.bootstrap, &s.input, 2);
    s.produce(2_000, 2);

    let log = expect_exit_1(s.start(&[]));
    let needle = format!("source cluster id changed from \"{old_cluster}\" to \"{new_cluster}\"");
    assert!(
        log.contains(&needle),
        "{needle:?} missing:\n{}",
        tail(&log, 20)
    );
    s.assert_output(&old_records);
    source.stop();
}

#[test]
fn a_topic_recreated_while_running_is_bridged_again_under_restart() {
    let _serial = serial();
    let mut s = Scenario::new("live", 2);
    let input = s.input.clone();
    s.produce(3_000, 1);
    let old_records = s.input_records();
    // A pattern, so that the moment the topic does not exist is no error of its own.
    s.run(&[
        StartWith(&[
            ("EOS_BRIDGE__SOURCE__TOPICS", ""),
            ("EOS_BRIDGE__SOURCE__TOPIC_PATTERN", input.as_str()),
            ("EOS_BRIDGE__BRIDGE__ON_IDENTITY_CHANGE", "restart"),
        ]),
        CommittedTo(3_000),
    ]);

    recreate_input(&s, 2);
    // More records than before: the old positions fall inside the new topic's offsets, where
    // librdkafka would go on reading.
    s.produce(4_000, 2);
    let new_records = s.input_records();
    s.run(&[CommittedTo(4_000)]);
    let log = stop_after_one_topic_change(&mut s);
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
    s.assert_output(&concat(&old_records, &new_records));
}

#[test]
fn a_rebuilt_sink_cluster_stops_the_bridge() {
    let _serial = serial();
    let sink = Broker::start_private("rebuilt-sink");
    let mut s = Scenario::between(bootstrap(), &sink.bootstrap, "sinkgone", 2);
    s.run(&[Produce(2_000, 1), Start, CommittedTo(2_000), Stop]);

    // The output and the commit markers go with the old cluster; the state directory remains.
    let old_cluster = kafka_cluster_id(&sink.bootstrap);
    sink.rebuild();
    let new_cluster = kafka_cluster_id(&sink.bootstrap);
    assert_ne!(old_cluster, new_cluster);

    let log = expect_exit_1(s.start(&[]));
    let needle = format!("sink cluster id changed from \"{old_cluster}\" to \"{new_cluster}\"");
    assert!(
        log.contains(&needle),
        "{needle:?} missing:\n{}",
        tail(&log, 20)
    );
    // Not even an aborted transaction's records: the new cluster's output topic is untouched.
    assert_eq!(end_offsets_total(&sink.bootstrap, &s.output), 0);
    sink.stop();
}
