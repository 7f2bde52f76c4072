//! Offset translation end to end on the two test clusters: a consumer group moved from the source
//! to the sink with `eos-bridge offsets translate --apply` reads, with Kafka's own console
//! consumer, exactly the records after the ones it had read: none again, none skipped, per
//! partition, across committed and aborted source transactions and compacted gaps. Also: what
//! translate does under `partitioning = "key"`, and the bridge's monitoring group as
//! kafka-consumer-groups shows it, also right after a graceful stop.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{Message, Offset, TopicPartitionList};

use common::bridge::*;
use common::*;

const PARTITIONS: i32 = 3;

fn transactional_producer(bootstrap: &str) -> ThreadedProducer<DefaultProducerContext> {
    let p: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("transactional.id", unique("offsets-src"))
        .set("transaction.timeout.ms", "30000")
        .create()
        .expect("producer");
    p.init_transactions(Duration::from_secs(30))
        .expect("init_transactions");
    p
}

/// One transaction of keyed records to one partition, committed or aborted.
fn transaction(
    p: &ThreadedProducer<DefaultProducerContext>,
    topic: &str,
    partition: i32,
    records: &[(String, String)],
    commit: bool,
) {
    p.begin_transaction().expect("begin");
    for (k, v) in records {
        p.send(
            BaseRecord::to(topic)
                .key(k.as_str())
                .payload(v.as_str())
                .partition(partition),
        )
        .map_err(|(e, _)| e)
        .expect("enqueue");
    }
    if commit {
        p.commit_transaction(Duration::from_secs(30))
            .expect("commit");
    } else {
        p.flush(Duration::from_secs(30)).expect("flush");
        p.abort_transaction(Duration::from_secs(30)).expect("abort");
    }
}

fn keyed(keys: &str, n: usize, value: &str) -> Vec<(String, String)> {
    (0..n)
        .map(|i| (format!("{keys}{i}"), format!("{value}-{i}")))
        .collect()
}

fn reader(bootstrap: &str, group: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .create()
        .expect("consumer")
}

/// The committed records of a partition, (offset, value), read_committed to the end.
fn records(bootstrap: &str, topic: &str, partition: i32) -> Vec<(i64, String)> {
    let c = reader(bootstrap, &unique("probe"));
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Beginning)
        .unwrap();
    c.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        match c.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => out.push((
                m.offset(),
                String::from_utf8_lossy(m.payload().unwrap_or_default()).to_string(),
            )),
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(_))) => return out,
            _ => {}
        }
    }
    panic!("reading {topic}/{partition} did not reach its end");
}

fn last_stable_offset(bootstrap: &str, topic: &str, partition: i32) -> i64 {
    reader(bootstrap, &unique("probe"))
        .fetch_watermarks(topic, partition, Duration::from_secs(10))
        .unwrap()
        .1
}

/// Kafka's console consumer in `group`, read_committed, printing partition and offset; with
/// `from_beginning` for a group without offsets, at most `max` records, one record per poll so
/// that what it commits on close is exactly what it printed.
fn console_group(
    bootstrap: &str,
    topic: &str,
    group: &str,
    from_beginning: bool,
    max: Option<usize>,
) -> Vec<Seen> {
    let mut args = console_read_args(topic, "read_committed", &PRINT_RECORD);
    args.extend(
        [
            "--group",
            group,
            "--timeout-ms",
            // It counts the group join too, which takes seconds on a busy machine; a read of at
            // most `max` records returns as soon as it has them.
            if max.is_some() { "20000" } else { "10000" },
            "--consumer-property",
            "max.poll.records=1",
        ]
        .map(String::from),
    );
    if from_beginning {
        args.push("--from-beginning".into());
    }
    if let Some(n) = max {
        args.push("--max-messages".into());
        args.push(n.to_string());
    }
    let out = console_command(bootstrap, &args)
        .output()
        .expect("console consumer runs");
    parse_console_lines(&String::from_utf8_lossy(&out.stdout))
}

fn translate(config: &Path, group: &str, apply: bool) -> Output {
    translate_from(config, group, apply, None)
}

fn translate_from(config: &Path, group: &str, apply: bool, offsets: Option<&Path>) -> Output {
    translate_command(config, group, apply, offsets)
        .output()
        .expect("runs")
}

fn translate_command(config: &Path, group: &str, apply: bool, offsets: Option<&Path>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_eos-bridge"));
    cmd.args([
        "offsets",
        "translate",
        "--config",
        config.to_str().unwrap(),
        "--group",
        group,
    ]);
    if apply {
        cmd.arg("--apply");
    }
    if let Some(f) = offsets {
        cmd.arg("--source-offsets").arg(f);
    }
    cmd.env("EOS_BRIDGE_LOG", "warn");
    cmd
}

/// (source partition, source offset, sink partition, sink offset) of each row translate printed.
fn table(out: &str) -> Vec<[String; 4]> {
    out.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() >= 5 && w[2] == "->")
        .map(|w| [w[0], w[1], w[3], w[4]].map(str::to_string))
        .collect()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn values(seen: &[Seen], partition: i32) -> Vec<String> {
    let mut v: Vec<&Seen> = seen.iter().filter(|s| s.partition == partition).collect();
    v.sort_by_key(|s| s.offset);
    v.into_iter().map(|s| s.value.clone()).collect()
}

/// Writes, per partition: a committed transaction (k0..k9), an aborted one, a committed one that
/// overwrites k0..k4 (compaction then removes offsets 0..4), and 10 more committed records.
/// Then ticks (a committed record every second, rolling the 100 ms segments) until the cleaner has
/// removed offset 0 of every partition. Returns the number of ticks written.
fn source_with_gaps(bootstrap: &str, topic: &str) -> usize {
    create_topic_with(
        bootstrap,
        topic,
        PARTITIONS as u32,
        &[
            "cleanup.policy=compact",
            "segment.ms=100",
            "min.cleanable.dirty.ratio=0.01",
            "min.compaction.lag.ms=0",
        ],
    );
    let p = transactional_producer(bootstrap);
    for part in 0..PARTITIONS {
        transaction(
            &p,
            topic,
            part,
            &keyed("k", 10, &format!("p{part}-a")),
            true,
        );
        transaction(
            &p,
            topic,
            part,
            &keyed("x", 5, &format!("p{part}-aborted")),
            false,
        );
        transaction(&p, topic, part, &keyed("k", 5, &format!("p{part}-b")), true);
        transaction(
            &p,
            topic,
            part,
            &keyed("u", 10, &format!("p{part}-c")),
            true,
        );
    }
    let mut ticks = 0;
    let mut last_tick: Option<Instant> = None;
    let compacted = wait_until(Duration::from_secs(60), || {
        if last_tick.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            for part in 0..PARTITIONS {
                let tick = vec![(format!("t{ticks}"), format!("p{part}-tick-{ticks}"))];
                transaction(&p, topic, part, &tick, true);
            }
            ticks += 1;
            last_tick = Some(Instant::now());
        }
        (0..PARTITIONS).all(|part| records(bootstrap, topic, part)[0].0 > 0)
    });
    assert!(
        compacted,
        "the log cleaner did not compact {topic} within 60 s"
    );
    ticks
}

/// What kafka-consumer-groups --describe prints for `group`.
fn describe_group(bootstrap: &str, group: &str) -> String {
    let out = kafka_tool(
        "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
        &[
            "--bootstrap-server",
            bootstrap,
            "--describe",
            "--group",
            group,
        ],
    );
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Whether a describe output shows every partition of `topic` with a committed offset and lag 0.
fn no_lag(describe: &str, topic: &str) -> bool {
    let rows: Vec<Vec<&str>> = describe
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() >= 6 && w[1] == topic)
        .collect();
    rows.len() == PARTITIONS as usize && rows.iter().all(|w| w[5] == "0")
}

#[test]
fn a_translated_group_resumes_on_the_sink_with_nothing_again_and_nothing_skipped() {
    let _serial = serial();
    let began = Instant::now();
    let src = bootstrap();
    let dst = second_bootstrap();
    let topic = unique("offsets-src");
    let sink_topic = format!("{topic}-copy");
    let ticks = source_with_gaps(src, &topic);
    let all: BTreeMap<i32, Vec<(i64, String)>> = (0..PARTITIONS)
        .map(|p| (p, records(src, &topic, p)))
        .collect();
    let total: usize = all.values().map(Vec::len).sum();
    eprintln!(
        "source: {total} committed records in {PARTITIONS} partitions, {ticks} ticks, first offsets {:?} \
         (compaction: {:.1} s)",
        all.values().map(|r| r[0].0).collect::<Vec<_>>(),
        began.elapsed().as_secs_f64()
    );

    // G1 reads part of the source with Kafka's console consumer, commits and stops.
    let g1 = unique("group-g1");
    let read = console_group(src, &topic, &g1, true, Some(total / 2));
    assert_eq!(read.len(), total / 2, "G1 read {read:?}");
    // G2 was positioned by hand at the awkward offsets: inside the compacted gap, on a transaction
    // marker followed by an aborted transaction, and at the very end (after a commit marker).
    let g2 = unique("group-g2");
    let marker = all[&1]
        .windows(2)
        .find(|w| w[1].0 > w[0].0 + 1)
        .map(|w| w[0].0 + 1)
        .expect("a transaction marker in partition 1");
    let g2_offsets = [(0, 2), (1, marker), (2, last_stable_offset(src, &topic, 2))];
    {
        let c = reader(src, &g2);
        let mut tpl = TopicPartitionList::new();
        for (p, o) in g2_offsets {
            tpl.add_partition_offset(&topic, p, Offset::Offset(o))
                .unwrap();
        }
        c.commit(&tpl, CommitMode::Sync).expect("commit G2");
    }

    let mut spec = BridgeSpec::new(&topic, &sink_topic);
    spec.sink_bootstrap = dst.to_string();
    let home = BridgeHome::new(spec.clone());
    let mut bridge = home.start(&[]);
    let bridged: i64 = all.values().map(|r| r.last().unwrap().0 + 1).sum();
    bridge.wait_committed(bridged, Duration::from_secs(60));
    let config = home.write_config("translate", 1);

    // While the bridge runs: translate, apply, and read on the sink.
    let mut shown_g2 = String::new();
    for (group, source_read) in [(&g1, Some(&read)), (&g2, None)] {
        let out = translate(&config, group, true);
        let shown = text(&out);
        if source_read.is_none() {
            shown_g2 = shown.clone();
        }
        eprintln!("$ eos-bridge offsets translate --group {group} --apply\n{shown}");
        assert!(out.status.success(), "translate {group} failed:\n{shown}");
        let resumed = console_group(dst, &sink_topic, group, false, None);
        for p in 0..PARTITIONS {
            let expected: Vec<String> = match source_read {
                Some(read) => {
                    let before = values(read, p);
                    assert_eq!(
                        before[..],
                        all[&p][..before.len()]
                            .iter()
                            .map(|r| r.1.clone())
                            .collect::<Vec<_>>()[..],
                        "G1 read partition {p} in order from its start"
                    );
                    all[&p][before.len()..]
                        .iter()
                        .map(|r| r.1.clone())
                        .collect()
                }
                None => {
                    let o = g2_offsets[p as usize].1;
                    all[&p]
                        .iter()
                        .filter(|r| r.0 >= o)
                        .map(|r| r.1.clone())
                        .collect()
                }
            };
            let got = values(&resumed, p);
            let last_source = source_read.and_then(|r| {
                r.iter()
                    .filter(|s| s.partition == p)
                    .max_by_key(|s| s.offset)
                    .map(|s| format!("{}@{}", s.value, s.offset))
            });
            let first_sink = resumed
                .iter()
                .filter(|s| s.partition == p)
                .min_by_key(|s| s.offset)
                .map(|s| format!("{}@{}", s.value, s.offset));
            eprintln!(
                "{group} partition {p}: last read on the source {last_source:?}, first read on the sink \
                 {first_sink:?}, {} read on the sink",
                got.len()
            );
            assert_eq!(
                got, expected,
                "{group} partition {p}: the sink must hold exactly the records after those read"
            );
        }
    }

    // Failover: the source cluster unreachable (a closed port), G2's offsets from the file
    // kafka-consumer-groups exports: the same translation, from the sink cluster alone.
    let csv = home.dir.path().join("g2.csv");
    let lines: Vec<String> = g2_offsets
        .iter()
        .map(|(p, o)| format!("{topic},{p},{o}"))
        .collect();
    std::fs::write(&csv, lines.join("\n")).unwrap();
    let mut gone = spec.clone();
    gone.source_bootstrap = "127.0.0.1:9".into();
    let gone_config = home.dir.path().join("source-gone.toml");
    std::fs::write(&gone_config, gone.toml(&home.state_dir(), 1)).unwrap();
    let out = translate_from(&gone_config, &g2, false, Some(&csv));
    let shown = text(&out);
    eprintln!("$ eos-bridge offsets translate --group {g2} --source-offsets g2.csv  (source gone)\n{shown}");
    assert!(out.status.success(), "{shown}");
    assert_eq!(table(&shown), table(&shown_g2));
    assert_eq!(table(&shown).len(), PARTITIONS as usize);

    // An open transaction on the mapping topic (here a foreign one; just as well the bridge's own
    // commit not yet written to the topic) hides every mapping record behind it: the translation
    // waits for it rather than answer "not yet bridged", and answers the same once it ends.
    let mapping_topic = format!("__eos_bridge_offsets.{}", spec.id);
    let foreign = transactional_producer(dst);
    foreign.begin_transaction().expect("begin");
    foreign
        .send(
            BaseRecord::<str, str>::to(&mapping_topic)
                .partition(0)
                .payload("not a mapping"),
        )
        .map_err(|(e, _)| e)
        .expect("enqueue");
    foreign.flush(Duration::from_secs(30)).expect("flush");
    let waiting_log = home.dir.path().join("translate-waiting.log");
    let mut waiting = translate_command(&gone_config, &g2, false, Some(&csv))
        .stdout(std::fs::File::create(home.dir.path().join("translate-waiting.out")).unwrap())
        .stderr(std::fs::File::create(&waiting_log).unwrap())
        .spawn()
        .expect("runs");
    let held = wait_until(Duration::from_secs(30), || {
        std::fs::read_to_string(&waiting_log)
            .is_ok_and(|l| l.contains("holds back the offset mapping topic"))
    });
    let still_running = waiting.try_wait().unwrap().is_none();
    foreign
        .abort_transaction(Duration::from_secs(30))
        .expect("abort");
    let ended = wait_until(Duration::from_secs(30), || {
        waiting.try_wait().unwrap().is_some()
    });
    let log = std::fs::read_to_string(&waiting_log).unwrap();
    if !ended {
        let _ = waiting.kill();
    }
    assert!(
        held && still_running,
        "translate did not wait for the open transaction:\n{log}"
    );
    assert!(
        ended,
        "translate did not end once the transaction was aborted:\n{log}"
    );
    assert!(waiting.wait().unwrap().success(), "{log}");
    let after = std::fs::read_to_string(home.dir.path().join("translate-waiting.out")).unwrap();
    assert_eq!(table(&after), table(&shown_g2), "{after}");

    // The bridge's monitoring group, as Kafka's tool shows it: every partition, no lag.
    let group = format!("eos-bridge.{}", spec.id);
    let mut describe = String::new();
    let caught_up = wait_until(Duration::from_secs(30), || {
        describe = describe_group(src, &group);
        no_lag(&describe, &topic)
    });
    eprintln!("$ kafka-consumer-groups --describe --group {group}\n{describe}");
    assert!(
        caught_up,
        "monitoring group shows lag or misses partitions:\n{describe}\nmetrics: ok {:?} failed {:?}\n{}",
        bridge.metric(r#"eos_bridge_monitor_group_commits_total{result="ok"}"#),
        bridge.metric(r#"eos_bridge_monitor_group_commits_total{result="failed"}"#),
        tail(&bridge.log_text(), 20)
    );
    assert!(
        bridge
            .metric(r#"eos_bridge_monitor_group_commits_total{result="ok"}"#)
            .unwrap_or(0.0)
            > 0.0
    );
    assert!(
        bridge
            .metric("eos_bridge_offset_mapping_runs_total")
            .unwrap_or(0.0)
            > 0.0
    );

    // Applying while the group has a member on the sink is refused.
    let mut member = Command::new(kafka_script())
        .args([
            "tool",
            "ConsoleConsumer",
            "--bootstrap-server",
            dst,
            "--topic",
            &sink_topic,
            "--group",
            &g1,
            "--timeout-ms",
            "30000",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut refusal = String::new();
    let refused = wait_until(Duration::from_secs(30), || {
        let out = translate(&config, &g1, true);
        refusal = text(&out);
        !out.status.success() && refusal.contains("active member")
    });
    let _ = member.kill();
    let _ = member.wait();
    assert!(refused, "apply with a live member on the sink:\n{refusal}");

    bridge.stop_gracefully(Duration::from_secs(30));
    eprintln!("total {:.1} s", began.elapsed().as_secs_f64());
}

#[test]
fn key_partitioning_is_refused_with_the_reason() {
    let mut spec = BridgeSpec::new("in", "out");
    spec.partitioning = "key";
    let dir = temp_state_dir();
    let config = dir.path().join("key.toml");
    std::fs::write(&config, spec.toml(&dir.path().join("state"), 1)).unwrap();
    let out = translate(&config, "g", true);
    let shown = text(&out);
    assert_eq!(out.status.code(), Some(1), "{shown}");
    assert!(shown.contains("no exact translation exists"), "{shown}");
    assert!(shown.contains("partitioning = \"key\""), "{shown}");
}

/// A graceful stop leaves the monitoring group at the bridge's final positions. The bridge commits
/// to it at most once a second; records bridged just before SIGTERM are in a commit that spacing
/// held back, which the stop must make, not drop with the process.
#[test]
fn a_graceful_stop_leaves_the_monitoring_group_at_the_final_positions() {
    let _serial = serial();
    let src = bootstrap();
    let topic = unique("monitor-src");
    create_topic(src, &topic, PARTITIONS as u32);
    let spec = BridgeSpec::new(&topic, &format!("{topic}-copy"));
    let home = BridgeHome::new(spec.clone());
    let mut bridge = home.start(&[]);
    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", src)
        .create()
        .expect("producer");
    // SIGTERM right after the second round is committed: the monitoring commit of its positions
    // is then due within the next second, so in most runs it is still held back by the spacing.
    let mut total = 0;
    for round in 0..2 {
        for i in 0..30 {
            send_to_partition(&producer, &topic, i % PARTITIONS, &format!("r{round}-{i}"));
        }
        producer.flush(Duration::from_secs(30)).expect("flush");
        total += 30;
        bridge.wait_committed(total, Duration::from_secs(60));
    }
    let status = bridge.stop_gracefully(Duration::from_secs(30));
    assert!(
        status.success(),
        "{status}\n{}",
        tail(&bridge.log_text(), 20)
    );

    let group = format!("eos-bridge.{}", spec.id);
    let describe = describe_group(src, &group);
    eprintln!("$ kafka-consumer-groups --describe --group {group}\n{describe}");
    assert!(
        no_lag(&describe, &topic),
        "after a graceful stop the monitoring group is behind the final positions:\n{describe}\n{}",
        tail(&bridge.log_text(), 20)
    );
}
