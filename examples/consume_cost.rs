//! Benchmark probe: what reading one record costs the thread that reads, through rdkafka's
//! `BaseConsumer::poll` (the bridge's source, one event per record) or through librdkafka's
//! `rd_kafka_consume_batch_queue` (up to --batch records per call), on the same consumer settings
//! (the bridge's source defaults, examples/common). It drains every record present at start,
//! touches each record's key, payload, partition, offset and timestamp, and prints one JSON line:
//! records, seconds, records/s, and CPU-seconds per million records of the reading thread
//! (`CLOCK_THREAD_CPUTIME_ID`) and of the whole process (librdkafka's fetch and decompression
//! threads included). At 100 B the profile of the bridge puts a fifth of its reading thread in
//! clock reads and most of the rest in librdkafka's per-call queue work
//! (bench/README.md, "Session 38"): this measures that share apart from producing.
//!
//! cargo run --release --example consume_cost -- --bootstrap 127.0.0.1:9092 --topic in --mode batch

mod common;

use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use rdkafka::bindings as rdsys;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;

use common::{assign_all_from_start, bridge_consumer, raw_bytes, Target};

#[derive(Clone, Copy, ValueEnum)]
enum Mode {
    /// rdkafka's BaseConsumer::poll: an event, an Arc and a clock read per record.
    Poll,
    /// librdkafka's rd_kafka_consume_batch_queue: one queue lock per batch.
    Batch,
    /// librdkafka's rd_kafka_consumer_poll: a record per call, without rdkafka's event wrapper.
    Single,
}

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    target: Target,
    #[arg(long, value_enum)]
    mode: Mode,
    /// Records per rd_kafka_consume_batch_queue call (batch mode).
    #[arg(long, default_value_t = 1000)]
    batch: usize,
    /// Give up after this many seconds without finishing.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
}

fn cpu_s(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a timespec we own.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// What the reading does with a record: enough that nothing is optimised away.
#[derive(Default)]
struct Touched {
    records: u64,
    bytes: u64,
    check: i64,
}

impl Touched {
    fn touch(
        &mut self,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        partition: i32,
        offset: i64,
        ts: i64,
    ) {
        self.records += 1;
        let p = payload.unwrap_or_default();
        self.bytes += (p.len() + key.map_or(0, <[u8]>::len)) as u64;
        self.check = self
            .check
            .wrapping_add(i64::from(p.first().copied().unwrap_or(0)))
            .wrapping_add(offset ^ i64::from(partition) ^ ts);
    }

    /// Touches a message librdkafka returned and destroys it.
    ///
    /// # Safety
    /// `mp` must be a live message of ours, not used after this call.
    unsafe fn touch_and_destroy(&mut self, mp: *mut rdsys::rd_kafka_message_t) {
        // SAFETY: per the contract; key and payload live until the destroy below.
        unsafe {
            let m = &*mp;
            assert!(
                m.err == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR,
                "consume error {:?}",
                m.err
            );
            let ts = rdsys::rd_kafka_message_timestamp(mp, std::ptr::null_mut());
            self.touch(
                raw_bytes(m.key, m.key_len),
                raw_bytes(m.payload, m.len),
                m.partition,
                m.offset,
                ts,
            );
            rdsys::rd_kafka_message_destroy(mp);
        }
    }
}

fn main() {
    let a = Args::parse();
    let group = format!("bench-consume-cost-{}", std::process::id());
    let consumer: BaseConsumer = bridge_consumer(&a.target.bootstrap, &group)
        .set("fetch.wait.max.ms", "100")
        .create()
        .expect("consumer");
    let ends = assign_all_from_start(&consumer, &a.target.topic);
    let total: i64 = ends.values().sum();
    let deadline = Instant::now() + Duration::from_secs(a.timeout_s);
    let mut t = Touched::default();

    // The first record starts the clock: connecting and the first fetch are not reading.
    let (mut wall0, mut thread0, mut proc0) = (None, 0.0, 0.0);
    let mut started = |t: &Touched| {
        if wall0.is_none() && t.records > 0 {
            wall0 = Some(Instant::now());
            thread0 = cpu_s(libc::CLOCK_THREAD_CPUTIME_ID);
            proc0 = cpu_s(libc::CLOCK_PROCESS_CPUTIME_ID);
        }
    };
    match a.mode {
        Mode::Poll => {
            while (t.records as i64) < total && Instant::now() < deadline {
                let m = match consumer.poll(Duration::ZERO) {
                    Some(m) => m,
                    None => match consumer.poll(Duration::from_millis(100)) {
                        Some(m) => m,
                        None => continue,
                    },
                };
                let m = m.expect("consume");
                t.touch(
                    m.key(),
                    m.payload(),
                    m.partition(),
                    m.offset(),
                    m.timestamp().to_millis().unwrap_or(0),
                );
                started(&t);
            }
        }
        Mode::Single => {
            let rk = consumer.client().native_ptr();
            while (t.records as i64) < total && Instant::now() < deadline {
                // SAFETY: a live consumer; the message returned is destroyed once touched.
                unsafe {
                    let mut mp = rdsys::rd_kafka_consumer_poll(rk, 0);
                    if mp.is_null() {
                        mp = rdsys::rd_kafka_consumer_poll(rk, 100);
                        if mp.is_null() {
                            continue;
                        }
                    }
                    t.touch_and_destroy(mp);
                }
                started(&t);
            }
        }
        Mode::Batch => {
            let rk = consumer.client().native_ptr();
            // SAFETY: the consumer outlives the queue handle, destroyed below; only this thread
            // reads the consumer's queue, and every message returned is destroyed once touched.
            unsafe {
                let q = rdsys::rd_kafka_queue_get_consumer(rk);
                assert!(!q.is_null(), "no consumer queue");
                let mut buf: Vec<*mut rdsys::rd_kafka_message_t> =
                    vec![std::ptr::null_mut(); a.batch];
                while (t.records as i64) < total && Instant::now() < deadline {
                    let got =
                        rdsys::rd_kafka_consume_batch_queue(q, 100, buf.as_mut_ptr(), a.batch);
                    assert!(got >= 0, "rd_kafka_consume_batch_queue failed");
                    for &mp in &buf[..got as usize] {
                        t.touch_and_destroy(mp);
                    }
                    started(&t);
                }
                rdsys::rd_kafka_queue_destroy(q);
            }
        }
    }
    let wall = wall0.map_or(0.0, |w| w.elapsed().as_secs_f64());
    let thread_cpu = cpu_s(libc::CLOCK_THREAD_CPUTIME_ID) - thread0;
    let proc_cpu = cpu_s(libc::CLOCK_PROCESS_CPUTIME_ID) - proc0;
    assert_eq!(
        t.records as i64, total,
        "read {} of {} records before the timeout",
        t.records, total
    );
    let per_m = |s: f64| s / t.records as f64 * 1e6;
    println!(
        "{{\"mode\":\"{}\",\"records\":{},\"bytes\":{},\"seconds\":{:.3},\"records_per_s\":{:.0},\"thread_cpu_s_per_M\":{:.3},\"process_cpu_s_per_M\":{:.3},\"check\":{}}}",
        match a.mode {
            Mode::Poll => "poll",
            Mode::Batch => "batch",
            Mode::Single => "single",
        },
        t.records,
        t.bytes,
        wall,
        t.records as f64 / wall,
        per_m(thread_cpu),
        per_m(proc_cpu),
        t.check
    );
}
