//! How long a new transaction holds back its first send after the previous one ended, learnt
//! from how soon its first acknowledgement came.
//!
//! Why: after EndTxn returns, the coordinator still writes the transaction's markers to every
//! partition it touched before it takes a new AddPartitionsToTxn for the same transactional id.
//! Until then it answers CONCURRENT_TRANSACTIONS, and librdkafka 2.12.1 retries after a fixed
//! 20 ms (`rd_kafka_txn_handle_AddPartitionsToTxn`), however soon the coordinator finishes. The
//! next transaction's first send went out right after the commit, so nearly every transaction
//! paid that retry: with librdkafka's debug log on, 40 of 50 checkpoints at 1 KB / 100 ms on the
//! 2-core VM, and the sink sent nothing for 25-34 ms (median) after each commit. Holding the first
//! send back 6 ms let nearly every registration through at once and cut the gap to ~10 ms
//! (bench/README.md, "Session 32").
//!
//! The hold is learnt, not configured: the coordinator's time depends on the cluster (replication,
//! where the partitions' leaders are). What is measured is what the hold is for: the time from the
//! commit to the next transaction's first delivery report, hold included. It is not smooth in the
//! hold (a hold just short of the coordinator's time costs the hold *and* the retry), so a search
//! by small steps stops at no hold; instead every hold of a short ladder keeps a running mean,
//! the transactions use the best one, and every `EXPLORE_EVERY`-th tries the ladder's next rung
//! so that the means follow the cluster. A coordinator slower than the ladder makes every rung
//! pay the retry, and the best is then the shortest.

use std::time::Duration;

/// The rungs: 0, 2, ..., 14 ms. Longer would cost about what the retry it spares costs.
const RUNG: Duration = Duration::from_millis(2);
const RUNGS: usize = 8;
/// One transaction in this many tries the next rung instead of the best.
const EXPLORE_EVERY: u64 = 8;
/// Weight of a new measurement in a rung's running mean: a rung is measured every
/// `RUNGS * EXPLORE_EVERY` transactions, and its mean follows over a few of them.
const WEIGHT: f64 = 0.3;

#[derive(Debug, Default)]
pub(crate) struct Settle {
    /// Running mean per rung of commit → first report, in seconds; None until measured.
    means: [Option<f64>; RUNGS],
    /// The rung the open transaction's first send used, until its measurement comes.
    chosen: Option<usize>,
    /// Transactions measured.
    measured: u64,
}

fn rung_hold(rung: usize) -> Duration {
    RUNG * rung as u32
}

impl Settle {
    /// The rung whose mean is lowest (the shortest of equals); the shortest when none is known.
    fn best(&self) -> usize {
        let mut best = 0;
        for (i, m) in self.means.iter().enumerate() {
            if let (Some(m), Some(b)) = (m, self.means[best]) {
                if *m < b {
                    best = i;
                }
            }
        }
        best
    }

    /// Picks the hold of the transaction about to start; its measurement goes to `observe`.
    pub(crate) fn choose(&mut self) -> Duration {
        let rung = match self.means.iter().position(Option::is_none) {
            Some(unmeasured) => unmeasured,
            None if self.measured.is_multiple_of(EXPLORE_EVERY) => {
                (self.measured / EXPLORE_EVERY) as usize % RUNGS
            }
            None => self.best(),
        };
        self.chosen = Some(rung);
        rung_hold(rung)
    }

    /// The transaction that `choose` was asked for is not measured (it started late or aborted).
    pub(crate) fn forget(&mut self) {
        self.chosen = None;
    }

    /// Takes in the time from the previous transaction's end to this one's first delivery
    /// report, with the hold `choose` gave it.
    pub(crate) fn observe(&mut self, commit_to_first_report: Duration) {
        let Some(rung) = self.chosen.take() else {
            return;
        };
        let g = commit_to_first_report.as_secs_f64();
        let m = &mut self.means[rung];
        *m = Some(m.map_or(g, |m| m + WEIGHT * (g - m)));
        self.measured += 1;
    }

    /// The hold the transactions use now (a metric).
    pub(crate) fn hold(&self) -> Duration {
        rung_hold(self.best())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    /// A coordinator that finishes `done` after the commit: a registration sent before that is
    /// refused and retried 20 ms after its answer; one round trip is `rtt`, the first produce
    /// `produce` (varied by `noise`).
    fn first_report(hold: Duration, done: Duration, rtt: Duration, produce: Duration) -> Duration {
        let mut sent = hold;
        while sent + rtt / 2 < done {
            sent += rtt + ms(20.0);
        }
        sent + rtt + produce
    }

    fn run(done: Duration, transactions: u32) -> (Settle, Vec<Duration>) {
        let mut s = Settle::default();
        let mut seen = Vec::new();
        for i in 0..transactions {
            let hold = s.choose();
            let noise = ms(f64::from(i * 7 % 11));
            s.observe(first_report(hold, done, ms(1.0), ms(4.0) + noise));
            seen.push(hold);
        }
        (s, seen)
    }

    #[test]
    fn measures_every_rung_once_before_it_picks() {
        let mut s = Settle::default();
        let mut holds = Vec::new();
        for _ in 0..RUNGS {
            holds.push(s.choose());
            s.observe(ms(10.0));
        }
        assert_eq!(holds, (0..RUNGS).map(rung_hold).collect::<Vec<_>>());
    }

    #[test]
    fn learns_to_wait_out_a_coordinator_that_needs_a_few_ms() {
        let (s, seen) = run(ms(5.0), 400);
        assert!(
            s.hold() >= ms(5.0) && s.hold() <= ms(10.0),
            "hold {:?}",
            s.hold()
        );
        // The exploring transactions aside, the late ones wait the coordinator out.
        let late = &seen[300..];
        let waited = late.iter().filter(|h| **h >= ms(5.0)).count();
        assert!(waited * 4 >= late.len() * 3, "{waited} of {}", late.len());
    }

    #[test]
    fn holds_nothing_when_the_coordinator_is_done_at_once() {
        let (s, _) = run(Duration::ZERO, 400);
        assert_eq!(s.hold(), Duration::ZERO);
    }

    /// Slower than any rung: every start pays the retry, so holding only adds.
    #[test]
    fn holds_nothing_when_the_coordinator_is_slower_than_any_hold() {
        let (s, _) = run(ms(19.0), 400);
        assert_eq!(s.hold(), Duration::ZERO);
    }

    #[test]
    fn follows_a_coordinator_that_becomes_slower() {
        let mut s = Settle::default();
        for i in 0..400u32 {
            let done = if i < 200 { ms(3.0) } else { ms(9.0) };
            let hold = s.choose();
            s.observe(first_report(hold, done, ms(1.0), ms(4.0)));
        }
        assert!(s.hold() >= ms(9.0) - ms(0.5), "hold {:?}", s.hold());
    }

    #[test]
    fn a_forgotten_start_is_not_measured() {
        let mut s = Settle::default();
        s.choose();
        s.forget();
        s.observe(ms(50.0));
        assert_eq!(s.means, [None; RUNGS]);
        assert_eq!(s.measured, 0);
    }
}
