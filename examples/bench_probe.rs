//! Small Kafka utilities for bench/run, in Rust so that they cost little CPU next to what is
//! measured (a Kafka CLI tool is a fresh JVM, about two CPU-seconds each):
//!
//!   bench_probe create  --bootstrap B --partitions N TOPIC...   create topics (replication 1)
//!   bench_probe delete  --bootstrap B TOPIC...                 delete topics
//!   bench_probe end     --bootstrap B TOPIC                    print the sum of the end offsets
//!   bench_probe count   --bootstrap B TOPIC                    count records a read_committed
//!                                                              consumer sees, print the count
//!   bench_probe fill    --bootstrap B --records N --size S TOPIC
//!        prefill: N records of S random capital letters (as ProducerPerformance writes them),
//!        no key, round-robin over the partitions, the bridge's producer settings; a JVM-free
//!        stand-in for ProducerPerformance where no C0 sample is taken
//!   bench_probe group   --bootstrap B --group G --target N TOPIC
//!        poll G's committed offsets on TOPIC every --interval-ms; print "P <epoch ms> <sum>" on
//!        each change; exit 0 once the sum reaches N (or 1 after --timeout-s)

mod common;

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{Offset, TopicPartitionList};

use common::{bridge_producer, letters, now_ms, read_committed_consumer, send_waiting};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Create {
        #[arg(long)]
        bootstrap: String,
        #[arg(long)]
        partitions: i32,
        topics: Vec<String>,
    },
    Delete {
        #[arg(long)]
        bootstrap: String,
        topics: Vec<String>,
    },
    End {
        #[arg(long)]
        bootstrap: String,
        topic: String,
    },
    Count {
        #[arg(long)]
        bootstrap: String,
        topic: String,
    },
    Fill {
        #[arg(long)]
        bootstrap: String,
        #[arg(long)]
        records: u64,
        #[arg(long)]
        size: usize,
        topic: String,
    },
    Group {
        #[arg(long)]
        bootstrap: String,
        #[arg(long)]
        group: String,
        #[arg(long)]
        target: i64,
        #[arg(long, default_value_t = 50)]
        interval_ms: u64,
        #[arg(long, default_value_t = 600)]
        timeout_s: u64,
        topic: String,
    },
}

fn consumer(bootstrap: &str, group: &str) -> BaseConsumer {
    read_committed_consumer(bootstrap, group)
        .set("enable.partition.eof", "true")
        .create()
        .expect("consumer")
}

fn partitions(c: &BaseConsumer, topic: &str) -> Vec<i32> {
    common::partitions(c.client(), topic)
}

fn admin(bootstrap: &str) -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin")
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    match Args::parse().cmd {
        Cmd::Create {
            bootstrap,
            partitions,
            topics,
        } => {
            let news: Vec<NewTopic> = topics
                .iter()
                .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(1)))
                .collect();
            let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
            let res = rt
                .block_on(admin(&bootstrap).create_topics(&news, &opts))
                .expect("create topics");
            for r in res {
                if let Err((t, e)) = r {
                    eprintln!("create {t}: {e}");
                    std::process::exit(1);
                }
            }
            // Wait until metadata shows every partition with a leader.
            let c = consumer(&bootstrap, "bench-probe");
            for t in &topics {
                let end = Instant::now() + Duration::from_secs(30);
                loop {
                    let ok = c
                        .fetch_metadata(Some(t), Duration::from_secs(5))
                        .map(|md| {
                            let tp = &md.topics()[0];
                            tp.error().is_none()
                                && tp.partitions().len() == partitions as usize
                                && tp.partitions().iter().all(|p| p.leader() >= 0)
                        })
                        .unwrap_or(false);
                    if ok {
                        break;
                    }
                    assert!(Instant::now() < end, "topic {t} not ready");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        Cmd::Delete { bootstrap, topics } => {
            let names: Vec<&str> = topics.iter().map(|s| s.as_str()).collect();
            let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
            let _ = rt.block_on(admin(&bootstrap).delete_topics(&names, &opts));
        }
        Cmd::End { bootstrap, topic } => {
            let c = consumer(&bootstrap, "bench-probe");
            let mut sum = 0i64;
            for p in partitions(&c, &topic) {
                let (_, hi) = c
                    .fetch_watermarks(&topic, p, Duration::from_secs(10))
                    .expect("watermarks");
                sum += hi;
            }
            println!("{sum}");
        }
        Cmd::Count { bootstrap, topic } => {
            let c = consumer(&bootstrap, "bench-probe-count");
            let parts = partitions(&c, &topic);
            let mut tpl = TopicPartitionList::new();
            for &p in &parts {
                tpl.add_partition_offset(&topic, p, Offset::Beginning)
                    .unwrap();
            }
            c.assign(&tpl).expect("assign");
            let mut at_eof = std::collections::HashSet::new();
            let mut n = 0u64;
            let end = Instant::now() + Duration::from_secs(300);
            while at_eof.len() < parts.len() && Instant::now() < end {
                match c.poll(Duration::from_millis(200)) {
                    None => {}
                    Some(Ok(_)) => n += 1,
                    Some(Err(KafkaError::PartitionEOF(p))) => {
                        at_eof.insert(p);
                    }
                    Some(Err(e)) => eprintln!("count: {e}"),
                }
            }
            println!("{n}");
        }
        Cmd::Fill {
            bootstrap,
            records,
            size,
            topic,
        } => {
            let producer: ThreadedProducer<DefaultProducerContext> =
                bridge_producer(&bootstrap).create().expect("producer");
            let c = consumer(&bootstrap, "bench-probe");
            let parts = partitions(&c, &topic).len() as u64;
            let letters = letters(0x2545_f491_4f6c_dd1d, (1 << 20) + size);
            for i in 0..records {
                let off = ((i.wrapping_mul(0x9e37_79b9)) % (1 << 20)) as usize;
                let rec: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(&topic)
                    .partition((i % parts) as i32)
                    .payload(&letters[off..off + size]);
                send_waiting(&producer, rec, Duration::from_millis(1));
            }
            producer.flush(Duration::from_secs(120)).expect("flush");
        }
        Cmd::Group {
            bootstrap,
            group,
            target,
            interval_ms,
            timeout_s,
            topic,
        } => {
            let c = consumer(&bootstrap, &group);
            let parts = partitions(&c, &topic);
            let mut tpl = TopicPartitionList::new();
            for &p in &parts {
                tpl.add_partition(&topic, p);
            }
            let end = Instant::now() + Duration::from_secs(timeout_s);
            let mut last = -1i64;
            while Instant::now() < end {
                if let Ok(got) = c.committed_offsets(tpl.clone(), Duration::from_secs(5)) {
                    let sum: i64 = got
                        .elements()
                        .iter()
                        .map(|e| match e.offset() {
                            Offset::Offset(o) => o,
                            _ => 0,
                        })
                        .sum();
                    if sum != last {
                        println!("P {} {}", now_ms(), sum);
                        last = sum;
                    }
                    if sum >= target {
                        return;
                    }
                }
                std::thread::sleep(Duration::from_millis(interval_ms));
            }
            std::process::exit(1);
        }
    }
}
