//! The bridge end to end on a real broker: sequenced input from Kafka's VerifiableProducer,
//! output judged by Kafka's console consumer with read_committed, a graceful shutdown that leaves
//! no transaction open (asked of Kafka's TransactionsCommand), and a clean restart.

mod common;

use std::time::Duration;

use common::bridge::*;
use common::*;

#[test]
fn bridges_exactly_once_and_shuts_down_with_no_open_transaction() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("in");
    let output = unique("out");
    create_topic(b, &input, 3);
    let out = verifiable_produce(b, &input, 3000, -1, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let total = end_offsets_total(b, &input);
    assert_eq!(total, 3000);

    let home = BridgeHome::new(BridgeSpec::new(&input, &output));
    let mut bridge = home.start(&[]);
    bridge.wait_committed(total, Duration::from_secs(60));

    // More input while it runs.
    let out = verifiable_produce(b, &input, 1000, -1, Some(7));
    assert!(out.status.success());
    let total = end_offsets_total(b, &input);
    bridge.wait_committed(total, Duration::from_secs(60));

    // Readiness and metrics reflect the work.
    let (code, body) = bridge.get("/health/ready").expect("api answers");
    assert_eq!(code, 200, "ready: {body}");
    let (_, metrics) = bridge.get("/metrics").unwrap();
    assert!(
        metrics.contains("eos_bridge_checkpoints_total{result=\"completed\"}"),
        "{metrics}"
    );

    let status = bridge.stop_gracefully(Duration::from_secs(30));
    assert!(
        status.success(),
        "graceful shutdown exits 0: {status}\n{}",
        bridge.log_text()
    );
    let txn_id = format!("eos-bridge-{}-0", home.spec.id);
    let state =
        transaction_state(b, &txn_id).expect("TransactionsCommand describes the bridge's id");
    assert!(
        state == "Empty" || state == "CompleteCommit" || state == "CompleteAbort",
        "no transaction of the bridge may be left open after SIGTERM, found state {state}"
    );

    let n = assert_exactly_once(b, &input, b, &output);
    assert_eq!(n, 4000);

    // A restart resumes where it stopped: new input only, nothing twice.
    let out = verifiable_produce(b, &input, 500, -1, Some(9));
    assert!(out.status.success());
    let total = end_offsets_total(b, &input);
    let mut bridge = home.start(&[]);
    bridge.wait_committed(total, Duration::from_secs(60));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    let n = assert_exactly_once(b, &input, b, &output);
    assert_eq!(n, 4500);
}

#[test]
fn partitions_added_while_running_are_read_from_their_beginning() {
    let _serial = serial();
    let b = bootstrap();
    let input = unique("grow-in");
    let output = unique("grow-out");
    create_topic(b, &input, 2);
    assert!(verifiable_produce(b, &input, 1000, -1, Some(1))
        .status
        .success());
    let home = BridgeHome::new(BridgeSpec::new(&input, &output));
    let mut bridge = home.start(&[]);
    bridge.wait_committed(1000, Duration::from_secs(60));

    let out = kafka_tool(
        "TopicCommand",
        &[
            "--bootstrap-server",
            b,
            "--alter",
            "--topic",
            &input,
            "--partitions",
            "4",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Keyed, so that records land on every partition (keyless ones stick to a few).
    let out = kafka_tool(
        "VerifiableProducer",
        &[
            "--bootstrap-server",
            b,
            "--topic",
            &input,
            "--max-messages",
            "2000",
        ],
    );
    assert!(out.status.success());
    let out = kafka_tool(
        "VerifiableProducer",
        &[
            "--bootstrap-server",
            b,
            "--topic",
            &input,
            "--max-messages",
            "2000",
            "--repeating-keys",
            "40",
            "--value-prefix",
            "3",
        ],
    );
    assert!(out.status.success());
    let by_part = by_partition(&console_consume(b, &input, true, Duration::from_secs(3)));
    assert!(
        by_part.get(&3).is_some_and(|v| !v.is_empty()),
        "the new partitions received records"
    );
    let total = end_offsets_total(b, &input);
    bridge.wait_committed(total, Duration::from_secs(90));
    assert!(bridge.stop_gracefully(Duration::from_secs(30)).success());
    assert_eq!(assert_exactly_once(b, &input, b, &output) as i64, total);
}
