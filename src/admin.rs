//! Administrative calls to the sink cluster: the broker's transaction.max.timeout.ms, the marker
//! topic (created compacted if missing, one partition per instance), and the sink topics (created
//! with the source's partition count if missing, checked for enough partitions under `preserve`,
//! their max.message.bytes read to size the producer's batches). Dead-letter topics are sink
//! topics too.
//! Also, for either cluster, its cluster id and topic ids (`cluster_ids`), which tell one
//! incarnation of a cluster or topic from another (see `identity`).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_int, CStr, CString};
use std::time::Duration;

use rdkafka::admin::{
    AdminClient, AdminOptions, ConfigSource, NewPartitions, NewTopic, ResourceSpecifier,
    TopicReplication,
};
use rdkafka::bindings as rd;
use rdkafka::client::{Client, DefaultClientContext};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::ClientContext;
use tracing::info;

use crate::config::{ConfigError, ConfigErrors};
use crate::error::{transient_code, BridgeError, Result};
use crate::mirror::TopicConfigs;
use crate::sink::is_client_wide;

const TIMEOUT: Duration = Duration::from_secs(15);

pub struct Admin {
    client: AdminClient<DefaultClientContext>,
    /// For the topics this client creates; -1 is the broker's default.replication.factor.
    replication_factor: i32,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin").finish_non_exhaustive()
    }
}

impl Admin {
    pub fn new(bootstrap: &str, kafka: &[(String, String)]) -> Result<Admin> {
        let mut cc = ClientConfig::new();
        for (k, v) in kafka {
            if is_client_wide(k) {
                cc.set(k, v);
            }
        }
        let client = cc
            .set("bootstrap.servers", bootstrap)
            .create()
            .map_err(|e| BridgeError::kafka("create admin client", e))?;
        Ok(Admin {
            client,
            replication_factor: -1,
        })
    }

    /// Topics created from now on get `factor` replicas (None: the broker's default).
    pub fn with_replication_factor(mut self, factor: Option<u16>) -> Admin {
        self.replication_factor = factor.map_or(-1, i32::from);
        self
    }

    /// Every config of a topic that has a value (sensitive ones have none), marked whether it is
    /// the hard-coded default; None when the topic does not exist.
    pub async fn topic_configs(&self, topic: &str) -> Result<Option<TopicConfigs>> {
        let results = self
            .client
            .describe_configs(&[ResourceSpecifier::Topic(topic)], &Self::options())
            .await
            .map_err(|e| BridgeError::kafka("describe topic configs", e))?;
        let mut out = TopicConfigs::default();
        for r in results {
            let resource = match r {
                Ok(resource) => resource,
                Err(RDKafkaErrorCode::UnknownTopicOrPartition) => return Ok(None),
                Err(code) if transient_code(code) => {
                    return Err(BridgeError::kafka(
                        "describe topic configs",
                        KafkaError::AdminOp(code),
                    ))
                }
                Err(code) => {
                    return Err(BridgeError::SinkConfigUnreadable(format!(
                        "describing the configuration of topic '{topic}' failed: {code:?}; grant the bridge \
                         DescribeConfigs on it"
                    )))
                }
            };
            for e in resource.entries {
                if let Some(v) = e.value {
                    let is_default = matches!(e.source, ConfigSource::Default);
                    out.entries.insert(e.name, (v, is_default));
                }
            }
        }
        Ok(Some(out))
    }

    /// The admin client, for the permission probe (`acl`).
    pub(crate) fn inner(&self) -> &AdminClient<DefaultClientContext> {
        &self.client
    }

    fn options() -> AdminOptions {
        AdminOptions::new().request_timeout(Some(TIMEOUT))
    }

    /// Partition count of a topic, None when it does not exist.
    pub fn partitions(&self, topic: &str) -> Result<Option<i32>> {
        let md = self
            .client
            .inner()
            .fetch_metadata(Some(topic), TIMEOUT)
            .map_err(|e| BridgeError::kafka("fetch sink metadata", e))?;
        Ok(md
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .filter(|t| t.error().is_none() && !t.partitions().is_empty())
            .map(|t| t.partitions().len() as i32))
    }

    /// The sink broker's transaction.max.timeout.ms.
    pub async fn transaction_max_timeout_ms(&self) -> Result<i64> {
        let md = self
            .client
            .inner()
            .fetch_metadata(None, TIMEOUT)
            .map_err(|e| BridgeError::kafka("fetch sink metadata", e))?;
        let broker = md
            .brokers()
            .first()
            .ok_or_else(|| {
                BridgeError::SinkConfigUnreadable("the sink cluster reported no brokers".into())
            })?
            .id();
        let results = self
            .client
            .describe_configs(&[ResourceSpecifier::Broker(broker)], &Self::options())
            .await
            .map_err(|e| BridgeError::kafka("describe sink broker configs", e))?;
        for r in results {
            let resource = r.map_err(|code| {
                BridgeError::SinkConfigUnreadable(format!(
                    "describing the sink broker's configuration failed: {code:?}; grant DescribeConfigs on the cluster"
                ))
            })?;
            if let Some(v) = resource
                .get("transaction.max.timeout.ms")
                .and_then(|e| e.value.clone())
            {
                return v.parse().map_err(|_| {
                    BridgeError::SinkConfigUnreadable(format!(
                        "the sink broker's transaction.max.timeout.ms is not a number: {v}"
                    ))
                });
            }
        }
        Err(BridgeError::SinkConfigUnreadable(
            "the sink broker did not report transaction.max.timeout.ms; grant DescribeConfigs on the cluster".into(),
        ))
    }

    /// A topic's max.message.bytes: the largest record batch its brokers accept.
    pub async fn max_message_bytes(&self, topic: &str) -> Result<i64> {
        let results = self
            .client
            .describe_configs(&[ResourceSpecifier::Topic(topic)], &Self::options())
            .await
            .map_err(|e| BridgeError::kafka("describe sink topic configs", e))?;
        for r in results {
            let resource = r.map_err(|code| {
                BridgeError::SinkConfigUnreadable(format!(
                    "describing the configuration of sink topic '{topic}' failed: {code:?}; grant the bridge \
                     DescribeConfigs on it"
                ))
            })?;
            if let Some(v) = resource
                .get("max.message.bytes")
                .and_then(|e| e.value.clone())
            {
                return v.parse().map_err(|_| {
                    BridgeError::SinkConfigUnreadable(format!(
                        "sink topic '{topic}' has a max.message.bytes that is not a number: {v}"
                    ))
                });
            }
        }
        Err(BridgeError::SinkConfigUnreadable(format!(
            "sink topic '{topic}' did not report max.message.bytes; grant the bridge DescribeConfigs on it"
        )))
    }

    /// Creates a topic, tolerating that someone else created it first.
    pub async fn create_topic(
        &self,
        topic: &str,
        partitions: i32,
        configs: &[(&str, &str)],
    ) -> Result<()> {
        let mut nt = NewTopic::new(
            topic,
            partitions,
            TopicReplication::Fixed(self.replication_factor),
        );
        for (k, v) in configs {
            nt = nt.set(k, v);
        }
        let res = self
            .client
            .create_topics(&[nt], &Self::options())
            .await
            .map_err(|e| BridgeError::kafka("create topic", e))?;
        for r in res {
            match r {
                Ok(_) => info!(topic, partitions, "created topic"),
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((t, RDKafkaErrorCode::InvalidReplicationFactor)) => {
                    return Err(BridgeError::Config(ConfigErrors(vec![ConfigError::new(
                        "sink.replication_factor",
                        format!(
                            "{} is more than the sink cluster has brokers (creating topic '{t}' failed with \
                             InvalidReplicationFactor): lower it, or leave it unset for the broker's \
                             default.replication.factor",
                            self.replication_factor
                        ),
                    )])))
                }
                Err((t, RDKafkaErrorCode::InvalidConfig)) => {
                    let names: Vec<&str> = configs.iter().map(|(k, _)| *k).collect();
                    return Err(BridgeError::Config(ConfigErrors(vec![ConfigError::new(
                        "sink.topic_config_exclude",
                        format!(
                            "the sink cluster refused the configs of new topic '{t}' ({}): add the one it \
                             does not accept to sink.topic_config_exclude, or create the topic yourself",
                            names.join(", ")
                        ),
                    )])))
                }
                // The controller moving or a broker restarting says nothing about permissions.
                Err((_, code)) if transient_code(code) => {
                    return Err(BridgeError::kafka("create topic", KafkaError::AdminOp(code)))
                }
                Err((t, code)) => {
                    return Err(BridgeError::TopicAdmin(format!(
                        "could not create topic '{t}' on the sink cluster: {code:?}; create it yourself or grant \
                         the bridge Create on it"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Grows a topic to `total` partitions.
    pub async fn add_partitions(&self, topic: &str, total: i32) -> Result<()> {
        let res = self
            .client
            .create_partitions(
                &[NewPartitions::new(topic, total as usize)],
                &Self::options(),
            )
            .await
            .map_err(|e| BridgeError::kafka("add partitions", e))?;
        for r in res {
            if let Err((t, code)) = r {
                // Another instance (or a person) grew it first: enough partitions is all we need.
                if let Ok(Some(now)) = self.partitions(topic) {
                    if now >= total {
                        return Ok(());
                    }
                }
                return Err(BridgeError::TopicAdmin(format!(
                    "adding partitions to '{t}' (to {total}) failed: {code:?}; add them yourself or \
                     grant the bridge Alter on the topic"
                )));
            }
        }
        info!(topic, partitions = total, "added partitions");
        Ok(())
    }

    /// The sink cluster's id and the ids of those of `topics` that exist.
    pub fn ids(&self, topics: &[String]) -> Result<ClusterIds> {
        cluster_ids(self.client.inner(), topics, TIMEOUT)
    }

    /// The marker topic: compacted (only each instance's newest marker matters), with at least
    /// one partition per instance.
    pub async fn ensure_marker_topic(&self, topic: &str, instances: u32) -> Result<i32> {
        let want = instances.max(1) as i32;
        match self.partitions(topic)? {
            None => {
                self.create_topic(
                    topic,
                    want,
                    &[
                        ("cleanup.policy", "compact"),
                        ("segment.ms", "3600000"),
                        ("min.cleanable.dirty.ratio", "0.1"),
                    ],
                )
                .await?;
                Ok(want)
            }
            Some(n) if n < want => {
                if let Err(e) = self.add_partitions(topic, want).await {
                    // Instances of a new layout start together and race to grow the topic: one
                    // of them finding it grown already is fine.
                    if let Ok(Some(now)) = self.partitions(topic) {
                        if now >= want {
                            return Ok(now);
                        }
                    }
                    return Err(BridgeError::TopicAdmin(format!(
                        "marker topic '{topic}' has {n} partitions but {want} instances need one each: {e}"
                    )));
                }
                Ok(want)
            }
            Some(n) => Ok(n),
        }
    }
}

/// What a cluster reports about its identity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterIds {
    pub cluster_id: Option<String>,
    /// Topic name → topic id, for the topics asked about that exist.
    pub topic_ids: BTreeMap<String, String>,
}

/// The cluster id of the cluster `client` is connected to, and the topic ids of those of `topics`
/// that exist there, in the form Kafka's own tools print (22 characters of URL-safe base64).
///
/// rdkafka 0.39 has no safe call for topic ids (librdkafka's DescribeTopics), and its
/// `fetch_cluster_id` never frees the string librdkafka returns, which would leak at every
/// periodic check; so this goes to librdkafka's C API directly, through rdkafka's own bindings.
/// The DescribeTopics request is a Metadata request, whose response also refreshes the cluster id
/// librdkafka caches, so the cluster id read after it is current.
pub fn cluster_ids<C: ClientContext>(
    client: &Client<C>,
    topics: &[String],
    timeout: Duration,
) -> Result<ClusterIds> {
    let rk = client.native_ptr();
    // DescribeTopics refuses duplicates.
    let names: BTreeSet<&str> = topics.iter().map(String::as_str).collect();
    let topic_ids = if names.is_empty() {
        BTreeMap::new()
    } else {
        describe_topic_ids(client, &names, timeout)?
    };
    // Without a request just made, wait for metadata if none was ever received.
    let wait = if names.is_empty() {
        timeout
    } else {
        Duration::ZERO
    };
    Ok(ClusterIds {
        cluster_id: cached_cluster_id(rk, wait),
        topic_ids,
    })
}

pub(crate) fn millis(d: Duration) -> c_int {
    d.as_millis().min(c_int::MAX as u128 / 2) as c_int
}

/// A librdkafka object this module created, destroyed when dropped so that every return path
/// frees it.
pub(crate) struct Owned<T> {
    pub(crate) ptr: *mut T,
    pub(crate) destroy: unsafe extern "C" fn(*mut T),
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: `ptr` came from the librdkafka constructor matching `destroy`, is owned by
            // this guard alone, and is destroyed exactly once.
            unsafe { (self.destroy)(self.ptr) }
        }
    }
}

fn cached_cluster_id(rk: *mut rd::rd_kafka_t, wait: Duration) -> Option<String> {
    // SAFETY: `rk` is a live client handle (borrowed from a `Client` by the caller).
    // rd_kafka_clusterid returns NULL or a NUL-terminated string that we own and must free with
    // rd_kafka_mem_free; it is copied before being freed.
    unsafe {
        let raw = rd::rd_kafka_clusterid(rk, millis(wait));
        if raw.is_null() {
            return None;
        }
        let id = CStr::from_ptr(raw).to_string_lossy().into_owned();
        rd::rd_kafka_mem_free(rk, raw.cast());
        Some(id)
    }
}

pub(crate) fn describe_error(code: RDKafkaErrorCode) -> BridgeError {
    // MetadataFetch carries the code, so that an authorization failure is classified as one.
    BridgeError::kafka("describe topics", KafkaError::MetadataFetch(code))
}

/// The options and reply queue of one librdkafka admin request, and how long to wait for it.
pub(crate) struct Request {
    pub(crate) options: Owned<rd::rd_kafka_AdminOptions_t>,
    pub(crate) queue: Owned<rd::rd_kafka_queue_t>,
    ms: c_int,
}

impl Request {
    /// Options for a request of kind `op` that times itself out after `timeout`, and a queue of
    /// our own for its reply.
    ///
    /// # Safety
    /// `rk` must be a live client handle that outlives the request.
    pub(crate) unsafe fn new(
        rk: *mut rd::rd_kafka_t,
        op: rd::rd_kafka_admin_op_t,
        timeout: Duration,
    ) -> std::result::Result<Request, RDKafkaErrorCode> {
        let ms = millis(timeout);
        // SAFETY: `rk` is live (the caller's promise); each object is owned by a guard.
        unsafe {
            let options = Owned {
                ptr: rd::rd_kafka_AdminOptions_new(rk, op),
                destroy: rd::rd_kafka_AdminOptions_destroy,
            };
            let queue = Owned {
                ptr: rd::rd_kafka_queue_new(rk),
                destroy: rd::rd_kafka_queue_destroy,
            };
            if options.ptr.is_null() || queue.ptr.is_null() {
                return Err(RDKafkaErrorCode::Fail);
            }
            let mut errstr = [0 as c_char; 256];
            // Only fails for a timeout out of range, which `millis` rules out.
            rd::rd_kafka_AdminOptions_set_request_timeout(
                options.ptr,
                ms,
                errstr.as_mut_ptr(),
                errstr.len(),
            );
            Ok(Request { options, queue, ms })
        }
    }

    /// The reply to the request sent with these options and queue: its event, or the code of its
    /// error (OperationTimedOut when none came). The caller keeps the request alive while it reads
    /// the event, whose contents are borrowed from it.
    pub(crate) fn reply(
        &self,
    ) -> std::result::Result<Owned<rd::rd_kafka_event_t>, RDKafkaErrorCode> {
        // SAFETY: the queue is live (owned by `self`); the event is owned by the guard returned.
        // A reply that arrives after we stopped waiting is freed by librdkafka with the queue,
        // which its request holds a reference to.
        unsafe {
            // The request times itself out after `ms`; the margin lets that answer arrive.
            let event = Owned {
                ptr: rd::rd_kafka_queue_poll(self.queue.ptr, self.ms.saturating_add(1000)),
                destroy: rd::rd_kafka_event_destroy,
            };
            if event.ptr.is_null() {
                return Err(RDKafkaErrorCode::OperationTimedOut);
            }
            match RDKafkaErrorCode::from(rd::rd_kafka_event_error(event.ptr)) {
                RDKafkaErrorCode::NoError => Ok(event),
                err => Err(err),
            }
        }
    }
}

/// What DescribeTopics reported for one topic it found.
#[derive(Debug)]
pub(crate) struct TopicDescription {
    pub(crate) partitions: i32,
    /// In Kafka's alphabet; None from a broker too old to have topic ids.
    pub(crate) id: Option<String>,
    /// The principal's authorized operations on the topic (rd_kafka_AclOperation_t values);
    /// empty unless asked for.
    pub(crate) allowed: BTreeSet<u32>,
}

/// The topics' descriptions, or each one's error code (e.g. UnknownTopicOrPartition, or an
/// authorization failure), by name; with `authorized_operations`, the principal's operations on
/// each (KIP-430). An error of the request as a whole is an Err.
///
/// rdkafka 0.39 has no safe call for DescribeTopics, so this goes to librdkafka's C API directly,
/// through rdkafka's own bindings.
pub(crate) fn describe_topics<C: ClientContext>(
    client: &Client<C>,
    names: &BTreeSet<&str>,
    timeout: Duration,
    authorized_operations: bool,
) -> Result<TopicDescriptions> {
    let mut out = BTreeMap::new();
    if names.is_empty() {
        return Ok(out);
    }
    let rk = client.native_ptr();
    let c_names: Vec<CString> = names
        .iter()
        .map(|n| CString::new(*n))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| BridgeError::kafka("describe topics", KafkaError::from(e)))?;
    let mut c_ptrs: Vec<*const c_char> = c_names.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: `rk` is a live client handle, borrowed from `client` for this call. Every object
    // created here is owned by an `Owned` guard (or, for the event's contents, borrowed from the
    // event, which outlives their use). The collection copies the names, and librdkafka copies the
    // collection and options into its request, so the CStrings need only live until
    // DescribeTopics returns.
    unsafe {
        let collection = Owned {
            ptr: rd::rd_kafka_TopicCollection_of_topic_names(c_ptrs.as_mut_ptr(), c_ptrs.len()),
            destroy: rd::rd_kafka_TopicCollection_destroy,
        };
        if collection.ptr.is_null() {
            return Err(describe_error(RDKafkaErrorCode::Fail));
        }
        let request = Request::new(
            rk,
            rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS,
            timeout,
        )
        .map_err(describe_error)?;
        if authorized_operations {
            let set = Owned {
                ptr: rd::rd_kafka_AdminOptions_set_include_authorized_operations(
                    request.options.ptr,
                    1,
                ),
                destroy: rd::rd_kafka_error_destroy,
            };
            if !set.ptr.is_null() {
                return Err(describe_error(RDKafkaErrorCode::from(
                    rd::rd_kafka_error_code(set.ptr),
                )));
            }
        }
        rd::rd_kafka_DescribeTopics(rk, collection.ptr, request.options.ptr, request.queue.ptr);
        let event = request.reply().map_err(describe_error)?;
        let result = rd::rd_kafka_event_DescribeTopics_result(event.ptr);
        if result.is_null() {
            return Err(describe_error(RDKafkaErrorCode::Fail));
        }
        let mut count = 0usize;
        let descriptions = rd::rd_kafka_DescribeTopics_result_topics(result, &mut count);
        for i in 0..count {
            let d = *descriptions.add(i);
            if d.is_null() {
                continue;
            }
            let name = CStr::from_ptr(rd::rd_kafka_TopicDescription_name(d))
                .to_string_lossy()
                .into_owned();
            let error = rd::rd_kafka_TopicDescription_error(d);
            let code = if error.is_null() {
                RDKafkaErrorCode::NoError
            } else {
                RDKafkaErrorCode::from(rd::rd_kafka_error_code(error))
            };
            if code != RDKafkaErrorCode::NoError {
                out.insert(name, Err(code));
                continue;
            }
            let mut partitions = 0usize;
            rd::rd_kafka_TopicDescription_partitions(d, &mut partitions);
            let mut ops = 0usize;
            let list = rd::rd_kafka_TopicDescription_authorized_operations(d, &mut ops);
            let allowed = (0..ops)
                .filter(|_| !list.is_null())
                .map(|j| *list.add(j) as u32)
                .collect();
            let uuid = rd::rd_kafka_TopicDescription_topic_id(d);
            // A broker too old to have topic ids answers with the zero id.
            let id = if uuid.is_null()
                || (rd::rd_kafka_Uuid_most_significant_bits(uuid) == 0
                    && rd::rd_kafka_Uuid_least_significant_bits(uuid) == 0)
            {
                None
            } else {
                let b64 = rd::rd_kafka_Uuid_base64str(uuid);
                (!b64.is_null()).then(|| kafka_form(&CStr::from_ptr(b64).to_string_lossy()))
            };
            out.insert(
                name,
                Ok(TopicDescription {
                    partitions: partitions as i32,
                    id,
                    allowed,
                }),
            );
        }
    }
    Ok(out)
}

/// `describe_topics`' answer: each topic's description or error code, by name.
pub(crate) type TopicDescriptions =
    BTreeMap<String, std::result::Result<TopicDescription, RDKafkaErrorCode>>;

fn describe_topic_ids<C: ClientContext>(
    client: &Client<C>,
    names: &BTreeSet<&str>,
    timeout: Duration,
) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (name, described) in describe_topics(client, names, timeout, false)? {
        match described {
            Ok(TopicDescription { id: Some(id), .. }) => {
                out.insert(name, id);
            }
            // Not there (now), or from a broker without topic ids: nothing to compare.
            Ok(_)
            | Err(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopicId) => {
            }
            Err(other) => return Err(describe_error(other)),
        }
    }
    Ok(out)
}

/// librdkafka prints topic ids in standard base64; Kafka's tools (kafka-topics --describe) use the
/// URL-safe alphabet. Messages name ids the way operators see them elsewhere.
fn kafka_form(base64: &str) -> String {
    base64
        .chars()
        .map(|c| match c {
            '+' => '-',
            '/' => '_',
            other => other,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_ids_are_shown_in_kafkas_alphabet() {
        assert_eq!(
            kafka_form("kKMw2mZ0Q+ea4k6b5/1QmA"),
            "kKMw2mZ0Q-ea4k6b5_1QmA"
        );
    }
}
