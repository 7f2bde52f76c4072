//! Benchmark reader for the latency phases: reads the output topic with
//! isolation.level=read_committed from its end, and for every record whose value starts with a
//! scheduled send time stamped by latency_gen (µs since the Unix epoch, little endian) records
//! "visible now" minus "scheduled" in an HDR histogram (µs, 3 significant digits). Only records
//! scheduled in [--from-us, --to-us) count; it stops at --until-us (wall clock) and prints
//! one JSON line: count, p50/p90/p99/p99.9/max/mean in ms, and the burst spread (below).
//!
//! cargo run --release --example latency_reader -- --bootstrap 127.0.0.1:9092 --topic out \
//!     --from-us … --to-us … --until-us …

mod common;

use std::io::Write;
use std::time::Duration;

use clap::Parser;
use hdrhistogram::Histogram;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use common::{now_us, partitions, read_committed_consumer, Target};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    target: Target,
    #[arg(long)]
    from_us: u64,
    #[arg(long)]
    to_us: u64,
    #[arg(long)]
    until_us: u64,
    /// librdkafka fetch.wait.max.ms: the longest the broker holds a fetch with nothing new.
    #[arg(long, default_value = "10")]
    fetch_wait_ms: String,
    /// Also write every counted record to this file, a line each: µs visible, µs scheduled,
    /// partition. For finding where a tail comes from (which commits were late, and when); tens
    /// of MB per 20 s run, so bench/run does not ask for it.
    #[arg(long)]
    dump: Option<std::path::PathBuf>,
}

fn main() {
    let a = Args::parse();
    let topic = &a.target.topic;
    // librdkafka stops fetching every partition for fetch.queue.backoff.ms (1 s by default) once
    // its consumer queue holds queued.min.messages (100,000, counted over the whole queue all
    // partitions forward to) or queued.max.messages.kbytes (64 MiB). One commit of a 1 s
    // checkpoint at 285,000 records/s makes 285,000 records visible at once, so with the defaults
    // this reader paused itself for a second at every commit and measured its own pause. It
    // fetches whatever is visible instead; it hands records out faster than any copier writes
    // them, so the queue stays as large as one commit.
    let consumer: BaseConsumer =
        read_committed_consumer(&a.target.bootstrap, "bench-latency-reader")
            .set("fetch.wait.max.ms", &a.fetch_wait_ms)
            .set("queued.min.messages", "10000000")
            .set("queued.max.messages.kbytes", "2097151")
            .create()
            .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in partitions(consumer.client(), topic) {
        // The generator starts after us; what is already there (nothing, for a fresh topic) is skipped.
        tpl.add_partition_offset(topic, p, Offset::End).unwrap();
    }
    consumer.assign(&tpl).expect("assign");
    println!("READY {}", now_us() / 1000);

    let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).unwrap();
    // How long after the first record of its burst each counted record reached us: a commit
    // makes a whole checkpoint visible at once, and what this reader takes to fetch and hand
    // out such a burst is in every latency above. A burst ends at a poll that found nothing.
    let mut spread = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).unwrap();
    let mut burst_start: Option<u64> = None;
    let (mut seen, mut counted, mut before, mut after) = (0u64, 0u64, 0u64, 0u64);
    let mut dump = a.dump.as_ref().map(|p| {
        std::io::BufWriter::new(std::fs::File::create(p).expect("create the --dump file"))
    });
    while now_us() < a.until_us {
        let m = match consumer.poll(Duration::from_millis(50)) {
            None => {
                burst_start = None;
                continue;
            }
            Some(Err(e)) => {
                eprintln!("latency_reader: {e}");
                continue;
            }
            Some(Ok(m)) => m,
        };
        let now = now_us();
        let first = *burst_start.get_or_insert(now);
        seen += 1;
        let Some(v) = m.payload() else { continue };
        if v.len() < 8 {
            continue;
        }
        let stamp = u64::from_le_bytes(v[..8].try_into().unwrap());
        if stamp < a.from_us {
            before += 1;
            continue;
        }
        if stamp >= a.to_us {
            after += 1;
            continue;
        }
        counted += 1;
        if let Some(f) = dump.as_mut() {
            writeln!(f, "{now} {stamp} {}", m.partition()).expect("write the --dump file");
        }
        h.saturating_record(now.saturating_sub(stamp).max(1));
        spread.saturating_record(now.saturating_sub(first).max(1));
    }
    if let Some(f) = dump.as_mut() {
        f.flush().expect("write the --dump file");
    }
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "{{\"count\":{},\"seen\":{},\"before_window\":{},\"after_window\":{},\"p50_ms\":{:.3},\"p90_ms\":{:.3},\"p99_ms\":{:.3},\"p999_ms\":{:.3},\"max_ms\":{:.3},\"mean_ms\":{:.3},\"burst_spread_p50_ms\":{:.3},\"burst_spread_p99_ms\":{:.3}}}",
        counted,
        seen,
        before,
        after,
        ms(0.5),
        ms(0.9),
        ms(0.99),
        ms(0.999),
        h.max() as f64 / 1000.0,
        h.mean() / 1000.0,
        spread.value_at_quantile(0.5) as f64 / 1000.0,
        spread.value_at_quantile(0.99) as f64 / 1000.0
    );
}
