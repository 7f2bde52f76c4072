//! Benchmark probe C4: the floor of a copier that commits one Kafka transaction per checkpoint.
//!
//! It does only what such a copier cannot skip: begin a transaction, send what it reads, wait at
//! the barrier until every record is acknowledged, commit. No positions, no marker, no state store,
//! no checks: **not exactly-once by itself**, and not a product. Its rate, checkpoint time and
//! latency on a broker bound what any design with the same transaction pattern reaches there, the
//! bridge's included, which is what issue 11's targets need to be judged against.
//!
//! `--producers 2` measures the one structural lever the bridge does not have: two transactional
//! producers taking turns, so that while one commits epoch N the other already sends N+1. Sending
//! N+1 starts only once N's records are all acknowledged (every partition keeps its order), and
//! N+1 commits only after N did.
//!
//! The source consumer and the producers use the bridge's defaults (src/source.rs, src/sink.rs),
//! not raw_copy's, and it reads up to 1,000 records per call as the bridge reads (`--batch`), so
//! that the difference to C2 is the protocol alone.
//!
//! `--side-records` adds the bridge's two per-checkpoint records to the floor, to measure what they
//! cost: at the barrier one record to partition 0 of `<output>.side` (as the commit marker goes to
//! its marker partition), and after the flush one to partition 1, waited for before the commit (as
//! the offset mapping is). Both partitions join each transaction only then, as the bridge's did
//! until session 11.
//!
//! `--openers` (with `--side-records`) sends one more record to each side partition just before an
//! epoch's first data record, so that both join the transaction with the data, as the bridge's
//! openers make them do now (docs/design.md, "Side partitions join with the first record").
//! `--copy-headers` reads each record's headers and copies them, as the bridge must: librdkafka
//! parses a header count even for a record that has none. With all three, the floor does per
//! transaction and per record what the bridge's protocol needs of Kafka, and nothing of its own.
//!
//! Output on stdout (read by bench/run), like raw_copy's but counting *committed* records:
//!   READY <epoch ms>
//!   P <epoch ms> <committed records>   after every commit
//!   DONE <epoch ms> <committed records> with --until-end
//! On stderr: `C <total ms> <flush ms> <commit ms>` per checkpoint (barrier to commit, the wait for
//! the acks, commit_transaction), and with --until-end their p50/p99 at the end.
//!
//! cargo run --release --example txn_copy -- --bootstrap 127.0.0.1:9092 --input in --output out \
//!     --interval-ms 100 --producers 2 --until-end

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clap::Parser;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::BaseConsumer;
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};

use common::{
    assign_all_from_start, bridge_consumer, bridge_producer, copy_of, now_ms, send_waiting,
    wait_acked, BatchReader, CopyTopics, Deliveries,
};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    copy: CopyTopics,
    /// Checkpoint interval: a barrier every this many ms.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// 1: one transactional producer; 2: two, taking turns by epoch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    producers: u8,
    /// Prefix of the producers' transactional ids (made unique per run by the caller).
    #[arg(long, default_value = "bench-txn-copy")]
    transactional_id: String,
    /// Stop once every record present at start is committed.
    #[arg(long)]
    until_end: bool,
    /// Per checkpoint, a record to a partition of `<output>.side` at the barrier and another after
    /// the flush (the bridge's marker and offset mapping); creates that topic.
    #[arg(long)]
    side_records: bool,
    /// With --side-records: a record to each side partition before an epoch's first data record.
    #[arg(long, requires = "side_records")]
    openers: bool,
    /// Copy each record's headers (the bridge's data path reads them for every record).
    #[arg(long)]
    copy_headers: bool,
    /// With one producer: an epoch's first send waits until this many ms after the previous
    /// commit, so that its AddPartitionsToTxn comes after the coordinator has written the
    /// previous transaction's markers instead of being refused and retried by librdkafka 20 ms
    /// later (the bridge learns its hold: src/sink/settle.rs).
    #[arg(long, default_value_t = 0)]
    hold_ms: u64,
    /// Records read per call of librdkafka's rd_kafka_consume_batch_queue, as the bridge reads
    /// since session 38 (so that C4b stays a floor of the bridge's reading too); 0 reads with
    /// rdkafka's per-record poll, as both did before.
    #[arg(long, default_value_t = 1000)]
    batch: usize,
}

type Txp = Arc<ThreadedProducer<Deliveries>>;

const TXN_TIMEOUT: Duration = Duration::from_secs(30);

fn producer(a: &Args, n: usize) -> Txp {
    let p: ThreadedProducer<Deliveries> = bridge_producer(&a.copy.bootstrap)
        .set("transactional.id", format!("{}-{n}", a.transactional_id))
        .set("transaction.timeout.ms", "60000")
        .create_with_context(Deliveries::default())
        .expect("producer");
    p.init_transactions(TXN_TIMEOUT).expect("init_transactions");
    Arc::new(p)
}

fn consumer(a: &Args) -> BaseConsumer {
    bridge_consumer(&a.copy.bootstrap, &format!("{}-group", a.transactional_id))
        .create()
        .expect("consumer")
}

/// Durations of the checkpoints, in ms, in the order of the `C` lines: barrier to commit, flush,
/// commit.
type Timings = [Vec<f64>; 3];

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// p50 and p99 of `v` (sorted in place); zeros for none.
fn p50_p99(v: &mut [f64]) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)];
    (at(0.5), at(0.99))
}

/// Commits `p`'s open transaction; the checkpoint it closes was cut at `barrier` and flushed in
/// `flush`. Returns the records it made visible.
fn commit(p: &Txp, barrier: Instant, flush: Duration, records: u64, t: &Mutex<Timings>) -> u64 {
    let began = Instant::now();
    p.commit_transaction(TXN_TIMEOUT)
        .expect("commit_transaction");
    let row = [ms(barrier.elapsed()), ms(flush), ms(began.elapsed())];
    // One line per checkpoint: a latency run ends by SIGTERM, before the summary.
    eprintln!("C {:.2} {:.2} {:.2}", row[0], row[1], row[2]);
    let mut t = t.lock().unwrap();
    for (column, v) in t.iter_mut().zip(row) {
        column.push(v);
    }
    records
}

/// Creates `topic` with two partitions (the side records' marker and mapping partitions).
fn create_side_topic(bootstrap: &str, topic: &str) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let res = rt
        .block_on(admin.create_topics(
            &[NewTopic::new(topic, 2, TopicReplication::Fixed(1))],
            &opts,
        ))
        .expect("create side topic");
    for r in res {
        if let Err((t, e)) = r {
            panic!("create {t}: {e}");
        }
    }
}

fn main() {
    let a = Args::parse();
    let side = a.side_records.then(|| format!("{}.side", a.copy.output));
    if let Some(t) = &side {
        create_side_topic(&a.copy.bootstrap, t);
    }
    let consumer = consumer(&a);
    let producers: Vec<Txp> = (0..a.producers as usize).map(|n| producer(&a, n)).collect();
    let target = assign_all_from_start(&consumer, &a.copy.input);
    let mut reader = (a.batch > 0).then(|| BatchReader::new(&consumer, a.batch));
    let total: u64 = target.values().map(|&h| h as u64).sum();

    let timings = Arc::new(Mutex::new(Timings::default()));
    let interval = Duration::from_millis(a.interval_ms);
    let out = std::io::stdout();
    println!("READY {}", now_ms());
    out.lock().flush().ok();

    let mut cur = 0;
    producers[cur]
        .begin_transaction()
        .expect("begin_transaction");
    let mut committed: u64 = 0;
    let mut in_epoch: u64 = 0;
    let mut copied: u64 = 0;
    // With two producers: the commit of the previous epoch, running while this one sends.
    let mut committing: Option<JoinHandle<u64>> = None;
    let mut opened = false;
    let mut first_sent = false;
    let mut committed_at: Option<Instant> = None;
    let hold = Duration::from_millis(a.hold_ms);
    let mut last_barrier = Instant::now();
    let mut epoch_began = last_barrier;
    loop {
        let done = a.until_end && copied >= total;
        // The bridge's barrier rule: every interval, but never sooner than a quarter of it after
        // the epoch began.
        let barrier_at = (last_barrier + interval).max(epoch_began + interval / 4);
        let now = Instant::now();
        if done || now >= barrier_at {
            let barrier = now;
            if let Some(t) = &side {
                let rec: BaseRecord<'_, [u8], [u8], ()> =
                    BaseRecord::to(t).partition(0).payload(&b"marker"[..]);
                send_waiting(&*producers[cur], rec, Duration::from_millis(1));
            }
            wait_acked(&*producers[cur]);
            let flush = barrier.elapsed();
            if let Some(t) = &side {
                let rec: BaseRecord<'_, [u8], [u8], ()> =
                    BaseRecord::to(t).partition(1).payload(&b"mapping"[..]);
                send_waiting(&*producers[cur], rec, Duration::from_millis(1));
                wait_acked(&*producers[cur]);
            }
            if let Some(h) = committing.take() {
                committed += h.join().expect("commit thread");
                println!("P {} {}", now_ms(), committed);
            }
            if producers.len() == 1 {
                committed += commit(&producers[cur], barrier, flush, in_epoch, &timings);
                committed_at = Some(Instant::now());
                println!("P {} {}", now_ms(), committed);
            } else {
                let (p, t, n) = (producers[cur].clone(), timings.clone(), in_epoch);
                committing = Some(std::thread::spawn(move || {
                    commit(&p, barrier, flush, n, &t)
                }));
                cur = 1 - cur;
            }
            out.lock().flush().ok();
            in_epoch = 0;
            last_barrier = barrier;
            if done {
                if let Some(h) = committing.take() {
                    committed += h.join().expect("commit thread");
                }
                println!("P {} {}", now_ms(), committed);
                println!("DONE {} {}", now_ms(), committed);
                break;
            }
            producers[cur]
                .begin_transaction()
                .expect("begin_transaction");
            epoch_began = Instant::now();
            opened = false;
            first_sent = false;
            continue;
        }
        // One record's send, as the bridge's: the first of an epoch waits out the hold and the
        // openers go first.
        let mut send = |p: i32, offset: i64, rec: BaseRecord<'_, [u8], [u8], ()>| {
            if !first_sent {
                if let Some(at) = committed_at {
                    let left = (at + hold).saturating_duration_since(Instant::now());
                    if !left.is_zero() {
                        std::thread::sleep(left);
                    }
                }
                first_sent = true;
            }
            // `--openers` requires `--side-records`, so `side` is set whenever it is.
            if a.openers && !opened {
                let t = side.as_deref().expect("--openers requires --side-records");
                for (partition, what) in [(0, &b"opener-marker"[..]), (1, &b"opener-mapping"[..])] {
                    let rec: BaseRecord<'_, [u8], [u8], ()> =
                        BaseRecord::to(t).partition(partition).payload(what);
                    send_waiting(&*producers[cur], rec, Duration::from_millis(1));
                }
                opened = true;
            }
            send_waiting(&*producers[cur], rec, Duration::from_millis(1));
            in_epoch += 1;
            if offset < target[&p] {
                copied += 1;
            }
        };
        let wait = barrier_at.saturating_duration_since(now);
        if let Some(reader) = reader.as_mut() {
            // The barrier is looked at after each batch: at most one batch late, under 1 ms here
            // (the bridge looks every 64 records).
            reader.copy_each(wait, &a.copy.output, a.copy_headers, &mut send);
            continue;
        }
        let msg = match consumer.poll(wait) {
            None => continue,
            Some(Err(e)) => {
                eprintln!("txn_copy: consumer error: {e}");
                continue;
            }
            Some(Ok(m)) => m,
        };
        let mut rec = copy_of(&msg, &a.copy.output);
        if a.copy_headers {
            if let Some(h) = msg.headers().filter(|h| h.count() > 0) {
                rec = rec.headers(h.detach());
            }
        }
        send(msg.partition(), msg.offset(), rec);
    }
    let mut t = std::mem::take(&mut *timings.lock().unwrap());
    let checkpoints = t[0].len();
    let [(t50, t99), (f50, f99), (c50, c99)] = t.each_mut().map(|v| p50_p99(v));
    eprintln!(
        "txn_copy: producers={} interval_ms={} checkpoints={checkpoints} total_ms p50={t50:.1} \
         p99={t99:.1} flush_ms p50={f50:.1} p99={f99:.1} commit_ms p50={c50:.1} p99={c99:.1}",
        a.producers, a.interval_ms,
    );
    let failed = producers
        .iter()
        .map(|p| {
            p.context()
                .failed
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum::<u64>();
    if failed > 0 {
        eprintln!("txn_copy: {failed} deliveries failed");
        std::process::exit(1);
    }
}
