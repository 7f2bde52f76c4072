//! The bridge end to end on a real broker: sequenced input from Kafka's VerifiableProducer,
//! output judged by Kafka's console consumer with read_committed, a graceful shutdown that leaves
//! no transaction open (asked of Kafka's TransactionsCommand), and a clean restart.

mod common;

use std::time::Duration;

use common::scenario::*;
use common::*;

#[test]
fn bridges_exactly_once_and_shuts_down_with_no_open_transaction() {
    let _serial = serial();
    let mut s = Scenario::new("basic", 3);
    let out = verifiable_produce(&s.source, &s.input, 3000, -1, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(s.input_total(), 3000);
    s.run(&[Start, Committed]);

    // More input while it runs.
    s.run(&[Produce(1000, 7), Committed]);

    // Readiness and metrics reflect the work.
    let bridge = s.bridge();
    let (code, body) = bridge.get("/health/ready").expect("api answers");
    assert_eq!(code, 200, "ready: {body}");
    let (_, metrics) = bridge.get("/metrics").unwrap();
    assert!(
        metrics.contains("eos_bridge_checkpoints_total{result=\"completed\"}"),
        "{metrics}"
    );

    s.stop();
    let state = transaction_state(&s.sink, &s.transactional_id())
        .expect("TransactionsCommand describes the bridge's id");
    assert!(
        state == "Empty" || state == "CompleteCommit" || state == "CompleteAbort",
        "no transaction of the bridge may be left open after SIGTERM, found state {state}"
    );
    assert_eq!(s.judge(), 4000);

    // A restart resumes where it stopped: new input only, nothing twice.
    s.run(&[Produce(500, 9), Start, Committed, Stop]);
    assert_eq!(s.judge(), 4500);
}

#[test]
fn partitions_added_while_running_are_read_from_their_beginning() {
    let _serial = serial();
    let mut s = Scenario::new("grow", 2);
    s.run(&[Produce(1000, 1), Start, CommittedTo(1000)]);
    let (b, input) = (s.source.clone(), s.input.clone());

    let out = kafka_tool(
        "TopicCommand",
        &[
            "--bootstrap-server",
            &b,
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
    let produce = |extra: &[&str]| {
        let mut args = vec!["--bootstrap-server", &b, "--topic", &input];
        args.extend_from_slice(&["--max-messages", "2000"]);
        args.extend_from_slice(extra);
        assert!(kafka_tool("VerifiableProducer", &args).status.success());
    };
    produce(&[]);
    // Keyed, so that records land on every partition (keyless ones stick to a few).
    produce(&["--repeating-keys", "40", "--value-prefix", "3"]);
    let by_part = by_partition(&console_consume(&b, &input, true, Duration::from_secs(3)));
    assert!(
        by_part.get(&3).is_some_and(|v| !v.is_empty()),
        "the new partitions received records"
    );
    s.run(&[CommittedWithin(90), Stop, Judge]);
}
