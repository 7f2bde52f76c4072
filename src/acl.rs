//! Least privilege: the permissions the bridge needs on each cluster, and a probe that finds the
//! missing ones before anything starts, so that `eos-bridge check` and `eos-bridge run` stop within
//! seconds naming each missing ACL and the kafka-acls command that grants it, instead of failing
//! deep inside a transaction (or, for a source topic the bridge may not read, silently making no
//! progress: librdkafka reports such fetch errors only as consumer errors).
//!
//! Nothing the probe does is visible to consumers or disturbs a running bridge:
//! - topics: DescribeTopics with the principal's authorized operations (KIP-430), which the broker
//!   computes from the ACLs, so Read/Write/Alter/DescribeConfigs are known without using them;
//! - topics the bridge would create: CreateTopics with validate_only;
//! - the sink broker's configuration: the DescribeConfigs the timeout check needs anyway;
//! - transactional ids: init_transactions under `eos-bridge-<id>-probe`, an id inside the bridge's
//!   prefix that no instance ever uses (instance ids end in `-<number>`), so a `check` next to a
//!   running bridge fences no one; it opens no transaction and writes nothing.
//!
//! docs/security.md holds the same list as a table; keep the two in step.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::fmt;
use std::time::Duration;

use rdkafka::admin::{AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::bindings as rd;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, Producer};
use thiserror::Error;
use tokio::runtime::Handle;

use crate::admin::{self, Admin, Request, TopicDescription};
use crate::config::{Config, Delivery, OnBadRecord, Partitioning};
use crate::error::{is_auth, BridgeError, Result};
use crate::sink::is_client_wide;
use crate::source::Source;

const TIMEOUT: Duration = Duration::from_secs(10);

/// Which of the bridge's clusters a permission is needed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    Source,
    Sink,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Sink => "sink",
        })
    }
}

/// Kafka ACL operations the bridge uses, spelled as kafka-acls.sh takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Operation {
    Read,
    Write,
    Create,
    Alter,
    Describe,
    DescribeConfigs,
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Operation::Read => "Read",
            Operation::Write => "Write",
            Operation::Create => "Create",
            Operation::Alter => "Alter",
            Operation::Describe => "Describe",
            Operation::DescribeConfigs => "DescribeConfigs",
        })
    }
}

impl Operation {
    fn acl_operation(self) -> rd::rd_kafka_AclOperation_t {
        use rd::rd_kafka_AclOperation_t as Op;
        match self {
            Operation::Read => Op::RD_KAFKA_ACL_OPERATION_READ,
            Operation::Write => Op::RD_KAFKA_ACL_OPERATION_WRITE,
            Operation::Create => Op::RD_KAFKA_ACL_OPERATION_CREATE,
            Operation::Alter => Op::RD_KAFKA_ACL_OPERATION_ALTER,
            Operation::Describe => Op::RD_KAFKA_ACL_OPERATION_DESCRIBE,
            Operation::DescribeConfigs => Op::RD_KAFKA_ACL_OPERATION_DESCRIBE_CONFIGS,
        }
    }
}

/// What an ACL is on.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Resource {
    Topic(String),
    Group(String),
    /// Every transactional id starting with this prefix.
    TransactionalIdPrefix(String),
    Cluster,
}

/// One ACL the bridge needs: its operation, resource and cluster, and why.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Permission {
    pub side: Side,
    pub operation: Operation,
    pub resource: Resource,
    pub why: &'static str,
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.resource {
            Resource::Topic(t) => write!(f, "{} on topic '{t}'", self.operation)?,
            Resource::Group(g) => write!(f, "{} on group '{g}'", self.operation)?,
            Resource::TransactionalIdPrefix(p) => write!(
                f,
                "{} on transactional ids with prefix '{p}'",
                self.operation
            )?,
            Resource::Cluster => write!(f, "{} on the cluster", self.operation)?,
        }
        write!(f, " ({} cluster)", self.side)
    }
}

impl Permission {
    /// The kafka-acls.sh command that grants this permission to `principal` (add
    /// `--command-config` with an admin's client settings on a secured cluster).
    pub fn grant_command(&self, bootstrap: &str, principal: &str) -> String {
        let resource = match &self.resource {
            Resource::Topic(t) => format!("--topic {}", shell_word(t)),
            Resource::Group(g) => format!("--group {}", shell_word(g)),
            Resource::TransactionalIdPrefix(p) => format!(
                "--transactional-id {} --resource-pattern-type prefixed",
                shell_word(p)
            ),
            Resource::Cluster => "--cluster".to_string(),
        };
        format!(
            "kafka-acls.sh --bootstrap-server {} --add --allow-principal {} --operation {} {resource}",
            shell_word(bootstrap),
            shell_word(principal),
            self.operation
        )
    }
}

/// Names the bridge derives (topics, ids) hold letters, digits and `._-{}`; anything else is
/// quoted so that the command can be pasted into a shell.
fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-:,/=@+".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// A permission the probe found missing, with what the broker answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    pub permission: Permission,
    /// The cluster's bootstrap servers and the principal, for the command.
    pub bootstrap: String,
    pub principal: String,
    /// How the denial showed: the broker's error, or the operation absent from the authorized ones.
    pub evidence: String,
}

impl Denial {
    pub fn command(&self) -> String {
        self.permission
            .grant_command(&self.bootstrap, &self.principal)
    }
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "missing permission: {}, needed because {} ({}); grant it with: {}",
            self.permission,
            self.permission.why,
            self.evidence,
            self.command()
        )
    }
}

/// Every permission the probe found missing: the bridge cannot run until they are granted.
#[derive(Debug, Error)]
pub struct MissingPermissions(pub Vec<Denial>);

impl fmt::Display for MissingPermissions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "not authorized: the bridge's principal lacks {} permission(s) it needs (docs/security.md lists \
             every ACL; add --command-config with an admin's client settings to the commands on a secured \
             cluster):",
            self.0.len()
        )?;
        for d in &self.0 {
            write!(f, "\n  - {d}")?;
        }
        Ok(())
    }
}

/// What the probe found: permissions missing, permissions whose absence only costs something
/// (a warning), and what it could not judge yet.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    pub denied: Vec<Denial>,
    pub optional: Vec<Denial>,
    pub notes: Vec<String>,
}

/// The principal the broker sees, as far as the client settings tell: `User:<sasl.username>`
/// for PLAIN and SCRAM; otherwise (mutual TLS, OAUTHBEARER) a placeholder to fill in.
pub(crate) fn principal(kafka: &[(String, String)]) -> String {
    kafka
        .iter()
        .find(|(k, _)| k == "sasl.username")
        .map(|(_, v)| format!("User:{v}"))
        .unwrap_or_else(|| "User:<principal>".to_string())
}

/// The prefix of every transactional id of the bridge, in every layout
/// (`eos-bridge-<id>-<instance>` and `eos-bridge-<id>-g<G>n<N>-<instance>`).
pub(crate) fn transactional_id_prefix(bridge_id: &str) -> String {
    format!("eos-bridge-{bridge_id}-")
}

/// The group id of the source consumer. The bridge assigns partitions itself and commits no
/// offsets, but librdkafka's `assign` needs a group, and a consumer with a group looks up its
/// coordinator, which takes Describe on the group.
pub(crate) fn source_group(bridge_id: &str) -> String {
    format!("eos-bridge.{bridge_id}")
}

/// The group id of the commit-marker reader on the sink cluster (see `source_group`).
pub(crate) fn marker_reader_group(bridge_id: &str) -> String {
    format!("eos-bridge.{bridge_id}.marker-reader")
}

/// The transactional id the probe initialises: inside the prefix, never an instance's.
pub(crate) fn probe_transactional_id(bridge_id: &str) -> String {
    format!("{}probe", transactional_id_prefix(bridge_id))
}

/// One cluster the probe talks to.
struct Cluster<'a> {
    side: Side,
    bootstrap: &'a str,
    kafka: Vec<(String, String)>,
    principal: String,
    admin: Admin,
}

impl<'a> Cluster<'a> {
    fn new(
        side: Side,
        bootstrap: &'a str,
        kafka: &crate::config::KafkaProps,
    ) -> Result<Cluster<'a>> {
        let kafka = kafka.pairs();
        Ok(Cluster {
            side,
            bootstrap,
            principal: principal(&kafka),
            admin: Admin::new(bootstrap, &kafka)?,
            kafka,
        })
    }

    fn deny(
        &self,
        operation: Operation,
        resource: Resource,
        why: &'static str,
        evidence: String,
    ) -> Denial {
        Denial {
            permission: Permission {
                side: self.side,
                operation,
                resource,
                why,
            },
            bootstrap: self.bootstrap.to_string(),
            principal: self.principal.clone(),
            evidence,
        }
    }
}

/// What DescribeTopics said about one topic.
#[derive(Debug)]
enum TopicAccess {
    Missing,
    Denied(RDKafkaErrorCode),
    Found {
        partitions: i32,
        allowed: BTreeSet<u32>,
    },
}

fn topic_access(
    described: std::result::Result<TopicDescription, RDKafkaErrorCode>,
) -> Result<TopicAccess> {
    Ok(match described {
        Ok(d) => TopicAccess::Found {
            partitions: d.partitions,
            allowed: d.allowed,
        },
        Err(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopicId) => {
            TopicAccess::Missing
        }
        Err(c) if is_auth(c) => TopicAccess::Denied(c),
        Err(other) => return Err(admin::describe_error(other)),
    })
}

/// A topic the bridge uses, and the operations it needs there.
struct Need {
    topic: String,
    /// Needed whenever the topic exists, with why.
    ops: Vec<(Operation, &'static str)>,
    /// Why Create is needed when the topic is missing (None: the bridge never creates it).
    create: Option<&'static str>,
    /// Partitions the topic must have; fewer needs Alter (the bridge adds them).
    min_partitions: Option<(i32, &'static str)>,
    /// Why DescribeConfigs helps; its absence is a warning.
    describe_configs: Option<&'static str>,
}

const WHY_SOURCE: &str = "the bridge reads the source topic (Read implies the Describe it needs for metadata and offsets)";
const WHY_SINK: &str = "the bridge writes the sink topic in its transactions";
const WHY_SINK_CREATE: &str = "the sink topic does not exist and the bridge creates it";
const WHY_SINK_ALTER: &str = "sink.partitioning = \"preserve\" and the sink topic has fewer partitions than its source: the bridge adds them";
const WHY_SINK_CONFIGS: &str = "the bridge reads max.message.bytes to keep its batches below it (without it: a warning, and the configured batch.size)";
const WHY_MARKER_READ: &str = "recovery reads the commit markers back";
const WHY_MARKER_WRITE: &str = "every checkpoint's transaction writes a commit marker";
const WHY_MARKER_CREATE: &str = "the marker topic does not exist and the bridge creates it";
const WHY_MARKER_ALTER: &str =
    "the marker topic has fewer partitions than bridge.instances: the bridge adds them";
const WHY_OFFSETS_WRITE: &str =
    "every checkpoint's transaction writes its offset mapping (offsets translate reads it)";
const WHY_OFFSETS_CREATE: &str =
    "the offset-mapping topic (offsets.topic) does not exist and the bridge creates it";
const WHY_DLQ_WRITE: &str =
    "on_bad_record = \"dead-letter\" writes refused records to the dead-letter topic";
const WHY_DLQ_CREATE: &str = "on_bad_record = \"dead-letter\" creates the missing dead-letter topic on the first refused record";
const WHY_TXN: &str = "the bridge's transactional producers (and the take-over fencing of older layouts) use these ids; Write implies Describe";
const WHY_GROUP: &str = "librdkafka's consumers look up their group's coordinator (assign needs a group; no offsets are committed)";
const WHY_MONITOR_GROUP: &str = "the bridge commits its source positions to this group (at most once a second), for lag tools (offsets.monitor_group; Read implies the Describe its consumer's coordinator lookup needs)";
const WHY_CLUSTER_CONFIGS: &str = "the timeout check reads the broker's transaction.max.timeout.ms";

/// Probes every permission the configuration needs. An error means a cluster could not be asked
/// (unreachable, wrong credentials), not that a permission is missing.
pub(crate) fn probe(cfg: &Config, runtime: &Handle) -> Result<Probe> {
    let mut out = Probe::default();
    let exactly_once = cfg.bridge.delivery == Delivery::ExactlyOnce;

    let source = Cluster::new(
        Side::Source,
        &cfg.source.bootstrap_servers,
        &cfg.source.kafka,
    )?;
    // A pattern can only match topics the principal may describe: the broker leaves the others out
    // of a listing, so the probe judges those it sees.
    let source_topics: Vec<String> = match &cfg.source.topic_pattern {
        None => cfg.source.topics.clone(),
        Some(_) => {
            let found: Vec<String> = Source::new(cfg)?.discover()?.into_keys().collect();
            if found.is_empty() {
                out.notes.push(format!(
                    "no source topic that the principal may describe matches source.topic_pattern; grant Read on \
                     the topics (a prefixed ACL covers a pattern's future topics): {}",
                    Permission {
                        side: Side::Source,
                        operation: Operation::Read,
                        resource: Resource::Topic("<topic>".into()),
                        why: WHY_SOURCE,
                    }
                    .grant_command(source.bootstrap, &source.principal)
                ));
            }
            found
        }
    };
    let needs: Vec<Need> = source_topics
        .iter()
        .map(|t| Need {
            topic: t.clone(),
            ops: vec![(Operation::Read, WHY_SOURCE)],
            create: None,
            min_partitions: None,
            describe_configs: None,
        })
        .collect();
    let found = check_topics(&source, runtime, &needs, &mut out)?;
    // The monitoring commit (offsets.monitor_group, by default this very group) needs Read; a
    // refused describe is then best fixed by granting Read, which implies Describe.
    let group = source_group(&cfg.bridge.id);
    let (op, why) = match cfg.offsets.monitor_group == group {
        true => (Operation::Read, WHY_MONITOR_GROUP),
        false => (Operation::Describe, WHY_GROUP),
    };
    check_group(&source, &group, op, why, &mut out)?;

    let sink = Cluster::new(Side::Sink, &cfg.sink.bootstrap_servers, &cfg.sink.kafka)?;
    if exactly_once {
        check_cluster_configs(&sink, runtime, &mut out)?;
    }
    let mut needs: BTreeMap<String, Need> = BTreeMap::new();
    for t in &source_topics {
        let sink_topic = cfg.sink_topic_for(t);
        let source_partitions = found.get(t).copied();
        let preserve = cfg.sink.partitioning == Partitioning::Preserve;
        let need = needs.entry(sink_topic.clone()).or_insert_with(|| Need {
            topic: sink_topic,
            ops: vec![(Operation::Write, WHY_SINK)],
            create: Some(WHY_SINK_CREATE),
            min_partitions: None,
            describe_configs: Some(WHY_SINK_CONFIGS),
        });
        if let (true, Some(n)) = (preserve, source_partitions) {
            let want = need.min_partitions.map_or(n, |(m, _)| m.max(n));
            need.min_partitions = Some((want, WHY_SINK_ALTER));
        }
        if cfg.sink.on_bad_record == OnBadRecord::DeadLetter {
            let dlq = cfg.dead_letter_topic_for(t);
            needs.entry(dlq.clone()).or_insert_with(|| Need {
                topic: dlq,
                ops: vec![(Operation::Write, WHY_DLQ_WRITE)],
                create: Some(WHY_DLQ_CREATE),
                min_partitions: None,
                describe_configs: Some(WHY_SINK_CONFIGS),
            });
        }
    }
    if exactly_once {
        let marker = cfg.sink.marker_topic.clone();
        needs.insert(
            marker.clone(),
            Need {
                topic: marker,
                ops: vec![
                    (Operation::Read, WHY_MARKER_READ),
                    (Operation::Write, WHY_MARKER_WRITE),
                ],
                create: Some(WHY_MARKER_CREATE),
                min_partitions: Some((cfg.bridge.instances.max(1) as i32, WHY_MARKER_ALTER)),
                describe_configs: None,
            },
        );
    }
    if crate::offsets::kept(cfg) {
        let topic = cfg.offsets.topic.clone();
        needs.insert(
            topic.clone(),
            Need {
                topic,
                ops: vec![(Operation::Write, WHY_OFFSETS_WRITE)],
                create: Some(WHY_OFFSETS_CREATE),
                min_partitions: None,
                describe_configs: None,
            },
        );
    }
    let needs: Vec<Need> = needs.into_values().collect();
    check_topics(&sink, runtime, &needs, &mut out)?;
    if exactly_once {
        let group = marker_reader_group(&cfg.bridge.id);
        check_group(&sink, &group, Operation::Describe, WHY_GROUP, &mut out)?;
        check_transactional_ids(&sink, cfg, &mut out)?;
    }
    Ok(out)
}

/// Probes, and turns missing permissions into the error that stops the bridge. Returns the
/// optional permissions that are missing, for the caller to warn about.
pub(crate) fn require(cfg: &Config, runtime: &Handle) -> Result<Vec<Denial>> {
    let p = probe(cfg, runtime)?;
    if p.denied.is_empty() {
        Ok(p.optional)
    } else {
        Err(BridgeError::MissingPermissions(MissingPermissions(
            p.denied,
        )))
    }
}

/// Describes the topics of `needs` with the authorized operations, and records what is missing.
/// Returns the partition counts of the topics found.
fn check_topics(
    cluster: &Cluster<'_>,
    runtime: &Handle,
    needs: &[Need],
    out: &mut Probe,
) -> Result<BTreeMap<String, i32>> {
    let names: BTreeSet<&str> = needs.iter().map(|n| n.topic.as_str()).collect();
    let described = admin::describe_topics(cluster.admin.inner().inner(), &names, TIMEOUT, true)?
        .into_iter()
        .map(|(name, d)| Ok((name, topic_access(d)?)))
        .collect::<Result<BTreeMap<_, _>>>()?;
    let mut partitions = BTreeMap::new();
    for need in needs {
        let topic = || Resource::Topic(need.topic.clone());
        match described.get(&need.topic).unwrap_or(&TopicAccess::Missing) {
            TopicAccess::Denied(code) => {
                // Without Describe nothing else about the topic is known, not even whether it
                // exists: every operation needed on it is reported (each implies Describe).
                for (op, why) in &need.ops {
                    out.denied
                        .push(cluster.deny(*op, topic(), why, format!("metadata: {code:?}")));
                }
            }
            TopicAccess::Missing => {
                let Some(why) = need.create else {
                    // A missing source topic is reported by the topic checks, with its own fix.
                    continue;
                };
                if let Some(code) =
                    runtime.block_on(validate_create(&cluster.admin, &need.topic))?
                {
                    out.denied.push(cluster.deny(
                        Operation::Create,
                        topic(),
                        why,
                        format!("CreateTopics (validate only): {code:?}"),
                    ));
                }
                out.notes.push(format!(
                    "topic '{}' does not exist on the {} cluster yet: the permissions needed on it once it exists \
                     ({}) are judged when it does",
                    need.topic,
                    cluster.side,
                    need.ops
                        .iter()
                        .map(|(op, _)| op.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            TopicAccess::Found {
                partitions: n,
                allowed,
            } => {
                partitions.insert(need.topic.clone(), *n);
                let lacks = |op: Operation| !allowed.contains(&(op.acl_operation() as u32));
                for (op, why) in &need.ops {
                    if lacks(*op) {
                        out.denied.push(cluster.deny(
                            *op,
                            topic(),
                            why,
                            "not among the principal's authorized operations on the topic".into(),
                        ));
                    }
                }
                if let Some((want, why)) = need.min_partitions {
                    if *n < want && lacks(Operation::Alter) {
                        out.denied.push(cluster.deny(
                            Operation::Alter,
                            topic(),
                            why,
                            format!("the topic has {n} partitions, {want} are needed"),
                        ));
                    }
                }
                if let Some(why) = need.describe_configs {
                    if lacks(Operation::DescribeConfigs) {
                        out.optional.push(cluster.deny(
                            Operation::DescribeConfigs,
                            topic(),
                            why,
                            "not among the principal's authorized operations on the topic".into(),
                        ));
                    }
                }
            }
        }
    }
    Ok(partitions)
}

/// CreateTopics with validate_only: None when the broker would create the topic, the code when it
/// refuses for lack of permission. Other refusals (the topic appeared meanwhile, a policy) are the
/// creation's own business, not a permission's.
async fn validate_create(admin: &Admin, topic: &str) -> Result<Option<RDKafkaErrorCode>> {
    let opts = AdminOptions::new()
        .request_timeout(Some(TIMEOUT))
        .validate_only(true);
    let results = admin
        .inner()
        .create_topics(
            &[NewTopic::new(topic, 1, TopicReplication::Fixed(-1))],
            &opts,
        )
        .await
        .map_err(|e| BridgeError::kafka("create topic (validate only)", e))?;
    for r in results {
        if let Err((_, code)) = r {
            if is_auth(code) {
                return Ok(Some(code));
            }
        }
    }
    Ok(None)
}

/// DescribeConfigs of a sink broker: what the timeout check reads.
fn check_cluster_configs(cluster: &Cluster<'_>, runtime: &Handle, out: &mut Probe) -> Result<()> {
    let md = cluster
        .admin
        .inner()
        .inner()
        .fetch_metadata(None, TIMEOUT)
        .map_err(|e| BridgeError::kafka("fetch sink metadata", e))?;
    let Some(broker) = md.brokers().first().map(|b| b.id()) else {
        return Err(BridgeError::SinkConfigUnreadable(
            "the sink cluster reported no brokers".into(),
        ));
    };
    let opts = AdminOptions::new().request_timeout(Some(TIMEOUT));
    let results = runtime
        .block_on(
            cluster
                .admin
                .inner()
                .describe_configs(&[ResourceSpecifier::Broker(broker)], &opts),
        )
        .map_err(|e| BridgeError::kafka("describe sink broker configs", e))?;
    // rdkafka drops a resource's own error and hands back the resource without entries, while
    // every broker has configuration entries to show: an empty answer is the denial.
    let denied = match results.first() {
        Some(Ok(resource)) => resource
            .entries
            .is_empty()
            .then(|| format!("DescribeConfigs of broker {broker} returned no configuration")),
        Some(Err(code)) if is_auth(*code) => {
            Some(format!("DescribeConfigs of broker {broker}: {code:?}"))
        }
        Some(Err(code)) => {
            return Err(BridgeError::kafka(
                "describe sink broker configs",
                KafkaError::AdminOp(*code),
            ))
        }
        None => Some(format!(
            "DescribeConfigs of broker {broker} returned nothing"
        )),
    };
    if let Some(evidence) = denied {
        out.denied.push(cluster.deny(
            Operation::DescribeConfigs,
            Resource::Cluster,
            WHY_CLUSTER_CONFIGS,
            evidence,
        ));
    }
    Ok(())
}

/// init_transactions under the probe's transactional id: FindCoordinator needs Describe on it,
/// InitProducerId Write.
fn check_transactional_ids(cluster: &Cluster<'_>, cfg: &Config, out: &mut Probe) -> Result<()> {
    let id = probe_transactional_id(&cfg.bridge.id);
    let mut cc = ClientConfig::new();
    for (k, v) in &cluster.kafka {
        if is_client_wide(k) {
            cc.set(k, v);
        }
    }
    let producer: BaseProducer = cc
        .set("bootstrap.servers", cluster.bootstrap)
        .set("transactional.id", &id)
        // The probe opens no transaction: a short timeout keeps a transaction.timeout above the
        // broker's maximum for the timeout rule to report (a configuration error, exit 2), rather
        // than failing here.
        .set(
            "transaction.timeout.ms",
            cfg.transaction
                .timeout
                .min(Duration::from_secs(60))
                .as_millis()
                .to_string(),
        )
        .create()
        .map_err(|e| BridgeError::kafka("create probe producer", e))?;
    match producer.init_transactions(TIMEOUT) {
        Ok(()) => Ok(()),
        Err(e) => match e.rdkafka_error_code() {
            Some(code) if is_auth(code) => {
                out.denied.push(cluster.deny(
                    Operation::Write,
                    Resource::TransactionalIdPrefix(transactional_id_prefix(&cfg.bridge.id)),
                    WHY_TXN,
                    format!("init_transactions under '{id}': {code:?}"),
                ));
                Ok(())
            }
            _ => Err(BridgeError::kafka(
                "init_transactions (permission probe)",
                e,
            )),
        },
    }
}

/// The probe as rows of `eos-bridge check`: one failing row per missing permission, its fix the
/// grant command.
pub(crate) fn findings(cfg: &Config, runtime: &Handle) -> Vec<crate::check::Finding> {
    use crate::check::Finding;
    let row = |check: &str, ok: bool, detail: String, fix: String| Finding {
        check: check.into(),
        ok,
        warn: false,
        detail,
        fix,
    };
    let p = match probe(cfg, runtime) {
        Ok(p) => p,
        Err(e) => {
            return vec![row(
            "permissions",
            false,
            format!("could not probe the permissions: {e}"),
            "check bootstrap_servers and the security settings in [source.kafka] and [sink.kafka]"
                .into(),
        )]
        }
    };
    let mut out = Vec::new();
    if p.denied.is_empty() {
        out.push(row(
            "permissions",
            true,
            "every permission the configuration needs was granted (docs/security.md)".into(),
            String::new(),
        ));
    }
    for d in &p.denied {
        out.push(row(
            "permission",
            false,
            format!(
                "missing: {}, needed because {} ({})",
                d.permission, d.permission.why, d.evidence
            ),
            d.command(),
        ));
    }
    for d in &p.optional {
        out.push(row(
            "permission",
            true,
            format!(
                "optional, missing: {}: {}; grant it with: {}",
                d.permission,
                d.permission.why,
                d.command()
            ),
            String::new(),
        ));
    }
    for n in p.notes {
        out.push(row("permissions", true, n, String::new()));
    }
    out
}

/// DescribeConsumerGroups of `group`: its coordinator lookup needs what the bridge's consumer's
/// does, Describe on the group. A group never used is described as dead, not refused.
fn check_group(
    cluster: &Cluster<'_>,
    group: &str,
    op: Operation,
    why: &'static str,
    out: &mut Probe,
) -> Result<()> {
    // A group's coordinator may be moving or loading (a fresh broker, a new group): that is no
    // answer yet, so ask again within the probe's bound.
    let deadline = std::time::Instant::now() + TIMEOUT;
    let code = loop {
        let code = describe_group(cluster, group)?;
        let not_yet = matches!(
            code,
            RDKafkaErrorCode::NotCoordinator
                | RDKafkaErrorCode::CoordinatorLoadInProgress
                | RDKafkaErrorCode::CoordinatorNotAvailable
        );
        if !not_yet || std::time::Instant::now() >= deadline {
            break code;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if is_auth(code) {
        out.denied.push(cluster.deny(
            op,
            Resource::Group(group.to_string()),
            why,
            format!("DescribeConsumerGroups: {code:?}"),
        ));
    } else if code != RDKafkaErrorCode::NoError {
        return Err(BridgeError::kafka(
            "describe group",
            KafkaError::AdminOp(code),
        ));
    }
    Ok(())
}

/// The error code DescribeConsumerGroups gives for `group` (NoError: described).
fn describe_group(cluster: &Cluster<'_>, group: &str) -> Result<RDKafkaErrorCode> {
    let rk = cluster.admin.inner().inner().native_ptr();
    let name = CString::new(group)
        .map_err(|e| BridgeError::kafka("describe group", KafkaError::from(e)))?;
    let mut names = [name.as_ptr()];
    let fail = |code| BridgeError::kafka("describe group", KafkaError::AdminOp(code));
    // SAFETY: `rk` is a live handle, borrowed from the admin client for this call; the request
    // owns its options and queue, librdkafka copies the group name and options into its request,
    // and the description is borrowed from the event, which outlives its use.
    let code = unsafe {
        let request = Request::new(
            rk,
            rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBECONSUMERGROUPS,
            TIMEOUT,
        )
        .map_err(fail)?;
        rd::rd_kafka_DescribeConsumerGroups(
            rk,
            names.as_mut_ptr(),
            1,
            request.options.ptr,
            request.queue.ptr,
        );
        match request.reply() {
            // A timeout is no authorization failure: it is returned below as it was.
            Err(err) => err,
            Ok(event) => {
                let result = rd::rd_kafka_event_DescribeConsumerGroups_result(event.ptr);
                if result.is_null() {
                    return Err(fail(RDKafkaErrorCode::Fail));
                }
                let mut count = 0usize;
                let groups = rd::rd_kafka_DescribeConsumerGroups_result_groups(result, &mut count);
                let mut code = RDKafkaErrorCode::NoError;
                for i in 0..count {
                    let g = *groups.add(i);
                    if g.is_null() {
                        continue;
                    }
                    let e = rd::rd_kafka_ConsumerGroupDescription_error(g);
                    if !e.is_null() {
                        code = RDKafkaErrorCode::from(rd::rd_kafka_error_code(e));
                    }
                }
                code
            }
        }
    };
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perm(operation: Operation, resource: Resource) -> Permission {
        Permission {
            side: Side::Sink,
            operation,
            resource,
            why: "test",
        }
    }

    #[test]
    fn commands_name_the_operation_resource_and_pattern() {
        let p = perm(Operation::Write, Resource::Topic("orders.copy".into()));
        assert_eq!(
            p.grant_command("k1:9093,k2:9093", "User:bridge"),
            "kafka-acls.sh --bootstrap-server k1:9093,k2:9093 --add --allow-principal User:bridge --operation \
             Write --topic orders.copy"
        );
        let p = perm(
            Operation::Write,
            Resource::TransactionalIdPrefix(transactional_id_prefix("b1")),
        );
        assert_eq!(
            p.grant_command("k:1", "User:bridge"),
            "kafka-acls.sh --bootstrap-server k:1 --add --allow-principal User:bridge --operation Write \
             --transactional-id eos-bridge-b1- --resource-pattern-type prefixed"
        );
        let p = perm(Operation::DescribeConfigs, Resource::Cluster);
        assert!(p.grant_command("k:1", "User:<principal>").ends_with(
            "--allow-principal 'User:<principal>' --operation DescribeConfigs --cluster"
        ));
        assert_eq!(
            p.to_string(),
            "DescribeConfigs on the cluster (sink cluster)"
        );
    }

    #[test]
    fn the_probe_id_is_inside_the_prefix_and_never_an_instances() {
        let id = probe_transactional_id("b");
        assert!(id.starts_with(&transactional_id_prefix("b")));
        // Instance ids end in "-<number>"; the probe's does not, for any bridge id.
        assert!(!id
            .rsplit('-')
            .next()
            .unwrap()
            .chars()
            .all(|c| c.is_ascii_digit()));
    }

    #[test]
    fn the_principal_comes_from_the_sasl_user() {
        let kafka = vec![
            ("security.protocol".to_string(), "SASL_SSL".to_string()),
            ("sasl.username".to_string(), "mirror".to_string()),
        ];
        assert_eq!(principal(&kafka), "User:mirror");
        assert_eq!(principal(&[]), "User:<principal>");
    }

    #[test]
    fn every_denial_is_listed_with_its_command() {
        let d = |t: &str| Denial {
            permission: perm(Operation::Read, Resource::Topic(t.into())),
            bootstrap: "k:1".into(),
            principal: "User:u".into(),
            evidence: "TopicAuthorizationFailed".into(),
        };
        let e = BridgeError::MissingPermissions(MissingPermissions(vec![d("a"), d("b")]));
        let text = e.to_string();
        assert!(text.contains("lacks 2 permission(s)"), "{text}");
        assert!(text.contains("Read on topic 'a' (sink cluster)"), "{text}");
        assert!(text.contains("--operation Read --topic b"), "{text}");
        assert_eq!(e.exit_code(), 1);
        assert_eq!(e.action(), crate::error::Action::Stop);
        assert!(!e.is_transient());
    }
}
