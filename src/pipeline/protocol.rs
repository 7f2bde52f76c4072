//! The delivery modes as one protocol (docs/design.md, "The checkpoint protocol"): what each mode
//! does at the barrier, how it completes a checkpoint, and what recovery reads.
//!
//! The pipeline reads until the barrier, hands the checkpoint to `Protocol::complete`, and
//! publishes. `complete` talks to the sink and the checkpoint store through two small traits, so
//! that each mode's order of steps, and what a failure at each step leaves behind, is testable
//! without a broker; the failpoints sit at the same steps for the tests that crash a real bridge.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::checkpoint::{Checkpoint, CheckpointState, CheckpointStore};
use crate::config::Delivery;
use crate::error::Result;
use crate::failpoint;
use crate::marker::{Marker, MARKER_VERSION};

/// The sink as the protocol sees it: the epoch's output is already queued (or, at-most-once,
/// held) when `complete` begins.
pub(crate) trait EpochSink {
    /// Queues the commit marker of the checkpoint into the open transaction.
    fn send_marker(&mut self, marker: &Marker) -> Result<()>;
    /// Waits until everything queued is acknowledged, or fails with the first delivery error.
    fn flush(&mut self, deadline: Instant) -> Result<()>;
    /// Queues the checkpoint's offset mapping (source offset → sink offset runs, known once the
    /// flush has every delivery report) into the open transaction; nothing when none is kept.
    fn send_offset_mapping(&mut self, c: &Checkpoint) -> Result<()>;
    /// Judges the identity of the epoch's topics (asked at the barrier) before anything of the
    /// checkpoint commits: an error when a topic is no longer the incarnation its positions name.
    fn verify(&mut self) -> Result<()>;
    /// Commits the transaction (without transactions: ends the epoch).
    fn commit(&mut self, deadline: Instant) -> Result<()>;
    /// Queues the records held back until the checkpoint was written.
    fn write_held(&mut self, deadline: Instant) -> Result<()>;
}

/// The checkpoint store as the protocol sees it.
pub(crate) trait EpochStore {
    /// Durably, before the commit: only a checkpoint that names a savepoint has one.
    fn write_pending(&self, c: &Checkpoint) -> Result<()>;
    /// After the commit: the committed write and its fsync, off the checkpoint's path.
    fn commit_in_background(&self, c: &Checkpoint) -> Result<()>;
    /// Durably, in line.
    fn put_committed(&self, c: &Checkpoint) -> Result<()>;
}

impl EpochStore for Arc<CheckpointStore> {
    fn write_pending(&self, c: &Checkpoint) -> Result<()> {
        Ok(CheckpointStore::write_pending(self, c)?)
    }
    fn commit_in_background(&self, c: &Checkpoint) -> Result<()> {
        Ok(CheckpointStore::commit_in_background(self, c)?)
    }
    fn put_committed(&self, c: &Checkpoint) -> Result<()> {
        Ok(CheckpointStore::put_committed(self, c)?)
    }
}

/// What a checkpoint's completion has done so far, kept even when it fails: the failure path
/// needs to know what to undo.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Progress {
    /// A pending checkpoint is in the store and its transaction not known committed: the abort
    /// path discards it.
    pub pending: Option<u64>,
    /// The checkpoint is committed in the store before its output was written (at-most-once):
    /// from here on a failure rewinds to it, not to the previous one.
    pub checkpointed_ahead: bool,
    /// How long the transaction's commit took.
    pub commit_took: Option<Duration>,
    /// How long the flush and the store's part took (exactly-once: handing the committed
    /// checkpoint to the writer thread, or a savepoint's two durable writes), for the log line
    /// that says where a checkpoint's time went.
    pub flush_took: Option<Duration>,
    pub store_took: Option<Duration>,
    /// How long the identity verdict still waited for the clusters' answer.
    pub verify_took: Option<Duration>,
    /// How long the marker took to enter the producer's queue: it can wait there for room when
    /// the epoch's last sends filled the queue, which is waiting on the broker like the flush.
    pub marker_took: Option<Duration>,
    /// How long the offset mapping took to build and enqueue (its delivery is in the commit).
    pub mapping_took: Option<Duration>,
}

/// Runs one step of the protocol and, when it succeeds, keeps how long it took in `took`.
fn timed(took: &mut Option<Duration>, step: impl FnOnce() -> Result<()>) -> Result<()> {
    let t = Instant::now();
    step()?;
    *took = Some(t.elapsed());
    Ok(())
}

/// One delivery mode's protocol, named as `bridge.delivery` names the modes.
#[allow(clippy::enum_variant_names)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// Marker, flush, offset mapping, commit, committed checkpoint (written after the commit);
    /// recovery by the newest committed marker.
    ExactlyOnce,
    /// No transactions: positions checkpointed once the output is flushed; a crash writes the
    /// epoch again.
    AtLeastOnce,
    /// Positions checkpointed before the output is written; a crash loses the epoch's output.
    AtMostOnce,
}

impl From<Delivery> for Protocol {
    fn from(d: Delivery) -> Self {
        match d {
            Delivery::ExactlyOnce => Protocol::ExactlyOnce,
            Delivery::AtLeastOnce => Protocol::AtLeastOnce,
            Delivery::AtMostOnce => Protocol::AtMostOnce,
        }
    }
}

/// The commit marker M(N) of a checkpoint.
fn marker_of(c: &Checkpoint) -> Marker {
    Marker {
        version: MARKER_VERSION,
        bridge_id: c.bridge_id.clone(),
        instance: c.instance,
        instances: c.instances,
        checkpoint_id: c.id,
        positions: c.positions.clone(),
        time_ms: c.created_ms,
        identity: c.identity.clone(),
    }
}

impl Protocol {
    /// Before the barrier: whether records are held until their checkpoint is written, instead of
    /// sent as they are read.
    pub(crate) fn holds_records(self) -> bool {
        self == Protocol::AtMostOnce
    }

    /// At start-up and recovery: whether the mode writes in transactions with commit markers, so
    /// that the markers (and the layouts they record) decide where to start.
    pub(crate) fn recovers_from_markers(self) -> bool {
        self == Protocol::ExactlyOnce
    }

    /// Whether a failed epoch is replayed from the previous checkpoint; at-most-once has
    /// checkpointed past it already, so it cannot write a bad record to a dead-letter topic.
    pub(crate) fn replays_failed_epochs(self) -> bool {
        self != Protocol::AtMostOnce
    }

    /// Completes checkpoint `c` (committed state; its id is N) after the barrier, in the mode's
    /// order. `progress` says what was done when an error returns.
    pub(crate) fn complete(
        self,
        sink: &mut impl EpochSink,
        store: &impl EpochStore,
        c: &Checkpoint,
        deadline: Instant,
        progress: &mut Progress,
    ) -> Result<()> {
        debug_assert_eq!(c.state, CheckpointState::Committed);
        match self {
            Protocol::ExactlyOnce => {
                timed(&mut progress.marker_took, || {
                    sink.send_marker(&marker_of(c))
                })?;
                failpoint::hit_at("after-marker", c.id);
                // No pending write for an ordinary checkpoint: the marker commits with the
                // transaction and recovery adopts its positions when sled lacks them, so sled
                // needs the checkpoint only after the commit, and then off this path. A savepoint's
                // name is written durably first: the operator is told about it after the commit.
                let named = c.savepoint.is_some();
                let mut store_took = Duration::ZERO;
                if named {
                    let t = Instant::now();
                    store.write_pending(&Checkpoint {
                        state: CheckpointState::Pending,
                        ..c.clone()
                    })?;
                    store_took = t.elapsed();
                    progress.pending = Some(c.id);
                }
                failpoint::hit_at("after-precommit", c.id);
                timed(&mut progress.flush_took, || sink.flush(deadline))?;
                failpoint::hit_at("after-flush", c.id);
                timed(&mut progress.verify_took, || sink.verify())?;
                timed(&mut progress.mapping_took, || sink.send_offset_mapping(c))?;
                timed(&mut progress.commit_took, || sink.commit(deadline))?;
                failpoint::hit_at("after-commit", c.id);
                progress.pending = None;
                let t = Instant::now();
                if named {
                    // In line, so that the savepoint is listed by the time the operator hears of it.
                    store.put_committed(c)?;
                } else {
                    store.commit_in_background(c)?;
                }
                progress.store_took = Some(store_took + t.elapsed());
                failpoint::hit_at("after-mark-committed", c.id);
            }
            Protocol::AtLeastOnce => {
                sink.flush(deadline)?;
                sink.verify()?;
                sink.commit(deadline)?;
                store.put_committed(c)?;
            }
            Protocol::AtMostOnce => {
                // Before the checkpoint: at-most-once commits it before it writes.
                sink.verify()?;
                store.put_committed(c)?;
                progress.checkpointed_ahead = true;
                sink.write_held(deadline)?;
                // A failure now loses the epoch's records: that is what at-most-once promises. A
                // bad record still stops the bridge, as it does in the other modes.
                match sink.flush(deadline) {
                    Err(e) if super::blamed_record(&e).is_some() => return Err(e),
                    Err(e) => {
                        warn!(error = %e, "at-most-once: records of this epoch were not all delivered");
                    }
                    Ok(()) => {}
                }
                sink.commit(deadline)?;
            }
        }
        Ok(())
    }

    /// What became of the failed epoch when a bad record stops the bridge, for its message.
    /// `resume` is the last committed checkpoint; `aborted` whether the transaction was aborted.
    pub(crate) fn stop_outcome(self, aborted: bool, resume: u64) -> String {
        match self {
            Protocol::ExactlyOnce if aborted => format!(
                "The bridge stopped with the transaction of checkpoint {} aborted, so nothing of it is visible; a \
                 restart resumes from checkpoint {resume} and stops here again until the fix",
                resume + 1
            ),
            Protocol::ExactlyOnce => format!(
                "The bridge stopped; the transaction of checkpoint {} could not be aborted and is aborted by the \
                 coordinator after transaction.timeout, so nothing of it becomes visible; a restart resumes from \
                 checkpoint {resume} and stops here again until the fix",
                resume + 1
            ),
            Protocol::AtLeastOnce => format!(
                "The bridge stopped; a restart resumes from checkpoint {resume}, writes again what this epoch \
                 delivered before the record (at-least-once), and stops here again until the fix"
            ),
            Protocol::AtMostOnce => "The bridge stopped; at-most-once had checkpointed past this epoch's records \
                 before writing them, so this record and the epoch's records not yet written are lost, and a \
                 restart continues after them"
                .to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use rdkafka::error::RDKafkaErrorCode;

    use super::*;
    use crate::error::BridgeError;
    use crate::positions::Positions;

    type Log = Rc<RefCell<Vec<String>>>;

    /// Records every call in one log shared with the store, and fails the step named `fail`.
    struct FakeSink {
        log: Log,
        fail: Option<&'static str>,
        /// The error a failing flush returns.
        flush_error: fn() -> BridgeError,
    }

    struct FakeStore {
        log: Log,
        fail: Option<&'static str>,
    }

    fn step(log: &Log, fail: Option<&'static str>, name: &'static str) -> Result<()> {
        log.borrow_mut().push(name.to_string());
        if fail == Some(name) {
            return Err(BridgeError::CheckpointTimeout {
                id: 7,
                step: name,
                timeout: Duration::from_secs(1),
            });
        }
        Ok(())
    }

    impl EpochSink for FakeSink {
        fn send_marker(&mut self, m: &Marker) -> Result<()> {
            assert_eq!((m.checkpoint_id, m.time_ms), (7, 1_000), "{m:?}");
            assert_eq!(m.positions.get("in", 0), Some(42));
            step(&self.log, self.fail, "send_marker")
        }
        fn flush(&mut self, _: Instant) -> Result<()> {
            if self.fail == Some("flush") {
                self.log.borrow_mut().push("flush".into());
                return Err((self.flush_error)());
            }
            step(&self.log, self.fail, "flush")
        }
        fn send_offset_mapping(&mut self, c: &Checkpoint) -> Result<()> {
            assert_eq!(c.id, 7);
            step(&self.log, self.fail, "send_offset_mapping")
        }
        fn verify(&mut self) -> Result<()> {
            step(&self.log, self.fail, "verify")
        }
        fn commit(&mut self, _: Instant) -> Result<()> {
            step(&self.log, self.fail, "commit")
        }
        fn write_held(&mut self, _: Instant) -> Result<()> {
            step(&self.log, self.fail, "write_held")
        }
    }

    impl EpochStore for FakeStore {
        fn write_pending(&self, c: &Checkpoint) -> Result<()> {
            assert_eq!((c.id, c.state), (7, CheckpointState::Pending));
            assert!(
                c.savepoint.is_some(),
                "only a savepoint has a pending write"
            );
            step(&self.log, self.fail, "write_pending")
        }
        fn commit_in_background(&self, c: &Checkpoint) -> Result<()> {
            assert_eq!((c.id, c.state), (7, CheckpointState::Committed));
            step(&self.log, self.fail, "commit_in_background")
        }
        fn put_committed(&self, c: &Checkpoint) -> Result<()> {
            assert_eq!(c.id, 7);
            step(&self.log, self.fail, "put_committed")
        }
    }

    fn checkpoint() -> Checkpoint {
        let mut positions = Positions::new();
        positions.set("in", 0, 42);
        Checkpoint {
            id: 7,
            bridge_id: "b".into(),
            instance: 0,
            instances: 1,
            state: CheckpointState::Committed,
            positions,
            created_ms: 1_000,
            savepoint: None,
            identity: None,
        }
    }

    fn timeout() -> BridgeError {
        BridgeError::CheckpointTimeout {
            id: 7,
            step: "flush",
            timeout: Duration::from_secs(1),
        }
    }

    fn bad_record() -> BridgeError {
        BridgeError::Delivery {
            topic: "in".into(),
            partition: 0,
            offset: 41,
            reason: "too large".into(),
            code: Some(RDKafkaErrorCode::MessageSizeTooLarge),
        }
    }

    /// Runs one completion; returns the calls made, the result, and the progress left behind.
    fn run(
        p: Protocol,
        fail: Option<&'static str>,
        flush_error: fn() -> BridgeError,
    ) -> (Vec<String>, Result<()>, Progress) {
        run_on(p, fail, flush_error, &checkpoint())
    }

    fn run_on(
        p: Protocol,
        fail: Option<&'static str>,
        flush_error: fn() -> BridgeError,
        c: &Checkpoint,
    ) -> (Vec<String>, Result<()>, Progress) {
        let log: Log = Rc::default();
        let mut sink = FakeSink {
            log: log.clone(),
            fail,
            flush_error,
        };
        let store = FakeStore {
            log: log.clone(),
            fail,
        };
        let mut progress = Progress::default();
        let deadline = Instant::now() + Duration::from_secs(5);
        let result = p.complete(&mut sink, &store, c, deadline, &mut progress);
        let calls = log.borrow().clone();
        (calls, result, progress)
    }

    const EXACTLY_ONCE: [&str; 6] = [
        "send_marker",
        "flush",
        "verify",
        "send_offset_mapping",
        "commit",
        "commit_in_background",
    ];

    /// A checkpoint that names a savepoint: its name is durable before the commit, and its
    /// committed write is in line.
    const EXACTLY_ONCE_SAVEPOINT: [&str; 7] = [
        "send_marker",
        "write_pending",
        "flush",
        "verify",
        "send_offset_mapping",
        "commit",
        "put_committed",
    ];

    fn savepoint() -> Checkpoint {
        Checkpoint {
            savepoint: Some("sp".into()),
            ..checkpoint()
        }
    }

    #[test]
    fn exactly_once_commits_after_the_marker_and_the_flush_and_writes_sled_only_after_the_commit() {
        let (calls, result, progress) = run(Protocol::ExactlyOnce, None, timeout);
        result.unwrap();
        assert_eq!(calls, EXACTLY_ONCE);
        assert_eq!(progress.pending, None);
        assert!(!progress.checkpointed_ahead);
        assert!(progress.commit_took.is_some());

        let (calls, result, progress) = run_on(Protocol::ExactlyOnce, None, timeout, &savepoint());
        result.unwrap();
        assert_eq!(calls, EXACTLY_ONCE_SAVEPOINT);
        assert_eq!(progress.pending, None);
    }

    #[test]
    fn exactly_once_stops_at_a_failed_step_and_leaves_a_pending_checkpoint_only_for_a_savepoint_before_the_commit(
    ) {
        for (steps, c) in [
            (&EXACTLY_ONCE[..], checkpoint()),
            (&EXACTLY_ONCE_SAVEPOINT[..], savepoint()),
        ] {
            for (i, failing) in steps.iter().enumerate() {
                let (calls, result, progress) =
                    run_on(Protocol::ExactlyOnce, Some(failing), timeout, &c);
                assert!(result.is_err(), "{failing}");
                assert_eq!(calls, steps[..=i], "{failing}");
                let committed = ["commit_in_background", "put_committed"].contains(failing);
                // A savepoint's pending checkpoint is written and its transaction not known
                // committed: the abort path must discard it. After the commit, recovery adopts or
                // confirms it from the marker.
                let wrote_pending = steps[..i].contains(&"write_pending");
                let pending = (wrote_pending && !committed).then_some(7);
                assert_eq!(progress.pending, pending, "{failing}");
                assert!(!progress.checkpointed_ahead, "{failing}");
                assert_eq!(progress.commit_took.is_some(), committed, "{failing}");
            }
        }
    }

    #[test]
    fn at_least_once_checkpoints_after_the_output_is_flushed() {
        let order = ["flush", "verify", "commit", "put_committed"];
        let (calls, result, progress) = run(Protocol::AtLeastOnce, None, timeout);
        result.unwrap();
        assert_eq!(calls, order);
        assert_eq!(progress, Progress::default());
        for (i, failing) in order.iter().enumerate() {
            let (calls, result, progress) = run(Protocol::AtLeastOnce, Some(failing), timeout);
            assert!(result.is_err(), "{failing}");
            assert_eq!(calls, order[..=i], "{failing}");
            // Nothing checkpointed: the epoch is replayed from the previous checkpoint.
            assert_eq!(progress, Progress::default(), "{failing}");
        }
    }

    #[test]
    fn at_most_once_checkpoints_before_it_writes_and_tolerates_a_lost_flush() {
        let order = ["verify", "put_committed", "write_held", "flush", "commit"];
        let (calls, result, progress) = run(Protocol::AtMostOnce, None, timeout);
        result.unwrap();
        assert_eq!(calls, order);
        assert!(progress.checkpointed_ahead);
        assert_eq!(progress.pending, None);

        // A topic changed, or the checkpoint failed: nothing was written, nothing is checkpointed.
        for (i, failing) in ["verify", "put_committed"].iter().enumerate() {
            let (calls, result, progress) = run(Protocol::AtMostOnce, Some(failing), timeout);
            assert!(result.is_err());
            assert_eq!(calls, order[..=i]);
            assert!(!progress.checkpointed_ahead);
        }

        // Checkpointed, then writing failed: the failure rewinds to the new checkpoint.
        let (calls, result, progress) = run(Protocol::AtMostOnce, Some("write_held"), timeout);
        assert!(result.is_err());
        assert_eq!(calls, order[..=2]);
        assert!(progress.checkpointed_ahead);

        // Records not delivered are lost, as promised, and the epoch still ends.
        let (calls, result, _) = run(Protocol::AtMostOnce, Some("flush"), timeout);
        result.unwrap();
        assert_eq!(calls, order);

        // A bad record stops the bridge as in the other modes.
        let (calls, result, progress) = run(Protocol::AtMostOnce, Some("flush"), bad_record);
        assert!(matches!(result, Err(BridgeError::Delivery { .. })));
        assert_eq!(calls, order[..=3]);
        assert!(progress.checkpointed_ahead);

        let (calls, result, _) = run(Protocol::AtMostOnce, Some("commit"), timeout);
        assert!(result.is_err());
        assert_eq!(calls, order);
    }

    #[test]
    fn a_bad_record_fails_the_flush_of_the_transactional_modes() {
        for p in [Protocol::ExactlyOnce, Protocol::AtLeastOnce] {
            let (calls, result, progress) = run(p, Some("flush"), bad_record);
            assert!(matches!(result, Err(BridgeError::Delivery { .. })), "{p:?}");
            assert_eq!(calls.last().map(String::as_str), Some("flush"), "{p:?}");
            // Nothing of the checkpoint is in the store yet.
            assert_eq!(progress.pending, None, "{p:?}");
        }
        // A savepoint's pending checkpoint is: the abort path discards it.
        let (_, result, progress) = run_on(
            Protocol::ExactlyOnce,
            Some("flush"),
            bad_record,
            &savepoint(),
        );
        assert!(matches!(result, Err(BridgeError::Delivery { .. })));
        assert_eq!(progress.pending, Some(7));
    }

    #[test]
    fn each_mode_says_what_it_does_at_the_barrier_and_at_recovery() {
        let modes = [
            Protocol::ExactlyOnce,
            Protocol::AtLeastOnce,
            Protocol::AtMostOnce,
        ];
        let holds: Vec<bool> = modes.iter().map(|p| p.holds_records()).collect();
        assert_eq!(holds, [false, false, true]);
        let markers: Vec<bool> = modes.iter().map(|p| p.recovers_from_markers()).collect();
        assert_eq!(markers, [true, false, false]);
        let replays: Vec<bool> = modes.iter().map(|p| p.replays_failed_epochs()).collect();
        assert_eq!(replays, [true, true, false]);
        assert_eq!(Protocol::from(Delivery::AtMostOnce), Protocol::AtMostOnce);
        assert!(Protocol::ExactlyOnce
            .stop_outcome(true, 4)
            .contains("checkpoint 5 aborted"));
        assert!(Protocol::AtMostOnce.stop_outcome(false, 4).contains("lost"));
    }
}
