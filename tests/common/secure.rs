//! The secured broker of `scripts/kafka start --secure` for the tests: where it is, how each
//! mechanism is configured, and Kafka's own tools over its SASL_SSL listener as `admin`.
//!
//! `EOS_BRIDGE_TEST_SECURE_DIR` names the run dir of a running secured broker (CI starts one);
//! otherwise the first test of the process starts a private one, stopped when the process exits.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use super::*;

pub struct SecureBroker {
    pub dir: PathBuf,
    env: BTreeMap<String, String>,
}

/// How a client authenticates; each is a separate set of librdkafka properties.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Auth {
    Plain,
    Scram256,
    Scram512,
    /// librdkafka's unsecured JWT; the principal is the token's subject.
    OAuthBearer,
    /// The SSL listener with a client certificate.
    MutualTls,
}

/// One side's connection settings: `[source.kafka]` or `[sink.kafka]` properties, and the
/// environment that carries the password (never the file).
#[derive(Clone, Debug)]
pub struct ClientSettings {
    pub bootstrap: String,
    pub props: Vec<(String, String)>,
    pub password: Option<String>,
}

impl ClientSettings {
    /// The `[SECTION.kafka]` table for the config file.
    pub fn table(&self, section: &str) -> String {
        let mut t = format!("\n[{section}.kafka]\n");
        for (k, v) in &self.props {
            t.push_str(&format!("{k:?} = {v:?}\n"));
        }
        t
    }

    /// `EOS_BRIDGE__SOURCE__KAFKA__SASL_PASSWORD` and the like.
    pub fn env(&self, section: &str) -> Vec<(String, String)> {
        self.password
            .iter()
            .map(|p| {
                (
                    format!(
                        "EOS_BRIDGE__{}__KAFKA__SASL_PASSWORD",
                        section.to_uppercase()
                    ),
                    p.clone(),
                )
            })
            .collect()
    }

    pub fn with(mut self, key: &str, value: &str) -> ClientSettings {
        self.props.retain(|(k, _)| k != key);
        self.props.push((key.to_string(), value.to_string()));
        self
    }
}

/// The shared secured broker of this test process, with `User:bridge` allowed everything.
pub fn secure_broker() -> &'static SecureBroker {
    static BROKER: OnceLock<SecureBroker> = OnceLock::new();
    BROKER.get_or_init(|| {
        let dir = match std::env::var("EOS_BRIDGE_TEST_SECURE_DIR") {
            Ok(d) if !d.is_empty() => PathBuf::from(d),
            _ => {
                let name = format!("secure-{}", random_suffix());
                register_stop(&name);
                let out = Command::new(kafka_script())
                    .args(["start", "--secure", "--name", &name, "--fresh"])
                    .stderr(Stdio::inherit())
                    .output()
                    .expect("scripts/kafka runs");
                assert!(out.status.success(), "starting a secured broker failed");
                let out = Command::new(kafka_script())
                    .args(["dir", "--name", &name])
                    .output()
                    .expect("scripts/kafka runs");
                PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
            }
        };
        let text = std::fs::read_to_string(dir.join("secure.env"))
            .unwrap_or_else(|e| panic!("{}/secure.env: {e}", dir.display()));
        let env = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let b = SecureBroker { dir, env };
        b.grant_all("User:bridge");
        b
    })
}

impl SecureBroker {
    pub fn get(&self, key: &str) -> &str {
        self.env
            .get(key)
            .unwrap_or_else(|| panic!("secure.env has no {key}"))
    }

    pub fn sasl_ssl(&self) -> &str {
        self.get("SECURE_SASL_SSL_BOOTSTRAP")
    }

    pub fn admin_properties(&self) -> &str {
        self.get("SECURE_ADMIN_PROPERTIES")
    }

    /// Connection settings of `user` with `auth`, the server verified with the broker's CA.
    pub fn client(&self, auth: Auth, user: &str) -> ClientSettings {
        let u = user.to_uppercase();
        let ca = self.get("SECURE_CA_PEM").to_string();
        let p = |k: &str, v: &str| (k.to_string(), v.to_string());
        let sasl = |mechanism: &str| {
            vec![
                p("security.protocol", "SASL_SSL"),
                p("ssl.ca.location", &ca),
                p("sasl.mechanism", mechanism),
                p("sasl.username", user),
            ]
        };
        let password = Some(self.get(&format!("SECURE_{u}_PASSWORD")).to_string());
        let (bootstrap, props, password) = match auth {
            Auth::Plain => (self.sasl_ssl(), sasl("PLAIN"), password),
            Auth::Scram256 => (self.sasl_ssl(), sasl("SCRAM-SHA-256"), password),
            Auth::Scram512 => (self.sasl_ssl(), sasl("SCRAM-SHA-512"), password),
            Auth::OAuthBearer => (
                self.sasl_ssl(),
                vec![
                    p("security.protocol", "SASL_SSL"),
                    p("ssl.ca.location", &ca),
                    p("sasl.mechanism", "OAUTHBEARER"),
                    p("enable.sasl.oauthbearer.unsecure.jwt", "true"),
                    p("sasl.oauthbearer.config", &format!("principal={user}")),
                ],
                None,
            ),
            Auth::MutualTls => (
                self.get("SECURE_SSL_BOOTSTRAP"),
                vec![
                    p("security.protocol", "SSL"),
                    p("ssl.ca.location", &ca),
                    p(
                        "ssl.certificate.location",
                        self.get(&format!("SECURE_{u}_CERT_PEM")),
                    ),
                    p("ssl.key.location", self.get(&format!("SECURE_{u}_KEY_PEM"))),
                ],
                None,
            ),
        };
        ClientSettings {
            bootstrap: bootstrap.to_string(),
            props,
            password,
        }
    }

    /// A Kafka tool run as `admin` over SASL_SSL; `config_flag` is the tool's name for its client
    /// config file (`--command-config`, `--producer.config`, ...).
    pub fn tool(&self, class: &str, config_flag: &str, args: &[&str]) -> Output {
        let mut all = vec![
            "--bootstrap-server",
            self.sasl_ssl(),
            config_flag,
            self.admin_properties(),
        ];
        all.extend_from_slice(args);
        kafka_tool(class, &all)
    }

    fn grant_all(&self, principal: &str) {
        let out = self.tool(
            "AclCommand",
            "--command-config",
            &[
                "--add",
                "--allow-principal",
                principal,
                "--operation",
                "All",
                "--topic",
                "*",
                "--group",
                "*",
                "--transactional-id",
                "*",
                "--cluster",
            ],
        );
        assert!(
            out.status.success(),
            "granting {principal} ACLs failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// librdkafka settings of `admin` over SASL_SSL, for writing test input without a JVM start.
    fn admin_client_config(&self) -> rdkafka::ClientConfig {
        let mut cc = rdkafka::ClientConfig::new();
        cc.set("bootstrap.servers", self.sasl_ssl())
            .set("security.protocol", "SASL_SSL")
            .set("ssl.ca.location", self.get("SECURE_CA_PEM"))
            .set("sasl.mechanism", "SCRAM-SHA-512")
            .set("sasl.username", "admin")
            .set("sasl.password", self.get("SECURE_ADMIN_PASSWORD"));
        cc
    }

    pub fn create_topic(&self, topic: &str, partitions: u32) {
        use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
        let admin: AdminClient<rdkafka::client::DefaultClientContext> =
            self.admin_client_config().create().expect("admin client");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let results = rt
            .block_on(admin.create_topics(
                &[NewTopic::new(
                    topic,
                    partitions as i32,
                    TopicReplication::Fixed(1),
                )],
                &opts,
            ))
            .expect("create_topics");
        for r in results {
            r.unwrap_or_else(|(t, e)| panic!("creating {t} failed: {e}"));
        }
    }

    /// `count` records with values "PREFIX.N", record N to partition N mod `partitions`, acks=all.
    pub fn produce(&self, topic: &str, partitions: i32, count: u64, prefix: u32) {
        use rdkafka::producer::{DefaultProducerContext, Producer, ThreadedProducer};
        let producer: ThreadedProducer<DefaultProducerContext> = self
            .admin_client_config()
            .set("acks", "all")
            .create()
            .expect("producer");
        for n in 0..count {
            send_to_partition(
                &producer,
                topic,
                (n % partitions as u64) as i32,
                &format!("{prefix}.{n}"),
            );
        }
        producer
            .flush(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("producing to {topic}: {e}"));
    }

    /// The sum of the topic's end offsets (its record count when written without transactions).
    pub fn end_offsets_total(&self, topic: &str) -> i64 {
        bridge::watermarks_total(&self.admin_client_config(), topic)
    }

    /// The topic as Kafka's console consumer reads it with read_committed over SASL_SSL: all of
    /// it (until idle for 8 s), or the first `count` records (at most 60 s).
    pub fn consume_committed(&self, topic: &str, count: Option<usize>) -> Vec<Seen> {
        let max = count.map(|c| c.to_string());
        let read = console_read_args(topic, "read_committed", &PRINT_RECORD);
        let mut args: Vec<&str> = read.iter().map(String::as_str).collect();
        args.push("--from-beginning");
        // The idle timeout is the time between two records: on a loaded machine a TLS consumer can
        // pause for seconds between partitions, so the known count ends the read when there is one.
        match &max {
            Some(m) => args.extend_from_slice(&["--max-messages", m, "--timeout-ms", "60000"]),
            None => args.extend_from_slice(&["--timeout-ms", "8000"]),
        }
        let out = self.tool("ConsoleConsumer", "--consumer.config", &args);
        parse_console_lines(&String::from_utf8_lossy(&out.stdout))
    }

    /// The exactly-once verdict between two topics of this broker, the source holding `records`
    /// records (none in transactions); returns the sink's count.
    pub fn assert_exactly_once(
        &self,
        source_topic: &str,
        records: usize,
        sink_topic: &str,
    ) -> usize {
        // Both reads at once (the bridge has stopped, neither topic changes). The sink's read
        // stops at the source's count; it is the whole topic when it reached the end offsets,
        // else (a duplicate the count cut off, a record missing) a read until idle decides.
        let ends = bridge::high_watermarks(&self.admin_client_config(), sink_topic);
        let (source_records, sink_records) = std::thread::scope(|scope| {
            let source = scope.spawn(|| self.consume_committed(source_topic, Some(records)));
            let mut sink_records = self.consume_committed(sink_topic, Some(records));
            if sink_records.len() != records
                || !read_to_the_end(&sink_records, &ends, Writer::Transactional)
            {
                sink_records = self.consume_committed(sink_topic, None);
            }
            (source.join().expect("the source read"), sink_records)
        });
        assert_eq!(source_records.len(), records, "the whole source was read");
        let source = by_partition(&source_records);
        assert_same_sequences(&source, &by_partition(&sink_records));
        sink_records.len()
    }
}

/// A bridge from `input` to `output` with the given settings on each side.
pub fn secured_spec(
    input: &str,
    output: &str,
    source: &ClientSettings,
    sink: &ClientSettings,
) -> bridge::BridgeSpec {
    let mut spec = bridge::BridgeSpec::new(input, output);
    spec.source_bootstrap = source.bootstrap.clone();
    spec.sink_bootstrap = sink.bootstrap.clone();
    spec.extra = format!("{}{}", source.table("source"), sink.table("sink"));
    spec
}

/// The environment a bridge with these settings needs (the passwords).
pub fn secured_env(source: &ClientSettings, sink: &ClientSettings) -> Vec<(String, String)> {
    let mut env = source.env("source");
    env.extend(sink.env("sink"));
    env
}

/// How long a failing bridge or check may take to exit, at most, in these tests.
pub const FAILURE_BOUND: Duration = Duration::from_secs(30);
