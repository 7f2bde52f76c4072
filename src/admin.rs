//! Administrative calls to the sink cluster: the broker's transaction.max.timeout.ms, the marker
//! topic (created compacted if missing, one partition per instance), and the sink topics (created
//! with the source's partition count if missing, checked for enough partitions under `preserve`,
//! their max.message.bytes read to size the producer's batches). Dead-letter topics are sink
//! topics too.

use std::time::Duration;

use rdkafka::admin::{
    AdminClient, AdminOptions, NewPartitions, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use tracing::info;

use crate::error::{transient_code, BridgeError, Result};
use crate::sink::is_client_wide;

const TIMEOUT: Duration = Duration::from_secs(15);

pub struct Admin {
    client: AdminClient<DefaultClientContext>,
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
        Ok(Admin { client })
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
            .ok_or_else(|| BridgeError::Setup("the sink cluster reported no brokers".into()))?
            .id();
        let results = self
            .client
            .describe_configs(&[ResourceSpecifier::Broker(broker)], &Self::options())
            .await
            .map_err(|e| BridgeError::kafka("describe sink broker configs", e))?;
        for r in results {
            let resource = r.map_err(|code| {
                BridgeError::Setup(format!(
                    "describing the sink broker's configuration failed: {code:?}; grant DescribeConfigs on the cluster"
                ))
            })?;
            if let Some(v) = resource
                .get("transaction.max.timeout.ms")
                .and_then(|e| e.value.clone())
            {
                return v.parse().map_err(|_| {
                    BridgeError::Setup(format!(
                        "the sink broker's transaction.max.timeout.ms is not a number: {v}"
                    ))
                });
            }
        }
        Err(BridgeError::Setup(
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
                BridgeError::Setup(format!(
                    "describing the configuration of sink topic '{topic}' failed: {code:?}; grant the bridge \
                     DescribeConfigs on it"
                ))
            })?;
            if let Some(v) = resource
                .get("max.message.bytes")
                .and_then(|e| e.value.clone())
            {
                return v.parse().map_err(|_| {
                    BridgeError::Setup(format!(
                        "sink topic '{topic}' has a max.message.bytes that is not a number: {v}"
                    ))
                });
            }
        }
        Err(BridgeError::Setup(format!(
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
        let mut nt = NewTopic::new(topic, partitions, TopicReplication::Fixed(-1));
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
                // The controller moving or a broker restarting says nothing about permissions.
                Err((_, code)) if transient_code(code) => {
                    return Err(BridgeError::kafka("create topic", KafkaError::AdminOp(code)))
                }
                Err((t, code)) => {
                    return Err(BridgeError::Setup(format!(
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
                return Err(BridgeError::Setup(format!(
                    "adding partitions to '{t}' (to {total}) failed: {code:?}; add them yourself or \
                     grant the bridge Alter on the topic"
                )));
            }
        }
        info!(topic, partitions = total, "added partitions");
        Ok(())
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
                self.add_partitions(topic, want).await.map_err(|e| {
                    BridgeError::Setup(format!(
                        "marker topic '{topic}' has {n} partitions but {want} instances need one each: {e}"
                    ))
                })?;
                Ok(want)
            }
            Some(n) => Ok(n),
        }
    }
}
