//! Windows a careful reading found: a sink cluster that is down when the bridge starts, a listed
//! source topic that appears late (or never), `start = "latest"` across a crash before the first
//! commit, and a savepoint whose checkpoint never committed. Judged by Kafka's console consumer
//! with read_committed.

mod common;

#[cfg(feature = "failpoints")]
use std::process::Command;
use std::time::{Duration, Instant};

use common::bridge::*;
use common::scenario::*;
use common::*;

const WAITING: &str = "start-up: waiting for the cluster";

fn count(log: &str, needle: &str) -> usize {
    log.lines().filter(|l| l.contains(needle)).count()
}

#[test]
fn start_up_waits_for_a_sink_cluster_that_is_down() {
    let _serial = serial();
    let sink = Broker::start_private("sinkdown");
    sink.stop();
    let mut s = Scenario::between(bootstrap(), &sink.bootstrap, "sd", 2);
    s.run(&[Produce(400, 1), Start]);
    // A second bridge waiting on the same dead cluster is stopped with SIGTERM meanwhile.
    let mut other = s.home.spec.clone();
    other.id = unique("bridge");
    other.marker_topic = unique("markers");
    let quitter_home = BridgeHome::new(other);
    let mut quitter = quitter_home.start(&[]);

    let waited = wait_until(Duration::from_secs(45), || {
        count(&s.log(), WAITING) >= 1 && count(&quitter.log_text(), WAITING) >= 1
    });
    assert!(
        waited,
        "both bridges log that they wait:\n{}",
        tail(&s.log(), 20)
    );
    assert!(
        matches!(s.bridge().child.try_wait(), Ok(None)),
        "the bridge waits instead of exiting:\n{}",
        s.log()
    );

    let signalled = Instant::now();
    let status = quitter.stop_gracefully(Duration::from_secs(10));
    assert!(
        status.success(),
        "SIGTERM while waiting exits 0 ({status}):\n{}",
        quitter.log_text()
    );
    let took = signalled.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "exited {took:?} after SIGTERM"
    );

    sink.restart();
    s.bridge().wait_committed(400, Duration::from_secs(75));
    s.stop();
    assert_eq!(s.judge(), 400);
    eprintln!(
        "start-up attempts logged while the sink was down: {}; SIGTERM while waiting exited in {took:?}",
        count(&s.log(), WAITING)
    );
    sink.stop();
}

#[test]
fn a_listed_topic_that_appears_late_is_waited_for_and_one_that_never_does_stops_start_up() {
    let _serial = serial();
    let b = bootstrap();
    let late = unique("late-in");
    let output = unique("late-out");
    let home = BridgeHome::new(BridgeSpec::new(&late, &output));
    let never_home = BridgeHome::new(BridgeSpec::new(&unique("never"), &unique("never-out")));
    let began = Instant::now();
    let mut bridge = home.start(&[]);
    let mut never = never_home.start(&[]);

    let waiting = wait_until(Duration::from_secs(30), || {
        count(&bridge.log_text(), "discover the source topics") >= 1
    });
    assert!(
        waiting,
        "the bridge waits for its topic:\n{}",
        bridge.log_text()
    );
    create_topic(b, &late, 2);
    assert!(verifiable_produce(b, &late, 300, -1, Some(1))
        .status
        .success());
    bridge.wait_committed(300, Duration::from_secs(60));

    let status = never
        .wait_exit(Duration::from_secs(60))
        .expect("a topic that never appears stops start-up");
    let waited = began.elapsed();
    let log = never.log_text();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("do not exist on the source cluster"),
        "{}",
        tail(&log, 10)
    );
    assert!(
        waited >= Duration::from_secs(25),
        "stopped after {waited:?}, before the bounded wait"
    );

    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    assert_eq!(
        assert_exactly_once(b, &late, b, &output, Writer::Transactional),
        300
    );
    eprintln!("a missing topic stopped start-up after {waited:?}");
}

#[test]
fn start_latest_is_resolved_once_and_kept_until_the_first_commit() {
    let _serial = serial();
    let mut s = Scenario::new("latest", 2).with(|spec| {
        spec.interval = "60s";
        spec.transaction_timeout = "90s";
    });
    // Before the first start: `latest` skips these.
    s.produce(200, 1);
    let latest = [("EOS_BRIDGE__SOURCE__START", "latest")];

    let bridge = s.start(&latest);
    let resolved = wait_until(Duration::from_secs(60), || {
        bridge.log_text().contains("resolved source.start")
    });
    assert!(resolved, "{}", bridge.log_text());
    assert_eq!(bridge.last_checkpoint_id(), Some(0), "no commit yet");

    // Produced while the bridge is down, after `latest` was resolved: all of these are bridged.
    s.run(&[Kill9, Produce(300, 2)]);
    s.spec().interval = "300ms";
    s.run(&[StartWith(&latest), Committed]);
    assert!(
        s.log().contains("kept by an earlier run"),
        "{}",
        tail(&s.log(), 20)
    );
    s.stop();

    let (b, input, output) = (bootstrap(), &s.input, &s.output);
    let (source, sink) = read_committed_both((b, input), (b, output), Duration::from_secs(4));
    let mut wanted = by_partition(&source);
    for values in wanted.values_mut() {
        values.retain(|v| v.starts_with("2."));
    }
    assert_eq!(wanted.values().map(Vec::len).sum::<usize>(), 300);
    assert_same_sequences(&wanted, &by_partition(&sink));
    eprintln!(
        "start = latest across a kill -9 before the first commit: {} bridged of 300",
        sink.len()
    );
}

#[cfg(feature = "failpoints")]
#[test]
fn a_savepoint_whose_checkpoint_never_committed_is_not_offered() {
    use std::os::unix::process::ExitStatusExt;

    let _serial = serial();
    let mut s = Scenario::new("spp", 2).with(|spec| spec.interval = "3s");
    s.produce(300, 1);
    let token = ("EOS_BRIDGE__API__ADMIN_TOKEN", "t");
    let name = "never-committed";

    // Checkpoint 1 commits; the request arrives during epoch 2, so epoch 3 carries the name and
    // dies right after its pending checkpoint is on disk (the third "after-precommit").
    let bridge = s.start(&[
        token,
        ("EOS_BRIDGE_FAILPOINT", "after-precommit"),
        ("EOS_BRIDGE_FAILPOINT_HIT", "3"),
    ]);
    bridge.wait_checkpoint(1, Duration::from_secs(60));
    let url = format!("http://127.0.0.1:{}/api/v1/savepoints", bridge.port);
    let body = format!(r#"{{"name":"{name}"}}"#);
    std::thread::spawn(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        // The process dies before it answers.
        let _ = agent
            .post(&url)
            .header("Content-Type", "application/json")
            .header("Authorization", "Bearer t")
            .send(body.as_str());
    });
    let status = s.wait_exit(Duration::from_secs(60));
    assert_eq!(status.signal(), Some(9), "{}", s.log());

    let state_dir = s.home.state_dir();
    let cli = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_eos-bridge"))
            .args(args)
            .arg("--state-dir")
            .arg(&state_dir)
            .output()
            .unwrap()
    };
    let list = String::from_utf8_lossy(&cli(&["checkpoints", "list"]).stdout).to_string();
    assert!(
        list.lines()
            .any(|l| l.contains("pending") && l.contains(name)),
        "the pending checkpoint carries the name:\n{list}"
    );
    let export = cli(&["savepoint", "export", "--name", name]);
    let stderr = String::from_utf8_lossy(&export.stderr);
    assert!(
        !export.status.success(),
        "a pending savepoint is not exported:\n{}",
        String::from_utf8_lossy(&export.stdout)
    );
    assert!(stderr.contains("still pending"), "{stderr}");

    // Recovery settles it: the marker says checkpoint 3 never committed.
    s.run(&[StartWith(&[token]), CommittedTo(300)]);
    let bridge = s.bridge();
    let (code, listed) = bridge.get("/api/v1/savepoints").unwrap();
    assert_eq!(code, 200);
    assert!(!listed.contains(name), "{listed}");
    let (code, one) = bridge.get(&format!("/api/v1/savepoints/{name}")).unwrap();
    assert_eq!(code, 404, "{one}");
    s.stop();
    let list = String::from_utf8_lossy(&cli(&["checkpoints", "list"]).stdout).to_string();
    assert!(!list.contains(name), "{list}");
    assert_eq!(s.judge(), 300);
}
