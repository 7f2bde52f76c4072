//! Crashes: kill -9 at random instants under load, and a crash at each step of the checkpoint
//! protocol through failpoints. Judged by Kafka's console consumer with read_committed.

mod common;

#[cfg(feature = "failpoints")]
use std::os::unix::process::ExitStatusExt;

use std::time::{Duration, Instant};

use rand::Rng;

use common::bridge::*;
use common::*;

#[cfg(feature = "failpoints")]
/// The protocol steps, in order, and the recovery outcome the next start must report.
const STEPS: [(&str, &str); 6] = [
    ("after-produce", "committed"),
    ("after-marker", "committed"),
    ("after-flush", "committed"),
    ("after-precommit", "rolled_back"),
    ("after-commit", "committed"),
    ("after-mark-committed", "committed"),
];

#[cfg(feature = "failpoints")]
fn reports_outcome(log: &str, outcome: &str) -> bool {
    log.lines().any(|l| {
        l.contains("recovered")
            && (l.contains(&format!("outcome={outcome}"))
                || l.contains(&format!("outcome=\"{outcome}\"")))
    })
}

#[cfg(feature = "failpoints")]
#[test]
fn a_crash_at_each_protocol_step_loses_nothing_and_duplicates_nothing() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("fp-in");
    let output = unique("fp-out");
    create_topic(b, &input, 2);
    let home = BridgeHome::new(BridgeSpec::new(&input, &output));

    for (i, (step, outcome)) in STEPS.iter().enumerate() {
        // A clean run first, so that there is committed state to come back to.
        assert!(verifiable_produce(b, &input, 300, -1, Some(2 * i as u32))
            .status
            .success());
        let total = end_offsets_total(b, &input);
        let mut bridge = home.start(&[]);
        bridge.wait_committed(total, Duration::from_secs(60));
        assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());

        // Then a crash at the step, with a fresh batch in flight.
        assert!(
            verifiable_produce(b, &input, 300, -1, Some(2 * i as u32 + 1))
                .status
                .success()
        );
        let mut bridge = home.start(&[("EOS_BRIDGE_FAILPOINT", step)]);
        let status = bridge
            .wait_exit(Duration::from_secs(60))
            .unwrap_or_else(|| {
                panic!(
                    "failpoint {step} was never reached:\n{}",
                    tail(&bridge.log_text(), 30)
                )
            });
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "the bridge must die at failpoint {step}, it exited with {status}:\n{}",
            tail(&bridge.log_text(), 30)
        );
        assert!(bridge
            .log_text()
            .contains(&format!("failpoint '{step}' reached")));

        // The next start reports the outcome the protocol predicts, and finishes the work.
        let total = end_offsets_total(b, &input);
        let mut bridge = home.start(&[]);
        bridge.wait_committed(total, Duration::from_secs(60));
        let log = bridge.log_text();
        assert!(
            reports_outcome(&log, outcome),
            "after a crash at {step}, recovery should report {outcome}:\n{}",
            tail(&log, 30)
        );
        assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    }
    let total = end_offsets_total(b, &input);
    let n = assert_exactly_once(b, &input, b, &output);
    assert_eq!(n as i64, total);
}

#[test]
fn kill_9_at_random_instants_under_load() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("chaos-in");
    let output = unique("chaos-out");
    create_topic(b, &input, 4);
    let records: u64 = std::env::var("EOS_BRIDGE_CHAOS_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let kills: u32 = std::env::var("EOS_BRIDGE_CHAOS_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let started = Instant::now();

    // Input keeps arriving during the kills.
    let rate = (records / 30).max(1000);
    let mut producer = background_producer(b, &input, records, rate, 1);

    let home = BridgeHome::new(BridgeSpec::new(&input, &output));
    let mut rng = rand::rng();

    // The first run creates the sink topic; then a second read_committed reader follows the sink
    // through all the chaos.
    let mut bridge = home.start(&[]);
    bridge.wait_checkpoint(1, Duration::from_secs(60));
    let reader_out = home.dir.path().join("live-reader.txt");
    let mut reader = spawn_console_consumer(b, &output, Duration::from_secs(20), &reader_out);

    let mut killed = 0;
    while killed < kills {
        std::thread::sleep(Duration::from_millis(rng.random_range(200..2500)));
        bridge.kill9();
        killed += 1;
        bridge = home.start(&[]);
    }
    let producer_status = producer.wait().unwrap();
    assert!(producer_status.success(), "the input producer failed");
    let total = end_offsets_total(b, &input);
    assert_eq!(total as u64, records);
    bridge.wait_committed(total, Duration::from_secs(180));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    let chaos_secs = started.elapsed().as_secs_f64();

    let n = assert_exactly_once(b, &input, b, &output);
    assert_eq!(n as u64, records);

    // The reader that ran through the chaos saw nothing twice, and in the end everything.
    let reader_done = wait_until(Duration::from_secs(90), || {
        matches!(reader.try_wait(), Ok(Some(_)))
    });
    if !reader_done {
        let _ = reader.kill();
    }
    let live = parse_console_lines(&std::fs::read_to_string(&reader_out).unwrap());
    let mut seen = std::collections::HashSet::new();
    for r in &live {
        assert!(
            seen.insert(r.value.clone()),
            "the live reader saw {} twice",
            r.value
        );
    }
    assert_eq!(
        live.len() as u64,
        records,
        "the live reader saw every record once"
    );
    eprintln!("chaos: {records} records, {killed} kills, {chaos_secs:.1}s until all committed");
}
