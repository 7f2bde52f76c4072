//! Waiting out open transactions on one partition. A read_committed reader sees only what lies
//! below the partition's last stable offset (LSO); a transaction that is still open, or whose
//! commit the coordinator has not yet written to the partition, holds the LSO back. The two
//! readers of our own records that must see all of them, recovery's marker read and
//! `offsets translate`'s mapping read, wait here until the LSO reaches the high watermark that
//! the partition had when the wait began.
//!
//! Why that proves the read complete: every record written before the wait began lies below the
//! high watermark H read first. Once no transaction with a record below H is open, the LSO is at
//! least H and a read_committed read up to it sees every committed one of them. Transactions that
//! begin later start at or above H and cannot hold the LSO below it, so the wait ends when the
//! slowest transaction open now commits or is aborted, at the latest when its coordinator times
//! it out.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use tracing::{info, warn};

use crate::error::{BridgeError, Result};

/// How long past a transaction's timeout it may still hold a partition back: the coordinator's
/// sweep for expired transactions (10 s by default) and the time to write their abort markers.
pub(crate) const EXPIRY_MARGIN: Duration = Duration::from_secs(60);

/// A read held back by an open transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HeldBack {
    pub topic: String,
    pub partition: i32,
    pub last_stable_offset: i64,
    pub high_watermark: i64,
    pub waited: Duration,
}

/// What a wait reports on each look: `Some` while held back, `None` once stable.
pub(crate) type Report<'a> = &'a mut dyn FnMut(Option<&HeldBack>);

/// Waits until `topic`/`partition`'s LSO (asked with `committed`, a read_committed client)
/// reaches the high watermark that `uncommitted` (read_uncommitted) sees now. Returns the LSO, or
/// what held it back when `deadline` passed. `what` names the partition's role in the logs.
pub(crate) fn wait_until_stable(
    committed: &BaseConsumer,
    uncommitted: &BaseConsumer,
    topic: &str,
    partition: i32,
    what: &str,
    deadline: Instant,
    report: Report<'_>,
) -> Result<std::result::Result<i64, HeldBack>> {
    let t = Duration::from_secs(10);
    let (_, high) = uncommitted
        .fetch_watermarks(topic, partition, t)
        .map_err(|e| BridgeError::kafka("fetch high watermark", e))?;
    let began = Instant::now();
    let mut last_log: Option<Instant> = None;
    let mut pause = Duration::from_millis(20);
    loop {
        let (_, lso) = committed
            .fetch_watermarks(topic, partition, t)
            .map_err(|e| BridgeError::kafka("fetch last stable offset", e))?;
        if lso >= high {
            if last_log.is_some() {
                info!(
                    topic,
                    partition,
                    waited_ms = began.elapsed().as_millis() as u64,
                    "{what} is stable again; reading it"
                );
            }
            report(None);
            return Ok(Ok(lso));
        }
        let held = HeldBack {
            topic: topic.to_string(),
            partition,
            last_stable_offset: lso,
            high_watermark: high,
            waited: began.elapsed(),
        };
        if Instant::now() >= deadline {
            return Ok(Err(held));
        }
        if last_log.is_none_or(|l| l.elapsed() >= Duration::from_secs(5)) {
            warn!(
                topic,
                partition,
                last_stable_offset = lso,
                high_watermark = high,
                waited_ms = held.waited.as_millis() as u64,
                "an open transaction holds back {what}; waiting for it to finish"
            );
            last_log = Some(Instant::now());
        }
        report(Some(&held));
        std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}
