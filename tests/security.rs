//! The bridge on a secured broker (`scripts/kafka start --secure`): TLS with the server verified
//! by a CA file, mutual TLS, SASL PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 and OAUTHBEARER, a run whose
//! source and sink use different mechanisms; and what a wrong password, an untrusted certificate
//! and an unreachable cluster do: a clear error within a bound, a non-zero exit, nothing lost.
//! Exactly-once is judged by Kafka's console consumer with read_committed over the SASL_SSL
//! listener, as the broker's super user.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::bridge::*;
use common::scenario::*;
use common::secure::*;
use common::*;

const RECORDS: u64 = 2000;

fn env_refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// Bridges RECORDS records over two partitions with these settings and judges the result.
fn bridge_exactly_once(label: &str, source: &ClientSettings, sink: &ClientSettings) {
    let _serial = serial();
    let began = Instant::now();
    let mut s = Scenario::secured("sec", 2, source, sink);
    s.run(&[Produce(RECORDS, 1), Start, Committed, Stop]);
    let out = s.judge();
    assert_eq!(out as u64, RECORDS);
    eprintln!(
        "{label}: {RECORDS} records in, {out} out, exactly once (read_committed), {:.1}s",
        began.elapsed().as_secs_f64()
    );
}

#[test]
fn sasl_plain_over_tls_with_the_server_verified() {
    let b = secure_broker();
    let c = b.client(Auth::Plain, "bridge");
    // The broker's certificate is checked against the CA and its host name (librdkafka's default).
    assert!(c.props.iter().any(|(k, _)| k == "ssl.ca.location"));
    bridge_exactly_once("SASL_SSL PLAIN", &c, &c);
}

#[test]
fn scram_sha_256() {
    let c = secure_broker().client(Auth::Scram256, "bridge");
    bridge_exactly_once("SASL_SSL SCRAM-SHA-256", &c, &c);
}

#[test]
fn scram_sha_512() {
    let c = secure_broker().client(Auth::Scram512, "bridge");
    bridge_exactly_once("SASL_SSL SCRAM-SHA-512", &c, &c);
}

#[test]
fn oauthbearer_unsecured_jwt() {
    let c = secure_broker().client(Auth::OAuthBearer, "bridge");
    bridge_exactly_once("SASL_SSL OAUTHBEARER", &c, &c);
}

#[test]
fn mutual_tls() {
    let c = secure_broker().client(Auth::MutualTls, "bridge");
    bridge_exactly_once("SSL mutual TLS", &c, &c);
}

/// Source and sink on different listeners of the broker with different mechanisms: each side's
/// settings reach only its own clients (a second secured broker would cost another JVM).
#[test]
fn source_and_sink_with_different_mechanisms() {
    let b = secure_broker();
    let source = b.client(Auth::MutualTls, "bridge");
    let sink = b.client(Auth::Scram512, "bridge");
    bridge_exactly_once("source mutual TLS, sink SCRAM-SHA-512", &source, &sink);
}

/// Runs `eos-bridge check` on the spec: (exit code, output, time taken).
fn check(home: &BridgeHome, env: &[(String, String)]) -> (Option<i32>, String, Duration) {
    let cfg = home.write_config("check", free_port());
    let began = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_eos-bridge"))
        .args(["check", "--config", path_str(&cfg)])
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .expect("eos-bridge check runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text, began.elapsed())
}

/// Starts the bridge and waits for it to exit: (exit code, log, time taken).
fn run_until_exit(home: &BridgeHome, env: &[(String, String)]) -> (Option<i32>, String, Duration) {
    let began = Instant::now();
    let mut bridge = home.start(&env_refs(env));
    let status = bridge.wait_exit(FAILURE_BOUND);
    let log = bridge.log_text();
    let status = status.unwrap_or_else(|| {
        panic!(
            "the bridge did not exit within {FAILURE_BOUND:?}:\n{}",
            tail(&log, 30)
        )
    });
    (status.code(), log, began.elapsed())
}

fn assert_failed_naming(what: &str, code: Option<i32>, text: &str, needles: &[&str]) {
    assert!(
        matches!(code, Some(c) if c != 0),
        "{what} exits non-zero, got {code:?}:\n{text}"
    );
    for n in needles {
        assert!(text.contains(n), "{what} names '{n}':\n{}", tail(text, 30));
    }
}

#[test]
fn a_wrong_password_stops_run_and_check_and_a_fixed_restart_bridges_everything_once() {
    let _serial = serial();
    let good = secure_broker().client(Auth::Scram512, "bridge");
    let wrong_password = format!("wrong-{}", random_suffix());
    let mut bad = good.clone();
    bad.password = Some(wrong_password.clone());
    let mut s = Scenario::secured("pw", 2, &good, &bad);
    s.run(&[Produce(RECORDS, 1)]);

    let (code, text, took) = check(&s.home, &s.env);
    assert_failed_naming(
        "check",
        code,
        &text,
        &["sink connection", "authentication failed", "sasl.password"],
    );
    assert!(took < FAILURE_BOUND, "check took {took:?}");
    let (run_code, log, run_took) = run_until_exit(&s.home, &s.env);
    assert_failed_naming(
        "run",
        run_code,
        &log,
        &["sink cluster: authentication failed", "sasl.password"],
    );
    for (what, t) in [("check", &text), ("run", &log)] {
        assert!(
            !t.contains(&wrong_password),
            "{what} output shows the password"
        );
    }
    eprintln!(
        "wrong password: check exit {code:?} in {:.1}s, run exit {run_code:?} in {:.1}s",
        took.as_secs_f64(),
        run_took.as_secs_f64()
    );

    // The same bridge (id, markers, state directory), now with the right password.
    s.clients(&good, &good);
    s.run(&[Start, Committed, Stop]);
    let out = s.judge();
    assert_eq!(out as u64, RECORDS);
    eprintln!("after the fix: {RECORDS} in, {out} out, exactly once");
}

#[test]
fn an_untrusted_certificate_stops_run_and_check() {
    let _serial = serial();
    let broker = secure_broker();
    let input = unique("ca-in");
    broker.create_topic(&input, 1);
    let good = broker.client(Auth::Scram256, "bridge");
    let untrusted = good
        .clone()
        .with("ssl.ca.location", broker.get("SECURE_UNTRUSTED_CA_PEM"));
    let home = BridgeHome::new(secured_spec(&input, &unique("ca-out"), &untrusted, &good));
    let env = secured_env(&untrusted, &good);
    let (code, text, took) = check(&home, &env);
    assert_failed_naming(
        "check",
        code,
        &text,
        &[
            "source connection",
            "TLS handshake failed",
            "ssl.ca.location",
        ],
    );
    let (run_code, log, run_took) = run_until_exit(&home, &env);
    assert_failed_naming(
        "run",
        run_code,
        &log,
        &["source cluster: TLS handshake failed", "ssl.ca.location"],
    );
    eprintln!(
        "untrusted CA: check exit {code:?} in {:.1}s, run exit {run_code:?} in {:.1}s",
        took.as_secs_f64(),
        run_took.as_secs_f64()
    );
}

#[test]
fn an_unreachable_cluster_is_reported_by_ready_and_stops_start_up_after_its_timeout() {
    let _serial = serial();
    let broker = secure_broker();
    let input = unique("down-in");
    broker.create_topic(&input, 1);
    let good = broker.client(Auth::Scram256, "bridge");
    let mut nowhere = good.clone();
    // A port nothing listens on: every connection is refused.
    nowhere.bootstrap = format!("127.0.0.1:{}", free_port());
    let home = BridgeHome::new(secured_spec(&input, &unique("down-out"), &good, &nowhere));
    let mut env = secured_env(&good, &nowhere);
    env.push((
        "EOS_BRIDGE__BRIDGE__UNREACHABLE_TIMEOUT".into(),
        "10s".into(),
    ));

    let (code, text, took) = check(&home, &env);
    assert_failed_naming(
        "check",
        code,
        &text,
        &["sink connection", "unreachable", "sink.bootstrap_servers"],
    );

    let began = Instant::now();
    let mut bridge = home.start(&env_refs(&env));
    let mut ready = None;
    let said_why = wait_until(FAILURE_BOUND, || {
        ready = bridge.get("/health/ready");
        matches!(&ready, Some((503, body)) if body.contains("sink cluster unreachable"))
    });
    assert!(
        said_why,
        "/health/ready names the unreachable sink while start-up waits: {ready:?}\n{}",
        tail(&bridge.log_text(), 20)
    );
    let status = bridge.wait_exit(FAILURE_BOUND);
    let run_took = began.elapsed();
    let log = bridge.log_text();
    assert_failed_naming(
        "run",
        status.and_then(|s| s.code()),
        &log,
        &["sink cluster unreachable", "sink.bootstrap_servers"],
    );
    assert!(
        run_took >= Duration::from_secs(10),
        "start-up waits bridge.unreachable_timeout before it stops ({run_took:?})"
    );
    eprintln!(
        "unreachable sink: check exit {code:?} in {:.1}s, run exit {:?} in {:.1}s (unreachable_timeout 10s); ready said {:?}",
        took.as_secs_f64(),
        status.and_then(|s| s.code()),
        run_took.as_secs_f64(),
        ready.map(|(_, b)| b)
    );
}

/// A running bridge whose sink cluster goes away keeps running, answers not ready naming the
/// cause, and catches up exactly once when the cluster is back. (A private plaintext broker: the
/// shared secured one is not to be killed.)
#[test]
fn a_running_bridge_that_loses_its_sink_says_why_and_catches_up_once() {
    let _serial = serial();
    let sink = Broker::start_private("sec-lost");
    let mut s = Scenario::between(bootstrap(), &sink.bootstrap, "lost", 2);
    s.run(&[Produce(1000, 1), Start, Committed]);

    sink.kill9();
    let lost = Instant::now();
    let mut ready = None;
    let bridge = s.bridge();
    let said_why = wait_until(Duration::from_secs(45), || {
        ready = bridge.get("/health/ready");
        matches!(&ready, Some((503, body)) if body.contains("sink cluster unreachable"))
    });
    assert!(
        said_why,
        "/health/ready names the lost sink: {ready:?}\n{}",
        tail(&bridge.log_text(), 20)
    );
    let noticed = lost.elapsed();
    assert!(
        matches!(bridge.child.try_wait(), Ok(None)),
        "a running bridge waits for its cluster:\n{}",
        tail(&bridge.log_text(), 20)
    );
    s.run(&[Produce(1000, 2)]);
    sink.restart();
    s.run(&[CommittedWithin(90)]);
    let ready_again = wait_until(Duration::from_secs(30), || {
        matches!(s.bridge().get("/health/ready"), Some((200, _)))
    });
    assert!(ready_again, "ready again after the sink is back");
    s.run(&[Stop]);
    let out = s.judge();
    assert_eq!(out, 2000);
    eprintln!(
        "lost sink: not ready after {:.1}s with {:?}; after the restart 2000 in, {out} out, exactly once",
        noticed.as_secs_f64(),
        ready.map(|(_, b)| b)
    );
    sink.stop();
}
