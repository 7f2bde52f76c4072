//! Settings of the bridge: the configuration contract, its defaults and its validation.
//!
//! This module owns the layout of the TOML file (`config/eos-bridge.toml` documents every key),
//! the environment overrides, the defaults, and every rule a setting must pass before the daemon
//! starts. [`Config::load`] reports every problem in one go, each naming its key, the value found
//! and the fix, so that a deployment is corrected in one round trip rather than one per mistake.
//! The one rule it cannot check on its own, `transaction.timeout` against the sink brokers'
//! `transaction.max.timeout.ms`, is [`Config::check_broker_timeout`], called at start-up.
//!
//! # Environment overrides
//!
//! `EOS_BRIDGE__SECTION__KEY=value` overrides `key` of `[section]`: `EOS_BRIDGE__` prefix, `__`
//! between levels, names case-insensitive (the `config` crate lower-cases them). Every variable
//! with the prefix must name a known key: a misspelled one is an error, never silently ignored.
//! Values are strings, parsed here: numbers (`"3"`), durations (`"500ms"`), lists as
//! comma-separated names (`EOS_BRIDGE__SOURCE__TOPICS=orders,payments`; an empty value clears a
//! list set by the file). The keys of `[source.kafka]` and `[sink.kafka]` are librdkafka
//! properties, whose names only ever contain dots, and an environment name cannot: there a `_`
//! stands for a `.`, so `EOS_BRIDGE__SINK__KAFKA__SASL_PASSWORD` sets `sasl.password`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use ::config::{
    Config as Layers, Environment, File, FileFormat, Map as LayerMap, Source, Value, ValueKind,
};
use regex::Regex;
use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};
use thiserror::Error;

/// Prefix of every environment override.
pub const ENV_PREFIX: &str = "EOS_BRIDGE";
/// Separator after the prefix and between levels: `EOS_BRIDGE__SECTION__KEY`. A single `_` is part
/// of a key name (`bootstrap_servers`), so the level separator has to be something else.
pub const ENV_SEPARATOR: &str = "__";
/// The only placeholder of `sink.topic`.
pub const SOURCE_TOPIC_PLACEHOLDER: &str = "{source_topic}";
/// Prefix of the default marker topic; the bridge id follows it (see [`default_marker_topic`]).
pub const DEFAULT_MARKER_TOPIC: &str = "__eos_bridge_markers";
/// Where `on_bad_record = "dead-letter"` writes the records the sink refuses, unless
/// `sink.dead_letter_topic` says otherwise.
pub const DEFAULT_DEAD_LETTER_TOPIC: &str = "{source_topic}.dlq";

/// The marker topic a bridge uses unless `sink.marker_topic` names one: a topic per bridge id,
/// so that no other bridge's transaction can ever sit in an instance's marker partition and hold
/// back the last stable offset its recovery reads up to.
pub fn default_marker_topic(bridge_id: &str) -> String {
    format!("{DEFAULT_MARKER_TOPIC}.{bridge_id}")
}

/// How the `config` crate names the origin of a value that came from its `Environment` source.
const ENV_ORIGIN: &str = "the environment";
/// librdkafka's range for `transaction.timeout.ms`.
const MIN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(1);
const MAX_KAFKA_MS: u128 = i32::MAX as u128;
/// Long enough for a broker restart or a rolling upgrade, short enough that a wrong address ends in
/// an exit an orchestrator reports.
const DEFAULT_UNREACHABLE_TIMEOUT: Duration = Duration::from_secs(300);
const DURATION_EXAMPLES: &str = r#"write it like "500ms", "1s" or "2m""#;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub bridge: BridgeConfig,
    pub source: SourceConfig,
    pub sink: SinkConfig,
    pub checkpoint: CheckpointConfig,
    pub transaction: TransactionConfig,
    pub api: ApiConfig,
    pub shutdown: ShutdownConfig,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgeConfig {
    pub id: String,
    /// This instance's number, `0..instances`: it picks the instance's share of the partitions.
    pub instance: u32,
    pub instances: u32,
    pub state_dir: PathBuf,
    pub delivery: Delivery,
    /// What to do when a cluster or topic is not the one the committed positions were taken on.
    pub on_identity_change: IdentityPolicy,
    /// How long start-up waits for a cluster no broker of answers before it exits.
    pub unreachable_timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Delivery {
    ExactlyOnce,
    AtLeastOnce,
    AtMostOnce,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceConfig {
    pub bootstrap_servers: String,
    /// Exactly one of `topics` (non-empty) and `topic_pattern` is set in a validated config.
    pub topics: Vec<String>,
    /// Matched against the whole topic name, like the Java clients' pattern subscription.
    pub topic_pattern: Option<String>,
    /// Where to start when neither a checkpoint nor a commit marker says where to resume.
    pub start: StartPosition,
    pub on_offset_out_of_range: OutOfRange,
    pub kafka: KafkaProps,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StartPosition {
    Earliest,
    Latest,
    /// The first record at or after this time, in milliseconds since the Unix epoch.
    Timestamp(i64),
}

/// What to do when the source or sink cluster, or a source or sink topic, is another one than the
/// committed positions refer to (a rebuilt cluster, a topic deleted and created again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdentityPolicy {
    /// Stop with a message naming what changed and the ways out.
    Stop,
    /// Bridge every source topic touched by the change again from its earliest offset; logged at
    /// error level and counted.
    Restart,
}

/// What to do when a position to resume from no longer exists because retention deleted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutOfRange {
    Fail,
    /// Resume from the oldest record still kept; the records lost are counted and logged.
    Earliest,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkConfig {
    /// The source's servers when not set: the same cluster.
    pub bootstrap_servers: String,
    /// A template: [`SOURCE_TOPIC_PLACEHOLDER`] is replaced by the source topic's name.
    pub topic: String,
    pub partitioning: Partitioning,
    pub marker_topic: String,
    pub on_bad_record: OnBadRecord,
    /// A template like `topic`; used only with [`OnBadRecord::DeadLetter`].
    pub dead_letter_topic: String,
    /// The most output bytes (keys and values) handed to the producer and not yet acknowledged;
    /// the bridge lowers its working limit below this for a slow sink.
    pub max_in_flight_bytes: u64,
    pub kafka: KafkaProps,
}

/// `sink.max_in_flight_bytes` when unset: 16 MiB.
pub const DEFAULT_MAX_IN_FLIGHT_BYTES: u64 = 16 * 1024 * 1024;
/// `checkpoint.max_bytes` when unset: 64 MiB.
pub const DEFAULT_EPOCH_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// What to do with a record the sink refuses for good (too large for the sink topic, invalid).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OnBadRecord {
    /// Abort the transaction and stop, naming the record.
    Stop,
    /// Write the record to the dead-letter topic instead, in the same transaction, and go on.
    DeadLetter,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Partitioning {
    /// Sink partition = source partition: the source order is kept whole.
    Preserve,
    /// Kafka's default (murmur2) partitioner on the record key: order is kept per key.
    Key,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointConfig {
    pub interval: Duration,
    pub min_pause: Duration,
    pub timeout: Duration,
    pub retain: usize,
    /// An epoch ends early once its output (keys and values) reaches this many bytes.
    pub max_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransactionConfig {
    pub timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiConfig {
    pub listen: SocketAddr,
    pub admin_token: Option<Secret>,
    /// See [`Config::ready_max_age`] for the default.
    pub ready_max_age: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShutdownConfig {
    pub timeout: Duration,
}

/// librdkafka properties passed through to a client, by their dotted names.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct KafkaProps(BTreeMap<String, String>);

/// A value that must not reach a log: its `Debug` prints `***` and it has no `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

/// One problem with the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    /// The dotted key, `section.key` (for a file that cannot be read: the file's path).
    pub key: String,
    /// The value found, what is wrong with it and how to fix it.
    pub message: String,
}

/// Every problem found in one load, in a stable order.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

/// Which source topics the bridge reads: see [`Config::source_topic_matcher`].
#[derive(Debug, Clone)]
pub enum TopicMatcher {
    Listed(Vec<String>),
    /// Anchored at both ends: it must match the whole topic name.
    Pattern(Regex),
}

impl Config {
    /// Defaults, then the TOML file (if given), then `EOS_BRIDGE__*` variables from `env`; then
    /// validates. Collects every error and returns them all at once.
    pub fn load(
        file: Option<&Path>,
        env: &HashMap<String, String>,
    ) -> Result<Config, ConfigErrors> {
        let root = layers(file, env)?;
        let mut loader = Loader::default();
        let (raw, source_kafka, sink_kafka) = loader.read(root);
        let config = loader.resolve(raw, source_kafka, sink_kafka);
        loader.validate(&config);
        loader.finish(config)
    }

    /// [`Config::load`] with the process's environment.
    pub fn from_process_env(file: Option<&Path>) -> Result<Config, ConfigErrors> {
        let mut env = HashMap::new();
        let mut unreadable = Vec::new();
        // `std::env::vars` would panic on any non-UTF-8 variable, ours or not.
        for (name, value) in std::env::vars_os() {
            let Ok(name) = name.into_string() else {
                continue;
            };
            match value.into_string() {
                Ok(value) => {
                    env.insert(name, value);
                }
                Err(_) if is_ours(&name) => unreadable.push(ConfigError::new(
                    &name,
                    "the value is not valid UTF-8: set it as UTF-8 text",
                )),
                Err(_) => {}
            }
        }
        match (Config::load(file, &env), unreadable.is_empty()) {
            (result, true) => result,
            (Ok(_), false) => Err(ConfigErrors(unreadable)),
            (Err(ConfigErrors(errors)), false) => {
                unreadable.extend(errors);
                Err(ConfigErrors(unreadable))
            }
        }
    }

    /// Checks the rules of [`Config::load`] again, for a config built or changed in code.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        let mut loader = Loader::default();
        loader.validate(self);
        loader.finish(())
    }

    /// The source topics to read.
    ///
    /// # Panics
    /// If `source.topic_pattern` is not a valid regex, which [`Config::load`] never lets through.
    pub fn source_topic_matcher(&self) -> TopicMatcher {
        match &self.source.topic_pattern {
            Some(pattern) => TopicMatcher::Pattern(
                anchored(pattern).expect("source.topic_pattern is checked by Config::load"),
            ),
            None => TopicMatcher::Listed(self.source.topics.clone()),
        }
    }

    /// The sink topic that the records of `source_topic` go to.
    pub fn sink_topic_for(&self, source_topic: &str) -> String {
        self.sink
            .topic
            .replace(SOURCE_TOPIC_PLACEHOLDER, source_topic)
    }

    /// The dead-letter topic of `source_topic`'s refused records.
    pub fn dead_letter_topic_for(&self, source_topic: &str) -> String {
        self.sink
            .dead_letter_topic
            .replace(SOURCE_TOPIC_PLACEHOLDER, source_topic)
    }

    /// `eos-bridge-{id}-{instance}`: one per instance, stable across restarts, so that a restarted
    /// instance fences its own zombie and no two instances fence each other.
    pub fn transactional_id(&self) -> String {
        format!("eos-bridge-{}-{}", self.bridge.id, self.bridge.instance)
    }

    /// How old the last completed checkpoint may be while the bridge still reports ready:
    /// `api.ready_max_age`, or by default three missed intervals plus one checkpoint's timeout.
    pub fn ready_max_age(&self) -> Duration {
        self.api
            .ready_max_age
            .unwrap_or_else(|| self.checkpoint.default_ready_max_age())
    }

    /// The half of the timeout rule that needs the sink brokers' `transaction.max.timeout.ms`:
    /// above it, `init_transactions` fails with INVALID_TRANSACTION_TIMEOUT. Only exactly-once
    /// delivery uses transactions, so the other modes always pass.
    pub fn check_broker_timeout(&self, transaction_max_timeout_ms: i64) -> Result<(), ConfigError> {
        let timeout = self.transaction.timeout;
        let broker_max_ms = u64::try_from(transaction_max_timeout_ms).unwrap_or(0);
        if self.bridge.delivery != Delivery::ExactlyOnce
            || timeout.as_millis() <= u128::from(broker_max_ms)
        {
            return Ok(());
        }
        let broker_max = Duration::from_millis(broker_max_ms);
        let (epoch_key, epoch) = self.epoch();
        let open = epoch.saturating_add(self.checkpoint.timeout);
        Err(ConfigError::new(
            "transaction.timeout",
            format!(
                "{} ({} ms) is above the sink brokers' transaction.max.timeout.ms = \
                 {transaction_max_timeout_ms} ({}), so the brokers would refuse every \
                 transaction; lower [transaction] timeout to at most {} (while keeping it above \
                 {epoch_key} + checkpoint.timeout = {}), or raise transaction.max.timeout.ms on \
                 the sink brokers",
                show(timeout),
                timeout.as_millis(),
                show(broker_max),
                show(broker_max),
                show(open),
            ),
        ))
    }

    /// How long an epoch lasts, and the key that sets it: the checkpoint interval, or the minimum
    /// pause if that is longer. A transaction stays open for an epoch plus its checkpoint.
    fn epoch(&self) -> (&'static str, Duration) {
        let cp = &self.checkpoint;
        if cp.min_pause > cp.interval {
            ("checkpoint.min_pause", cp.min_pause)
        } else {
            ("checkpoint.interval", cp.interval)
        }
    }
}

impl Delivery {
    pub const fn as_str(self) -> &'static str {
        match self {
            Delivery::ExactlyOnce => "exactly-once",
            Delivery::AtLeastOnce => "at-least-once",
            Delivery::AtMostOnce => "at-most-once",
        }
    }
}

impl OutOfRange {
    pub const fn as_str(self) -> &'static str {
        match self {
            OutOfRange::Fail => "fail",
            OutOfRange::Earliest => "earliest",
        }
    }
}

impl OnBadRecord {
    pub const fn as_str(self) -> &'static str {
        match self {
            OnBadRecord::Stop => "stop",
            OnBadRecord::DeadLetter => "dead-letter",
        }
    }
}

impl IdentityPolicy {
    pub const fn as_str(self) -> &'static str {
        match self {
            IdentityPolicy::Stop => "stop",
            IdentityPolicy::Restart => "restart",
        }
    }
}

impl Partitioning {
    pub const fn as_str(self) -> &'static str {
        match self {
            Partitioning::Preserve => "preserve",
            Partitioning::Key => "key",
        }
    }
}

impl FromStr for Delivery {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [Delivery::ExactlyOnce, Delivery::AtLeastOnce, Delivery::AtMostOnce]
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| {
                format!(r#"{s:?} is not a delivery mode: use "exactly-once", "at-least-once" or "at-most-once""#)
            })
    }
}

impl FromStr for OutOfRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fail" => Ok(OutOfRange::Fail),
            "earliest" => Ok(OutOfRange::Earliest),
            _ => Err(format!(
                r#"{s:?} is not an out-of-range policy: use "fail" (stop) or "earliest" (resume from the oldest record kept, counting the records lost)"#
            )),
        }
    }
}

impl FromStr for IdentityPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stop" => Ok(IdentityPolicy::Stop),
            "restart" => Ok(IdentityPolicy::Restart),
            _ => Err(format!(
                r#"{s:?} is not an identity policy: use "stop" (stop and say what changed) or "restart" (bridge a recreated topic or rebuilt cluster again from its earliest offset)"#
            )),
        }
    }
}

impl FromStr for Partitioning {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "preserve" => Ok(Partitioning::Preserve),
            "key" => Ok(Partitioning::Key),
            _ => Err(format!(
                r#"{s:?} is not a partitioning: use "preserve" (sink partition = source partition) or "key" (partition by record key)"#
            )),
        }
    }
}

impl FromStr for OnBadRecord {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stop" => Ok(OnBadRecord::Stop),
            "dead-letter" => Ok(OnBadRecord::DeadLetter),
            _ => Err(format!(
                r#"{s:?} is not a bad-record policy: use "stop" (abort and stop, naming the record) or "dead-letter" (write it to sink.dead_letter_topic and go on)"#
            )),
        }
    }
}

impl FromStr for StartPosition {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let fix = r#"use "earliest", "latest" or "timestamp:<milliseconds since the Unix epoch>", e.g. "timestamp:1700000000000""#;
        match s {
            "earliest" => Ok(StartPosition::Earliest),
            "latest" => Ok(StartPosition::Latest),
            _ => match s.strip_prefix("timestamp:") {
                Some(ms) => match ms.parse::<i64>() {
                    Ok(ms) if ms >= 0 => Ok(StartPosition::Timestamp(ms)),
                    _ => Err(format!(
                        "{s:?} has no valid timestamp: it must be a non-negative whole number of milliseconds; {fix}"
                    )),
                },
                None => Err(format!("{s:?} is not a start position: {fix}")),
            },
        }
    }
}

impl fmt::Display for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for OutOfRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for IdentityPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for Partitioning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for OnBadRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for StartPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartPosition::Earliest => f.write_str("earliest"),
            StartPosition::Latest => f.write_str("latest"),
            StartPosition::Timestamp(ms) => write!(f, "timestamp:{ms}"),
        }
    }
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            interval: Duration::from_secs(1),
            min_pause: Duration::ZERO,
            timeout: Duration::from_secs(30),
            retain: 3,
            max_bytes: DEFAULT_EPOCH_MAX_BYTES,
        }
    }
}

impl CheckpointConfig {
    fn default_ready_max_age(&self) -> Duration {
        self.interval.saturating_mul(3).saturating_add(self.timeout)
    }
}

impl Default for TransactionConfig {
    fn default() -> Self {
        // librdkafka's own default for transaction.timeout.ms.
        TransactionConfig {
            timeout: Duration::from_secs(60),
        }
    }
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin_token: None,
            ready_max_age: None,
        }
    }
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            timeout: Duration::from_secs(30),
        }
    }
}

impl KafkaProps {
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether a property's value is a credential, to be kept out of logs and `Debug` output.
    pub fn is_sensitive(key: &str) -> bool {
        let key = key.to_ascii_lowercase();
        [
            "password",
            "secret",
            "jaas",
            "token",
            "credential",
            "oauthbearer.config",
        ]
        .iter()
        .any(|word| key.contains(word))
            || key.ends_with(".key")
            || key.ends_with("key.pem")
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for KafkaProps {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        KafkaProps(
            iter.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }
}

impl fmt::Debug for KafkaProps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(k, v)| {
                (
                    k,
                    if KafkaProps::is_sensitive(k) {
                        "***"
                    } else {
                        v
                    },
                )
            }))
            .finish()
    }
}

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl ConfigError {
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl TopicMatcher {
    pub fn matches(&self, topic: &str) -> bool {
        match self {
            TopicMatcher::Listed(topics) => topics.iter().any(|t| t == topic),
            TopicMatcher::Pattern(pattern) => pattern.is_match(topic),
        }
    }
}

/// Merges the file and the environment into one tree. Defaults are not a layer: they are applied
/// while resolving, where a missing key and a bad value can be told apart.
fn layers(
    file: Option<&Path>,
    env: &HashMap<String, String>,
) -> Result<LayerMap<String, Value>, ConfigErrors> {
    let mut builder = Layers::builder();
    if let Some(path) = file {
        builder = builder.add_source(File::from(path).format(FileFormat::Toml).required(true));
    }
    // No try_parsing and no list_separator: both rewrite strings behind our back ("007" becomes
    // 7, every string a list); values are parsed by the deserializers below instead.
    let env: LayerMap<String, String> = env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    builder = builder.add_source(
        Environment::with_prefix(ENV_PREFIX)
            .prefix_separator(ENV_SEPARATOR)
            .separator(ENV_SEPARATOR)
            .source(Some(env)),
    );
    let unreadable = |e: ::config::ConfigError| {
        let key = file.map_or_else(|| "environment".to_string(), |p| p.display().to_string());
        ConfigErrors(vec![ConfigError::new(key, one_line(&e.to_string()))])
    };
    let layers = builder.build().map_err(unreadable)?;
    Source::collect(&layers).map_err(unreadable)
}

fn is_ours(env_name: &str) -> bool {
    env_name
        .to_ascii_uppercase()
        .starts_with(&format!("{ENV_PREFIX}{ENV_SEPARATOR}"))
}

/// What the file and the environment say, before defaults. Each section lists the keys it accepts
/// as its fields (the two `kafka` tables aside), and every field is read on its own.
#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawConfig {
    bridge: RawBridge,
    source: RawSource,
    sink: RawSink,
    checkpoint: RawCheckpoint,
    transaction: RawTransaction,
    api: RawApi,
    shutdown: RawShutdown,
}

#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawBridge {
    id: Field<String>,
    instance: Field<Count<u32>>,
    instances: Field<Count<u32>>,
    state_dir: Field<String>,
    delivery: Field<Parse<Delivery>>,
    on_identity_change: Field<Parse<IdentityPolicy>>,
    unreachable_timeout: Field<HumanDuration>,
}

#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawSource {
    bootstrap_servers: Field<String>,
    topics: Field<TopicList>,
    topic_pattern: Field<String>,
    start: Field<Parse<StartPosition>>,
    on_offset_out_of_range: Field<Parse<OutOfRange>>,
}

#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawSink {
    bootstrap_servers: Field<String>,
    topic: Field<String>,
    partitioning: Field<Parse<Partitioning>>,
    marker_topic: Field<String>,
    on_bad_record: Field<Parse<OnBadRecord>>,
    dead_letter_topic: Field<String>,
    max_in_flight_bytes: Field<Count<u64>>,
}

#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawCheckpoint {
    interval: Field<HumanDuration>,
    min_pause: Field<HumanDuration>,
    timeout: Field<HumanDuration>,
    retain: Field<Count<usize>>,
    max_bytes: Field<Count<u64>>,
}

#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawTransaction {
    timeout: Field<HumanDuration>,
}

#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawApi {
    listen: Field<Parse<ListenAddr>>,
    admin_token: Field<String>,
    ready_max_age: Field<HumanDuration>,
}

#[derive(Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawShutdown {
    timeout: Field<HumanDuration>,
}

/// The keys a section accepts, and whether it has a librdkafka `kafka` table.
fn section_keys(section: &str) -> Option<(&'static [&'static str], bool)> {
    Some(match section {
        "bridge" => (field_names::<RawBridge>(), false),
        "source" => (field_names::<RawSource>(), true),
        "sink" => (field_names::<RawSink>(), true),
        "checkpoint" => (field_names::<RawCheckpoint>(), false),
        "transaction" => (field_names::<RawTransaction>(), false),
        "api" => (field_names::<RawApi>(), false),
        "shutdown" => (field_names::<RawShutdown>(), false),
        _ => return None,
    })
}

/// The field names serde derived for `T`, so that the structs above stay the one list of keys:
/// serde hands them to `deserialize_struct`, where this probe keeps them and gives up.
fn field_names<T: for<'de> Deserialize<'de>>() -> &'static [&'static str] {
    struct Probe<'a>(&'a mut &'static [&'static str]);

    impl<'de> Deserializer<'de> for Probe<'_> {
        type Error = de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("field names taken"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }

    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Probe(&mut fields));
    fields
}

/// One key's value as written. A bad value is kept as its message instead of failing the whole
/// section, so that one load reports every bad value. That is sound only because each value of
/// the `config` crate's tree is deserialized from an owned, self-contained `Value`: giving up on
/// one leaves nothing half-read behind.
#[derive(Default)]
enum Field<T> {
    #[default]
    Unset,
    Set(T),
    Invalid(String),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(match T::deserialize(deserializer) {
            Ok(value) => Field::Set(value),
            Err(e) => Field::Invalid(one_line(&e.to_string())),
        })
    }
}

/// A whole number written as a number (file) or a string of digits (environment). The `config`
/// crate's own integer parsing would also take "yes" for 1.
struct Count<T>(T);

impl<'de, T: TryFrom<u64>> Deserialize<'de> for Count<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Whole;

        impl Visitor<'_> for Whole {
            type Value = u64;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a whole number such as 3")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
                Ok(v)
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
                u64::try_from(v).map_err(|_| {
                    E::custom(format!("{v} is negative: use a whole number of 0 or more"))
                })
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
                v.trim().parse().map_err(|_| {
                    E::custom(format!(
                        "{v:?} is not a whole number: write digits only, such as \"3\""
                    ))
                })
            }
        }

        let n = deserializer.deserialize_any(Whole)?;
        T::try_from(n)
            .map(Count)
            .map_err(|_| de::Error::custom(format!("{n} is too large")))
    }
}

/// A duration in humantime's notation: "500ms", "1s", "2m", "1h 30m".
struct HumanDuration(Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Human;

        impl Visitor<'_> for Human {
            type Value = HumanDuration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a duration: {DURATION_EXAMPLES}")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                humantime::parse_duration(v.trim())
                    .map(HumanDuration)
                    .map_err(|e| {
                        E::custom(format!(
                            "{v:?} is not a duration ({e}): {DURATION_EXAMPLES}"
                        ))
                    })
            }

            // A bare number is refused rather than guessed: seconds and milliseconds are both
            // common conventions.
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HumanDuration, E> {
                Err(E::custom(format!(
                    "{v} has no unit: write \"{v}s\" for seconds or \"{v}ms\" for milliseconds"
                )))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<HumanDuration, E> {
                Err(E::custom(format!(
                    "{v} has no unit: write \"{v}s\" for seconds or \"{v}ms\" for milliseconds"
                )))
            }
        }

        deserializer.deserialize_any(Human)
    }
}

/// Topic names: a TOML array from the file, "a,b,c" from the environment.
struct TopicList(Vec<String>);

impl<'de> Deserialize<'de> for TopicList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Topics;

        impl<'de> Visitor<'de> for Topics {
            type Value = TopicList;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    r#"a list of topic names: ["a", "b"] in the file, "a,b" in the environment"#,
                )
            }

            // Blank entries are dropped so that a trailing comma is harmless and an empty string
            // clears a list set by the file.
            fn visit_str<E: de::Error>(self, v: &str) -> Result<TopicList, E> {
                Ok(TopicList(
                    v.split(',')
                        .map(str::trim)
                        .filter(|t| !t.is_empty())
                        .map(String::from)
                        .collect(),
                ))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TopicList, A::Error> {
                let mut topics = Vec::new();
                while let Some(topic) = seq.next_element::<String>()? {
                    topics.push(topic.trim().to_string());
                }
                Ok(TopicList(topics))
            }
        }

        deserializer.deserialize_any(Topics)
    }
}

/// A string read with `T`'s `FromStr`, whose error message names the value and the fix.
struct Parse<T>(T);

impl<'de, T: FromStr<Err: fmt::Display>> Deserialize<'de> for Parse<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Text<T>(PhantomData<T>);

        impl<T: FromStr<Err: fmt::Display>> Visitor<'_> for Text<T> {
            type Value = Parse<T>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Parse<T>, E> {
                v.parse().map(Parse).map_err(E::custom)
            }
        }

        deserializer.deserialize_any(Text(PhantomData))
    }
}

struct ListenAddr(SocketAddr);

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        s.trim().parse().map(ListenAddr).map_err(|e| {
            format!(r#"{s:?} is not an address to listen on ({e}): write an IP address and a port, e.g. "127.0.0.1:8080" or "0.0.0.0:8080""#)
        })
    }
}

/// Collects errors across reading, resolving and validating.
#[derive(Default)]
struct Loader {
    errors: Vec<ConfigError>,
    /// Keys whose value did not parse. Rules that read them are skipped: judged on a stand-in
    /// default, they would report a value the user never wrote.
    broken: BTreeSet<String>,
    /// The environment variable behind each key set from the environment, to point at it.
    env_names: BTreeMap<String, String>,
}

impl Loader {
    fn fail(&mut self, key: &str, message: impl Into<String>) {
        let mut message = message.into();
        if let Some(var) = self.env_names.get(key) {
            message = format!("{message} (set by {var})");
        }
        self.errors.push(ConfigError::new(key, message));
    }

    fn usable(&self, keys: &[&str]) -> bool {
        keys.iter().all(|k| !self.broken.contains(*k))
    }

    fn finish<T>(self, value: T) -> Result<T, ConfigErrors> {
        if self.errors.is_empty() {
            Ok(value)
        } else {
            Err(ConfigErrors(self.errors))
        }
    }

    /// Walks the merged tree: rejects unknown keys (all of them, with their full names), takes the
    /// two librdkafka tables out, and reads what is left into the raw sections.
    fn read(&mut self, root: LayerMap<String, Value>) -> (RawConfig, KafkaProps, KafkaProps) {
        let sections = field_names::<RawConfig>();
        let (mut source_kafka, mut sink_kafka) = (KafkaProps::default(), KafkaProps::default());
        let mut known = LayerMap::new();
        for (section, value) in sorted(root) {
            let Some((keys, has_kafka)) = section_keys(&section) else {
                self.unknown(&section, &value, "the top level", sections);
                continue;
            };
            let ValueKind::Table(table) = value.kind else {
                self.broken
                    .extend(keys.iter().map(|key| format!("{section}.{key}")));
                self.note_env(&section, &value);
                self.fail(
                    &section,
                    format!("expected a table of settings, found a value: set its keys, e.g. [{section}] in the file"),
                );
                continue;
            };
            let mut kept = LayerMap::new();
            for (key, value) in sorted(table) {
                let path = format!("{section}.{key}");
                if has_kafka && key == "kafka" {
                    let props = self.kafka_props(&path, value);
                    if section == "source" {
                        source_kafka = props;
                    } else {
                        sink_kafka = props;
                    }
                } else if keys.contains(&key.as_str()) {
                    self.note_env(&path, &value);
                    kept.insert(key, value);
                } else {
                    let mut accepted = keys.to_vec();
                    if has_kafka {
                        accepted.push("kafka");
                    }
                    self.unknown(&path, &value, &format!("[{section}]"), &accepted);
                }
            }
            known.insert(section, Value::new(None, ValueKind::Table(kept)));
        }
        let raw = Value::new(None, ValueKind::Table(known))
            .try_deserialize::<RawConfig>()
            .unwrap_or_else(|e| {
                // Unknown keys were taken out above and every field reads on its own, so this
                // is a bug of this module rather than of the configuration.
                self.fail("configuration", one_line(&e.to_string()));
                RawConfig::default()
            });
        (raw, source_kafka, sink_kafka)
    }

    fn unknown(&mut self, path: &str, value: &Value, place: &str, accepted: &[&str]) {
        let mut vars = Vec::new();
        env_leaves(path, value, &mut vars);
        let from = match vars.len() {
            0 => String::new(),
            _ => format!(" (set by {})", vars.join(", ")),
        };
        self.errors.push(ConfigError::new(
            path,
            format!(
                "unknown key{from}: {place} accepts {}; check the spelling",
                accepted.join(", ")
            ),
        ));
    }

    fn note_env(&mut self, path: &str, value: &Value) {
        if value.origin() == Some(ENV_ORIGIN) {
            self.env_names
                .insert(path.to_string(), env_name(path.split('.')));
        }
    }

    /// Flattens a librdkafka table (TOML dotted keys make nested tables) into dotted names, with
    /// `_` read as `.`. A property set both in the file and in the environment takes the
    /// environment's value, however each one spelled the name.
    fn kafka_props(&mut self, path: &str, value: Value) -> KafkaProps {
        if !matches!(value.kind, ValueKind::Table(_)) {
            self.note_env(path, &value);
            self.fail(
                path,
                format!(r#"expected a table of librdkafka properties, e.g. [{path}] "compression.type" = "zstd""#),
            );
            return KafkaProps::default();
        }
        let mut leaves = Vec::new();
        flatten(Vec::new(), value, &mut leaves);
        // Stable: within each origin the order stays sorted; the environment's come last and win.
        leaves.sort_by_key(|(_, v)| v.origin() == Some(ENV_ORIGIN));
        let mut props: BTreeMap<String, (String, bool, String)> = BTreeMap::new();
        for (segments, leaf) in leaves {
            let spelled = segments.join(".");
            let name = spelled.replace('_', ".");
            let key = format!("{path}.{name}");
            let from_env = leaf.origin() == Some(ENV_ORIGIN);
            if from_env {
                self.env_names.insert(
                    key.clone(),
                    env_name(path.split('.').chain(segments.iter().map(String::as_str))),
                );
            }
            let text = match leaf.kind {
                ValueKind::Nil => continue,
                ValueKind::Array(_) => {
                    self.broken.insert(key.clone());
                    self.fail(
                        &key,
                        "librdkafka properties are single values: write a list as one comma-separated string",
                    );
                    continue;
                }
                _ => match leaf.into_string() {
                    Ok(text) => text,
                    Err(e) => {
                        self.fail(&key, one_line(&e.to_string()));
                        continue;
                    }
                },
            };
            if let Some((other, other_from_env, _)) = props.get(&name) {
                if *other_from_env == from_env {
                    let place = if from_env {
                        "the environment"
                    } else {
                        "the file"
                    };
                    let message =
                        format!("set twice in {place}, as `{other}` and as `{spelled}`: keep one");
                    self.fail(&key, message);
                    continue;
                }
            }
            props.insert(name, (spelled, from_env, text));
        }
        KafkaProps(
            props
                .into_iter()
                .map(|(name, (_, _, text))| (name, text))
                .collect(),
        )
    }

    /// Reads a field: its value, `None` when unset, or `None` and an error when it did not parse.
    fn take<T>(&mut self, key: &str, field: Field<T>) -> Option<T> {
        match field {
            Field::Unset => None,
            Field::Set(value) => Some(value),
            Field::Invalid(message) => {
                self.broken.insert(key.to_string());
                self.fail(key, message);
                None
            }
        }
    }

    /// Applies the defaults to what was read.
    fn resolve(
        &mut self,
        raw: RawConfig,
        source_kafka: KafkaProps,
        sink_kafka: KafkaProps,
    ) -> Config {
        let RawConfig {
            bridge: b,
            source: s,
            sink: k,
            checkpoint: c,
            transaction: t,
            api: a,
            shutdown: d,
        } = raw;
        let bridge = BridgeConfig {
            // Required: validation reports it missing.
            id: self.take("bridge.id", b.id).unwrap_or_default(),
            instance: self
                .take("bridge.instance", b.instance)
                .map_or(0, |Count(n)| n),
            instances: self
                .take("bridge.instances", b.instances)
                .map_or(1, |Count(n)| n),
            state_dir: self
                .take("bridge.state_dir", b.state_dir)
                .unwrap_or_else(|| "state".into())
                .into(),
            delivery: self
                .take("bridge.delivery", b.delivery)
                .map_or(Delivery::ExactlyOnce, |Parse(v)| v),
            on_identity_change: self
                .take("bridge.on_identity_change", b.on_identity_change)
                .map_or(IdentityPolicy::Stop, |Parse(v)| v),
            unreachable_timeout: self
                .take("bridge.unreachable_timeout", b.unreachable_timeout)
                .map_or(DEFAULT_UNREACHABLE_TIMEOUT, |HumanDuration(d)| d),
        };
        let source = SourceConfig {
            bootstrap_servers: self
                .take("source.bootstrap_servers", s.bootstrap_servers)
                .unwrap_or_default(),
            topics: self
                .take("source.topics", s.topics)
                .map_or_else(Vec::new, |TopicList(t)| t),
            topic_pattern: self.take("source.topic_pattern", s.topic_pattern),
            start: self
                .take("source.start", s.start)
                .map_or(StartPosition::Earliest, |Parse(v)| v),
            on_offset_out_of_range: self
                .take("source.on_offset_out_of_range", s.on_offset_out_of_range)
                .map_or(OutOfRange::Fail, |Parse(v)| v),
            kafka: source_kafka,
        };
        let sink_servers = self.take("sink.bootstrap_servers", k.bootstrap_servers);
        let mut sink = SinkConfig {
            bootstrap_servers: sink_servers.unwrap_or_else(|| source.bootstrap_servers.clone()),
            topic: self
                .take("sink.topic", k.topic)
                .unwrap_or_else(|| SOURCE_TOPIC_PLACEHOLDER.to_string()),
            partitioning: self
                .take("sink.partitioning", k.partitioning)
                .map_or(Partitioning::Preserve, |Parse(v)| v),
            marker_topic: self
                .take("sink.marker_topic", k.marker_topic)
                .unwrap_or_else(|| default_marker_topic(&bridge.id)),
            on_bad_record: self
                .take("sink.on_bad_record", k.on_bad_record)
                .map_or(OnBadRecord::Stop, |Parse(v)| v),
            dead_letter_topic: DEFAULT_DEAD_LETTER_TOPIC.to_string(),
            max_in_flight_bytes: self
                .take("sink.max_in_flight_bytes", k.max_in_flight_bytes)
                .map_or(DEFAULT_MAX_IN_FLIGHT_BYTES, |Count(n)| n),
            kafka: sink_kafka,
        };
        if let Some(topic) = self.take("sink.dead_letter_topic", k.dead_letter_topic) {
            // Only here is it known whether the key was written: a dead-letter topic that is never
            // used is a half-finished configuration, not something to ignore.
            if sink.on_bad_record != OnBadRecord::DeadLetter && self.usable(&["sink.on_bad_record"])
            {
                self.fail(
                    "sink.dead_letter_topic",
                    format!(
                        r#"{topic:?} is set but sink.on_bad_record is "{}", which never writes to it: set on_bad_record = "dead-letter" in [sink], or remove dead_letter_topic"#,
                        sink.on_bad_record
                    ),
                );
            }
            sink.dead_letter_topic = topic;
        }
        let dc = CheckpointConfig::default();
        let checkpoint = CheckpointConfig {
            interval: self
                .take("checkpoint.interval", c.interval)
                .map_or(dc.interval, |HumanDuration(v)| v),
            min_pause: self
                .take("checkpoint.min_pause", c.min_pause)
                .map_or(dc.min_pause, |HumanDuration(v)| v),
            timeout: self
                .take("checkpoint.timeout", c.timeout)
                .map_or(dc.timeout, |HumanDuration(v)| v),
            retain: self
                .take("checkpoint.retain", c.retain)
                .map_or(dc.retain, |Count(n)| n),
            max_bytes: self
                .take("checkpoint.max_bytes", c.max_bytes)
                .map_or(dc.max_bytes, |Count(n)| n),
        };
        let transaction = TransactionConfig {
            timeout: self
                .take("transaction.timeout", t.timeout)
                .map_or(TransactionConfig::default().timeout, |HumanDuration(v)| v),
        };
        let api = ApiConfig {
            listen: self
                .take("api.listen", a.listen)
                .map_or(ApiConfig::default().listen, |Parse(ListenAddr(v))| v),
            admin_token: self.take("api.admin_token", a.admin_token).map(Secret),
            ready_max_age: self
                .take("api.ready_max_age", a.ready_max_age)
                .map(|HumanDuration(v)| v),
        };
        let shutdown = ShutdownConfig {
            timeout: self
                .take("shutdown.timeout", d.timeout)
                .map_or(ShutdownConfig::default().timeout, |HumanDuration(v)| v),
        };
        Config {
            bridge,
            source,
            sink,
            checkpoint,
            transaction,
            api,
            shutdown,
        }
    }

    fn validate(&mut self, c: &Config) {
        self.validate_bridge(&c.bridge);
        self.validate_source(&c.source);
        self.validate_sink(c);
        self.validate_dead_letter(c);
        self.validate_timeouts(c);
        self.validate_passthrough(c);
        if let Some(token) = &c.api.admin_token {
            if token.expose().is_empty() {
                self.fail(
                    "api.admin_token",
                    "is empty: set a long random token, or leave the key out",
                );
            }
        }
        if c.api.ready_max_age == Some(Duration::ZERO) && self.usable(&["api.ready_max_age"]) {
            self.fail(
                "api.ready_max_age",
                format!(
                    r#""0s" would never report ready: leave it out for the default ({}) or {DURATION_EXAMPLES}"#,
                    show(c.checkpoint.default_ready_max_age())
                ),
            );
        }
        if c.bridge.unreachable_timeout.is_zero() && self.usable(&["bridge.unreachable_timeout"]) {
            self.fail(
                "bridge.unreachable_timeout",
                r#""0s" would stop at the first refused connection: use e.g. "5m" (the default)"#,
            );
        }
        if c.shutdown.timeout.is_zero() && self.usable(&["shutdown.timeout"]) {
            self.fail(
                "shutdown.timeout",
                r#""0s" leaves no time to finish the last checkpoint: use e.g. "30s""#,
            );
        }
    }

    fn validate_bridge(&mut self, b: &BridgeConfig) {
        if self.usable(&["bridge.id"]) {
            if b.id.is_empty() {
                self.fail(
                    "bridge.id",
                    r#"is required: name the bridge, e.g. id = "orders-mirror" in [bridge] or EOS_BRIDGE__BRIDGE__ID=orders-mirror; it keys the transactional id and the commit markers, so keep it stable"#,
                );
            } else if !b
                .id
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-'))
            {
                self.fail(
                    "bridge.id",
                    format!(
                        "{:?} may only hold letters, digits, '.', '_' and '-' (it becomes part of the transactional id): e.g. {:?}",
                        b.id,
                        b.id.chars()
                            .map(|ch| if ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_') { ch } else { '-' })
                            .collect::<String>()
                    ),
                );
            }
        }
        if self.usable(&["bridge.instances"]) && b.instances == 0 {
            self.fail(
                "bridge.instances",
                "0: a bridge runs as at least one instance; use 1 or more",
            );
        } else if self.usable(&["bridge.instance", "bridge.instances"]) && b.instance >= b.instances
        {
            self.fail(
                "bridge.instance",
                format!(
                    "{} is out of range for bridge.instances = {}: instances are numbered 0 to {}; use one of those numbers or raise bridge.instances",
                    b.instance,
                    b.instances,
                    b.instances - 1
                ),
            );
        }
        if self.usable(&["bridge.state_dir"]) && b.state_dir.as_os_str().is_empty() {
            self.fail(
                "bridge.state_dir",
                r#"is empty: name the directory that holds this instance's checkpoints, e.g. "state""#,
            );
        }
    }

    fn validate_source(&mut self, s: &SourceConfig) {
        self.check_servers("source.bootstrap_servers", &s.bootstrap_servers);
        if self.usable(&["source.topic_pattern"]) {
            if let Some(Err(e)) = s.topic_pattern.as_deref().map(anchored) {
                self.fail(
                    "source.topic_pattern",
                    format!(
                        "{:?} is not a valid regular expression ({}): fix the syntax; it must match whole topic names",
                        s.topic_pattern.as_deref().unwrap_or_default(),
                        regex_reason(&e)
                    ),
                );
            }
        }
        if self.usable(&["source.topics"]) {
            for topic in &s.topics {
                if let Err(why) = check_topic_name(topic) {
                    self.fail(
                        "source.topics",
                        format!("{topic:?} {why}: fix the topic's name"),
                    );
                }
            }
        }
        if !self.usable(&["source.topics", "source.topic_pattern"]) {
            return;
        }
        match (s.topics.is_empty(), &s.topic_pattern) {
            (true, None) => self.fail(
                "source.topics",
                r#"no source topics: set topics = ["orders", "payments"] or topic_pattern = "orders\\..*" in [source]"#,
            ),
            (false, Some(pattern)) => self.fail(
                "source.topic_pattern",
                format!(
                    r#"{pattern:?} is set together with source.topics = {:?}: keep one of them (an empty EOS_BRIDGE__SOURCE__TOPICS="" clears a list set by the file)"#,
                    s.topics
                ),
            ),
            _ => {}
        }
    }

    fn validate_sink(&mut self, c: &Config) {
        let (source, sink) = (&c.source, &c.sink);
        // Unset, the sink's servers are the source's: one error about them is enough.
        if sink.bootstrap_servers != source.bootstrap_servers {
            self.check_servers("sink.bootstrap_servers", &sink.bootstrap_servers);
        }
        let mut topic_ok = self.usable(&["sink.topic"]);
        if topic_ok {
            let sample = c.sink_topic_for("t");
            if let Err(why) = check_topic_name(&sample) {
                topic_ok = false;
                let names = if sample == sink.topic {
                    String::new()
                } else {
                    format!(" gives topic names like {sample:?}, which")
                };
                let placeholder = if sample.contains('{') {
                    format!(" ({SOURCE_TOPIC_PLACEHOLDER} is the only placeholder)")
                } else {
                    String::new()
                };
                self.fail(
                    "sink.topic",
                    format!(
                        r#"{:?}{names} {why}{placeholder}: use e.g. "{SOURCE_TOPIC_PLACEHOLDER}-copy""#,
                        sink.topic
                    ),
                );
            }
        }
        // The default marker topic is made of bridge.id: a bad id is reported there, once.
        let default_marker = sink.marker_topic == default_marker_topic(&c.bridge.id);
        let id_legal = c
            .bridge
            .id
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-'));
        let mut marker_ok = (id_legal || !default_marker) && self.usable(&["sink.marker_topic"]);
        if marker_ok {
            if let Err(why) = check_topic_name(&sink.marker_topic) {
                marker_ok = false;
                self.fail(
                    "sink.marker_topic",
                    format!(
                        "{:?} {why}: leave it unset for the default {:?}",
                        sink.marker_topic,
                        default_marker_topic(&c.bridge.id)
                    ),
                );
            }
        }
        if !self.usable(&[
            "source.topics",
            "source.topic_pattern",
            "source.bootstrap_servers",
            "sink.bootstrap_servers",
        ]) {
            return;
        }
        let listed: &[String] = if source.topic_pattern.is_some() {
            &[]
        } else {
            &source.topics
        };
        let pattern = source
            .topic_pattern
            .as_deref()
            .and_then(|p| anchored(p).ok());
        let constant = !sink.topic.contains(SOURCE_TOPIC_PLACEHOLDER);
        if topic_ok && marker_ok {
            let clash = if constant {
                (sink.topic == sink.marker_topic).then(|| sink.topic.clone())
            } else {
                listed
                    .iter()
                    .map(|t| c.sink_topic_for(t))
                    .find(|t| *t == sink.marker_topic)
            };
            if let Some(topic) = clash {
                self.fail(
                    "sink.marker_topic",
                    format!(
                        "{topic:?} is also a sink topic: commit markers must have a topic of their own; leave it unset for the default {:?}",
                        default_marker_topic(&c.bridge.id)
                    ),
                );
            }
        }
        if !same_cluster(&source.bootstrap_servers, &sink.bootstrap_servers) {
            return;
        }
        // On one cluster, a sink topic that is also a source topic feeds the bridge its own output.
        if topic_ok {
            let fix = format!(
                r#"use e.g. "{SOURCE_TOPIC_PLACEHOLDER}-copy", or a sink.bootstrap_servers of another cluster"#
            );
            if sink.topic == SOURCE_TOPIC_PLACEHOLDER {
                self.fail(
                    "sink.topic",
                    format!(
                        "{:?} writes every topic onto itself, since source and sink are the same cluster ({:?}): {fix}",
                        sink.topic, sink.bootstrap_servers
                    ),
                );
            } else if let Some(topic) = listed
                .iter()
                .find(|t| source.topics.contains(&c.sink_topic_for(t)))
            {
                self.fail(
                    "sink.topic",
                    format!(
                        "{:?} writes source topic {topic:?} to {:?}, which is itself a source topic on the same cluster: the bridge would read its own output; {fix}",
                        sink.topic,
                        c.sink_topic_for(topic)
                    ),
                );
            } else if pattern
                .as_ref()
                .is_some_and(|p| constant && p.is_match(&sink.topic))
            {
                self.fail(
                    "sink.topic",
                    format!(
                        "{:?} is matched by source.topic_pattern {:?} on the same cluster: the bridge would read its own output; narrow the pattern or {fix}",
                        sink.topic,
                        source.topic_pattern.as_deref().unwrap_or_default()
                    ),
                );
            }
        }
        if marker_ok {
            if listed.contains(&sink.marker_topic) {
                self.fail(
                    "source.topics",
                    format!(
                        "{:?} is the marker topic of the same cluster: the bridge would read its own commit markers as data; remove it",
                        sink.marker_topic
                    ),
                );
            } else if pattern
                .as_ref()
                .is_some_and(|p| p.is_match(&sink.marker_topic))
            {
                self.fail(
                    "source.topic_pattern",
                    format!(
                        "{:?} matches the marker topic {:?} of the same cluster: the bridge would read its own commit markers as data; narrow the pattern, e.g. to the topics' common prefix",
                        source.topic_pattern.as_deref().unwrap_or_default(),
                        sink.marker_topic
                    ),
                );
            }
        }
    }

    fn validate_dead_letter(&mut self, c: &Config) {
        let sink = &c.sink;
        if sink.on_bad_record != OnBadRecord::DeadLetter
            || !self.usable(&["sink.on_bad_record", "sink.dead_letter_topic"])
        {
            return;
        }
        if c.bridge.delivery == Delivery::AtMostOnce && self.usable(&["bridge.delivery"]) {
            self.fail(
                "sink.on_bad_record",
                r#""dead-letter" cannot work with bridge.delivery = "at-most-once", which checkpoints past an epoch's records before writing them, so a refused record is never read again to be dead-lettered: use on_bad_record = "stop", or exactly-once or at-least-once delivery"#,
            );
        }
        let sample = c.dead_letter_topic_for("t");
        if let Err(why) = check_topic_name(&sample) {
            let names = if sample == sink.dead_letter_topic {
                String::new()
            } else {
                format!(" gives topic names like {sample:?}, which")
            };
            self.fail(
                "sink.dead_letter_topic",
                format!(
                    r#"{:?}{names} {why}: use e.g. "{DEFAULT_DEAD_LETTER_TOPIC}""#,
                    sink.dead_letter_topic
                ),
            );
            return;
        }
        if !self.usable(&[
            "source.topics",
            "source.topic_pattern",
            "sink.topic",
            "sink.marker_topic",
        ]) {
            return;
        }
        // With listed topics every dead-letter topic is known; with a pattern, only a template
        // without the placeholder (one topic for all) or one identical to another's.
        let listed: &[String] = if c.source.topic_pattern.is_some() {
            &[]
        } else {
            &c.source.topics
        };
        let constant = !sink.dead_letter_topic.contains(SOURCE_TOPIC_PLACEHOLDER);
        let mut pairs: Vec<(String, String)> = listed
            .iter()
            .map(|t| (c.dead_letter_topic_for(t), c.sink_topic_for(t)))
            .collect();
        if listed.is_empty() && (constant || sink.dead_letter_topic == sink.topic) {
            pairs.push((c.dead_letter_topic_for("t"), c.sink_topic_for("t")));
        }
        let fix = format!(r#"use e.g. "{DEFAULT_DEAD_LETTER_TOPIC}""#);
        for (dlq, sink_topic) in &pairs {
            let what = if *dlq == sink.marker_topic {
                "the marker topic"
            } else if dlq == sink_topic {
                "a sink topic"
            } else {
                continue;
            };
            self.fail(
                "sink.dead_letter_topic",
                format!(
                    "{:?} gives {dlq:?}, which is also {what}: dead letters need a topic of their own; {fix}",
                    sink.dead_letter_topic
                ),
            );
            return;
        }
        if !same_cluster(&c.source.bootstrap_servers, &sink.bootstrap_servers) {
            return;
        }
        let pattern = c
            .source
            .topic_pattern
            .as_deref()
            .and_then(|p| anchored(p).ok());
        let read_back = pairs.iter().map(|(dlq, _)| dlq).find(|dlq| {
            listed.contains(dlq)
                || pattern
                    .as_ref()
                    .is_some_and(|p| constant && p.is_match(dlq))
        });
        if let Some(dlq) = read_back {
            self.fail(
                "sink.dead_letter_topic",
                format!(
                    "{:?} gives {dlq:?}, which is a source topic of the same cluster: the bridge would read its own dead letters; {fix}",
                    sink.dead_letter_topic
                ),
            );
        }
    }

    fn validate_timeouts(&mut self, c: &Config) {
        let cp = &c.checkpoint;
        for (key, value) in [
            ("checkpoint.interval", cp.interval),
            ("checkpoint.timeout", cp.timeout),
        ] {
            if value.is_zero() && self.usable(&[key]) {
                self.fail(
                    key,
                    format!(r#""0s" must be longer than zero: {DURATION_EXAMPLES}"#),
                );
            }
        }
        for (key, value, why) in [
            (
                "checkpoint.max_bytes",
                cp.max_bytes,
                "would end every epoch at its first record",
            ),
            (
                "sink.max_in_flight_bytes",
                c.sink.max_in_flight_bytes,
                "would let no record be sent",
            ),
        ] {
            if value == 0 && self.usable(&[key]) {
                self.fail(
                    key,
                    format!("0 {why}: give a number of bytes, such as 16777216 for 16 MiB"),
                );
            }
        }
        if cp.retain == 0 && self.usable(&["checkpoint.retain"]) {
            self.fail(
                "checkpoint.retain",
                "0 would keep no checkpoint to recover from: keep at least 1 (3 by default)",
            );
        }
        let txn = c.transaction.timeout;
        if !self.usable(&["transaction.timeout"]) {
            return;
        }
        if txn.is_zero() {
            self.fail(
                "transaction.timeout",
                format!(r#""0s" must be longer than zero: {DURATION_EXAMPLES}"#),
            );
            return;
        }
        // The rules below concern the transactional producer, which only exactly-once uses.
        if c.bridge.delivery != Delivery::ExactlyOnce || !self.usable(&["bridge.delivery"]) {
            return;
        }
        if txn < MIN_TRANSACTION_TIMEOUT || txn.as_millis() > MAX_KAFKA_MS {
            self.fail(
                "transaction.timeout",
                format!(
                    "{} is outside librdkafka's range for transaction.timeout.ms, 1s to {}: choose a value in it",
                    show(txn),
                    show(Duration::from_millis(MAX_KAFKA_MS as u64))
                ),
            );
            return;
        }
        // The coordinator aborts a transaction left open longer than transaction.timeout.
        if self.usable(&[
            "checkpoint.interval",
            "checkpoint.min_pause",
            "checkpoint.timeout",
        ]) {
            let (epoch_key, epoch) = c.epoch();
            let open = epoch.saturating_add(cp.timeout);
            if open >= txn {
                self.fail(
                    "transaction.timeout",
                    format!(
                        "{} must be longer than {epoch_key} ({}) + checkpoint.timeout ({}) = {}, the longest a transaction stays open, or the brokers abort it before it commits: raise [transaction] timeout above {} (within the sink brokers' transaction.max.timeout.ms, 15m by default) or shorten the checkpoint settings",
                        show(txn),
                        show(epoch),
                        show(cp.timeout),
                        show(open),
                        show(open)
                    ),
                );
            }
        }
        self.check_delivery_timeouts(&c.sink.kafka, txn);
    }

    /// librdkafka refuses a transactional producer whose records or requests may outlive the
    /// transaction; it derives both timeouts from transaction.timeout unless they are set.
    fn check_delivery_timeouts(&mut self, kafka: &KafkaProps, txn: Duration) {
        let set: Vec<&str> = ["message.timeout.ms", "delivery.timeout.ms"]
            .into_iter()
            .filter(|name| kafka.get(name).is_some())
            .collect();
        if set.len() == 2 {
            self.fail(
                "sink.kafka.delivery.timeout.ms",
                "is librdkafka's other name for message.timeout.ms, which is set too: keep one",
            );
        }
        let txn_ms = txn.as_millis();
        for name in set {
            let key = format!("sink.kafka.{name}");
            match self.kafka_ms(&key, kafka.get(name)) {
                Some(0) => self.fail(
                    &key,
                    format!(
                        "0 lets a record wait forever, but its transaction is aborted after transaction.timeout ({}): set at most {txn_ms}, or leave it out to follow transaction.timeout",
                        show(txn)
                    ),
                ),
                Some(ms) if ms > txn_ms => self.fail(
                    &key,
                    format!(
                        "{ms} is above transaction.timeout ({}, {txn_ms} ms): a record could outlive its transaction; set at most {txn_ms}, or leave it out to follow transaction.timeout",
                        show(txn)
                    ),
                ),
                _ => {}
            }
        }
        let key = "sink.kafka.socket.timeout.ms";
        if let Some(ms) = self.kafka_ms(key, kafka.get("socket.timeout.ms")) {
            let limit = txn_ms.saturating_sub(100);
            if ms > limit {
                self.fail(
                    key,
                    format!(
                        "{ms} must be at least 100 ms below transaction.timeout ({}, {txn_ms} ms), so a request can fail and be retried before the transaction times out: set at most {limit}, or leave it out",
                        show(txn)
                    ),
                );
            }
        }
    }

    fn kafka_ms(&mut self, key: &str, value: Option<&str>) -> Option<u128> {
        if !self.usable(&[key]) {
            return None;
        }
        let value = value?;
        match value.trim().parse::<u128>() {
            Ok(ms) => Some(ms),
            Err(_) => {
                self.fail(
                    key,
                    format!("{value:?} is not a whole number of milliseconds: write digits only"),
                );
                None
            }
        }
    }

    /// Properties the bridge sets itself: a passthrough value would fight it or break the guarantee.
    fn validate_passthrough(&mut self, c: &Config) {
        const SINK: &[(&str, &str)] = &[
            (
                "transactional.id",
                "the bridge derives it from bridge.id and bridge.instance",
            ),
            ("transaction.timeout.ms", "use [transaction] timeout"),
            (
                "enable.idempotence",
                "the bridge sets it for the delivery mode; choose bridge.delivery",
            ),
            ("bootstrap.servers", "use sink.bootstrap_servers"),
            ("metadata.broker.list", "use sink.bootstrap_servers"),
        ];
        const SOURCE: &[(&str, &str)] = &[
            ("group.id", "the bridge assigns partitions itself and keeps positions in its checkpoints"),
            ("enable.auto.commit", "positions live in the bridge's checkpoints, never in auto-commits"),
            ("enable.auto.offset.store", "positions live in the bridge's checkpoints"),
            ("isolation.level", "the bridge always reads read_committed, so aborted source records are never bridged"),
            ("auto.offset.reset", "use source.on_offset_out_of_range (and source.start for the first run)"),
            ("bootstrap.servers", "use source.bootstrap_servers"),
            ("metadata.broker.list", "use source.bootstrap_servers"),
        ];
        for (section, props, owned) in [
            ("source", &c.source.kafka, SOURCE),
            ("sink", &c.sink.kafka, SINK),
        ] {
            for (name, instead) in owned {
                if let Some(value) = props.get(name) {
                    let key = format!("{section}.kafka.{name}");
                    self.fail(
                        &key,
                        format!("{value:?}: the bridge sets this property itself, so it may not be passed through; remove it ({instead})"),
                    );
                }
            }
        }
    }

    fn check_servers(&mut self, key: &str, servers: &str) {
        if !self.usable(&[key]) {
            return;
        }
        if servers.trim().is_empty() {
            self.fail(
                key,
                r#"is required: list the cluster's brokers, e.g. "kafka-1:9092,kafka-2:9092""#,
            );
        } else if servers.split(',').any(|s| s.trim().is_empty()) {
            self.fail(
                key,
                format!(r#"{servers:?} has an empty entry: separate brokers with single commas, e.g. "kafka-1:9092,kafka-2:9092""#),
            );
        }
    }
}

fn sorted<V>(map: LayerMap<String, V>) -> BTreeMap<String, V> {
    map.into_iter().collect()
}

fn flatten(prefix: Vec<String>, value: Value, out: &mut Vec<(Vec<String>, Value)>) {
    match value.kind {
        ValueKind::Table(table) => {
            for (key, value) in sorted(table) {
                let mut path = prefix.clone();
                path.push(key);
                flatten(path, value, out);
            }
        }
        _ => out.push((prefix, value)),
    }
}

/// The names of the environment variables that set `value` or anything under it.
fn env_leaves(path: &str, value: &Value, out: &mut Vec<String>) {
    match &value.kind {
        ValueKind::Table(table) => {
            for (key, value) in table.iter().collect::<BTreeMap<_, _>>() {
                env_leaves(&format!("{path}.{key}"), value, out);
            }
        }
        _ if value.origin() == Some(ENV_ORIGIN) => out.push(env_name(path.split('.'))),
        _ => {}
    }
}

fn env_name<'a>(path: impl Iterator<Item = &'a str>) -> String {
    let mut name = ENV_PREFIX.to_string();
    for segment in path {
        name.push_str(ENV_SEPARATOR);
        name.push_str(&segment.to_ascii_uppercase());
    }
    name
}

/// Compiles a topic pattern to match whole names, as Kafka's Java clients do.
fn anchored(pattern: &str) -> Result<Regex, regex::Error> {
    Regex::new(&format!("^(?:{pattern})$"))
}

/// Kafka's rule for topic names; the reason completes "NAME ...".
fn check_topic_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        Err("is empty")
    } else if name == "." || name == ".." {
        Err("is not a legal topic name")
    } else if name.len() > 249 {
        Err("is longer than Kafka's limit of 249 characters")
    } else if !name
        .chars()
        .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-'))
    {
        Err("holds characters Kafka does not allow in topic names (only letters, digits, '.', '_' and '-')")
    } else {
        Ok(())
    }
}

/// Whether two server lists name the same brokers, whatever their order, case or spacing.
fn same_cluster(a: &str, b: &str) -> bool {
    let brokers = |s: &str| -> BTreeSet<String> {
        s.split(',')
            .map(|b| b.trim().to_ascii_lowercase())
            .filter(|b| !b.is_empty())
            .collect()
    };
    brokers(a) == brokers(b)
}

fn show(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// Errors are shown one per line, but TOML's explain over several: the position, a snippet of the
/// file with a caret under the offending text, what is wrong, and the file's name (which the error's
/// key already gives). Keep the position and what is wrong.
fn one_line(text: &str) -> String {
    let mut lines: Vec<&str> = text.lines().collect();
    if lines.len() > 1 && lines.last().is_some_and(|l| l.starts_with(" in ")) {
        lines.pop();
    }
    let snippet = |line: &str| {
        let line = line.trim_start_matches(|ch: char| ch.is_ascii_digit() || ch == ' ');
        line.is_empty() || line.starts_with('|') || line.chars().all(|ch| ch == '^')
    };
    lines
        .into_iter()
        .filter(|l| !snippet(l))
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(": ")
}

/// A regex error ends with what is wrong, after a snippet of the pattern.
fn regex_reason(e: &regex::Error) -> String {
    let text = e.to_string();
    let last = text
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or_default();
    last.strip_prefix("error: ").unwrap_or(last).to_string()
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use proptest::prelude::*;

    use super::*;

    /// Two clusters, so that the default sink topic (the source topic's own name) is legal.
    const BASE: &str = r#"
        [bridge]
        id = "orders-mirror"
        [source]
        bootstrap_servers = "src-1:9092,src-2:9092"
        topics = ["orders"]
        [sink]
        bootstrap_servers = "dst-1:9092"
    "#;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn load(toml: &str, vars: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(toml.as_bytes()).unwrap();
        Config::load(Some(file.path()), &env(vars))
    }

    fn errors(toml: &str, vars: &[(&str, &str)]) -> Vec<ConfigError> {
        match load(toml, vars) {
            Ok(config) => panic!("expected errors, loaded {config:#?}"),
            Err(ConfigErrors(errors)) => errors,
        }
    }

    /// Asserts that loading fails with exactly one error, on `key`, whose message holds every
    /// needle (the value and the fix).
    #[track_caller]
    fn rejects(toml: &str, vars: &[(&str, &str)], key: &str, needles: &[&str]) {
        let errors = errors(toml, vars);
        assert_eq!(
            errors.len(),
            1,
            "one error expected for {key}, got {errors:#?}"
        );
        assert_eq!(errors[0].key, key, "{errors:#?}");
        for needle in needles {
            assert!(
                errors[0].message.contains(needle),
                "{:?} lacks {needle:?}",
                errors[0].message
            );
        }
    }

    fn repo_file(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("config")
            .join(name)
    }

    #[test]
    fn example_file_loads() {
        let config = Config::load(Some(&repo_file("eos-bridge.toml")), &HashMap::new())
            .unwrap_or_else(|e| panic!("config/eos-bridge.toml:\n{e}"));
        assert_eq!(config.bridge.delivery, Delivery::ExactlyOnce);
        assert!(!config.source.kafka.is_empty() && !config.sink.kafka.is_empty());
    }

    #[test]
    fn example_file_documents_every_key() {
        let text = std::fs::read_to_string(repo_file("eos-bridge.toml")).unwrap();
        let lines: Vec<&str> = text.lines().map(|l| l.trim_start_matches("# ")).collect();
        for &section in field_names::<RawConfig>() {
            let (keys, has_kafka) = section_keys(section).unwrap();
            let start = lines
                .iter()
                .position(|l| *l == format!("[{section}]"))
                .unwrap_or_else(|| panic!("[{section}] missing"));
            let body = lines[start + 1..]
                .iter()
                .take_while(|l| !l.starts_with('[') || l.starts_with(&format!("[{section}.")));
            let body: Vec<&str> = body.copied().collect();
            for key in keys {
                let set = format!("{key} = ");
                assert!(
                    body.iter().any(|l| l.starts_with(&set)),
                    "{section}.{key} missing"
                );
            }
            if has_kafka {
                assert!(
                    text.contains(&format!("[{section}.kafka]")),
                    "[{section}.kafka] missing"
                );
            }
        }
    }

    #[test]
    fn quickstart_file_loads() {
        let config = Config::load(Some(&repo_file("quickstart.toml")), &HashMap::new())
            .unwrap_or_else(|e| panic!("config/quickstart.toml:\n{e}"));
        assert_eq!(config.bridge.id, "quickstart");
        assert_eq!(config.source.bootstrap_servers, "127.0.0.1:19092");
        assert_eq!(config.sink.bootstrap_servers, "127.0.0.1:19092");
        assert_eq!(config.source.topics, ["demo-in"]);
        assert_eq!(config.sink_topic_for("demo-in"), "demo-out");
        assert_eq!(
            config.bridge.state_dir,
            Path::new(".cache/quickstart/state")
        );
        assert_eq!(config.checkpoint.interval, Duration::from_secs(1));
        assert_eq!(config.api.listen, "127.0.0.1:8080".parse().unwrap());
    }

    #[test]
    fn a_full_file_sets_every_key() {
        let toml = r#"
            [bridge]
            id = "orders.mirror_2"
            instance = 1
            instances = 4
            state_dir = "/var/lib/eos-bridge"
            delivery = "at-least-once"
            on_identity_change = "restart"
            unreachable_timeout = "90s"

            [source]
            bootstrap_servers = "src-1:9092"
            topic_pattern = "orders\\..*"
            start = "timestamp:1700000000000"
            on_offset_out_of_range = "earliest"

            [source.kafka]
            "client.id" = "bridge-source"
            fetch.max.bytes = 1048576

            [sink]
            bootstrap_servers = "dst-1:9092,dst-2:9092"
            topic = "mirror.{source_topic}"
            partitioning = "key"
            marker_topic = "mirror.markers"
            on_bad_record = "dead-letter"
            dead_letter_topic = "mirror.{source_topic}.refused"
            max_in_flight_bytes = 4194304

            [sink.kafka]
            "compression.type" = "zstd"
            linger_ms = 5
            "socket.timeout.ms" = "30000"

            [checkpoint]
            interval = "2s"
            min_pause = "500ms"
            timeout = "20s"
            retain = 5
            max_bytes = 33554432

            [transaction]
            timeout = "2m"

            [api]
            listen = "0.0.0.0:9090"
            admin_token = "s3cret"
            ready_max_age = "90s"

            [shutdown]
            timeout = "45s"
        "#;
        let config = load(toml, &[]).unwrap();
        let expected = Config {
            bridge: BridgeConfig {
                id: "orders.mirror_2".into(),
                instance: 1,
                instances: 4,
                state_dir: "/var/lib/eos-bridge".into(),
                delivery: Delivery::AtLeastOnce,
                on_identity_change: IdentityPolicy::Restart,
                unreachable_timeout: Duration::from_secs(90),
            },
            source: SourceConfig {
                bootstrap_servers: "src-1:9092".into(),
                topics: vec![],
                topic_pattern: Some(r"orders\..*".into()),
                start: StartPosition::Timestamp(1_700_000_000_000),
                on_offset_out_of_range: OutOfRange::Earliest,
                kafka: [
                    ("client.id", "bridge-source"),
                    ("fetch.max.bytes", "1048576"),
                ]
                .into_iter()
                .collect(),
            },
            sink: SinkConfig {
                bootstrap_servers: "dst-1:9092,dst-2:9092".into(),
                topic: "mirror.{source_topic}".into(),
                partitioning: Partitioning::Key,
                marker_topic: "mirror.markers".into(),
                on_bad_record: OnBadRecord::DeadLetter,
                dead_letter_topic: "mirror.{source_topic}.refused".into(),
                max_in_flight_bytes: 4 * 1024 * 1024,
                kafka: [
                    ("compression.type", "zstd"),
                    ("linger.ms", "5"),
                    ("socket.timeout.ms", "30000"),
                ]
                .into_iter()
                .collect(),
            },
            checkpoint: CheckpointConfig {
                interval: Duration::from_secs(2),
                min_pause: Duration::from_millis(500),
                timeout: Duration::from_secs(20),
                retain: 5,
                max_bytes: 32 * 1024 * 1024,
            },
            transaction: TransactionConfig {
                timeout: Duration::from_secs(120),
            },
            api: ApiConfig {
                listen: "0.0.0.0:9090".parse().unwrap(),
                admin_token: Some(Secret::new("s3cret")),
                ready_max_age: Some(Duration::from_secs(90)),
            },
            shutdown: ShutdownConfig {
                timeout: Duration::from_secs(45),
            },
        };
        assert_eq!(config, expected);
        assert_eq!(config.api.admin_token.as_ref().unwrap().expose(), "s3cret");
        assert_eq!(config.sink_topic_for("orders.eu"), "mirror.orders.eu");
        assert_eq!(
            config.dead_letter_topic_for("orders.eu"),
            "mirror.orders.eu.refused"
        );
        assert_eq!(config.transactional_id(), "eos-bridge-orders.mirror_2-1");
        assert_eq!(config.ready_max_age(), Duration::from_secs(90));
    }

    #[test]
    fn defaults_fill_every_unset_key() {
        let c = load(BASE, &[]).unwrap();
        assert_eq!(c.bridge.instance, 0);
        assert_eq!(c.bridge.instances, 1);
        assert_eq!(c.bridge.state_dir, Path::new("state"));
        assert_eq!(c.bridge.delivery, Delivery::ExactlyOnce);
        assert_eq!(c.bridge.on_identity_change, IdentityPolicy::Stop);
        assert_eq!(c.source.topic_pattern, None);
        assert_eq!(c.source.start, StartPosition::Earliest);
        assert_eq!(c.source.on_offset_out_of_range, OutOfRange::Fail);
        assert!(c.source.kafka.is_empty());
        assert_eq!(c.sink.topic, "{source_topic}");
        assert_eq!(c.sink.partitioning, Partitioning::Preserve);
        assert_eq!(
            c.sink.marker_topic,
            format!("__eos_bridge_markers.{}", c.bridge.id)
        );
        assert_eq!(c.sink.on_bad_record, OnBadRecord::Stop);
        assert_eq!(c.sink.dead_letter_topic, "{source_topic}.dlq");
        assert_eq!(c.dead_letter_topic_for("orders"), "orders.dlq");
        assert!(c.sink.kafka.is_empty());
        assert_eq!(c.checkpoint, CheckpointConfig::default());
        assert_eq!(c.checkpoint.interval, Duration::from_secs(1));
        assert_eq!(c.checkpoint.min_pause, Duration::ZERO);
        assert_eq!(c.checkpoint.timeout, Duration::from_secs(30));
        assert_eq!(c.checkpoint.retain, 3);
        assert_eq!(c.checkpoint.max_bytes, 64 * 1024 * 1024);
        assert_eq!(c.sink.max_in_flight_bytes, 16 * 1024 * 1024);
        assert_eq!(c.transaction.timeout, Duration::from_secs(60));
        assert_eq!(c.api.listen, SocketAddr::from(([127, 0, 0, 1], 8080)));
        assert_eq!(c.api.admin_token, None);
        assert_eq!(c.api.ready_max_age, None);
        assert_eq!(c.shutdown.timeout, Duration::from_secs(30));
        // 3 x interval + checkpoint timeout.
        assert_eq!(c.ready_max_age(), Duration::from_secs(33));
        assert_eq!(c.transactional_id(), "eos-bridge-orders-mirror-0");
    }

    #[test]
    fn sink_servers_default_to_the_source_cluster() {
        let toml = BASE.replace(
            "bootstrap_servers = \"dst-1:9092\"",
            "topic = \"{source_topic}-copy\"",
        );
        let c = load(&toml, &[]).unwrap();
        assert_eq!(c.sink.bootstrap_servers, "src-1:9092,src-2:9092");
    }

    #[test]
    fn the_environment_alone_is_enough() {
        let vars = env(&[
            ("EOS_BRIDGE__BRIDGE__ID", "from-env"),
            ("EOS_BRIDGE__SOURCE__BOOTSTRAP_SERVERS", "k:9092"),
            ("EOS_BRIDGE__SOURCE__TOPICS", "a"),
            ("EOS_BRIDGE__SINK__TOPIC", "{source_topic}.copy"),
            ("UNRELATED", "ignored"),
        ]);
        let c = Config::load(None, &vars).unwrap();
        assert_eq!(c.bridge.id, "from-env");
        assert_eq!(c.sink_topic_for("a"), "a.copy");
    }

    /// The prefix/separator pair: `EOS_BRIDGE` + `__` + `SECTION` + `__` + `KEY`. A wrong pair is
    /// not an error for the `config` crate, it just never matches: this pins the one that works.
    #[test]
    fn environment_names_are_prefix_double_underscore_section_double_underscore_key() {
        let c = load(
            BASE,
            &[("EOS_BRIDGE__SOURCE__BOOTSTRAP_SERVERS", "env:9092")],
        )
        .unwrap();
        assert_eq!(c.source.bootstrap_servers, "env:9092");
        // Case does not matter: the crate lower-cases the names.
        let c = load(
            BASE,
            &[("eos_bridge__source__bootstrap_servers", "lower:9092")],
        )
        .unwrap();
        assert_eq!(c.source.bootstrap_servers, "lower:9092");
        // Other separators are not ours, and go unseen.
        for name in [
            "EOS_BRIDGE_SOURCE__BOOTSTRAP_SERVERS",
            "EOS_BRIDGE_SOURCE_BOOTSTRAP_SERVERS",
            "EOSBRIDGE__SOURCE__BOOTSTRAP_SERVERS",
        ] {
            let c = load(BASE, &[(name, "other:9092")]).unwrap();
            assert_eq!(
                c.source.bootstrap_servers, "src-1:9092,src-2:9092",
                "{name}"
            );
        }
        assert_eq!(
            env_name("sink.kafka.sasl_password".split('.')),
            "EOS_BRIDGE__SINK__KAFKA__SASL_PASSWORD"
        );
    }

    #[test]
    fn environment_overrides_parse_every_kind_of_value() {
        let c = load(
            BASE,
            &[
                ("EOS_BRIDGE__SINK__TOPIC", "copy.{source_topic}"),
                ("EOS_BRIDGE__BRIDGE__INSTANCE", "2"),
                ("EOS_BRIDGE__BRIDGE__INSTANCES", " 3 "),
                ("EOS_BRIDGE__BRIDGE__DELIVERY", "at-most-once"),
                ("EOS_BRIDGE__BRIDGE__ID", "007"),
                ("EOS_BRIDGE__CHECKPOINT__RETAIN", "10"),
                ("EOS_BRIDGE__SOURCE__TOPICS", "a, b,c,"),
                ("EOS_BRIDGE__SOURCE__START", "latest"),
                ("EOS_BRIDGE__CHECKPOINT__INTERVAL", "250ms"),
                ("EOS_BRIDGE__TRANSACTION__TIMEOUT", "2m"),
                ("EOS_BRIDGE__API__LISTEN", "0.0.0.0:9000"),
                ("EOS_BRIDGE__API__ADMIN_TOKEN", "tok"),
                ("EOS_BRIDGE__SINK__KAFKA__SASL_PASSWORD", "pw"),
                ("EOS_BRIDGE__SOURCE__KAFKA__SECURITY_PROTOCOL", "SASL_SSL"),
            ],
        )
        .unwrap();
        assert_eq!(c.sink.topic, "copy.{source_topic}");
        assert_eq!((c.bridge.instance, c.bridge.instances), (2, 3));
        assert_eq!(c.bridge.delivery, Delivery::AtMostOnce);
        // A string stays a string: no "007" -> 7.
        assert_eq!(c.bridge.id, "007");
        assert_eq!(c.checkpoint.retain, 10);
        assert_eq!(c.source.topics, ["a", "b", "c"]);
        assert_eq!(c.source.start, StartPosition::Latest);
        assert_eq!(c.checkpoint.interval, Duration::from_millis(250));
        assert_eq!(c.transaction.timeout, Duration::from_secs(120));
        assert_eq!(c.api.listen, "0.0.0.0:9000".parse().unwrap());
        assert_eq!(c.api.admin_token.as_ref().map(Secret::expose), Some("tok"));
        assert_eq!(c.sink.kafka.get("sasl.password"), Some("pw"));
        assert_eq!(c.source.kafka.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(c.sink.kafka.len(), 1);
    }

    #[test]
    fn the_environment_wins_over_the_file() {
        let toml = format!(
            "{BASE}\n[checkpoint]\ninterval = \"5s\"\n[sink.kafka]\n\"sasl.password\" = \"from-file\"\nsasl.username = \"user\"\n"
        );
        let c = load(&toml, &[]).unwrap();
        assert_eq!(c.checkpoint.interval, Duration::from_secs(5));
        assert_eq!(c.sink.kafka.get("sasl.password"), Some("from-file"));
        assert_eq!(c.sink.kafka.get("sasl.username"), Some("user"));

        let c = load(
            &toml,
            &[
                ("EOS_BRIDGE__CHECKPOINT__INTERVAL", "2s"),
                ("EOS_BRIDGE__SINK__KAFKA__SASL_PASSWORD", "from-env"),
                ("EOS_BRIDGE__SINK__KAFKA__SASL__USERNAME", "env-user"),
                // A pattern from the environment replaces the file's list, once the list is cleared.
                ("EOS_BRIDGE__SOURCE__TOPICS", ""),
                ("EOS_BRIDGE__SOURCE__TOPIC_PATTERN", "orders-.*"),
            ],
        )
        .unwrap();
        assert_eq!(c.checkpoint.interval, Duration::from_secs(2));
        assert_eq!(c.sink.kafka.get("sasl.password"), Some("from-env"));
        assert_eq!(c.sink.kafka.get("sasl.username"), Some("env-user"));
        assert_eq!(c.sink.kafka.len(), 2);
        assert!(c.source.topics.is_empty());
        assert_eq!(c.source.topic_pattern.as_deref(), Some("orders-.*"));
    }

    #[test]
    fn a_misspelled_key_in_the_file_is_rejected_by_name() {
        let toml = BASE.replace("topics = ", "topic = ");
        let errors = errors(&toml, &[]);
        let error = errors
            .iter()
            .find(|e| e.key == "source.topic")
            .expect("source.topic named");
        assert!(error.message.contains("unknown key"), "{error}");
        assert!(
            error.message.contains("topics"),
            "lists the accepted keys: {error}"
        );

        rejects(
            &format!("{BASE}\n[checkpoints]\nretain = 3\n"),
            &[],
            "checkpoints",
            &["unknown key", "checkpoint"],
        );
        rejects(
            &format!("{BASE}\n[bridge.kafka]\n\"a.b\" = 1\n"),
            &[],
            "bridge.kafka",
            &["unknown key"],
        );
    }

    #[test]
    fn a_misspelled_key_in_the_environment_is_rejected_by_name() {
        rejects(
            BASE,
            &[("EOS_BRIDGE__CHECKPOINT__INTERVALL", "1s")],
            "checkpoint.intervall",
            &[
                "unknown key",
                "EOS_BRIDGE__CHECKPOINT__INTERVALL",
                "interval",
            ],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__LOG_LEVEL", "debug")],
            "log_level",
            &["EOS_BRIDGE__LOG_LEVEL", "bridge"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SINK", "x")],
            "sink",
            &["expected a table", "EOS_BRIDGE__SINK"],
        );
    }

    #[test]
    fn every_error_is_reported_at_once() {
        let toml = r#"
            [source]
            bootstrap_servers = "k:9092"
            topics = ["a"]
            [sink]
            topic = "{source_topic}-copy"
            [checkpoint]
            interval = "soon"
            [api]
            listen = "nowhere"
        "#;
        let three = errors(toml, &[]);
        let keys: Vec<&str> = three.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys.len(), 3, "{three:#?}");
        for key in ["bridge.id", "checkpoint.interval", "api.listen"] {
            assert!(keys.contains(&key), "{key} missing from {three:#?}");
        }

        // Unknown keys, bad values and broken rules, from both layers, all in one report.
        let errors = errors(
            &BASE.replace("topics = ", "topicz = "),
            &[
                ("EOS_BRIDGE__BRIDGE__INSTANCE", "one"),
                ("EOS_BRIDGE__CHECKPOINT__RETAIN", "0"),
                ("EOS_BRIDGE__SHUTDOWN__TIMEOUT", "0s"),
            ],
        );
        let keys: BTreeSet<&str> = errors.iter().map(|e| e.key.as_str()).collect();
        let expected: BTreeSet<&str> = [
            "source.topicz",
            "source.topics",
            "bridge.instance",
            "checkpoint.retain",
            "shutdown.timeout",
        ]
        .into();
        assert_eq!(keys, expected, "{errors:#?}");
        let shown = ConfigErrors(errors).to_string();
        assert_eq!(shown.lines().count(), 5, "one error per line:\n{shown}");
    }

    #[test]
    fn a_bad_value_is_not_judged_again_on_its_default() {
        // The interval did not parse: the timeout rule must not report the 1s stand-in.
        rejects(
            BASE,
            &[
                ("EOS_BRIDGE__CHECKPOINT__INTERVAL", "1 fortnight"),
                ("EOS_BRIDGE__CHECKPOINT__TIMEOUT", "1m"),
            ],
            "checkpoint.interval",
            &[
                "\"1 fortnight\"",
                "\"500ms\"",
                "EOS_BRIDGE__CHECKPOINT__INTERVAL",
            ],
        );
    }

    #[test]
    fn bridge_rules() {
        rejects(
            &BASE.replace("id = \"orders-mirror\"", ""),
            &[],
            "bridge.id",
            &["required", "EOS_BRIDGE__BRIDGE__ID"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__BRIDGE__ID", "")],
            "bridge.id",
            &["required"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__BRIDGE__ID", "orders mirror/eu")],
            "bridge.id",
            &["\"orders mirror/eu\"", "\"orders-mirror-eu\""],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__BRIDGE__INSTANCES", "0")],
            "bridge.instances",
            &["0", "1 or more"],
        );
        rejects(
            BASE,
            &[
                ("EOS_BRIDGE__BRIDGE__INSTANCE", "2"),
                ("EOS_BRIDGE__BRIDGE__INSTANCES", "2"),
            ],
            "bridge.instance",
            &["2", "0 to 1"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__BRIDGE__INSTANCE", "yes")],
            "bridge.instance",
            &["\"yes\"", "whole number"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__BRIDGE__INSTANCE", "-1")],
            "bridge.instance",
            &["\"-1\"", "whole number"],
        );
        rejects(
            &BASE.replace("[bridge]", "[bridge]\ninstance = -1"),
            &[],
            "bridge.instance",
            &["-1", "negative"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__BRIDGE__INSTANCES", "4294967296")],
            "bridge.instances",
            &["4294967296", "too large"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__BRIDGE__STATE_DIR", "")],
            "bridge.state_dir",
            &["empty"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__BRIDGE__DELIVERY", "exactly_once")],
            "bridge.delivery",
            &[
                "\"exactly_once\"",
                "\"exactly-once\"",
                "\"at-least-once\"",
                "\"at-most-once\"",
            ],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__BRIDGE__ON_IDENTITY_CHANGE", "continue")],
            "bridge.on_identity_change",
            &["\"continue\"", "\"stop\"", "\"restart\""],
        );
        let c = load(
            BASE,
            &[("EOS_BRIDGE__BRIDGE__ON_IDENTITY_CHANGE", "restart")],
        )
        .unwrap();
        assert_eq!(c.bridge.on_identity_change, IdentityPolicy::Restart);
    }

    #[test]
    fn source_rules() {
        rejects(
            BASE,
            &[("EOS_BRIDGE__SOURCE__TOPIC_PATTERN", "orders.*")],
            "source.topic_pattern",
            &["\"orders.*\"", "source.topics", "keep one"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SOURCE__TOPICS", "")],
            "source.topics",
            &["topic_pattern"],
        );
        rejects(
            &BASE.replace("[\"orders\"]", "[]"),
            &[],
            "source.topics",
            &["no source topics"],
        );
        rejects(
            BASE,
            &[
                ("EOS_BRIDGE__SOURCE__TOPICS", ""),
                ("EOS_BRIDGE__SOURCE__TOPIC_PATTERN", "orders("),
            ],
            "source.topic_pattern",
            &["\"orders(\"", "not a valid regular expression"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SOURCE__TOPICS", "ok,not ok")],
            "source.topics",
            &["\"not ok\"", "characters"],
        );
        rejects(
            &BASE.replace("[\"orders\"]", "[\"orders\", { a = 1 }]"),
            &[],
            "source.topics",
            &["[1]"],
        );
        // A string is a comma-separated list in the file too.
        let c = load(&BASE.replace("[\"orders\"]", "\"orders, payments\""), &[]).unwrap();
        assert_eq!(c.source.topics, ["orders", "payments"]);
        rejects(
            BASE,
            &[("EOS_BRIDGE__SOURCE__BOOTSTRAP_SERVERS", " ")],
            "source.bootstrap_servers",
            &["required"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SOURCE__BOOTSTRAP_SERVERS", "a:1,,b:2")],
            "source.bootstrap_servers",
            &["\"a:1,,b:2\"", "empty entry"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SOURCE__START", "yesterday")],
            "source.start",
            &["\"yesterday\"", "timestamp:"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SOURCE__START", "timestamp:-1")],
            "source.start",
            &["\"timestamp:-1\"", "non-negative"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SOURCE__START", "timestamp:noon")],
            "source.start",
            &["\"timestamp:noon\""],
        );
        let c = load(BASE, &[("EOS_BRIDGE__SOURCE__START", "timestamp:0")]).unwrap();
        assert_eq!(c.source.start, StartPosition::Timestamp(0));
        rejects(
            BASE,
            &[("EOS_BRIDGE__SOURCE__ON_OFFSET_OUT_OF_RANGE", "latest")],
            "source.on_offset_out_of_range",
            &["\"latest\"", "\"fail\"", "\"earliest\""],
        );
    }

    #[test]
    fn sink_rules() {
        rejects(
            BASE,
            &[("EOS_BRIDGE__SINK__BOOTSTRAP_SERVERS", "")],
            "sink.bootstrap_servers",
            &["required"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SINK__PARTITIONING", "random")],
            "sink.partitioning",
            &["\"random\"", "\"preserve\"", "\"key\""],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SINK__TOPIC", "{topic}-copy")],
            "sink.topic",
            &[
                "\"{topic}-copy\"",
                "only placeholder",
                "{source_topic}-copy",
            ],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SINK__MARKER_TOPIC", "my markers")],
            "sink.marker_topic",
            &["\"my markers\""],
        );
        rejects(
            BASE,
            &[
                ("EOS_BRIDGE__SINK__TOPIC", "all"),
                ("EOS_BRIDGE__SINK__MARKER_TOPIC", "all"),
            ],
            "sink.marker_topic",
            &["\"all\"", "also a sink topic"],
        );
    }

    #[test]
    fn bad_record_rules() {
        let dead_letter = ("EOS_BRIDGE__SINK__ON_BAD_RECORD", "dead-letter");
        rejects(
            BASE,
            &[("EOS_BRIDGE__SINK__ON_BAD_RECORD", "skip")],
            "sink.on_bad_record",
            &["\"skip\"", "\"stop\"", "\"dead-letter\""],
        );
        // A dead-letter topic nothing writes to is a half-done configuration.
        rejects(
            BASE,
            &[("EOS_BRIDGE__SINK__DEAD_LETTER_TOPIC", "refused")],
            "sink.dead_letter_topic",
            &["\"refused\"", "on_bad_record = \"dead-letter\""],
        );
        rejects(
            BASE,
            &[
                dead_letter,
                ("EOS_BRIDGE__BRIDGE__DELIVERY", "at-most-once"),
            ],
            "sink.on_bad_record",
            &["at-most-once", "\"stop\""],
        );
        rejects(
            BASE,
            &[
                dead_letter,
                ("EOS_BRIDGE__SINK__DEAD_LETTER_TOPIC", "{topic}.dlq"),
            ],
            "sink.dead_letter_topic",
            &["\"{topic}.dlq\"", "{source_topic}.dlq"],
        );
        rejects(
            BASE,
            &[
                dead_letter,
                ("EOS_BRIDGE__SINK__DEAD_LETTER_TOPIC", "{source_topic}"),
            ],
            "sink.dead_letter_topic",
            &["\"orders\"", "a sink topic"],
        );
        rejects(
            BASE,
            &[
                dead_letter,
                (
                    "EOS_BRIDGE__SINK__DEAD_LETTER_TOPIC",
                    "__eos_bridge_markers.orders-mirror",
                ),
            ],
            "sink.dead_letter_topic",
            &["the marker topic"],
        );
        let one_cluster = (
            "EOS_BRIDGE__SINK__BOOTSTRAP_SERVERS",
            "src-1:9092,src-2:9092",
        );
        let copy = ("EOS_BRIDGE__SINK__TOPIC", "{source_topic}-copy");
        rejects(
            &BASE.replace(
                r#"topics = ["orders"]"#,
                r#"topics = ["orders", "orders.dlq"]"#,
            ),
            &[dead_letter, one_cluster, copy],
            "sink.dead_letter_topic",
            &["\"orders.dlq\"", "read its own dead letters"],
        );
        rejects(
            &BASE.replace(r#"topics = ["orders"]"#, r#"topic_pattern = "orders.*""#),
            &[
                dead_letter,
                one_cluster,
                copy,
                ("EOS_BRIDGE__SINK__DEAD_LETTER_TOPIC", "orders-refused"),
            ],
            "sink.dead_letter_topic",
            &["\"orders-refused\"", "read its own dead letters"],
        );
        // Accepted: the default template, on another cluster or the same one.
        let c = load(BASE, &[dead_letter]).unwrap();
        assert_eq!(c.sink.on_bad_record, OnBadRecord::DeadLetter);
        assert_eq!(c.dead_letter_topic_for("orders"), "orders.dlq");
        load(BASE, &[dead_letter, one_cluster, copy]).unwrap();
    }

    #[test]
    fn a_topic_may_not_be_written_onto_itself_on_one_cluster() {
        let one_cluster = [(
            "EOS_BRIDGE__SINK__BOOTSTRAP_SERVERS",
            "SRC-2:9092, src-1:9092",
        )];
        rejects(
            BASE,
            &one_cluster,
            "sink.topic",
            &[
                "\"{source_topic}\"",
                "onto itself",
                "\"{source_topic}-copy\"",
            ],
        );
        let unset = BASE.replace("bootstrap_servers = \"dst-1:9092\"", "");
        rejects(&unset, &[], "sink.topic", &["onto itself"]);
        // Another cluster may hold topics of the same names.
        assert!(load(BASE, &[]).is_ok());

        rejects(
            &unset,
            &[
                ("EOS_BRIDGE__SOURCE__TOPICS", "a,a-copy"),
                ("EOS_BRIDGE__SINK__TOPIC", "{source_topic}-copy"),
            ],
            "sink.topic",
            &["\"a\"", "\"a-copy\"", "its own output"],
        );
        rejects(
            &unset,
            &[
                ("EOS_BRIDGE__SOURCE__TOPICS", ""),
                ("EOS_BRIDGE__SOURCE__TOPIC_PATTERN", "demo.*"),
                ("EOS_BRIDGE__SINK__TOPIC", "demo-out"),
            ],
            "sink.topic",
            &["\"demo-out\"", "\"demo.*\"", "its own output"],
        );
        rejects(
            &unset,
            &[
                ("EOS_BRIDGE__SOURCE__TOPICS", ""),
                ("EOS_BRIDGE__SOURCE__TOPIC_PATTERN", ".*"),
                ("EOS_BRIDGE__SINK__TOPIC", "{source_topic}-copy"),
            ],
            "source.topic_pattern",
            &["\".*\"", "__eos_bridge_markers", "commit markers"],
        );
        rejects(
            &unset,
            &[
                (
                    "EOS_BRIDGE__SOURCE__TOPICS",
                    "a,__eos_bridge_markers.orders-mirror",
                ),
                ("EOS_BRIDGE__SINK__TOPIC", "{source_topic}-copy"),
            ],
            "source.topics",
            &["\"__eos_bridge_markers.orders-mirror\"", "commit markers"],
        );
    }

    #[test]
    fn checkpoint_and_shutdown_rules() {
        rejects(
            BASE,
            &[("EOS_BRIDGE__CHECKPOINT__INTERVAL", "0s")],
            "checkpoint.interval",
            &["\"0s\"", "longer than zero"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__CHECKPOINT__TIMEOUT", "0ms")],
            "checkpoint.timeout",
            &["\"0s\""],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__CHECKPOINT__RETAIN", "0")],
            "checkpoint.retain",
            &["0", "at least 1"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__CHECKPOINT__MIN_PAUSE", "later")],
            "checkpoint.min_pause",
            &["\"later\""],
        );
        rejects(
            &format!("{BASE}\n[checkpoint]\ninterval = 5\n"),
            &[],
            "checkpoint.interval",
            &["5 has no unit", "\"5s\"", "\"5ms\""],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SHUTDOWN__TIMEOUT", "0s")],
            "shutdown.timeout",
            &["\"0s\""],
        );
        for key in ["checkpoint.max_bytes", "sink.max_in_flight_bytes"] {
            let var = format!(
                "EOS_BRIDGE__{}",
                key.to_ascii_uppercase().replace('.', "__")
            );
            rejects(BASE, &[(&var, "0")], key, &["0 would", "bytes"]);
            rejects(
                BASE,
                &[(&var, "16MiB")],
                key,
                &["\"16MiB\"", "whole number"],
            );
        }
        assert!(load(BASE, &[("EOS_BRIDGE__CHECKPOINT__MIN_PAUSE", "0s")]).is_ok());
    }

    #[test]
    fn api_rules() {
        rejects(
            BASE,
            &[("EOS_BRIDGE__API__ADMIN_TOKEN", "")],
            "api.admin_token",
            &["empty"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__API__READY_MAX_AGE", "0s")],
            "api.ready_max_age",
            &["\"0s\"", "33s"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__API__LISTEN", "localhost:8080")],
            "api.listen",
            &["\"localhost:8080\"", "127.0.0.1:8080"],
        );
    }

    #[test]
    fn transactions_must_outlive_an_epoch_and_its_checkpoint() {
        rejects(
            BASE,
            &[("EOS_BRIDGE__CHECKPOINT__TIMEOUT", "59s")],
            "transaction.timeout",
            &[
                "1m",
                "checkpoint.interval (1s)",
                "checkpoint.timeout (59s)",
                "raise [transaction] timeout above 1m",
            ],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__CHECKPOINT__MIN_PAUSE", "40s")],
            "transaction.timeout",
            &["checkpoint.min_pause (40s)", "1m 10s"],
        );
        assert!(load(BASE, &[("EOS_BRIDGE__CHECKPOINT__TIMEOUT", "58s")]).is_ok());
        // Only exactly-once has transactions.
        assert!(load(
            BASE,
            &[
                ("EOS_BRIDGE__CHECKPOINT__TIMEOUT", "2m"),
                ("EOS_BRIDGE__BRIDGE__DELIVERY", "at-least-once")
            ]
        )
        .is_ok());
        rejects(
            BASE,
            &[("EOS_BRIDGE__TRANSACTION__TIMEOUT", "0s")],
            "transaction.timeout",
            &["\"0s\""],
        );
        rejects(
            BASE,
            &[
                ("EOS_BRIDGE__TRANSACTION__TIMEOUT", "900ms"),
                ("EOS_BRIDGE__CHECKPOINT__INTERVAL", "100ms"),
                ("EOS_BRIDGE__CHECKPOINT__TIMEOUT", "100ms"),
            ],
            "transaction.timeout",
            &["900ms", "1s to"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__TRANSACTION__TIMEOUT", "30days")],
            "transaction.timeout",
            &["30days", "1s to 24days"],
        );
    }

    #[test]
    fn librdkafka_timeouts_stay_within_the_transaction() {
        let sink = |name: &str, value: &str| -> Vec<(String, String)> {
            vec![(
                format!(
                    "EOS_BRIDGE__SINK__KAFKA__{}",
                    name.replace('.', "_").to_uppercase()
                ),
                value.to_string(),
            )]
        };
        let run = |vars: Vec<(String, String)>| {
            let vars: Vec<(&str, &str)> =
                vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            load(BASE, &vars)
        };
        assert!(run(sink("message.timeout.ms", "60000")).is_ok());
        assert!(run(sink("socket.timeout.ms", "59900")).is_ok());
        for (name, value, needles) in [
            (
                "message.timeout.ms",
                "60001",
                &["60001", "60000", "transaction.timeout"][..],
            ),
            (
                "delivery.timeout.ms",
                "120000",
                &["120000", "at most 60000"][..],
            ),
            (
                "delivery.timeout.ms",
                "0",
                &["0 lets a record wait forever"][..],
            ),
            (
                "socket.timeout.ms",
                "59901",
                &["59901", "at most 59900"][..],
            ),
            (
                "socket.timeout.ms",
                "1m",
                &["\"1m\"", "whole number of milliseconds"][..],
            ),
        ] {
            let errors = match run(sink(name, value)) {
                Err(ConfigErrors(errors)) => errors,
                Ok(_) => panic!("{name} = {value} accepted"),
            };
            assert_eq!(errors.len(), 1, "{errors:#?}");
            assert_eq!(errors[0].key, format!("sink.kafka.{name}"));
            for needle in needles {
                assert!(
                    errors[0].message.contains(needle),
                    "{:?} lacks {needle:?}",
                    errors[0].message
                );
            }
        }
        let mut both = sink("message.timeout.ms", "1000");
        both.extend(sink("delivery.timeout.ms", "1000"));
        let Err(ConfigErrors(errors)) = run(both) else {
            panic!("both accepted")
        };
        assert_eq!(errors[0].key, "sink.kafka.delivery.timeout.ms");
        // Without transactions librdkafka has no such limit.
        let mut alo = sink("message.timeout.ms", "600000");
        alo.push((
            "EOS_BRIDGE__BRIDGE__DELIVERY".into(),
            "at-least-once".into(),
        ));
        assert!(run(alo).is_ok());
    }

    #[test]
    fn properties_the_bridge_owns_cannot_be_passed_through() {
        for (section, name, instead) in [
            ("sink", "transactional.id", "bridge.id"),
            ("sink", "transaction.timeout.ms", "[transaction] timeout"),
            ("sink", "enable.idempotence", "bridge.delivery"),
            ("sink", "bootstrap.servers", "sink.bootstrap_servers"),
            ("sink", "metadata.broker.list", "sink.bootstrap_servers"),
            ("source", "group.id", "checkpoints"),
            ("source", "enable.auto.commit", "checkpoints"),
            ("source", "enable.auto.offset.store", "checkpoints"),
            ("source", "isolation.level", "read_committed"),
            (
                "source",
                "auto.offset.reset",
                "source.on_offset_out_of_range",
            ),
            ("source", "bootstrap.servers", "source.bootstrap_servers"),
        ] {
            let toml = format!("{BASE}\n[{section}.kafka]\n\"{name}\" = \"x\"\n");
            rejects(
                &toml,
                &[],
                &format!("{section}.kafka.{name}"),
                &["\"x\"", "remove it", instead],
            );
        }
    }

    #[test]
    fn kafka_tables_flatten_and_reject_what_librdkafka_cannot_take() {
        let toml = format!("{BASE}\n[sink.kafka]\nsasl.mechanism = \"PLAIN\"\n\"linger.ms\" = 5\nenable_ssl_certificate_verification = false\n");
        let c = load(&toml, &[]).unwrap();
        let props: Vec<(&str, &str)> = c.sink.kafka.iter().collect();
        assert_eq!(
            props,
            [
                ("enable.ssl.certificate.verification", "false"),
                ("linger.ms", "5"),
                ("sasl.mechanism", "PLAIN")
            ]
        );
        rejects(
            &format!("{BASE}\n[sink.kafka]\n\"sasl.password\" = \"a\"\nsasl_password = \"b\"\n"),
            &[],
            "sink.kafka.sasl.password",
            &["set twice", "keep one"],
        );
        rejects(
            &format!("{BASE}\n[source.kafka]\n\"client.id\" = [\"a\"]\n"),
            &[],
            "source.kafka.client.id",
            &["comma-separated"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__SOURCE__KAFKA", "x")],
            "source.kafka",
            &["table of librdkafka properties"],
        );
    }

    #[test]
    fn the_broker_timeout_rule_names_both_settings() {
        let c = load(BASE, &[("EOS_BRIDGE__TRANSACTION__TIMEOUT", "20m")]).unwrap();
        assert_eq!(c.check_broker_timeout(1_200_000), Ok(()));
        let e = c.check_broker_timeout(900_000).unwrap_err();
        assert_eq!(e.key, "transaction.timeout");
        for needle in [
            "20m",
            "1200000 ms",
            "transaction.max.timeout.ms = 900000",
            "15m",
            "lower [transaction] timeout",
        ] {
            assert!(e.message.contains(needle), "{e} lacks {needle:?}");
        }
        let mut alo = c.clone();
        alo.bridge.delivery = Delivery::AtLeastOnce;
        assert_eq!(alo.check_broker_timeout(900_000), Ok(()));
    }

    #[test]
    fn secrets_never_reach_debug_output() {
        let toml = format!(
            r#"{BASE}
            [api]
            admin_token = "tok-4f1e"
            [sink.kafka]
            "sasl.password" = "pw-8d2a"
            "sasl.jaas.config" = "jaas-77c1"
            "ssl.key.pem" = "pem-19ab"
            "ssl.key.password" = "kpw-5e5e"
            "ssl.keystore.password" = "kspw-2b2b"
            "sasl.oauthbearer.client.secret" = "oauth-6c6c"
            "compression.type" = "zstd"
            "#
        );
        let c = load(
            &toml,
            &[("EOS_BRIDGE__SOURCE__KAFKA__SASL_PASSWORD", "env-pw-3a3a")],
        )
        .unwrap();
        let shown = format!("{c:?} {c:#?}");
        for secret in [
            "tok-4f1e",
            "pw-8d2a",
            "jaas-77c1",
            "pem-19ab",
            "kpw-5e5e",
            "kspw-2b2b",
            "oauth-6c6c",
            "env-pw-3a3a",
        ] {
            assert!(!shown.contains(secret), "{secret} shown in {shown}");
        }
        assert!(shown.contains("zstd") && shown.contains("sasl.password") && shown.contains("***"));
        assert_eq!(format!("{:?}", Secret::new("x")), "***");
        for key in [
            "sasl.password",
            "ssl.key.pem",
            "ssl.keystore.key",
            "sasl.jaas.config",
            "sasl.oauthbearer.client.secret",
        ] {
            assert!(KafkaProps::is_sensitive(key), "{key}");
        }
        for key in [
            "sasl.username",
            "ssl.key.location",
            "compression.type",
            "client.id",
        ] {
            assert!(!KafkaProps::is_sensitive(key), "{key}");
        }
    }

    #[test]
    fn unreadable_files_are_reported_with_their_path() {
        let missing = Path::new("/nonexistent/eos-bridge.toml");
        let ConfigErrors(errors) = Config::load(Some(missing), &HashMap::new()).unwrap_err();
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].key, missing.display().to_string());
        let ConfigErrors(errors) = load("[bridge]\nid = orders\n", &[]).unwrap_err();
        assert_eq!(errors.len(), 1);
        assert!(!errors[0].to_string().contains('\n'), "{}", errors[0]);
        assert!(errors[0].message.contains("line 2"), "{}", errors[0]);
        assert!(
            errors[0].message.contains("quoted"),
            "says what is wrong: {}",
            errors[0]
        );
    }

    #[test]
    fn topic_helpers() {
        let mut c = load(BASE, &[("EOS_BRIDGE__SOURCE__TOPICS", "a,b")]).unwrap();
        let listed = c.source_topic_matcher();
        assert!(listed.matches("a") && listed.matches("b") && !listed.matches("ab"));

        c.source.topics.clear();
        c.source.topic_pattern = Some("orders|payments-.*".into());
        let pattern = c.source_topic_matcher();
        assert!(pattern.matches("orders") && pattern.matches("payments-eu"));
        // Whole names only, as the Java clients match.
        assert!(!pattern.matches("old-orders") && !pattern.matches("orders-x"));

        c.sink.topic = "{source_topic}.{source_topic}-{x}".into();
        assert_eq!(c.sink_topic_for("t"), "t.t-{x}");
    }

    #[test]
    fn validate_checks_a_config_changed_in_code() {
        let mut c = load(BASE, &[]).unwrap();
        assert_eq!(c.validate(), Ok(()));
        c.bridge.instance = 5;
        c.checkpoint.retain = 0;
        let ConfigErrors(errors) = c.validate().unwrap_err();
        let keys: Vec<&str> = errors.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["bridge.instance", "checkpoint.retain"]);
    }

    #[test]
    fn enums_read_back_what_they_show() {
        for d in [
            Delivery::ExactlyOnce,
            Delivery::AtLeastOnce,
            Delivery::AtMostOnce,
        ] {
            assert_eq!(d.as_str().parse::<Delivery>(), Ok(d));
        }
        for p in [Partitioning::Preserve, Partitioning::Key] {
            assert_eq!(p.to_string().parse::<Partitioning>(), Ok(p));
        }
        for o in [OutOfRange::Fail, OutOfRange::Earliest] {
            assert_eq!(o.to_string().parse::<OutOfRange>(), Ok(o));
        }
        for b in [OnBadRecord::Stop, OnBadRecord::DeadLetter] {
            assert_eq!(b.to_string().parse::<OnBadRecord>(), Ok(b));
        }
        for s in [
            StartPosition::Earliest,
            StartPosition::Latest,
            StartPosition::Timestamp(1_700_000_000_000),
        ] {
            assert_eq!(s.to_string().parse::<StartPosition>(), Ok(s));
        }
    }

    #[test]
    fn sections_accept_exactly_their_fields() {
        assert_eq!(
            field_names::<RawConfig>(),
            [
                "bridge",
                "source",
                "sink",
                "checkpoint",
                "transaction",
                "api",
                "shutdown"
            ]
        );
        assert_eq!(
            field_names::<RawSource>(),
            [
                "bootstrap_servers",
                "topics",
                "topic_pattern",
                "start",
                "on_offset_out_of_range"
            ]
        );
        // deny_unknown_fields stays as a second line behind the walk in `Loader::read`.
        let mut table = LayerMap::new();
        table.insert("retian".to_string(), Value::from("3"));
        let raw = Value::new(None, ValueKind::Table(table)).try_deserialize::<RawCheckpoint>();
        assert!(raw.is_err());
    }

    #[test]
    fn from_process_env_reads_this_process() {
        let ours = std::env::vars_os().any(|(k, _)| k.to_str().is_some_and(is_ours));
        let result = Config::from_process_env(Some(&repo_file("quickstart.toml")));
        if !ours {
            assert_eq!(result.unwrap().bridge.id, "quickstart");
        }
    }

    proptest! {
        #[test]
        fn durations_and_counts_survive_the_environment(ms in 1u64..10_000_000, retain in 1usize..100_000) {
            let interval = Duration::from_millis(ms);
            let vars = env(&[
                ("EOS_BRIDGE__BRIDGE__ID", "p"),
                ("EOS_BRIDGE__SOURCE__BOOTSTRAP_SERVERS", "k:9092"),
                ("EOS_BRIDGE__SOURCE__TOPICS", "a"),
                ("EOS_BRIDGE__SINK__TOPIC", "b"),
                ("EOS_BRIDGE__BRIDGE__DELIVERY", "at-least-once"),
                ("EOS_BRIDGE__CHECKPOINT__INTERVAL", &show(interval)),
                ("EOS_BRIDGE__CHECKPOINT__RETAIN", &retain.to_string()),
            ]);
            let c = Config::load(None, &vars).unwrap();
            prop_assert_eq!(c.checkpoint.interval, interval);
            prop_assert_eq!(c.checkpoint.retain, retain);
        }

        #[test]
        fn bridge_ids_are_accepted_exactly_when_their_characters_are(id in "[ -~]{1,20}") {
            let vars = env(&[
                ("EOS_BRIDGE__BRIDGE__ID", &id),
                ("EOS_BRIDGE__SOURCE__BOOTSTRAP_SERVERS", "k:9092"),
                ("EOS_BRIDGE__SOURCE__TOPICS", "a"),
                ("EOS_BRIDGE__SINK__TOPIC", "b"),
            ]);
            let legal = id.chars().all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-'));
            prop_assert_eq!(Config::load(None, &vars).is_ok(), legal);
        }
    }
}
