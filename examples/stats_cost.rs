//! Benchmark probe: what decoding librdkafka's statistics costs the thread that receives them. The
//! sink producer's statistics arrive on the thread that also serves its delivery reports, which a
//! checkpoint's flush waits for, so the decode is a pause in those reports every window
//! (docs/design.md, "The checkpoint protocol"). librdkafka writes an object per topic partition
//! (about 1 KB each); rdkafka's default decodes all of it into `Statistics`, while the bridge
//! decodes only the brokers and skips the rest (src/sink.rs, `BrokerStatistics`).
//!
//! The JSON is rdkafka's own `Statistics` serialized, with every field librdkafka writes, for
//! one topic of --partitions partitions spread over --brokers brokers. It prints one JSON line: the
//! JSON's bytes and the median microseconds per decode, full and brokers only.
//!
//! cargo run --release --example stats_cost -- --partitions 1000

use std::collections::HashMap;
use std::time::Instant;

use clap::Parser;
use rdkafka::statistics::{Broker, Partition, Statistics, Topic, TopicPartition, Window};
use serde::de::IgnoredAny;

#[derive(Parser)]
struct Args {
    /// Partitions of the one topic written.
    #[arg(long, default_value_t = 1000)]
    partitions: i32,
    #[arg(long, default_value_t = 3)]
    brokers: i32,
    /// Decodes of each kind; the median is printed.
    #[arg(long, default_value_t = 51)]
    rounds: usize,
}

/// The shape of the bridge's decode: the brokers' objects kept (here undecoded), the rest skipped.
#[derive(serde::Deserialize)]
struct BrokersOnly {
    #[allow(dead_code)]
    brokers: HashMap<String, IgnoredAny>,
}

fn statistics(partitions: i32, brokers: i32) -> Statistics {
    let window = Window {
        cnt: 100,
        ..Window::default()
    };
    let partition_map = (0..partitions)
        .map(|p| {
            (
                p,
                Partition {
                    partition: p,
                    broker: p % brokers,
                    ..Partition::default()
                },
            )
        })
        .collect();
    let broker_map = (0..brokers)
        .map(|b| {
            let toppars = (0..partitions)
                .filter(|p| p % brokers == b)
                .map(|p| {
                    (
                        format!("out-{p}"),
                        TopicPartition {
                            topic: "out".into(),
                            partition: p,
                        },
                    )
                })
                .collect();
            (
                format!("b{b}:9092/{b}"),
                Broker {
                    name: format!("b{b}:9092/{b}"),
                    nodeid: b,
                    rtt: Some(window.clone()),
                    int_latency: Some(window.clone()),
                    outbuf_latency: Some(window.clone()),
                    throttle: Some(window.clone()),
                    toppars,
                    ..Broker::default()
                },
            )
        })
        .collect();
    Statistics {
        name: "rdkafka#producer-1".into(),
        client_type: "producer".into(),
        brokers: broker_map,
        topics: HashMap::from([(
            "out".to_string(),
            Topic {
                topic: "out".into(),
                batchsize: window.clone(),
                batchcnt: window,
                partitions: partition_map,
                ..Topic::default()
            },
        )]),
        ..Statistics::default()
    }
}

/// The median microseconds of `rounds` runs of `decode`.
fn median_us(rounds: usize, mut decode: impl FnMut()) -> f64 {
    let mut us: Vec<f64> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            decode();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    us.sort_by(f64::total_cmp);
    us[us.len() / 2]
}

fn main() {
    let args = Args::parse();
    let brokers_written = args.brokers.max(1);
    let json = serde_json::to_vec(&statistics(args.partitions, brokers_written)).unwrap();
    let full = median_us(args.rounds, || {
        let s: Statistics = serde_json::from_slice(&json).unwrap();
        assert_eq!(s.topics["out"].partitions.len(), args.partitions as usize);
    });
    let brokers = median_us(args.rounds, || {
        let s: BrokersOnly = serde_json::from_slice(&json).unwrap();
        assert_eq!(s.brokers.len(), brokers_written as usize);
    });
    println!(
        "{}",
        serde_json::json!({
            "partitions": args.partitions,
            "brokers": args.brokers,
            "json_bytes": json.len(),
            "full_decode_us": full,
            "brokers_only_decode_us": brokers,
        })
    );
}
