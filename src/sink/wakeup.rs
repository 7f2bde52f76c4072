//! Owns how a thread that waits for delivery reports is woken: when the reports reach the byte
//! count it named, not at every report.
//!
//! Reports arrive one record at a time on librdkafka's thread. Waking the waiter at each one made
//! the read loop wake, find the limit still reached, and sleep again: at 1 KB that was ~7,500
//! context switches per million records where the floor (one transaction per interval, no limit)
//! had ~2,500, and the delivery thread paid a futex call per report while anyone waited
//! (bench/README.md, sessions 26-28). A waiter now names the reported-byte count it needs, and
//! only the report that reaches it (or one that carries a failure) pays for a wake-up.

#[cfg(test)]
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{self, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// No one waits: no count of reported bytes reaches it.
const NOBODY: u64 = u64::MAX;

pub(super) struct Wakeup {
    /// The smallest reported-byte count a waiter named, or `NOBODY`. Read by every report, so it
    /// is the only thing a report looks at when no one waits.
    at: AtomicU64,
    /// Threads waiting. Changed only under this lock, which also orders a wake-up after the
    /// waiter's last check, so that none is lost.
    waiters: Mutex<usize>,
    woken: Condvar,
    /// Notifies sent, ever: what the tests count.
    #[cfg(test)]
    notified: AtomicUsize,
}

impl Default for Wakeup {
    fn default() -> Self {
        Wakeup {
            at: AtomicU64::new(NOBODY),
            waiters: Mutex::new(0),
            woken: Condvar::new(),
            #[cfg(test)]
            notified: Default::default(),
        }
    }
}

impl Wakeup {
    /// Called by a report after it added its bytes, `reported` being the count it made (by a
    /// sequentially consistent add). A failure wakes any waiter: the transaction is lost then, and
    /// every wait ends on it.
    ///
    /// Why no wake-up is lost: the waiter stores its count into `at` and then, after a
    /// sequentially consistent fence, reads the reported bytes; the report adds to them and then
    /// reads `at`, both sequentially consistent. So either the report sees the waiter's count (and
    /// takes the lock, which the waiter holds until it sleeps, before it notifies), or the
    /// waiter's check sees the report. Swapping `at` back to `NOBODY` lets one report, not every
    /// report until the waiter has run, pay for the notify; `notify_all` wakes every waiter whose
    /// count the swap cleared, and each names its count again.
    pub(super) fn reported(&self, reported: u64, failed: bool) {
        let at = self.at.load(Ordering::SeqCst);
        if at == NOBODY || (reported < at && !failed) {
            return;
        }
        if self.at.swap(NOBODY, Ordering::SeqCst) != NOBODY {
            drop(self.waiters.lock().unwrap_or_else(|p| p.into_inner()));
            self.woken.notify_all();
            #[cfg(test)]
            self.notified.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Waits until the reported bytes reach `at`, a failure is reported, `done` holds, or `at_most`
    /// passes, whichever comes first; the caller re-checks its own condition. `done` must hold once
    /// the reported bytes reach `at` (read them first in it, then any failure flag), or a wake-up
    /// that raced with the check is only caught by `at_most`.
    pub(super) fn wait(&self, at: u64, at_most: Duration, done: impl Fn() -> bool) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        *waiters += 1;
        self.at.fetch_min(at, Ordering::SeqCst);
        atomic::fence(Ordering::SeqCst);
        if !done() {
            waiters = match self.woken.wait_timeout(waiters, at_most) {
                Ok((guard, _)) => guard,
                Err(p) => p.into_inner().0,
            };
        }
        *waiters -= 1;
        // The last waiter out clears its count; with others still waiting, a stale smaller count
        // only wakes them early, and they check again.
        if *waiters == 0 {
            self.at.store(NOBODY, Ordering::SeqCst);
        }
    }

    #[cfg(test)]
    fn armed(&self) -> bool {
        self.at.load(Ordering::SeqCst) != NOBODY
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;

    /// A shared count of reported bytes, as the sink keeps it, with the wake-up beside it.
    #[derive(Default)]
    struct Reports {
        bytes: AtomicU64,
        failed: AtomicBool,
        wakeup: Wakeup,
    }

    impl Reports {
        fn report(&self, bytes: u64, failed: bool) {
            if failed {
                self.failed.store(true, Ordering::SeqCst);
            }
            let now = self.bytes.fetch_add(bytes, Ordering::SeqCst) + bytes;
            self.wakeup.reported(now, failed);
        }

        fn reached(&self, at: u64) -> bool {
            self.bytes.load(Ordering::SeqCst) >= at || self.failed.load(Ordering::SeqCst)
        }
    }

    fn notified(r: &Reports) -> usize {
        r.wakeup.notified.load(Ordering::SeqCst)
    }

    /// Reports `steps` times `bytes` once a waiter has named its count.
    fn report_when_armed(r: &Reports, steps: usize, bytes: u64, failed: bool) {
        let began = Instant::now();
        while !r.wakeup.armed() {
            assert!(began.elapsed() < Duration::from_secs(10), "no waiter armed");
            std::thread::yield_now();
        }
        for _ in 0..steps {
            r.report(bytes, failed);
        }
    }

    /// Waits for count `at`, in waits of at most `at_most`, again until `until` holds (10 s at most).
    fn wait_until(r: &Reports, at: u64, at_most: Duration, until: impl Fn() -> bool) {
        let began = Instant::now();
        while !until() {
            assert!(
                began.elapsed() < Duration::from_secs(10),
                "not done within 10 s"
            );
            r.wakeup.wait(at, at_most, || r.reached(at));
        }
    }

    #[test]
    fn only_the_report_that_reaches_the_count_wakes_the_waiter() {
        let r = Reports::default();
        std::thread::scope(|s| {
            s.spawn(|| report_when_armed(&r, 10, 100, false));
            wait_until(&r, 1000, Duration::from_secs(10), || r.reached(1000));
        });
        assert_eq!(notified(&r), 1, "ten reports, one wake-up");
        assert!(!r.wakeup.armed(), "the last waiter out clears its count");
        // With no one waiting, a report wakes no one.
        r.report(100, false);
        assert_eq!(notified(&r), 1);
    }

    #[test]
    fn a_report_below_the_count_wakes_no_one() {
        let r = Reports::default();
        std::thread::scope(|s| {
            s.spawn(|| report_when_armed(&r, 1, 10, false));
            // Waits again until the report was made, however late the reporter runs.
            wait_until(&r, 1000, Duration::from_millis(50), || {
                r.bytes.load(Ordering::SeqCst) >= 10
            });
        });
        assert_eq!(r.bytes.load(Ordering::SeqCst), 10, "the report was made");
        assert_eq!(notified(&r), 0);
    }

    #[test]
    fn a_failure_wakes_a_waiter_whatever_its_count() {
        let r = Reports::default();
        std::thread::scope(|s| {
            s.spawn(|| report_when_armed(&r, 1, 1, true));
            wait_until(&r, u64::MAX - 1, Duration::from_secs(10), || {
                r.reached(u64::MAX - 1)
            });
        });
        assert_eq!(notified(&r), 1);
    }

    #[test]
    fn a_count_already_reached_does_not_sleep() {
        let r = Reports::default();
        r.report(500, false);
        let began = Instant::now();
        r.wakeup
            .wait(500, Duration::from_secs(10), || r.reached(500));
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "slept though the count was reached"
        );
        assert!(!r.wakeup.armed());
        assert_eq!(notified(&r), 0);
    }

    /// A waiter and a reporter racing, round after round: each report lands while the waiter is
    /// naming its count, checking, or asleep. A lost wake-up leaves the waiter asleep for its whole
    /// time-out though its count was reached.
    #[test]
    fn no_wake_up_is_lost_when_reports_race_with_the_check() {
        let r = Reports::default();
        let round_now = AtomicU64::new(0);
        let stop = AtomicBool::new(false);
        let rounds = 2_000u64;
        let at_most = Duration::from_secs(2);
        let mut lost = None;
        std::thread::scope(|s| {
            s.spawn(|| {
                for round in 1..=rounds {
                    while round_now.load(Ordering::SeqCst) < round {
                        if stop.load(Ordering::SeqCst) {
                            return;
                        }
                        std::thread::yield_now();
                    }
                    r.report(64, false);
                }
            });
            'rounds: for round in 1..=rounds {
                round_now.store(round, Ordering::SeqCst);
                let at = round * 64;
                while !r.reached(at) {
                    let began = Instant::now();
                    r.wakeup.wait(at, at_most, || r.reached(at));
                    if began.elapsed() >= at_most && r.reached(at) {
                        lost = Some(round);
                        break 'rounds;
                    }
                }
            }
            stop.store(true, Ordering::SeqCst);
        });
        assert_eq!(lost, None, "the wake-up of this round was lost");
        assert_eq!(r.bytes.load(Ordering::SeqCst), rounds * 64);
    }
}
