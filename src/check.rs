//! `eos-bridge check`: everything start-up would verify, without starting. Each finding is a row
//! with its status and, when it fails, the fix.

use std::time::Duration;

use crate::admin::Admin;
use crate::config::{Config, Delivery};
use crate::source::Source;

#[derive(Debug)]
pub struct Finding {
    pub check: String,
    pub ok: bool,
    pub detail: String,
    pub fix: String,
}

fn pass(check: &str, detail: impl Into<String>) -> Finding {
    Finding {
        check: check.into(),
        ok: true,
        detail: detail.into(),
        fix: String::new(),
    }
}

fn fail(check: &str, detail: impl Into<String>, fix: impl Into<String>) -> Finding {
    Finding {
        check: check.into(),
        ok: false,
        detail: detail.into(),
        fix: fix.into(),
    }
}

/// Runs every check against the clusters; `runtime` drives the admin calls.
pub fn run(cfg: &Config, runtime: &tokio::runtime::Runtime) -> Vec<Finding> {
    let mut out = vec![pass("configuration", "parsed and validated")];

    // Credentials, certificates and addresses first: the checks below would only time out.
    let problems = crate::connectivity::probe_config(cfg);
    if !problems.is_empty() {
        for p in problems {
            out.push(fail(
                &format!("{} connection", p.cluster.name()),
                p.summary(),
                p.fix(),
            ));
        }
        return out;
    }
    // Every ACL the configuration needs (src/acl.rs), once both clusters let the bridge in.
    out.extend(crate::acl::findings(cfg, runtime.handle()));

    match Source::new(cfg).and_then(|s| s.discover()) {
        Ok(topics) if topics.is_empty() => out.push(fail(
            "source topics",
            "no topic matches source.topic_pattern yet",
            "create a matching topic, or fix source.topic_pattern",
        )),
        Ok(topics) => {
            let list: Vec<String> = topics
                .iter()
                .map(|(t, n)| format!("{t} ({n} partitions)"))
                .collect();
            out.push(pass(
                "source cluster",
                format!("reachable at {}", cfg.source.bootstrap_servers),
            ));
            out.push(pass("source topics", list.join(", ")));
        }
        Err(e) => out.push(fail(
            "source cluster / topics",
            e.to_string(),
            "check source.bootstrap_servers, [source.kafka] security settings and source.topics",
        )),
    }

    let kafka: Vec<(String, String)> = cfg
        .sink
        .kafka
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let admin = match Admin::new(&cfg.sink.bootstrap_servers, &kafka) {
        Ok(a) => a,
        Err(e) => {
            out.push(fail(
                "sink cluster",
                e.to_string(),
                "check sink.bootstrap_servers and [sink.kafka]",
            ));
            return out;
        }
    };
    match admin.partitions(&cfg.sink.marker_topic) {
        Ok(found) => {
            out.push(pass(
                "sink cluster",
                format!("reachable at {}", cfg.sink.bootstrap_servers),
            ));
            if cfg.bridge.delivery == Delivery::ExactlyOnce {
                out.push(match found {
                    Some(n) => pass(
                        "marker topic",
                        format!("{} exists with {n} partitions", cfg.sink.marker_topic),
                    ),
                    None => pass(
                        "marker topic",
                        format!(
                            "{} will be created (compacted) at start-up",
                            cfg.sink.marker_topic
                        ),
                    ),
                });
            }
        }
        Err(e) => {
            out.push(fail(
                "sink cluster",
                e.to_string(),
                "check sink.bootstrap_servers and [sink.kafka] security settings",
            ));
            return out;
        }
    }

    if cfg.bridge.delivery == Delivery::ExactlyOnce {
        match runtime.block_on(admin.transaction_max_timeout_ms()) {
            Ok(max) => match cfg.check_broker_timeout(max) {
                Ok(()) => out.push(pass(
                    "timeout rule",
                    format!(
                        "checkpoint.interval {:?} + checkpoint.timeout {:?} < transaction.timeout {:?} <= broker \
                         transaction.max.timeout.ms {}",
                        cfg.checkpoint.interval,
                        cfg.checkpoint.timeout,
                        cfg.transaction.timeout,
                        Duration::from_millis(max as u64).as_millis()
                    ),
                )),
                Err(e) => out.push(fail("timeout rule", e.message.clone(), "see the message")),
            },
            Err(e) => out.push(fail(
                "broker transaction.max.timeout.ms",
                e.to_string(),
                "grant DescribeConfigs on the sink cluster, or check connectivity",
            )),
        }
    }
    out
}

/// The findings as a table a person reads top to bottom.
pub fn render(findings: &[Finding]) -> String {
    let width = findings
        .iter()
        .map(|f| f.check.len())
        .max()
        .unwrap_or(5)
        .max(5);
    let mut s = format!("{:<width$}  {:<4}  detail\n", "check", "ok");
    for f in findings {
        s.push_str(&format!(
            "{:<width$}  {:<4}  {}\n",
            f.check,
            if f.ok { "ok" } else { "FAIL" },
            f.detail
        ));
        if !f.ok {
            s.push_str(&format!("{:<width$}        fix: {}\n", "", f.fix));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_show_their_fix() {
        let t = render(&[
            pass("configuration", "fine"),
            fail("timeout rule", "too long", "lower it"),
        ]);
        assert!(t.contains("configuration  ok"), "{t}");
        assert!(t.contains("timeout rule   FAIL  too long"), "{t}");
        assert!(t.contains("fix: lower it"), "{t}");
    }
}
