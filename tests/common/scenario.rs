//! The one shape most integration tests share: sequenced input on a source topic, one bridge (its
//! config and state directory) driven through a list of actions (start, kill -9, pause, wipe the
//! state directory, wait until committed, stop), and the verdict of Kafka's read_committed console
//! consumer: none missing, none twice, order kept per source partition.
//!
//! A test says what is special about it (data sizes, the fault, its own checks between actions);
//! the waits, deadlines and failure messages with the bridge's log live here once.

use std::process::{Child, ExitStatus};
use std::time::Duration;

use rand::Rng;

use super::bridge::*;
use super::secure::*;
use super::*;

/// How long a bridge may take for a wait the test does not bound itself.
const DEFAULT_WAIT: Duration = Duration::from_secs(60);
/// SIGTERM to exit: a graceful stop commits or aborts the open epoch well within this.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// One step of a scenario; `Scenario::run` performs them in order.
#[derive(Clone, Copy, Debug)]
pub enum Action<'a> {
    /// `count` sequenced records with the value prefix, by Kafka's VerifiableProducer (acks=all).
    Produce(u64, u32),
    /// Starts the bridge.
    Start,
    /// Starts the bridge with extra environment variables (failpoints, config overrides).
    StartWith(&'a [(&'a str, &'a str)]),
    /// Waits until the bridge reports this checkpoint id or a later one.
    WaitCheckpoint(u64),
    /// Waits until the bridge has committed the input's end offsets, within 60 s.
    Committed,
    /// The same within this many seconds.
    CommittedWithin(u64),
    /// Waits until the bridge's committed positions sum to exactly this, within 60 s.
    CommittedTo(i64),
    /// Sleeps a random time in [from, to) milliseconds: the random instant of the next fault, not
    /// a wait for a condition.
    Jitter(u64, u64),
    /// kill -9 of the bridge.
    Kill9,
    /// Deletes the state directory (the bridge must not be running).
    WipeState,
    /// SIGSTOP: the process freezes with whatever transaction it has open.
    Pause,
    /// SIGCONT.
    Resume,
    /// SIGTERM; the bridge must exit 0 within 30 s.
    Stop,
    /// The exactly-once verdict over the whole input and output.
    Judge,
}

pub use Action::*;

/// An input topic, an output topic and one bridge between them.
pub struct Scenario {
    pub source: String,
    pub sink: String,
    pub input: String,
    pub output: String,
    pub home: BridgeHome,
    /// Environment every start of the bridge gets (passwords referenced by the config).
    pub env: Vec<(String, String)>,
    /// Both topics on the secured broker, written and read as its admin user.
    secured: Option<&'static SecureBroker>,
    partitions: u32,
    bridge: Option<Bridge>,
}

impl Scenario {
    /// Topics `NAME-in-…` (created, `partitions`) and `NAME-out-…` on the shared test broker.
    pub fn new(name: &str, partitions: u32) -> Scenario {
        Scenario::between(bootstrap(), bootstrap(), name, partitions)
    }

    /// The same with the input on cluster `source` and the output on cluster `sink`.
    pub fn between(source: &str, sink: &str, name: &str, partitions: u32) -> Scenario {
        let input = unique(&format!("{name}-in"));
        let output = unique(&format!("{name}-out"));
        create_topic(source, &input, partitions);
        let mut spec = BridgeSpec::new(&input, &output);
        spec.source_bootstrap = source.to_string();
        spec.sink_bootstrap = sink.to_string();
        Scenario {
            source: source.to_string(),
            sink: sink.to_string(),
            input,
            output,
            home: BridgeHome::new(spec),
            env: Vec::new(),
            secured: None,
            partitions,
            bridge: None,
        }
    }

    /// Topics `NAME-in-…` (created, `partitions`) and `NAME-out-…` on the secured broker, the
    /// bridge connecting to each side with its settings.
    pub fn secured(
        name: &str,
        partitions: u32,
        source: &ClientSettings,
        sink: &ClientSettings,
    ) -> Scenario {
        let input = unique(&format!("{name}-in"));
        let output = unique(&format!("{name}-out"));
        let mut s = Scenario::on_secured_broker(BridgeSpec::new(&input, &output), partitions);
        s.clients(source, sink);
        s
    }

    /// A scenario on the secured broker for a bridge configured by `spec` (its first source topic
    /// is created, with `partitions`).
    pub fn on_secured_broker(spec: BridgeSpec, partitions: u32) -> Scenario {
        let broker = secure_broker();
        let input = spec.source_topics[0].clone();
        broker.create_topic(&input, partitions);
        Scenario {
            source: spec.source_bootstrap.clone(),
            sink: spec.sink_bootstrap.clone(),
            output: spec.sink_topic.clone(),
            input,
            home: BridgeHome::new(spec),
            env: Vec::new(),
            secured: Some(broker),
            partitions,
            bridge: None,
        }
    }

    /// Each side's connection settings (and the passwords' environment), from the next start.
    pub fn clients(&mut self, source: &ClientSettings, sink: &ClientSettings) {
        let with = secured_spec(&self.input, &self.output, source, sink);
        let spec = &mut self.home.spec;
        spec.source_bootstrap = with.source_bootstrap;
        spec.sink_bootstrap = with.sink_bootstrap;
        spec.extra = with.extra;
        self.env = secured_env(source, sink);
    }

    /// Changes the bridge's settings; they apply from the next start.
    pub fn with(mut self, configure: impl FnOnce(&mut BridgeSpec)) -> Scenario {
        configure(&mut self.home.spec);
        self
    }

    pub fn spec(&mut self) -> &mut BridgeSpec {
        &mut self.home.spec
    }

    /// The transactional id of the bridge's instance, as TransactionsCommand knows it.
    pub fn transactional_id(&self) -> String {
        format!(
            "eos-bridge-{}-{}",
            self.home.spec.id, self.home.spec.instance
        )
    }

    pub fn run(&mut self, actions: &[Action]) {
        for action in actions {
            match *action {
                Produce(count, prefix) => self.produce(count, prefix),
                Start => {
                    self.start(&[]);
                }
                StartWith(env) => {
                    self.start(env);
                }
                WaitCheckpoint(id) => self.bridge().wait_checkpoint(id, DEFAULT_WAIT),
                Committed => {
                    self.wait_committed(DEFAULT_WAIT);
                }
                CommittedWithin(secs) => {
                    self.wait_committed(Duration::from_secs(secs));
                }
                CommittedTo(total) => self.bridge().wait_committed(total, DEFAULT_WAIT),
                Jitter(from, to) => {
                    let ms = rand::rng().random_range(from..to);
                    std::thread::sleep(Duration::from_millis(ms));
                }
                Kill9 => self.bridge().kill9(),
                WipeState => self.wipe_state(),
                Pause => self.signal(libc::SIGSTOP),
                Resume => self.signal(libc::SIGCONT),
                Stop => self.stop(),
                Judge => {
                    self.judge();
                }
            }
        }
    }

    pub fn produce(&self, count: u64, prefix: u32) {
        if let Some(broker) = self.secured {
            broker.produce(&self.input, self.partitions as i32, count, prefix);
            return;
        }
        let out = verifiable_produce(&self.source, &self.input, count, -1, Some(prefix));
        assert!(
            out.status.success(),
            "producing {count} records to {}: {}",
            self.input,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Input that keeps arriving (`rate` records/s) while the test does other things.
    pub fn produce_in_background(&self, count: u64, rate: u64, prefix: u32) -> Child {
        background_producer(&self.source, &self.input, count, rate, prefix)
    }

    /// The sum of the input's end offsets: its record count, and where every position ends.
    pub fn input_total(&self) -> i64 {
        match self.secured {
            Some(broker) => broker.end_offsets_total(&self.input),
            None => end_offsets_total(&self.source, &self.input),
        }
    }

    /// Starts the bridge with the scenario's environment and `env`; one still running is killed
    /// -9 first, as a supervisor's restart would.
    pub fn start(&mut self, env: &[(&str, &str)]) -> &mut Bridge {
        if let Some(mut old) = self.bridge.take() {
            old.kill9();
        }
        let mut all: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        all.extend_from_slice(env);
        self.bridge.insert(self.home.start(&all))
    }

    /// The config file of the bridge started last.
    pub fn config(&self) -> PathBuf {
        self.home.config_of(
            self.bridge
                .as_ref()
                .expect("the scenario has started a bridge"),
        )
    }

    /// The bridge started last (running or not).
    pub fn bridge(&mut self) -> &mut Bridge {
        self.bridge
            .as_mut()
            .expect("the scenario has started a bridge")
    }

    /// The log of the bridge started last.
    pub fn log(&self) -> String {
        self.bridge
            .as_ref()
            .map(Bridge::log_text)
            .unwrap_or_default()
    }

    /// Waits until the bridge has committed all of the input; returns that total.
    pub fn wait_committed(&mut self, within: Duration) -> i64 {
        let total = self.input_total();
        self.bridge().wait_committed(total, within);
        total
    }

    /// Waits for a bridge that must stop by itself; panics with its log if it keeps running.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let bridge = self.bridge();
        match bridge.wait_exit(within) {
            Some(status) => status,
            None => panic!(
                "the bridge did not exit within {within:?} (last checkpoint {:?}, committed \
                 positions {:?}):\n{}",
                bridge.last_checkpoint_id(),
                bridge.committed_total(),
                tail(&bridge.log_text(), 30)
            ),
        }
    }

    pub fn stop(&mut self) {
        let bridge = self.bridge();
        let status = bridge.stop_gracefully(STOP_WAIT);
        assert!(
            status.success(),
            "graceful stop exits 0, got {status}:\n{}",
            tail(&bridge.log_text(), 30)
        );
    }

    pub fn wipe_state(&mut self) {
        assert!(
            self.bridge
                .as_mut()
                .is_none_or(|b| matches!(b.child.try_wait(), Ok(Some(_)))),
            "the state directory is wiped under a stopped bridge only"
        );
        let dir = self.home.state_dir();
        if dir.exists() {
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    fn signal(&mut self, signal: libc::c_int) {
        let pid = self.bridge().pid();
        // SAFETY: signalling a child we own.
        unsafe {
            libc::kill(pid, signal);
        }
    }

    /// Exactly once, by Kafka's console consumer with read_committed on both sides, and as many
    /// records as the input's end offsets say. Returns the record count.
    pub fn judge(&self) -> i64 {
        let total = self.input_total();
        let seen = match self.secured {
            Some(broker) => broker.assert_exactly_once(&self.input, total as usize, &self.output),
            None => assert_exactly_once(
                &self.source,
                &self.input,
                &self.sink,
                &self.output,
                self.sink_writer(),
            ),
        } as i64;
        assert_eq!(seen, total, "the sink holds as many records as the input");
        seen
    }

    /// How the bridge writes the output: in transactions when exactly-once.
    pub fn sink_writer(&self) -> Writer {
        if self.home.spec.delivery == "exactly-once" {
            Writer::Transactional
        } else {
            Writer::Plain
        }
    }

    /// The input per partition in offset order, as the read_committed console consumer sees it.
    pub fn input_records(&self) -> BTreeMap<i32, Vec<String>> {
        let total = usize::try_from(self.input_total()).ok();
        by_partition(&read_committed_whole(
            &self.source,
            &self.input,
            total,
            Writer::Plain,
            READ_IDLE,
        ))
    }

    /// The exactly-once verdict against records read before: the output holds exactly
    /// `expected`'s values per partition, in order, as the read_committed console consumer sees it.
    pub fn assert_output(&self, expected: &BTreeMap<i32, Vec<String>>) {
        let total = expected.values().map(Vec::len).sum();
        let output = read_committed_whole(
            &self.sink,
            &self.output,
            Some(total),
            self.sink_writer(),
            READ_IDLE,
        );
        assert_same_sequences(expected, &by_partition(&output));
    }

    /// Both, read at once: for topics that no longer change (the bridge has stopped or exited).
    pub fn input_and_output_records(
        &self,
    ) -> (BTreeMap<i32, Vec<String>>, BTreeMap<i32, Vec<String>>) {
        let (input, output) = read_committed_both(
            (&self.source, &self.input),
            (&self.sink, &self.output),
            READ_IDLE,
        );
        (by_partition(&input), by_partition(&output))
    }
}

/// How long the console consumer reads on after the last record.
const READ_IDLE: Duration = Duration::from_secs(5);
