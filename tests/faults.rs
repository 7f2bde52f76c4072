//! Faults around the bridge: downtime longer than the transaction timeout, a zombie with the same
//! transactional id, the broker killed and restarted, a corrupt or deleted state directory, and a
//! bridge between two clusters. Each judged by Kafka's console consumer with read_committed.

mod common;

use std::time::Duration;
#[cfg(feature = "failpoints")]
use std::time::Instant;

use common::bridge::*;
use common::scenario::*;
use common::*;

#[cfg(feature = "failpoints")]
#[test]
fn downtime_longer_than_the_transaction_timeout() {
    let _serial = serial();
    let mut s = Scenario::new("down", 2).with(|spec| {
        spec.interval = "300ms";
        spec.checkpoint_timeout = "2s";
        spec.transaction_timeout = "4s";
    });
    let txn_id = s.transactional_id();
    s.produce(1500, 1);

    // Die with the transaction open and its records flushed: the worst moment to vanish.
    s.start(&[("EOS_BRIDGE_FAILPOINT", "after-flush")]);
    s.wait_exit(Duration::from_secs(60));
    let died = Instant::now();

    // Stay down until the coordinator has timed the transaction out and aborted it.
    let aborted = wait_until(Duration::from_secs(60), || {
        transaction_state(&s.source, &txn_id).as_deref() == Some("CompleteAbort")
    });
    assert!(
        aborted,
        "the coordinator should abort the abandoned transaction"
    );
    assert!(
        died.elapsed() >= Duration::from_secs(4),
        "down for longer than transaction.timeout"
    );
    s.run(&[Produce(500, 2), Start, Committed, Stop, Judge]);
}

#[test]
fn a_zombie_with_the_same_transactional_id_is_fenced() {
    let _serial = serial();
    let mut s = Scenario::new("zombie", 3);
    let second = BridgeHome::new(s.home.spec.clone());
    // Input arrives until one of the two is fenced (up to a minute at 2,000/s): an instance
    // learns it was fenced when it next writes, so both must have records to write however long
    // their starts take.
    let producer = s.produce_in_background(120_000, 2_000, 1);

    s.run(&[Start, WaitCheckpoint(3)]);
    let mut z = second.start(&[]);
    // One of the two must stop with the fencing message; the survivor finishes the work.
    let a = s.bridge();
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
    stop_producer(producer);
    assert!(decided, "neither instance was fenced");
    let (who, status, log) = fenced.unwrap();
    assert!(!status.success(), "the fenced instance exits non-zero");
    assert!(
        log.contains("fenced"),
        "the {who} instance's log says it was fenced:\n{}",
        tail(&log, 20)
    );
    let total = s.input_total();
    let survivor = if who == "first" { &mut z } else { s.bridge() };
    survivor.wait_committed(total, Duration::from_secs(120));
    assert!(survivor.stop_gracefully(Duration::from_secs(30)).success());
    s.judge();
}

#[test]
fn the_broker_killed_and_restarted_under_load() {
    let _serial = serial();
    let broker = Broker::start_private("faults");
    let b = &broker.bootstrap;
    let mut s = Scenario::between(b, b, "bk", 3);
    let mut producer = s.produce_in_background(15_000, 1_000, 1);

    s.run(&[Start, WaitCheckpoint(3)]);
    broker.kill9();
    // A real outage: the broker stays away for a few seconds while the bridge keeps trying.
    std::thread::sleep(Duration::from_secs(4));
    broker.restart();
    let _ = producer.wait();
    s.run(&[CommittedWithin(180), Stop, Judge]);
    broker.stop();
}

#[cfg(feature = "failpoints")]
#[test]
fn a_corrupt_newest_checkpoint_and_a_deleted_state_directory() {
    use eos_bridge::checkpoint::CheckpointStore;

    let _serial = serial();
    let mut s = Scenario::new("state", 2);
    s.run(&[Produce(1000, 1), Start, Committed, Stop]);

    let corrupted = {
        let store = CheckpointStore::open(&s.home.state_dir(), 3).unwrap();
        store.corrupt_newest_for_tests().unwrap()
    };
    assert!(corrupted.is_some(), "there was a checkpoint to corrupt");
    s.run(&[Produce(500, 2), Start, Committed]);
    let log = s.log();
    assert!(
        log.contains("corrupt checkpoint"),
        "the corrupt checkpoint is reported:\n{}",
        tail(&log, 30)
    );
    let (_, metrics) = s.bridge().get("/metrics").unwrap();
    assert!(
        metrics.contains("eos_bridge_corrupt_checkpoints_total 1"),
        "{metrics}"
    );
    s.run(&[Stop, Judge, WipeState, Produce(500, 3), Start, Committed]);
    let log = s.log();
    assert!(
        log.contains("adopted_from_marker"),
        "recovery adopts the marker:\n{}",
        tail(&log, 30)
    );
    s.run(&[Stop, Judge]);
}

#[test]
fn across_two_clusters() {
    let _serial = serial();
    let (source, sink) = (bootstrap(), second_bootstrap());
    assert_ne!(source, sink);
    let mut s = Scenario::between(source, sink, "x", 3);
    let mut producer = s.produce_in_background(6_000, 2_000, 1);
    s.run(&[Start, WaitCheckpoint(2), Kill9, Start]);
    assert!(producer.wait().unwrap().success());
    s.run(&[CommittedWithin(120), Stop, Judge]);
}
