//! The sink side: the one owner of the transactional producer and of the transaction's state
//! machine (ready → open → flushed → committed or aborted), and of the fencing of other
//! transactional ids. Markers are read back by `marker`.
//!
//! Nothing else in the crate touches the producer. Every call here blocks (librdkafka's
//! transaction API does), so the pipeline runs on a thread of its own, never on the async
//! runtime. Delivery failures are gathered by the producer context and reported by `flush`,
//! together with the source record they came from.
//!
//! Naming the right record matters: once one record fails, librdkafka fails the whole transaction,
//! purges the records still queued and refuses every later send, each with an error of its own. So
//! failures are ranked: a record's own permanent error (too large, invalid) outranks any other
//! error, which outranks the collateral ones (purged, erroneous state), and a refused send waits
//! briefly for the delivery reports that say which record really failed.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use rdkafka::bindings::rd_kafka_topic_name;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message, OwnedHeaders, ToBytes};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::statistics::Window;
use rdkafka::util::IntoOpaque;
use rdkafka::ClientContext;
use tracing::{debug, info, warn};

use self::settle::Settle;
use self::topics::TopicHandles;
use self::wakeup::Wakeup;

mod settle;
mod topics;
mod wakeup;

use crate::error::{classify_kafka, is_auth, is_fencing, Action, BridgeError, Result};
use crate::marker::Marker;
use crate::metrics::{Metrics, Quantiles};
use crate::offsets::mapping::RunCollector;

/// Where an output record came from; carried through librdkafka so that a failed delivery names
/// its source record. The commit marker carries the marker topic's partition and offset -1.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SourceRef {
    pub topic: Arc<str>,
    pub partition: i32,
    pub offset: i64,
}

/// Where an output record came from, as it travels through librdkafka to its delivery report.
///
/// A source record from a partition the sink has a slot for (`Sink::source_slot`) travels packed
/// into the opaque pointer itself, so that nothing is allocated per record on the pipeline thread
/// and freed on the delivery thread (at 100 B the boxed form, with its shared topic name, was a
/// few percent of the bridge's CPU: bench/results/20261201-profile-eos-100b-1s-s6-before.txt).
/// Everything else (the marker, the offset mapping, a dead letter, an offset of 2^47 or more) is
/// boxed.
#[derive(Debug)]
pub(crate) enum Origin {
    Packed { slot: u16, offset: i64 },
    Boxed(Box<SourceRef>),
}

// The packed form needs 1 tag bit, 47 offset bits and 16 slot bits.
const _: () = assert!(
    usize::BITS == 64,
    "eos-bridge packs record origins into 64-bit pointers"
);
/// Set in a packed origin; never in a box's pointer (SourceRef is 8-aligned).
const PACKED_TAG: usize = 1;
const PACKED_OFFSET_BITS: u32 = 47;

impl Origin {
    /// The packed origin of a record at `offset` in slot `slot`, if the offset fits.
    pub(crate) fn packed(slot: u16, offset: i64) -> Option<Origin> {
        (0..1i64 << PACKED_OFFSET_BITS)
            .contains(&offset)
            .then_some(Origin::Packed { slot, offset })
    }
}

impl From<SourceRef> for Origin {
    fn from(source: SourceRef) -> Origin {
        Origin::Boxed(Box::new(source))
    }
}

impl IntoOpaque for Origin {
    fn into_ptr(self) -> *mut c_void {
        match self {
            Origin::Packed { slot, offset } => {
                (((slot as usize) << (PACKED_OFFSET_BITS + 1))
                    | ((offset as usize) << 1)
                    | PACKED_TAG) as *mut c_void
            }
            Origin::Boxed(b) => Box::into_raw(b).cast(),
        }
    }

    unsafe fn from_ptr(ptr: *mut c_void) -> Origin {
        let v = ptr as usize;
        if v & PACKED_TAG == PACKED_TAG {
            Origin::Packed {
                slot: (v >> (PACKED_OFFSET_BITS + 1)) as u16,
                offset: ((v >> 1) & ((1 << PACKED_OFFSET_BITS) - 1)) as i64,
            }
        } else {
            // SAFETY: an untagged pointer was made by `into_ptr` from a Box, and librdkafka hands
            // each record's opaque back exactly once (its delivery report, or a refused send).
            Origin::Boxed(unsafe { Box::from_raw(ptr.cast()) })
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct DeliveryFailure {
    pub source: SourceRef,
    pub code: Option<RDKafkaErrorCode>,
    pub reason: String,
    pub payload_len: usize,
}

fn size_error(code: Option<RDKafkaErrorCode>) -> bool {
    matches!(
        code,
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::MessageBatchTooLarge
        )
    )
}

/// Errors a record fails with however often it is sent: the record itself is bad.
pub(crate) fn is_permanent_record_error(code: Option<RDKafkaErrorCode>) -> bool {
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

/// Errors a record gets because something else failed first: the transaction is in an error
/// state, the record was purged when it failed, another record of its batch was invalid, or the
/// producer had a fatal error. They never say what went wrong.
fn is_collateral(code: Option<RDKafkaErrorCode>) -> bool {
    matches!(
        code,
        Some(
            RDKafkaErrorCode::State
                | RDKafkaErrorCode::PurgeQueue
                | RDKafkaErrorCode::PurgeInflight
                | RDKafkaErrorCode::InvalidDifferentRecord
                | RDKafkaErrorCode::Fatal
        )
    )
}

/// How much a failure says about its cause: 2 for a record's own permanent error, 0 for a
/// collateral one, 1 for the rest.
fn rank(code: Option<RDKafkaErrorCode>) -> u8 {
    if is_permanent_record_error(code) {
        2
    } else if is_collateral(code) {
        0
    } else {
        1
    }
}

/// How long a refused send waits for the delivery reports that name the record that failed first.
const ATTRIBUTION_WAIT: Duration = Duration::from_secs(5);
/// Once a failure is reported, how long the reports of records still in flight may take: they come
/// in the same responses, so this is ample; waiting longer only delays the abort.
const SETTLE_GRACE: Duration = Duration::from_millis(500);
/// The longest a wait for delivery reports sleeps before it looks again: librdkafka's in-flight
/// count drops a moment after the report's callback has woken us.
const REPORT_WAIT: Duration = Duration::from_millis(2);
/// The longest a wait for room under the in-flight limit sleeps before it looks again. Only a
/// safety net: the report that makes the room (or a failure) wakes it.
const LIMIT_WAIT: Duration = Duration::from_millis(100);

#[derive(Default)]
pub(crate) struct SinkContext {
    failed: AtomicBool,
    first_failure: Mutex<Option<DeliveryFailure>>,
    /// Key and payload bytes handed to librdkafka, ever, less those it refused; written by the
    /// sending thread only. The bytes in flight are this less `reported_bytes`: two counters, each
    /// with one writer and on a cache line of its own, because one in-flight count that both the
    /// read loop and the delivery thread changed per record moved its cache line between the two
    /// cores twice per record (docs/design.md, "The read loop").
    sent_bytes: CachePadded<AtomicU64>,
    /// Key and payload bytes whose delivery report arrived, success or failure, ever: the delivery
    /// rate is measured from its growth. Written by the delivery reports.
    reported_bytes: CachePadded<AtomicU64>,
    /// Wakes a thread waiting for the reported bytes to reach a count it names.
    wakeup: Wakeup,
    /// Where each source record landed, as runs, for the offset mapping (when it is kept).
    collect_runs: AtomicBool,
    runs: Mutex<RunCollector>,
    /// The source partition of each slot of a packed origin; written when a slot is added.
    sources: RwLock<Vec<(Arc<str>, i32)>>,
    /// Set when a transaction's first record is sent; the next delivery report clears it and
    /// keeps its time in `first_report_at`, which `settle` learns from.
    first_report_armed: AtomicBool,
    first_report_at: Mutex<Option<Instant>>,
    /// Where librdkafka's statistics of this producer go (none for a producer that only fences),
    /// and the brokers its latest statistics reported.
    metrics: Option<Arc<Metrics>>,
    latency_brokers: Mutex<Vec<i32>>,
    /// Set once statistics failed to decode, so that the warning is logged once.
    statistics_refused: AtomicBool,
}

impl SinkContext {
    fn sent(&self, bytes: u64) {
        self.sent_bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    /// A send librdkafka refused: it never was in flight, and no report will come for it.
    fn unsent(&self, bytes: u64) {
        self.sent_bytes.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Sequentially consistent: `Wakeup::reported` says why. A failure is recorded before this.
    fn reported(&self, bytes: u64, failed: bool) {
        // One relaxed load per report; the swap runs once per transaction.
        if self.first_report_armed.load(Ordering::Relaxed)
            && self.first_report_armed.swap(false, Ordering::AcqRel)
        {
            *self
                .first_report_at
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        }
        let now = self.reported_bytes.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.wakeup.reported(now, failed);
    }

    /// Starts the clock that the next delivery report stops (see `first_report_armed`).
    fn arm_first_report(&self) {
        *self
            .first_report_at
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        self.first_report_armed.store(true, Ordering::Release);
    }

    /// Stops waiting for a first report, and takes its time if one came.
    fn take_first_report(&self) -> Option<Instant> {
        self.first_report_armed.store(false, Ordering::Release);
        self.first_report_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    fn sent_bytes(&self) -> u64 {
        self.sent_bytes.load(Ordering::Acquire)
    }

    /// Reported first: a report that lands between the two loads makes the result larger than the
    /// truth, never smaller, so a limit checked against it holds. Saturating: a report never
    /// arrives for more than was sent, but an underflow must not turn into a limit that blocks
    /// forever.
    fn in_flight_bytes(&self) -> u64 {
        let reported = self.reported_bytes.load(Ordering::Acquire);
        self.sent_bytes().saturating_sub(reported)
    }

    fn reported_bytes(&self) -> u64 {
        self.reported_bytes.load(Ordering::Acquire)
    }

    /// Whether the reported bytes reached `at` or a delivery failed, read in the order
    /// `Wakeup::wait` needs.
    fn reported_reach(&self, at: u64) -> bool {
        self.reported_bytes() >= at || self.has_failed()
    }

    /// Keeps the failure that says most about its cause (see `rank`), the first of equals, except
    /// that for a size error the largest record wins: the broker rejects a whole batch for one
    /// oversized record, and that record is the one to name.
    fn record_failure(&self, f: DeliveryFailure) {
        let mut slot = self.first_failure.lock().unwrap_or_else(|p| p.into_inner());
        let replace = match slot.as_ref() {
            None => true,
            Some(old) => {
                rank(f.code) > rank(old.code)
                    || (size_error(f.code)
                        && size_error(old.code)
                        && f.payload_len > old.payload_len)
            }
        };
        if replace {
            *slot = Some(f);
        }
        self.failed.store(true, Ordering::Release);
    }

    /// Calls `f` with the topic, partition and offset an origin names; None for a slot without an
    /// entry, which cannot happen (a slot is handed out once its entry is in), but a panic here
    /// would abort the process inside librdkafka's callback.
    fn with_source<R>(
        &self,
        origin: &Origin,
        f: impl FnOnce(&Arc<str>, i32, i64) -> R,
    ) -> Option<R> {
        match origin {
            Origin::Boxed(s) => Some(f(&s.topic, s.partition, s.offset)),
            Origin::Packed { slot, offset } => {
                let sources = self.sources.read().unwrap_or_else(|p| p.into_inner());
                let (topic, partition) = sources.get(usize::from(*slot))?;
                Some(f(topic, *partition, *offset))
            }
        }
    }

    /// The source record an origin names.
    fn source_of(&self, origin: Origin) -> SourceRef {
        self.with_source(&origin, |topic, partition, offset| SourceRef {
            topic: topic.clone(),
            partition,
            offset,
        })
        .unwrap_or_else(|| SourceRef {
            topic: "<unknown>".into(),
            partition: -1,
            offset: -1,
        })
    }

    fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    fn take_failure(&self) -> Option<DeliveryFailure> {
        if !self.failed.swap(false, Ordering::AcqRel) {
            return None;
        }
        self.first_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

impl ClientContext for SinkContext {
    fn error(&self, error: KafkaError, reason: &str) {
        crate::connectivity::on_error(crate::connectivity::Cluster::Sink, &error, reason);
    }

    /// The round trips and queue times per broker, set here rather than by the pipeline, so that
    /// they move while a checkpoint waits on a slow sink, which is when an operator looks.
    fn stats_raw(&self, statistics: &[u8]) {
        match serde_json::from_slice::<BrokerStatistics>(statistics) {
            Ok(s) => self.broker_latency(&s),
            Err(e) => {
                if !self.statistics_refused.swap(true, Ordering::Relaxed) {
                    warn!(error = %e, "the sink producer's statistics could not be read; its latency metrics stay empty");
                }
            }
        }
    }
}

/// The part of librdkafka's statistics that the latency gauges read. Decoding only this skips the
/// objects of every topic and partition (about 1 KB of JSON each) without building them, since the
/// callback runs on the thread that serves the delivery reports a checkpoint's flush waits for.
#[derive(serde::Deserialize)]
struct BrokerStatistics {
    brokers: HashMap<String, BrokerWindows>,
}

#[derive(serde::Deserialize)]
struct BrokerWindows {
    nodeid: i32,
    rtt: Option<Window>,
    int_latency: Option<Window>,
    #[serde(default)]
    waitresp_cnt: i64,
}

impl SinkContext {
    fn broker_latency(&self, statistics: &BrokerStatistics) {
        let mut reported = Vec::with_capacity(statistics.brokers.len());
        // The bootstrap entries have no node id: no broker of their own.
        for b in statistics.brokers.values().filter(|b| b.nodeid >= 0) {
            reported.push(b.nodeid);
            let rtt = b.rtt.as_ref().and_then(quantiles);
            let queue = b.int_latency.as_ref().and_then(quantiles);
            if let Some(m) = &self.metrics {
                m.set_sink_latency(&b.nodeid.to_string(), rtt, queue);
            }
            if let Some(r) = rtt {
                let ms = |d: Duration| d.as_secs_f64() * 1e3;
                debug!(
                    broker = b.nodeid,
                    requests = b.rtt.as_ref().map_or(0, |w| w.cnt),
                    rtt_p50_ms = ms(r.p50),
                    rtt_p99_ms = ms(r.p99),
                    rtt_max_ms = ms(r.max),
                    queue_p99_ms = queue.map_or(0.0, |q| ms(q.p99)),
                    queue_max_ms = queue.map_or(0.0, |q| ms(q.max)),
                    waiting_requests = b.waitresp_cnt,
                    "sink broker latency"
                );
            }
        }
        // A broker that left the cluster is no longer reported: its last figures would stand
        // for ever.
        let mut last = self
            .latency_brokers
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(m) = &self.metrics {
            for gone in last.iter().filter(|id| !reported.contains(id)) {
                m.set_sink_latency(&gone.to_string(), None, None);
            }
        }
        *last = reported;
    }
}

/// A statistics window's quantiles (librdkafka counts microseconds); None for a window that saw
/// nothing, whose zeros are no measurement. The percentiles are estimates from the buckets of an
/// HDR histogram and can exceed the largest value, which is exact; they are capped by it.
fn quantiles(w: &Window) -> Option<Quantiles> {
    let us = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    let max = us(w.max);
    (w.cnt > 0).then(|| Quantiles {
        p50: us(w.p50).min(max),
        p99: us(w.p99).min(max),
        max,
    })
}

impl ProducerContext for SinkContext {
    type DeliveryOpaque = Origin;

    fn delivery(&self, result: &DeliveryResult<'_>, origin: Origin) {
        let msg = match result {
            Ok(msg) | Err((_, msg)) => msg,
        };
        let bytes = msg.key().map_or(0, <[u8]>::len) + msg.payload_len();
        match result {
            Err((e, msg)) => self.record_failure(DeliveryFailure {
                source: self.source_of(origin),
                code: e.rdkafka_error_code(),
                reason: e.to_string(),
                payload_len: msg.payload_len(),
            }),
            Ok(msg) if self.collect_runs.load(Ordering::Acquire) => {
                self.with_source(&origin, |topic, partition, offset| {
                    // The marker and the mapping records carry offset -1: they are no source record.
                    if offset >= 0 {
                        self.runs.lock().unwrap_or_else(|p| p.into_inner()).record(
                            topic,
                            partition,
                            offset,
                            reported_topic(msg),
                            msg.partition(),
                            msg.offset(),
                        );
                    }
                });
            }
            Ok(_) => {}
        }
        // After the failure is recorded: a woken waiter must see it.
        self.reported(bytes as u64, result.is_err());
    }
}

/// The topic a delivery report is for. `Message::topic()` would check that the name is UTF-8 on
/// every report (~125 instructions per record at 100 B: bench/README.md, "Session 15"); this
/// producer only writes to topics named by a Rust `&str`, so the name librdkafka hands back, its
/// copy of that string, is UTF-8.
fn reported_topic<'m>(msg: &'m BorrowedMessage<'_>) -> &'m str {
    // SAFETY: the report's message and its topic handle live as long as `msg`;
    // rd_kafka_topic_name returns the handle's NUL-terminated name, valid as long as the handle.
    unsafe {
        let name = CStr::from_ptr(rd_kafka_topic_name((*msg.ptr()).rkt));
        std::str::from_utf8_unchecked(name.to_bytes())
    }
}

/// Whether `sent` less the reported bytes is below `limit`, reading the reported bytes (`reported`)
/// only when the count seen last (`seen`, updated) does not already say so; see
/// [`Sink::in_flight_below`].
fn below_limit(sent: u64, seen: &mut u64, reported: impl FnOnce() -> u64, limit: u64) -> bool {
    if sent.saturating_sub(*seen) < limit {
        return true;
    }
    *seen = reported();
    sent.saturating_sub(*seen) < limit
}

/// The in-flight limit never goes below this (nor above the configured cap): a few batches, so
/// that a throttled sink still gets full requests.
pub(crate) const MIN_IN_FLIGHT_LIMIT: u64 = 64 * 1024;
/// A flush that delivered less than this in less than its budget measured the sink's latency, not
/// its rate: it leaves the limit alone.
const RATE_SAMPLE_MIN_BYTES: u64 = 64 * 1024;

/// The adaptive bound on output bytes in flight (handed to the producer, not yet acknowledged).
///
/// A checkpoint's flush has to deliver what is in flight at the barrier within
/// checkpoint.timeout; keeping that below what the sink delivers in a quarter of the timeout
/// leaves room for rate swings and for the commit. The sink's rate is measured at each flush:
/// a slow flush (or a timed-out one) sets the limit from it at once, a fast flush that delivered
/// a fair amount lets it grow, at most twofold per checkpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct InFlightLimit {
    limit: u64,
    floor: u64,
    cap: u64,
    /// The time a flush should take at most: a quarter of checkpoint.timeout.
    budget: Duration,
}

impl InFlightLimit {
    /// Starts at the cap: until a flush says otherwise, the sink is taken to be fast.
    pub(crate) fn new(cap: u64, checkpoint_timeout: Duration) -> InFlightLimit {
        let cap = cap.max(1);
        InFlightLimit {
            limit: cap,
            floor: MIN_IN_FLIGHT_LIMIT.min(cap),
            cap,
            budget: checkpoint_timeout / 4,
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.limit
    }

    /// What the sink delivers within the budget at the rate `delivered` bytes in `took`.
    fn fits_budget(&self, delivered: u64, took: Duration) -> u64 {
        let rate = delivered as f64 / took.as_secs_f64().max(1e-3);
        (rate * self.budget.as_secs_f64()) as u64
    }

    /// A flush delivered `delivered` bytes in `took`.
    pub(crate) fn flushed(&mut self, delivered: u64, took: Duration) {
        let fits = self.fits_budget(delivered, took);
        if took > self.budget {
            // The sink was busy the whole flush: its rate is what was measured.
            self.limit = fits.clamp(self.floor, self.limit.max(self.floor));
        } else if delivered >= RATE_SAMPLE_MIN_BYTES {
            let most = self.limit.saturating_mul(2).min(self.cap);
            self.limit = fits.clamp(self.limit, most.max(self.limit));
        }
    }

    /// A flush timed out after delivering `delivered` bytes in `took`: at least halve the limit.
    pub(crate) fn timed_out(&mut self, delivered: u64, took: Duration) {
        let fits = self.fits_budget(delivered, took);
        self.limit = fits.min(self.limit / 2).clamp(self.floor, self.cap);
    }
}

/// A record librdkafka would not take, handed back with the reason.
type Refused<'r, K, P> = (KafkaError, BaseRecord<'r, K, P, Origin>);

/// How the sink writes: in transactions (exactly-once) or with a plain idempotent producer.
#[derive(Clone, Debug)]
pub(crate) struct SinkSettings {
    pub bootstrap_servers: String,
    pub kafka: Vec<(String, String)>,
    /// Some for exactly-once.
    pub transactional_id: Option<String>,
    pub transaction_timeout: Duration,
    pub marker_topic: String,
    pub marker_partition: i32,
    /// How long recovery may wait for other producers' transactions on the marker partition:
    /// longer than any transaction can stay open on the sink cluster.
    pub foreign_transaction_wait: Duration,
    pub bridge_id: String,
    /// The key of this instance's markers in its layout (`marker::layout_marker_key`).
    pub marker_key: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TxnState {
    /// Transactions initialised, none open.
    Ready,
    /// A transaction is open since the instant.
    Open(Instant),
    /// Everything of the open transaction was acknowledged.
    Flushed(Instant),
}

pub(crate) struct Sink {
    settings: SinkSettings,
    /// The producer's topic handles: declared before it, so that they are destroyed first.
    topics: RefCell<TopicHandles>,
    producer: ThreadedProducer<SinkContext>,
    state: TxnState,
    /// The largest batch.size every sink topic written so far takes (see `cap_batch_size`).
    batch_cap: Option<usize>,
    /// Whether delivery reports feed the offset mapping (see `collect_runs`).
    collecting: bool,
    /// The slot of each source partition in the context's `sources`.
    slots: HashMap<(Arc<str>, i32), u16>,
    /// What the open transaction's first output record brings in with it (see `begin`); None
    /// once sent, and outside transactions.
    openers: Option<Openers>,
    /// The marker of the open transaction (encoded), and that of the newest
    /// transaction this producer committed: the one an opener restates.
    sent_marker: Option<Vec<u8>>,
    committed_marker: Option<Vec<u8>>,
    /// Sends that found librdkafka's queue full and waited for room. The read loop reads the clock
    /// every 64 records, and again after such a wait: 64 sends that each wait for a slow sink's
    /// delivery reports could otherwise take it well past its barrier.
    /// Counted as the time they waited, in nanoseconds (at least 1 per wait, so that every wait
    /// changes it): also a share of `read_wait_seconds_total`.
    queue_full_nanos: AtomicU64,
    /// The delivery reports' byte count as `in_flight_below` last read it (see there); 0 for a
    /// new producer, whose counts start at 0.
    reported_seen: u64,
    /// How long a transaction's first send waits after the previous transaction ended, so that
    /// its partitions join at once instead of after librdkafka's 20 ms retry (see `settle`).
    settle: Settle,
    /// When the previous transaction's commit or abort returned.
    ended_at: Option<Instant>,
    /// Time first sends were held back, ever: a share of `read_wait_seconds_total`.
    first_send_held: Duration,
    /// Where each producer built here reports its statistics.
    metrics: Option<Arc<Metrics>>,
}

/// Records sent with an epoch's first output record only so that the marker partition and the
/// offset mapping's partition join the transaction then (one AddPartitionsToTxn with the data's
/// partitions) rather than at the barrier and after the flush, where each registration was a round
/// trip to the coordinator on the checkpoint's path (docs/design.md, "Side partitions join with
/// the first record"). Both are harmless to every reader: the restated marker is the newest one
/// this producer committed, and it is visible only if the transaction commits, with the newer
/// marker M(N) after it; the mapping opener is a mapping of no partition.
#[derive(Default)]
pub(crate) struct Openers {
    /// The offset mapping's opener: topic, key and an encoded mapping of no partition.
    pub mapping: Option<(String, String, Vec<u8>)>,
}

/// Our queue.buffering.max.messages when [sink.kafka] does not set one (librdkafka's is 100,000).
/// With small records it, not max_in_flight_bytes, bounds what a checkpoint's flush waits for,
/// so it trades rate at 100 B against checkpoint time: since the source reads in batches, 20,000
/// drained 100 B records 8-14 % faster than 10,000 at a checkpoint p99 of 17-35 ms, and 40,000
/// ~20 % faster but at up to 55 ms and 10 MB more peak RSS (docs/sizing.md).
pub(crate) const SINK_QUEUE_MESSAGES: usize = 20_000;

/// Our batch.size when [sink.kafka] does not set one.
const DEFAULT_BATCH_SIZE: usize = 1_000_000;

/// The batch.size that keeps a batch of innocent records within a topic's max.message.bytes: the
/// broker refuses a whole batch above it, and librdkafka does not split batches. librdkafka counts
/// batch.size before compression but with the protocol's framing; what is left over (a sixteenth,
/// at most 16 KiB) covers what compressing incompressible records adds, a few bytes per block.
pub(crate) fn batch_size_within(max_message_bytes: i64) -> usize {
    let limit = usize::try_from(max_message_bytes).unwrap_or(0);
    (limit - (limit / 16).min(16 * 1024)).max(1)
}

fn batch_size(s: &SinkSettings, cap: Option<usize>) -> usize {
    let wanted = s
        .kafka
        .iter()
        .find(|(k, _)| k == "batch.size")
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(DEFAULT_BATCH_SIZE);
    cap.map_or(wanted, |c| wanted.min(c))
}

/// Our statistics.interval.ms when [sink.kafka] does not set one: the window of the latency
/// gauges (`Metrics::set_sink_latency`), a few scrapes long; librdkafka's default is none.
const STATISTICS_INTERVAL_MS: &str = "5000";

fn build_producer(
    s: &SinkSettings,
    batch_cap: Option<usize>,
    metrics: Option<Arc<Metrics>>,
) -> Result<ThreadedProducer<SinkContext>> {
    let mut cc = ClientConfig::new();
    // Defaults that [sink.kafka] may override. The queue bound keeps what a barrier's flush must
    // deliver small when records are small (the byte limit alone allows 40,000 records of 100 B);
    // docs/sizing.md has the figures. Our flush waits for the delivery count instead of calling
    // rd_kafka_flush, so at a barrier the last batches (and the marker) still wait out linger.ms:
    // 1 ms, not 5, shortened every checkpoint.
    cc.set("linger.ms", "1").set("compression.type", "lz4").set(
        "queue.buffering.max.messages",
        SINK_QUEUE_MESSAGES.to_string(),
    );
    // Only a producer whose statistics go somewhere: a fencing producer's would be decoded for
    // nothing.
    if metrics.is_some() {
        cc.set("statistics.interval.ms", STATISTICS_INTERVAL_MS);
    }
    for (k, v) in &s.kafka {
        cc.set(k, v);
    }
    cc.set("batch.size", batch_size(s, batch_cap).to_string());
    cc.set("bootstrap.servers", &s.bootstrap_servers)
        .set("enable.idempotence", "true");
    if let Some(id) = &s.transactional_id {
        cc.set("transactional.id", id).set(
            "transaction.timeout.ms",
            s.transaction_timeout.as_millis().to_string(),
        );
    }
    let context = SinkContext {
        metrics,
        ..SinkContext::default()
    };
    cc.create_with_context(context)
        .map_err(|e| BridgeError::kafka("create sink producer", e))
}

/// A transaction's first send this much later than its hold asked is a late start (see
/// `Sink::hold_first_send`).
const LATE_START: Duration = Duration::from_millis(1);

/// Backoff for retriable transaction calls: short at first, never longer than two seconds.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis((50u64 << attempt.min(6)).min(2000))
}

impl Sink {
    /// Builds the producer and, for exactly-once, initialises transactions: this fences any older
    /// producer with our transactional id and has the coordinator finish or abort whatever it left
    /// open. Retriable failures are retried until `deadline`. `metrics` receives the producer's
    /// latencies per broker (none for a producer that only fences).
    pub(crate) fn connect(
        settings: SinkSettings,
        deadline: Duration,
        metrics: Option<Arc<Metrics>>,
    ) -> Result<Sink> {
        let producer = build_producer(&settings, None, metrics.clone())?;
        let sink = Sink {
            settings,
            topics: RefCell::default(),
            producer,
            state: TxnState::Ready,
            batch_cap: None,
            collecting: false,
            slots: HashMap::new(),
            openers: None,
            sent_marker: None,
            committed_marker: None,
            queue_full_nanos: AtomicU64::new(0),
            reported_seen: 0,
            settle: Settle::default(),
            ended_at: None,
            first_send_held: Duration::ZERO,
            metrics,
        };
        sink.init_transactions(deadline)?;
        Ok(sink)
    }

    pub(crate) fn settings(&self) -> &SinkSettings {
        &self.settings
    }

    pub(crate) fn is_transactional(&self) -> bool {
        self.settings.transactional_id.is_some()
    }

    fn transactional_id(&self) -> String {
        self.settings.transactional_id.clone().unwrap_or_default()
    }

    fn init_transactions(&self, deadline: Duration) -> Result<()> {
        if !self.is_transactional() {
            return Ok(());
        }
        let end = Instant::now() + deadline;
        let mut attempt = 0;
        loop {
            match self.producer.init_transactions(Duration::from_secs(30)) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    let err = self.fenced_or(e, "init_transactions");
                    if err.action() != Action::Retry || Instant::now() >= end {
                        // init_transactions failing for a reason other than a timeout (for
                        // example INVALID_TRANSACTION_TIMEOUT) says something about our settings.
                        return Err(err);
                    }
                    warn!(error = %err, attempt, "init_transactions failed; retrying");
                    std::thread::sleep(backoff(attempt));
                    attempt += 1;
                }
            }
        }
    }

    /// Drops the producer and builds a new one: the way out of a fatal producer error.
    pub(crate) fn rebuild(&mut self, deadline: Duration) -> Result<()> {
        warn!(transactional_id = %self.transactional_id(), "rebuilding the sink producer");
        self.replace_producer(deadline)
    }

    fn replace_producer(&mut self, deadline: Duration) -> Result<()> {
        let fresh = build_producer(&self.settings, self.batch_cap, self.metrics.clone())?;
        // The slots handed out stay valid for the new producer.
        let sources = self
            .producer
            .context()
            .sources
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        *fresh
            .context()
            .sources
            .write()
            .unwrap_or_else(|p| p.into_inner()) = sources;
        // Dropping the old producer purges whatever it still had in flight. Only what this
        // producer committed is restated: recovery follows a rebuild and decides afresh.
        self.topics.get_mut().clear();
        self.producer = fresh;
        self.reported_seen = 0;
        self.committed_marker = None;
        let collecting = self.collecting;
        self.collect_runs(collecting);
        self.state = TxnState::Ready;
        self.init_transactions(deadline)
    }

    /// Keeps every batch within a sink topic's max.message.bytes, so that no innocent record is
    /// refused with a batch that grew too large. A lower limit than any seen so far rebuilds the
    /// producer: only call it with no transaction open.
    pub(crate) fn cap_batch_size(
        &mut self,
        topic: &str,
        max_message_bytes: i64,
        deadline: Duration,
    ) -> Result<()> {
        let cap = batch_size_within(max_message_bytes);
        let before = batch_size(&self.settings, self.batch_cap);
        if cap >= before {
            return Ok(());
        }
        debug_assert_eq!(
            self.state,
            TxnState::Ready,
            "batch size changed mid-transaction"
        );
        info!(
            topic,
            max_message_bytes,
            batch_size = cap,
            "lowering the sink producer's batch.size to fit the topic's max.message.bytes"
        );
        self.batch_cap = Some(cap);
        self.replace_producer(deadline)
    }

    /// Age of the open transaction, if one is open.
    pub(crate) fn transaction_age(&self) -> Option<Duration> {
        match self.state {
            TxnState::Ready => None,
            TxnState::Open(t) | TxnState::Flushed(t) => Some(t.elapsed()),
        }
    }

    /// A fencing error while our transaction is younger than the transaction timeout can only come
    /// from another producer with our transactional id: that is a zombie situation and we stop.
    /// After the timeout it was the coordinator aborting us, and a rebuild recovers.
    fn fenced_or(&self, e: KafkaError, op: &'static str) -> BridgeError {
        let code = self.cause(match &e {
            KafkaError::Transaction(t) => Some(t.code()),
            other => other.rdkafka_error_code(),
        });
        if let Some(c) = code {
            if is_auth(c) {
                return BridgeError::Unauthorized { op, code: c };
            }
            if is_fencing(c) && self.is_transactional() {
                let young = self
                    .transaction_age()
                    .is_none_or(|age| age < self.settings.transaction_timeout);
                if young {
                    return BridgeError::Fenced {
                        transactional_id: self.transactional_id(),
                    };
                }
            }
        }
        BridgeError::kafka(op, e)
    }

    /// What an error code stands for: for "fatal", the producer's own fatal error (fenced, for
    /// one, which must stop us rather than have a rebuild fence the newer producer back).
    fn cause(&self, code: Option<RDKafkaErrorCode>) -> Option<RDKafkaErrorCode> {
        if code == Some(RDKafkaErrorCode::Fatal) {
            if let Some((fatal, _)) = self.producer.client().fatal_error() {
                return Some(fatal);
            }
        }
        code
    }

    /// Turns an error whose action is Rebuild into Fenced when another live producer fenced us.
    pub(crate) fn classify(&self, err: BridgeError) -> BridgeError {
        match err {
            BridgeError::Kafka { op, source } => self.fenced_or(source, op),
            BridgeError::Delivery { code, .. }
                if self.cause(code).is_some_and(is_fencing) && self.is_transactional() =>
            {
                let young = self
                    .transaction_age()
                    .is_none_or(|age| age < self.settings.transaction_timeout);
                if young {
                    BridgeError::Fenced {
                        transactional_id: self.transactional_id(),
                    }
                } else {
                    err
                }
            }
            other => other,
        }
    }

    /// Opens a transaction. `openers` are sent just before its first output record (an epoch that
    /// reads nothing sends none of them), so that their partitions join the transaction with the
    /// data's; see [`Openers`].
    pub(crate) fn begin(&mut self, openers: Openers) -> Result<()> {
        debug_assert_eq!(self.state, TxnState::Ready, "begin with a transaction open");
        // A failure from an earlier transaction must not leak into this one, nor its runs.
        self.producer.context().take_failure();
        self.runs().clear();
        self.sent_marker = None;
        if self.is_transactional() {
            self.producer
                .begin_transaction()
                .map_err(|e| self.fenced_or(e, "begin_transaction"))?;
            self.openers = Some(openers);
        }
        self.state = TxnState::Open(Instant::now());
        Ok(())
    }

    /// Holds the open transaction's first send back until the hold `settle` picks has passed
    /// since the previous transaction ended, and starts the clock that its first delivery report
    /// stops. A transaction whose first record came after the hold anyway (an idle source) is
    /// not measured: its time says nothing about the hold.
    fn hold_first_send(&mut self) {
        let Some(ended) = self.ended_at else {
            return;
        };
        let until = ended + self.settle.choose();
        let now = Instant::now();
        if now > until + LATE_START {
            self.settle.forget();
            return;
        }
        if until > now {
            std::thread::sleep(until - now);
            self.first_send_held += until - now;
        }
        self.producer.context().arm_first_report();
    }

    /// After a commit: `settle` learns how long the commit's successor waited for its first
    /// report, and the next successor's hold counts from now.
    fn ended(&mut self) {
        match (self.ended_at, self.producer.context().take_first_report()) {
            (Some(ended), Some(report)) => {
                self.settle.observe(report.saturating_duration_since(ended))
            }
            _ => self.settle.forget(),
        }
        self.ended_at = Some(Instant::now());
    }

    /// Time first sends were held back, ever (see `hold_first_send`).
    pub(crate) fn first_send_held(&self) -> Duration {
        self.first_send_held
    }

    /// How long a transaction's first send waits after a commit now (a metric).
    pub(crate) fn first_send_hold(&self) -> Duration {
        self.settle.hold()
    }

    /// Sends the open transaction's openers: the newest committed marker restated, and the
    /// offset mapping's opener.
    #[cold]
    fn send_openers(&mut self) -> Result<()> {
        let Some(o) = self.openers.take() else {
            return Ok(());
        };
        self.hold_first_send();
        if let Some(payload) = &self.committed_marker {
            self.send_marker_payload(payload)?;
        }
        if let Some((topic, key, payload)) = o.mapping {
            self.send_mapping(&topic, &key, &payload)?;
        }
        Ok(())
    }

    /// Queues one output record. A full local queue is waited out (the producer's own thread
    /// drains it). A record librdkafka refuses for itself (larger than message.max.bytes) is
    /// reported with its source; one refused because the transaction already failed is not to
    /// blame, and the record that failed first is reported instead.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send(
        &mut self,
        topic: &str,
        partition: i32,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: Option<OwnedHeaders>,
        timestamp: Option<i64>,
        origin: Origin,
    ) -> Result<()> {
        debug_assert!(
            matches!(self.state, TxnState::Open(_)),
            "send outside a transaction"
        );
        // A test, not a take: the per-record path only reads the field.
        if self.openers.is_some() {
            self.send_openers()?;
        }
        let mut record: BaseRecord<'_, [u8], [u8], Origin> =
            BaseRecord::with_opaque_to(topic, origin).partition(partition);
        if let Some(k) = key {
            record = record.key(k);
        }
        if let Some(p) = payload {
            record = record.payload(p);
        }
        if let Some(h) = headers {
            record = record.headers(h);
        }
        if let Some(ts) = timestamp {
            record = record.timestamp(ts);
        }
        let sent = match self.enqueue(record) {
            // Partitions added to the sink topic since librdkafka last refreshed its metadata
            // (every five minutes by default): refresh now and try once more.
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::UnknownPartition), back)) => {
                self.refresh_metadata(topic);
                self.enqueue(back)
            }
            other => other,
        };
        sent.map_err(|(e, back)| {
            if let Some(first) = self.earlier_failure(&e) {
                return first;
            }
            if e.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) {
                // Not this record's fault: the producer is done for and must be rebuilt.
                return self.fenced_or(e, "produce");
            }
            let src = self.producer.context().source_of(back.delivery_opaque);
            BridgeError::Delivery {
                topic: src.topic.to_string(),
                partition: src.partition,
                offset: src.offset,
                code: e.rdkafka_error_code(),
                reason: e.to_string(),
            }
        })
    }

    /// For a send refused only because the transaction (or the producer) failed earlier: the
    /// failure that caused it, once the delivery reports in flight are in (bounded wait).
    fn earlier_failure(&self, refusal: &KafkaError) -> Option<BridgeError> {
        let code = refusal.rdkafka_error_code();
        if !is_collateral(code) {
            return None;
        }
        // A timeout here only means some reports are still out; what arrived is ranked already.
        let _ = self.wait_delivered(ATTRIBUTION_WAIT);
        let first = self.delivery_failure()?;
        // A producer with a fatal error is rebuilt whatever failed before, unless that was a bad
        // record, which decides what happens next.
        if code == Some(RDKafkaErrorCode::Fatal) && !is_permanent_record_error(first.code()) {
            return None;
        }
        Some(first)
    }

    /// Makes librdkafka learn a topic's current partitions (after the pipeline added some).
    pub(crate) fn refresh_metadata(&self, topic: &str) {
        if let Err(e) = self
            .producer
            .client()
            .fetch_metadata(Some(topic), Duration::from_secs(10))
        {
            warn!(topic, error = %e, "refreshing sink topic metadata failed");
        }
    }

    /// Hands a record to librdkafka, waiting out a full local queue (the producer's own thread
    /// drains it); any other refusal comes back with the record.
    #[allow(clippy::result_large_err)]
    fn enqueue<'r, K, P>(
        &self,
        mut record: BaseRecord<'r, K, P, Origin>,
    ) -> std::result::Result<(), Refused<'r, K, P>>
    where
        K: ToBytes + ?Sized,
        P: ToBytes + ?Sized,
    {
        let bytes = record.key.map_or(0, |k| k.to_bytes().len())
            + record.payload.map_or(0, |p| p.to_bytes().len());
        loop {
            // Counted before the send: the delivery report can arrive before send returns.
            self.producer.context().sent(bytes as u64);
            let sent = if record.headers.is_some() {
                self.producer.send(record)
            } else {
                let rk = self.producer.client().native_ptr();
                self.topics.borrow_mut().send(rk, record)
            };
            match sent {
                Ok(()) => return Ok(()),
                Err((e, back)) => {
                    self.producer.context().unsent(bytes as u64);
                    match e {
                        KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull) => {
                            record = back;
                            let ctx = self.producer.context();
                            let waited = Instant::now();
                            // Until a quarter of what is in flight is reported: librdkafka
                            // then has room for a quarter of its queue, not for one record.
                            let at = ctx.reported_bytes() + (ctx.in_flight_bytes() / 4).max(1);
                            ctx.wakeup
                                .wait(at, Duration::from_millis(5), || ctx.reported_reach(at));
                            let nanos = waited.elapsed().as_nanos().max(1);
                            self.queue_full_nanos.fetch_add(
                                u64::try_from(nanos).unwrap_or(u64::MAX),
                                Ordering::Relaxed,
                            );
                        }
                        e => return Err((e, back)),
                    }
                }
            }
        }
    }

    /// How long sends have waited for room in librdkafka's queue, ever (see the field): it grows
    /// with every such wait.
    pub(crate) fn queue_full_waited(&self) -> Duration {
        Duration::from_nanos(self.queue_full_nanos.load(Ordering::Relaxed))
    }

    /// Key and payload bytes handed to the producer and not yet acknowledged (or failed).
    pub(crate) fn in_flight_bytes(&self) -> u64 {
        self.producer.context().in_flight_bytes()
    }

    /// Whether fewer than `limit` bytes are in flight: the read loop's check before every record.
    /// It reads the delivery reports' count only when the count it read last says the limit is
    /// reached. Reports only lower the bytes in flight, so an old count overstates them and the
    /// limit holds; and per record the check reads only what this thread writes, not a cache line
    /// the delivery thread has just written.
    pub(crate) fn in_flight_below(&mut self, limit: u64) -> bool {
        let ctx = self.producer.context();
        below_limit(
            ctx.sent_bytes(),
            &mut self.reported_seen,
            || ctx.reported_bytes(),
            limit,
        )
    }

    /// Bytes whose delivery report arrived since the producer was built; only differences of it
    /// mean anything.
    pub(crate) fn reported_bytes(&self) -> u64 {
        self.producer.context().reported_bytes()
    }

    /// Returns at once while the bytes in flight are below `limit`; at the limit, waits until a
    /// quarter of it is free again, or `until` passes; says whether the bytes in flight are below
    /// the limit. Woken by the report that frees that quarter, not by every report: waking at the
    /// limit itself had the read loop send one record and wait again.
    pub(crate) fn wait_in_flight_below(&self, limit: u64, until: Instant) -> bool {
        let ctx = self.producer.context();
        if ctx.in_flight_bytes() < limit {
            return true;
        }
        // Only this thread sends, so the bytes sent stay put while it waits.
        let at = ctx.sent_bytes().saturating_sub(limit - limit / 4);
        loop {
            // A failed transaction is not waited on: the next send or the flush reports it.
            if ctx.reported_reach(at) {
                return true;
            }
            let now = Instant::now();
            if now >= until {
                return ctx.in_flight_bytes() < limit;
            }
            ctx.wakeup
                .wait(at, (until - now).min(LIMIT_WAIT), || ctx.reported_reach(at));
        }
    }

    /// The slot of a source partition, for packed origins (`Origin::packed`); None once 65,536
    /// partitions have one (their records' origins are boxed).
    pub(crate) fn source_slot(&mut self, topic: &Arc<str>, partition: i32) -> Option<u16> {
        let key = (topic.clone(), partition);
        if let Some(slot) = self.slots.get(&key) {
            return Some(*slot);
        }
        let mut sources = self
            .producer
            .context()
            .sources
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let slot = u16::try_from(sources.len()).ok()?;
        sources.push(key.clone());
        self.slots.insert(key, slot);
        Some(slot)
    }

    /// Whether delivery reports feed the offset mapping's runs (kept across producer rebuilds).
    pub(crate) fn collect_runs(&mut self, on: bool) {
        self.collecting = on;
        self.producer
            .context()
            .collect_runs
            .store(on, Ordering::Release);
    }

    /// The runs collected from the delivery reports of the open transaction.
    pub(crate) fn runs(&self) -> std::sync::MutexGuard<'_, RunCollector> {
        self.producer
            .context()
            .runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Queues one record of the offset mapping into the open transaction, after the flush: it
    /// commits or aborts with the checkpoint's output and marker. commit_transaction flushes it.
    pub(crate) fn send_mapping(&mut self, topic: &str, key: &str, payload: &[u8]) -> Result<()> {
        let me = Origin::from(SourceRef {
            topic: topic.into(),
            partition: 0,
            offset: -1,
        });
        let record: BaseRecord<'_, str, [u8], Origin> = BaseRecord::with_opaque_to(topic, me)
            .partition(0)
            .key(key)
            .payload(payload);
        self.enqueue(record).map_err(|(e, _)| {
            self.earlier_failure(&e)
                .or_else(|| self.delivery_failure())
                .unwrap_or_else(|| self.fenced_or(e, "produce offset mapping"))
        })
    }

    /// Queues the commit marker M(N) into the open transaction.
    pub(crate) fn send_marker(&mut self, marker: &Marker) -> Result<()> {
        // Nothing of the epoch was sent (it read nothing): no opener is due any more.
        self.openers = None;
        let payload = marker.encode();
        self.send_marker_payload(&payload)?;
        // The intent marker of a take-over (checkpoint 0) is no checkpoint's: never restated.
        if marker.checkpoint_id > 0 {
            self.sent_marker = Some(payload);
        }
        Ok(())
    }

    fn send_marker_payload(&self, payload: &[u8]) -> Result<()> {
        let key = self.settings.marker_key.clone();
        let me = Origin::from(SourceRef {
            topic: self.settings.marker_topic.as_str().into(),
            partition: self.settings.marker_partition,
            offset: -1,
        });
        let record: BaseRecord<'_, str, [u8], Origin> =
            BaseRecord::with_opaque_to(&self.settings.marker_topic, me)
                .partition(self.settings.marker_partition)
                .key(key.as_str())
                .payload(payload);
        self.enqueue(record).map_err(|(e, _)| {
            // The transaction usually failed earlier, on a record: report that record.
            self.earlier_failure(&e)
                .or_else(|| self.delivery_failure())
                .unwrap_or_else(|| self.fenced_or(e, "produce commit marker"))
        })
    }

    /// The first delivery failure since the last look, as an error naming its source record.
    fn delivery_failure(&self) -> Option<BridgeError> {
        let f = self.producer.context().take_failure()?;
        Some(self.classify(BridgeError::Delivery {
            topic: f.source.topic.to_string(),
            partition: f.source.partition,
            offset: f.source.offset,
            code: f.code,
            reason: f.reason,
        }))
    }

    /// Waits until librdkafka holds nothing undelivered, or a delivery failed and the reports
    /// arriving with it had their time (the transaction is lost then; waiting on only delays the
    /// abort). rdkafka's `flush` waits in steps of 100 ms, which alone would make every checkpoint
    /// last 100 ms (measured: median 100.2 ms for 10 records, against 6.3 ms for this loop), so we
    /// poll the in-flight count instead.
    fn wait_delivered(&self, timeout: Duration) -> rdkafka::error::KafkaResult<()> {
        let end = Instant::now() + timeout;
        let mut failed_at: Option<Instant> = None;
        let ctx = self.producer.context();
        // librdkafka's count, not one of ours that the report's callback lowers at once: ours is
        // zero a moment before librdkafka's, and a commit_transaction in that moment sleeps ~100
        // ms in its own flush (tried in session 13: commit step p99 104 ms, bench/README.md).
        while self.producer.in_flight_count() > 0 {
            let now = Instant::now();
            if failed_at.is_none() && ctx.has_failed() {
                failed_at = Some(now);
            }
            if failed_at.is_some_and(|t| now.duration_since(t) >= SETTLE_GRACE) {
                return Ok(());
            }
            if now >= end {
                return Err(KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut));
            }
            // The producer's own thread serves the reports and wakes us at the last one (or a
            // failure); the short bound covers librdkafka's count dropping a moment after the
            // report's callback, which no report follows.
            ctx.wakeup.wait(
                ctx.sent_bytes(),
                REPORT_WAIT.min(end.saturating_duration_since(now)),
                || self.producer.in_flight_count() == 0,
            );
        }
        Ok(())
    }

    /// Waits until every record of the open transaction is acknowledged; any delivery error
    /// (reported with its source record) fails the checkpoint.
    pub(crate) fn flush(&mut self, timeout: Duration) -> Result<()> {
        let began = match self.state {
            TxnState::Open(t) | TxnState::Flushed(t) => t,
            TxnState::Ready => Instant::now(),
        };
        let flushed = self.wait_delivered(timeout);
        if let Some(err) = self.delivery_failure() {
            return Err(err);
        }
        flushed.map_err(|e| self.fenced_or(e, "flush"))?;
        self.state = TxnState::Flushed(began);
        Ok(())
    }

    /// Commits the open transaction, retrying retriable failures until `deadline` passes. The
    /// caller has made the pending checkpoint durable before this call.
    pub(crate) fn commit(&mut self, deadline: Instant) -> Result<()> {
        if !self.is_transactional() {
            self.state = TxnState::Ready;
            return Ok(());
        }
        // What was queued after the flush (the offset mapping) is delivered by our own wait:
        // commit_transaction's internal flush, with rdkafka's polling thread taking the delivery
        // reports, sleeps until that thread's next poll (measured: commit p50 103 ms with one
        // mapping record outstanding, a few ms without).
        if self.producer.in_flight_count() > 0 {
            self.flush(deadline.saturating_duration_since(Instant::now()))?;
        }
        let mut attempt = 0;
        loop {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            match self.producer.commit_transaction(left) {
                Ok(()) => {
                    self.ended();
                    self.state = TxnState::Ready;
                    if let Some(payload) = self.sent_marker.take() {
                        self.committed_marker = Some(payload);
                    }
                    return Ok(());
                }
                Err(e) => {
                    if let Some(failed) = self.delivery_failure() {
                        return Err(failed);
                    }
                    let err = self.fenced_or(e, "commit_transaction");
                    if err.action() == Action::Retry && Instant::now() < deadline {
                        warn!(error = %err, attempt, "commit_transaction failed; retrying");
                        std::thread::sleep(
                            backoff(attempt)
                                .min(deadline.saturating_duration_since(Instant::now())),
                        );
                        attempt += 1;
                        continue;
                    }
                    return Err(err);
                }
            }
        }
    }

    /// Aborts the open transaction (a no-op without one, or without transactions). Records not
    /// yet delivered are purged by librdkafka.
    pub(crate) fn abort(&mut self, timeout: Duration) -> Result<()> {
        if self.state == TxnState::Ready {
            return Ok(());
        }
        if !self.is_transactional() {
            self.state = TxnState::Ready;
            return Ok(());
        }
        let end = Instant::now() + timeout;
        let mut attempt = 0;
        loop {
            match self
                .producer
                .abort_transaction(end.saturating_duration_since(Instant::now()))
            {
                Ok(()) => {
                    self.state = TxnState::Ready;
                    self.producer.context().take_failure();
                    // Its purged records' reports may still come, so its start is not measured;
                    // the coordinator writes abort markers as it writes commit markers.
                    self.settle.forget();
                    self.producer.context().take_first_report();
                    self.ended_at = Some(Instant::now());
                    return Ok(());
                }
                Err(e) => {
                    let err = self.fenced_or(e, "abort_transaction");
                    if classify_kafka_err(&err) == Action::Retry && Instant::now() < end {
                        std::thread::sleep(backoff(attempt));
                        attempt += 1;
                        continue;
                    }
                    return Err(err);
                }
            }
        }
    }
}

fn classify_kafka_err(e: &BridgeError) -> Action {
    match e {
        BridgeError::Kafka { source, .. } => classify_kafka(source),
        other => other.action(),
    }
}

/// Fences a transactional id: init_transactions under it aborts the transaction its producer
/// left open and makes that producer's next transactional call fail with a fencing error.
pub(crate) fn fence(s: &SinkSettings, transactional_id: &str, deadline: Duration) -> Result<()> {
    let settings = SinkSettings {
        transactional_id: Some(transactional_id.to_string()),
        ..s.clone()
    };
    let sink = Sink::connect(settings, deadline, None)?;
    info!(
        transactional_id,
        "fenced the transactional id of an older layout"
    );
    drop(sink);
    Ok(())
}

/// librdkafka properties that configure the connection (security, timeouts), not the producer:
/// the marker reader and the admin client take these from [sink.kafka].
pub(crate) fn is_client_wide(key: &str) -> bool {
    key.starts_with("security.")
        || key.starts_with("ssl.")
        || key.starts_with("sasl.")
        || key.starts_with("socket.")
        || key.starts_with("client.")
        // The unsecured-JWT switch and OIDC's token endpoint TLS (https.ca.location) are part of
        // authentication: without them a reader would connect with no token at all.
        || key.starts_with("enable.sasl.")
        || key.starts_with("https.")
        || key == "enable.ssl.certificate.verification"
        || key == "broker.address.family"
        || key == "metadata.max.age.ms"
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn a_timed_out_flush_shrinks_the_limit_to_what_the_sink_delivers() {
        let mut l = InFlightLimit::new(16 * MIB, Duration::from_secs(4));
        assert_eq!(l.bytes(), 16 * MIB);
        // 512 KiB/s for 4 s: a quarter of the timeout holds 512 KiB.
        l.timed_out(2 * MIB, Duration::from_secs(4));
        assert_eq!(l.bytes(), 512 * 1024);
        l.timed_out(2 * MIB, Duration::from_secs(4));
        assert_eq!(l.bytes(), 256 * 1024);
        // Nothing delivered at all: the floor, never zero.
        l.timed_out(0, Duration::from_secs(4));
        assert_eq!(l.bytes(), MIN_IN_FLIGHT_LIMIT);
        // A rate that would allow more still halves it.
        let mut l = InFlightLimit::new(16 * MIB, Duration::from_secs(4));
        l.timed_out(100 * MIB, Duration::from_secs(4));
        assert_eq!(l.bytes(), 8 * MIB);
    }

    #[test]
    fn fast_flushes_grow_the_limit_at_most_twofold_up_to_the_cap() {
        let mut l = InFlightLimit::new(16 * MIB, Duration::from_secs(4));
        l.timed_out(0, Duration::from_secs(4));
        let mut seen = vec![l.bytes()];
        for _ in 0..8 {
            // The whole limit delivered in 10 ms: a fast sink.
            l.flushed(l.bytes(), Duration::from_millis(10));
            seen.push(l.bytes());
        }
        assert_eq!(
            seen,
            [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384].map(|k| k * 1024)
        );
        // A small flush measures latency: no change either way.
        let before = l.bytes();
        l.flushed(1000, Duration::from_millis(900));
        assert_eq!(l.bytes(), before);
    }

    #[test]
    fn a_slow_flush_sets_the_limit_from_the_measured_rate_and_never_raises_it() {
        let mut l = InFlightLimit::new(16 * MIB, Duration::from_secs(4));
        // 4 MiB in 2 s (budget 1 s): 2 MiB/s, so 2 MiB fit the budget.
        l.flushed(4 * MIB, Duration::from_secs(2));
        assert_eq!(l.bytes(), 2 * MIB);
        // Slow but at a higher rate than the limit: the limit stays.
        l.flushed(8 * MIB, Duration::from_millis(1100));
        assert_eq!(l.bytes(), 2 * MIB);
        // A cap below the floor is the floor.
        let mut small = InFlightLimit::new(50_000, Duration::from_secs(4));
        small.timed_out(0, Duration::from_secs(4));
        assert_eq!(small.bytes(), 50_000);
    }

    #[test]
    fn in_flight_bytes_follow_sends_and_reports() {
        let ctx = SinkContext::default();
        ctx.sent(1000);
        ctx.sent(500);
        ctx.unsent(500);
        assert_eq!(ctx.in_flight_bytes(), 1000);
        let began = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                ctx.reported(1000, false);
            });
            while ctx.in_flight_bytes() > 0 {
                assert!(began.elapsed() < Duration::from_secs(5), "no report");
                ctx.wakeup
                    .wait(1000, Duration::from_secs(1), || ctx.reported_reach(1000));
            }
        });
        assert_eq!(ctx.in_flight_bytes(), 0);
        assert_eq!(ctx.reported_bytes(), 1000);
        // A report for more than is in flight cannot wrap around.
        ctx.reported(10, false);
        assert_eq!(ctx.in_flight_bytes(), 0);
    }

    #[test]
    fn the_limit_check_reads_the_reported_count_only_when_it_must_and_never_overshoots() {
        let ctx = SinkContext::default();
        let mut seen = 0;
        let reads = std::cell::Cell::new(0);
        let check = |seen: &mut u64, limit| {
            below_limit(
                ctx.sent_bytes(),
                seen,
                || {
                    reads.set(reads.get() + 1);
                    ctx.reported_bytes()
                },
                limit,
            )
        };
        ctx.sent(900);
        assert!(check(&mut seen, 1000));
        assert_eq!(
            reads.get(),
            0,
            "below the limit on what this thread sent alone"
        );
        ctx.sent(200);
        // 1,100 sent, none reported: at the limit, so the count is read, and it says so.
        assert!(!check(&mut seen, 1000));
        assert_eq!(reads.get(), 1);
        ctx.reported(600, false);
        // The stale count (0) says 1,100 in flight; the fresh one 500.
        assert!(check(&mut seen, 1000));
        assert_eq!((reads.get(), seen), (2, 600));
        // Reports that came since are not looked for while the count seen is enough.
        ctx.reported(500, false);
        assert!(check(&mut seen, 1000));
        assert_eq!((reads.get(), seen), (2, 600));
        // Whatever the order of sends and reports, the check never says "below" while the bytes
        // in flight are at or over the limit.
        for step in 0..200u64 {
            if step % 3 == 0 {
                ctx.reported(ctx.in_flight_bytes().min(70), false);
            } else {
                ctx.sent(50);
            }
            if check(&mut seen, 1000) {
                assert!(ctx.in_flight_bytes() < 1000, "step {step}");
            }
        }
    }

    /// A window that saw `cnt` values, with these percentiles (µs).
    fn window(cnt: i64, p50: i64, p99: i64, max: i64) -> Window {
        Window {
            cnt,
            p50,
            p99,
            max,
            ..Window::default()
        }
    }

    #[test]
    fn a_statistics_window_gives_its_quantiles_only_when_it_saw_something() {
        assert_eq!(quantiles(&Window::default()), None);
        assert_eq!(
            quantiles(&window(40, 1_500, 38_000, 70_250)),
            Some(Quantiles {
                p50: Duration::from_micros(1_500),
                p99: Duration::from_millis(38),
                max: Duration::from_micros(70_250),
            })
        );
        // As seen from a broker: the bucket's estimate above the exact maximum.
        let q = quantiles(&window(9, 2_431, 5_759, 5_744)).unwrap();
        assert_eq!(q.p99, Duration::from_micros(5_744));
        assert_eq!(q.p99, q.max);
        assert_eq!(q.p50, Duration::from_micros(2_431));
    }

    /// A window as librdkafka writes it (every field, in µs).
    fn window_json(cnt: i64, p99_us: i64) -> serde_json::Value {
        serde_json::json!({
            "min": 100, "max": 90_000, "avg": 2_000, "sum": 20_000, "stddev": 10, "p50": 1_000,
            "p75": 1_500, "p90": 2_000, "p95": 2_500, "p99": p99_us, "p99_99": p99_us,
            "outofrange": 0, "hdrsize": 11_376, "cnt": cnt
        })
    }

    #[test]
    fn statistics_set_each_brokers_latency_and_drop_a_broker_no_longer_reported() {
        let metrics = Arc::new(Metrics::new());
        let ctx = SinkContext {
            metrics: Some(metrics.clone()),
            ..SinkContext::default()
        };
        let broker = |nodeid: i32, rtt: serde_json::Value| {
            serde_json::json!({
                "name": format!("b{nodeid}:9092/{nodeid}"), "nodeid": nodeid, "state": "UP",
                "waitresp_cnt": 1, "rtt": rtt, "int_latency": window_json(5, 3_000),
                "toppars": {}
            })
        };
        // Everything else librdkafka writes (topics, partitions) is skipped, not decoded.
        let stats = |brokers: serde_json::Value| {
            serde_json::to_vec(&serde_json::json!({
                "name": "rdkafka#producer-1", "type": "producer", "ts": 1, "time": 1,
                "brokers": brokers,
                "topics": {"out": {"topic": "out", "partitions": {"0": {"partition": 0}}}}
            }))
            .unwrap()
        };
        let text = || String::from_utf8(metrics.render().1).unwrap();
        // The sink latency series alone: the process collector's figures move between renders.
        let sink_series = |t: &str| {
            t.lines()
                .filter(|l| l.starts_with("eos_bridge_sink_"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let rtt99 = |id: &str| {
            format!("eos_bridge_sink_request_rtt_seconds{{broker=\"{id}\",quantile=\"0.99\"}}")
        };

        ctx.stats_raw(&stats(serde_json::json!({
            "b1:9092/1": broker(1, window_json(10, 40_000)),
            "b2:9092/2": broker(2, window_json(10, 7_000)),
            "b1:9092/bootstrap": broker(-1, window_json(10, 1_000)),
        })));
        let t = text();
        assert!(t.contains(&format!("{} 0.04", rtt99("1"))), "{t}");
        assert!(t.contains(&format!("{} 0.007", rtt99("2"))), "{t}");
        assert!(!t.contains("broker=\"-1\""), "{t}");

        // Broker 2 left the cluster; broker 1 sent no request in this window.
        ctx.stats_raw(&stats(serde_json::json!({
            "b1:9092/1": broker(1, window_json(0, 0)),
        })));
        let t = text();
        assert!(!t.contains(&rtt99("1")), "{t}");
        assert!(!t.contains("broker=\"2\""), "{t}");
        assert!(
            t.contains(
                "eos_bridge_sink_queue_latency_seconds{broker=\"1\",quantile=\"0.99\"} 0.003"
            ),
            "{t}"
        );

        // Statistics it cannot read change nothing.
        ctx.stats_raw(b"{\"brokers\": 7}");
        assert_eq!(sink_series(&text()), sink_series(&t));
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        assert_eq!(backoff(0), Duration::from_millis(50));
        assert_eq!(backoff(1), Duration::from_millis(100));
        assert_eq!(backoff(10), Duration::from_millis(2000));
    }

    #[test]
    fn only_connection_settings_are_shared_with_readers() {
        assert!(is_client_wide("sasl.password"));
        assert!(is_client_wide("security.protocol"));
        assert!(is_client_wide("enable.sasl.oauthbearer.unsecure.jwt"));
        assert!(is_client_wide("https.ca.location"));
        assert!(!is_client_wide("linger.ms"));
        assert!(!is_client_wide("compression.type"));
    }

    #[test]
    fn the_largest_record_is_named_for_a_size_error() {
        let ctx = SinkContext::default();
        let at = |offset| SourceRef {
            topic: "t".into(),
            partition: 0,
            offset,
        };
        for (offset, len) in [(10, 5), (11, 20_000), (12, 7)] {
            ctx.record_failure(DeliveryFailure {
                source: at(offset),
                code: Some(RDKafkaErrorCode::MessageSizeTooLarge),
                reason: "too large".into(),
                payload_len: len,
            });
        }
        assert_eq!(ctx.take_failure().unwrap().source, at(11));
    }

    proptest::proptest! {
        #[test]
        fn a_packed_origin_comes_back_as_it_went(slot: u16, offset in 0i64..1 << 47) {
            let origin = Origin::packed(slot, offset).expect("fits");
            // SAFETY: the pointer was made by into_ptr just above and is taken back once.
            let back = unsafe { Origin::from_ptr(origin.into_ptr()) };
            let same = matches!(back, Origin::Packed { slot: s, offset: o } if s == slot && o == offset);
            proptest::prop_assert!(same, "{:?} came back as {:?}", (slot, offset), back);
        }
    }

    #[test]
    fn origins_that_do_not_pack_are_boxed_and_name_their_record() {
        assert!(Origin::packed(0, 1 << 47).is_none());
        assert!(Origin::packed(0, -1).is_none());
        let ctx = SinkContext::default();
        let src = SourceRef {
            topic: "orders".into(),
            partition: 3,
            offset: i64::MAX,
        };
        // SAFETY: the pointer was made by into_ptr just above and is taken back once.
        let back = unsafe { Origin::from_ptr(Origin::from(src.clone()).into_ptr()) };
        assert_eq!(ctx.source_of(back), src);

        ctx.sources
            .write()
            .unwrap()
            .extend([("a".into(), 0), ("orders".into(), 3)]);
        let packed = Origin::packed(1, 77).unwrap();
        // SAFETY: as above.
        let back = unsafe { Origin::from_ptr(packed.into_ptr()) };
        assert_eq!(
            ctx.source_of(back),
            SourceRef {
                topic: "orders".into(),
                partition: 3,
                offset: 77
            }
        );
    }

    fn failure(offset: i64, code: RDKafkaErrorCode, len: usize) -> DeliveryFailure {
        DeliveryFailure {
            source: SourceRef {
                topic: "t".into(),
                partition: 0,
                offset,
            },
            code: Some(code),
            reason: format!("{code:?}"),
            payload_len: len,
        }
    }

    /// The order librdkafka reports a transaction's failures in: the records it purged from the
    /// queue when the transaction failed, and records refused because of the state, can come
    /// before the record whose own error failed it. That record is the one named.
    #[test]
    fn the_record_that_failed_is_named_not_the_collateral_ones() {
        let ctx = SinkContext::default();
        assert!(!ctx.has_failed());
        ctx.record_failure(failure(4464, RDKafkaErrorCode::PurgeQueue, 100));
        assert!(ctx.has_failed());
        ctx.record_failure(failure(4465, RDKafkaErrorCode::State, 100));
        ctx.record_failure(failure(
            50_000,
            RDKafkaErrorCode::MessageSizeTooLarge,
            500_000,
        ));
        ctx.record_failure(failure(4466, RDKafkaErrorCode::PurgeInflight, 100));
        let f = ctx.take_failure().unwrap();
        assert_eq!(f.source.offset, 50_000);
        assert_eq!(f.code, Some(RDKafkaErrorCode::MessageSizeTooLarge));

        // A batch with an invalid record: the others of the batch are not to blame.
        ctx.record_failure(failure(7, RDKafkaErrorCode::InvalidDifferentRecord, 10));
        ctx.record_failure(failure(8, RDKafkaErrorCode::InvalidRecord, 10));
        ctx.record_failure(failure(9, RDKafkaErrorCode::InvalidDifferentRecord, 10));
        assert_eq!(ctx.take_failure().unwrap().source.offset, 8);
    }

    #[test]
    fn a_real_error_outranks_collateral_ones_and_is_kept_against_equals() {
        let ctx = SinkContext::default();
        ctx.record_failure(failure(1, RDKafkaErrorCode::State, 10));
        ctx.record_failure(failure(2, RDKafkaErrorCode::MessageTimedOut, 10));
        ctx.record_failure(failure(3, RDKafkaErrorCode::NotEnoughReplicas, 10));
        ctx.record_failure(failure(4, RDKafkaErrorCode::PurgeQueue, 10));
        assert_eq!(ctx.take_failure().unwrap().source.offset, 2);

        // A permanent error is not displaced by a later ordinary one, nor by a smaller size error.
        ctx.record_failure(failure(5, RDKafkaErrorCode::MessageSizeTooLarge, 900));
        ctx.record_failure(failure(6, RDKafkaErrorCode::RequestTimedOut, 10));
        ctx.record_failure(failure(7, RDKafkaErrorCode::MessageSizeTooLarge, 800));
        assert_eq!(ctx.take_failure().unwrap().source.offset, 5);
        assert!(!ctx.has_failed());
    }

    #[test]
    fn errors_are_sorted_into_permanent_collateral_and_the_rest() {
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::InvalidRecord,
            RDKafkaErrorCode::InvalidTimestamp,
        ] {
            assert!(is_permanent_record_error(Some(code)), "{code:?}");
            assert!(!is_collateral(Some(code)), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::State,
            RDKafkaErrorCode::PurgeQueue,
            RDKafkaErrorCode::PurgeInflight,
            RDKafkaErrorCode::InvalidDifferentRecord,
            RDKafkaErrorCode::Fatal,
        ] {
            assert!(is_collateral(Some(code)), "{code:?}");
            assert!(!is_permanent_record_error(Some(code)), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::OutOfOrderSequenceNumber,
            RDKafkaErrorCode::ProducerFenced,
        ] {
            assert_eq!(rank(Some(code)), 1, "{code:?}");
        }
        assert_eq!(rank(None), 1);
    }

    fn settings(kafka: &[(&str, &str)]) -> SinkSettings {
        SinkSettings {
            bootstrap_servers: "localhost:9092".into(),
            kafka: kafka
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            transactional_id: None,
            transaction_timeout: Duration::from_secs(60),
            marker_topic: "m".into(),
            marker_partition: 0,
            foreign_transaction_wait: Duration::ZERO,
            bridge_id: "b".into(),
            marker_key: "b/0".into(),
        }
    }

    #[test]
    fn batches_stay_within_the_smallest_topic_limit() {
        // Room for compression's framing, and never above the limit.
        let cap = batch_size_within(65_536);
        assert!((60_000..65_536).contains(&cap), "{cap}");
        assert_eq!(batch_size_within(0), 1);
        assert_eq!(batch_size(&settings(&[]), None), DEFAULT_BATCH_SIZE);
        assert_eq!(batch_size(&settings(&[]), Some(cap)), cap);
        // A smaller batch.size of the user's stays; a larger one is capped.
        assert_eq!(
            batch_size(&settings(&[("batch.size", "16384")]), Some(cap)),
            16_384
        );
        assert_eq!(
            batch_size(&settings(&[("batch.size", "5000000")]), Some(cap)),
            cap
        );
        // The broker's default limit (1048588) leaves our default alone.
        assert_eq!(
            batch_size(&settings(&[]), Some(batch_size_within(1_048_588))),
            DEFAULT_BATCH_SIZE
        );
    }

    #[test]
    fn delivery_failures_are_reported_once_with_the_first_source() {
        let ctx = SinkContext::default();
        assert!(ctx.take_failure().is_none());
        let src = SourceRef {
            topic: "t".into(),
            partition: 2,
            offset: 9,
        };
        ctx.record_failure(DeliveryFailure {
            source: src.clone(),
            code: None,
            reason: "first".into(),
            payload_len: 1,
        });
        ctx.record_failure(DeliveryFailure {
            source: src.clone(),
            code: None,
            reason: "second".into(),
            payload_len: 2,
        });
        let f = ctx.take_failure().unwrap();
        assert_eq!(f.source, src);
        assert_eq!(f.reason, "first");
        assert!(ctx.take_failure().is_none());
    }
}
