//! Evidence for bench/README.md: how long `Producer::flush` takes on a `ThreadedProducer` (what
//! eos-bridge's sink uses) when only a handful of records are in flight, against waiting for
//! `in_flight_count() == 0` with short sleeps, and against a `BaseProducer` flushed by the only
//! thread that polls it. Transactional with --transactional (one transaction per round, like a
//! checkpoint: begin, send, flush, commit).
//!
//! cargo run --release --example flush_latency -- --bootstrap 127.0.0.1:9092 --topic t --rounds 50

mod common;

use std::time::{Duration, Instant};

use clap::Parser;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{
    BaseProducer, BaseRecord, DefaultProducerContext, Producer, ThreadedProducer,
};

use common::{bridge_producer, Target};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    target: Target,
    #[arg(long, default_value_t = 50)]
    rounds: u32,
    #[arg(long)]
    transactional: bool,
}

fn config(a: &Args, id: &str) -> ClientConfig {
    let mut c = bridge_producer(&a.target.bootstrap);
    if a.transactional {
        c.set(
            "transactional.id",
            format!("flush-latency-{id}-{}", std::process::id()),
        );
    }
    c
}

fn median_ms(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1000.0
}

fn rounds<P: Producer<DefaultProducerContext>>(
    a: &Args,
    p: &P,
    send: impl Fn(u32),
    wait: impl Fn(&P),
) -> (f64, f64) {
    if a.transactional {
        p.init_transactions(Duration::from_secs(30)).unwrap();
    }
    let mut times = Vec::new();
    let mut totals = Vec::new();
    for i in 0..a.rounds {
        let t0 = Instant::now();
        if a.transactional {
            p.begin_transaction().unwrap();
        }
        for _ in 0..10 {
            send(i);
        }
        let t = Instant::now();
        wait(p);
        times.push(t.elapsed());
        if a.transactional {
            p.commit_transaction(Duration::from_secs(30)).unwrap();
        }
        totals.push(t0.elapsed());
    }
    (median_ms(times), median_ms(totals))
}

fn record(a: &Args, v: &[u8; 4]) -> BaseRecord<'static, [u8], [u8]> {
    let topic: &'static str = Box::leak(a.target.topic.clone().into_boxed_str());
    let v: &'static [u8] = Box::leak(Box::new(*v));
    BaseRecord::to(topic).partition(0).payload(v)
}

/// The rounds on a fresh `ThreadedProducer`, each ended by `wait`.
fn threaded_rounds(
    a: &Args,
    id: &str,
    wait: impl Fn(&ThreadedProducer<DefaultProducerContext>),
) -> (f64, f64) {
    let tp: ThreadedProducer<DefaultProducerContext> = config(a, id).create().unwrap();
    rounds(
        a,
        &tp,
        |i| {
            tp.send(record(a, &i.to_le_bytes()))
                .map_err(|(e, _)| e)
                .unwrap()
        },
        wait,
    )
}

fn main() {
    let a = Args::parse();
    let (f, t) = threaded_rounds(&a, "a", |p| p.flush(Duration::from_secs(30)).unwrap());
    println!("ThreadedProducer flush():                      wait median {f:7.2} ms, round median {t:7.2} ms");
    let (f, t) = threaded_rounds(&a, "b", |p| {
        while p.in_flight_count() > 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    });
    println!("ThreadedProducer in_flight_count()==0 loop:    wait median {f:7.2} ms, round median {t:7.2} ms");
    let bp: BaseProducer<DefaultProducerContext> = config(&a, "c").create().unwrap();
    let (f, t) = rounds(
        &a,
        &bp,
        |i| {
            bp.send(record(&a, &i.to_le_bytes()))
                .map_err(|(e, _)| e)
                .unwrap()
        },
        |p| p.flush(Duration::from_secs(30)).unwrap(),
    );
    println!("BaseProducer flush() (no other poller):        wait median {f:7.2} ms, round median {t:7.2} ms");
}
