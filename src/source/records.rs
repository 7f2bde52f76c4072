//! Owns how consumed records leave librdkafka: a batch at a time, from a queue of the bridge's own
//! that every assigned partition's fetch queue is forwarded to, and [`SourceRecord`], one record
//! owned until it is dropped.
//!
//! Why batches: librdkafka's per-record poll locks the queue, reads the clock and moves the
//! partition's position on every call. Read that way (rdkafka's `poll`, or librdkafka's own
//! `rd_kafka_consumer_poll`, which costs the same), 100 B records took 0.40-0.70 CPU-s per
//! million in the reading thread; `rd_kafka_consume_batch_queue` took 0.12-0.24, and a copier
//! reading that way drained 1.28-1.57x the records/s of the same copier polling
//! (examples/consume_cost.rs, bench/README.md "Session 38").
//!
//! Why a queue of our own: batch consumption serves every other kind of operation on its queue
//! with callbacks, and rdkafka uses events instead, so logs, statistics and errors on the
//! consumer's queue would be dropped. Only fetched records (and a partition's consumer errors)
//! come here; rdkafka keeps serving the consumer's queue (`Source::poll` polls it whenever the
//! buffer runs dry). A partition's fetch queue is forwarded here before the partition is first
//! assigned, which also marks it as the application's, so that librdkafka never forwards it to
//! the consumer's queue; after every assignment it is forwarded again until it delivers (see
//! [`Batches::unconfirmed`]).
//!
//! The buffer holds at most one batch of records that librdkafka already counts as read: its
//! position for their partitions is past them (see [`Batches::pending_partitions`]).

use std::collections::{HashSet, VecDeque};
use std::ffi::{CStr, CString};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use rdkafka::bindings as rdsys;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{BorrowedHeaders, Message, OwnedMessage, Timestamp};
use rdkafka::types::RDKafkaErrorCode;

use crate::error::{BridgeError, Result};

/// Records taken off librdkafka's queue per call. Per-call costs are gone at a few hundred; more
/// only holds more records outside librdkafka's prefetch bound (1 MB at 1 KB records).
const BATCH: usize = 1000;

/// A consumed record, librdkafka's own message (not copied), destroyed when dropped. `'a` is the
/// consumer's lifetime: a message must not outlive the client that fetched it.
pub(crate) struct SourceRecord<'a> {
    ptr: NonNull<rdsys::rd_kafka_message_t>,
    _consumer: PhantomData<&'a ()>,
}

impl SourceRecord<'_> {
    fn msg(&self) -> &rdsys::rd_kafka_message_t {
        // SAFETY: `ptr` is a live message we own until drop.
        unsafe { self.ptr.as_ref() }
    }

    /// librdkafka's message.
    pub(crate) fn ptr(&self) -> *mut rdsys::rd_kafka_message_t {
        self.ptr.as_ptr()
    }

    /// An owned copy (key, payload, headers and all), for what outlives the epoch's reading.
    pub(crate) fn detach(&self) -> OwnedMessage {
        OwnedMessage::new(
            self.payload().map(<[u8]>::to_vec),
            self.key().map(<[u8]>::to_vec),
            self.topic().to_owned(),
            self.timestamp(),
            self.partition(),
            self.offset(),
            self.headers().map(BorrowedHeaders::detach),
        )
    }
}

impl Drop for SourceRecord<'_> {
    fn drop(&mut self) {
        // SAFETY: we own the message; nothing borrowed from it outlives `self`.
        unsafe { rdsys::rd_kafka_message_destroy(self.ptr.as_ptr()) }
    }
}

/// The name of a consumed message's topic.
///
/// # Safety
/// `rkt` must be the topic handle of a live consumed message; the name lives as long as it.
unsafe fn topic_name<'a>(rkt: *mut rdsys::rd_kafka_topic_t) -> &'a CStr {
    // SAFETY: rd_kafka_topic_name returns the handle's NUL-terminated name.
    unsafe { CStr::from_ptr(rdsys::rd_kafka_topic_name(rkt)) }
}

/// Bytes librdkafka hands out as a pointer and a length; None for a null pointer.
///
/// # Safety
/// `p` must be null or point to `len` bytes that live as long as `'a`.
unsafe fn bytes<'a>(p: *mut std::ffi::c_void, len: usize) -> Option<&'a [u8]> {
    // SAFETY: per the contract.
    (!p.is_null()).then(|| unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

impl Message for SourceRecord<'_> {
    type Headers = BorrowedHeaders;

    fn key(&self) -> Option<&[u8]> {
        let m = self.msg();
        // SAFETY: the key lives as long as the message.
        unsafe { bytes(m.key, m.key_len) }
    }

    fn payload(&self) -> Option<&[u8]> {
        let m = self.msg();
        // SAFETY: the payload lives as long as the message.
        unsafe { bytes(m.payload, m.len) }
    }

    unsafe fn payload_mut(&mut self) -> Option<&mut [u8]> {
        let m = self.msg();
        // SAFETY: the caller's, as the trait says; the payload lives as long as the message.
        (!m.payload.is_null())
            .then(|| unsafe { std::slice::from_raw_parts_mut(m.payload.cast::<u8>(), m.len) })
    }

    fn topic(&self) -> &str {
        // SAFETY: a consumed message's topic handle lives as long as the message.
        let name = unsafe { topic_name(self.msg().rkt) };
        name.to_str().expect("a topic name is UTF-8")
    }

    fn partition(&self) -> i32 {
        self.msg().partition
    }

    fn offset(&self) -> i64 {
        self.msg().offset
    }

    fn timestamp(&self) -> Timestamp {
        use rdsys::rd_kafka_timestamp_type_t as T;
        let mut kind = T::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        // SAFETY: a live message and a type we own.
        let ts = unsafe { rdsys::rd_kafka_message_timestamp(self.ptr(), &mut kind) };
        match kind {
            _ if ts == -1 => Timestamp::NotAvailable,
            T::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE => Timestamp::NotAvailable,
            T::RD_KAFKA_TIMESTAMP_CREATE_TIME => Timestamp::CreateTime(ts),
            T::RD_KAFKA_TIMESTAMP_LOG_APPEND_TIME => Timestamp::LogAppendTime(ts),
        }
    }

    fn headers(&self) -> Option<&BorrowedHeaders> {
        let mut h = std::ptr::null_mut();
        // SAFETY: a live message; librdkafka parses its headers into the message on first
        // access and keeps them as long as the message.
        let err = unsafe { rdsys::rd_kafka_message_headers(self.ptr(), &mut h) };
        if err != rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || h.is_null() {
            return None;
        }
        // SAFETY: `BorrowedHeaders` is rdkafka's zero-sized stand-in for librdkafka's header
        // list, used only through a reference whose address is the list's (rdkafka 0.39 makes
        // its own the same way); the list lives as long as `self`.
        Some(unsafe { &*h.cast::<BorrowedHeaders>() })
    }
}

/// A message pointer the buffer owns.
struct Owned(NonNull<rdsys::rd_kafka_message_t>);

// SAFETY: librdkafka's messages may be used and destroyed on any thread, one at a time; the
// buffer is only ever touched by the thread that owns the `Source`.
unsafe impl Send for Owned {}

/// The longest between two forwardings of a partition that has not delivered since an assignment.
const REFORWARD_MAX: Duration = Duration::from_secs(1);

/// The bridge's own record queue and the records taken off it but not yet handed out.
pub(super) struct Batches {
    rk: NonNull<rdsys::rd_kafka_t>,
    queue: NonNull<rdsys::rd_kafka_queue_t>,
    buffered: VecDeque<Owned>,
    scratch: Vec<*mut rdsys::rd_kafka_message_t>,
    /// Partitions of the newest assignment that have not delivered anything here since. An
    /// assignment stops every partition it replaces, and librdkafka clears a partition's
    /// forwarding when it processes the stop, after `assign` has returned; the fetch that starts
    /// next leaves the fetch queue unforwarded (the application's flag stays). So a partition is
    /// forwarded again, at growing intervals, until something of its arrives here: fetched after
    /// the stop, it shows that its forwarding outlived the stop. Forwarding moves what the fetch
    /// queue already holds to this queue's end, in order.
    unconfirmed: HashSet<(String, i32)>,
    next_forward: Instant,
    forward_every: Duration,
}

// SAFETY: librdkafka's clients and queues are thread-safe; the pointers in `scratch` are only
// written and read within one call of `fill`.
unsafe impl Send for Batches {}

impl Batches {
    /// A new queue of the consumer `rk`, which must outlive it.
    pub(super) fn new(rk: *mut rdsys::rd_kafka_t) -> Batches {
        let rk = NonNull::new(rk).expect("a live consumer");
        // SAFETY: a live client.
        let queue = NonNull::new(unsafe { rdsys::rd_kafka_queue_new(rk.as_ptr()) })
            .expect("rd_kafka_queue_new returns a queue");
        Batches {
            rk,
            queue,
            buffered: VecDeque::with_capacity(BATCH),
            scratch: vec![std::ptr::null_mut(); BATCH],
            unconfirmed: HashSet::new(),
            next_forward: Instant::now(),
            forward_every: Duration::ZERO,
        }
    }

    /// Before the consumer is assigned `partitions`: drops what is buffered (after a rewind none
    /// of it is next) and forwards each partition here, as often as it takes (see `unconfirmed`).
    pub(super) fn assigning<'p>(
        &mut self,
        partitions: impl Iterator<Item = (&'p str, i32)>,
    ) -> Result<()> {
        self.clear();
        self.unconfirmed = partitions.map(|(t, p)| (t.to_string(), p)).collect();
        self.forward_every = Duration::from_millis(1);
        self.next_forward = Instant::now();
        self.forward_unconfirmed()
    }

    fn forward_unconfirmed(&mut self) -> Result<()> {
        for (topic, partition) in &self.unconfirmed {
            let name = CString::new(topic.as_str()).map_err(|_| {
                BridgeError::kafka(
                    "forward a source partition",
                    KafkaError::MessageConsumption(RDKafkaErrorCode::InvalidArgument),
                )
            })?;
            // SAFETY: a live client and a NUL-terminated name; the partition's queue handle is
            // released at once (the forwarding stays with the partition's fetch queue).
            unsafe {
                let pq = rdsys::rd_kafka_queue_get_partition(
                    self.rk.as_ptr(),
                    name.as_ptr(),
                    *partition,
                );
                if pq.is_null() {
                    return Err(BridgeError::kafka(
                        "forward a source partition",
                        KafkaError::MessageConsumption(RDKafkaErrorCode::UnknownPartition),
                    ));
                }
                rdsys::rd_kafka_queue_forward(pq, self.queue.as_ptr());
                rdsys::rd_kafka_queue_destroy(pq);
            }
        }
        let now = Instant::now();
        self.next_forward = now + self.forward_every;
        self.forward_every = (self.forward_every * 2).min(REFORWARD_MAX);
        Ok(())
    }

    /// Drops what is buffered.
    fn clear(&mut self) {
        for Owned(m) in self.buffered.drain(..) {
            // SAFETY: buffered messages are ours to destroy.
            unsafe { rdsys::rd_kafka_message_destroy(m.as_ptr()) }
        }
    }

    /// Whether the buffer is empty.
    pub(super) fn is_empty(&self) -> bool {
        self.buffered.is_empty()
    }

    /// Takes what the queue holds, up to a batch; when it holds nothing, waits up to `wait` for
    /// one record (while partitions are unconfirmed, only until they are next forwarded).
    pub(super) fn fill(&mut self, wait: Duration) -> Result<()> {
        let confirming = !self.unconfirmed.is_empty();
        if confirming && Instant::now() >= self.next_forward {
            self.forward_unconfirmed()?;
        }
        let mut got = self.take(0, BATCH);
        if got == 0 && !wait.is_zero() {
            let wait = if confirming {
                wait.min(
                    self.next_forward
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                )
            } else {
                wait
            };
            // Whole milliseconds, rounded up: rounded down, a wait under 1 ms would spin.
            let ms = i32::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
            got = self.take(ms, 1);
        }
        if confirming {
            self.confirm(got);
        }
        for &m in &self.scratch[..got] {
            if let Some(m) = NonNull::new(m) {
                self.buffered.push_back(Owned(m));
            }
        }
        Ok(())
    }

    /// Marks the partitions of the `got` messages in `scratch` as confirmed.
    fn confirm(&mut self, got: usize) {
        // A batch holds runs of a few partitions: look each (topic handle, partition) up once.
        let mut seen: Vec<(usize, i32)> = Vec::new();
        for &m in &self.scratch[..got] {
            // SAFETY: messages just taken off the queue, live.
            let m = unsafe { &*m };
            let key = (m.rkt as usize, m.partition);
            if seen.contains(&key) {
                continue;
            }
            seen.push(key);
            // SAFETY: a message just taken off the queue.
            let name = unsafe { topic_name(m.rkt) };
            self.unconfirmed
                .remove(&(name.to_string_lossy().into_owned(), m.partition));
        }
    }

    fn take(&mut self, timeout_ms: i32, max: usize) -> usize {
        // SAFETY: our live queue and room for `max` <= BATCH pointers.
        let n = unsafe {
            rdsys::rd_kafka_consume_batch_queue(
                self.queue.as_ptr(),
                timeout_ms,
                self.scratch.as_mut_ptr(),
                max,
            )
        };
        usize::try_from(n).unwrap_or(0)
    }

    /// The next buffered record, or the error librdkafka put in its place.
    pub(super) fn next<'a>(&mut self) -> Option<KafkaResult<SourceRecord<'a>>> {
        let Owned(m) = self.buffered.pop_front()?;
        let record = SourceRecord {
            ptr: m,
            _consumer: PhantomData,
        };
        let err = record.msg().err;
        if err == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Some(Ok(record));
        }
        Some(Err(
            if err == rdsys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__PARTITION_EOF {
                KafkaError::PartitionEOF(record.partition())
            } else {
                KafkaError::MessageConsumption(err.into())
            },
        ))
    }

    /// The partitions (topic, partition) of buffered records: librdkafka's position for them is
    /// past records the pipeline has not read yet.
    pub(super) fn pending_partitions(&self) -> HashSet<(String, i32)> {
        self.buffered
            .iter()
            .map(|Owned(m)| {
                // SAFETY: buffered messages are live; see `SourceRecord::topic`.
                let m = unsafe { m.as_ref() };
                let name = unsafe { topic_name(m.rkt) };
                (name.to_string_lossy().into_owned(), m.partition)
            })
            .collect()
    }
}

impl Drop for Batches {
    fn drop(&mut self) {
        self.clear();
        // SAFETY: our queue handle, released once; forwarded partitions keep their own reference.
        unsafe { rdsys::rd_kafka_queue_destroy(self.queue.as_ptr()) }
    }
}
