//! The bridge's progress for standard tooling: the source positions of its newest committed
//! checkpoint are committed to a consumer group of its own on the source cluster
//! (`offsets.monitor_group`), so that kafka-consumer-groups and lag exporters show its lag.
//! Monitoring only: the bridge never reads these offsets back (its positions live in its
//! checkpoints and commit markers).
//!
//! A thread of its own commits synchronously (librdkafka reports an asynchronous commit's result
//! only to an offset_commit_cb, which rdkafka does not set), so the pipeline never waits on it.
//! It commits the newest positions at most once per `MIN_SPACING`: lag tools look every few
//! seconds, and a commit after each of ten checkpoints a second cost about a fifth of the 100-byte
//! drain rate (bench/README.md, "The monitoring commit"). A graceful stop does not wait out the
//! spacing and does not lose what it held back: dropping the `Monitor` makes the thread commit the
//! newest positions at once, and waits (bounded) for that commit before the process exits.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use prometheus::IntCounterVec;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use tracing::{info, warn};

use crate::config::Config;
use crate::error::{BridgeError, Result};
use crate::positions::Positions;
use crate::sink::is_client_wide;

/// The least time between two monitoring commits.
const MIN_SPACING: Duration = Duration::from_secs(1);
/// How long a stopping bridge waits for the last monitoring commit: lag tools showing a second
/// of stale lag is not worth holding up a shutdown with a source cluster that does not answer.
const STOP_WAIT: Duration = Duration::from_secs(5);

pub(crate) struct Monitor {
    /// None once dropping: the thread sees the disconnect and makes its last commit.
    to_thread: Option<Sender<Positions>>,
    /// Disconnected when the thread has ended.
    ended: Receiver<()>,
}

impl Monitor {
    /// None when `offsets.monitor_group` is empty.
    pub(crate) fn start(cfg: &Config, commits: IntCounterVec) -> Result<Option<Monitor>> {
        let group = cfg.offsets.monitor_group.clone();
        if group.is_empty() {
            return Ok(None);
        }
        let mut cc = ClientConfig::new();
        for (k, v) in cfg.source.kafka.iter() {
            if is_client_wide(k) {
                cc.set(k, v);
            }
        }
        let consumer: BaseConsumer = cc
            .set("bootstrap.servers", &cfg.source.bootstrap_servers)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .map_err(|e| BridgeError::kafka("create the monitoring group client", e))?;
        // Unbounded, but drained at every commit: at most a second's checkpoints wait in it.
        let (to_thread, from_pipeline) = channel();
        let (ending, ended) = channel::<()>();
        std::thread::Builder::new()
            .name("monitor-group".into())
            .spawn(move || {
                let _ending = ending;
                commit_loop(consumer, &group, from_pipeline, commits)
            })
            .map_err(|e| {
                BridgeError::Runtime(format!("cannot start the monitoring thread: {e}"))
            })?;
        Ok(Some(Monitor {
            to_thread: Some(to_thread),
            ended,
        }))
    }

    /// Hands a committed checkpoint's positions to the thread, which commits the newest it has.
    pub(crate) fn committed(&self, positions: Positions) {
        if let Some(t) = &self.to_thread {
            // Disconnected: the thread ended (it logs why); monitoring never stops the bridge.
            let _ = t.send(positions);
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        drop(self.to_thread.take());
        if let Err(RecvTimeoutError::Timeout) = self.ended.recv_timeout(STOP_WAIT) {
            warn!(
                wait = ?STOP_WAIT,
                "the last monitoring commit did not finish in time; lag tools may show the bridge behind its final checkpoint"
            );
        }
    }
}

fn commit_loop(
    consumer: BaseConsumer,
    group: &str,
    positions: Receiver<Positions>,
    commits: IntCounterVec,
) {
    let mut failing = false;
    // The newest positions not committed yet, and when the spacing allows the next commit.
    let mut held: Option<Positions> = None;
    let mut not_before = Instant::now();
    loop {
        let received = match held {
            None => positions.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(_) => positions.recv_timeout(not_before.saturating_duration_since(Instant::now())),
        };
        // Disconnected: the pipeline dropped its Monitor; what is held is committed now.
        let stopping = match received {
            Ok(p) => {
                // Checkpoints that completed since supersede what is held.
                held = Some(p);
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        if stopping || Instant::now() >= not_before {
            if let Some(p) = held.take() {
                not_before = Instant::now() + MIN_SPACING;
                commit(&consumer, group, &p, &commits, &mut failing);
            }
        }
        if stopping {
            return;
        }
    }
}

fn commit(
    consumer: &BaseConsumer,
    group: &str,
    p: &Positions,
    commits: &IntCounterVec,
    failing: &mut bool,
) {
    let mut tpl = TopicPartitionList::new();
    for (t, partition, o) in p.iter() {
        let _ = tpl.add_partition_offset(t, partition, Offset::Offset(o));
    }
    let result = consumer.commit(&tpl, CommitMode::Sync);
    // Commit sync waits for the broker's answer within librdkafka's own timeouts; a poll
    // serves the client's other events.
    let _ = consumer.poll(Duration::ZERO);
    match result {
        Ok(()) => {
            commits.with_label_values(&["ok"]).inc();
            if *failing {
                info!(
                    group,
                    "monitoring commits to the source cluster succeed again"
                );
                *failing = false;
            }
        }
        Err(e) => {
            commits.with_label_values(&["failed"]).inc();
            // One line per change, not per checkpoint.
            if !*failing {
                warn!(group, error = %e, "monitoring commit to the source cluster failed; lag tools show stale offsets until it succeeds");
                *failing = true;
            }
        }
    }
}
