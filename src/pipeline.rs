//! The pipeline: the one owner of the epoch loop and of the checkpoint protocol of docs/design.md.
//!
//! It runs on a thread of its own because every transaction call blocks. Each epoch is:
//! begin → poll and produce until the barrier → commit marker → flush → durable pending
//! checkpoint → commit → checkpoint marked committed. Failures follow the action their error is
//! classified as (error.rs): abort and replay the epoch from the last checkpoint, rebuild the
//! producer and recover in-process from the newest committed marker, or stop.
//!
//! A record the sink refuses for good (a bad record) either stops the bridge, its transaction
//! aborted, or with `on_bad_record = "dead-letter"` is remembered and the epoch replayed with that
//! record written to its dead-letter topic inside the epoch's transaction: exactly once, like every
//! other output.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::admin::Admin;
use crate::checkpoint::{Checkpoint, CheckpointState, CheckpointStore};
use crate::config::{Config, Delivery, OnBadRecord, OutOfRange, Partitioning, StartPosition};
use crate::error::{Action, BadRecordStop, BridgeError, Result};
use crate::failpoint;
use crate::identity::{self, Identity};
use crate::marker::{
    layout_marker_key, layout_transactional_id, marker_partition, Layout, Marker, MARKER_VERSION,
};
use crate::metrics::Metrics;
use crate::positions::Positions;
use crate::recovery::{decide, plan_layout, Decision, LayoutPlan, RecoveryOutcome};
use crate::savepoint::{Restore, Savepoint, RESTORED_PREFIX};
use crate::sink::{
    fence, is_permanent_record_error, read_bridge_markers, InFlightLimit, Sink, SinkSettings,
    SourceRef,
};
use crate::source::Source;
use crate::status::{self, PartitionStatus, RunState, SharedStatus};
use crate::transform::Router;

mod identity_checks;

/// How often the source is asked for new partitions and (with a pattern) new topics.
const DISCOVERY_INTERVAL: Duration = Duration::from_secs(10);
/// How long init_transactions and the marker read may take before the attempt counts as failed.
const CONNECT_DEADLINE: Duration = Duration::from_secs(60);
/// Beyond the broker's transaction.max.timeout.ms: the coordinator's sweep for expired
/// transactions (10 s by default) and the time to write their abort markers.
const FOREIGN_TRANSACTION_MARGIN: Duration = Duration::from_secs(60);
/// Every n-th record's timestamp feeds the end-to-end latency histogram.
const LATENCY_SAMPLE: u64 = 64;
/// How long a listed source topic may be missing (a broker that restarts can briefly not know
/// it) before the bridge stops, at start-up and while running.
const MISSING_TOPIC_WAIT: Duration = Duration::from_secs(30);

pub struct Shared {
    pub metrics: Arc<Metrics>,
    pub status: SharedStatus,
    pub shutdown: CancellationToken,
    pub runtime: Handle,
    /// Opened by the daemon before the pipeline starts; the API reads it too.
    pub store: Arc<CheckpointStore>,
}

type SavepointRequest = (
    String,
    bool,
    tokio::sync::oneshot::Sender<std::result::Result<Savepoint, String>>,
);

/// Requests from the API, served at epoch boundaries.
pub enum Command {
    /// Name the next checkpoint a savepoint; the reply comes once it is committed. With `stop`,
    /// that checkpoint is the last one: the bridge then shuts down as on SIGTERM, so nothing is
    /// committed after the savepoint (the way to move to another layout under live traffic).
    Savepoint {
        name: String,
        stop: bool,
        reply: tokio::sync::oneshot::Sender<std::result::Result<Savepoint, String>>,
    },
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Headers a dead letter carries besides its own: where it came from, why the sink refused it, and
/// when (milliseconds since the Unix epoch, as decimal text like the partition and offset).
pub const HEADER_SOURCE_TOPIC: &str = "eos-bridge.source.topic";
pub const HEADER_SOURCE_PARTITION: &str = "eos-bridge.source.partition";
pub const HEADER_SOURCE_OFFSET: &str = "eos-bridge.source.offset";
pub const HEADER_ERROR: &str = "eos-bridge.error";
pub const HEADER_ERROR_TIME: &str = "eos-bridge.error.time";

/// A record the sink refused for good: why, and when it first failed.
struct BadRecord {
    code: Option<RDKafkaErrorCode>,
    reason: String,
    failed_ms: i64,
}

/// The record a delivery error blames, if the error is the record's own and permanent.
fn blamed_record(e: &BridgeError) -> Option<(&str, i32, i64, BadRecord)> {
    let BridgeError::Delivery {
        topic,
        partition,
        offset,
        reason,
        code,
    } = e
    else {
        return None;
    };
    // The commit marker carries offset -1: it is no source record to skip.
    if !is_permanent_record_error(*code) || *offset < 0 {
        return None;
    }
    Some((
        topic.as_str(),
        *partition,
        *offset,
        BadRecord {
            code: *code,
            reason: reason.clone(),
            failed_ms: now_ms(),
        },
    ))
}

/// What to change so that `topic` takes a record refused with `code`.
fn fix_for(code: Option<RDKafkaErrorCode>, topic: &str) -> String {
    match code {
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::MessageBatchTooLarge,
        ) => format!(
            "raise max.message.bytes of topic '{topic}' above the record's size (and message.max.bytes in \
             [sink.kafka], 1000000 by default, if the record is larger than that)"
        ),
        Some(RDKafkaErrorCode::InvalidTimestamp) => format!(
            "the record's timestamp is outside what topic '{topic}' accepts: raise its \
             message.timestamp.before.max.ms / message.timestamp.after.max.ms"
        ),
        _ => format!(
            "make topic '{topic}' accept the record (a compacted topic, for one, takes only records with a key)"
        ),
    }
}

/// A dead letter's headers: the record's own, then where it came from and why it was refused.
fn dead_letter_headers<H: Headers>(
    own: Option<&H>,
    src: &SourceRef,
    bad: &BadRecord,
) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(own.map_or(0, |h| h.count()) + 5);
    if let Some(h) = own {
        for header in h.iter() {
            headers = headers.insert(header);
        }
    }
    let partition = src.partition.to_string();
    let offset = src.offset.to_string();
    let time = bad.failed_ms.to_string();
    for (key, value) in [
        (HEADER_SOURCE_TOPIC, &*src.topic),
        (HEADER_SOURCE_PARTITION, partition.as_str()),
        (HEADER_SOURCE_OFFSET, offset.as_str()),
        (HEADER_ERROR, bad.reason.as_str()),
        (HEADER_ERROR_TIME, time.as_str()),
    ] {
        headers = headers.insert(Header {
            key,
            value: Some(value),
        });
    }
    headers
}

/// Writes a record the sink refused to its dead-letter topic, in the open transaction: key, value,
/// timestamp and headers as they were, plus headers naming its origin and the error.
fn send_dead_letter<M: Message>(
    sink: &mut Sink,
    dead_letter_topic: &str,
    partitions: i32,
    msg: &M,
    src: SourceRef,
    bad: &BadRecord,
) -> Result<()> {
    let headers = dead_letter_headers(msg.headers(), &src, bad);
    // Records of one source partition stay in order in the dead-letter topic too.
    let partition = src.partition.rem_euclid(partitions.max(1));
    sink.send(
        dead_letter_topic,
        partition,
        msg.key(),
        msg.payload(),
        Some(headers),
        msg.timestamp().to_millis(),
        src,
    )
}

/// One shared name per source topic, so that every record does not allocate its topic's name.
fn interned(names: &mut HashMap<String, Arc<str>>, topic: &str) -> Arc<str> {
    if let Some(t) = names.get(topic) {
        return t.clone();
    }
    let t: Arc<str> = topic.into();
    names.insert(topic.to_string(), t.clone());
    t
}

/// Wait between start-up attempts: 0.5 s doubling to at most 10 s.
fn startup_backoff(attempt: u32) -> Duration {
    Duration::from_millis((500u64 << attempt.min(5)).min(10_000))
}

/// Sleeps for `d`, or less when shutdown is requested.
fn sleep_unless_shutdown(token: &CancellationToken, d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end && !token.is_cancelled() {
        std::thread::sleep(
            Duration::from_millis(20).min(end.saturating_duration_since(Instant::now())),
        );
    }
}

/// One step of start-up, tried until it succeeds: the errors `retry` accepts (a cluster that is
/// down or restarting) are waited out with a growing pause and a log line per attempt, as the
/// running loop waits out an outage, instead of exiting for the orchestrator to retry blindly.
/// None when shutdown is requested while waiting.
fn wait_out<T>(
    shared: &Shared,
    step: &'static str,
    retry: impl Fn(&BridgeError) -> bool,
    mut f: impl FnMut() -> Result<T>,
) -> Result<Option<T>> {
    let mut attempt = 0u32;
    loop {
        if shared.shutdown.is_cancelled() {
            return Ok(None);
        }
        match f() {
            Ok(v) => {
                if attempt > 0 {
                    info!(step, attempts = attempt + 1, "start-up step succeeded");
                }
                return Ok(Some(v));
            }
            Err(e) if retry(&e) => {
                let pause = startup_backoff(attempt);
                attempt += 1;
                warn!(
                    step,
                    attempt,
                    retry_in_ms = pause.as_millis() as u64,
                    error = %e,
                    "start-up: waiting for the cluster"
                );
                // The loop is alive, only waiting: liveness must not restart it for that.
                status::update(&shared.status, |s| s.heartbeat = Instant::now());
                sleep_unless_shutdown(&shared.shutdown, pause);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Connects to both clusters before anything else: wrong credentials and untrusted certificates
/// stop start-up at once (librdkafka would only time out on them, step after step), and a cluster
/// no broker of answers stops it after `bridge.unreachable_timeout`.
fn preflight(cfg: &Config, shared: &Shared) -> Result<Option<()>> {
    let began = Instant::now();
    let limit = cfg.bridge.unreachable_timeout;
    let keep_waiting =
        |e: &BridgeError| matches!(e, BridgeError::Unreachable { .. }) && began.elapsed() < limit;
    wait_out(shared, "connect to the clusters", keep_waiting, || {
        let mut problems = crate::connectivity::probe_config(cfg);
        // A refused login is reported even while the other cluster is down.
        problems.sort_by_key(|p| p.trouble == crate::connectivity::Trouble::Unreachable);
        match problems.into_iter().next() {
            Some(p) => Err(p.into_error(began.elapsed())),
            None => Ok(()),
        }
    })
}

/// Runs the bridge until shutdown or a fatal error.
pub fn run(
    cfg: Arc<Config>,
    shared: Shared,
    commands: Receiver<Command>,
    restore: Option<Restore>,
) -> Result<()> {
    let result = match Pipeline::start(cfg, &shared, commands, restore) {
        Ok(Some(mut p)) => {
            let result = p.run_loop();
            p.explain_fencing(result)
        }
        Ok(None) => {
            info!(
                "shutdown requested during start-up; no transaction was begun, nothing to finish"
            );
            Ok(())
        }
        Err(e) => Err(e),
    };
    status::update(&shared.status, |s| match &result {
        Ok(()) => s.state = RunState::Stopped,
        Err(e) => {
            s.state = RunState::Failed;
            s.failure = Some(e.to_string());
        }
    });
    result
}

struct Pipeline<'a> {
    cfg: Arc<Config>,
    shared: &'a Shared,
    admin: Admin,
    store: Arc<CheckpointStore>,
    commands: Receiver<Command>,
    restore: Option<Restore>,
    /// A savepoint request waiting for the checkpoint that will carry its name.
    savepoint: Option<SavepointRequest>,
    source: Source,
    sink: Sink,
    router: Router,
    topics: BTreeMap<String, i32>,
    topic_names: HashMap<String, Arc<str>>,
    /// P(N-1): the positions of the last committed checkpoint (plus new partitions at their start).
    committed: Positions,
    last_id: u64,
    last_barrier: Instant,
    last_discovery: Instant,
    /// Records the sink refused for good, with `on_bad_record = "dead-letter"`: a replay writes them
    /// to their dead-letter topic. Dropped once a checkpoint past them commits.
    bad_records: HashMap<SourceRef, BadRecord>,
    /// Partition count of each dead-letter topic, once it is known to exist.
    dead_letter_partitions: HashMap<String, i32>,
    failures_in_row: u32,
    /// Id of a pending checkpoint written to sled in the current epoch, not yet committed.
    pending: Option<u64>,
    /// Since when discovery has found a listed source topic missing.
    topics_missing_since: Option<Instant>,
    /// The clusters and topic incarnations `committed` refers to; recorded in every checkpoint
    /// and commit marker.
    identity: Identity,
    /// Changes already logged and counted under `restart`.
    reported: BTreeSet<identity::Change>,
    /// Bound on output bytes in flight, fitted to the sink's measured delivery rate.
    in_flight: InFlightLimit,
    /// The layout this process runs in (exactly-once only), chosen at start-up.
    layout: Option<Layout>,
    /// Partitions of the marker topic: one per instance slot of any layout used so far.
    marker_partitions: i32,
    /// Whether this process committed the intent marker of its layout.
    intent_committed: bool,
    /// Transactional ids of lower layouts this process has fenced.
    fenced: BTreeSet<String>,
}

impl<'a> Pipeline<'a> {
    fn exactly_once(&self) -> bool {
        self.cfg.bridge.delivery == Delivery::ExactlyOnce
    }

    /// Connects, discovers and recovers, waiting out clusters that are down (None: shutdown was
    /// requested meanwhile).
    fn start(
        cfg: Arc<Config>,
        shared: &'a Shared,
        commands: Receiver<Command>,
        restore: Option<Restore>,
    ) -> Result<Option<Pipeline<'a>>> {
        let sink_kafka: Vec<(String, String)> = cfg
            .sink
            .kafka
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if preflight(&cfg, shared)?.is_none() {
            return Ok(None);
        }
        let admin = Admin::new(&cfg.sink.bootstrap_servers, &sink_kafka)?;
        let exactly_once = cfg.bridge.delivery == Delivery::ExactlyOnce;

        let transient = |e: &BridgeError| e.is_transient();

        // Missing ACLs stop start-up at once, each named with the command that grants it.
        let Some(optional) = wait_out(shared, "probe the permissions", transient, || {
            crate::acl::require(&cfg, &shared.runtime)
        })?
        else {
            return Ok(None);
        };
        for d in &optional {
            warn!(permission = %d.permission, grant = %d.command(), "optional permission missing: {}", d.permission.why);
        }

        // The timeout rule, before anything is consumed.
        let mut foreign_transaction_wait = Duration::ZERO;
        if exactly_once {
            let Some(max) = wait_out(shared, "read transaction.max.timeout.ms", transient, || {
                shared.runtime.block_on(admin.transaction_max_timeout_ms())
            })?
            else {
                return Ok(None);
            };
            cfg.check_broker_timeout(max)
                .map_err(|e| BridgeError::Config(crate::config::ConfigErrors(vec![e])))?;
            // No transaction on the sink cluster outlives the broker's maximum timeout plus the
            // coordinator's sweep for expired ones (10 s by default): past that, something hangs.
            foreign_transaction_wait =
                Duration::from_millis(max.max(0) as u64) + FOREIGN_TRANSACTION_MARGIN;
        }

        let store = shared.store.clone();
        let source = Source::new(&cfg)?;
        let router = Router::new(&cfg.sink.topic, cfg.sink.partitioning);

        let marker_partitions = if exactly_once {
            let Some(n) = wait_out(shared, "ensure the marker topic", transient, || {
                shared.runtime.block_on(
                    admin.ensure_marker_topic(&cfg.sink.marker_topic, cfg.bridge.instances),
                )
            })?
            else {
                return Ok(None);
            };
            n
        } else {
            1
        };
        let mut settings = SinkSettings {
            bootstrap_servers: cfg.sink.bootstrap_servers.clone(),
            kafka: sink_kafka,
            transactional_id: exactly_once.then(|| cfg.transactional_id()),
            transaction_timeout: cfg.transaction.timeout,
            marker_topic: cfg.sink.marker_topic.clone(),
            marker_partition: marker_partition(cfg.bridge.instance, marker_partitions),
            foreign_transaction_wait,
            bridge_id: cfg.bridge.id.clone(),
            instance: cfg.bridge.instance,
            marker_key: crate::marker::marker_key(&cfg.bridge.id, cfg.bridge.instance),
        };
        // The layout decides the transactional id, which init_transactions needs before any
        // committed read can be complete: guess it from everything written (recover() checks it
        // against the committed markers once our own earlier transactions are finished).
        let mut layout = None;
        if exactly_once {
            let Some(found) =
                wait_out(shared, "read the layouts of the bridge", transient, || {
                    read_bridge_markers(
                        &settings,
                        marker_partitions,
                        false,
                        CONNECT_DEADLINE,
                        &mut |_| {},
                    )
                })?
            else {
                return Ok(None);
            };
            let l = plan_layout(
                &cfg.bridge.id,
                cfg.bridge.instance,
                cfg.bridge.instances,
                None,
                &found,
                &[],
            )?
            .layout();
            settings.transactional_id = Some(layout_transactional_id(
                &cfg.bridge.id,
                l,
                cfg.bridge.instance,
            ));
            settings.marker_key = layout_marker_key(&cfg.bridge.id, l, cfg.bridge.instance);
            info!(layout = %l, transactional_id = ?settings.transactional_id, "layout chosen");
            shared.metrics.layout_generation.set(l.generation as i64);
            status::update(&shared.status, |s| {
                s.layout_generation = Some(l.generation);
                s.layout_instances = Some(l.instances);
            });
            layout = Some(l);
        }
        let Some(sink) = wait_out(shared, "initialise the sink producer", transient, || {
            Sink::connect(settings.clone(), CONNECT_DEADLINE)
        })?
        else {
            return Ok(None);
        };
        status::update(&shared.status, |s| s.transactions_ready = true);

        let cfg_in_flight_cap = cfg.sink.max_in_flight_bytes;
        let cfg_checkpoint_timeout = cfg.checkpoint.timeout;
        let mut p = Pipeline {
            cfg,
            shared,
            admin,
            store,
            commands,
            restore,
            savepoint: None,
            source,
            sink,
            router,
            topics: BTreeMap::new(),
            topic_names: HashMap::new(),
            committed: Positions::new(),
            last_id: 0,
            last_barrier: Instant::now(),
            last_discovery: Instant::now(),
            bad_records: HashMap::new(),
            dead_letter_partitions: HashMap::new(),
            failures_in_row: 0,
            pending: None,
            topics_missing_since: None,
            identity: Identity::default(),
            reported: BTreeSet::new(),
            in_flight: InFlightLimit::new(cfg_in_flight_cap, cfg_checkpoint_timeout),
            layout,
            marker_partitions,
            intent_committed: false,
            fenced: BTreeSet::new(),
        };
        p.publish_in_flight_limit();
        // A listed topic that is missing may be one a restarting broker does not know yet: wait a
        // little, then stop with the error that names it.
        let began = Instant::now();
        let missing_for_now = |e: &BridgeError| {
            e.is_transient()
                || (matches!(e, BridgeError::SourceTopicsMissing { .. })
                    && began.elapsed() < MISSING_TOPIC_WAIT)
        };
        if wait_out(
            shared,
            "discover the source topics",
            missing_for_now,
            || p.discover_topics(),
        )?
        .is_none()
        {
            return Ok(None);
        }
        if wait_out(shared, "recover", transient, || p.recover())?.is_none() {
            return Ok(None);
        }
        Ok(Some(p))
    }

    fn topic_name(&mut self, topic: &str) -> Arc<str> {
        interned(&mut self.topic_names, topic)
    }

    /// Finds the source topics, and makes sure each has a sink topic that can take its records.
    fn discover_topics(&mut self) -> Result<bool> {
        let found = self.source.discover()?;
        let mut changed = false;
        for (topic, partitions) in &found {
            if self.topics.get(topic) == Some(partitions) {
                continue;
            }
            changed = true;
            let sink_topic = self.router.sink_topic(topic).to_string();
            let existing = self.admin.partitions(&sink_topic)?;
            let n = match existing {
                Some(n) => n,
                None => {
                    self.shared.runtime.block_on(self.admin.create_topic(
                        &sink_topic,
                        *partitions,
                        &[],
                    ))?;
                    *partitions
                }
            };
            // `preserve` writes source partition p to sink partition p: the sink grows with the source.
            let n = if self.cfg.sink.partitioning == Partitioning::Preserve && n < *partitions {
                self.shared
                    .runtime
                    .block_on(self.admin.add_partitions(&sink_topic, *partitions))
                    .map_err(|e| {
                        BridgeError::Setup(format!(
                            "sink topic '{sink_topic}' has {n} partitions but source topic '{topic}' has \
                             {partitions}, and sink.partitioning = \"preserve\" needs at least as many: {e}"
                        ))
                    })?;
                self.sink.refresh_metadata(&sink_topic);
                *partitions
            } else {
                n
            };
            self.router.set_sink_partitions(&sink_topic, n);
            self.fit_batches_to(&sink_topic)?;
            self.shared
                .metrics
                .records_produced
                .with_label_values(&[&sink_topic]);
        }
        self.topics = found;
        self.last_discovery = Instant::now();
        self.topics_missing_since = None;
        Ok(changed)
    }

    /// Recovery: decide the starting positions from sled and the newest committed marker, make
    /// sled agree with the decision, and assign the source there.
    fn recover(&mut self) -> Result<()> {
        status::update(&self.shared.status, |s| {
            s.state = RunState::Recovering;
            s.partitions_assigned = false;
        });
        let loaded = self.store.load()?;
        for c in &loaded.corrupt {
            warn!(key = %c.key, id = ?c.id, reason = %c.reason, "skipping a corrupt checkpoint");
            self.shared.metrics.corrupt_checkpoints.inc();
            self.store.remove_key(&c.key)?;
        }
        let mut marker = None;
        if self.exactly_once() {
            match self.settle_layout()? {
                LayoutPlan::Resume { own, .. } => marker = own,
                // No lower layout to take over from: a late instance of the first layout, which
                // starts like the others did, from source.start.
                LayoutPlan::TakeOver { fence, .. } if fence.is_empty() => {}
                LayoutPlan::TakeOver {
                    positions,
                    next_id,
                    identity,
                    layout,
                    ..
                } => {
                    // A restore into this layout before its first commit: the restored checkpoint
                    // is newer than every marker and decides.
                    let restored_here = loaded.checkpoints.iter().any(|c| {
                        c.savepoint
                            .as_deref()
                            .is_some_and(|n| n.starts_with(RESTORED_PREFIX))
                            && c.instance == self.cfg.bridge.instance
                            && c.instances == self.cfg.bridge.instances
                            && c.id >= next_id
                    });
                    if self.restore.is_none() && !restored_here {
                        return self.take_over(
                            layout,
                            &loaded.checkpoints,
                            positions,
                            next_id,
                            identity,
                        );
                    }
                }
            }
        }
        let cfg = self.cfg.clone();
        self.pending = None;

        if let Some(restore) = self.restore.take() {
            let tag = restore.tag();
            if loaded
                .checkpoints
                .iter()
                .any(|c| c.savepoint.as_deref() == Some(tag.as_str()))
            {
                info!(tag = %tag, "this state directory already restored these savepoints; resuming normally");
            } else {
                return self.restore_from(&restore, &loaded.checkpoints, marker.as_ref());
            }
        }
        // After a restore into a new layout, the marker partition can still hold the old layout's
        // last marker until the first commit: the restored checkpoint is newer and wins.
        if let Some(m) = &marker {
            let foreign = m.bridge_id != cfg.bridge.id || m.instances != cfg.bridge.instances;
            let restored_after = loaded.checkpoints.iter().any(|c| {
                c.savepoint
                    .as_deref()
                    .is_some_and(|n| n.starts_with(RESTORED_PREFIX))
                    && c.id > m.checkpoint_id
            });
            if foreign && restored_after {
                marker = None;
            }
        }

        let decision = decide(
            &cfg.bridge.id,
            cfg.bridge.instance,
            cfg.bridge.instances,
            &loaded.checkpoints,
            marker.as_ref(),
            now_ms(),
        )?;
        for w in &decision.warnings {
            warn!(warning = %w, "recovery");
        }
        // Judged before sled is repaired, so that a stop leaves the state directory as it was.
        let positions = self.judge_recovered_identity(&decision)?;
        for id in &decision.discard {
            self.store.discard(*id)?;
        }
        if let Some(id) = decision.confirm {
            self.store.mark_committed(id)?;
        }
        if let Some(c) = &decision.adopt {
            self.store.put_committed(c)?;
        }
        self.last_id = decision.last_committed_id;
        self.start_from(positions, decision.outcome.as_str())
    }

    /// Reads the committed markers of the bridge and settles this process's layout: when the
    /// instance has not committed in its layout yet, it commits the layout's intent marker, fences
    /// the lower layouts' owners of its partitions and reads again, until a read asks to fence no
    /// one new (docs/design.md, "Rescaling"). A newer layout found stops the process.
    fn settle_layout(&mut self) -> Result<LayoutPlan> {
        let cfg = self.cfg.clone();
        let partitions: Vec<(String, i32)> = self
            .topics
            .iter()
            .flat_map(|(t, n)| (0..*n).map(move |p| (t.clone(), p)))
            .collect();
        loop {
            self.refresh_marker_partitions()?;
            let status = &self.shared.status;
            let metrics = &self.shared.metrics;
            let mut waited = Duration::ZERO;
            let found = read_bridge_markers(
                self.sink.settings(),
                self.marker_partitions,
                true,
                CONNECT_DEADLINE,
                &mut |wait| {
                    if let Some(w) = wait {
                        metrics
                            .marker_wait_seconds
                            .inc_by(w.waited.saturating_sub(waited).as_secs_f64());
                        waited = w.waited;
                    }
                    let why = wait.map(|w| {
                        format!(
                            "waiting for another producer's transaction on marker partition {}/{} \
                             (last stable offset {} < high watermark {}) for {:?}",
                            w.topic, w.partition, w.last_stable_offset, w.high_watermark, w.waited
                        )
                    });
                    status::update(status, |s| s.recovery_wait = why);
                },
            );
            status::update(status, |s| s.recovery_wait = None);
            let found = found?;
            let plan = plan_layout(
                &cfg.bridge.id,
                cfg.bridge.instance,
                cfg.bridge.instances,
                self.layout,
                &found,
                &partitions,
            )?;
            let LayoutPlan::TakeOver {
                layout,
                fence: owners,
                ..
            } = &plan
            else {
                status::update(status, |s| s.takeover = None);
                return Ok(plan);
            };
            let layout = *layout;
            if !self.intent_committed {
                status::update(status, |s| {
                    s.takeover = Some(format!("committing the intent marker of {layout}"))
                });
                self.commit_intent(layout)?;
                failpoint::hit("after-intent");
                self.intent_committed = true;
                continue;
            }
            let ids: Vec<String> = owners
                .iter()
                .map(|(l, i)| layout_transactional_id(&cfg.bridge.id, *l, *i))
                .filter(|id| !self.fenced.contains(id))
                .collect();
            if ids.is_empty() {
                status::update(status, |s| s.takeover = None);
                return Ok(plan);
            }
            for id in ids {
                status::update(status, |s| {
                    s.takeover = Some(format!("fencing {id} of an older layout"))
                });
                fence(self.sink.settings(), &id, CONNECT_DEADLINE)?;
                failpoint::hit("after-fence");
                self.fenced.insert(id);
            }
        }
    }

    /// Commits a transaction holding only this instance's intent marker: from its commit on, a
    /// process of a lower layout that starts finds the layout and stops.
    fn commit_intent(&mut self, layout: Layout) -> Result<()> {
        let cfg = &self.cfg.bridge;
        let intent = Marker {
            version: MARKER_VERSION,
            bridge_id: cfg.id.clone(),
            instance: cfg.instance,
            instances: layout.instances,
            checkpoint_id: 0,
            positions: Positions::new(),
            time_ms: now_ms(),
            identity: None,
        };
        self.sink.begin()?;
        let sent = self
            .sink
            .send_marker(&intent)
            .and_then(|()| self.sink.commit(Instant::now() + CONNECT_DEADLINE));
        if let Err(e) = sent {
            let _ = self.sink.abort(CONNECT_DEADLINE);
            return Err(e);
        }
        info!(layout = %layout, "committed the intent marker of a new layout");
        Ok(())
    }

    /// Starts a layout's instance that has not committed in it yet from the positions its
    /// partitions were last committed at in lower layouts. The state directory's checkpoints
    /// belong to a lower layout (or to an earlier attempt of this take-over) and go.
    fn take_over(
        &mut self,
        layout: Layout,
        checkpoints: &[Checkpoint],
        positions: Positions,
        next_id: u64,
        identity: Option<Identity>,
    ) -> Result<()> {
        let cfg = self.cfg.clone();
        let decision = Decision {
            outcome: RecoveryOutcome::TakenOver,
            positions: Some(positions),
            last_committed_id: next_id,
            discard: Vec::new(),
            confirm: None,
            adopt: None,
            warnings: Vec::new(),
            identity: identity.clone(),
            identity_origin: "the commit markers of the previous layout".to_string(),
        };
        let positions = self
            .judge_recovered_identity(&decision)?
            .unwrap_or_default();
        for c in checkpoints {
            self.store.forget(c.id)?;
        }
        self.store.put_committed(&Checkpoint {
            id: next_id,
            bridge_id: cfg.bridge.id.clone(),
            instance: cfg.bridge.instance,
            instances: cfg.bridge.instances,
            state: CheckpointState::Committed,
            positions: positions.clone(),
            created_ms: now_ms(),
            savepoint: None,
            identity,
        })?;
        failpoint::hit("after-takeover");
        info!(
            layout = %layout,
            checkpoint = next_id,
            partitions = positions.len(),
            fenced = ?self.fenced,
            "taking over the partitions of the previous layout"
        );
        self.last_id = next_id;
        self.start_from(Some(positions), RecoveryOutcome::TakenOver.as_str())
    }

    /// Learns the marker topic's partition count anew: a layout with more instances grows it
    /// before it writes its intent there, and a read must cover every partition that exists when it
    /// begins (the intent argument in docs/design.md, "Rescaling").
    fn refresh_marker_partitions(&mut self) -> Result<()> {
        if let Some(n) = self.admin.partitions(&self.cfg.sink.marker_topic)? {
            self.marker_partitions = self.marker_partitions.max(n);
        }
        Ok(())
    }

    /// A fenced process looks for the newer layout that fenced it, to say so.
    fn explain_fencing(&mut self, result: Result<()>) -> Result<()> {
        let Err(BridgeError::Fenced { .. }) = &result else {
            return result;
        };
        let Some(layout) = self.layout else {
            return result;
        };
        let found = self.refresh_marker_partitions().and_then(|()| {
            read_bridge_markers(
                self.sink.settings(),
                self.marker_partitions,
                true,
                CONNECT_DEADLINE,
                &mut |_| {},
            )
        });
        if let Ok(found) = found {
            let cfg = &self.cfg.bridge;
            if let Err(e) = plan_layout(
                &cfg.id,
                cfg.instance,
                cfg.instances,
                Some(layout),
                &found,
                &[],
            ) {
                error!(error = %e, "fenced by a newer layout");
                return Err(e.into());
            }
        }
        result
    }

    /// `run --from-savepoint`: the savepoints' positions (of the partitions this instance owns)
    /// become a committed checkpoint numbered above everything seen so far, and the bridge starts
    /// there. Its first commit writes a marker in the new layout.
    fn restore_from(
        &mut self,
        restore: &Restore,
        checkpoints: &[Checkpoint],
        marker: Option<&Marker>,
    ) -> Result<()> {
        let cfg = self.cfg.clone();
        let merged = restore
            .positions(&cfg.bridge.id, cfg.bridge.instance, cfg.bridge.instances)
            .map_err(|e| BridgeError::Setup(e.to_string()))?;
        if let Some(c) = checkpoints.iter().find(|c| {
            c.bridge_id != cfg.bridge.id
                || c.instances != cfg.bridge.instances
                || c.instance != cfg.bridge.instance
        }) {
            return Err(BridgeError::Setup(format!(
                "state directory {} holds checkpoints of bridge '{}' instance {} of {}; restore a savepoint into a \
                 new layout with an empty state directory",
                cfg.bridge.state_dir.display(),
                c.bridge_id,
                c.instance,
                c.instances
            )));
        }
        for c in checkpoints
            .iter()
            .filter(|c| c.state == CheckpointState::Pending)
        {
            self.store.discard(c.id)?;
        }
        let owned = self.source.owned(&self.topics);
        let positions: Positions = owned
            .iter()
            .filter_map(|(t, p)| merged.get(t, *p).map(|o| (t.clone(), *p, o)))
            .collect();
        let id = checkpoints
            .iter()
            .map(|c| c.id)
            .chain(marker.map(|m| m.checkpoint_id))
            .chain([restore.max_checkpoint_id()])
            .max()
            .unwrap_or(0)
            + 1;
        let now = self.restored_identity(restore, &positions)?;
        self.store.put_committed(&self.committed_checkpoint(
            id,
            positions.clone(),
            Some(restore.tag()),
            Some(now),
        ))?;
        info!(tag = %restore.tag(), checkpoint = id, partitions = positions.len(), "restored from savepoint");
        self.last_id = id;
        self.start_from(Some(positions), "restored_from_savepoint")
    }

    /// A committed checkpoint of this instance's layout, stamped now.
    fn committed_checkpoint(
        &self,
        id: u64,
        positions: Positions,
        savepoint: Option<String>,
        identity: Option<Identity>,
    ) -> Checkpoint {
        Checkpoint {
            id,
            bridge_id: self.cfg.bridge.id.clone(),
            instance: self.cfg.bridge.instance,
            instances: self.cfg.bridge.instances,
            state: CheckpointState::Committed,
            positions,
            created_ms: now_ms(),
            savepoint,
            identity,
        }
    }

    /// Assigns the source at `saved` (None: the configured start position), with every owned
    /// partition the positions do not know read from its beginning.
    fn start_from(&mut self, saved: Option<Positions>, outcome: &'static str) -> Result<()> {
        let cfg = self.cfg.clone();
        self.shared
            .metrics
            .recoveries
            .with_label_values(&[outcome])
            .inc();
        let owned = self.source.owned(&self.topics);
        // Nothing committed yet: the start positions an earlier run resolved, if it kept any.
        let first_run = saved.is_none();
        let saved = match saved {
            Some(s) => Some(s),
            None => self.kept_start()?,
        };
        let had_state = saved.is_some();
        let saved = saved.unwrap_or_default();
        let mut positions = Positions::new();
        let mut missing = Vec::new();
        for (t, p) in &owned {
            match saved.get(t, *p) {
                Some(o) => positions.set(t, *p, o),
                None => missing.push((t.clone(), *p)),
            }
        }
        // Partitions a checkpoint does not know appeared after it: read them from their start.
        let start = if had_state {
            StartPosition::Earliest
        } else {
            cfg.source.start
        };
        for (t, p, o) in self.source.resolve(start, &missing)?.iter() {
            positions.set(t, p, o);
        }
        self.check_out_of_range(&mut positions)?;
        if first_run {
            self.store.put_resolved_start(&self.committed_checkpoint(
                0,
                positions.clone(),
                None,
                None,
            ))?;
            if had_state {
                info!(
                    "no checkpoint yet: starting from the start positions kept by an earlier run"
                );
            } else {
                info!(start = %cfg.source.start, "resolved source.start; the positions are kept until the first checkpoint");
            }
        }
        self.source.assign(&positions)?;
        for (t, p, _) in positions.iter() {
            self.shared.metrics.preset_partition(t, p);
        }
        self.committed = positions;
        info!(
            outcome,
            last_checkpoint = self.last_id,
            partitions = self.committed.len(),
            "recovered"
        );
        self.publish_positions();
        status::update(&self.shared.status, |s| {
            s.state = RunState::Running;
            s.partitions_assigned = true;
            s.last_checkpoint_id = self.last_id;
        });
        Ok(())
    }

    /// The start positions a run before the first commit resolved and kept, if they are this
    /// instance's. An unreadable or foreign entry is as good as none: resolve again.
    fn kept_start(&self) -> Result<Option<Positions>> {
        let cfg = &self.cfg.bridge;
        match self.store.resolved_start() {
            Ok(Some(c))
                if c.bridge_id == cfg.id
                    && c.instance == cfg.instance
                    && c.instances == cfg.instances =>
            {
                Ok(Some(c.positions))
            }
            Ok(Some(c)) => {
                warn!(
                    bridge_id = %c.bridge_id, instance = c.instance, instances = c.instances,
                    "ignoring start positions kept for another bridge or layout; resolving source.start again"
                );
                Ok(None)
            }
            Ok(None) => Ok(None),
            Err(e @ crate::checkpoint::StoreError::Corrupt { .. }) => {
                warn!(error = %e, "ignoring unreadable kept start positions; resolving source.start again");
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Positions that retention has deleted under us: fail, or continue from the earliest record
    /// and count what was lost, as configured.
    fn check_out_of_range(&mut self, positions: &mut Positions) -> Result<()> {
        let snapshot: Vec<(String, i32, i64)> = positions
            .iter()
            .map(|(t, p, o)| (t.to_string(), p, o))
            .collect();
        let mut explained = BTreeSet::new();
        let mut restarted = BTreeSet::new();
        for (t, p, o) in snapshot {
            if restarted.contains(&t) {
                continue;
            }
            let (lo, hi) = self.source.watermarks(&t, p)?;
            if o >= lo && o <= hi {
                continue;
            }
            if explained.insert(t.clone()) {
                restarted.extend(self.identity_explains(&t, positions)?);
                if restarted.contains(&t) {
                    continue;
                }
            }
            let lost = if o < lo { lo - o } else { 0 };
            match self.cfg.source.on_offset_out_of_range {
                OutOfRange::Fail => {
                    return Err(BridgeError::OffsetOutOfRange {
                        topic: t,
                        partition: p,
                        position: o,
                        earliest: lo,
                        lost,
                    })
                }
                OutOfRange::Earliest => {
                    error!(
                        topic = %t, partition = p, position = o, earliest = lo, lost,
                        "source records were deleted by retention before they were read; continuing from the earliest"
                    );
                    self.shared
                        .metrics
                        .records_lost
                        .with_label_values(&[t.as_str(), &p.to_string()])
                        .inc_by(lost as u64);
                    positions.set(&t, p, lo);
                }
            }
        }
        Ok(())
    }

    fn publish_positions(&self) {
        let mut parts = Vec::with_capacity(self.committed.len());
        for (t, p, o) in self.committed.iter() {
            let lso = self.source.cached_high_watermark(t, p);
            let lag = lso.map(|h| (h - o).max(0));
            if let Some(l) = lag {
                self.shared
                    .metrics
                    .consumer_lag
                    .with_label_values(&[t, &p.to_string()])
                    .set(l);
            }
            parts.push(PartitionStatus {
                topic: t.to_string(),
                partition: p,
                position: o,
                last_stable_offset: lso,
                lag,
            });
        }
        status::update(&self.shared.status, |s| s.partitions = parts);
    }

    fn run_loop(&mut self) -> Result<()> {
        loop {
            if self.shutdown_requested() {
                status::update(&self.shared.status, |s| s.state = RunState::Draining);
            }
            match self.epoch() {
                Ok(()) => {
                    self.failures_in_row = 0;
                    if self.shutdown_requested() {
                        info!(
                            checkpoint = self.last_id,
                            "final checkpoint committed; stopping"
                        );
                        return Ok(());
                    }
                }
                Err(e) => {
                    if self.shutdown_requested() {
                        // Leave no open transaction behind; recovery resumes from the last commit.
                        let _ = self.sink.abort(self.cfg.checkpoint.timeout);
                        return Err(BridgeError::Setup(format!(
                            "the final checkpoint failed during shutdown ({e}); nothing is lost: the next start \
                             resumes from checkpoint {}",
                            self.last_id
                        )));
                    }
                    self.handle_failure(e)?;
                }
            }
            if self.last_discovery.elapsed() >= DISCOVERY_INTERVAL {
                self.discover_partitions()?;
                self.check_identity()?;
            }
        }
    }

    fn shutdown_requested(&self) -> bool {
        self.shared.shutdown.is_cancelled()
    }

    /// New partitions (and, with a pattern, new topics) join at their earliest offset.
    fn discover_partitions(&mut self) -> Result<()> {
        match self.discover_topics() {
            Ok(false) => Ok(()),
            Ok(true) => {
                let owned = self.source.owned(&self.topics);
                let new: Vec<(String, i32)> = owned
                    .into_iter()
                    .filter(|(t, p)| self.committed.get(t, *p).is_none())
                    .collect();
                if new.is_empty() {
                    return Ok(());
                }
                let start = self.source.resolve(StartPosition::Earliest, &new)?;
                for (t, p, o) in start.iter() {
                    info!(topic = t, partition = p, offset = o, "new source partition");
                    self.committed.set(t, p, o);
                }
                self.source.assign(&self.committed)
            }
            Err(e @ BridgeError::SourceTopicsMissing { .. }) => {
                let since = *self.topics_missing_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= MISSING_TOPIC_WAIT {
                    return Err(e);
                }
                warn!(
                    error = %e,
                    missing_for_s = since.elapsed().as_secs(),
                    stop_after_s = MISSING_TOPIC_WAIT.as_secs(),
                    "listed source topics are missing; the bridge stops if they stay missing"
                );
                Ok(())
            }
            Err(e) if e.action() == Action::Stop => Err(e),
            Err(e) => {
                warn!(error = %e, "partition discovery failed; will retry");
                Ok(())
            }
        }
    }

    fn epoch(&mut self) -> Result<()> {
        let id = self.last_id + 1;
        let cfg = self.cfg.clone();
        let epoch_start = Instant::now();
        // Barriers follow the interval; but when a checkpoint took longer than the interval, the
        // next epoch still reads for a quarter of it, so that slow commits never starve reading.
        let barrier_at = (self.last_barrier + cfg.checkpoint.interval)
            .max(epoch_start + cfg.checkpoint.min_pause)
            .max(epoch_start + cfg.checkpoint.interval / 4);
        status::update(&self.shared.status, |s| {
            s.epoch_started_at = Some(epoch_start);
            s.heartbeat = epoch_start;
        });
        if self.savepoint.is_none() {
            if let Ok(Command::Savepoint { name, stop, reply }) = self.commands.try_recv() {
                self.savepoint = Some((name, stop, reply));
            }
        }
        let savepoint_name = self.savepoint.as_ref().map(|(n, _, _)| n.clone());

        self.sink.begin()?;
        let mut current = self.committed.clone();
        let mut consumed: HashMap<Arc<str>, u64> = HashMap::new();
        let mut produced: HashMap<Arc<str>, u64> = HashMap::new();
        let mut dead_lettered: Vec<SourceRef> = Vec::new();
        let mut samples: Vec<i64> = Vec::new();
        let mut count: u64 = 0;
        // at-most-once checkpoints positions before producing, so it holds the epoch's records.
        let mut held: Vec<OwnedMessage> = Vec::new();
        let at_most_once = cfg.bridge.delivery == Delivery::AtMostOnce;
        // Output bytes of this epoch, against checkpoint.max_bytes.
        let mut epoch_bytes: u64 = 0;
        let mut trigger = "interval";

        loop {
            let now = Instant::now();
            if self.shutdown_requested() {
                trigger = "shutdown";
                break;
            }
            if now >= barrier_at {
                break;
            }
            if epoch_bytes >= cfg.checkpoint.max_bytes {
                trigger = "size";
                break;
            }
            // Waited out before a record is read, not after: a record read is in the epoch's
            // positions and must be sent in it. A record may overshoot the limit by its size.
            if !at_most_once
                && !self
                    .sink
                    .wait_in_flight_below(self.in_flight.bytes(), barrier_at)
            {
                break;
            }
            let wait = barrier_at
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(100));
            let msg = match self.source.poll(wait) {
                None => {
                    status::update(&self.shared.status, |s| s.heartbeat = Instant::now());
                    continue;
                }
                Some(Err(KafkaError::MessageConsumption(RDKafkaErrorCode::AutoOffsetReset))) => {
                    // Retention deleted our position: abort, and let the abort path apply the policy.
                    return Err(BridgeError::kafka(
                        "consume",
                        KafkaError::MessageConsumption(RDKafkaErrorCode::AutoOffsetReset),
                    ));
                }
                Some(Err(e)) => {
                    warn!(error = %e, "source consumer error");
                    continue;
                }
                Some(Ok(m)) => m,
            };
            let src_topic = interned(&mut self.topic_names, msg.topic());
            current.set(&src_topic, msg.partition(), msg.offset() + 1);
            *consumed.entry(src_topic.clone()).or_default() += 1;
            let ts = msg.timestamp().to_millis();
            if count.is_multiple_of(LATENCY_SAMPLE) {
                if let Some(ts) = ts {
                    samples.push(ts);
                }
            }
            count += 1;
            let src = SourceRef {
                topic: src_topic,
                partition: msg.partition(),
                offset: msg.offset(),
            };
            epoch_bytes += (msg.key_len() + msg.payload_len()) as u64;
            if let Some(bad) = (!self.bad_records.is_empty())
                .then(|| self.bad_records.get(&src))
                .flatten()
            {
                let topic = cfg.dead_letter_topic_for(&src.topic);
                let partitions = self
                    .dead_letter_partitions
                    .get(&topic)
                    .copied()
                    .unwrap_or(1);
                dead_lettered.push(src.clone());
                send_dead_letter(&mut self.sink, &topic, partitions, &msg, src, bad)?;
                continue;
            }
            let (sink_topic, partition) =
                self.router.route(msg.topic(), msg.partition(), msg.key());
            *produced.entry(sink_topic.clone()).or_default() += 1;
            if at_most_once {
                held.push(msg.detach());
                continue;
            }
            self.sink.send(
                &sink_topic,
                partition,
                msg.key(),
                msg.payload(),
                msg.headers().map(|h| h.detach()),
                ts,
                src,
            )?;
            if count == 1 {
                failpoint::hit("after-produce");
            }
        }

        // Barrier: P(N) = current.
        let barrier = Instant::now();
        self.last_barrier = barrier;
        self.shared
            .metrics
            .epochs_ended
            .with_label_values(&[trigger])
            .inc();
        self.verify_epoch(&consumed, &produced)?;
        let identity = Some(self.identity.clone());
        let deadline = barrier + cfg.checkpoint.timeout;
        // One time for the checkpoint and its savepoint reply.
        let barrier_ms = now_ms();
        let checkpoint = |state| Checkpoint {
            id,
            bridge_id: cfg.bridge.id.clone(),
            instance: cfg.bridge.instance,
            instances: cfg.bridge.instances,
            state,
            positions: current.clone(),
            created_ms: barrier_ms,
            savepoint: savepoint_name.clone(),
            identity: identity.clone(),
        };
        match cfg.bridge.delivery {
            Delivery::ExactlyOnce => {
                let marker = Marker {
                    version: MARKER_VERSION,
                    bridge_id: cfg.bridge.id.clone(),
                    instance: cfg.bridge.instance,
                    instances: cfg.bridge.instances,
                    checkpoint_id: id,
                    positions: current.clone(),
                    time_ms: barrier_ms,
                    identity: identity.clone(),
                };
                self.sink.send_marker(&marker)?;
                failpoint::hit("after-marker");
                self.flush_until(id, deadline)?;
                failpoint::hit("after-flush");
                self.store
                    .write_pending(&checkpoint(CheckpointState::Pending))?;
                self.pending = Some(id);
                failpoint::hit("after-precommit");
                let t = Instant::now();
                self.sink
                    .commit(deadline)
                    .map_err(|e| self.sink.classify(e))?;
                self.shared
                    .metrics
                    .commit_duration
                    .observe(t.elapsed().as_secs_f64());
                failpoint::hit("after-commit");
                self.pending = None;
                self.store.mark_committed(id)?;
                failpoint::hit("after-mark-committed");
            }
            Delivery::AtLeastOnce => {
                self.flush_until(id, deadline)?;
                self.sink.commit(deadline)?;
                self.store
                    .put_committed(&checkpoint(CheckpointState::Committed))?;
            }
            Delivery::AtMostOnce => {
                self.store
                    .put_committed(&checkpoint(CheckpointState::Committed))?;
                // The epoch is checkpointed before a record is written: from here on a failure
                // must rewind to these positions, not to the previous checkpoint's, or the
                // records already written would be written again.
                self.committed = current.clone();
                self.last_id = id;
                for m in held.drain(..) {
                    let (sink_topic, partition) =
                        self.router.route(m.topic(), m.partition(), m.key());
                    let src = SourceRef {
                        topic: self.topic_name(m.topic()),
                        partition: m.partition(),
                        offset: m.offset(),
                    };
                    let headers = m.headers().cloned();
                    // Past the deadline the flush below times out; sending on is still the best
                    // chance of delivering what was checkpointed.
                    self.sink
                        .wait_in_flight_below(self.in_flight.bytes(), deadline);
                    self.sink.send(
                        &sink_topic,
                        partition,
                        m.key(),
                        m.payload(),
                        headers,
                        m.timestamp().to_millis(),
                        src,
                    )?;
                }
                // A failure now loses the epoch's records: that is what at-most-once promises. A
                // bad record still stops the bridge, as it does in the other modes.
                match self.flush_until(id, deadline) {
                    Err(e) if blamed_record(&e).is_some() => return Err(e),
                    Err(e) => {
                        warn!(error = %e, "at-most-once: records of this epoch were not all delivered")
                    }
                    Ok(()) => {}
                }
                self.sink.commit(deadline)?;
            }
        }

        // Committed.
        if let Some((name, stop, reply)) = self.savepoint.take() {
            let sp = Savepoint::from_checkpoint(&checkpoint(CheckpointState::Committed));
            info!(savepoint = %name, checkpoint = id, stop, "savepoint taken");
            if stop {
                self.shared.shutdown.cancel();
            }
            let _ = reply.send(sp.ok_or_else(|| "the savepoint lost its name".to_string()));
        }
        let m = &self.shared.metrics;
        let done_ms = now_ms();
        for (t, n) in consumed {
            m.records_consumed.with_label_values(&[&t]).inc_by(n);
        }
        for (t, n) in produced {
            m.records_produced.with_label_values(&[&t]).inc_by(n);
        }
        for src in &dead_lettered {
            m.records_dead_lettered
                .with_label_values(&[&src.topic])
                .inc();
            info!(
                record = %format_args!("{}/{}@{}", src.topic, src.partition, src.offset),
                dead_letter_topic = %cfg.dead_letter_topic_for(&src.topic),
                checkpoint = id,
                "bad record dead-lettered"
            );
        }
        for ts in samples {
            m.end_to_end_latency
                .observe(((done_ms - ts).max(0) as f64) / 1000.0);
        }
        m.checkpoints.with_label_values(&["completed"]).inc();
        m.checkpoint_duration
            .observe(barrier.elapsed().as_secs_f64());
        m.last_checkpoint_id.set(id as i64);
        m.last_checkpoint_timestamp.set(done_ms / 1000);
        self.committed = current;
        self.last_id = id;
        // A bad record behind the committed positions is never read again.
        if !self.bad_records.is_empty() {
            let committed = &self.committed;
            self.bad_records.retain(|src, _| {
                committed
                    .get(&src.topic, src.partition)
                    .is_none_or(|o| o <= src.offset)
            });
        }
        self.publish_positions();
        status::update(&self.shared.status, |s| {
            s.last_checkpoint_id = id;
            s.last_checkpoint_time_ms = Some(done_ms);
            s.last_checkpoint_at = Some(Instant::now());
            s.heartbeat = Instant::now();
        });
        Ok(())
    }

    fn flush_until(&mut self, id: u64, deadline: Instant) -> Result<()> {
        let left = deadline.saturating_duration_since(Instant::now());
        let began = Instant::now();
        let reported = self.sink.reported_bytes();
        let in_flight = self.sink.in_flight_bytes();
        let flushed = self.sink.flush(left);
        let delivered = self.sink.reported_bytes().saturating_sub(reported);
        let took = began.elapsed();
        match flushed {
            Err(BridgeError::Kafka {
                source: KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut),
                ..
            }) => {
                let before = self.in_flight.bytes();
                self.in_flight.timed_out(delivered, took);
                warn!(
                    checkpoint = id,
                    in_flight_bytes = in_flight,
                    delivered_bytes = delivered,
                    flush_ms = took.as_millis() as u64,
                    limit_before = before,
                    limit_after = self.in_flight.bytes(),
                    "the sink delivers slower than checkpoint.timeout allows; shrinking the in-flight limit"
                );
                self.publish_in_flight_limit();
                Err(BridgeError::CheckpointTimeout {
                    id,
                    step: "flush",
                    timeout: self.cfg.checkpoint.timeout,
                })
            }
            Ok(()) => {
                self.in_flight.flushed(delivered, took);
                self.publish_in_flight_limit();
                Ok(())
            }
            other => other,
        }
    }

    fn publish_in_flight_limit(&self) {
        let limit = self.in_flight.bytes();
        self.shared
            .metrics
            .in_flight_limit_bytes
            .set(i64::try_from(limit).unwrap_or(i64::MAX));
        status::update(&self.shared.status, |s| s.in_flight_limit_bytes = limit);
    }

    /// The abort path, the rebuild path, or stop, as the error's class says. A bad record stops
    /// the bridge, or is set aside for the dead-letter topic, as `sink.on_bad_record` says.
    fn handle_failure(&mut self, e: BridgeError) -> Result<()> {
        let e = self.sink.classify(e);
        let bad = blamed_record(&e).map(|(topic, partition, offset, bad)| {
            let src = SourceRef {
                topic: self.topic_name(topic),
                partition,
                offset,
            };
            (src, bad)
        });
        // Dead letters need the epoch replayed, which at-most-once cannot (it checkpointed past
        // the epoch already); and a bad record seen before is one the dead-letter topic refused.
        let dead_letter = self.cfg.sink.on_bad_record == OnBadRecord::DeadLetter
            && self.cfg.bridge.delivery != Delivery::AtMostOnce;
        let bad_stops = bad
            .as_ref()
            .is_some_and(|(src, _)| !dead_letter || self.bad_records.contains_key(src));
        let action = if bad_stops { Action::Stop } else { e.action() };
        self.shared
            .metrics
            .transactions_aborted
            .with_label_values(&[e.reason()])
            .inc();
        self.shared
            .metrics
            .checkpoints
            .with_label_values(&[if action == Action::Stop {
                "failed"
            } else {
                "aborted"
            }])
            .inc();
        if action == Action::Stop {
            let aborted = self.abort_before_stop();
            let e = match bad {
                Some((src, bad)) => self.bad_record_error(&src, &bad, aborted),
                None => e,
            };
            error!(error = %e, "stopping");
            return Err(e);
        }
        if let Some((src, bad)) = bad {
            return self.set_aside(src, bad);
        }
        self.failures_in_row += 1;
        warn!(error = %e, action = ?action, checkpoint = self.last_id + 1, "checkpoint failed");

        if action != Action::Rebuild {
            match self.abort_and_rewind() {
                Ok(()) => {
                    self.pause();
                    return Ok(());
                }
                Err(abort_err) if abort_err.action() == Action::Stop => return Err(abort_err),
                Err(abort_err) => {
                    warn!(error = %abort_err, "abort failed; rebuilding the producer")
                }
            }
        }
        self.rebuild_and_recover()
    }

    /// Leaves no open transaction behind a stop: read_committed consumers of its partitions would
    /// wait for the coordinator's timeout otherwise. Bounded by checkpoint.timeout; says whether
    /// the transaction is gone.
    fn abort_before_stop(&mut self) -> bool {
        match self.sink.abort(self.cfg.checkpoint.timeout) {
            Ok(()) => true,
            Err(e) => {
                warn!(
                    error = %e,
                    "aborting the open transaction before stopping failed; the coordinator aborts it after transaction.timeout"
                );
                false
            }
        }
    }

    /// The error a bad record stops the bridge with: the record, the broker's error, what became
    /// of the epoch, and the fix.
    fn bad_record_error(&self, src: &SourceRef, bad: &BadRecord, aborted: bool) -> BridgeError {
        let cfg = &self.cfg;
        let sink_topic = cfg.sink_topic_for(&src.topic);
        let (refused_by, fix) = if self.bad_records.contains_key(src) {
            let dlq = cfg.dead_letter_topic_for(&src.topic);
            (
                format!("sink topic '{sink_topic}' nor to its dead-letter topic '{dlq}'"),
                fix_for(bad.code, &dlq),
            )
        } else {
            let dead_letter = if cfg.bridge.delivery == Delivery::AtMostOnce {
                ""
            } else {
                ", or set [sink] on_bad_record = \"dead-letter\" to write such records to a dead-letter topic and go on"
            };
            (
                format!("sink topic '{sink_topic}'"),
                format!("{}{dead_letter}", fix_for(bad.code, &sink_topic)),
            )
        };
        let resume = self.last_id;
        let outcome = match cfg.bridge.delivery {
            Delivery::ExactlyOnce if aborted => format!(
                "The bridge stopped with the transaction of checkpoint {} aborted, so nothing of it is visible; a \
                 restart resumes from checkpoint {resume} and stops here again until the fix",
                resume + 1
            ),
            Delivery::ExactlyOnce => format!(
                "The bridge stopped; the transaction of checkpoint {} could not be aborted and is aborted by the \
                 coordinator after transaction.timeout, so nothing of it becomes visible; a restart resumes from \
                 checkpoint {resume} and stops here again until the fix",
                resume + 1
            ),
            Delivery::AtLeastOnce => format!(
                "The bridge stopped; a restart resumes from checkpoint {resume}, writes again what this epoch \
                 delivered before the record (at-least-once), and stops here again until the fix"
            ),
            Delivery::AtMostOnce => "The bridge stopped; at-most-once had checkpointed past this epoch's records \
                 before writing them, so this record and the epoch's records not yet written are lost, and a \
                 restart continues after them"
                .to_string(),
        };
        BridgeError::PoisonRecord(Box::new(BadRecordStop {
            topic: src.topic.to_string(),
            partition: src.partition,
            offset: src.offset,
            refused_by,
            reason: bad.reason.clone(),
            outcome,
            fix,
        }))
    }

    /// Dead-letter mode: aborts the epoch, makes sure the record's dead-letter topic exists, and
    /// remembers the record, so that the replay (from the last checkpoint, at once) writes it
    /// there instead of to the sink.
    fn set_aside(&mut self, src: SourceRef, bad: BadRecord) -> Result<()> {
        let dlq = self.cfg.dead_letter_topic_for(&src.topic);
        warn!(
            record = %format_args!("{}/{}@{}", src.topic, src.partition, src.offset),
            error = %bad.reason,
            dead_letter_topic = %dlq,
            checkpoint = self.last_id + 1,
            "the sink refuses this record for good; replaying the checkpoint with it written to the dead-letter topic"
        );
        match self.abort_and_rewind() {
            Ok(()) => {}
            Err(e) if e.action() == Action::Stop => return Err(e),
            Err(e) => {
                warn!(error = %e, "abort failed; rebuilding the producer");
                self.rebuild_and_recover()?;
            }
        }
        self.ensure_dead_letter_topic(&src.topic, &dlq)?;
        self.bad_records.insert(src, bad);
        Ok(())
    }

    /// Creates a dead-letter topic that does not exist (with its source topic's partition count),
    /// learns its partitions, and fits the producer's batches to it.
    fn ensure_dead_letter_topic(&mut self, source_topic: &str, dlq: &str) -> Result<()> {
        if self.dead_letter_partitions.contains_key(dlq) {
            return Ok(());
        }
        let partitions = match self.admin.partitions(dlq)? {
            Some(n) => n,
            None => {
                let n = self.topics.get(source_topic).copied().unwrap_or(1);
                self.shared
                    .runtime
                    .block_on(self.admin.create_topic(dlq, n, &[]))?;
                n
            }
        };
        self.fit_batches_to(dlq)?;
        self.dead_letter_partitions
            .insert(dlq.to_string(), partitions);
        Ok(())
    }

    /// Keeps the producer's batches within a sink topic's max.message.bytes (see
    /// `Sink::cap_batch_size`); call with no transaction open.
    fn fit_batches_to(&mut self, topic: &str) -> Result<()> {
        match self
            .shared
            .runtime
            .block_on(self.admin.max_message_bytes(topic))
        {
            Ok(limit) => self
                .sink
                .cap_batch_size(topic, limit, CONNECT_DEADLINE)
                .map_err(|e| self.sink.classify(e)),
            Err(e) => {
                warn!(
                    topic,
                    error = %e,
                    "cannot read the topic's max.message.bytes: batches of small records may exceed it"
                );
                Ok(())
            }
        }
    }

    fn abort_and_rewind(&mut self) -> Result<()> {
        self.sink
            .abort(self.cfg.checkpoint.timeout)
            .map_err(|e| self.sink.classify(e))?;
        if let Some(id) = self.pending.take() {
            self.store.discard(id)?;
        }
        let mut positions = self.committed.clone();
        self.check_out_of_range(&mut positions)?;
        self.committed = positions;
        self.source.assign(&self.committed)
    }

    /// Drops the producer, builds a new one and recovers from the marker, until that succeeds, a
    /// stop-class error occurs, or shutdown is requested. A cluster that is down for hours is
    /// waited out, not given up on.
    fn rebuild_and_recover(&mut self) -> Result<()> {
        loop {
            self.shared.metrics.producer_rebuilds.inc();
            let attempt = self
                .sink
                .rebuild(CONNECT_DEADLINE)
                .map_err(|e| self.sink.classify(e))
                .and_then(|()| self.recover());
            match attempt {
                Ok(()) => return Ok(()),
                Err(e) if e.action() == Action::Stop => return Err(e),
                Err(e) => {
                    warn!(error = %e, "recovery failed; retrying");
                    self.failures_in_row += 1;
                    self.pause();
                    if self.shutdown_requested() {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Backoff between failed epochs: 100 ms doubling to 10 s, cut short by shutdown.
    fn pause(&self) {
        let ms = (100u64 << self.failures_in_row.min(7)).min(10_000);
        let token = self.shared.shutdown.clone();
        let end = Instant::now() + Duration::from_millis(ms);
        while Instant::now() < end && !token.is_cancelled() {
            std::thread::sleep(
                Duration::from_millis(20).min(end.saturating_duration_since(Instant::now())),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(offset: i64, code: RDKafkaErrorCode) -> BridgeError {
        BridgeError::Delivery {
            topic: "in".into(),
            partition: 3,
            offset,
            reason: format!("{code:?}"),
            code: Some(code),
        }
    }

    #[test]
    fn only_a_records_own_permanent_error_blames_it() {
        let e = delivery(42, RDKafkaErrorCode::MessageSizeTooLarge);
        let (topic, partition, offset, bad) = blamed_record(&e).unwrap();
        assert_eq!((topic, partition, offset), ("in", 3, 42));
        assert_eq!(bad.code, Some(RDKafkaErrorCode::MessageSizeTooLarge));
        assert!(blamed_record(&delivery(42, RDKafkaErrorCode::InvalidRecord)).is_some());
        // Collateral and passing errors blame nobody; neither does the commit marker's failure.
        for code in [
            RDKafkaErrorCode::State,
            RDKafkaErrorCode::PurgeQueue,
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::NotEnoughReplicas,
        ] {
            assert!(blamed_record(&delivery(42, code)).is_none(), "{code:?}");
        }
        assert!(blamed_record(&delivery(-1, RDKafkaErrorCode::MessageSizeTooLarge)).is_none());
        let timeout = BridgeError::CheckpointTimeout {
            id: 1,
            step: "flush",
            timeout: Duration::from_secs(1),
        };
        assert!(blamed_record(&timeout).is_none());
    }

    #[test]
    fn the_fix_fits_the_error() {
        let size = fix_for(Some(RDKafkaErrorCode::MessageSizeTooLarge), "out");
        assert!(size.contains("max.message.bytes of topic 'out'"), "{size}");
        assert!(size.contains("message.max.bytes in [sink.kafka]"), "{size}");
        let ts = fix_for(Some(RDKafkaErrorCode::InvalidTimestamp), "out");
        assert!(ts.contains("message.timestamp"), "{ts}");
        let other = fix_for(Some(RDKafkaErrorCode::InvalidRecord), "out");
        assert!(other.contains("compacted"), "{other}");
    }

    #[test]
    fn a_dead_letter_keeps_its_headers_and_names_its_origin() {
        let own = OwnedHeaders::new()
            .insert(Header {
                key: "trace",
                value: Some("abc"),
            })
            .insert::<[u8]>(Header {
                key: "empty",
                value: None,
            });
        let src = SourceRef {
            topic: "orders".into(),
            partition: 2,
            offset: 50_000,
        };
        let bad = BadRecord {
            code: Some(RDKafkaErrorCode::MessageSizeTooLarge),
            reason: "Message size too large".into(),
            failed_ms: 1_700_000_000_000,
        };
        let h = dead_letter_headers(Some(&own), &src, &bad);
        let all: Vec<(String, Option<String>)> = h
            .iter()
            .map(|h| {
                (
                    h.key.to_string(),
                    h.value.map(|v| String::from_utf8_lossy(v).to_string()),
                )
            })
            .collect();
        let expected: Vec<(String, Option<String>)> = [
            ("trace", Some("abc")),
            ("empty", None),
            (HEADER_SOURCE_TOPIC, Some("orders")),
            (HEADER_SOURCE_PARTITION, Some("2")),
            (HEADER_SOURCE_OFFSET, Some("50000")),
            (HEADER_ERROR, Some("Message size too large")),
            (HEADER_ERROR_TIME, Some("1700000000000")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.map(str::to_string)))
        .collect();
        assert_eq!(all, expected);
        let none: Option<&OwnedHeaders> = None;
        assert_eq!(dead_letter_headers(none, &src, &bad).count(), 5);
    }

    fn shared(dir: &std::path::Path, runtime: &tokio::runtime::Runtime) -> Shared {
        Shared {
            metrics: Arc::new(Metrics::new()),
            status: status::Status::new("b", 0, 1, "exactly-once").shared(),
            shutdown: CancellationToken::new(),
            runtime: runtime.handle().clone(),
            store: Arc::new(CheckpointStore::open(dir, 3).unwrap()),
        }
    }

    fn down() -> BridgeError {
        BridgeError::kafka(
            "fetch sink metadata",
            KafkaError::MetadataFetch(RDKafkaErrorCode::AllBrokersDown),
        )
    }

    #[test]
    fn start_up_waits_out_transient_errors_only_and_stops_waiting_on_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let shared = shared(dir.path(), &runtime);
        let transient = |e: &BridgeError| e.is_transient();

        let mut calls = 0;
        let got = wait_out(&shared, "test", transient, || {
            calls += 1;
            if calls < 3 {
                Err(down())
            } else {
                Ok(calls)
            }
        });
        assert_eq!(got.unwrap(), Some(3));

        let mut calls = 0;
        let got: Result<Option<()>> = wait_out(&shared, "test", transient, || {
            calls += 1;
            Err(BridgeError::Setup("permanent".into()))
        });
        assert!(matches!(got, Err(BridgeError::Setup(_))));
        assert_eq!(calls, 1, "a permanent error is not retried");

        let token = shared.shutdown.clone();
        let canceller = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            token.cancel();
        });
        let began = Instant::now();
        let got: Result<Option<()>> = wait_out(&shared, "test", transient, || Err(down()));
        canceller.join().unwrap();
        assert!(matches!(got, Ok(None)));
        assert!(
            began.elapsed() < Duration::from_secs(3),
            "{:?}",
            began.elapsed()
        );
    }

    #[test]
    fn start_up_backoff_grows_and_is_capped() {
        let waits: Vec<u64> = (0..8)
            .map(|a| startup_backoff(a).as_millis() as u64)
            .collect();
        assert_eq!(waits, [500, 1000, 2000, 4000, 8000, 10_000, 10_000, 10_000]);
    }
}
