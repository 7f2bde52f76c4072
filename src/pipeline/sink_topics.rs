//! The pipeline's sink topics (see `crate::mirror`): a missing one is created like its source
//! topic (partition count, copied configs, `sink.replication_factor`); an existing one is judged
//! against its source topic when first seen, refused at start if it would lose or refuse records;
//! under `preserve` every sink topic grows with its source before records of a new partition are
//! written.

use tracing::{info, warn};

use super::Pipeline;
use crate::config::Partitioning;
use crate::error::{BridgeError, Result};
use crate::mirror::{self, Severity};

impl Pipeline<'_> {
    /// Makes sure `sink_topic` can take the records of `topic` (with `partitions` now); returns
    /// the sink topic's partition count. `first` is whether this process sees `topic` for the
    /// first time: only then is an existing sink topic's configuration judged.
    pub(super) fn ensure_sink_topic(
        &mut self,
        topic: &str,
        partitions: i32,
        sink_topic: &str,
        first: bool,
    ) -> Result<i32> {
        let runtime = &self.shared.runtime;
        let n = match self.admin.partitions(sink_topic)? {
            Some(n) => {
                if first {
                    let source = runtime.block_on(self.source_admin.topic_configs(topic))?;
                    let sink = runtime.block_on(self.admin.topic_configs(sink_topic))?;
                    if let (Some(source), Some(sink)) = (source, sink) {
                        let breaches = mirror::judge(topic, sink_topic, &source, &sink);
                        for b in breaches.iter().filter(|b| b.severity == Severity::Warn) {
                            warn!(
                                topic = sink_topic,
                                setting = b.setting,
                                problem = %b.problem,
                                fix = %b.fix,
                                "sink topic differs from its source topic"
                            );
                        }
                        let refused: Vec<String> = breaches
                            .iter()
                            .filter(|b| b.severity == Severity::Refuse)
                            .map(|b| b.to_string())
                            .collect();
                        if !refused.is_empty() {
                            return Err(BridgeError::SinkTopicUnfit {
                                breaches: refused.join("; "),
                            });
                        }
                    }
                }
                n
            }
            None => {
                let source = runtime
                    .block_on(self.source_admin.topic_configs(topic))?
                    .unwrap_or_default();
                let copied = mirror::copied(&source, &self.cfg.sink.topic_config_exclude);
                let configs: Vec<(&str, &str)> = copied
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                runtime.block_on(self.admin.create_topic(sink_topic, partitions, &configs))?;
                info!(
                    topic = sink_topic,
                    source_topic = topic,
                    partitions,
                    configs = ?copied,
                    "created the sink topic like its source topic"
                );
                // Another instance may have created it first, and with another count.
                self.admin.partitions(sink_topic)?.unwrap_or(partitions)
            }
        };
        if self.cfg.sink.partitioning != Partitioning::Preserve || n >= partitions {
            return Ok(n);
        }
        // `preserve` writes source partition p to sink partition p: the sink grows with the
        // source, before any record of the new partitions is read.
        if let Some(note) =
            mirror::partition_note(self.cfg.sink.partitioning, topic, partitions, sink_topic, n)
        {
            info!(topic = sink_topic, "{note}");
        }
        runtime
            .block_on(self.admin.add_partitions(sink_topic, partitions))
            .map_err(|e| {
                BridgeError::TopicAdmin(format!(
                    "sink topic '{sink_topic}' has {n} partitions but source topic '{topic}' has \
                     {partitions}, and sink.partitioning = \"preserve\" needs at least as many: {e}"
                ))
            })?;
        self.sink.refresh_metadata(sink_topic);
        Ok(partitions)
    }
}
