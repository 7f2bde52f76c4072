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
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::admin::Admin;
use crate::check;
use crate::checkpoint::{Checkpoint, CheckpointState, CheckpointStore};
use crate::config::{Config, OnBadRecord, StartPosition};
use crate::error::{Action, BadRecordStop, BridgeError, Result};
use crate::failpoint;
use crate::identity::{self, Identity};
use crate::marker::{
    layout_marker_key, layout_transactional_id, marker_partition, read_bridge_markers, Layout,
    Marker,
};
use crate::metrics::Metrics;
use crate::offsets;
use crate::positions::Positions;
use crate::recovery::plan_layout;
use crate::savepoint::{Restore, Savepoint};
use crate::sink::{
    is_permanent_record_error, InFlightLimit, Openers, Origin, Sink, SinkSettings, SourceRef,
};
use crate::source::{headers_of, record_bytes, topic_handle, Source};
use crate::status::{self, PartitionStatus, RunState, SharedStatus};
use crate::transform::{Route, Router};

mod identity_checks;
mod protocol;
mod recover;
mod sink_topics;

use protocol::{EpochSink, Progress, Protocol};

/// How often the source is asked for new partitions and (with a pattern) new topics.
const DISCOVERY_INTERVAL: Duration = Duration::from_secs(10);
/// How long init_transactions and the marker read may take before the attempt counts as failed.
const CONNECT_DEADLINE: Duration = Duration::from_secs(60);
/// Every n-th record's timestamp feeds the end-to-end latency histogram.
const LATENCY_SAMPLE: u64 = 64;
/// How long a listed source topic may be missing (a broker that restarts can briefly not know
/// it) before the bridge stops, at start-up and while running.
const MISSING_TOPIC_WAIT: Duration = Duration::from_secs(30);

pub(crate) struct Shared {
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
pub(crate) enum Command {
    /// Name the next checkpoint a savepoint; the reply comes once it is committed. With `stop`,
    /// that checkpoint is the last one: the bridge then shuts down as on SIGTERM, so nothing is
    /// committed after the savepoint (the way to move to another layout under live traffic).
    Savepoint {
        name: String,
        stop: bool,
        reply: tokio::sync::oneshot::Sender<std::result::Result<Savepoint, String>>,
    },
}

/// How many records the read loop polls between two looks at the shutdown token and at the offset
/// mapping's runs.
const CHECK_EVERY: u32 = 64;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Headers a dead letter carries besides its own: where it came from, why the sink refused it, and
/// when (milliseconds since the Unix epoch, as decimal text like the partition and offset).
pub(crate) const HEADER_SOURCE_TOPIC: &str = "eos-bridge.source.topic";
pub(crate) const HEADER_SOURCE_PARTITION: &str = "eos-bridge.source.partition";
pub(crate) const HEADER_SOURCE_OFFSET: &str = "eos-bridge.source.offset";
pub(crate) const HEADER_ERROR: &str = "eos-bridge.error";
pub(crate) const HEADER_ERROR_TIME: &str = "eos-bridge.error.time";

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
        src.into(),
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
pub(crate) fn run(
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
    // The newest commits' checkpoints may still be on the store's writer thread: let them land
    // before the process exits (were it killed instead, recovery would adopt them from the marker).
    if let Err(e) = shared.store.wait_synced() {
        warn!(error = %e, "writing the newest committed checkpoints to the state directory failed");
    }
    status::update(&shared.status, |s| match &result {
        Ok(()) => s.state = RunState::Stopped,
        Err(e) => {
            s.state = RunState::Failed;
            s.failure = Some(e.to_string());
        }
    });
    result
}

/// What an epoch read until its barrier.
struct EpochRead {
    /// P(N): the next offset to read per source partition.
    positions: Positions,
    /// Records held until their checkpoint is written (at-most-once).
    held: Vec<OwnedMessage>,
    /// What ended the epoch, for `epochs_ended`.
    trigger: &'static str,
    stats: EpochStats,
    waits: ReadWaits,
}

/// Where an epoch's reading stood still, and for how long: the split between a sink that holds
/// the bridge back (the in-flight limit, the producer's queue) and a source with nothing to read.
/// Clocked only around the waits, never per record.
#[derive(Clone, Copy, Default)]
struct ReadWaits {
    /// From the epoch's start to its barrier.
    read: Duration,
    in_flight_limit: Duration,
    producer_queue: Duration,
    /// The transaction's first send held back after the previous commit (`Sink::first_send_held`).
    transaction_start: Duration,
    source: Duration,
}

impl ReadWaits {
    /// The time of each reason of `read_wait_seconds_total`.
    fn by_reason(&self) -> [(&'static str, Duration); 4] {
        let [a, b, c, d] = crate::metrics::READ_WAIT_REASONS;
        [
            (a, self.in_flight_limit),
            (b, self.producer_queue),
            (c, self.transaction_start),
            (d, self.source),
        ]
    }
}

/// What an epoch counts, published once its checkpoint committed.
#[derive(Default)]
struct EpochStats {
    consumed: HashMap<Arc<str>, u64>,
    produced: HashMap<Arc<str>, u64>,
    dead_lettered: Vec<SourceRef>,
    /// Record timestamps sampled for the end-to-end latency.
    samples: Vec<i64>,
}

/// The source partition the read loop is in, and where its records go. A fetch hands out one
/// partition's records in a run, so the topic's name is looked up, its route resolved and its
/// records counted once per run rather than per record: at 100 B those per-record map lookups
/// were ~5 % of the bridge's CPU (bench/results/20261201-profile-eos-100b-1s-s6-before.txt).
struct Lane {
    topic: Arc<str>,
    /// The topic's librdkafka handle (`source::topic_handle`): records of the lane's topic carry
    /// the same one, so the per-record check needs no name.
    topic_handle: usize,
    partition: i32,
    route: Route,
    /// The sink's slot for the partition, for records' packed origins.
    slot: Option<u16>,
    /// The next offset to read, after the lane's last record.
    next_offset: i64,
    consumed: u64,
    produced: u64,
}

impl Lane {
    fn open(
        topic: Arc<str>,
        topic_handle: usize,
        partition: i32,
        router: &mut Router,
        sink: &mut Sink,
    ) -> Lane {
        let route = router.route_of(&topic);
        let slot = sink.source_slot(&topic, partition);
        Lane {
            topic,
            topic_handle,
            partition,
            route,
            slot,
            next_offset: 0,
            consumed: 0,
            produced: 0,
        }
    }

    fn source(&self, offset: i64) -> SourceRef {
        SourceRef {
            topic: self.topic.clone(),
            partition: self.partition,
            offset,
        }
    }

    /// Where a record at `offset` came from, for its delivery report.
    fn origin(&self, offset: i64) -> Origin {
        self.slot
            .and_then(|slot| Origin::packed(slot, offset))
            .unwrap_or_else(|| self.source(offset).into())
    }

    /// Moves what the lane read into the epoch's positions and counts (a lane is opened for a
    /// record, so it has read at least one).
    fn close(self, positions: &mut Positions, stats: &mut EpochStats) {
        positions.set(&self.topic, self.partition, self.next_offset);
        *stats.consumed.entry(self.topic).or_default() += self.consumed;
        if self.produced > 0 {
            *stats.produced.entry(self.route.topic).or_default() += self.produced;
        }
    }
}

/// The pipeline's side of the protocol's sink: the transactional producer, with the in-flight
/// limit and the routing of held records.
struct EpochOutput<'p, 'a> {
    p: &'p mut Pipeline<'a>,
    id: u64,
    held: Vec<OwnedMessage>,
    /// The answer of the thread asking for the epoch's topic ids (None: the epoch read nothing).
    identity: Option<Receiver<Result<Identity>>>,
}

impl EpochSink for EpochOutput<'_, '_> {
    fn send_marker(&mut self, marker: &Marker) -> Result<()> {
        self.p.sink.send_marker(marker)
    }

    fn flush(&mut self, deadline: Instant) -> Result<()> {
        self.p.flush_until(self.id, deadline)
    }

    fn send_offset_mapping(&mut self, c: &Checkpoint) -> Result<()> {
        self.p.mapping = self
            .p
            .send_offset_mapping(c.id, c.created_ms, &c.positions)?;
        Ok(())
    }

    fn verify(&mut self) -> Result<()> {
        let Some(answer) = self.identity.take() else {
            return Ok(());
        };
        let now = answer.recv().unwrap_or_else(|_| {
            Err(BridgeError::TopicAdmin(
                "the thread asking for the topic ids did not start or answer".into(),
            ))
        })?;
        self.p.verify_epoch(&now)
    }

    fn commit(&mut self, deadline: Instant) -> Result<()> {
        let sink = &mut self.p.sink;
        sink.commit(deadline).map_err(|e| sink.classify(e))
    }

    fn write_held(&mut self, deadline: Instant) -> Result<()> {
        let p = &mut *self.p;
        for m in self.held.drain(..) {
            let (sink_topic, partition) = p.router.route(m.topic(), m.partition(), m.key());
            let src = SourceRef {
                topic: p.topic_name(m.topic()),
                partition: m.partition(),
                offset: m.offset(),
            };
            let headers = m.headers().cloned();
            // Past the deadline the flush times out; sending on is still the best chance of
            // delivering what was checkpointed.
            p.sink.wait_in_flight_below(p.in_flight.bytes(), deadline);
            p.sink.send(
                &sink_topic,
                partition,
                m.key(),
                m.payload(),
                headers,
                m.timestamp().to_millis(),
                src.into(),
            )?;
        }
        Ok(())
    }
}

struct Pipeline<'a> {
    /// What the delivery mode does at the barrier, at commit and at recovery.
    protocol: Protocol,
    cfg: Arc<Config>,
    shared: &'a Shared,
    /// Shared with the thread that asks for the epoch's topic ids while its checkpoint flushes.
    admin: Arc<Admin>,
    /// Reads source topic configs, which new sink topics copy and existing ones are judged by.
    source_admin: Arc<Admin>,
    store: Arc<CheckpointStore>,
    commands: Receiver<Command>,
    restore: Option<Restore>,
    /// A savepoint request waiting for the checkpoint that will carry its name.
    savepoint: Option<SavepointRequest>,
    source: Source,
    /// P(N) moved past transaction markers, taken at the barrier, before the next epoch moves the
    /// consumer further (`Source::positions_past_markers`); for the offset mapping and monitor.
    read_to: Option<Positions>,
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
    /// The offset mapping written with each checkpoint (exactly-once under `preserve` only).
    offsets: Option<offsets::Tracker>,
    /// Commits the newest committed positions to the monitoring group, at most once a second.
    monitor: Option<offsets::monitor::Monitor>,
    /// The mapping sent in the open transaction, carried forward once it commits.
    mapping: Option<offsets::Built>,
}

impl<'a> Pipeline<'a> {
    /// Connects, discovers and recovers, waiting out clusters that are down (None: shutdown was
    /// requested meanwhile).
    fn start(
        cfg: Arc<Config>,
        shared: &'a Shared,
        commands: Receiver<Command>,
        restore: Option<Restore>,
    ) -> Result<Option<Pipeline<'a>>> {
        if preflight(&cfg, shared)?.is_none() {
            return Ok(None);
        }
        let admin = check::sink_admin(&cfg)?;
        let protocol = Protocol::from(cfg.bridge.delivery);
        let exactly_once = protocol.recovers_from_markers();
        let source_admin = Admin::new(&cfg.source.bootstrap_servers, &cfg.source.kafka.pairs())?;

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
                check::broker_timeout_rule(&cfg, &admin, &shared.runtime)
            })?
            else {
                return Ok(None);
            };
            // No transaction on the sink cluster outlives the broker's maximum timeout plus the
            // coordinator's sweep for expired ones (10 s by default): past that, something hangs.
            foreign_transaction_wait =
                Duration::from_millis(max.max(0) as u64) + crate::stable::EXPIRY_MARGIN;
        }

        let store = shared.store.clone();
        let source = Source::new(&cfg)?;
        let monitor =
            offsets::monitor::Monitor::start(&cfg, shared.metrics.monitor_commits.clone())?;
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
            kafka: check::sink_kafka(&cfg),
            transactional_id: exactly_once.then(|| cfg.transactional_id()),
            transaction_timeout: cfg.transaction.timeout,
            marker_topic: cfg.sink.marker_topic.clone(),
            marker_partition: marker_partition(cfg.bridge.instance, marker_partitions),
            foreign_transaction_wait,
            bridge_id: cfg.bridge.id.clone(),
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
        let Some(mut sink) = wait_out(shared, "initialise the sink producer", transient, || {
            Sink::connect(
                settings.clone(),
                CONNECT_DEADLINE,
                Some(shared.metrics.clone()),
            )
        })?
        else {
            return Ok(None);
        };
        let tracker = if offsets::kept(&cfg) {
            if wait_out(shared, "ensure the offset mapping topic", transient, || {
                shared.runtime.block_on(offsets::ensure_topic(&admin, &cfg))
            })?
            .is_none()
            {
                return Ok(None);
            }
            sink.collect_runs(true);
            Some(offsets::Tracker::new(&cfg))
        } else {
            None
        };
        status::update(&shared.status, |s| s.transactions_ready = true);

        let cfg_in_flight_cap = cfg.sink.max_in_flight_bytes;
        let cfg_checkpoint_timeout = cfg.checkpoint.timeout;
        let cfg_interval = cfg.checkpoint.interval;
        let mut p = Pipeline {
            protocol,
            cfg,
            shared,
            admin: Arc::new(admin),
            source_admin: Arc::new(source_admin),
            store,
            commands,
            restore,
            savepoint: None,
            source,
            read_to: None,
            sink,
            router,
            topics: BTreeMap::new(),
            topic_names: HashMap::new(),
            committed: Positions::new(),
            last_id: 0,
            // As if the last barrier were an interval ago: the first epoch after a start or a
            // recovery then ends after the shortest epoch allowed (a quarter of the interval),
            // so that a restart commits, and shows itself healthy, soon after it recovered
            // (bench/recovery: kill -9 to first commit).
            last_barrier: Instant::now()
                .checked_sub(cfg_interval)
                .unwrap_or_else(Instant::now),
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
            offsets: tracker,
            monitor,
            mapping: None,
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
            let first = !self.topics.contains_key(topic);
            let n = self.ensure_sink_topic(topic, *partitions, &sink_topic, first)?;
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
                        // Its committed write and fsync run on the store's writer thread.
                        self.store.sync()?;
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
                        return Err(BridgeError::ShutdownIncomplete(format!(
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

    /// One epoch: read until the barrier, complete the checkpoint as the delivery mode says,
    /// publish what it committed.
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

        let openers = Openers {
            mapping: self
                .offsets
                .as_ref()
                .map(|t| t.opener(&self.sink.settings().marker_key, id, now_ms())),
        };
        self.sink.begin(openers)?;
        let read = self.read_until_barrier(barrier_at)?;

        // Barrier: P(N) = the positions read.
        let barrier = Instant::now();
        self.last_barrier = barrier;
        self.read_to = (self.offsets.is_some() || self.monitor.is_some())
            .then(|| self.source.positions_past_markers(&read.positions));
        self.shared
            .metrics
            .epochs_ended
            .with_label_values(&[read.trigger])
            .inc();
        let topics = identity_checks::epoch_topics(&read.stats.consumed, &read.stats.produced);
        let checkpoint = Checkpoint {
            id,
            bridge_id: cfg.bridge.id.clone(),
            instance: cfg.bridge.instance,
            instances: cfg.bridge.instances,
            state: CheckpointState::Committed,
            positions: read.positions,
            // One time for the checkpoint, its marker and its savepoint reply.
            created_ms: now_ms(),
            savepoint: savepoint_name,
            identity: Some(self.identity.clone()),
        };
        self.complete(
            &checkpoint,
            read.held,
            read.waits,
            topics,
            barrier,
            barrier + cfg.checkpoint.timeout,
        )?;
        self.publish(checkpoint, read.stats, barrier);
        Ok(())
    }

    /// Polls and produces (at-most-once: holds) until the barrier: the interval, the size limit
    /// or shutdown.
    fn read_until_barrier(&mut self, barrier_at: Instant) -> Result<EpochRead> {
        let cfg = self.cfg.clone();
        let mut read = EpochRead {
            positions: self.committed.clone(),
            held: Vec::new(),
            trigger: "interval",
            stats: EpochStats::default(),
            waits: ReadWaits::default(),
        };
        let read_start = Instant::now();
        let queue_waited_before = self.sink.queue_full_waited();
        let held_before = self.sink.first_send_held();
        let stats = &mut read.stats;
        let mut count: u64 = 0;
        let holds = self.protocol.holds_records();
        // Output bytes of this epoch, against checkpoint.max_bytes.
        let mut epoch_bytes: u64 = 0;

        // Records polled since shutdown and the offset mapping's runs were last looked at: both
        // take a lock, and at 100 B the per-record checks were a few percent of the bridge's CPU
        // (bench/results 20261201-profile-eos-100b-1s-…). A shutdown reads at most this many more
        // records into the final epoch.
        let mut unchecked: u32 = 0;
        let mut lane: Option<Lane> = None;
        // Read every CHECK_EVERY records and whenever the loop or a send has waited, not per
        // record: at 100 B the clock was 7 % of the bridge's CPU samples (one read here, the rest
        // in rdkafka and librdkafka; bench/results/20261202-profile-eos-100b-1s-s13-bridge.txt).
        // While records are ready the barrier is seen at most CHECK_EVERY records late, a
        // fraction of a millisecond; any wait (for the in-flight limit, for room in the
        // producer's queue, for a record) reads it afresh.
        let mut now = Instant::now();
        let mut queue_waited = queue_waited_before;
        loop {
            if unchecked == 0 {
                now = Instant::now();
                if self.shutdown_requested() {
                    read.trigger = "shutdown";
                    break;
                }
                // The runs count is behind a lock the delivery thread takes per record. Runs are
                // counted from delivery reports, which lag the sends anyway: looking every 64
                // records does not make the bound any looser in kind.
                if self
                    .offsets
                    .as_ref()
                    .is_some_and(|o| o.full(self.sink.runs().runs()))
                {
                    read.trigger = "offsets";
                    break;
                }
            }
            unchecked = (unchecked + 1) % CHECK_EVERY;
            if now >= barrier_at {
                break;
            }
            if epoch_bytes >= cfg.checkpoint.max_bytes {
                read.trigger = "size";
                break;
            }
            // Waited out before a record is read, not after: a record read is in the epoch's
            // positions and must be sent in it. A record may overshoot the limit by its size.
            let limit = self.in_flight.bytes();
            if !holds && !self.sink.in_flight_below(limit) {
                let waited = Instant::now();
                let room = self.sink.wait_in_flight_below(limit, barrier_at);
                // The wait took time: the barrier is looked at against the time after it.
                now = Instant::now();
                read.waits.in_flight_limit += now - waited;
                if !room {
                    break;
                }
            }
            let polled = match self.source.poll(Duration::ZERO)? {
                Some(polled) => Some(polled),
                None => {
                    // Nothing ready: how long to wait depends on the time now, not at the last look.
                    now = Instant::now();
                    if now >= barrier_at {
                        break;
                    }
                    let wait = barrier_at
                        .saturating_duration_since(now)
                        .min(Duration::from_millis(100));
                    let polled = self.source.poll(wait)?;
                    read.waits.source += now.elapsed();
                    polled
                }
            };
            let msg = match polled {
                None => {
                    unchecked = 0;
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
            let handle = topic_handle(&msg);
            let in_lane = lane
                .as_ref()
                .is_some_and(|l| l.partition == msg.partition() && l.topic_handle == handle);
            if !in_lane {
                if let Some(done) = lane.take() {
                    done.close(&mut read.positions, stats);
                }
            }
            let l = lane.get_or_insert_with(|| {
                let topic = interned(&mut self.topic_names, msg.topic());
                Lane::open(
                    topic,
                    handle,
                    msg.partition(),
                    &mut self.router,
                    &mut self.sink,
                )
            });
            l.next_offset = msg.offset() + 1;
            l.consumed += 1;
            let ts = msg.timestamp().to_millis();
            if count.is_multiple_of(LATENCY_SAMPLE) {
                if let Some(ts) = ts {
                    stats.samples.push(ts);
                }
            }
            count += 1;
            epoch_bytes += record_bytes(&msg);
            if let Some((src, bad)) = (!self.bad_records.is_empty())
                .then(|| {
                    let src = l.source(msg.offset());
                    let bad = self.bad_records.get(&src)?;
                    Some((src, bad))
                })
                .flatten()
            {
                let topic = cfg.dead_letter_topic_for(&src.topic);
                let partitions = self
                    .dead_letter_partitions
                    .get(&topic)
                    .copied()
                    .unwrap_or(1);
                stats.dead_lettered.push(src.clone());
                send_dead_letter(&mut self.sink, &topic, partitions, &msg, src, bad)?;
                continue;
            }
            let partition = l.route.partition(msg.partition(), msg.key());
            l.produced += 1;
            if holds {
                read.held.push(msg.detach());
                continue;
            }
            self.sink.send(
                &l.route.topic,
                partition,
                msg.key(),
                msg.payload(),
                // A record without headers goes out without a header list: the same bytes on
                // the wire, and no copy of an empty list to allocate and free per record.
                headers_of(&msg).map(|h| h.detach()),
                ts,
                l.origin(msg.offset()),
            )?;
            // A send that waited for room in the producer's queue took time: look at the clock
            // (and the rest) before the next record.
            let waited = self.sink.queue_full_waited();
            if waited != queue_waited {
                queue_waited = waited;
                unchecked = 0;
            }
            if count == 1 {
                failpoint::hit_at("after-produce", self.last_id + 1);
            }
        }
        if let Some(done) = lane {
            done.close(&mut read.positions, &mut read.stats);
        }
        read.waits.read = read_start.elapsed();
        read.waits.producer_queue = self
            .sink
            .queue_full_waited()
            .saturating_sub(queue_waited_before);
        read.waits.transaction_start = self.sink.first_send_held().saturating_sub(held_before);
        for (reason, took) in read.waits.by_reason() {
            self.shared
                .metrics
                .read_wait_seconds
                .with_label_values(&[reason])
                .inc_by(took.as_secs_f64());
        }
        Ok(read)
    }

    /// Completes checkpoint `c` through the delivery mode's protocol, and keeps what the failure
    /// path needs whatever the outcome: the pending checkpoint to discard, or (at-most-once) the
    /// checkpoint already written, which a failure must rewind to.
    fn complete(
        &mut self,
        c: &Checkpoint,
        held: Vec<OwnedMessage>,
        waits: ReadWaits,
        topics: Option<(Vec<String>, Vec<String>)>,
        barrier: Instant,
        deadline: Instant,
    ) -> Result<()> {
        let store = self.store.clone();
        let protocol = self.protocol;
        let mut progress = Progress::default();
        let (source_admin, admin) = (Arc::clone(&self.source_admin), Arc::clone(&self.admin));
        // From the barrier to the protocol's first step: the positions, the checkpoint and the
        // identity question's thread; reported beside the steps.
        let mut prepared = Duration::ZERO;
        let result = std::thread::scope(|scope| {
            // The topic ids the commit must wait for: two metadata round trips, asked now so that
            // they overlap the flush instead of preceding it.
            let ask = |topics| identity_checks::identity_of(&source_admin, &admin, topics);
            let identity = topics.as_ref().map(|topics| {
                let (tx, rx) = sync_channel(1);
                let answer = tx.clone();
                if let Err(e) = std::thread::Builder::new()
                    .name("eos-bridge-ids".into())
                    .spawn_scoped(scope, move || answer.send(ask(topics)))
                {
                    warn!(error = %e, "could not ask for the topic ids beside the flush; asking now");
                    let _ = tx.send(ask(topics));
                }
                rx
            });
            let mut output = EpochOutput {
                p: self,
                id: c.id,
                held,
                identity,
            };
            prepared = barrier.elapsed();
            protocol.complete(&mut output, &store, c, deadline, &mut progress)
        });
        self.pending = progress.pending;
        if progress.checkpointed_ahead {
            self.committed = c.positions.clone();
            self.last_id = c.id;
        }
        if let Some(took) = progress.commit_took {
            self.shared
                .metrics
                .commit_duration
                .observe(took.as_secs_f64());
        }
        let hold = self.sink.first_send_hold();
        self.shared
            .metrics
            .first_send_hold_seconds
            .set(hold.as_secs_f64());
        let ms = |d: Option<Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e3);
        debug!(
            checkpoint = c.id,
            total_ms = ms(Some(barrier.elapsed())),
            prepare_ms = ms(Some(prepared)),
            verify_ms = ms(progress.verify_took),
            marker_ms = ms(progress.marker_took),
            mapping_ms = ms(progress.mapping_took),
            flush_ms = ms(progress.flush_took),
            store_ms = ms(progress.store_took),
            commit_ms = ms(progress.commit_took),
            first_send_hold_ms = ms(Some(hold)),
            read_ms = ms(Some(waits.read)),
            wait_in_flight_ms = ms(Some(waits.in_flight_limit)),
            wait_queue_ms = ms(Some(waits.producer_queue)),
            wait_source_ms = ms(Some(waits.source)),
            wait_start_ms = ms(Some(waits.transaction_start)),
            ok = result.is_ok(),
            "checkpoint completed"
        );
        result
    }

    /// After the commit: the savepoint reply, metrics, positions and status.
    fn publish(&mut self, c: Checkpoint, stats: EpochStats, barrier: Instant) {
        let cfg = self.cfg.clone();
        let id = c.id;
        if let (Some(t), Some(m)) = (self.offsets.as_mut(), self.mapping.take()) {
            self.shared
                .metrics
                .offset_mapping_runs
                .inc_by(m.runs as u64);
            t.committed(m);
        }
        if let Some(m) = &self.monitor {
            m.committed(self.read_to.take().unwrap_or_else(|| c.positions.clone()));
        }
        if let Some((name, stop, reply)) = self.savepoint.take() {
            let sp = Savepoint::from_checkpoint(&c);
            info!(savepoint = %name, checkpoint = id, stop, "savepoint taken");
            if stop {
                self.shared.shutdown.cancel();
            }
            let _ = reply.send(sp.ok_or_else(|| "the savepoint lost its name".to_string()));
        }
        let m = &self.shared.metrics;
        let done_ms = now_ms();
        for (t, n) in stats.consumed {
            m.records_consumed.with_label_values(&[&t]).inc_by(n);
        }
        for (t, n) in stats.produced {
            m.records_produced.with_label_values(&[&t]).inc_by(n);
        }
        for src in &stats.dead_lettered {
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
        for ts in stats.samples {
            m.end_to_end_latency
                .observe(((done_ms - ts).max(0) as f64) / 1000.0);
        }
        m.checkpoints.with_label_values(&["completed"]).inc();
        m.checkpoint_duration
            .observe(barrier.elapsed().as_secs_f64());
        m.last_checkpoint_id.set(id as i64);
        m.last_checkpoint_timestamp.set(done_ms / 1000);
        self.committed = c.positions;
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
    }

    /// Sends checkpoint `id`'s offset mapping into its transaction (after the flush, so that every
    /// delivery report, with its sink offset, is in). Returns what its commit carries forward.
    fn send_offset_mapping(
        &mut self,
        id: u64,
        time_ms: i64,
        current: &Positions,
    ) -> Result<Option<offsets::Built>> {
        let Some(tracker) = self.offsets.as_ref() else {
            return Ok(None);
        };
        let writer = self.sink.settings().marker_key.clone();
        let cfg = &self.cfg;
        let read_to = self.read_to.clone().unwrap_or_else(|| current.clone());
        let built = tracker.build(
            &writer,
            id,
            time_ms,
            &self.committed,
            &read_to,
            &mut self.sink.runs(),
            |t| cfg.sink_topic_for(t),
        );
        let topic = tracker.topic().to_string();
        for (key, value) in &built.records {
            self.sink.send_mapping(&topic, key, value)?;
        }
        Ok(Some(built))
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
            && self.protocol.replays_failed_epochs();
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
            let dead_letter = if !self.protocol.replays_failed_epochs() {
                ""
            } else {
                ", or set [sink] on_bad_record = \"dead-letter\" to write such records to a dead-letter topic and go on"
            };
            (
                format!("sink topic '{sink_topic}'"),
                format!("{}{dead_letter}", fix_for(bad.code, &sink_topic)),
            )
        };
        let outcome = self.protocol.stop_outcome(aborted, self.last_id);
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
            Err(BridgeError::Runtime("permanent".into()))
        });
        assert!(matches!(got, Err(BridgeError::Runtime(_))));
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
