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
//! drain rate (bench/README.md, "The monitoring commit").

use std::sync::mpsc::{channel, Receiver, Sender};
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

pub(crate) struct Monitor {
    to_thread: Sender<Positions>,
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
        std::thread::Builder::new()
            .name("monitor-group".into())
            .spawn(move || commit_loop(consumer, &group, from_pipeline, commits))
            .map_err(|e| {
                BridgeError::Runtime(format!("cannot start the monitoring thread: {e}"))
            })?;
        Ok(Some(Monitor { to_thread }))
    }

    /// Hands a committed checkpoint's positions to the thread, which commits the newest it has.
    pub(crate) fn committed(&self, positions: Positions) {
        // Disconnected: the thread ended (it logs why); monitoring never stops the bridge.
        let _ = self.to_thread.send(positions);
    }
}

fn commit_loop(
    consumer: BaseConsumer,
    group: &str,
    positions: Receiver<Positions>,
    commits: IntCounterVec,
) {
    let mut failing = false;
    // Ends when the pipeline drops its Monitor.
    while let Ok(mut p) = positions.recv() {
        // Checkpoints that completed since supersede it.
        while let Ok(newer) = positions.try_recv() {
            p = newer;
        }
        let began = Instant::now();
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
                if failing {
                    info!(
                        group,
                        "monitoring commits to the source cluster succeed again"
                    );
                    failing = false;
                }
            }
            Err(e) => {
                commits.with_label_values(&["failed"]).inc();
                // One line per change, not per checkpoint.
                if !failing {
                    warn!(group, error = %e, "monitoring commit to the source cluster failed; lag tools show stale offsets until it succeeds");
                    failing = true;
                }
            }
        }
        std::thread::sleep(MIN_SPACING.saturating_sub(began.elapsed()));
    }
}
