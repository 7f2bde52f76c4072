//! Settings of the bridge: the configuration contract, its defaults and its validation.
//!
//! This module owns the layout of the TOML file (`config/eos-bridge.toml` documents every key,
//! docs/configuration.md is the reference, environment overrides included), the defaults, and
//! every rule a setting must pass before the daemon starts. [`Config::load`] reports every problem
//! in one go, each naming its key, the value found and the fix, so that a deployment is corrected
//! in one round trip rather than one per mistake. The one rule it cannot check on its own,
//! `transaction.timeout` against the sink brokers' `transaction.max.timeout.ms`, is
//! [`Config::check_broker_timeout`], called at start-up.
//!
//! # Adding a key
//!
//! 1. Add the field to its section's struct, its default as `#[default(..)]`. Strings, paths and
//!    `Option`s need nothing else; durations take `#[serde(with = "humantime_serde")]`, whole
//!    numbers `#[serde(deserialize_with = "count")]` (the environment writes them as text), a
//!    choice of names an enum declared with `named!`.
//! 2. If the value must pass a rule, add it to `RULES` with the keys it reads (it is skipped when
//!    one of them did not parse): a rule on one key as a `rule!` row (key, condition, message), any
//!    other as a small function over `&Config` that returns a [`ConfigError`] for each problem
//!    (key, value found, fix). rustfmt leaves `rule!` rows alone: keep them tidy by hand.
//! 3. Document the key in `config/eos-bridge.toml` (a test checks) and `docs/configuration.md`.
//!
//! Unknown keys, environment overrides (`EOS_BRIDGE__SECTION__KEY`, a `_` standing for a `.` in
//! the librdkafka tables, whose property names only ever contain dots) and the report of every
//! error come with the field.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use ::config::{
    Config as Layers, Environment, File, FileFormat, Map as LayerMap, Source, Value, ValueKind,
};
use regex::Regex;
use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use serde_json::Value as Any;
use smart_default::SmartDefault;
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
/// Where `on_bad_record = "dead-letter"` writes, unless `sink.dead_letter_topic` says otherwise.
pub const DEFAULT_DEAD_LETTER_TOPIC: &str = "{source_topic}.dlq";
/// `offsets.retention` when unset: a day of checkpoints.
pub const DEFAULT_OFFSETS_RETENTION: Duration = Duration::from_secs(24 * 3600);
/// `offsets.max_runs` when unset: about 100 KB of mapping per record.
pub const DEFAULT_OFFSETS_MAX_RUNS: usize = 4096;

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
const MAX_TRANSACTION_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);
const DURATION_EXAMPLES: &str = r#"write it like "500ms", "1s" or "2m""#;
const MIB: u64 = 1024 * 1024;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub bridge: BridgeConfig,
    pub source: SourceConfig,
    pub sink: SinkConfig,
    pub checkpoint: CheckpointConfig,
    pub transaction: TransactionConfig,
    pub api: ApiConfig,
    pub shutdown: ShutdownConfig,
    pub offsets: OffsetsConfig,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct BridgeConfig {
    /// Required: the empty default is reported missing.
    pub id: String,
    #[serde(deserialize_with = "count")]
    pub instance: u32,
    #[serde(deserialize_with = "count")]
    #[default = 1]
    pub instances: u32,
    #[default = "state"]
    pub state_dir: PathBuf,
    pub delivery: Delivery,
    pub on_identity_change: IdentityPolicy,
    /// Long enough for a broker restart or a rolling upgrade, short enough that a wrong address
    /// ends in an exit an orchestrator reports.
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(300))]
    pub unreachable_timeout: Duration,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SourceConfig {
    pub bootstrap_servers: String,
    /// Exactly one of `topics` (non-empty) and `topic_pattern` is set in a validated config.
    #[serde(deserialize_with = "topic_list")]
    pub topics: Vec<String>,
    /// Matched against the whole topic name, like the Java clients' pattern subscription.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic_pattern: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic_exclude: Option<String>,
    pub start: StartPosition,
    pub on_offset_out_of_range: OutOfRange,
    pub kafka: KafkaProps,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct SinkConfig {
    /// The source's servers when not set ([`Config::load`] fills it in).
    pub bootstrap_servers: String,
    #[default(SOURCE_TOPIC_PLACEHOLDER.to_string())]
    pub topic: String,
    pub partitioning: Partitioning,
    /// [`default_marker_topic`] when not set ([`Config::load`] fills it in).
    pub marker_topic: String,
    pub on_bad_record: OnBadRecord,
    #[default(DEFAULT_DEAD_LETTER_TOPIC.to_string())]
    pub dead_letter_topic: String,
    /// At 1 KB / 100 ms, 8 MiB held reading back 13-22 % of its time; a 16 MiB cap drained faster
    /// in 9 of 11 paired rounds (bench/README.md, "Session 37"), but there the producer's
    /// 10,000-record queue stopped 1 KB records at ~10 MB. With the queue at 20,000 (for 100 B,
    /// session 39) 16 MiB would be reached, for 7 MB more peak RSS and longer flushes at no
    /// resolvable gain, so the cap is where the queue held it: 10 MiB. The cost on a slow sink is
    /// at start only: one first flush may time out (a sink below 10 MiB per `checkpoint.timeout`),
    /// and the working limit then follows the sink's measured rate.
    #[serde(deserialize_with = "count")]
    #[default(10 * MIB)]
    pub max_in_flight_bytes: u64,
    #[serde(
        deserialize_with = "count_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub replication_factor: Option<u16>,
    #[serde(deserialize_with = "topic_list")]
    pub topic_config_exclude: Vec<String>,
    pub kafka: KafkaProps,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(1))]
    pub interval: Duration,
    #[serde(with = "humantime_serde")]
    pub min_pause: Duration,
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(30))]
    pub timeout: Duration,
    #[serde(deserialize_with = "count")]
    #[default = 3]
    pub retain: usize,
    /// The flush at a barrier waits only for what is in flight (bounded by
    /// `sink.max_in_flight_bytes`), so this bounds a transaction, not a checkpoint's duration; at
    /// 64 MiB, 1 KB records at ~200k/s ended every 1 s epoch after ~0.3 s, and each extra
    /// checkpoint stopped reading: 256 MiB drained 1.24-1.32x faster in every paired round
    /// (bench/README.md, "Session 27"). At-most-once gets a smaller default in [`Config::load`].
    #[serde(deserialize_with = "count")]
    #[default(256 * MIB)]
    pub max_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct TransactionConfig {
    /// librdkafka's own default for transaction.timeout.ms.
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(60))]
    pub timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    #[serde(deserialize_with = "listen_addr")]
    #[default(SocketAddr::from(([127, 0, 0, 1], 8080)))]
    pub listen: SocketAddr,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_token: Option<Secret>,
    /// See [`Config::ready_max_age`] for the default.
    #[serde(
        with = "humantime_serde::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub ready_max_age: Option<Duration>,
    /// PEM files of the certificate chain and its private key: set both to serve HTTPS only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownConfig {
    #[serde(with = "humantime_serde")]
    #[default(Duration::from_secs(30))]
    pub timeout: Duration,
}

/// `[offsets]`: the offset mapping that `eos-bridge offsets translate` reads, and the monitoring
/// group (docs/design.md, "Offset translation").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
pub struct OffsetsConfig {
    /// `__eos_bridge_offsets.<id>` when not set ([`Config::load`] fills it in).
    pub topic: String,
    #[serde(with = "humantime_serde")]
    #[default(DEFAULT_OFFSETS_RETENTION)]
    pub retention: Duration,
    /// An epoch ends early once its mapping holds this many runs; also the most entries (runs,
    /// partitions) per mapping record.
    #[serde(deserialize_with = "count")]
    #[default(DEFAULT_OFFSETS_MAX_RUNS)]
    pub max_runs: usize,
    /// For monitoring only; empty: none. `eos-bridge.<id>` when not set.
    pub monitor_group: String,
}

/// A setting that takes one of a few names: the enum, `as_str`, `Display`, a `FromStr` whose
/// error names the value found and the choices, and serde through those two.
macro_rules! named {
    ($(#[$doc:meta])* $ty:ident is $what:literal, use $fix:literal {
        $($(#[$variant_doc:meta])* $variant:ident = $name:literal,)+
    }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub enum $ty {
            $($(#[$variant_doc])* $variant,)+
        }

        impl $ty {
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }
        }

        impl FromStr for $ty {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    _ => Err(format!(concat!("{:?} is not ", $what, ": use ", $fix), s)),
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        text_serde!($ty);
    };
}

/// serde through `FromStr` and `Display` (`#[serde(try_from = "String", into = "String")]`).
macro_rules! text_serde {
    ($ty:ident) => {
        impl TryFrom<String> for $ty {
            type Error = String;

            fn try_from(s: String) -> Result<Self, String> {
                s.parse()
            }
        }

        impl From<$ty> for String {
            fn from(value: $ty) -> String {
                value.to_string()
            }
        }
    };
}

named! {
    Delivery is "a delivery mode", use r#""exactly-once", "at-least-once" or "at-most-once""# {
        #[default]
        ExactlyOnce = "exactly-once",
        AtLeastOnce = "at-least-once",
        AtMostOnce = "at-most-once",
    }
}

named! {
    /// What to do when the source or sink cluster, or a source or sink topic, is another one than
    /// the committed positions refer to (a rebuilt cluster, a topic deleted and created again).
    IdentityPolicy is "an identity policy", use r#""stop" (stop and say what changed) or "restart" (bridge a recreated topic or rebuilt cluster again from its earliest offset)"# {
        #[default]
        Stop = "stop",
        Restart = "restart",
    }
}

named! {
    /// What to do when a position to resume from no longer exists because retention deleted it.
    OutOfRange is "an out-of-range policy", use r#""fail" (stop) or "earliest" (resume from the oldest record kept, counting the records lost)"# {
        #[default]
        Fail = "fail",
        Earliest = "earliest",
    }
}

named! {
    /// What to do with a record the sink refuses for good (too large for the sink topic, invalid).
    OnBadRecord is "a bad-record policy", use r#""stop" (abort and stop, naming the record) or "dead-letter" (write it to sink.dead_letter_topic and go on)"# {
        #[default]
        Stop = "stop",
        DeadLetter = "dead-letter",
    }
}

named! {
    Partitioning is "a partitioning", use r#""preserve" (sink partition = source partition) or "key" (partition by record key)"# {
        #[default]
        Preserve = "preserve",
        Key = "key",
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum StartPosition {
    #[default]
    Earliest,
    Latest,
    /// The first record at or after this time, in milliseconds since the Unix epoch.
    Timestamp(i64),
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

impl fmt::Display for StartPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartPosition::Earliest => f.write_str("earliest"),
            StartPosition::Latest => f.write_str("latest"),
            StartPosition::Timestamp(ms) => write!(f, "timestamp:{ms}"),
        }
    }
}

text_serde!(StartPosition);

/// librdkafka properties passed through to a client, by their dotted names. Written as a TOML
/// table whose values may be strings, numbers or booleans; each becomes its text.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KafkaProps(BTreeMap<String, String>);

/// A value that must not reach a log: its `Debug` prints `***` and it has no `Display`. It
/// serializes as itself, to write a configuration file: never serialize a config into a log.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
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

/// Every problem found in one load, in a stable order, one per line.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
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
        let mut tree = layers(file, env)?;
        let mut report = Report::default();
        report.note_env(&tree);
        report.flatten_kafka(&mut tree);
        let mut config = report.read(&mut tree);
        report.errors.sort_by(|a, b| a.key.cmp(&b.key));
        report.bad_values.sort_by(|a, b| a.key.cmp(&b.key));
        report.errors.append(&mut report.bad_values);
        // Defaults made of other settings, known only now.
        let written = |section: &str, key: &str| {
            let table = tree.get(section).map(|s| &s.kind);
            matches!(table, Some(ValueKind::Table(t)) if t.contains_key(key))
        };
        let (id, c) = (config.bridge.id.clone(), &mut config);
        if !written("sink", "bootstrap_servers") {
            c.sink.bootstrap_servers = c.source.bootstrap_servers.clone();
        }
        if !written("sink", "marker_topic") {
            c.sink.marker_topic = default_marker_topic(&id);
        }
        if !written("offsets", "topic") {
            c.offsets.topic = format!("__eos_bridge_offsets.{id}");
        }
        if !written("offsets", "monitor_group") {
            c.offsets.monitor_group = format!("eos-bridge.{id}");
        }
        // At-most-once holds an epoch's records in memory until its checkpoint is written: there
        // the epoch bound is memory, and stays small.
        if !written("checkpoint", "max_bytes") && c.bridge.delivery == Delivery::AtMostOnce {
            c.checkpoint.max_bytes = 64 * MIB;
        }
        report
            .errors
            .extend(crate::secrets::resolve(&mut config, env));
        report.check(&config);
        report.finish(config)
    }

    /// [`Config::load`] with the process's environment.
    pub fn from_process_env(file: Option<&Path>) -> Result<Config, ConfigErrors> {
        let (mut env, mut unreadable) = (HashMap::new(), Vec::new());
        // `std::env::vars` would panic on any non-UTF-8 variable, ours or not.
        for (name, value) in std::env::vars_os() {
            match (name.into_string(), value.into_string()) {
                (Ok(name), Ok(value)) => {
                    env.insert(name, value);
                }
                (Ok(name), Err(_)) if is_ours(&name) => unreadable.push(ConfigError::new(
                    &name,
                    "the value is not valid UTF-8: set it as UTF-8 text",
                )),
                _ => {}
            }
        }
        match Config::load(file, &env) {
            result if unreadable.is_empty() => result,
            Ok(_) => Err(ConfigErrors(unreadable)),
            Err(ConfigErrors(errors)) => Err(ConfigErrors([unreadable, errors].concat())),
        }
    }

    /// Checks the rules of [`Config::load`] again, for a config built or changed in code.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        let mut report = Report::default();
        report.check(self);
        report.finish(())
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
        let (timeout, max_ms) = (self.transaction.timeout, transaction_max_timeout_ms);
        let broker_max = Duration::from_millis(u64::try_from(max_ms).unwrap_or(0));
        if self.bridge.delivery != Delivery::ExactlyOnce
            || timeout.as_millis() <= broker_max.as_millis()
        {
            return Ok(());
        }
        let (epoch_key, epoch) = self.epoch();
        let (txn, ms, max) = (show(timeout), timeout.as_millis(), show(broker_max));
        let open = show(epoch.saturating_add(self.checkpoint.timeout));
        let message = format!("{txn} ({ms} ms) is above the sink brokers' transaction.max.timeout.ms = {max_ms} ({max}), so the brokers would refuse every transaction; lower [transaction] timeout to at most {max} (while keeping it above {epoch_key} + checkpoint.timeout = {open}), or raise transaction.max.timeout.ms on the sink brokers");
        Err(ConfigError::new("transaction.timeout", message))
    }

    /// How long an epoch lasts, and the key that sets it: the checkpoint interval, or the minimum
    /// pause if that is longer. A transaction stays open for an epoch plus its checkpoint.
    fn epoch(&self) -> (&'static str, Duration) {
        let cp = &self.checkpoint;
        match cp.min_pause > cp.interval {
            true => ("checkpoint.min_pause", cp.min_pause),
            false => ("checkpoint.interval", cp.interval),
        }
    }
}

impl CheckpointConfig {
    fn default_ready_max_age(&self) -> Duration {
        self.interval.saturating_mul(3).saturating_add(self.timeout)
    }
}

impl KafkaProps {
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Every value by name, to rewrite in place (secret references are resolved so).
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = (&str, &mut String)> {
        self.0.iter_mut().map(|(k, v)| (k.as_str(), v))
    }

    /// The properties as librdkafka's clients take them.
    pub(crate) fn pairs(&self) -> Vec<(String, String)> {
        self.0.clone().into_iter().collect()
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
        let words = "password passphrase secret jaas token credential oauthbearer.config";
        let ends = [".key", "key.pem"];
        words.split(' ').any(|word| key.contains(word)) || ends.iter().any(|e| key.ends_with(e))
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for KafkaProps {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let props = iter.into_iter().map(|(k, v)| (k.into(), v.into()));
        KafkaProps(props.collect())
    }
}

impl fmt::Debug for KafkaProps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown = |(k, v)| match KafkaProps::is_sensitive(k) {
            true => (k, "***"),
            false => (k, v),
        };
        f.debug_map().entries(self.iter().map(shown)).finish()
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
        let (key, message) = (key.into(), message.into());
        ConfigError { key, message }
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

/// [`count`] for an optional key: absent stays None through the section's default.
fn count_opt<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<Option<T>, D::Error> {
    count(d).map(Some)
}

/// A whole number: an integer in the file, digits in the environment (the `config` crate alone
/// would also read "yes" as 1).
fn count<'de, D: Deserializer<'de>, T: TryFrom<u64>>(deserializer: D) -> Result<T, D::Error> {
    let n = match Any::deserialize(deserializer)? {
        Any::Number(n) if n.as_i64().is_some_and(|n| n < 0) => {
            Err(format!("{n} is negative: use a whole number of 0 or more"))
        }
        Any::String(s) => s
            .trim()
            .parse()
            .map_err(|_| format!(r#"{s:?} is not a whole number: write digits only, such as "3""#)),
        other => other
            .as_u64()
            .ok_or_else(|| format!("{other} is not a whole number such as 3")),
    };
    let n = n.map_err(de::Error::custom)?;
    T::try_from(n).map_err(|_| de::Error::custom(format!("{n} is too large")))
}

/// Topic names: a list in the file, or one string of comma-separated names (the environment's way
/// to write a list). Blank names in a string are dropped, so that a trailing comma is harmless and
/// an empty value clears a list set by the file.
fn topic_list<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<String>, D::Error> {
    let name = |(i, item): (usize, Any)| match item {
        Any::String(t) => Ok(t.trim().to_string()),
        other => Err(format!(
            "[{i}] is {other}, not a topic name: write each topic as a string"
        )),
    };
    match Any::deserialize(deserializer)? {
        Any::String(s) => {
            let names = s.split(',').map(str::trim).filter(|t| !t.is_empty());
            Ok(names.map(String::from).collect())
        }
        Any::Array(items) => items.into_iter().enumerate().map(name).collect(),
        other => Err(format!(r#"{other} is not a list of topic names: write ["a", "b"] in the file, "a,b" in the environment"#)),
    }
    .map_err(de::Error::custom)
}

fn listen_addr<'de, D: Deserializer<'de>>(deserializer: D) -> Result<SocketAddr, D::Error> {
    let s = String::deserialize(deserializer)?;
    s.trim().parse().map_err(|e| {
        de::Error::custom(format!(
            r#"{s:?} is not an address to listen on ({e}): write an IP address and a port, e.g. "127.0.0.1:8080" or "0.0.0.0:8080""#
        ))
    })
}

/// Merges the file and the environment into one tree; the defaults are the structs' own.
fn layers(
    file: Option<&Path>,
    env: &HashMap<String, String>,
) -> Result<LayerMap<String, Value>, ConfigErrors> {
    let mut builder = Layers::builder();
    if let Some(path) = file {
        builder = builder.add_source(File::from(path).format(FileFormat::Toml).required(true));
    }
    // No try_parsing and no list_separator: both rewrite strings behind our back ("007" becomes
    // 7, every string a list); values are parsed by the field types instead.
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

/// The errors of one load, and what the rules need to know about the values behind them.
#[derive(Default)]
struct Report {
    /// Unknown keys and misshapen tables, then (in `bad_values` until all are read) values that
    /// did not parse, then broken rules.
    errors: Vec<ConfigError>,
    bad_values: Vec<ConfigError>,
    /// Keys whose value did not parse. Rules that read them are skipped: judged on a stand-in
    /// default, they would report a value the user never wrote.
    broken: Vec<String>,
    /// The environment variable behind each key set from the environment, to point at it.
    env_names: BTreeMap<String, String>,
}

impl Report {
    fn fail(&mut self, key: &str, message: impl Into<String>) {
        let error = self.with_env(key, message);
        self.errors.push(error);
    }

    fn with_env(&self, key: &str, message: impl Into<String>) -> ConfigError {
        match self.env_names.get(key) {
            Some(var) => ConfigError::new(key, format!("{} (set by {var})", message.into())),
            None => ConfigError::new(key, message),
        }
    }

    fn finish<T>(self, value: T) -> Result<T, ConfigErrors> {
        match self.errors.is_empty() {
            true => Ok(value),
            false => Err(ConfigErrors(self.errors)),
        }
    }

    fn note_env(&mut self, tree: &LayerMap<String, Value>) {
        let root = Value::new(None, ValueKind::Table(tree.clone()));
        for path in env_paths(&[], &root) {
            self.env_names.insert(path.join("."), env_name(&path));
        }
    }

    /// Deserializes the tree into a `Config`, one error at a time: each bad value is reported,
    /// taken out (its default stands in) and the rest read again, so that one load names them all.
    fn read(&mut self, tree: &mut LayerMap<String, Value>) -> Config {
        loop {
            let root = Value::new(None, ValueKind::Table(tree.clone()));
            let error = match serde_path_to_error::deserialize::<_, Config>(root) {
                Ok(config) => return config,
                Err(error) => error,
            };
            let path: Vec<String> = error
                .path()
                .iter()
                .map_while(|segment| match segment {
                    serde_path_to_error::Segment::Map { key } => Some(key.clone()),
                    _ => None,
                })
                .take(2)
                .collect();
            let reason = reason(error.inner());
            let Some(found) = remove(tree, &path) else {
                // Every value has a path in the tree: this is a bug of this module.
                self.fail("configuration", reason);
                return Config::default();
            };
            let key = path.join(".");
            if let Some(accepted) = reason.strip_prefix("unknown field `") {
                let accepted = accepted.split_once(", expected ").map_or("", |(_, a)| a);
                let accepted = accepted.trim_start_matches("one of ").replace('`', "");
                let vars: Vec<String> = env_paths(&path, &found).iter().map(env_name).collect();
                let from = (!vars.is_empty()).then(|| format!(" (set by {})", vars.join(", ")));
                let from = from.unwrap_or_default();
                let place = match &path[..] {
                    [_] => "the top level".to_string(),
                    [section, ..] => format!("[{section}]"),
                    [] => String::new(),
                };
                let message =
                    format!("unknown key{from}: {place} accepts {accepted}; check the spelling");
                self.errors.push(ConfigError::new(key, message));
                continue;
            }
            self.broken.push(key.clone());
            let message = match (&path[..], &found.kind) {
                ([section], kind) if !matches!(kind, ValueKind::Table(_)) => {
                    let message = format!("expected a table of settings, found a value: set its keys, e.g. [{section}] in the file");
                    self.fail(&key, message);
                    continue;
                }
                // humantime-serde names neither the value nor the notation.
                _ if reason.ends_with("expected a duration") => bad_duration(&found),
                _ => reason,
            };
            let error = self.with_env(&key, message);
            self.bad_values.push(error);
        }
    }

    /// Flattens the librdkafka tables (TOML dotted keys make nested tables) into dotted names,
    /// with `_` read as `.`. A property set both in the file and in the environment takes the
    /// environment's value, however each one spelled the name.
    fn flatten_kafka(&mut self, tree: &mut LayerMap<String, Value>) {
        for section in ["source", "sink"] {
            let Some(ValueKind::Table(table)) = tree.get_mut(section).map(|s| &mut s.kind) else {
                continue;
            };
            let (Some(kafka), path) = (table.remove("kafka"), format!("{section}.kafka")) else {
                continue;
            };
            if !matches!(kafka.kind, ValueKind::Table(_)) {
                self.broken.push(path.clone());
                let example = r#""compression.type" = "zstd""#;
                let message =
                    format!("expected a table of librdkafka properties, e.g. [{path}] {example}");
                self.fail(&path, message);
                continue;
            }
            let mut props = leaves_of(&[], &kafka);
            // Stable: within each origin the order stays sorted; the environment's come last and win.
            props.sort_by_key(|(_, v)| from_env(v));
            props.retain(|(_, v)| !matches!(v.kind, ValueKind::Nil));
            let mut flat: BTreeMap<String, (String, bool, Value)> = BTreeMap::new();
            for (segments, leaf) in props {
                let (spelled, env) = (segments.join("."), from_env(&leaf));
                let name = spelled.replace('_', ".");
                let key = format!("{path}.{name}");
                if env {
                    let var = env_name(format!("{path}.{spelled}").split('.'));
                    self.env_names.insert(key.clone(), var);
                }
                if matches!(leaf.kind, ValueKind::Array(_)) {
                    self.broken.push(key.clone());
                    self.fail(&key, "librdkafka properties are single values: write a list as one comma-separated string");
                } else if let Some((other, _, _)) = flat.get(&name).filter(|(_, e, _)| *e == env) {
                    let place = if env { "the environment" } else { "the file" };
                    let message =
                        format!("set twice in {place}, as `{other}` and as `{spelled}`: keep one");
                    self.fail(&key, message);
                } else {
                    flat.insert(name, (spelled, env, leaf));
                }
            }
            let flat = flat
                .into_iter()
                .map(|(name, (_, _, v))| (name, v))
                .collect();
            table.insert("kafka".into(), Value::new(None, ValueKind::Table(flat)));
        }
    }

    /// Runs every rule whose keys all parsed.
    fn check(&mut self, config: &Config) {
        let related = |a: &str, b: &str| {
            a == b || a.starts_with(&format!("{b}.")) || b.starts_with(&format!("{a}."))
        };
        for (reads, rule) in RULES {
            if !reads
                .iter()
                .any(|r| self.broken.iter().any(|b| related(r, b)))
            {
                for ConfigError { key, message } in rule(config) {
                    self.fail(&key, message);
                }
            }
        }
    }
}

fn from_env(value: &Value) -> bool {
    value.origin() == Some(ENV_ORIGIN)
}

/// The paths of the values under `value` that the environment set.
fn env_paths(path: &[String], value: &Value) -> Vec<Vec<String>> {
    let leaves = leaves_of(path, value).into_iter();
    leaves
        .filter(|(_, v)| from_env(v))
        .map(|(p, _)| p)
        .collect()
}

/// serde's message without the `config` crate's " for key `…` in …" (the key is reported apart).
fn reason(error: &::config::ConfigError) -> String {
    match error {
        ::config::ConfigError::At { error, .. } => reason(error),
        ::config::ConfigError::Type {
            unexpected,
            expected,
            ..
        } => {
            format!("invalid type: {unexpected}, expected {expected}")
        }
        other => one_line(&other.to_string()),
    }
}

fn bad_duration(found: &Value) -> String {
    let text = found.to_string();
    match &found.kind {
        ValueKind::I64(_) | ValueKind::U64(_) | ValueKind::I128(_) | ValueKind::U128(_) => {
            format!(
                r#"{text} has no unit: write "{text}s" for seconds or "{text}ms" for milliseconds"#
            )
        }
        ValueKind::String(s) => match humantime::parse_duration(s.trim()) {
            Err(e) => format!("{s:?} is not a duration ({e}): {DURATION_EXAMPLES}"),
            Ok(_) => format!("{s:?} is not a duration: {DURATION_EXAMPLES}"),
        },
        _ => format!("{text} is not a duration: {DURATION_EXAMPLES}"),
    }
}

/// Takes the value at `path` out of the tree.
fn remove(tree: &mut LayerMap<String, Value>, path: &[String]) -> Option<Value> {
    match (path, path.split_first()) {
        ([key], _) => tree.remove(key),
        (_, Some((section, rest))) => match &mut tree.get_mut(section)?.kind {
            ValueKind::Table(table) => remove(table, rest),
            _ => None,
        },
        (_, None) => None,
    }
}

/// Every value under `value` that is not a table, with its path, in sorted order.
fn leaves_of(path: &[String], value: &Value) -> Vec<(Vec<String>, Value)> {
    let ValueKind::Table(table) = &value.kind else {
        return vec![(path.to_vec(), value.clone())];
    };
    let sorted: BTreeMap<&String, &Value> = table.iter().collect();
    let leaves = sorted
        .into_iter()
        .map(|(key, v)| leaves_of(&[path, std::slice::from_ref(key)].concat(), v));
    leaves.flatten().collect()
}

fn env_name<S: AsRef<str>>(path: impl IntoIterator<Item = S>) -> String {
    let levels = path.into_iter().map(|s| s.as_ref().to_ascii_uppercase());
    [ENV_PREFIX.to_string()]
        .into_iter()
        .chain(levels)
        .collect::<Vec<_>>()
        .join(ENV_SEPARATOR)
}

/// What a rule found wrong, each error on its key.
type Found = Vec<ConfigError>;
type Rule = fn(&Config) -> Found;

/// A row of `RULES` for a rule on one key: `|c| key (+ other keys it reads) if broken => message`,
/// the message (`format!` arguments) made only for a broken value.
macro_rules! rule {
    (|$c:ident| $key:literal $(+ $reads:literal)* if $broken:expr => $($message:tt)+) => {
        (&[$key $(, $reads)*], |$c: &Config| when($broken, $key, || format!($($message)+)))
    };
}

/// Every rule, with the keys it reads: a rule is skipped when one of them did not parse, since
/// judged on a stand-in default it would report a value never written. Errors come in this order.
const RULES: &[(&[&str], Rule)] = &[
    (&["bridge.id"], bridge_id),
    rule!(|c| "bridge.instances" if c.bridge.instances == 0
        => "0: a bridge runs as at least one instance; use 1 or more"),
    rule!(|c| "bridge.instance" + "bridge.instances" if c.bridge.instances > 0 && c.bridge.instance >= c.bridge.instances
        => "{} is out of range for bridge.instances = {}: instances are numbered 0 to {}; use one of those numbers or raise bridge.instances",
        c.bridge.instance, c.bridge.instances, c.bridge.instances - 1),
    rule!(|c| "bridge.state_dir" if c.bridge.state_dir.as_os_str().is_empty()
        => r#"is empty: name the directory that holds this instance's checkpoints, e.g. "state""#),
    (&["source.bootstrap_servers"], |c| {
        servers("source.bootstrap_servers", &c.source.bootstrap_servers)
    }),
    (&["source.topic_pattern"], |c| {
        let pattern = c.source.topic_pattern.as_deref().unwrap_or_default();
        at("source.topic_pattern", compile(pattern).err())
    }),
    (&["source.topics"], |c| {
        let bad = |t: &String| {
            Some(format!(
                "{t:?} {}: fix the topic's name",
                check_topic_name(t).err()?
            ))
        };
        let errors = c.source.topics.iter().filter_map(bad);
        errors
            .map(|m| ConfigError::new("source.topics", m))
            .collect()
    }),
    (&["source.topics", "source.topic_pattern"], source_topics),
    (&["source.topic_exclude", "source.topics"], |c| {
        let Some(exclude) = c.source.topic_exclude.as_deref() else {
            return vec![];
        };
        let listed = |re: Regex| c.source.topics.iter().find(|t| re.is_match(t)).cloned();
        let message = match compile(exclude).map(listed) {
            Err(message) => Some(message),
            Ok(listed) => listed.map(|t| format!("{exclude:?} excludes {t:?}, which source.topics lists: remove it from the list, or narrow the exclusion")),
        };
        at("source.topic_exclude", message)
    }),
    rule!(|c| "sink.replication_factor" if matches!(c.sink.replication_factor, Some(n) if n == 0 || n > i16::MAX as u16)
        => "{} is not a replica count: use 1 to {}, at most the sink cluster's brokers, or leave it unset for the broker's default",
        c.sink.replication_factor.unwrap_or_default(), i16::MAX),
    (&["sink.bootstrap_servers"], |c| {
        // Unset, the sink's servers are the source's: one error about them is enough.
        let (source, sink) = (&c.source.bootstrap_servers, &c.sink.bootstrap_servers);
        let errors = servers("sink.bootstrap_servers", sink);
        if sink == source {
            vec![]
        } else {
            errors
        }
    }),
    (&["sink.topic"], sink_topic_name),
    (&["sink.marker_topic"], |c| {
        let (marker, default) = (&c.sink.marker_topic, default_marker_topic(&c.bridge.id));
        let why = marker_judged(c).and_then(Result::err);
        let message =
            why.map(|why| format!("{marker:?} {why}: leave it unset for the default {default:?}"));
        at("sink.marker_topic", message)
    }),
    (TOPICS, own_output),
    // A dead-letter topic that is never used is a half-finished configuration.
    rule!(|c| "sink.dead_letter_topic" + "sink.on_bad_record" if !dead_letters(c) && c.sink.dead_letter_topic != DEFAULT_DEAD_LETTER_TOPIC
        => r#"{:?} is set but sink.on_bad_record is "{}", which never writes to it: set on_bad_record = "dead-letter" in [sink], or remove dead_letter_topic"#,
        c.sink.dead_letter_topic, c.sink.on_bad_record),
    rule!(|c| "sink.on_bad_record" + "sink.dead_letter_topic" + "bridge.delivery" if dead_letters(c) && c.bridge.delivery == Delivery::AtMostOnce
        => r#""dead-letter" cannot work with bridge.delivery = "at-most-once", which checkpoints past an epoch's records before writing them, so a refused record is never read again to be dead-lettered: use on_bad_record = "stop", or exactly-once or at-least-once delivery"#),
    (&["sink.on_bad_record", "sink.dead_letter_topic"], |c| {
        let (dlq, sample) = (&c.sink.dead_letter_topic, c.dead_letter_topic_for("t"));
        let Err(why) = check_topic_name(&sample) else {
            return vec![];
        };
        when(dead_letters(c), "sink.dead_letter_topic", || {
            format!(
                r#"{} {why}: use e.g. "{DEFAULT_DEAD_LETTER_TOPIC}""#,
                template(dlq, &sample)
            )
        })
    }),
    (DEAD_LETTER_TOPICS, dead_letter_clash),
    rule!(|c| "checkpoint.interval" if c.checkpoint.interval.is_zero() => "{NOT_ZERO}: {DURATION_EXAMPLES}"),
    rule!(|c| "checkpoint.timeout" if c.checkpoint.timeout.is_zero() => "{NOT_ZERO}: {DURATION_EXAMPLES}"),
    rule!(|c| "checkpoint.max_bytes" if c.checkpoint.max_bytes == 0
        => "0 would end every epoch at its first record: {SOME_BYTES}"),
    rule!(|c| "sink.max_in_flight_bytes" if c.sink.max_in_flight_bytes == 0
        => "0 would let no record be sent: {SOME_BYTES}"),
    rule!(|c| "checkpoint.retain" if c.checkpoint.retain == 0
        => "0 would keep no checkpoint to recover from: keep at least 1 (3 by default)"),
    rule!(|c| "transaction.timeout" if c.transaction.timeout.is_zero() => "{NOT_ZERO}: {DURATION_EXAMPLES}"),
    rule!(|c| "transaction.timeout" + "bridge.delivery" if c.bridge.delivery == Delivery::ExactlyOnce && !c.transaction.timeout.is_zero() && transactional(c).is_none()
        => "{} is outside librdkafka's range for transaction.timeout.ms, 1s to {}: choose a value in it",
        show(c.transaction.timeout), show(MAX_TRANSACTION_TIMEOUT)),
    (EPOCH, transaction_outlives_epoch),
    (
        &["transaction.timeout", "bridge.delivery", "sink.kafka"],
        delivery_timeouts,
    ),
    (&[], passthrough),
    rule!(|c| "api.admin_token" if c.api.admin_token.as_ref().is_some_and(|t| t.expose().is_empty())
        => "is empty: set a long random token, or leave the key out"),
    rule!(|c| "api.ready_max_age" if c.api.ready_max_age == Some(Duration::ZERO)
        => r#""0s" would never report ready: leave it out for the default ({}) or {DURATION_EXAMPLES}"#,
        show(c.checkpoint.default_ready_max_age())),
    (&["api.tls_cert", "api.tls_key"], |c| {
        let (set, missing) = match (&c.api.tls_cert, &c.api.tls_key) {
            (Some(_), None) => ("api.tls_cert", "api.tls_key"),
            (None, Some(_)) => ("api.tls_key", "api.tls_cert"),
            _ => return vec![],
        };
        let fix = "set both PEM paths to serve HTTPS, or neither for plain HTTP";
        vec![ConfigError::new(
            missing,
            format!("is required with {set}: {fix}"),
        )]
    }),
    rule!(|c| "offsets.max_runs" if c.offsets.max_runs == 0
        => "0 leaves no room for a run: use a whole number of 1 or more, such as 4096"),
    rule!(|c| "offsets.retention" if c.offsets.retention.is_zero()
        => r#""0s" keeps no mapping: use e.g. "24h""#),
    rule!(|c| "bridge.unreachable_timeout" if c.bridge.unreachable_timeout.is_zero()
        => r#""0s" would stop at the first refused connection: use e.g. "5m" (the default)"#),
    rule!(|c| "shutdown.timeout" if c.shutdown.timeout.is_zero()
        => r#""0s" leaves no time to finish the last checkpoint: use e.g. "30s""#),
];

const NOT_ZERO: &str = r#""0s" must be longer than zero"#;
const SOME_BYTES: &str = "give a number of bytes, such as 16777216 for 16 MiB";

/// What the rules on the topics that must stay apart read.
const TOPICS: &[&str] = &[
    "source.topics",
    "source.topic_pattern",
    "source.bootstrap_servers",
    "sink.bootstrap_servers",
    "sink.topic",
    "sink.marker_topic",
];
const DEAD_LETTER_TOPICS: &[&str] = &[
    "sink.on_bad_record",
    "sink.dead_letter_topic",
    "source.topics",
    "source.topic_pattern",
    "sink.topic",
    "sink.marker_topic",
];
const EPOCH: &[&str] = &[
    "transaction.timeout",
    "bridge.delivery",
    "checkpoint.interval",
    "checkpoint.min_pause",
    "checkpoint.timeout",
];

/// The error `message()` on `key` if `broken`.
fn when(broken: bool, key: &str, message: impl FnOnce() -> String) -> Found {
    at(key, broken.then(message))
}

/// The error `message` on `key`, if there is one.
fn at(key: &str, message: Option<String>) -> Found {
    message
        .map(|m| ConfigError::new(key, m))
        .into_iter()
        .collect()
}

fn bridge_id(c: &Config) -> Found {
    let id = &c.bridge.id;
    let message = if id.is_empty() {
        r#"is required: name the bridge, e.g. id = "orders-mirror" in [bridge] or EOS_BRIDGE__BRIDGE__ID=orders-mirror; it keys the transactional id and the commit markers, so keep it stable"#.to_string()
    } else if !id.chars().all(legal) {
        let fixed = id.replace(|ch| !legal(ch), "-");
        format!("{id:?} may only hold letters, digits, '.', '_' and '-' (it becomes part of the transactional id): e.g. {fixed:?}")
    } else {
        return vec![];
    };
    vec![ConfigError::new("bridge.id", message)]
}

fn source_topics(c: &Config) -> Found {
    let (topics, pattern) = (&c.source.topics, &c.source.topic_pattern);
    let (key, message) = match (topics.is_empty(), pattern) {
        (true, None) => ("source.topics", r#"no source topics: set topics = ["orders", "payments"] or topic_pattern = "orders\\..*" in [source]"#.to_string()),
        (false, Some(pattern)) => ("source.topic_pattern", format!(r#"{pattern:?} is set together with source.topics = {topics:?}: keep one of them (an empty EOS_BRIDGE__SOURCE__TOPICS="" clears a list set by the file)"#)),
        _ => return vec![],
    };
    vec![ConfigError::new(key, message)]
}

/// How a message on a topic template starts: the template, and the names it gives if it has a
/// placeholder.
fn template(template: &str, sample: &str) -> String {
    match sample == template {
        true => format!("{template:?}"),
        false => format!("{template:?} gives topic names like {sample:?}, which"),
    }
}

fn sink_topic_name(c: &Config) -> Found {
    let (topic, sample) = (&c.sink.topic, c.sink_topic_for("t"));
    let Err(why) = check_topic_name(&sample) else {
        return vec![];
    };
    let placeholder = match sample.contains('{') {
        true => format!(" ({SOURCE_TOPIC_PLACEHOLDER} is the only placeholder)"),
        false => String::new(),
    };
    let topic = template(topic, &sample);
    let message =
        format!(r#"{topic} {why}{placeholder}: use e.g. "{SOURCE_TOPIC_PLACEHOLDER}-copy""#);
    vec![ConfigError::new("sink.topic", message)]
}

/// Whether the marker topic is a legal name. The default one is made of bridge.id, whose own
/// rule reports a bad id: then the marker topic is not judged (once is enough).
fn marker_judged(c: &Config) -> Option<Result<(), &'static str>> {
    let default = c.sink.marker_topic == default_marker_topic(&c.bridge.id);
    (c.bridge.id.chars().all(legal) || !default).then(|| check_topic_name(&c.sink.marker_topic))
}

/// The listed source topics (none with a pattern), and the pattern compiled.
fn sources(c: &Config) -> (&[String], Option<Regex>) {
    match c.source.topic_pattern.as_deref() {
        Some(p) => (&[], anchored(p).ok()),
        None => (&c.source.topics, None),
    }
}

/// Markers are not sink topics, and on one cluster the bridge must not read its own output or
/// markers.
fn own_output(c: &Config) -> Found {
    let (source, sink, mut found) = (&c.source, &c.sink, Vec::new());
    let (topic, marker) = (&sink.topic, &sink.marker_topic);
    let topic_ok = check_topic_name(&c.sink_topic_for("t")).is_ok();
    let marker_ok = marker_judged(c) == Some(Ok(()));
    let (listed, pattern) = sources(c);
    let matched = |t: &str| pattern.as_ref().is_some_and(|p| p.is_match(t));
    let constant = !topic.contains(SOURCE_TOPIC_PLACEHOLDER);
    let default = default_marker_topic(&c.bridge.id);
    let sink_topics = listed.iter().map(|t| c.sink_topic_for(t));
    let clash = match constant {
        true => (topic == marker).then(|| topic.clone()),
        false => sink_topics.clone().find(|t| t == marker),
    };
    if let Some(clash) = clash.filter(|_| topic_ok && marker_ok) {
        found.push(ConfigError::new("sink.marker_topic", format!("{clash:?} is also a sink topic: commit markers must have a topic of their own; leave it unset for the default {default:?}")));
    }
    let servers = &sink.bootstrap_servers;
    if !same_cluster(&source.bootstrap_servers, servers) {
        return found;
    }
    let fix = format!(
        r#"use e.g. "{SOURCE_TOPIC_PLACEHOLDER}-copy", or a sink.bootstrap_servers of another cluster"#
    );
    let source_pattern = source.topic_pattern.as_deref().unwrap_or_default();
    let onto_source = listed
        .iter()
        .zip(sink_topics)
        .find(|(_, to)| source.topics.contains(to));
    let message = match onto_source {
        _ if !topic_ok => None,
        _ if topic == SOURCE_TOPIC_PLACEHOLDER => Some(format!("{topic:?} writes every topic onto itself, since source and sink are the same cluster ({servers:?}): {fix}")),
        Some((from, to)) => Some(format!("{topic:?} writes source topic {from:?} to {to:?}, which is itself a source topic on the same cluster: the bridge would read its own output; {fix}")),
        None if constant && matched(topic) => Some(format!("{topic:?} is matched by source.topic_pattern {source_pattern:?} on the same cluster: the bridge would read its own output; narrow the pattern or {fix}")),
        None => None,
    };
    found.extend(message.map(|m| ConfigError::new("sink.topic", m)));
    if marker_ok && listed.contains(marker) {
        found.push(ConfigError::new("source.topics", format!("{marker:?} is the marker topic of the same cluster: the bridge would read its own commit markers as data; remove it")));
    } else if marker_ok && matched(marker) {
        found.push(ConfigError::new("source.topic_pattern", format!("{source_pattern:?} matches the marker topic {marker:?} of the same cluster: the bridge would read its own commit markers as data; narrow the pattern, e.g. to the topics' common prefix")));
    }
    found
}

fn dead_letters(c: &Config) -> bool {
    c.sink.on_bad_record == OnBadRecord::DeadLetter
}

/// Dead letters need a topic of their own, and must not be read back as source records.
fn dead_letter_clash(c: &Config) -> Found {
    let (sink, template) = (&c.sink, &c.sink.dead_letter_topic);
    if !dead_letters(c) || check_topic_name(&c.dead_letter_topic_for("t")).is_err() {
        return vec![];
    }
    // With listed topics every dead-letter topic is known; with a pattern, only a template
    // without the placeholder (one topic for all) or one identical to another's.
    let (listed, pattern) = sources(c);
    let constant = !template.contains(SOURCE_TOPIC_PLACEHOLDER);
    let pair = |t: &str| (c.dead_letter_topic_for(t), c.sink_topic_for(t));
    let mut pairs: Vec<(String, String)> = listed.iter().map(|t| pair(t)).collect();
    if listed.is_empty() && (constant || template == &sink.topic) {
        pairs.push(pair("t"));
    }
    let fix = format!(r#"use e.g. "{DEFAULT_DEAD_LETTER_TOPIC}""#);
    let key = "sink.dead_letter_topic";
    for (dlq, sink_topic) in &pairs {
        let what = match (dlq == &sink.marker_topic, dlq == sink_topic) {
            (true, _) => "the marker topic",
            (false, true) => "a sink topic",
            _ => continue,
        };
        return vec![ConfigError::new(key, format!("{template:?} gives {dlq:?}, which is also {what}: dead letters need a topic of their own; {fix}"))];
    }
    let same = same_cluster(&c.source.bootstrap_servers, &sink.bootstrap_servers);
    let matched = |t: &str| pattern.as_ref().is_some_and(|p| constant && p.is_match(t));
    let mut read_back = pairs.iter().map(|(dlq, _)| dlq).filter(|_| same);
    let found = read_back.find(|dlq| listed.contains(dlq) || matched(dlq));
    let message = |dlq| {
        format!("{template:?} gives {dlq:?}, which is a source topic of the same cluster: the bridge would read its own dead letters; {fix}")
    };
    at(key, found.map(message))
}

/// `transaction.timeout` when exactly-once delivery uses transactions and the timeout is in
/// librdkafka's range; the rules on what a transaction must outlast judge only such a timeout.
fn transactional(c: &Config) -> Option<Duration> {
    let txn = c.transaction.timeout;
    let in_range = (MIN_TRANSACTION_TIMEOUT..=MAX_TRANSACTION_TIMEOUT).contains(&txn);
    (c.bridge.delivery == Delivery::ExactlyOnce && in_range).then_some(txn)
}

/// The coordinator aborts a transaction left open longer than transaction.timeout.
fn transaction_outlives_epoch(c: &Config) -> Found {
    let Some(txn) = transactional(c) else {
        return vec![];
    };
    let ((epoch_key, epoch), timeout) = (c.epoch(), c.checkpoint.timeout);
    let open = epoch.saturating_add(timeout);
    when(open >= txn, "transaction.timeout", || {
        let [txn, epoch, timeout, open] = [txn, epoch, timeout, open].map(show);
        format!("{txn} must be longer than {epoch_key} ({epoch}) + checkpoint.timeout ({timeout}) = {open}, the longest a transaction stays open, or the brokers abort it before it commits: raise [transaction] timeout above {open} (within the sink brokers' transaction.max.timeout.ms, 15m by default) or shorten the checkpoint settings")
    })
}

/// librdkafka refuses a transactional producer whose records or requests may outlive the
/// transaction; it derives both timeouts from transaction.timeout unless they are set.
fn delivery_timeouts(c: &Config) -> Found {
    let Some(txn) = transactional(c) else {
        return vec![];
    };
    let (kafka, txn_ms, shown) = (&c.sink.kafka, txn.as_millis(), show(txn));
    let (limit, mut found) = (txn_ms.saturating_sub(100), Vec::new());
    if kafka.get("message.timeout.ms").is_some() && kafka.get("delivery.timeout.ms").is_some() {
        found.push(ConfigError::new(
            "sink.kafka.delivery.timeout.ms",
            "is librdkafka's other name for message.timeout.ms, which is set too: keep one",
        ));
    }
    for name in ["message", "delivery", "socket"].map(|n| format!("{n}.timeout.ms")) {
        let Some(value) = kafka.get(&name) else {
            continue;
        };
        let socket = name == "socket.timeout.ms";
        let message = match value.trim().parse::<u128>() {
            Err(_) => format!("{value:?} is not a whole number of milliseconds: write digits only"),
            Ok(ms) if socket && ms > limit => format!("{ms} must be at least 100 ms below transaction.timeout ({shown}, {txn_ms} ms), so a request can fail and be retried before the transaction times out: set at most {limit}, or leave it out"),
            Ok(_) if socket => continue,
            Ok(0) => format!("0 lets a record wait forever, but its transaction is aborted after transaction.timeout ({shown}): set at most {txn_ms}, or leave it out to follow transaction.timeout"),
            Ok(ms) if ms > txn_ms => format!("{ms} is above transaction.timeout ({shown}, {txn_ms} ms): a record could outlive its transaction; set at most {txn_ms}, or leave it out to follow transaction.timeout"),
            Ok(_) => continue,
        };
        found.push(ConfigError::new(format!("sink.kafka.{name}"), message));
    }
    found
}

/// Properties the bridge sets itself: a passthrough value would fight it or break the guarantee.
fn passthrough(c: &Config) -> Found {
    let mut found = Vec::new();
    for (section, props) in [("source", &c.source.kafka), ("sink", &c.sink.kafka)] {
        for (name, value) in props.iter() {
            let instead = match (section, name) {
                (_, "bootstrap.servers" | "metadata.broker.list") => &format!("use {section}.bootstrap_servers"),
                ("source", "group.id") => "the bridge assigns partitions itself and keeps positions in its checkpoints",
                ("source", "enable.auto.commit") => "positions live in the bridge's checkpoints, never in auto-commits",
                ("source", "enable.auto.offset.store") => "positions live in the bridge's checkpoints",
                ("source", "isolation.level") => "the bridge always reads read_committed, so aborted source records are never bridged",
                ("source", "auto.offset.reset") => "use source.on_offset_out_of_range (and source.start for the first run)",
                ("sink", "transactional.id") => "the bridge derives it from bridge.id and bridge.instance",
                ("sink", "transaction.timeout.ms") => "use [transaction] timeout",
                ("sink", "enable.idempotence") => "the bridge sets it for the delivery mode; choose bridge.delivery",
                _ => continue,
            };
            let message = format!("{value:?}: the bridge sets this property itself, so it may not be passed through; remove it ({instead})");
            found.push(ConfigError::new(format!("{section}.kafka.{name}"), message));
        }
    }
    found
}

fn servers(key: &str, servers: &str) -> Found {
    let example = r#"e.g. "kafka-1:9092,kafka-2:9092""#;
    let message = if servers.trim().is_empty() {
        format!("is required: list the cluster's brokers, {example}")
    } else if servers.split(',').any(|s| s.trim().is_empty()) {
        format!("{servers:?} has an empty entry: separate brokers with single commas, {example}")
    } else {
        return vec![];
    };
    vec![ConfigError::new(key, message)]
}

/// The characters of a bridge id and of a topic name.
fn legal(ch: char) -> bool {
    ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-')
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
    } else if !name.chars().all(legal) {
        Err("holds characters Kafka does not allow in topic names (only letters, digits, '.', '_' and '-')")
    } else {
        Ok(())
    }
}

/// Whether two server lists name the same brokers, whatever their order, case or spacing.
pub(crate) fn same_cluster(a: &str, b: &str) -> bool {
    let brokers = |s: &str| -> BTreeSet<String> {
        let names = s.split(',').map(|b| b.trim().to_ascii_lowercase());
        names.filter(|b| !b.is_empty()).collect()
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
    lines.retain(|l| !snippet(l));
    lines
        .iter()
        .map(|l| l.trim())
        .collect::<Vec<_>>()
        .join(": ")
}

/// A topic pattern compiled, or what is wrong with it: a regex error ends with that, after a
/// snippet of the pattern.
fn compile(pattern: &str) -> Result<Regex, String> {
    anchored(pattern).map_err(|e| {
        let text = e.to_string();
        let last = text.trim_end().lines().last().unwrap_or_default().trim();
        let why = last.strip_prefix("error: ").unwrap_or(last);
        format!("{pattern:?} is not a valid regular expression ({why}): fix the syntax; it must match whole topic names")
    })
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

    /// Every key the structs accept, as serialized from a config that sets the optional ones.
    fn every_key() -> toml::Table {
        let mut full = Config::default();
        full.source.topic_pattern = Some("p".into());
        full.api.admin_token = Some(Secret::new("t"));
        full.api.ready_max_age = Some(Duration::from_secs(1));
        toml::Table::try_from(&full).unwrap()
    }

    #[test]
    fn mirror_keys_are_checked() {
        let with = |source: &str, sink: &str| {
            BASE.replace("topics = [\"orders\"]", source)
                .replace("[sink]\n", &format!("[sink]\n{sink}\n"))
        };
        rejects(
            &with("topics = [\"orders\"]\ntopic_exclude = \"ord.*\"", ""),
            &[],
            "source.topic_exclude",
            &["\"ord.*\"", "\"orders\"", "remove it from the list"],
        );
        rejects(
            &with("topic_pattern = \"o.*\"\ntopic_exclude = \"(\"", ""),
            &[],
            "source.topic_exclude",
            &["not a valid regular expression"],
        );
        rejects(
            &with("topics = [\"orders\"]", "replication_factor = 0"),
            &[],
            "sink.replication_factor",
            &["0 is not a replica count", "leave it unset"],
        );
        let c = load(
            &with(
                "topic_pattern = \"o.*\"\ntopic_exclude = \"o\\\\.tmp.*\"",
                "replication_factor = 3\ntopic_config_exclude = [\"segment.*\"]",
            ),
            &[(
                "EOS_BRIDGE__SINK__TOPIC_CONFIG_EXCLUDE",
                "segment.*,preallocate",
            )],
        )
        .unwrap();
        assert_eq!(c.source.topic_exclude.as_deref(), Some("o\\.tmp.*"));
        assert_eq!(c.sink.replication_factor, Some(3));
        assert_eq!(c.sink.topic_config_exclude, ["segment.*", "preallocate"]);
        let c = load(BASE, &[]).unwrap();
        assert_eq!(c.sink.replication_factor, None);
        assert!(c.sink.topic_config_exclude.is_empty() && c.source.topic_exclude.is_none());
    }

    #[test]
    fn secret_references_resolve_at_load_and_stay_out_of_debug_output() {
        let dir = tempfile::tempdir().unwrap();
        let password = dir.path().join("password");
        std::fs::write(&password, "file-pw-5150\n").unwrap();
        let toml = format!(
            r#"{BASE}
            [api]
            admin_token = "${{env:BRIDGE_ADMIN_TOKEN}}"
            [sink.kafka]
            "sasl.password" = "${{file:{}}}"
            "sasl.username" = "$${{literal}}"
            "compression.type" = "zstd"
            "#,
            password.display()
        );
        let c = load(
            &toml,
            &[
                ("BRIDGE_ADMIN_TOKEN", "env-tok-6a6a"),
                (
                    "EOS_BRIDGE__SOURCE__KAFKA__SSL_KEY_PASSWORD",
                    "${env:KEY_PW}",
                ),
                ("KEY_PW", "env-kpw-7b7b"),
            ],
        )
        .unwrap();
        assert_eq!(c.sink.kafka.get("sasl.password"), Some("file-pw-5150"));
        assert_eq!(c.sink.kafka.get("sasl.username"), Some("${literal}"));
        assert_eq!(c.source.kafka.get("ssl.key.password"), Some("env-kpw-7b7b"));
        assert_eq!(
            c.api.admin_token.as_ref().map(Secret::expose),
            Some("env-tok-6a6a")
        );
        let shown = format!("{c:?} {c:#?}");
        for secret in ["file-pw-5150", "env-tok-6a6a", "env-kpw-7b7b"] {
            assert!(!shown.contains(secret), "{secret} shown in {shown}");
        }
        assert!(shown.contains("zstd"), "{shown}");
    }

    #[test]
    fn unresolvable_references_are_errors_naming_key_and_source() {
        let toml = format!(
            r#"{BASE}
            [api]
            admin_token = "${{env:NO_SUCH_TOKEN_VAR}}"
            [sink.kafka]
            "sasl.password" = "${{file:/nonexistent/eos-bridge/pw}}"
            "#
        );
        let errors = errors(&toml, &[]);
        assert_eq!(errors.len(), 2, "{errors:#?}");
        let token = errors.iter().find(|e| e.key == "api.admin_token").unwrap();
        assert!(
            token.message.contains("NO_SUCH_TOKEN_VAR is not set"),
            "{token}"
        );
        let pw = errors
            .iter()
            .find(|e| e.key == "sink.kafka.sasl.password")
            .unwrap();
        assert!(pw.message.contains("/nonexistent/eos-bridge/pw"), "{pw}");
    }

    #[test]
    fn example_file_documents_every_key() {
        let text = std::fs::read_to_string(repo_file("eos-bridge.toml")).unwrap();
        let lines: Vec<&str> = text.lines().map(|l| l.trim_start_matches("# ")).collect();
        for (section, keys) in every_key() {
            let start = lines
                .iter()
                .position(|l| *l == format!("[{section}]"))
                .unwrap_or_else(|| panic!("[{section}] missing"));
            let body = lines[start + 1..]
                .iter()
                .take_while(|l| !l.starts_with('[') || l.starts_with(&format!("[{section}.")));
            let body: Vec<&str> = body.copied().collect();
            for key in keys.as_table().unwrap().keys() {
                if key == "kafka" {
                    assert!(
                        text.contains(&format!("[{section}.kafka]")),
                        "[{section}.kafka] missing"
                    );
                    continue;
                }
                let set = format!("{key} = ");
                assert!(
                    body.iter().any(|l| l.starts_with(&set)),
                    "{section}.{key} missing"
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
            topic_exclude = "orders\\.internal\\..*"
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
            replication_factor = 3
            topic_config_exclude = ["segment.*"]

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
            tls_cert = "/etc/eos-bridge/tls/tls.crt"
            tls_key = "/etc/eos-bridge/tls/tls.key"

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
                topic_exclude: Some(r"orders\.internal\..*".into()),
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
                replication_factor: Some(3),
                topic_config_exclude: vec!["segment.*".into()],
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
                tls_cert: Some("/etc/eos-bridge/tls/tls.crt".into()),
                tls_key: Some("/etc/eos-bridge/tls/tls.key".into()),
            },
            shutdown: ShutdownConfig {
                timeout: Duration::from_secs(45),
            },
            offsets: OffsetsConfig {
                topic: "__eos_bridge_offsets.orders.mirror_2".into(),
                retention: DEFAULT_OFFSETS_RETENTION,
                max_runs: DEFAULT_OFFSETS_MAX_RUNS,
                monitor_group: "eos-bridge.orders.mirror_2".into(),
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
        assert_eq!(c.checkpoint.max_bytes, 256 * 1024 * 1024);
        assert_eq!(c.sink.max_in_flight_bytes, 10 * 1024 * 1024);
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
    fn bad_values_and_unknown_keys_of_one_table_are_all_named() {
        let toml = format!(
            "{BASE}\n[checkpoint]\nintervall = \"1s\"\nretian = 3\ninterval = \"soon\"\ntimeout = 5\nretain = \"x\"\n"
        );
        let errors = errors(&toml, &[("EOS_BRIDGE__CHECKPOINT__MAX_BYTES", "-1")]);
        let keys: Vec<&str> = errors.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "checkpoint.intervall",
                "checkpoint.retian",
                "checkpoint.interval",
                "checkpoint.max_bytes",
                "checkpoint.retain",
                "checkpoint.timeout",
            ],
            "{errors:#?}"
        );
        assert!(errors[3]
            .message
            .contains("EOS_BRIDGE__CHECKPOINT__MAX_BYTES"));
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
        rejects(
            BASE,
            &[("EOS_BRIDGE__API__TLS_CERT", "/tls/tls.crt")],
            "api.tls_key",
            &["api.tls_cert", "both"],
        );
        rejects(
            BASE,
            &[("EOS_BRIDGE__API__TLS_KEY", "/tls/tls.key")],
            "api.tls_cert",
            &["api.tls_key", "both"],
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
            "sasl.oauthbearer.assertion.private.key.passphrase",
            "sasl.oauthbearer.assertion.private.key.pem",
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
    fn unknown_keys_name_exactly_what_their_table_accepts() {
        let keys = every_key();
        let sections: Vec<&str> = keys.keys().map(String::as_str).collect();
        assert_eq!(
            sections,
            [
                "api",
                "bridge",
                "checkpoint",
                "offsets",
                "shutdown",
                "sink",
                "source",
                "transaction"
            ]
        );
        let found = errors(&format!("{BASE}\n[checkpoint]\nretian = 3\n"), &[]);
        assert_eq!(
            found[0].to_string(),
            "checkpoint.retian: unknown key: [checkpoint] accepts interval, min_pause, timeout, retain, max_bytes; check the spelling"
        );
        let found = errors(&format!("{BASE}\n[transaction]\ntimeuot = \"1s\"\n"), &[]);
        assert!(
            found[0].message.contains("[transaction] accepts timeout;"),
            "{}",
            found[0]
        );
        let found = errors(BASE, &[("EOS_BRIDGE__LOGGING__LEVEL", "debug")]);
        assert_eq!(
            found[0].to_string(),
            "logging: unknown key (set by EOS_BRIDGE__LOGGING__LEVEL): the top level accepts bridge, source, sink, checkpoint, transaction, api, shutdown, offsets; check the spelling"
        );
    }

    #[test]
    fn the_epoch_bound_defaults_by_delivery_mode_and_a_set_value_wins() {
        let bound = |env: &[(&str, &str)]| load(BASE, env).unwrap().checkpoint.max_bytes;
        assert_eq!(bound(&[]), 256 * MIB);
        assert_eq!(
            bound(&[("EOS_BRIDGE__BRIDGE__DELIVERY", "at-least-once")]),
            256 * MIB
        );
        // At-most-once holds the epoch's records in memory: the bound stays small there.
        assert_eq!(
            bound(&[("EOS_BRIDGE__BRIDGE__DELIVERY", "at-most-once")]),
            64 * MIB
        );
        for delivery in ["exactly-once", "at-most-once"] {
            assert_eq!(
                bound(&[
                    ("EOS_BRIDGE__BRIDGE__DELIVERY", delivery),
                    ("EOS_BRIDGE__CHECKPOINT__MAX_BYTES", "1048576"),
                ]),
                1024 * 1024
            );
        }
    }

    #[test]
    fn a_config_written_with_toml_loads_back_the_same() {
        let mut config = load(BASE, &[]).unwrap();
        config.bridge.delivery = Delivery::AtLeastOnce;
        config.source.start = StartPosition::Timestamp(1_700_000_000_000);
        config.source.kafka = [("client.id", "c"), ("fetch.max.bytes", "1048576")]
            .into_iter()
            .collect();
        config.sink.kafka = [("sasl.password", "pw"), ("linger.ms", "5")]
            .into_iter()
            .collect();
        config.checkpoint.min_pause = Duration::from_millis(1500);
        config.api.admin_token = Some(Secret::new("tok"));
        config.api.ready_max_age = Some(Duration::from_secs(90));
        let text = toml::to_string(&config).unwrap();
        assert!(text.contains("min_pause = \"1s 500ms\""), "{text}");
        assert_eq!(load(&text, &[]), Ok(config.clone()));
        // Unset optional keys are left out rather than written empty.
        config.api.admin_token = None;
        let text = toml::to_string(&config).unwrap();
        assert!(!text.contains("admin_token"), "{text}");
        assert_eq!(load(&text, &[]), Ok(config));
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
