//! Test harness shared by the integration tests: a real Apache Kafka broker (through
//! scripts/kafka), random names, and Kafka's own Java tools as the independent reader.
//!
//! The broker comes from `EOS_BRIDGE_TEST_BOOTSTRAP` when set (CI starts one for the whole run);
//! otherwise the first test of a test binary starts one under a private name and the process's
//! exit stops it.
#![allow(dead_code)]

pub mod bridge;
pub mod scenario;
pub mod secure;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rand::Rng;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn kafka_script() -> PathBuf {
    repo_root().join("scripts/kafka")
}

/// Brokers this process started, stopped when the process exits.
static STARTED: Mutex<Vec<String>> = Mutex::new(Vec::new());

extern "C" fn stop_started_brokers() {
    let names = STARTED.lock().map(|v| v.clone()).unwrap_or_default();
    for name in names {
        let _ = Command::new(kafka_script())
            .args(["stop", "--name", &name, "--purge"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

pub fn register_stop(name: &str) {
    let mut started = STARTED.lock().unwrap();
    if started.is_empty() {
        // SAFETY: registering a plain extern "C" fn with no captured state.
        unsafe {
            libc::atexit(stop_started_brokers);
        }
    }
    started.push(name.to_string());
}

/// A broker started by this process under its own name; `stop`, `kill` and `restart` are for tests
/// that take the broker down on purpose.
pub struct Broker {
    pub name: String,
    pub bootstrap: String,
}

impl Broker {
    pub fn start_private(prefix: &str) -> Broker {
        let name = format!("{prefix}-{}", random_suffix());
        register_stop(&name);
        let bootstrap = run_kafka_script(&["start", "--name", &name, "--fresh"]);
        Broker { name, bootstrap }
    }

    pub fn kill9(&self) {
        run_kafka_script_quiet(&["kill", "--name", &self.name]);
    }

    pub fn restart(&self) {
        let b = run_kafka_script(&["start", "--name", &self.name]);
        assert_eq!(b, self.bootstrap, "a restarted broker keeps its address");
    }

    pub fn stop(&self) {
        run_kafka_script_quiet(&["stop", "--name", &self.name]);
    }

    /// Replaces the broker by a new, empty cluster (a new cluster id) on the same address: a
    /// cluster rebuilt behind an unchanged bootstrap address.
    pub fn rebuild(&self) {
        run_kafka_script_quiet(&["stop", "--name", &self.name, "--purge"]);
        let port = self
            .bootstrap
            .rsplit(':')
            .next()
            .expect("host:port")
            .to_string();
        let b = run_kafka_script(&["start", "--name", &self.name, "--port", &port, "--fresh"]);
        assert_eq!(b, self.bootstrap, "a rebuilt broker keeps its address");
    }
}

fn run_kafka_script_quiet(args: &[&str]) {
    let status = Command::new(kafka_script())
        .args(args)
        .status()
        .expect("scripts/kafka runs");
    assert!(status.success(), "scripts/kafka {args:?} failed");
}

fn run_kafka_script(args: &[&str]) -> String {
    let out = Command::new(kafka_script())
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/kafka runs");
    assert!(out.status.success(), "scripts/kafka {args:?} failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .expect("scripts/kafka prints the bootstrap address last")
        .trim()
        .to_string()
}

/// The shared broker of this test run.
pub fn bootstrap() -> &'static str {
    static BOOTSTRAP: OnceLock<String> = OnceLock::new();
    BOOTSTRAP.get_or_init(|| match std::env::var("EOS_BRIDGE_TEST_BOOTSTRAP") {
        Ok(b) if !b.is_empty() => b,
        _ => Broker::start_private("test").bootstrap,
    })
}

/// A second cluster for cross-cluster tests: `EOS_BRIDGE_TEST_BOOTSTRAP2` or one started here.
pub fn second_bootstrap() -> &'static str {
    static BOOTSTRAP2: OnceLock<String> = OnceLock::new();
    BOOTSTRAP2.get_or_init(|| match std::env::var("EOS_BRIDGE_TEST_BOOTSTRAP2") {
        Ok(b) if !b.is_empty() => b,
        _ => Broker::start_private("test2").bootstrap,
    })
}

pub fn random_suffix() -> String {
    let mut rng = rand::rng();
    (0..10)
        .map(|_| char::from(b'a' + rng.random_range(0..26u8)))
        .collect()
}

/// A topic or transactional id of its own for every test.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", random_suffix())
}

/// Runs a Kafka command-line class through scripts/kafka tool.
pub fn kafka_tool(class: &str, args: &[&str]) -> Output {
    let mut all = vec!["tool", class];
    all.extend_from_slice(args);
    Command::new(kafka_script())
        .args(&all)
        .output()
        .expect("scripts/kafka tool runs")
}

/// Runs Kafka's TopicCommand to create `topic` with topic configs such as
/// "max.message.bytes=65536"; the caller judges the outcome.
pub fn try_create_topic(bootstrap: &str, topic: &str, partitions: u32, configs: &[&str]) -> Output {
    let p = partitions.to_string();
    let mut args = vec![
        "--bootstrap-server",
        bootstrap,
        "--create",
        "--topic",
        topic,
        "--partitions",
        &p,
        "--replication-factor",
        "1",
    ];
    for c in configs {
        args.extend_from_slice(&["--config", c]);
    }
    kafka_tool("TopicCommand", &args)
}

pub fn create_topic_with(bootstrap: &str, topic: &str, partitions: u32, configs: &[&str]) {
    let out = try_create_topic(bootstrap, topic, partitions, configs);
    assert!(
        out.status.success(),
        "creating topic {topic} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn create_topic(bootstrap: &str, topic: &str, partitions: u32) {
    create_topic_with(bootstrap, topic, partitions, &[]);
}

/// `len` random letters and digits: lz4 leaves such text about as large as it is, so a test sees
/// every byte reach the sink (batch limits, quotas).
pub fn random_alnum(len: usize) -> String {
    use rand::RngCore;
    const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut bytes = vec![0u8; len];
    rand::rng().fill_bytes(&mut bytes);
    bytes
        .iter()
        .map(|b| ALNUM[usize::from(*b) % ALNUM.len()] as char)
        .collect()
}

/// Hands one record to `producer` for `topic`/`partition`, waiting out a full local queue.
pub fn send_to_partition(
    producer: &rdkafka::producer::ThreadedProducer<rdkafka::producer::DefaultProducerContext>,
    topic: &str,
    partition: i32,
    value: &str,
) {
    use rdkafka::error::KafkaError;
    use rdkafka::producer::BaseRecord;
    use rdkafka::types::RDKafkaErrorCode;
    let mut record = BaseRecord::<(), str>::to(topic)
        .payload(value)
        .partition(partition);
    loop {
        match producer.send(record) {
            Ok(()) => return,
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                record = back;
                producer.poll(Duration::from_millis(5));
            }
            Err((e, _)) => panic!("producing to {topic}/{partition}: {e}"),
        }
    }
}

/// One record as Kafka's console consumer printed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub partition: i32,
    pub offset: i64,
    pub key: String,
    pub value: String,
}

/// Reads a whole topic with Apache Kafka's console consumer until it has been idle for `idle`.
/// `read_committed` picks the isolation level.
pub fn console_consume(
    bootstrap: &str,
    topic: &str,
    read_committed: bool,
    idle: Duration,
) -> Vec<Seen> {
    let read = |idle| {
        let out = console_command(
            bootstrap,
            &console_args(topic, read_committed, idle, &PRINT_RECORD),
        )
        .output()
        .expect("scripts/kafka tool runs");
        // The console consumer exits non-zero when its idle timeout fires; its output is what
        // counts.
        parse_console_lines(&String::from_utf8_lossy(&out.stdout))
    };
    let records = read(idle);
    if !records.is_empty() {
        return records;
    }
    // The idle timeout also bounds the first fetch (group join, offsets): on a loaded machine an
    // empty read may only mean that took longer. A topic that is really empty reads empty again.
    read(idle * 3)
}

/// Who wrote a topic, for what may follow its last committed record once the writer has stopped:
/// a transactional writer's commit marker takes the offset after it, a plain writer leaves none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writer {
    Transactional,
    Plain,
}

/// Whether `records`, read from a topic whose writer has stopped, reach its end offsets `ends` in
/// every partition: nothing but the writer's commit marker follows the last record read. A
/// committed record that was not read needs its own offset and, transactional, a marker after it,
/// so it always leaves more than that.
pub fn read_to_the_end(records: &[Seen], ends: &BTreeMap<i32, i64>, writer: Writer) -> bool {
    let may_follow = match writer {
        Writer::Transactional => 1,
        Writer::Plain => 0,
    };
    ends.iter().all(|(partition, end)| {
        let next = records
            .iter()
            .filter(|r| r.partition == *partition)
            .map(|r| r.offset + 1)
            .max()
            .unwrap_or(0);
        end - next <= may_follow
    })
}

/// All of `topic` (whose writer has stopped) as Kafka's console consumer reads it with
/// read_committed. With `expect`, the number of records it should hold, the consumer stops as soon
/// as it has them instead of waiting out `idle`, and the read counts as whole only when it reached
/// the end offsets (`read_to_the_end`); otherwise it reads again until idle for `idle`, as
/// [`console_consume`] does (fewer records than `expect`: that read has been done). Either way a
/// duplicate or a missing record stays visible.
pub fn read_committed_whole(
    bootstrap: &str,
    topic: &str,
    expect: Option<usize>,
    writer: Writer,
    idle: Duration,
) -> Vec<Seen> {
    let Some(expect) = expect.filter(|n| *n > 0) else {
        return console_consume(bootstrap, topic, true, idle);
    };
    let ends = bridge::end_offsets(bootstrap, topic);
    let mut args = console_args(topic, true, idle, &PRINT_RECORD);
    args.extend(["--max-messages".to_string(), expect.to_string()]);
    let out = console_command(bootstrap, &args)
        .output()
        .expect("scripts/kafka tool runs");
    let records = parse_console_lines(&String::from_utf8_lossy(&out.stdout));
    let whole = match records.len() {
        0 => false,
        // Ended by the idle timeout: what a read without the count gives.
        n if n < expect => true,
        // More may follow: a duplicate the count cut off, or records of another run.
        _ => read_to_the_end(&records, &ends, writer),
    };
    if whole {
        return records;
    }
    console_consume(bootstrap, topic, true, idle)
}

/// The read_committed console consumer in the background, writing to `out` until it has read
/// `records` records or was idle for `idle` (whichever comes first).
pub fn spawn_console_consumer(
    bootstrap: &str,
    topic: &str,
    records: u64,
    idle: Duration,
    out: &Path,
) -> std::process::Child {
    let mut args = console_args(topic, true, idle, &PRINT_RECORD);
    args.extend(["--max-messages".to_string(), records.to_string()]);
    console_command(bootstrap, &args)
        .stdout(std::fs::File::create(out).expect("reader output file"))
        .stderr(Stdio::null())
        .spawn()
        .expect("console consumer starts")
}

/// What the console consumer prints of each record by default: `Partition:P|Offset:O|KEY|VALUE`.
pub const PRINT_RECORD: [&str; 4] = [
    "print.partition=true",
    "print.offset=true",
    "print.key=true",
    "key.separator=|",
];

/// Kafka's console consumer (through scripts/kafka) on `bootstrap`, with `args`.
pub fn console_command(bootstrap: &str, args: &[String]) -> Command {
    let mut cmd = Command::new(kafka_script());
    cmd.args(["tool", "ConsoleConsumer", "--bootstrap-server", bootstrap])
        .args(args);
    cmd
}

/// The console consumer's arguments to read `topic` with `isolation` ("read_committed"), printing
/// each record with formatter `properties`; the caller adds where to start and when to stop.
pub fn console_read_args(topic: &str, isolation: &str, properties: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "--topic".into(),
        topic.into(),
        "--isolation-level".into(),
        isolation.into(),
    ];
    for p in properties {
        args.extend(["--property".to_string(), p.to_string()]);
    }
    args
}

/// The console consumer's arguments to read all of `topic` until idle for `idle`.
fn console_args(
    topic: &str,
    read_committed: bool,
    idle: Duration,
    properties: &[&str],
) -> Vec<String> {
    let isolation = if read_committed {
        "read_committed"
    } else {
        "read_uncommitted"
    };
    let mut args = console_read_args(topic, isolation, properties);
    args.extend([
        "--from-beginning".to_string(),
        "--timeout-ms".to_string(),
        idle.as_millis().to_string(),
    ]);
    args
}

/// What Kafka's TopicCommand prints describing `topic`.
pub fn describe_topic(bootstrap: &str, topic: &str) -> String {
    let out = kafka_tool(
        "TopicCommand",
        &[
            "--bootstrap-server",
            bootstrap,
            "--describe",
            "--topic",
            topic,
        ],
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// An HTTP client for the bridge's API that returns error statuses as responses.
pub fn http_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

/// The record lines the read_committed console consumer prints with formatter `properties` (such
/// as "print.headers=true") until it has been idle for `idle`.
pub fn console_lines(
    bootstrap: &str,
    topic: &str,
    idle: Duration,
    properties: &[&str],
) -> Vec<String> {
    let out = console_command(bootstrap, &console_args(topic, true, idle, properties))
        .output()
        .expect("scripts/kafka tool runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("Partition:"))
        .map(str::to_string)
        .collect()
}

/// Parses `Partition:P|Offset:O|KEY|VALUE` lines (the formatter's separator is `|`).
pub fn parse_console_lines(text: &str) -> Vec<Seen> {
    text.lines()
        .filter(|l| l.starts_with("Partition:"))
        .map(|l| {
            let mut parts = l.splitn(4, '|');
            let p = parts.next().unwrap().trim_start_matches("Partition:");
            let o = parts.next().unwrap().trim_start_matches("Offset:");
            let key = parts.next().unwrap_or("").to_string();
            let value = parts.next().unwrap_or("").to_string();
            Seen {
                partition: p.parse().expect("partition number"),
                offset: o.parse().expect("offset number"),
                key,
                value,
            }
        })
        .collect()
}

/// Values per partition, in offset order.
pub fn by_partition(records: &[Seen]) -> BTreeMap<i32, Vec<String>> {
    let mut sorted = records.to_vec();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut map: BTreeMap<i32, Vec<String>> = BTreeMap::new();
    for r in sorted {
        map.entry(r.partition).or_default().push(r.value);
    }
    map
}

/// Produces `count` sequenced records (values "0".."count-1", or with a prefix) with Kafka's
/// VerifiableProducer, at most `throughput` records/s (-1: unthrottled).
pub fn verifiable_produce(
    bootstrap: &str,
    topic: &str,
    count: u64,
    throughput: i64,
    prefix: Option<u32>,
) -> Output {
    let c = count.to_string();
    let t = throughput.to_string();
    let mut args = vec![
        "--bootstrap-server",
        bootstrap,
        "--topic",
        topic,
        "--max-messages",
        &c,
        "--throughput",
        &t,
        "--acks",
        "-1",
    ];
    let p;
    if let Some(prefix) = prefix {
        p = prefix.to_string();
        args.extend_from_slice(&["--value-prefix", &p]);
    }
    kafka_tool("VerifiableProducer", &args)
}

/// Kafka's VerifiableProducer in the background: `count` sequenced records ("PREFIX.N") at `rate`
/// records/s, for tests where input keeps arriving while something else happens.
pub fn background_producer(
    bootstrap: &str,
    topic: &str,
    count: u64,
    rate: u64,
    prefix: u32,
) -> std::process::Child {
    Command::new(kafka_script())
        .args([
            "tool",
            "VerifiableProducer",
            "--bootstrap-server",
            bootstrap,
            "--topic",
            topic,
        ])
        .args([
            "--max-messages",
            &count.to_string(),
            "--throughput",
            &rate.to_string(),
        ])
        .args(["--acks", "-1", "--value-prefix", &prefix.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("VerifiableProducer starts")
}

/// Stops a background producer the way an operator would (SIGTERM: the JVM's shutdown hook
/// closes the producer, so every record it sent is acknowledged first) and waits for it, so that
/// the input's end offsets are final. Panics if it had failed on its own before.
pub fn stop_producer(mut producer: std::process::Child) {
    use std::os::unix::process::ExitStatusExt;
    if let Ok(None) = producer.try_wait() {
        // SAFETY: signalling a child we own.
        unsafe {
            libc::kill(producer.id() as i32, libc::SIGTERM);
        }
    }
    let exited = wait_until(Duration::from_secs(30), || {
        matches!(producer.try_wait(), Ok(Some(_)))
    });
    if !exited {
        let _ = producer.kill();
    }
    let status = producer.wait().expect("waiting for the input producer");
    // 143: the JVM's exit after SIGTERM ran its shutdown hooks.
    assert!(
        exited
            && (status.success()
                || status.code() == Some(143)
                || status.signal() == Some(libc::SIGTERM)),
        "the input producer failed or did not stop within 30 s of SIGTERM: {status}"
    );
}

/// The state of a transactional id as Kafka's TransactionsCommand describes it (Empty, Ongoing,
/// CompleteCommit, CompleteAbort, ...), None if it cannot be described.
pub fn transaction_state(bootstrap: &str, transactional_id: &str) -> Option<String> {
    let out = kafka_tool(
        "TransactionsCommand",
        &[
            "--bootstrap-server",
            bootstrap,
            "describe",
            "--transactional-id",
            transactional_id,
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines.next()?.split_whitespace().collect();
    let row: Vec<&str> = lines.next()?.split_whitespace().collect();
    let idx = header.iter().position(|h| *h == "TransactionState")?;
    row.get(idx).map(|s| s.to_string())
}

/// Polls `cond` until it holds or `deadline` passes; returns whether it held.
pub fn wait_until(deadline: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn temp_state_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("eos-bridge-test-")
        .tempdir()
        .expect("temp dir")
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Heavy tests take this lock so that they do not share the two cores with each other.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The exactly-once verdict, by Kafka's own console consumer with read_committed on both sides:
/// for every source partition, the sink partition of the same number holds exactly the source's
/// values in the source's order (none missing, none twice, order kept). `sink_writer`: how the
/// sink topic was written (the exactly-once bridge: transactional). Returns the record count.
pub fn assert_exactly_once(
    source_bootstrap: &str,
    source_topic: &str,
    sink_bootstrap: &str,
    sink_topic: &str,
    sink_writer: Writer,
) -> usize {
    // The first read stops once it has as many records as the source's end offsets count (a
    // source written without transactions) and both reads reached their topics' ends.
    let expect = usize::try_from(bridge::end_offsets_total(source_bootstrap, source_topic)).ok();
    let (source, sink_records) = std::thread::scope(|scope| {
        let source = scope.spawn(|| {
            read_committed_whole(
                source_bootstrap,
                source_topic,
                expect,
                Writer::Plain,
                Duration::from_secs(4),
            )
        });
        let sink = read_committed_whole(
            sink_bootstrap,
            sink_topic,
            expect,
            sink_writer,
            Duration::from_secs(4),
        );
        (source.join().expect("the source read"), sink)
    });
    let (mut source, mut sink_records) = (by_partition(&source), sink_records);
    if source.is_empty() || !sequence_problems(&source, &by_partition(&sink_records)).is_empty() {
        // A read ends when the consumer has been idle for a while, and on a loaded machine that
        // can happen before it fetched every partition. The bridge has stopped, so the topics no
        // longer change: a second, more patient read cannot hide a duplicate or a loss.
        let (s, k) = read_committed_both(
            (source_bootstrap, source_topic),
            (sink_bootstrap, sink_topic),
            Duration::from_secs(12),
        );
        (source, sink_records) = (by_partition(&s), k);
    }
    assert_same_sequences(&source, &by_partition(&sink_records));
    sink_records.len()
}

/// Two topics (bootstrap, topic) read by [`console_consume`] with read_committed at once: each
/// read is mostly a JVM start and an idle wait. For topics that no longer change (the bridge has
/// stopped), so that the two reads see what one after the other would.
pub fn read_committed_both(
    first: (&str, &str),
    second: (&str, &str),
    idle: Duration,
) -> (Vec<Seen>, Vec<Seen>) {
    std::thread::scope(|scope| {
        let a = scope.spawn(|| console_consume(first.0, first.1, true, idle));
        let b = console_consume(second.0, second.1, true, idle);
        (a.join().expect("the first read"), b)
    })
}

/// Compares per-partition sequences and fails with a summary a person can act on.
pub fn assert_same_sequences(
    source: &BTreeMap<i32, Vec<String>>,
    sink: &BTreeMap<i32, Vec<String>>,
) {
    let problems = sequence_problems(source, sink);
    assert!(
        problems.is_empty(),
        "not exactly once:\n{}",
        problems.join("\n")
    );
    assert!(
        !source.is_empty(),
        "the source is empty: the test proves nothing"
    );
}

/// What differs between the source's and the sink's per-partition sequences, one line a partition.
fn sequence_problems(
    source: &BTreeMap<i32, Vec<String>>,
    sink: &BTreeMap<i32, Vec<String>>,
) -> Vec<String> {
    let mut problems = Vec::new();
    for (p, want) in source {
        let got = sink.get(p).cloned().unwrap_or_default();
        if &got == want {
            continue;
        }
        let mut counts: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
        for v in want {
            *counts.entry(v.as_str()).or_default() += 1;
        }
        for v in &got {
            *counts.entry(v.as_str()).or_default() -= 1;
        }
        let missing = counts.values().filter(|c| **c > 0).count();
        let extra: i64 = counts.values().filter(|c| **c < 0).map(|c| -c).sum();
        problems.push(format!(
            "partition {p}: source {} records, sink {}, missing {missing}, duplicated/foreign {extra}, order {}",
            want.len(),
            got.len(),
            if missing == 0 && extra == 0 { "differs" } else { "n/a" }
        ));
    }
    for p in sink.keys() {
        if !source.contains_key(p) {
            problems.push(format!(
                "sink partition {p} has records but the source partition has none"
            ));
        }
    }
    problems
}
