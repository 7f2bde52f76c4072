//! The library's error type and its classification.
//!
//! Every error the pipeline meets is sorted into one of four actions: retry the call, abort the
//! transaction and replay the epoch, rebuild the producer and recover in-process, or stop the
//! daemon. The classification lives here, next to the errors, so the pipeline's loop only has to
//! follow it.

use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use thiserror::Error;

use crate::checkpoint::StoreError;
use crate::config::ConfigErrors;
use crate::identity::IdentityError;
use crate::recovery::{LayoutError, RecoveryError};

/// What the pipeline does about an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Call again after a backoff; the transaction stays open.
    Retry,
    /// Abort the transaction, rewind the source to the last checkpoint, replay the epoch.
    Abort,
    /// Drop the producer, build a new one (init_transactions fences and finishes the old
    /// transaction), read the newest committed marker, resume from there.
    Rebuild,
    /// Stop the daemon with a non-zero exit.
    Stop,
}

#[derive(Debug, Error)]
pub enum BridgeError {
    #[error("invalid configuration:\n{0}")]
    Config(#[from] ConfigErrors),

    #[error("kafka {op} failed: {source}")]
    Kafka {
        op: &'static str,
        #[source]
        source: KafkaError,
    },

    #[error(
        "fenced: another eos-bridge process with transactional id '{transactional_id}' started and took over \
         (same bridge.id and bridge.instance). This process stops so that only one writes; make sure each \
         instance runs once (check for a second pod or a leftover process), then restart"
    )]
    Fenced { transactional_id: String },

    #[error(
        "not authorized: {op} failed with {code:?}. Grant the bridge's principal the ACLs it needs \
         (transactional id Write/Describe, sink topics Write, marker topic Read/Write, source topics Read)"
    )]
    Unauthorized {
        op: &'static str,
        code: RDKafkaErrorCode,
    },

    /// Permissions the probe found missing at start-up (`acl`), each with its grant command.
    #[error(transparent)]
    MissingPermissions(#[from] crate::acl::MissingPermissions),

    #[error(transparent)]
    Store(#[from] StoreError),

    #[error(transparent)]
    Recovery(#[from] RecoveryError),

    #[error(transparent)]
    LayoutSuperseded(#[from] LayoutError),

    #[error(transparent)]
    PoisonRecord(Box<BadRecordStop>),

    #[error("delivery of {topic}/{partition}@{offset} failed: {reason}")]
    Delivery {
        topic: String,
        partition: i32,
        offset: i64,
        reason: String,
        code: Option<RDKafkaErrorCode>,
    },

    #[error(
        "source position {topic}/{partition}@{position} is no longer on the broker (earliest is {earliest}): \
         {lost} records were deleted by retention before they were read. Set \
         source.on_offset_out_of_range = \"earliest\" to continue from the earliest record and count the loss"
    )]
    OffsetOutOfRange {
        topic: String,
        partition: i32,
        position: i64,
        earliest: i64,
        lost: i64,
    },

    #[error(
        "checkpoint {id} did not complete within checkpoint.timeout ({timeout:?}) at step '{step}'"
    )]
    CheckpointTimeout {
        id: u64,
        step: &'static str,
        timeout: Duration,
    },

    #[error(
        "commit marker topic '{topic}' partition {partition} holds a record with key '{found_key}' at offset \
         {offset}, but only this instance ('{our_key}') may write there: another bridge or instance shares the \
         marker partition, and its open transactions can hide this instance's newest marker from recovery. Give \
         every bridge a marker topic of its own: leave sink.marker_topic unset (the default is \
         __eos_bridge_markers.<bridge id>) or name a topic that no other bridge uses"
    )]
    MarkerTopicShared {
        topic: String,
        partition: i32,
        offset: i64,
        found_key: String,
        our_key: String,
    },

    #[error(
        "a transaction of another producer has held back commit marker topic '{topic}' partition {partition} \
         for {waited:?} (last stable offset {last_stable_offset}, high watermark {high_watermark}), longer than \
         any transaction may stay open on the sink cluster, so recovery cannot prove which checkpoint committed \
         last. Find and abort the hanging transaction with kafka-transactions.sh (find-hanging --broker-id N, then \
         abort --topic {topic} --partition {partition} --start-offset OFFSET), then restart"
    )]
    MarkerPartitionUnstable {
        topic: String,
        partition: i32,
        last_stable_offset: i64,
        high_watermark: i64,
        waited: Duration,
    },

    /// The marker read did not finish in time: the sink cluster is down, slow, or its marker
    /// partition is held back. Recovery is tried again; it never guesses without the marker.
    #[error(
        "reading the commit marker of '{key}' from {topic}/{partition} took longer than {timeout:?}: the sink \
         cluster is unreachable or slow; retrying"
    )]
    MarkerRead {
        key: String,
        topic: String,
        partition: i32,
        timeout: Duration,
    },

    #[error(
        "source.topics: topic(s) {topics:?} do not exist on the source cluster; create them or fix source.topics"
    )]
    SourceTopicsMissing { topics: Vec<String> },

    /// Listed topics the source cluster knows but reports an error for (leader not available
    /// while a broker restarts, ...): a passing state, retried.
    #[error(
        "source.topics: topic(s) {topics:?} are not available on the source cluster right now"
    )]
    SourceTopicsUnavailable { topics: Vec<String> },

    /// A cluster or topic is not the one the positions refer to, under `on_identity_change = "stop"`.
    #[error(transparent)]
    IdentityChanged(#[from] IdentityError),

    /// Under `on_identity_change = "restart"`, a change found before a checkpoint committed: the
    /// epoch read or wrote the new incarnation at old positions, so it is aborted and replayed
    /// from the restarted positions.
    #[error(
        "{changes}; bridge.on_identity_change = \"restart\": the checkpoint is aborted and {topics} \
         bridged again from the earliest offset"
    )]
    IdentityRestart { changes: String, topics: String },

    /// Existing sink topics that would lose or refuse records their source topics keep (see
    /// `mirror::judge`); each entry names the topic, the setting and the fix.
    #[error("sink topics unfit for their source topics: {breaches}")]
    SinkTopicUnfit { breaches: String },

    /// The cluster refused the SASL credentials: waiting cannot fix that.
    #[error(
        "{cluster} cluster: authentication failed ({detail}). Fix sasl.mechanism, sasl.username and \
         sasl.password (or the sasl.oauthbearer.* settings) in [{cluster}.kafka]; the password is best set \
         from the environment (EOS_BRIDGE__{upper}__KAFKA__SASL_PASSWORD). Nothing was lost: after the fix, \
         a restart resumes from the last commit", upper = .cluster.to_uppercase()
    )]
    Authentication {
        cluster: &'static str,
        detail: String,
    },

    /// The TLS handshake with the cluster failed: waiting cannot fix that.
    #[error(
        "{cluster} cluster: TLS handshake failed ({detail}). Fix security.protocol (SSL or SASL_SSL for a TLS \
         listener), ssl.ca.location (the CA that signed the brokers' certificates) and, for mutual TLS, \
         ssl.certificate.location and ssl.key.location in [{cluster}.kafka]. Nothing was lost: after the fix, \
         a restart resumes from the last commit"
    )]
    Tls {
        cluster: &'static str,
        detail: String,
    },

    /// No broker of the cluster answered for longer than `bridge.unreachable_timeout` at start-up.
    #[error(
        "{cluster} cluster unreachable for {waited:?} ({detail}): check {cluster}.bootstrap_servers, the \
         network and that the brokers run (bridge.unreachable_timeout bounds this wait). Nothing was lost: a \
         restart resumes from the last commit"
    )]
    Unreachable {
        cluster: &'static str,
        detail: String,
        waited: Duration,
    },

    /// The sink cluster's or a sink topic's configuration could not be read (DescribeConfigs).
    #[error("{0}")]
    SinkConfigUnreadable(String),

    /// A topic the bridge needs could not be created or grown on the sink cluster.
    #[error("{0}")]
    TopicAdmin(String),

    /// `source.topic_pattern` is not a regular expression.
    #[error("{0}")]
    InvalidTopicPattern(String),

    /// The HTTP API's address cannot be bound.
    #[error(
        "api.listen: cannot listen on {listen}: {reason}; choose a free address in [api] listen"
    )]
    ApiListen { listen: String, reason: String },

    /// A savepoint file given to `run --from-savepoint` cannot be read.
    #[error("{0}")]
    SavepointFile(String),

    /// `run --from-savepoint` cannot restore into this state directory or layout.
    #[error("{0}")]
    Restore(String),

    /// The process could not start or keep a thread or runtime of its own.
    #[error("{0}")]
    Runtime(String),

    /// A shutdown that could not finish its final checkpoint; nothing is lost.
    #[error("{0}")]
    ShutdownIncomplete(String),

    /// `offsets translate` cannot translate or apply (the mapping or the group says why).
    #[error("{0}")]
    Translate(String),
}

/// A record the sink refuses for good (too large for the sink topic, invalid), with
/// `on_bad_record = "stop"`, or refused by the dead-letter topic too.
#[derive(Debug, Error)]
#[error("record {topic}/{partition}@{offset} can never be written to {refused_by}: {reason}. {outcome}. Fix: {fix}")]
pub struct BadRecordStop {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// The topic(s) that refused it.
    pub refused_by: String,
    /// The broker's (or librdkafka's) error.
    pub reason: String,
    /// What became of the epoch.
    pub outcome: String,
    pub fix: String,
}

pub type Result<T, E = BridgeError> = std::result::Result<T, E>;

impl BridgeError {
    pub fn kafka(op: &'static str, source: KafkaError) -> Self {
        BridgeError::Kafka { op, source }
    }

    /// The action this error calls for. Transaction errors carry librdkafka's own flags; an error
    /// with none of them set is treated as fatal, as librdkafka documents.
    pub fn action(&self) -> Action {
        match self {
            BridgeError::Kafka { source, .. } => classify_kafka(source),
            BridgeError::Delivery { code, .. } => match code {
                Some(c) if is_auth(*c) => Action::Stop,
                Some(c) if is_fencing(*c) || *c == RDKafkaErrorCode::Fatal => Action::Rebuild,
                _ => Action::Abort,
            },
            BridgeError::CheckpointTimeout { .. } | BridgeError::IdentityRestart { .. } => {
                Action::Abort
            }
            BridgeError::MarkerRead { .. } => Action::Rebuild,
            BridgeError::SourceTopicsUnavailable { .. } => Action::Retry,
            // Every other error needs someone to act (a grant, the configuration, the store, a
            // restart): stopping is the safe default, and `reason()` names each kind of stop, so a
            // new variant is classified there.
            _ => Action::Stop,
        }
    }

    /// Whether the error says a cluster is unreachable or busy right now, so that waiting and
    /// trying again can succeed without anyone doing anything: start-up waits these out.
    pub fn is_transient(&self) -> bool {
        match self {
            BridgeError::MarkerRead { .. } | BridgeError::SourceTopicsUnavailable { .. } => true,
            BridgeError::Kafka { source, .. } => match source {
                KafkaError::Transaction(t) => {
                    !is_auth(t.code())
                        && !t.is_fatal()
                        && (t.is_retriable() || transient_code(t.code()))
                }
                // rdkafka reports no code for an admin operation's error, though it carries one.
                KafkaError::AdminOp(code) => transient_code(*code),
                other => other.rdkafka_error_code().is_some_and(transient_code),
            },
            _ => false,
        }
    }

    /// Every value `reason()` can return, so that metrics can show each at zero from the start.
    pub const REASONS: [&'static str; 18] = [
        "kafka_error",
        "delivery_error",
        "checkpoint_timeout",
        "fenced",
        "unauthorized",
        "state_store",
        "recovery",
        "poison_record",
        "offset_out_of_range",
        "identity_change",
        "config",
        "marker_topic_shared",
        "marker_partition_unstable",
        "sink_topic_unfit",
        "authentication",
        "tls",
        "unreachable",
        "setup",
    ];

    /// A short label for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            BridgeError::Kafka { .. }
            | BridgeError::MarkerRead { .. }
            | BridgeError::SourceTopicsUnavailable { .. } => "kafka_error",
            BridgeError::Delivery { .. } => "delivery_error",
            BridgeError::CheckpointTimeout { .. } => "checkpoint_timeout",
            BridgeError::Fenced { .. } => "fenced",
            BridgeError::Unauthorized { .. } | BridgeError::MissingPermissions(_) => "unauthorized",
            BridgeError::Store(_) => "state_store",
            BridgeError::Recovery(_) => "recovery",
            BridgeError::LayoutSuperseded(_) => "layout_superseded",
            BridgeError::PoisonRecord(_) => "poison_record",
            BridgeError::OffsetOutOfRange { .. } => "offset_out_of_range",
            BridgeError::IdentityChanged(_) | BridgeError::IdentityRestart { .. } => {
                "identity_change"
            }
            BridgeError::Config(_) => "config",
            BridgeError::MarkerTopicShared { .. } => "marker_topic_shared",
            BridgeError::MarkerPartitionUnstable { .. } => "marker_partition_unstable",
            BridgeError::Authentication { .. } => "authentication",
            BridgeError::Tls { .. } => "tls",
            BridgeError::Unreachable { .. } => "unreachable",
            BridgeError::SinkTopicUnfit { .. } => "sink_topic_unfit",
            // One label for the stops outside an epoch, as before they had types of their own.
            BridgeError::SourceTopicsMissing { .. }
            | BridgeError::SinkConfigUnreadable(_)
            | BridgeError::TopicAdmin(_)
            | BridgeError::InvalidTopicPattern(_)
            | BridgeError::ApiListen { .. }
            | BridgeError::SavepointFile(_)
            | BridgeError::Restore(_)
            | BridgeError::Runtime(_)
            | BridgeError::ShutdownIncomplete(_)
            | BridgeError::Translate(_) => "setup",
        }
    }

    /// The process's exit code when this error stops the bridge: 2 for a configuration that can
    /// never work (fix the file or the environment), 1 for everything else. A graceful stop
    /// exits 0 (`exit_code_of`).
    pub fn exit_code(&self) -> u8 {
        match self {
            BridgeError::Config(_)
            | BridgeError::InvalidTopicPattern(_)
            | BridgeError::SavepointFile(_)
            | BridgeError::SinkTopicUnfit { .. } => 2,
            _ => 1,
        }
    }

    /// The exit code of a run's outcome: 0 after a graceful stop, else the error's.
    pub fn exit_code_of(result: &Result<()>) -> u8 {
        result.as_ref().err().map_or(0, BridgeError::exit_code)
    }

    /// The broker's error code, where there is one.
    pub fn code(&self) -> Option<RDKafkaErrorCode> {
        match self {
            BridgeError::Kafka { source, .. } => source.rdkafka_error_code(),
            BridgeError::Delivery { code, .. } => *code,
            _ => None,
        }
    }
}

pub fn is_auth(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::TransactionalIdAuthorizationFailed
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::GroupAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            | RDKafkaErrorCode::SaslAuthenticationFailed
            | RDKafkaErrorCode::Authentication
    )
}

/// Codes of a cluster that is down, restarting or moving leaders: nothing is wrong with the
/// request, only with the moment.
pub fn transient_code(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::Resolve
            | RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::OperationTimedOut
            | RDKafkaErrorCode::RequestTimedOut
            | RDKafkaErrorCode::BrokerNotAvailable
            | RDKafkaErrorCode::LeaderNotAvailable
            | RDKafkaErrorCode::NotLeaderForPartition
            | RDKafkaErrorCode::ReplicaNotAvailable
            | RDKafkaErrorCode::NetworkException
            | RDKafkaErrorCode::CoordinatorLoadInProgress
            | RDKafkaErrorCode::CoordinatorNotAvailable
            | RDKafkaErrorCode::NotCoordinator
            | RDKafkaErrorCode::WaitingForCoordinator
            | RDKafkaErrorCode::ConcurrentTransactions
            | RDKafkaErrorCode::NotEnoughReplicas
            | RDKafkaErrorCode::NotEnoughReplicasAfterAppend
            | RDKafkaErrorCode::NotController
            | RDKafkaErrorCode::KafkaStorageError
            | RDKafkaErrorCode::ThrottlingQuotaExceeded
            // A topic created a moment ago (the marker topic) is not known to every broker yet.
            | RDKafkaErrorCode::UnknownTopicOrPartition
            | RDKafkaErrorCode::UnknownTopic
    )
}

/// Codes that mean our producer epoch is no longer current: a newer producer with our
/// transactional id, or the coordinator bumped the epoch when it timed our transaction out. Which
/// of the two it was is decided by the caller from the age of the transaction.
pub fn is_fencing(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::Fenced
            | RDKafkaErrorCode::ProducerFenced
            | RDKafkaErrorCode::InvalidProducerEpoch
    )
}

pub fn classify_kafka(e: &KafkaError) -> Action {
    match e {
        KafkaError::Transaction(t) => {
            if is_auth(t.code()) {
                Action::Stop
            } else if t.is_fatal() {
                Action::Rebuild
            } else if t.txn_requires_abort() {
                Action::Abort
            } else if t.is_retriable() {
                Action::Retry
            } else {
                Action::Rebuild
            }
        }
        // BaseProducer::commit_transaction flushes first; a flush timeout carries no transaction
        // flag but is retriable (the commit may simply be called again).
        KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut) => Action::Retry,
        // A producer with a fatal error refuses everything until it is rebuilt; without
        // transactions there is no failing abort to find that out.
        other => match other.rdkafka_error_code() {
            Some(c) if is_auth(c) => Action::Stop,
            Some(c) if is_fencing(c) || c == RDKafkaErrorCode::Fatal => Action::Rebuild,
            _ => Action::Abort,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_timeout_is_retried() {
        assert_eq!(
            classify_kafka(&KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut)),
            Action::Retry
        );
    }

    #[test]
    fn production_errors_abort_and_auth_errors_stop() {
        assert_eq!(
            classify_kafka(&KafkaError::MessageProduction(
                RDKafkaErrorCode::MessageSizeTooLarge
            )),
            Action::Abort
        );
        assert_eq!(
            classify_kafka(&KafkaError::MessageProduction(
                RDKafkaErrorCode::TopicAuthorizationFailed
            )),
            Action::Stop
        );
        assert_eq!(
            classify_kafka(&KafkaError::MessageProduction(
                RDKafkaErrorCode::ProducerFenced
            )),
            Action::Rebuild
        );
        assert_eq!(
            classify_kafka(&KafkaError::MessageProduction(RDKafkaErrorCode::Fatal)),
            Action::Rebuild
        );
        let fatal = BridgeError::Delivery {
            topic: "t".into(),
            partition: 0,
            offset: 1,
            reason: "fatal".into(),
            code: Some(RDKafkaErrorCode::Fatal),
        };
        assert_eq!(fatal.action(), Action::Rebuild);
    }

    #[test]
    fn an_unreachable_cluster_is_transient_and_a_marker_read_timeout_is_retried() {
        let down = BridgeError::kafka(
            "fetch sink metadata",
            KafkaError::MetadataFetch(RDKafkaErrorCode::BrokerTransportFailure),
        );
        assert!(down.is_transient());
        assert_ne!(down.action(), Action::Stop);
        let timed_out = BridgeError::MarkerRead {
            key: "b/0".into(),
            topic: "markers".into(),
            partition: 0,
            timeout: Duration::from_secs(60),
        };
        assert!(timed_out.is_transient());
        assert_eq!(timed_out.action(), Action::Rebuild);
        // The permission probe's DescribeConsumerGroups on a cluster still electing its group
        // coordinator: start-up waits that out.
        let coordinator = BridgeError::kafka(
            "describe group",
            KafkaError::AdminOp(RDKafkaErrorCode::NotCoordinator),
        );
        assert!(coordinator.is_transient());
        assert!(timed_out.to_string().contains("markers/0"), "{timed_out}");
        for not_transient in [
            BridgeError::kafka(
                "describe sink broker configs",
                KafkaError::AdminOp(RDKafkaErrorCode::ClusterAuthorizationFailed),
            ),
            BridgeError::kafka(
                "create admin client",
                KafkaError::ClientCreation("bad property".into()),
            ),
            BridgeError::Runtime("x".into()),
            BridgeError::SourceTopicsMissing {
                topics: vec!["t".into()],
            },
        ] {
            assert!(!not_transient.is_transient(), "{not_transient}");
        }
    }

    #[test]
    fn fatal_conditions_stop() {
        let e = BridgeError::Fenced {
            transactional_id: "x".into(),
        };
        assert_eq!(e.action(), Action::Stop);
        assert!(e.to_string().contains("another eos-bridge process"));
        let e = BridgeError::OffsetOutOfRange {
            topic: "t".into(),
            partition: 1,
            position: 5,
            earliest: 9,
            lost: 4,
        };
        assert_eq!(e.action(), Action::Stop);
        assert!(e.to_string().contains("on_offset_out_of_range"), "{e}");
        let e = BridgeError::CheckpointTimeout {
            id: 3,
            step: "flush",
            timeout: Duration::from_secs(1),
        };
        assert_eq!(e.action(), Action::Abort);
    }

    #[test]
    fn the_exit_code_follows_the_cause() {
        assert_eq!(BridgeError::exit_code_of(&Ok(())), 0);
        let config = BridgeError::Config(ConfigErrors(Vec::new()));
        assert_eq!(BridgeError::exit_code_of(&Err(config)), 2);
        assert_eq!(BridgeError::InvalidTopicPattern("(".into()).exit_code(), 2);
        for other in [
            BridgeError::Runtime("x".into()),
            BridgeError::TopicAdmin("x".into()),
            BridgeError::ShutdownIncomplete("x".into()),
            BridgeError::Fenced {
                transactional_id: "t".into(),
            },
        ] {
            assert_eq!(other.exit_code(), 1, "{other}");
            assert_eq!(other.action(), Action::Stop, "{other}");
        }
    }
}
