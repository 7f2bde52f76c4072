//! Marker isolation: no other producer's transaction can hide an instance's newest committed
//! marker, a marker partition shared with another bridge is refused, and a neighbour bridge on
//! the same cluster with its default marker topic never disturbs recovery. Judged by Kafka's
//! console consumer with read_committed.

mod common;

use std::time::Duration;

use rand::Rng;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};

use common::bridge::*;
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
    let b = bootstrap();
    let input = unique("mi-in");
    let output = unique("mi-out");
    create_topic(b, &input, 2);
    let mut spec = BridgeSpec::new(&input, &output);
    spec.marker_topic = String::new();
    let marker_topic = format!("__eos_bridge_markers.{}", spec.id);
    let home = BridgeHome::new(spec);

    assert!(verifiable_produce(b, &input, 2000, -1, Some(0))
        .status
        .success());
    let mut bridge = home.start(&[]);
    bridge.wait_committed(2000, Duration::from_secs(60));

    // A foreign transaction opens on the marker partition, then the bridge commits more markers
    // behind it: a read_committed reader stops at the foreign record and cannot see them.
    let foreign = open_foreign_transaction(b, &marker_topic, 0);
    assert!(verifiable_produce(b, &input, 2000, -1, Some(1))
        .status
        .success());
    bridge.wait_committed(4000, Duration::from_secs(60));

    // Crash with the state directory lost: only the marker says what was committed.
    bridge.kill9();
    std::fs::remove_dir_all(home.state_dir()).unwrap();
    let mut bridge = home.start(&[]);
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
    assert!(verifiable_produce(b, &input, 1000, -1, Some(2))
        .status
        .success());
    bridge.wait_committed(5000, Duration::from_secs(90));
    let waited = bridge
        .metric("eos_bridge_marker_wait_seconds_total")
        .unwrap();
    assert!(waited > 0.0, "the wait is counted: {waited}");
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());

    let n = assert_exactly_once(b, &input, b, &output);
    assert_eq!(n, 5000);
    eprintln!("marker wait: {waited:.2}s, 5000 records exactly once");
}

#[test]
fn a_marker_topic_shared_with_another_bridge_is_refused_at_start() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("ms-in");
    create_topic(b, &input, 1);
    assert!(verifiable_produce(b, &input, 100, -1, Some(0))
        .status
        .success());
    let shared = unique("shared-markers");

    let mut first = BridgeSpec::new(&input, &unique("ms-out-a"));
    first.marker_topic = shared.clone();
    let first_id = first.id.clone();
    let home_a = BridgeHome::new(first);
    let mut a = home_a.start(&[]);
    a.wait_committed(100, Duration::from_secs(60));
    assert!(a.stop_gracefully(Duration::from_secs(30)).success());

    let mut second = BridgeSpec::new(&input, &unique("ms-out-b"));
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
    let b = bootstrap();
    let (input, output) = (unique("nb-in"), unique("nb-out"));
    let (n_input, n_output) = (unique("nb-neighbour-in"), unique("nb-neighbour-out"));
    create_topic(b, &input, 2);
    create_topic(b, &n_input, 2);

    // Both on their default marker topics, as most deployments run.
    let mut ours = BridgeSpec::new(&input, &output);
    ours.marker_topic = String::new();
    let mut theirs = BridgeSpec::new(&n_input, &n_output);
    theirs.marker_topic = String::new();
    let home = BridgeHome::new(ours);
    let n_home = BridgeHome::new(theirs);

    let records = 8000u64;
    let mut producer = background_producer(b, &input, records, 1000, 1);
    let mut n_producer = background_producer(b, &n_input, 4000, 500, 2);
    let mut neighbour = n_home.start(&[]);
    let mut bridge = home.start(&[]);
    bridge.wait_checkpoint(1, Duration::from_secs(60));
    neighbour.wait_checkpoint(1, Duration::from_secs(60));

    let mut rng = rand::rng();
    for _ in 0..4 {
        // The neighbour freezes mid-epoch with its transaction open, as a throttled or
        // descheduled process does, while our bridge dies and loses its state.
        unsafe { libc::kill(neighbour.pid(), libc::SIGSTOP) };
        std::thread::sleep(Duration::from_millis(rng.random_range(300..1500)));
        bridge.kill9();
        std::fs::remove_dir_all(home.state_dir()).ok();
        bridge = home.start(&[]);
        bridge.wait_checkpoint(1, Duration::from_secs(60));
        unsafe { libc::kill(neighbour.pid(), libc::SIGCONT) };
        std::thread::sleep(Duration::from_millis(rng.random_range(200..1000)));
    }
    assert!(producer.wait().unwrap().success());
    assert!(n_producer.wait().unwrap().success());
    let total = end_offsets_total(b, &input);
    assert_eq!(total as u64, records);
    bridge.wait_committed(total, Duration::from_secs(120));
    let n_total = end_offsets_total(b, &n_input);
    neighbour.wait_committed(n_total, Duration::from_secs(120));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    assert!(neighbour.stop_gracefully(Duration::from_secs(30)).success());

    assert_eq!(assert_exactly_once(b, &input, b, &output) as u64, records);
    assert_eq!(
        assert_exactly_once(b, &n_input, b, &n_output) as i64,
        n_total
    );
}
