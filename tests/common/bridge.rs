//! Running the real eos-bridge binary in tests: a config file of its own, a free API port,
//! kill -9, SIGTERM, and waiting on its status endpoint with bounded deadlines.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::*;

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Settings of one bridge under test; `toml()` renders the config file.
#[derive(Clone, Debug)]
pub struct BridgeSpec {
    pub id: String,
    pub instance: u32,
    pub instances: u32,
    pub delivery: &'static str,
    pub source_bootstrap: String,
    pub sink_bootstrap: String,
    pub source_topics: Vec<String>,
    pub sink_topic: String,
    pub partitioning: &'static str,
    /// Empty: leave `sink.marker_topic` unset, so the bridge uses its default topic.
    pub marker_topic: String,
    pub interval: &'static str,
    pub checkpoint_timeout: &'static str,
    pub transaction_timeout: &'static str,
    pub on_offset_out_of_range: &'static str,
    pub shutdown_timeout: &'static str,
    /// Extra lines of the `[api]` table (TLS files, an admin token).
    pub api_extra: String,
    /// Extra lines appended to the file (e.g. a [sink.kafka] table).
    pub extra: String,
}

impl BridgeSpec {
    /// A bridge from `source_topic` to `sink_topic` on the shared test broker, with names of its own.
    pub fn new(source_topic: &str, sink_topic: &str) -> BridgeSpec {
        BridgeSpec {
            id: unique("bridge"),
            instance: 0,
            instances: 1,
            delivery: "exactly-once",
            source_bootstrap: bootstrap().to_string(),
            sink_bootstrap: bootstrap().to_string(),
            source_topics: vec![source_topic.to_string()],
            sink_topic: sink_topic.to_string(),
            partitioning: "preserve",
            marker_topic: unique("markers"),
            interval: "300ms",
            checkpoint_timeout: "10s",
            transaction_timeout: "30s",
            on_offset_out_of_range: "fail",
            shutdown_timeout: "20s",
            api_extra: String::new(),
            extra: String::new(),
        }
    }

    pub fn toml(&self, state_dir: &Path, port: u16) -> String {
        let topics: Vec<String> = self
            .source_topics
            .iter()
            .map(|t| format!("{t:?}"))
            .collect();
        format!(
            r#"[bridge]
id = "{id}"
instance = {instance}
instances = {instances}
state_dir = {state:?}
delivery = "{delivery}"

[source]
bootstrap_servers = "{sb}"
topics = [{topics}]
start = "earliest"
on_offset_out_of_range = "{oor}"

[sink]
bootstrap_servers = "{kb}"
topic = "{sink_topic}"
partitioning = "{partitioning}"
{marker}

[checkpoint]
interval = "{interval}"
timeout = "{ctimeout}"

[transaction]
timeout = "{ttimeout}"

[api]
{api_extra}listen = "127.0.0.1:{port}"

[shutdown]
timeout = "{stimeout}"
{extra}
"#,
            id = self.id,
            instance = self.instance,
            instances = self.instances,
            state = state_dir.to_str().unwrap(),
            delivery = self.delivery,
            sb = self.source_bootstrap,
            kb = self.sink_bootstrap,
            topics = topics.join(", "),
            oor = self.on_offset_out_of_range,
            sink_topic = self.sink_topic,
            partitioning = self.partitioning,
            marker = if self.marker_topic.is_empty() {
                String::new()
            } else {
                format!("marker_topic = {:?}", self.marker_topic)
            },
            interval = self.interval,
            ctimeout = self.checkpoint_timeout,
            ttimeout = self.transaction_timeout,
            port = port,
            stimeout = self.shutdown_timeout,
            api_extra = self.api_extra,
            extra = self.extra,
        )
    }
}

/// One running bridge process.
pub struct Bridge {
    pub child: Child,
    pub port: u16,
    pub log: PathBuf,
}

/// A state directory and config for a bridge that is started, killed and restarted.
pub struct BridgeHome {
    pub dir: tempfile::TempDir,
    pub spec: BridgeSpec,
}

impl BridgeHome {
    pub fn new(spec: BridgeSpec) -> BridgeHome {
        BridgeHome {
            dir: temp_state_dir(),
            spec,
        }
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Starts the bridge; `env` adds variables (failpoints).
    pub fn start(&self, env: &[(&str, &str)]) -> Bridge {
        self.start_with_args(env, &[])
    }

    /// Writes the config file with the API on `port`, named after `command` and the port.
    pub fn write_config(&self, command: &str, port: u16) -> PathBuf {
        self.write_edited(command, port, &|toml| toml)
    }

    /// The same with the rendered text changed by `edit` (keys the spec does not render).
    pub fn write_edited(
        &self,
        command: &str,
        port: u16,
        edit: &dyn Fn(String) -> String,
    ) -> PathBuf {
        let path = self.dir.path().join(format!("{command}-{port}.toml"));
        std::fs::write(&path, edit(self.spec.toml(&self.state_dir(), port))).unwrap();
        path
    }

    /// The config file the bridge `bridge` was started with.
    pub fn config_of(&self, bridge: &Bridge) -> PathBuf {
        self.dir.path().join(format!("run-{}.toml", bridge.port))
    }

    /// Starts the bridge with extra arguments after `run --config FILE`.
    pub fn start_with_args(&self, env: &[(&str, &str)], args: &[&str]) -> Bridge {
        self.spawn("run", env, args)
    }

    /// `eos-bridge COMMAND --config FILE ARGS` in the background (`run`, or `check` to wait for),
    /// its output in a log file beside the config.
    pub fn spawn(&self, command: &str, env: &[(&str, &str)], args: &[&str]) -> Bridge {
        self.spawn_edited(command, env, args, &|toml| toml)
    }

    /// The same with the config file's text changed by `edit`.
    pub fn spawn_edited(
        &self,
        command: &str,
        env: &[(&str, &str)],
        args: &[&str],
        edit: &dyn Fn(String) -> String,
    ) -> Bridge {
        let port = free_port();
        let cfg_path = self.write_edited(command, port, edit);
        let log = self.dir.path().join(format!("{command}-{port}.log"));
        let log_file = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_eos-bridge"));
        cmd.args([command, "--config", cfg_path.to_str().unwrap()])
            .args(args)
            .env("EOS_BRIDGE_LOG", "info,librdkafka=warn,rdkafka=warn")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("eos-bridge starts");
        Bridge { child, port, log }
    }
}

impl Bridge {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn sigterm(&self) {
        // SAFETY: signalling a child we own.
        unsafe {
            libc::kill(self.pid(), libc::SIGTERM);
        }
    }

    /// Waits for the process to exit, at most `deadline`.
    pub fn wait_exit(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + deadline;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// GET a path of the bridge's API: (status code, body), or None if it does not answer.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(2)))
            .build()
            .into();
        let mut resp = agent
            .get(&format!("http://127.0.0.1:{}{path}", self.port))
            .call()
            .ok()?;
        let code = resp.status().as_u16();
        let body = resp.body_mut().read_to_string().ok()?;
        Some((code, body))
    }

    pub fn status(&self) -> Option<serde_json::Value> {
        let (code, body) = self.get("/api/v1/status")?;
        if code != 200 {
            return None;
        }
        serde_json::from_str(&body).ok()
    }

    /// Sum over partitions of the committed positions the bridge reports.
    pub fn committed_total(&self) -> Option<i64> {
        let st = self.status()?;
        let parts = st["partitions"].as_array()?;
        Some(
            parts
                .iter()
                .map(|p| p["position"].as_i64().unwrap_or(0))
                .sum(),
        )
    }

    pub fn last_checkpoint_id(&self) -> Option<u64> {
        self.status()?["last_checkpoint_id"].as_u64()
    }

    /// Waits until the bridge has committed positions summing to `total`, or the process exits,
    /// or `deadline` passes; panics with the log on failure.
    pub fn wait_committed(&mut self, total: i64, deadline: Duration) {
        let ok = wait_until(deadline, || {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            self.committed_total() == Some(total)
        });
        if let Ok(Some(s)) = self.child.try_wait() {
            panic!(
                "bridge exited ({s}) before committing {total}:\n{}",
                self.log_text()
            );
        }
        assert!(
            ok,
            "bridge did not commit positions summing to {total} within {deadline:?} (now {:?}):\n{}",
            self.committed_total(),
            tail(&self.log_text(), 40)
        );
    }

    /// The value of one series of /metrics, e.g. `eos_bridge_marker_wait_seconds_total` or
    /// `eos_bridge_checkpoints_total{result="completed"}`.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics")?;
        body.lines().find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
    }

    /// Waits until the bridge reports checkpoint `id` or a later one; panics with its log if not.
    pub fn wait_checkpoint(&self, id: u64, deadline: Duration) {
        let ok = wait_until(deadline, || self.last_checkpoint_id().unwrap_or(0) >= id);
        assert!(
            ok,
            "no checkpoint {id} within {deadline:?}:\n{}",
            tail(&self.log_text(), 30)
        );
    }

    /// SIGTERM, then the exit status within `deadline`.
    pub fn stop_gracefully(&mut self, deadline: Duration) -> ExitStatus {
        self.sigterm();
        match self.wait_exit(deadline) {
            Some(s) => s,
            None => {
                let log = self.log_text();
                self.kill9();
                panic!(
                    "bridge did not exit within {deadline:?} of SIGTERM:\n{}",
                    tail(&log, 40)
                );
            }
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The sum of the source topic's end offsets: for a topic written without transactions, the
/// number of records, and where every position ends once everything is bridged.
pub fn end_offsets_total(bootstrap: &str, topic: &str) -> i64 {
    end_offsets(bootstrap, topic).values().sum()
}

/// The topic's high watermark per partition, on the plaintext cluster at `bootstrap`.
pub fn end_offsets(bootstrap: &str, topic: &str) -> BTreeMap<i32, i64> {
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", bootstrap);
    high_watermarks(&config, topic)
}

/// The sum of the topic's high watermarks, asked by a client with `config` (a broker's answer; no
/// JVM start for a number the tests ask for before every wait and verdict).
pub fn watermarks_total(config: &rdkafka::ClientConfig, topic: &str) -> i64 {
    high_watermarks(config, topic).values().sum()
}

/// The topic's high watermark per partition, asked by a client with `config`.
pub fn high_watermarks(config: &rdkafka::ClientConfig, topic: &str) -> BTreeMap<i32, i64> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = config.create().expect("consumer");
    let timeout = Duration::from_secs(30);
    let metadata = consumer
        .fetch_metadata(Some(topic), timeout)
        .unwrap_or_else(|e| panic!("metadata of {topic}: {e}"));
    let partitions = metadata.topics()[0].partitions();
    assert!(!partitions.is_empty(), "topic {topic} has no partitions");
    partitions
        .iter()
        .map(|p| {
            let (_, high) = consumer
                .fetch_watermarks(topic, p.id(), timeout)
                .unwrap_or_else(|e| panic!("end offset of {topic}/{}: {e}", p.id()));
            (p.id(), high)
        })
        .collect()
}
