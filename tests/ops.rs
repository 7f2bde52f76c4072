//! The operations surface against a bridge on the real broker: every HTTP endpoint, readiness
//! across a broker outage, savepoints (including a restore into two instances, judged exactly
//! once by Kafka's console consumer), `check`, and the dashboard and alert rules naming only
//! metrics the bridge exposes.

mod common;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use common::bridge::*;
use common::scenario::*;
use common::*;

fn send(
    method: &str,
    bridge: &Bridge,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    let url = format!("http://127.0.0.1:{}{path}", bridge.port);
    let a = http_agent();
    let mut resp = match method {
        "POST" => {
            let mut req = a.post(&url).header("Content-Type", "application/json");
            if let Some(t) = token {
                req = req.header("Authorization", &format!("Bearer {t}"));
            }
            req.send(body.unwrap_or("")).unwrap()
        }
        "DELETE" => {
            let mut req = a.delete(&url);
            if let Some(t) = token {
                req = req.header("Authorization", &format!("Bearer {t}"));
            }
            req.call().unwrap()
        }
        _ => a.get(&url).call().unwrap(),
    };
    let code = resp.status().as_u16();
    (code, resp.body_mut().read_to_string().unwrap_or_default())
}

/// POST /api/v1/savepoints with `body`, with or without a bearer token.
fn post_savepoint(bridge: &Bridge, token: Option<&str>, body: &str) -> (u16, String) {
    send("POST", bridge, "/api/v1/savepoints", token, Some(body))
}

#[test]
fn every_endpoint_answers_and_mutations_need_the_token() {
    let _serial = serial();
    let mut s = Scenario::new("api", 2);
    s.produce(500, 1);
    // The token goes in through the environment, as a secret would.
    s.run(&[
        StartWith(&[("EOS_BRIDGE__API__ADMIN_TOKEN", "s3cret-token")]),
        CommittedTo(500),
    ]);
    let bridge = s.bridge();

    assert_eq!(bridge.get("/health/live").unwrap().0, 200);
    let (code, body) = bridge.get("/health/ready").unwrap();
    assert_eq!(code, 200, "{body}");
    let (code, metrics) = bridge.get("/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(
        metrics.contains("eos_bridge_build_info{version=\""),
        "{metrics}"
    );
    assert!(metrics.contains("process_resident_memory_bytes"));
    assert!(!metrics.contains("s3cret-token"));

    let status = bridge.status().unwrap();
    assert_eq!(status["state"], "running");
    assert_eq!(status["delivery"], "exactly-once");
    assert_eq!(status["partitions"].as_array().unwrap().len(), 2);
    assert!(status["epoch_age_ms"].is_u64());
    assert!(!status.to_string().contains("s3cret-token"));

    let (code, body) = bridge.get("/api/v1/checkpoints").unwrap();
    assert_eq!(code, 200);
    let cps: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(!cps["checkpoints"].as_array().unwrap().is_empty(), "{body}");

    // Savepoints: 401 without or with a wrong token, 400 for a bad name, 201 with the token.
    let (code, _) = post_savepoint(bridge, None, r#"{"name":"sp1"}"#);
    assert_eq!(code, 401);
    let (code, _) = post_savepoint(bridge, Some("wrong"), r#"{"name":"sp1"}"#);
    assert_eq!(code, 401);
    let (code, _) = post_savepoint(bridge, Some("s3cret-token"), r#"{"name":"a/b"}"#);
    assert_eq!(code, 400);
    let (code, body) = post_savepoint(bridge, Some("s3cret-token"), r#"{"name":"sp1"}"#);
    assert_eq!(code, 201, "{body}");
    let sp: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(sp["name"], "sp1");
    assert_eq!(sp["format"], "eos-bridge-savepoint");
    let (code, _) = post_savepoint(bridge, Some("s3cret-token"), r#"{"name":"sp1"}"#);
    assert_eq!(code, 409, "a name is taken once");
    let (code, body) = bridge.get("/api/v1/savepoints").unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("\"sp1\""), "{body}");
    let (code, body) = bridge.get("/api/v1/savepoints/sp1").unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["name"],
        "sp1"
    );
    assert_eq!(bridge.get("/api/v1/savepoints/nope").unwrap().0, 404);
    let (code, _) = send("DELETE", bridge, "/api/v1/savepoints/sp1", None, None);
    assert_eq!(code, 401);
    let (code, _) = send(
        "DELETE",
        bridge,
        "/api/v1/savepoints/sp1",
        Some("s3cret-token"),
        None,
    );
    assert_eq!(code, 204);
    assert_eq!(bridge.get("/api/v1/savepoints/sp1").unwrap().0, 404);
    s.stop();

    // Without a configured token, mutations are closed, never open.
    s.run(&[Start, CommittedTo(500)]);
    let bridge = s.bridge();
    let (code, body) = post_savepoint(bridge, Some("anything"), r#"{"name":"x"}"#);
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("admin_token"));
    s.stop();
}

#[test]
fn readiness_follows_the_broker() {
    let _serial = serial();
    let broker = Broker::start_private("ready");
    let b = &broker.bootstrap;
    let mut s = Scenario::between(b, b, "rd", 1).with(|spec| {
        spec.checkpoint_timeout = "3s";
        spec.transaction_timeout = "10s";
    });
    s.run(&[Produce(200, 1), Start, CommittedTo(200)]);
    let bridge = s.bridge();
    assert_eq!(bridge.get("/health/ready").unwrap().0, 200);

    broker.stop();
    let unready = wait_until(Duration::from_secs(60), || {
        bridge.get("/health/ready").is_some_and(|(c, _)| c == 503)
    });
    let (_, body) = bridge.get("/health/ready").unwrap();
    assert!(unready, "readiness must turn 503 while the broker is down");
    assert!(body.contains("reasons"), "{body}");
    assert_eq!(bridge.get("/health/live").unwrap().0, 200, "still alive");

    broker.restart();
    let ready = wait_until(Duration::from_secs(120), || {
        bridge.get("/health/ready").is_some_and(|(c, _)| c == 200)
    });
    assert!(
        ready,
        "readiness must return to 200:\n{}",
        tail(&bridge.log_text(), 30)
    );
    s.stop();
    broker.stop();
}

#[test]
fn a_savepoint_restores_exactly_once_into_two_instances() {
    let _serial = serial();
    let mut s = Scenario::new("sp", 4);
    s.run(&[
        Produce(2000, 1),
        StartWith(&[("EOS_BRIDGE__API__ADMIN_TOKEN", "t")]),
        CommittedTo(2000),
    ]);
    // Input keeps arriving while the savepoint is taken: stop-with-savepoint makes the savepoint
    // the last commit of the old layout, so nothing after it is bridged twice.
    let mut producer = s.produce_in_background(3000, 1000, 2);
    let bridge = s.bridge();
    assert!(wait_until(Duration::from_secs(30), || bridge
        .committed_total()
        .unwrap_or(0)
        > 2000));
    let (code, body) = post_savepoint(bridge, Some("t"), r#"{"name":"move","stop":true}"#);
    assert_eq!(code, 201, "{body}");
    let status = bridge
        .wait_exit(Duration::from_secs(30))
        .expect("the bridge stops after the savepoint");
    assert!(status.success(), "stop-with-savepoint exits 0");

    // Export with the CLI, from the stopped bridge's state directory.
    let out = Command::new(env!("CARGO_BIN_EXE_eos-bridge"))
        .args(["savepoint", "export", "--state-dir"])
        .arg(s.home.state_dir())
        .args(["--name", "move"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = s.home.dir.path().join("move.json");
    std::fs::write(&file, &out.stdout).unwrap();

    assert!(producer.wait().unwrap().success());
    let total = s.input_total();

    // Two instances, fresh state directories, restored from the one savepoint.
    let mut homes = Vec::new();
    for instance in 0..2 {
        let mut spec = s.home.spec.clone();
        spec.instance = instance;
        spec.instances = 2;
        homes.push(BridgeHome::new(spec));
    }
    // Without the flag the layout change is refused.
    let mut refused = homes[0].start_with_args(&[], &["--from-savepoint", file.to_str().unwrap()]);
    let status = refused.wait_exit(Duration::from_secs(60)).expect("refused");
    assert!(!status.success());
    assert!(
        refused.log_text().contains("--allow-layout-change"),
        "{}",
        refused.log_text()
    );

    let args = [
        "--from-savepoint",
        file.to_str().unwrap(),
        "--allow-layout-change",
    ];
    let mut bridges: Vec<Bridge> = homes
        .iter()
        .map(|h| h.start_with_args(&[], &args))
        .collect();
    let done = all_committed(&bridges, total);
    assert!(
        done,
        "the two instances together commit everything:\n{}",
        tail(&bridges[0].log_text(), 20)
    );
    // Everything can be committed before an instance has restored: the input may sit in the
    // other instance's partitions (VerifiableProducer's sticky partitioner), and that instance may
    // still be fencing the old layout. Each restores all the same, within a bounded wait.
    for br in &bridges {
        assert!(
            wait_until(Duration::from_secs(60), || br
                .log_text()
                .contains("restored from savepoint")),
            "{}",
            br.log_text()
        );
    }
    for br in bridges.iter_mut() {
        assert!(br.stop_gracefully(Duration::from_secs(30)).success());
    }
    assert_eq!(s.judge(), total);

    // A restart that still carries --from-savepoint does not rewind a second time.
    s.produce(400, 3);
    let total = s.input_total();
    let mut bridges: Vec<Bridge> = homes
        .iter()
        .map(|h| h.start_with_args(&[], &args))
        .collect();
    let done = all_committed(&bridges, total);
    assert!(done);
    for br in bridges.iter_mut() {
        assert!(br.stop_gracefully(Duration::from_secs(30)).success());
    }
    assert_eq!(s.judge(), total);
}

/// Waits until the instances' committed positions together reach `total`.
fn all_committed(bridges: &[Bridge], total: i64) -> bool {
    wait_until(Duration::from_secs(90), || {
        bridges
            .iter()
            .map(|br| br.committed_total().unwrap_or(0))
            .sum::<i64>()
            == total
    })
}

#[test]
fn check_reports_each_finding_with_its_fix() {
    let b = bootstrap();
    let input = unique("chk-in");
    create_topic(b, &input, 1);
    let dir = temp_state_dir();
    let run_check = |spec: &BridgeSpec| {
        let path = dir.path().join(format!("{}.toml", spec.id));
        std::fs::write(&path, spec.toml(&dir.path().join("state"), free_port())).unwrap();
        Command::new(env!("CARGO_BIN_EXE_eos-bridge"))
            .args(["check", "--config", path.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let good = BridgeSpec::new(&input, &unique("chk-out"));
    let out = run_check(&good);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("timeout rule") && text.contains("transaction.max.timeout.ms"),
        "{text}"
    );

    let missing = BridgeSpec::new(&unique("no-such-topic"), &unique("chk-out"));
    let out = run_check(&missing);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("FAIL") && text.contains("fix:"), "{text}");
}

#[test]
fn dashboards_and_alerts_name_only_exposed_metrics() {
    let _serial = serial();
    let out = Command::new("python3")
        .arg(repo_root().join("scripts/metric-names"))
        .output()
        .expect("python3 runs scripts/metric-names");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let named: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    assert!(
        named.len() >= 10,
        "the dashboard and rules name metrics: {named:?}"
    );

    let mut s = Scenario::new("dash", 1);
    s.run(&[Produce(100, 1), Start, CommittedTo(100)]);
    // The sink latency series appear with the producer's first statistics window (5 s).
    let mut unknown: Vec<String> = Vec::new();
    wait_until(Duration::from_secs(30), || {
        let metrics = s
            .bridge()
            .get("/metrics")
            .map(|(_, m)| m)
            .unwrap_or_default();
        let exposed: BTreeSet<&str> = metrics
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| l.split(['{', ' ']).next())
            .collect();
        unknown = named
            .iter()
            .filter(|n| !exposed.contains(n.as_str()))
            .cloned()
            .collect();
        unknown.is_empty()
    });
    s.stop();
    assert!(
        unknown.is_empty(),
        "the dashboard or alert rules name metrics that /metrics does not expose: {unknown:?}"
    );
}

/// The value of the first series of `name` with `labels` among them, in Prometheus text. Not
/// `Bridge::metric`, which scrapes once per series and needs the whole series: the quantiles must
/// come from one scrape (one statistics window), and the broker's node id is the test broker's.
fn series_value(metrics: &str, name: &str, labels: &str) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(labels))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

#[test]
fn the_sink_producers_broker_latency_is_exposed_from_its_statistics() {
    let _serial = serial();
    let mut s = Scenario::new("rtt", 1);
    s.run(&[Produce(300, 1), Start, CommittedTo(300)]);
    let bridge = s.bridge();
    // librdkafka reports every 5 s by default: the first window may still be open.
    let mut metrics = String::new();
    let shown = wait_until(Duration::from_secs(30), || {
        metrics = bridge.get("/metrics").map(|(_, m)| m).unwrap_or_default();
        series_value(
            &metrics,
            "eos_bridge_sink_request_rtt_seconds",
            "quantile=\"0.99\"",
        )
        .is_some()
    });
    s.stop();
    assert!(shown, "no sink round trip within 30 s:\n{metrics}");
    let rtt = |q: &str| {
        series_value(
            &metrics,
            "eos_bridge_sink_request_rtt_seconds",
            &format!("quantile=\"{q}\""),
        )
        .unwrap_or_else(|| panic!("quantile {q} missing:\n{metrics}"))
    };
    let (p50, p99, max) = (rtt("0.5"), rtt("0.99"), rtt("1"));
    assert!(
        0.0 < p50 && p50 <= p99 && p99 <= max && max < 30.0,
        "round trips out of order or range: p50 {p50} p99 {p99} max {max}"
    );
    let queued = series_value(
        &metrics,
        "eos_bridge_sink_queue_latency_seconds",
        "quantile=\"1\"",
    );
    assert!(
        queued.is_some_and(|q| (0.0..30.0).contains(&q)),
        "queue latency {queued:?}:\n{metrics}"
    );
}
