//! Marker isolation: no other producer's transaction can hide an instance's newest committed
//! marker, a marker partition shared with another bridge is refused, and a neighbour bridge on
//! the same cluster with its default marker topic never disturbs recovery. Judged by Kafka's
//! console consumer with read_committed.

mod common;

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};

use common::bridge::*;
use common::scenario::*;
use common::*;

/// A transactional producer of someone else that writes one record to `topic`/`partition` and
/// leaves its transaction open: what a neighbour paused between its marker and its commit does.
fn open_foreign_transaction(
    bootstrap: &str,
    topic: &str,
    partition: i32,
) -> ThreadedProducer<DefaultProducerContext> {
    let p: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("transactional.id", unique("neighbour"))
        .set("transaction.timeout.ms", "120000")
        .create()
        .expect("a transactional producer");
    p.init_transactions(Duration::from_secs(30)).unwrap();
    p.begin_transaction().unwrap();
    p.send(
        BaseRecord::<str, str>::to(topic)
            .partition(partition)
            .key("neighbour/0")
            .payload("{}"),
    )
    .map_err(|(e, _)| e)
    .unwrap();
    p.flush(Duration::from_secs(30)).unwrap();
    p
}

#[test]
fn an_open_foreign_transaction_on_the_marker_partition_is_waited_out() {
    let _serial = serial();
    let mut s = Scenario::new("mi", 2).with(|spec| spec.marker_topic = String::new());
    let marker_topic = format!("__eos_bridge_markers.{}", s.home.spec.id);
    s.run(&[Produce(2000, 0), Start, CommittedTo(2000)]);

    // A foreign transaction opens on the marker partition, then the bridge commits more markers
    // behind it: a read_committed reader stops at the foreign record and cannot see them.
    let foreign = open_foreign_transaction(&s.sink, &marker_topic, 0);
    s.run(&[Produce(2000, 1), CommittedTo(4000)]);

    // Crash with the state directory lost: only the marker says what was committed.
    s.run(&[Kill9, WipeState, Start]);
    let bridge = s.bridge();
    let waiting = wait_until(Duration::from_secs(60), || {
        bridge
            .status()
            .is_some_and(|s| s["recovery_wait"].as_str().is_some())
    });
    assert!(
        waiting,
        "recovery should wait for the foreign transaction:\n{}",
        tail(&bridge.log_text(), 30)
    );
    let status = bridge.status().unwrap();
    assert_eq!(status["state"], "recovering", "{status}");
    assert!(
        bridge
            .log_text()
            .contains("holds back the marker partition"),
        "{}",
        tail(&bridge.log_text(), 30)
    );

    foreign.abort_transaction(Duration::from_secs(30)).unwrap();
    s.produce(1000, 2);
    let bridge = s.bridge();
    bridge.wait_committed(5000, Duration::from_secs(90));
    let waited = bridge
        .metric("eos_bridge_marker_wait_seconds_total")
        .unwrap();
    assert!(waited > 0.0, "the wait is counted: {waited}");
    s.stop();
    assert_eq!(s.judge(), 5000);
    eprintln!("marker wait: {waited:.2}s, 5000 records exactly once");
}

#[test]
fn a_marker_topic_shared_with_another_bridge_is_refused_at_start() {
    let _serial = serial();
    let shared = unique("shared-markers");
    let mut first = Scenario::new("ms", 1).with(|spec| spec.marker_topic = shared.clone());
    let first_id = first.home.spec.id.clone();
    first.run(&[Produce(100, 0), Start, CommittedTo(100), Stop]);

    let mut second = BridgeSpec::new(&first.input, &unique("ms-out-b"));
    second.marker_topic = shared.clone();
    let home_b = BridgeHome::new(second);
    let mut bridge = home_b.start(&[]);
    let status = bridge
        .wait_exit(Duration::from_secs(90))
        .expect("a bridge on a shared marker partition stops");
    let log = bridge.log_text();
    assert_eq!(status.code(), Some(1), "{}", tail(&log, 20));
    assert!(
        log.contains(&format!("'{first_id}/0'")) && log.contains("sink.marker_topic unset"),
        "the message names the other bridge's key and the fix:\n{}",
        tail(&log, 20)
    );
}

#[test]
fn a_paused_neighbour_bridge_never_disturbs_recovery_after_state_loss() {
    let _serial = serial();
    // Both on their default marker topics, as most deployments run.
    let mut ours = Scenario::new("nb", 2).with(|spec| spec.marker_topic = String::new());
    let mut theirs =
        Scenario::new("nb-neighbour", 2).with(|spec| spec.marker_topic = String::new());

    let records = 8000u64;
    let mut producer = ours.produce_in_background(records, 1000, 1);
    let mut n_producer = theirs.produce_in_background(4000, 500, 2);
    theirs.start(&[]);
    ours.run(&[Start, WaitCheckpoint(1)]);
    theirs.run(&[WaitCheckpoint(1)]);

    for _ in 0..4 {
        // The neighbour freezes mid-epoch with its transaction open, as a throttled or
        // descheduled process does, while our bridge dies and loses its state.
        theirs.run(&[Pause]);
        ours.run(&[
            Jitter(300, 1500),
            Kill9,
            WipeState,
            Start,
            WaitCheckpoint(1),
        ]);
        theirs.run(&[Resume, Jitter(200, 1000)]);
    }
    assert!(producer.wait().unwrap().success());
    assert!(n_producer.wait().unwrap().success());
    assert_eq!(ours.input_total() as u64, records);
    ours.run(&[CommittedWithin(120)]);
    theirs.run(&[CommittedWithin(120)]);
    ours.stop();
    theirs.stop();

    assert_eq!(ours.judge() as u64, records);
    theirs.judge();
}
