//! `eos-bridge check`: everything start-up would verify, without starting. Each finding is a row
//! with its status and, when it fails, the fix. The checks against the clusters are the
//! functions here that `run` calls at start-up too.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::admin::Admin;
use crate::config::{Config, ConfigErrors, Delivery};
use crate::error::{BridgeError, Result};
use crate::mirror::{self, Severity};
use crate::source::Source;

/// The `[sink.kafka]` settings as librdkafka takes them.
pub(crate) fn sink_kafka(cfg: &Config) -> Vec<(String, String)> {
    cfg.sink.kafka.pairs()
}

/// The admin client of the sink cluster, with the client-wide settings of `[sink.kafka]`.
pub(crate) fn sink_admin(cfg: &Config) -> Result<Admin> {
    Admin::new(&cfg.sink.bootstrap_servers, &sink_kafka(cfg))
        .map(|a| a.with_replication_factor(cfg.sink.replication_factor))
}

/// The timeout rule against the sink brokers (exactly-once): reads their
/// transaction.max.timeout.ms and returns it when the configuration keeps within it. A violation
/// is a configuration error; failing to read it is the admin call's own error.
pub(crate) fn broker_timeout_rule(
    cfg: &Config,
    admin: &Admin,
    runtime: &tokio::runtime::Handle,
) -> Result<i64> {
    let max = runtime.block_on(admin.transaction_max_timeout_ms())?;
    cfg.check_broker_timeout(max)
        .map_err(|e| BridgeError::Config(ConfigErrors(vec![e])))?;
    Ok(max)
}

#[derive(Debug)]
pub struct Finding {
    pub check: String,
    pub ok: bool,
    /// Passing, but worth a look: the detail says what differs and the fix how to align it.
    pub warn: bool,
    pub detail: String,
    pub fix: String,
}

fn pass(check: &str, detail: impl Into<String>) -> Finding {
    Finding {
        check: check.into(),
        ok: true,
        warn: false,
        detail: detail.into(),
        fix: String::new(),
    }
}

fn warn(check: &str, detail: impl Into<String>, fix: impl Into<String>) -> Finding {
    Finding {
        check: check.into(),
        ok: true,
        warn: true,
        detail: detail.into(),
        fix: fix.into(),
    }
}

fn fail(check: &str, detail: impl Into<String>, fix: impl Into<String>) -> Finding {
    Finding {
        check: check.into(),
        ok: false,
        warn: false,
        detail: detail.into(),
        fix: fix.into(),
    }
}

/// Runs every check against the clusters; `runtime` drives the admin calls.
pub fn run(cfg: &Config, runtime: &tokio::runtime::Runtime) -> Vec<Finding> {
    let mut out = vec![pass("configuration", "parsed and validated")];
    if let (Some(cert), Some(key)) = (&cfg.api.tls_cert, &cfg.api.tls_key) {
        out.push(match crate::api::tls_config(cert, key) {
            Ok(_) => pass(
                "api tls",
                format!("certificate {} and its key load", cert.display()),
            ),
            Err(e) => fail("api tls", e.to_string(), "fix [api] tls_cert / tls_key"),
        });
    }

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

    let mut source_topics = BTreeMap::new();
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
            source_topics = topics;
        }
        Err(e) => out.push(fail(
            "source cluster / topics",
            e.to_string(),
            "check source.bootstrap_servers, [source.kafka] security settings and source.topics",
        )),
    }

    let admin = match sink_admin(cfg) {
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
        match broker_timeout_rule(cfg, &admin, runtime.handle()) {
            Ok(max) => out.push(pass(
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
            Err(BridgeError::Config(ConfigErrors(errors))) => {
                for e in errors {
                    out.push(fail("timeout rule", e.message, "see the message"));
                }
            }
            Err(e) => out.push(fail(
                "broker transaction.max.timeout.ms",
                e.to_string(),
                "grant DescribeConfigs on the sink cluster, or check connectivity",
            )),
        }
    }
    out.extend(sink_topics(cfg, runtime, &admin, &source_topics));
    out
}

/// One or more rows per source topic: how its sink topic will be created, or how the existing
/// one differs from it (see `mirror::judge`).
fn sink_topics(
    cfg: &Config,
    runtime: &tokio::runtime::Runtime,
    sink_admin: &Admin,
    topics: &BTreeMap<String, i32>,
) -> Vec<Finding> {
    let mut out = Vec::new();
    if topics.is_empty() {
        return out;
    }
    let kafka = cfg.source.kafka.pairs();
    let source_admin = match Admin::new(&cfg.source.bootstrap_servers, &kafka) {
        Ok(a) => a,
        Err(e) => {
            out.push(fail(
                "source topic configs",
                e.to_string(),
                "check [source.kafka]",
            ));
            return out;
        }
    };
    for (topic, &partitions) in topics {
        let sink_topic = cfg.sink_topic_for(topic);
        let check = format!("sink topic {sink_topic}");
        let described = runtime
            .block_on(source_admin.topic_configs(topic))
            .and_then(|s| Ok((s, sink_admin.partitions(&sink_topic)?)))
            .and_then(|(s, n)| {
                let configs = match n {
                    Some(_) => runtime.block_on(sink_admin.topic_configs(&sink_topic))?,
                    None => None,
                };
                Ok((s.unwrap_or_default(), n, configs))
            });
        let (source, sink_partitions, sink) = match described {
            Ok(d) => d,
            Err(e) => {
                out.push(fail(
                    &check,
                    e.to_string(),
                    "grant the bridge DescribeConfigs on the source and sink topics",
                ));
                continue;
            }
        };
        let Some(n) = sink_partitions else {
            let copied = mirror::copied(&source, &cfg.sink.topic_config_exclude);
            let shown: Vec<String> = copied.iter().map(|(k, v)| format!("{k}={v}")).collect();
            out.push(pass(
                &check,
                format!(
                    "will be created with {partitions} partitions, replication factor {}, configs [{}]",
                    cfg.sink
                        .replication_factor
                        .map_or("broker default".to_string(), |r| r.to_string()),
                    shown.join(", ")
                ),
            ));
            continue;
        };
        let mut fits = true;
        if let Some(note) =
            mirror::partition_note(cfg.sink.partitioning, topic, partitions, &sink_topic, n)
        {
            fits = false;
            out.push(warn(
                &check,
                note,
                "none needed if the bridge may alter the topic; else add the partitions yourself",
            ));
        }
        for b in mirror::judge(topic, &sink_topic, &source, &sink.unwrap_or_default()) {
            fits = false;
            let detail = format!("{}: {}", b.setting, b.problem);
            out.push(match b.severity {
                Severity::Refuse => fail(&check, detail, b.fix),
                Severity::Warn => warn(&check, detail, b.fix),
            });
        }
        if fits {
            out.push(pass(
                &check,
                format!("exists with {n} partitions and fits source topic {topic}"),
            ));
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
            match (f.ok, f.warn) {
                (false, _) => "FAIL",
                (true, true) => "warn",
                (true, false) => "ok",
            },
            f.detail
        ));
        if !f.ok || f.warn {
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
            warn("sink topic t", "retention.ms: shorter", "raise it"),
        ]);
        assert!(
            t.contains("sink topic t   warn  retention.ms: shorter"),
            "{t}"
        );
        assert!(t.contains("fix: raise it"), "{t}");
        assert!(t.contains("configuration  ok"), "{t}");
        assert!(t.contains("timeout rule   FAIL  too long"), "{t}");
        assert!(t.contains("fix: lower it"), "{t}");
    }
}
