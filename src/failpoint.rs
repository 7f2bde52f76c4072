//! Failpoints: a crash at a named step of the checkpoint protocol, compiled only with the
//! `failpoints` feature (tests), so that every step's recovery can be tested deterministically.
//!
//! `EOS_BRIDGE_FAILPOINT=NAME` kills the process with SIGKILL (exactly what kill -9 does: no
//! destructor, no flush) the `EOS_BRIDGE_FAILPOINT_HIT`-th time (default 1) the step is reached.
//! With `EOS_BRIDGE_FAILPOINT_ACTION=panic` it panics there instead, so that tests can read what a
//! panic prints (it must never show a secret).
//!
//! The steps, in protocol order: `after-produce` (pipeline), `after-marker`, `after-precommit`,
//! `after-flush`, `after-commit`, `after-mark-committed` (pipeline/protocol.rs, exactly-once);
//! of a new layout's take-over (docs/design.md, "Rescaling"): `after-intent`, `after-fence`,
//! `after-takeover` (pipeline/recover.rs).

/// A step of the checkpoint protocol: the message names the checkpoint, so that a test can tell
/// which one the restart must resume from.
pub(crate) fn hit_at(step: &'static str, checkpoint: u64) {
    crossed(step, Some(checkpoint));
}

pub(crate) fn hit(step: &'static str) {
    crossed(step, None);
}

#[cfg(feature = "failpoints")]
fn crossed(step: &'static str, checkpoint: Option<u64>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static ARMED: OnceLock<Option<(String, u64)>> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let armed = ARMED.get_or_init(|| {
        let name = std::env::var("EOS_BRIDGE_FAILPOINT").ok()?;
        let nth = std::env::var("EOS_BRIDGE_FAILPOINT_HIT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        Some((name, nth))
    });
    if let Some((name, nth)) = armed {
        if name == step && COUNT.fetch_add(1, Ordering::SeqCst) + 1 == *nth {
            let panic = std::env::var("EOS_BRIDGE_FAILPOINT_ACTION").as_deref() == Ok("panic");
            assert!(!panic, "failpoint '{step}' reached");
            let at = checkpoint.map_or(String::new(), |id| format!(" at checkpoint {id}"));
            eprintln!("eos-bridge: failpoint '{step}' reached{at}: killing this process");
            // SAFETY: sending a signal to our own pid has no memory-safety preconditions.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
fn crossed(_step: &'static str, _checkpoint: Option<u64>) {}
