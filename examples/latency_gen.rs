//! Benchmark load generator for the latency phases: open loop. Record i is *scheduled* at
//! t0 + i/rate and carries that scheduled time (microseconds since the Unix epoch, 8 bytes little
//! endian) at the start of its value; the rest of the value is filler up to --size bytes. A
//! generator that falls behind still stamps the scheduled time, so its own delays count as
//! latency (no coordinated omission). Records go round-robin over the topic's partitions.
//!
//! Prints one JSON line at the end: {"sent":…, "rate":…, "max_behind_ms":…, "failed":…}.
//!
//! cargo run --release --example latency_gen -- --bootstrap 127.0.0.1:9092 --topic in --rate 50000 --size 100 --seconds 20

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};

use common::{letters, now_us, partitions, send_waiting, Deliveries, Target};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    target: Target,
    /// Records per second.
    #[arg(long)]
    rate: f64,
    /// Value size in bytes (at least 8).
    #[arg(long, default_value_t = 100)]
    size: usize,
    #[arg(long)]
    seconds: f64,
    /// Start at this Unix time in microseconds (default: now), so the reader knows the schedule.
    #[arg(long)]
    start_us: Option<u64>,
}

fn main() {
    let a = Args::parse();
    assert!(a.size >= 8 && a.rate > 0.0);
    let topic = &a.target.topic;
    let producer: ThreadedProducer<Deliveries> = ClientConfig::new()
        .set("bootstrap.servers", &a.target.bootstrap)
        .set("linger.ms", "1")
        .set("enable.idempotence", "true")
        .create_with_context(Deliveries::default())
        .expect("producer");
    let parts = partitions(producer.client(), topic).len() as i32;
    assert!(parts > 0, "topic {topic} has no partitions");

    // Filler taken at a varying offset so records differ.
    let filler = letters(0x9e37_79b9_7f4a_7c15, 65_536 + a.size);
    let mut value = vec![0u8; a.size];

    let start_us = a.start_us.unwrap_or_else(now_us);
    while now_us() < start_us {
        std::thread::sleep(Duration::from_micros((start_us - now_us()).min(100_000)));
    }
    // The schedule runs on the monotonic clock from here; stamps are start_us + i/rate.
    let t0 = Instant::now();
    let total = (a.rate * a.seconds) as u64;
    let step_us = 1e6 / a.rate;
    let mut i: u64 = 0;
    let mut max_behind = Duration::ZERO;
    while i < total {
        let elapsed = t0.elapsed();
        let due = ((elapsed.as_secs_f64() * a.rate) as u64 + 1).min(total);
        if due > i + 1 {
            let behind = elapsed.saturating_sub(Duration::from_micros((i as f64 * step_us) as u64));
            max_behind = max_behind.max(behind);
        }
        while i < due {
            let stamp = start_us + (i as f64 * step_us) as u64;
            value[..8].copy_from_slice(&stamp.to_le_bytes());
            let off = (i as usize * 7919) % 65_536;
            value[8..].copy_from_slice(&filler[off..off + a.size - 8]);
            let rec: BaseRecord<'_, [u8], [u8], ()> = BaseRecord::to(topic)
                .partition((i % parts as u64) as i32)
                .payload(&value);
            send_waiting(&producer, rec, Duration::from_micros(500));
            i += 1;
        }
        // Sleep until the next record is due (at most 1 ms, so bursts stay small).
        let next_at = Duration::from_micros((i as f64 * step_us) as u64);
        let now = t0.elapsed();
        if next_at > now {
            std::thread::sleep((next_at - now).min(Duration::from_millis(1)));
        }
    }
    producer.flush(Duration::from_secs(60)).expect("flush");
    println!(
        "{{\"sent\":{},\"rate\":{},\"seconds\":{},\"max_behind_ms\":{:.1},\"failed\":{}}}",
        i,
        a.rate,
        a.seconds,
        max_behind.as_secs_f64() * 1000.0,
        producer.context().failed.load(Ordering::Relaxed)
    );
}
