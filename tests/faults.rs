//! Faults around the bridge: downtime longer than the transaction timeout, a zombie with the same
//! transactional id, the broker killed and restarted, a corrupt or deleted state directory, and a
//! bridge between two clusters. Each judged by Kafka's console consumer with read_committed.

mod common;

use std::time::{Duration, Instant};

use common::bridge::*;
use common::*;

#[cfg(feature = "failpoints")]
#[test]
fn downtime_longer_than_the_transaction_timeout() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("down-in");
    let output = unique("down-out");
    create_topic(b, &input, 2);
    let mut spec = BridgeSpec::new(&input, &output);
    spec.interval = "300ms";
    spec.checkpoint_timeout = "2s";
    spec.transaction_timeout = "4s";
    let txn_id = format!("eos-bridge-{}-0", spec.id);
    let home = BridgeHome::new(spec);
    assert!(verifiable_produce(b, &input, 1500, -1, Some(1))
        .status
        .success());

    // Die with the transaction open and its records flushed: the worst moment to vanish.
    let mut bridge = home.start(&[("EOS_BRIDGE_FAILPOINT", "after-flush")]);
    bridge
        .wait_exit(Duration::from_secs(60))
        .expect("failpoint reached");
    let died = Instant::now();

    // Stay down until the coordinator has timed the transaction out and aborted it.
    let aborted = wait_until(Duration::from_secs(60), || {
        transaction_state(b, &txn_id).as_deref() == Some("CompleteAbort")
    });
    assert!(
        aborted,
        "the coordinator should abort the abandoned transaction"
    );
    assert!(
        died.elapsed() >= Duration::from_secs(4),
        "down for longer than transaction.timeout"
    );
    assert!(verifiable_produce(b, &input, 500, -1, Some(2))
        .status
        .success());

    let total = end_offsets_total(b, &input);
    let mut bridge = home.start(&[]);
    bridge.wait_committed(total, Duration::from_secs(60));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    assert_eq!(assert_exactly_once(b, &input, b, &output) as i64, total);
}

#[test]
fn a_zombie_with_the_same_transactional_id_is_fenced() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("zombie-in");
    let output = unique("zombie-out");
    create_topic(b, &input, 3);
    let spec = BridgeSpec::new(&input, &output);
    let first = BridgeHome::new(spec.clone());
    let second = BridgeHome::new(spec);
    let mut producer = background_producer(b, &input, 12_000, 2_000, 1);

    let mut a = first.start(&[]);
    a.wait_checkpoint(3, Duration::from_secs(60));
    let mut z = second.start(&[]);
    // One of the two must stop with the fencing message; the survivor finishes the work.
    let mut fenced = None;
    let decided = wait_until(Duration::from_secs(60), || {
        if let Ok(Some(s)) = a.child.try_wait() {
            fenced = Some(("first", s, a.log_text()));
            return true;
        }
        if let Ok(Some(s)) = z.child.try_wait() {
            fenced = Some(("second", s, z.log_text()));
            return true;
        }
        false
    });
    assert!(decided, "neither instance was fenced");
    let (who, status, log) = fenced.unwrap();
    assert!(!status.success(), "the fenced instance exits non-zero");
    assert!(
        log.contains("fenced"),
        "the {who} instance's log says it was fenced:\n{}",
        tail(&log, 20)
    );
    let survivor = if who == "first" { &mut z } else { &mut a };
    assert!(producer.wait().unwrap().success());
    let total = end_offsets_total(b, &input);
    survivor.wait_committed(total, Duration::from_secs(120));
    assert!(survivor.stop_gracefully(Duration::from_secs(30)).success());
    assert_eq!(assert_exactly_once(b, &input, b, &output) as i64, total);
}

#[test]
fn the_broker_killed_and_restarted_under_load() {
    let _serial = serial();
    let broker = Broker::start_private("faults");
    let b = broker.bootstrap.clone();
    let input = unique("bk-in");
    let output = unique("bk-out");
    create_topic(&b, &input, 3);
    let mut spec = BridgeSpec::new(&input, &output);
    spec.source_bootstrap = b.clone();
    spec.sink_bootstrap = b.clone();
    let home = BridgeHome::new(spec);
    let mut producer = background_producer(&b, &input, 15_000, 1_000, 1);

    let mut bridge = home.start(&[]);
    bridge.wait_checkpoint(3, Duration::from_secs(60));
    broker.kill9();
    // A real outage: the broker stays away for a few seconds while the bridge keeps trying.
    std::thread::sleep(Duration::from_secs(4));
    broker.restart();
    let _ = producer.wait();
    let total = end_offsets_total(&b, &input);
    bridge.wait_committed(total, Duration::from_secs(180));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    assert_eq!(assert_exactly_once(&b, &input, &b, &output) as i64, total);
    broker.stop();
}

#[cfg(feature = "failpoints")]
#[test]
fn a_corrupt_newest_checkpoint_and_a_deleted_state_directory() {
    use eos_bridge::checkpoint::CheckpointStore;

    let _serial = serial();
    let b = bootstrap();
    let input = unique("state-in");
    let output = unique("state-out");
    create_topic(b, &input, 2);
    let home = BridgeHome::new(BridgeSpec::new(&input, &output));
    assert!(verifiable_produce(b, &input, 1000, -1, Some(1))
        .status
        .success());
    let mut bridge = home.start(&[]);
    bridge.wait_committed(end_offsets_total(b, &input), Duration::from_secs(60));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());

    let corrupted = {
        let store = CheckpointStore::open(&home.state_dir(), 3).unwrap();
        store.corrupt_newest_for_tests().unwrap()
    };
    assert!(corrupted.is_some(), "there was a checkpoint to corrupt");
    assert!(verifiable_produce(b, &input, 500, -1, Some(2))
        .status
        .success());
    let total = end_offsets_total(b, &input);
    let mut bridge = home.start(&[]);
    bridge.wait_committed(total, Duration::from_secs(60));
    let log = bridge.log_text();
    assert!(
        log.contains("corrupt checkpoint"),
        "the corrupt checkpoint is reported:\n{}",
        tail(&log, 30)
    );
    let (_, metrics) = bridge.get("/metrics").unwrap();
    assert!(
        metrics.contains("eos_bridge_corrupt_checkpoints_total 1"),
        "{metrics}"
    );
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    assert_eq!(assert_exactly_once(b, &input, b, &output) as i64, total);

    std::fs::remove_dir_all(home.state_dir()).unwrap();
    assert!(verifiable_produce(b, &input, 500, -1, Some(3))
        .status
        .success());
    let total = end_offsets_total(b, &input);
    let mut bridge = home.start(&[]);
    bridge.wait_committed(total, Duration::from_secs(60));
    let log = bridge.log_text();
    assert!(
        log.contains("adopted_from_marker"),
        "recovery adopts the marker:\n{}",
        tail(&log, 30)
    );
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    assert_eq!(assert_exactly_once(b, &input, b, &output) as i64, total);
}

#[test]
fn across_two_clusters() {
    let _serial = serial();
    let source = bootstrap();
    let sink = second_bootstrap();
    assert_ne!(source, sink);
    let input = unique("x-in");
    let output = unique("x-out");
    create_topic(source, &input, 3);
    let mut spec = BridgeSpec::new(&input, &output);
    spec.sink_bootstrap = sink.to_string();
    let home = BridgeHome::new(spec);
    let mut producer = background_producer(source, &input, 6_000, 2_000, 1);
    let mut bridge = home.start(&[]);
    bridge.wait_checkpoint(2, Duration::from_secs(60));
    bridge.kill9();
    let mut bridge = home.start(&[]);
    assert!(producer.wait().unwrap().success());
    let total = end_offsets_total(source, &input);
    bridge.wait_committed(total, Duration::from_secs(120));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    assert_eq!(
        assert_exactly_once(source, &input, sink, &output) as i64,
        total
    );
}
