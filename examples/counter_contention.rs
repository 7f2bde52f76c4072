//! Evidence for docs/design.md ("The read loop") and bench/README.md, session 19: what it costs per
//! record when the read loop and the delivery thread both change one in-flight byte count, against
//! two counts each written by one thread on a cache line of its own. The two threads do only the
//! counting of src/sink.rs, in its old and its new form, so the difference is the cache line
//! moving between cores, nothing else. No Kafka.
//!
//! cargo run --release --example counter_contention -- --records 20000000 --rounds 3

use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use clap::Parser;
use crossbeam_utils::CachePadded;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 20_000_000)]
    records: u64,
    #[arg(long, default_value_t = 3)]
    rounds: u32,
}

const BYTES: u64 = 100;
const LIMIT: u64 = u64::MAX / 2;

/// Until session 19: one count, raised per send by the read loop and lowered per report by the
/// delivery thread, which also keeps a reported total and looks for waiters after a fence.
#[derive(Default)]
struct Shared {
    in_flight: AtomicU64,
    reported: AtomicU64,
    waiters: AtomicUsize,
}

/// Since: bytes sent (read loop) and bytes reported (delivery thread), apart.
#[derive(Default)]
struct Split {
    sent: CachePadded<AtomicU64>,
    reported: CachePadded<AtomicU64>,
    waiters: AtomicUsize,
}

fn shared(n: u64) -> f64 {
    let c = Shared::default();
    let t = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..n {
                // The check before the record, then the send's count.
                assert!(c.in_flight.load(Ordering::Acquire) < LIMIT);
                c.in_flight.fetch_add(BYTES, Ordering::AcqRel);
            }
        });
        s.spawn(|| {
            for _ in 0..n {
                let _ = c
                    .in_flight
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                        Some(v.saturating_sub(BYTES))
                    });
                c.reported.fetch_add(BYTES, Ordering::AcqRel);
                fence(Ordering::SeqCst);
                assert_eq!(c.waiters.load(Ordering::SeqCst), 0);
            }
        });
    });
    t.elapsed().as_nanos() as f64 / n as f64
}

fn split(n: u64) -> f64 {
    let c = Split::default();
    let t = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut seen = 0;
            for _ in 0..n {
                let sent = c.sent.load(Ordering::Acquire);
                if sent.saturating_sub(seen) >= LIMIT {
                    seen = c.reported.load(Ordering::Acquire);
                }
                c.sent.fetch_add(BYTES, Ordering::AcqRel);
            }
        });
        s.spawn(|| {
            for _ in 0..n {
                c.reported.fetch_add(BYTES, Ordering::SeqCst);
                assert_eq!(c.waiters.load(Ordering::SeqCst), 0);
            }
        });
    });
    t.elapsed().as_nanos() as f64 / n as f64
}

fn main() {
    let a = Args::parse();
    for round in 0..a.rounds {
        let (old, new) = (shared(a.records), split(a.records));
        println!(
            "round {round}: one shared count {old:.1} ns per record, two counts apart {new:.1} ns \
             ({} records, both threads busy throughout)",
            a.records
        );
    }
}
