//! Benchmark phase C1: the minimal at-least-once copy that eos-bridge is measured against.
//!
//! One thread, the same shape as the bridge's pipeline: a `BaseConsumer` assigned every partition
//! of the input topic with the bridge's source defaults (read_committed, a 4 MiB / 20,000-record
//! prefetch), read up to 1,000 records per call as the bridge reads (`--batch`), and a
//! `ThreadedProducer` with the bridge's sink defaults (linger.ms=1, a 20,000-record queue,
//! batch.size=1000000, lz4, idempotence). Each record keeps its
//! partition, key, headers and timestamp. Every `--commit-ms` it waits until every record sent is
//! acknowledged, then commits the consumed positions to a consumer group: at-least-once, no
//! transactions.
//!
//! Output on stdout (read by bench/run):
//!   READY <epoch ms>                 partitions assigned, about to poll
//!   P <epoch ms> <acked records>     every --progress-ms: records acknowledged by the broker
//!   DONE <epoch ms> <acked records>  with --until-end: every record present at start copied and acked
//!
//! cargo run --release --example raw_copy -- --bootstrap 127.0.0.1:9092 --input in --output out --until-end

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{Producer, ThreadedProducer};
use rdkafka::{Offset, TopicPartitionList};

use common::{
    assign_all_from_start, bridge_consumer, bridge_producer, copy_of, now_ms, send_waiting,
    wait_acked, BatchReader, CopyTopics, Deliveries,
};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    copy: CopyTopics,
    #[arg(long, default_value = "bench-raw-copy")]
    group: String,
    /// Flush the producer and commit positions this often.
    #[arg(long, default_value_t = 1000)]
    commit_ms: u64,
    #[arg(long, default_value_t = 50)]
    progress_ms: u64,
    /// Stop once every record present at start has been copied and acknowledged.
    #[arg(long)]
    until_end: bool,
    /// Records read per call of librdkafka's rd_kafka_consume_batch_queue, as the bridge reads
    /// since session 38; 0 reads with rdkafka's per-record poll, as both did before (bench/README.md,
    /// "Session 38"). Consumer errors are printed either way.
    #[arg(long, default_value_t = 1000)]
    batch: usize,
}

fn main() {
    let a = Args::parse();
    let consumer: BaseConsumer = bridge_consumer(&a.copy.bootstrap, &a.group)
        .create()
        .expect("consumer");
    let producer: ThreadedProducer<Deliveries> = bridge_producer(&a.copy.bootstrap)
        .create_with_context(Deliveries::default())
        .expect("producer");
    let ctx: Arc<Deliveries> = producer.context().clone();

    let ends = assign_all_from_start(&consumer, &a.copy.input);
    let total: i64 = ends.values().sum();
    let mut next: HashMap<i32, i64> = ends.keys().map(|&p| (p, 0)).collect();
    let mut copied: i64 = 0;
    let mut reader = (a.batch > 0).then(|| BatchReader::new(&consumer, a.batch));

    let out = std::io::stdout();
    println!("READY {}", now_ms());
    out.lock().flush().ok();

    let progress_every = Duration::from_millis(a.progress_ms);
    let commit_every = Duration::from_millis(a.commit_ms);
    let mut last_progress = Instant::now();
    let mut last_commit = Instant::now();
    let commit = |next: &HashMap<i32, i64>, mode| {
        let mut t = TopicPartitionList::new();
        for (&p, &o) in next {
            if o > 0 {
                t.add_partition_offset(&a.copy.input, p, Offset::Offset(o))
                    .unwrap();
            }
        }
        if t.count() > 0 {
            let _ = consumer.commit(&t, mode);
        }
    };
    loop {
        if a.until_end && copied >= total {
            wait_acked(&producer);
            commit(&next, CommitMode::Sync);
            let acked = ctx.acked.load(Ordering::Relaxed);
            println!("P {} {}", now_ms(), acked);
            println!("DONE {} {}", now_ms(), acked);
            let failed = ctx.failed.load(Ordering::Relaxed);
            if failed > 0 {
                eprintln!("raw_copy: {failed} deliveries failed");
                std::process::exit(1);
            }
            return;
        }
        if last_progress.elapsed() >= progress_every {
            println!("P {} {}", now_ms(), ctx.acked.load(Ordering::Relaxed));
            out.lock().flush().ok();
            last_progress = Instant::now();
        }
        if last_commit.elapsed() >= commit_every {
            // At-least-once: positions are committed only after everything before them is acked.
            wait_acked(&producer);
            commit(&next, CommitMode::Async);
            last_commit = Instant::now();
        }
        if let Some(reader) = reader.as_mut() {
            reader.copy_each(
                Duration::from_millis(50),
                &a.copy.output,
                true,
                |p, offset, rec| {
                    send_waiting(&producer, rec, Duration::from_millis(1));
                    next.insert(p, offset + 1);
                    if a.until_end && offset < ends[&p] {
                        copied += 1;
                    }
                },
            );
            continue;
        }
        let msg = match consumer.poll(Duration::from_millis(50)) {
            None => continue,
            Some(Err(e)) => {
                eprintln!("raw_copy: consumer error: {e}");
                continue;
            }
            Some(Ok(m)) => m,
        };
        let p = msg.partition();
        let headers = msg.headers().map(|h| h.detach());
        let mut rec = copy_of(&msg, &a.copy.output);
        if let Some(h) = headers {
            rec = rec.headers(h);
        }
        send_waiting(&producer, rec, Duration::from_millis(1));
        next.insert(p, msg.offset() + 1);
        if a.until_end && msg.offset() < ends[&p] {
            copied += 1;
        }
    }
}
