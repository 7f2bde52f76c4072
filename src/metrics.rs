//! Every Prometheus metric of eos-bridge, defined in one place, on one registry of our own.
//!
//! Other modules take a `&Metrics` (or an `Arc`) and update the handles; nothing registers a
//! metric anywhere else, so /metrics, the dashboard and the alert rules have one list to agree on.

use std::time::Duration;

use prometheus::{
    Counter, CounterVec, Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

pub(crate) struct Metrics {
    pub registry: Registry,
    pub records_consumed: IntCounterVec,
    pub records_produced: IntCounterVec,
    pub checkpoints: IntCounterVec,
    pub checkpoint_duration: Histogram,
    pub last_checkpoint_id: IntGauge,
    pub last_checkpoint_timestamp: IntGauge,
    pub commit_duration: Histogram,
    pub transactions_aborted: IntCounterVec,
    pub consumer_lag: IntGaugeVec,
    pub end_to_end_latency: Histogram,
    pub recoveries: IntCounterVec,
    pub producer_rebuilds: IntCounter,
    pub records_dead_lettered: IntCounterVec,
    pub records_lost: IntCounterVec,
    pub corrupt_checkpoints: IntCounter,
    pub marker_wait_seconds: Counter,
    pub layout_generation: IntGauge,
    pub in_flight_limit_bytes: IntGauge,
    pub first_send_hold_seconds: Gauge,
    pub sink_request_rtt: GaugeVec,
    pub sink_queue_latency: GaugeVec,
    pub epochs_ended: IntCounterVec,
    pub read_wait_seconds: CounterVec,
    pub identity_changes: IntCounterVec,
    pub monitor_commits: IntCounterVec,
    pub offset_mapping_runs: IntCounter,
    pub build_info: IntGaugeVec,
}

const PREFIX: &str = "eos_bridge";

/// The reasons of `read_wait_seconds_total`: the sink holds reading back (the in-flight limit,
/// the producer's queue), or the source has nothing to read.
pub(crate) const READ_WAIT_REASONS: [&str; 4] = [
    "in_flight_limit",
    "producer_queue",
    "transaction_start",
    "source",
];

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help).namespace(PREFIX)
}

fn hopts(name: &str, help: &str, buckets: Vec<f64>) -> HistogramOpts {
    HistogramOpts::new(name, help)
        .namespace(PREFIX)
        .buckets(buckets)
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        let registry = Registry::new();
        // Checkpoints and commits take from a millisecond (idle) to the checkpoint timeout
        // (tens of seconds); end-to-end latency is dominated by the checkpoint interval.
        // Between 10 and 250 ms, where a busy bridge's checkpoints and their tail lie, neighbouring
        // bounds are at most 1.5x apart: with only 25, 50, 100 and 250 there, checkpoint p99s of
        // 50.5 and 55.8 ms (from the bridge's log) read 79 and 73 ms (bench/README.md, "Session 45").
        let short = vec![
            0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125,
            0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        ];
        let e2e = vec![
            0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0,
        ];
        let m = Metrics {
            records_consumed: IntCounterVec::new(
                opts(
                    "records_consumed_total",
                    "Records read from the source, per source topic.",
                ),
                &["topic"],
            )
            .unwrap(),
            records_produced: IntCounterVec::new(
                opts(
                    "records_produced_total",
                    "Records written to the sink in committed checkpoints, per sink topic.",
                ),
                &["topic"],
            )
            .unwrap(),
            checkpoints: IntCounterVec::new(
                opts(
                    "checkpoints_total",
                    "Checkpoints by result (completed, aborted, failed).",
                ),
                &["result"],
            )
            .unwrap(),
            checkpoint_duration: Histogram::with_opts(hopts(
                "checkpoint_duration_seconds",
                "Time from the barrier to the checkpoint being committed and recorded.",
                short.clone(),
            ))
            .unwrap(),
            last_checkpoint_id: IntGauge::with_opts(opts(
                "last_checkpoint_id",
                "Id of the last completed checkpoint.",
            ))
            .unwrap(),
            last_checkpoint_timestamp: IntGauge::with_opts(opts(
                "last_checkpoint_timestamp_seconds",
                "Unix time of the last completed checkpoint.",
            ))
            .unwrap(),
            commit_duration: Histogram::with_opts(hopts(
                "transaction_commit_duration_seconds",
                "Duration of commit_transaction.",
                short,
            ))
            .unwrap(),
            transactions_aborted: IntCounterVec::new(
                opts(
                    "transactions_aborted_total",
                    "Transactions aborted, by reason.",
                ),
                &["reason"],
            )
            .unwrap(),
            consumer_lag: IntGaugeVec::new(
                opts(
                    "consumer_lag",
                    "Records between the committed position and the source's last stable offset.",
                ),
                &["topic", "partition"],
            )
            .unwrap(),
            end_to_end_latency: Histogram::with_opts(hopts(
                "end_to_end_latency_seconds",
                "From a record's source timestamp to the commit that made its results visible.",
                e2e,
            ))
            .unwrap(),
            recoveries: IntCounterVec::new(
                opts(
                    "recoveries_total",
                    "Recoveries by outcome (fresh, committed, rolled_back, adopted_from_marker).",
                ),
                &["outcome"],
            )
            .unwrap(),
            producer_rebuilds: IntCounter::with_opts(opts(
                "producer_rebuilds_total",
                "Transactional producers rebuilt after a fatal producer error.",
            ))
            .unwrap(),
            records_dead_lettered: IntCounterVec::new(
                opts(
                    "records_dead_lettered_total",
                    "Source records the sink refused, written to their dead-letter topic in committed checkpoints, per source topic.",
                ),
                &["topic"],
            )
            .unwrap(),
            records_lost: IntCounterVec::new(
                opts(
                    "records_lost_to_retention_total",
                    "Source records deleted by retention before they were read.",
                ),
                &["topic", "partition"],
            )
            .unwrap(),
            corrupt_checkpoints: IntCounter::with_opts(opts(
                "corrupt_checkpoints_total",
                "Stored checkpoints that failed to decode or their checksum, skipped at recovery.",
            ))
            .unwrap(),
            marker_wait_seconds: Counter::with_opts(opts(
                "marker_wait_seconds_total",
                "Time recovery waited for other producers' transactions on the marker partition.",
            ))
            .unwrap(),
            layout_generation: IntGauge::with_opts(opts(
                "layout_generation",
                "Generation of the layout (each change of bridge.instances is one) this process runs in.",
            ))
            .unwrap(),
            in_flight_limit_bytes: IntGauge::with_opts(opts(
                "in_flight_limit_bytes",
                "Current bound on output bytes handed to the sink producer and not yet acknowledged.",
            ))
            .unwrap(),
            first_send_hold_seconds: Gauge::with_opts(opts(
                "first_send_hold_seconds",
                "How long a transaction's first send currently waits after the previous transaction ended, so that its partitions join without librdkafka's 20 ms retry.",
            ))
            .unwrap(),
            sink_request_rtt: GaugeVec::new(
                opts(
                    "sink_request_rtt_seconds",
                    "Round trip of the sink producer's requests to each broker (produce and transaction requests alike) over librdkafka's last statistics window (statistics.interval.ms of [sink.kafka], 5 s by default): quantile 0.5, 0.99, and 1 for the largest.",
                ),
                &["broker", "quantile"],
            )
            .unwrap(),
            sink_queue_latency: GaugeVec::new(
                opts(
                    "sink_queue_latency_seconds",
                    "How long output records waited in the sink producer's queue before they were sent to each broker, over the same window as sink_request_rtt_seconds: quantile 0.5, 0.99, and 1 for the largest.",
                ),
                &["broker", "quantile"],
            )
            .unwrap(),
            monitor_commits: IntCounterVec::new(
                opts(
                    "monitor_group_commits_total",
                    "Commits of the bridge's positions to its monitoring group on the source cluster, by result (ok, failed).",
                ),
                &["result"],
            )
            .unwrap(),
            offset_mapping_runs: IntCounter::with_opts(opts(
                "offset_mapping_runs_total",
                "Runs written to the offset mapping topic in committed checkpoints.",
            ))
            .unwrap(),
            epochs_ended: IntCounterVec::new(
                opts(
                    "epochs_ended_total",
                    "Epochs by what ended them (interval, size, shutdown).",
                ),
                &["trigger"],
            )
            .unwrap(),
            read_wait_seconds: CounterVec::new(
                opts(
                    "read_wait_seconds_total",
                    "Time the read loop stood still, by reason: in_flight_limit, producer_queue \
                     and transaction_start (the sink holds the bridge back), source (nothing to read).",
                ),
                &["reason"],
            )
            .unwrap(),
            identity_changes: IntCounterVec::new(
                opts(
                    "identity_changes_total",
                    "Clusters or topics found to be other incarnations than the committed positions \
                     refer to, by kind (source_cluster, sink_cluster, source_topic, sink_topic).",
                ),
                &["kind"],
            )
            .unwrap(),
            build_info: IntGaugeVec::new(
                opts("build_info", "Always 1; labels name the build."),
                &["version"],
            )
            .unwrap(),
            registry,
        };
        m.register_all();
        // Series that exist at zero from the start: dashboards and alert rules (increase, rate)
        // then see them before the first event, not only after it.
        for result in ["completed", "aborted", "failed"] {
            m.checkpoints.with_label_values(&[result]);
        }
        for trigger in ["interval", "size", "shutdown"] {
            m.epochs_ended.with_label_values(&[trigger]);
        }
        for reason in READ_WAIT_REASONS {
            m.read_wait_seconds.with_label_values(&[reason]);
        }
        for reason in crate::error::BridgeError::REASONS {
            m.transactions_aborted.with_label_values(&[reason]);
        }
        for outcome in crate::recovery::RecoveryOutcome::ALL
            .iter()
            .map(|o| o.as_str())
            .chain(["restored_from_savepoint"])
        {
            m.recoveries.with_label_values(&[outcome]);
        }
        for kind in crate::identity::Change::KINDS {
            m.identity_changes.with_label_values(&[kind]);
        }
        m.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        m
    }

    fn register_all(&self) {
        let r = &self.registry;
        let all: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(self.records_consumed.clone()),
            Box::new(self.records_produced.clone()),
            Box::new(self.checkpoints.clone()),
            Box::new(self.checkpoint_duration.clone()),
            Box::new(self.last_checkpoint_id.clone()),
            Box::new(self.last_checkpoint_timestamp.clone()),
            Box::new(self.commit_duration.clone()),
            Box::new(self.transactions_aborted.clone()),
            Box::new(self.consumer_lag.clone()),
            Box::new(self.end_to_end_latency.clone()),
            Box::new(self.recoveries.clone()),
            Box::new(self.producer_rebuilds.clone()),
            Box::new(self.records_dead_lettered.clone()),
            Box::new(self.records_lost.clone()),
            Box::new(self.corrupt_checkpoints.clone()),
            Box::new(self.marker_wait_seconds.clone()),
            Box::new(self.layout_generation.clone()),
            Box::new(self.in_flight_limit_bytes.clone()),
            Box::new(self.first_send_hold_seconds.clone()),
            Box::new(self.sink_request_rtt.clone()),
            Box::new(self.sink_queue_latency.clone()),
            Box::new(self.epochs_ended.clone()),
            Box::new(self.read_wait_seconds.clone()),
            Box::new(self.identity_changes.clone()),
            Box::new(self.monitor_commits.clone()),
            Box::new(self.offset_mapping_runs.clone()),
            Box::new(self.build_info.clone()),
            Box::new(prometheus::process_collector::ProcessCollector::for_self()),
        ];
        for c in all {
            r.register(c).expect("metric names are unique");
        }
    }

    /// Shows the per-partition series of a partition at zero as soon as it is assigned.
    pub(crate) fn preset_partition(&self, topic: &str, partition: i32) {
        let p = partition.to_string();
        self.records_lost.with_label_values(&[topic, &p]);
        self.consumer_lag.with_label_values(&[topic, &p]);
        self.records_consumed.with_label_values(&[topic]);
        self.records_dead_lettered.with_label_values(&[topic]);
    }

    /// One broker's latencies from the sink producer's latest statistics window; a quantity the
    /// window had no sample of loses its series (a stale figure would pass for a current one).
    pub(crate) fn set_sink_latency(
        &self,
        broker: &str,
        rtt: Option<Quantiles>,
        queue: Option<Quantiles>,
    ) {
        for (gauge, q) in [
            (&self.sink_request_rtt, rtt),
            (&self.sink_queue_latency, queue),
        ] {
            match q {
                Some(q) => {
                    for (label, v) in Quantiles::LABELS.iter().zip(q.seconds()) {
                        gauge.with_label_values(&[broker, label]).set(v);
                    }
                }
                None => {
                    for label in Quantiles::LABELS {
                        // Absent already is fine: there is nothing to remove.
                        let _ = gauge.remove_label_values(&[broker, label]);
                    }
                }
            }
        }
    }

    /// The registry in Prometheus text format, with its content type.
    pub(crate) fn render(&self) -> (String, Vec<u8>) {
        let encoder = TextEncoder::new();
        let mut buf = Vec::new();
        encoder
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding of gathered metrics");
        (encoder.format_type().to_string(), buf)
    }
}

/// A latency window's median, 99th percentile and largest value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Quantiles {
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
}

impl Quantiles {
    const LABELS: [&'static str; 3] = ["0.5", "0.99", "1"];

    fn seconds(self) -> [f64; 3] {
        [self.p50, self.p99, self.max].map(|d| d.as_secs_f64())
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prefixed_names_and_build_info() {
        let m = Metrics::new();
        m.checkpoints.with_label_values(&["completed"]).inc();
        let (ctype, body) = m.render();
        let text = String::from_utf8(body).unwrap();
        assert!(ctype.starts_with("text/plain"), "{ctype}");
        assert!(
            text.contains("eos_bridge_checkpoints_total{result=\"completed\"} 1"),
            "{text}"
        );
        assert!(text.contains("eos_bridge_build_info{version=\""));
        assert!(text.contains("process_resident_memory_bytes"));
    }

    #[test]
    fn a_sink_latency_is_shown_per_broker_and_quantile_and_dropped_when_unmeasured() {
        let m = Metrics::new();
        let q = Quantiles {
            p50: Duration::from_millis(2),
            p99: Duration::from_millis(40),
            max: Duration::from_millis(75),
        };
        m.set_sink_latency("1", Some(q), None);
        let text = String::from_utf8(m.render().1).unwrap();
        for series in [
            "eos_bridge_sink_request_rtt_seconds{broker=\"1\",quantile=\"0.5\"} 0.002",
            "eos_bridge_sink_request_rtt_seconds{broker=\"1\",quantile=\"0.99\"} 0.04",
            "eos_bridge_sink_request_rtt_seconds{broker=\"1\",quantile=\"1\"} 0.075",
        ] {
            assert!(text.contains(series), "{series} missing:\n{text}");
        }
        assert!(
            !text.contains("eos_bridge_sink_queue_latency_seconds{"),
            "{text}"
        );

        m.set_sink_latency("1", None, Some(q));
        let text = String::from_utf8(m.render().1).unwrap();
        assert!(
            !text.contains("eos_bridge_sink_request_rtt_seconds{"),
            "{text}"
        );
        assert!(
            text.contains(
                "eos_bridge_sink_queue_latency_seconds{broker=\"1\",quantile=\"0.99\"} 0.04"
            ),
            "{text}"
        );
    }

    #[test]
    fn checkpoint_buckets_are_fine_where_checkpoints_lie() {
        let text = String::from_utf8(Metrics::new().render().1).unwrap();
        let bounds: Vec<f64> = text
            .lines()
            .filter_map(|l| l.strip_prefix("eos_bridge_checkpoint_duration_seconds_bucket{le=\""))
            .filter_map(|l| l.split('"').next()?.parse().ok())
            .collect();
        assert!(bounds.len() > 10, "{text}");
        assert!(bounds.windows(2).all(|w| w[0] < w[1]), "{bounds:?}");
        for w in bounds.windows(2).filter(|w| w[0] >= 0.01 && w[1] <= 0.25) {
            assert!(w[1] / w[0] <= 1.5, "{} to {} is too coarse", w[0], w[1]);
        }
        for edge in [0.01, 0.05, 0.1, 0.25] {
            assert!(bounds.contains(&edge), "no bound at {edge}: {bounds:?}");
        }
    }

    #[test]
    fn every_read_wait_reason_is_a_series_from_the_start() {
        let (_, body) = Metrics::new().render();
        let text = String::from_utf8(body).unwrap();
        for reason in READ_WAIT_REASONS {
            let series = format!("eos_bridge_read_wait_seconds_total{{reason=\"{reason}\"}} 0");
            assert!(text.contains(&series), "{series} missing:\n{text}");
        }
    }
}
