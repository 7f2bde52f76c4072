//! The pipeline: the one owner of the epoch loop and of the checkpoint protocol of DESIGN.md.
//!
//! It runs on a thread of its own because every transaction call blocks. Each epoch is:
//! begin → poll and produce until the barrier → commit marker → flush → durable pending
//! checkpoint → commit → checkpoint marked committed. Failures follow the action their error is
//! classified as (error.rs): abort and replay the epoch from the last checkpoint, rebuild the
//! producer and recover in-process from the newest committed marker, or stop.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Message, OwnedMessage};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::admin::Admin;
use crate::checkpoint::{Checkpoint, CheckpointState, CheckpointStore};
use crate::config::{Config, Delivery, OutOfRange, Partitioning, StartPosition};
use crate::error::{Action, BridgeError, Result};
use crate::failpoint;
use crate::identity::{self, Identity};
use crate::marker::{marker_partition, Marker, MARKER_VERSION};
use crate::metrics::Metrics;
use crate::positions::Positions;
use crate::recovery::decide;
use crate::savepoint::{Restore, Savepoint, RESTORED_PREFIX};
use crate::sink::{Sink, SinkSettings, SourceRef};
use crate::source::Source;
use crate::status::{self, PartitionStatus, RunState, SharedStatus};
use crate::transform::Router;

mod identity_checks;

/// How often the source is asked for new partitions and (with a pattern) new topics.
const DISCOVERY_INTERVAL: Duration = Duration::from_secs(10);
/// How long init_transactions and the marker read may take before the attempt counts as failed.
const CONNECT_DEADLINE: Duration = Duration::from_secs(60);
/// Epochs failing on the same record with a permanent error before the bridge gives up on it.
const POISON_ATTEMPTS: u32 = 3;
/// Every n-th record's timestamp feeds the end-to-end latency histogram.
const LATENCY_SAMPLE: u64 = 64;

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

/// Errors whose record will fail the same way however often it is retried.
fn permanent(code: Option<RDKafkaErrorCode>) -> bool {
    matches!(
        code,
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::MessageBatchTooLarge
                | RDKafkaErrorCode::InvalidTimestamp
                | RDKafkaErrorCode::BadMessage
        )
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

/// Runs the bridge until shutdown or a fatal error.
pub fn run(
    cfg: Arc<Config>,
    shared: Shared,
    commands: Receiver<Command>,
    restore: Option<Restore>,
) -> Result<()> {
    let result = Pipeline::start(cfg, &shared, commands, restore).and_then(|mut p| p.run_loop());
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
    poison: Option<(SourceRef, u32)>,
    failures_in_row: u32,
    /// Id of a pending checkpoint written to sled in the current epoch, not yet committed.
    pending: Option<u64>,
    /// The clusters and topic incarnations `committed` refers to; recorded in every checkpoint
    /// and commit marker.
    identity: Identity,
    /// Changes already logged and counted under `restart`.
    reported: BTreeSet<identity::Change>,
}

impl<'a> Pipeline<'a> {
    fn exactly_once(&self) -> bool {
        self.cfg.bridge.delivery == Delivery::ExactlyOnce
    }

    fn start(
        cfg: Arc<Config>,
        shared: &'a Shared,
        commands: Receiver<Command>,
        restore: Option<Restore>,
    ) -> Result<Pipeline<'a>> {
        let sink_kafka: Vec<(String, String)> = cfg
            .sink
            .kafka
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let admin = Admin::new(&cfg.sink.bootstrap_servers, &sink_kafka)?;
        let exactly_once = cfg.bridge.delivery == Delivery::ExactlyOnce;

        // The timeout rule, before anything is consumed.
        if exactly_once {
            let max = shared
                .runtime
                .block_on(admin.transaction_max_timeout_ms())?;
            cfg.check_broker_timeout(max)
                .map_err(|e| BridgeError::Config(crate::config::ConfigErrors(vec![e])))?;
        }

        let store = shared.store.clone();
        let source = Source::new(&cfg)?;
        let router = Router::new(&cfg.sink.topic, cfg.sink.partitioning);

        let marker_partition = if exactly_once {
            let n = shared.runtime.block_on(
                admin.ensure_marker_topic(&cfg.sink.marker_topic, cfg.bridge.instances),
            )?;
            marker_partition(cfg.bridge.instance, n)
        } else {
            0
        };
        let settings = SinkSettings {
            bootstrap_servers: cfg.sink.bootstrap_servers.clone(),
            kafka: sink_kafka,
            transactional_id: exactly_once.then(|| cfg.transactional_id()),
            transaction_timeout: cfg.transaction.timeout,
            marker_topic: cfg.sink.marker_topic.clone(),
            marker_partition,
            bridge_id: cfg.bridge.id.clone(),
            instance: cfg.bridge.instance,
        };
        let sink = Sink::connect(settings, CONNECT_DEADLINE)?;
        status::update(&shared.status, |s| s.transactions_ready = true);

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
            poison: None,
            failures_in_row: 0,
            pending: None,
            identity: Identity::default(),
            reported: BTreeSet::new(),
        };
        p.discover_topics()?;
        p.recover()?;
        Ok(p)
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
            self.shared
                .metrics
                .records_produced
                .with_label_values(&[&sink_topic]);
        }
        self.topics = found;
        self.last_discovery = Instant::now();
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
        let mut marker = if self.exactly_once() {
            self.sink.read_newest_marker(CONNECT_DEADLINE)?
        } else {
            None
        };
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
        self.store.put_committed(&Checkpoint {
            id,
            bridge_id: cfg.bridge.id.clone(),
            instance: cfg.bridge.instance,
            instances: cfg.bridge.instances,
            state: CheckpointState::Committed,
            positions: positions.clone(),
            created_ms: now_ms(),
            savepoint: Some(restore.tag()),
            identity: Some(now),
        })?;
        info!(tag = %restore.tag(), checkpoint = id, partitions = positions.len(), "restored from savepoint");
        self.last_id = id;
        self.start_from(Some(positions), "restored_from_savepoint")
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
        let mut samples: Vec<i64> = Vec::new();
        let mut count: u64 = 0;
        // at-most-once checkpoints positions before producing, so it holds the epoch's records.
        let mut held: Vec<OwnedMessage> = Vec::new();
        let at_most_once = cfg.bridge.delivery == Delivery::AtMostOnce;

        loop {
            let now = Instant::now();
            if now >= barrier_at || self.shutdown_requested() {
                break;
            }
            let wait = (barrier_at - now).min(Duration::from_millis(100));
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
            let (sink_topic, partition) =
                self.router.route(msg.topic(), msg.partition(), msg.key());
            current.set(&src_topic, msg.partition(), msg.offset() + 1);
            *consumed.entry(src_topic.clone()).or_default() += 1;
            *produced.entry(sink_topic.clone()).or_default() += 1;
            let ts = msg.timestamp().to_millis();
            if count.is_multiple_of(LATENCY_SAMPLE) {
                if let Some(ts) = ts {
                    samples.push(ts);
                }
            }
            count += 1;
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
                SourceRef {
                    topic: src_topic,
                    partition: msg.partition(),
                    offset: msg.offset(),
                },
            )?;
            if count == 1 {
                failpoint::hit("after-produce");
            }
        }

        // Barrier: P(N) = current.
        let barrier = Instant::now();
        self.last_barrier = barrier;
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
                for m in held.drain(..) {
                    let (sink_topic, partition) =
                        self.router.route(m.topic(), m.partition(), m.key());
                    let src = SourceRef {
                        topic: self.topic_name(m.topic()),
                        partition: m.partition(),
                        offset: m.offset(),
                    };
                    let headers = m.headers().cloned();
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
                // A failure now loses the epoch's records: that is what at-most-once promises.
                if let Err(e) = self.flush_until(id, deadline) {
                    warn!(error = %e, "at-most-once: records of this epoch were not all delivered");
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
        // An epoch that committed without reaching the suspect record proves nothing about it.
        if let Some((src, _)) = &self.poison {
            if self
                .committed
                .get(&src.topic, src.partition)
                .is_some_and(|o| o > src.offset)
            {
                self.poison = None;
            }
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
        match self.sink.flush(left) {
            Err(BridgeError::Kafka {
                source: KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut),
                ..
            }) => Err(BridgeError::CheckpointTimeout {
                id,
                step: "flush",
                timeout: self.cfg.checkpoint.timeout,
            }),
            other => other,
        }
    }

    /// The abort path, the rebuild path, or stop, as the error's class says.
    fn handle_failure(&mut self, e: BridgeError) -> Result<()> {
        let e = self.sink.classify(e);
        let action = e.action();
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
            error!(error = %e, "stopping");
            return Err(e);
        }
        self.track_poison(&e)?;
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

    fn track_poison(&mut self, e: &BridgeError) -> Result<()> {
        let BridgeError::Delivery {
            topic,
            partition,
            offset,
            reason,
            code,
        } = e
        else {
            return Ok(());
        };
        if !permanent(*code) || *offset < 0 {
            return Ok(());
        }
        let this = SourceRef {
            topic: self.topic_name(topic),
            partition: *partition,
            offset: *offset,
        };
        let attempts = match &self.poison {
            Some((same, n)) if *same == this => n + 1,
            _ => 1,
        };
        if attempts >= POISON_ATTEMPTS {
            return Err(BridgeError::PoisonRecord {
                topic: topic.clone(),
                partition: *partition,
                offset: *offset,
                reason: reason.clone(),
                attempts,
            });
        }
        self.poison = Some((this, attempts));
        Ok(())
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
