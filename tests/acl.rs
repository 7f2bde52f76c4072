//! Least privilege on the secured broker (scripts/kafka start --secure): a SCRAM user of its own
//! per test, granted exactly the ACLs docs/security.md lists, bridges exactly once; then each of
//! those ACLs is removed in turn and both `eos-bridge check` and `eos-bridge run` must fail within
//! seconds naming that permission and the kafka-acls command that grants it. The test re-adds the
//! ACL by running the very command the bridge printed.

mod common;

use std::collections::BTreeMap;
use std::process::Output;
use std::time::{Duration, Instant};

use common::bridge::{tail, BridgeHome, BridgeSpec};
use common::scenario::*;
use common::secure::secure_broker;
use common::*;

/// How long `check` or `run` may take to fail for a missing permission. The probe itself takes
/// well under a second against a local broker; the rest is process start and TLS handshakes on a
/// shared 2-core machine.
const FAIL_FAST: Duration = Duration::from_secs(20);

/// A Kafka tool as the super user `admin` on the secured broker (tests/common/secure.rs).
fn admin_tool(class: &str, config_flag: &str, args: &[&str]) -> Output {
    secure_broker().tool(class, config_flag, args)
}

fn must(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether `topic` exists, asked as admin.
fn topic_exists(topic: &str) -> bool {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let b = secure_broker();
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", b.sasl_ssl())
        .set("security.protocol", "SASL_SSL")
        .set("ssl.ca.location", b.get("SECURE_CA_PEM"))
        .set("sasl.mechanism", "SCRAM-SHA-512")
        .set("sasl.username", "admin")
        .set("sasl.password", b.get("SECURE_ADMIN_PASSWORD"))
        .create()
        .expect("client");
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(15))
        .expect("metadata");
    md.topics()
        .iter()
        .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
}

/// A SCRAM-SHA-512 user made now, so that no other test's ACLs apply to it.
fn create_user(name: &str, password: &str) {
    let config = format!("SCRAM-SHA-512=[password={password}]");
    must(
        admin_tool(
            "kafka.admin.ConfigCommand",
            "--command-config",
            &[
                "--alter",
                "--add-config",
                &config,
                "--entity-type",
                "users",
                "--entity-name",
                name,
            ],
        ),
        "creating the SCRAM user",
    );
}

/// One ACL as kafka-acls.sh takes it: the operation and the resource arguments.
#[derive(Clone, Debug)]
struct Acl {
    operation: &'static str,
    resource: Vec<String>,
}

impl Acl {
    fn topic(operation: &'static str, topic: &str) -> Acl {
        Acl {
            operation,
            resource: vec!["--topic".into(), topic.into()],
        }
    }

    /// What the bridge's message names for this ACL (see src/acl.rs, Permission's Display).
    fn named(&self) -> String {
        match self.resource[0].as_str() {
            "--topic" => format!("{} on topic '{}'", self.operation, self.resource[1]),
            "--group" => format!("{} on group '{}'", self.operation, self.resource[1]),
            "--transactional-id" => format!(
                "{} on transactional ids with prefix '{}'",
                self.operation, self.resource[1]
            ),
            _ => format!("{} on the cluster", self.operation),
        }
    }

    fn remove(&self, principal: &str) {
        let mut args = vec![
            "--remove",
            "--force",
            "--allow-principal",
            principal,
            "--operation",
            self.operation,
        ];
        args.extend(self.resource.iter().map(String::as_str));
        must(
            admin_tool("AclCommand", "--command-config", &args),
            &format!("kafka-acls {args:?}"),
        );
    }
}

fn offsets_topic(id: &str) -> String {
    format!("__eos_bridge_offsets.{id}")
}

/// The ACLs docs/security.md lists for an exactly-once bridge `id` from `source` to `sink`
/// (topics that the bridge creates need Create as well; `creates` says whether it does).
fn documented_set(id: &str, source: &str, sink: &str, marker: &str) -> Vec<Acl> {
    vec![
        Acl::topic("Read", source),
        Acl::topic("Write", sink),
        Acl::topic("Create", sink),
        Acl::topic("Read", marker),
        Acl::topic("Write", marker),
        Acl::topic("Create", marker),
        // The offset mapping (exactly-once under `preserve`), written in each transaction.
        Acl::topic("Write", &offsets_topic(id)),
        Acl::topic("Create", &offsets_topic(id)),
        Acl {
            operation: "Write",
            resource: vec![
                "--transactional-id".into(),
                format!("eos-bridge-{id}-"),
                "--resource-pattern-type".into(),
                "prefixed".into(),
            ],
        },
        Acl {
            operation: "DescribeConfigs",
            resource: vec!["--cluster".into()],
        },
        // Read: the monitoring commit of the bridge's positions (on by default) needs it.
        Acl {
            operation: "Read",
            resource: vec!["--group".into(), format!("eos-bridge.{id}")],
        },
        Acl {
            operation: "Describe",
            resource: vec!["--group".into(), format!("eos-bridge.{id}.marker-reader")],
        },
    ]
}

/// Grants `set` with one AclCommand run per operation and pattern type (each run of the JVM tool
/// costs seconds): topics of one operation go together.
fn grant_all(set: &[Acl], principal: &str) {
    let mut runs: BTreeMap<(&str, bool), Vec<&str>> = BTreeMap::new();
    for acl in set {
        let prefixed = acl.resource.iter().any(|w| w == "prefixed");
        let resource = runs.entry((acl.operation, prefixed)).or_default();
        resource.extend(
            acl.resource
                .iter()
                .map(String::as_str)
                .filter(|w| !matches!(*w, "--resource-pattern-type" | "prefixed")),
        );
    }
    for ((operation, prefixed), resource) in runs {
        let mut args = vec![
            "--add",
            "--allow-principal",
            principal,
            "--operation",
            operation,
        ];
        args.extend(resource);
        if prefixed {
            args.extend(["--resource-pattern-type", "prefixed"]);
        }
        must(
            admin_tool("AclCommand", "--command-config", &args),
            &format!("kafka-acls {args:?}"),
        );
    }
}

/// A SCRAM user of its own, granted the documented set of a bridge `id` from `source` to `sink`
/// (not created yet), and that bridge's spec.
struct Granted {
    password: String,
    principal: String,
    id: String,
    source: String,
    sink: String,
    marker: String,
    set: Vec<Acl>,
    spec: BridgeSpec,
}

impl Granted {
    fn new(id_prefix: &str) -> Granted {
        let user = unique("acl-user");
        let password = random_alnum(24);
        let principal = format!("User:{user}");
        create_user(&user, &password);
        let id = unique(id_prefix);
        let source = unique("acl-src");
        let sink = unique("acl-sink");
        let marker = format!("__eos_bridge_markers.{id}");
        let set = documented_set(&id, &source, &sink, &marker);
        grant_all(&set, &principal);
        Granted {
            spec: spec(&id, &source, &sink, &user),
            password,
            principal,
            id,
            source,
            sink,
            marker,
            set,
        }
    }
}

/// A bridge on the secured broker as SCRAM user `user`; its password comes from the environment.
fn spec(id: &str, source: &str, sink: &str, user: &str) -> BridgeSpec {
    let b = secure_broker();
    let mut spec = BridgeSpec::new(source, sink);
    spec.id = id.to_string();
    spec.marker_topic = String::new();
    spec.source_bootstrap = b.sasl_ssl().to_string();
    spec.sink_bootstrap = b.sasl_ssl().to_string();
    let kafka = format!(
        "security.protocol = \"SASL_SSL\"\nsasl.mechanism = \"SCRAM-SHA-512\"\nsasl.username = \"{user}\"\n\
         ssl.ca.location = \"{}\"\n",
        b.get("SECURE_CA_PEM")
    );
    spec.extra = format!("\n[source.kafka]\n{kafka}\n[sink.kafka]\n{kafka}");
    spec
}

fn password_env(password: &str) -> Vec<(String, String)> {
    ["SOURCE", "SINK"]
        .map(|side| {
            (
                format!("EOS_BRIDGE__{side}__KAFKA__SASL_PASSWORD"),
                password.to_string(),
            )
        })
        .to_vec()
}

/// Runs `eos-bridge ARGS` to its end, at most `FAIL_FAST`: (exit code, stdout + stderr, time).
fn bridge_cli(home: &BridgeHome, command: &str, password: &str) -> (Option<i32>, String, Duration) {
    let env = password_env(password);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let began = Instant::now();
    // The harness's handle kills the process when dropped, should it outlive the bound.
    let mut process = home.spawn(command, &env, &[]);
    let status = process.wait_exit(FAIL_FAST);
    let took = began.elapsed();
    let text = process.log_text();
    (status.and_then(|s| s.code()), text, took)
}

/// The kafka-acls command the bridge printed for `acl`, run (as admin) to grant it back: the
/// printed command itself is what is tested, not a copy of it.
fn grant_as_printed(text: &str, acl: &Acl) {
    let needle = format!("--operation {} {}", acl.operation, acl.resource.join(" "));
    let line = text
        .lines()
        .flat_map(|l| l.split("kafka-acls.sh ").skip(1))
        .map(|c| c.trim())
        .find(|c| c.contains(&needle))
        .unwrap_or_else(|| panic!("no kafka-acls command with '{needle}' in:\n{text}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        words.get(1),
        Some(&secure_broker().sasl_ssl()),
        "the command names the cluster: {line}"
    );
    // `--bootstrap-server B` is first; admin_tool supplies it along with the admin's settings.
    must(
        admin_tool("AclCommand", "--command-config", &words[2..]),
        &format!("the printed command {line}"),
    );
}

/// Removes each ACL of `removals` in turn; `check` and `run` must both fail fast naming it and its
/// command; the printed command grants it back. Returns the slowest failure.
fn assert_each_removal_fails(
    home: &BridgeHome,
    principal: &str,
    password: &str,
    removals: &[Acl],
) -> Duration {
    let mut slowest = Duration::ZERO;
    for acl in removals {
        acl.remove(principal);
        let named = acl.named();
        // ACL changes travel through the metadata log to the broker's authorizer: a check that
        // still passes right after the removal is asked again, within the bound.
        let mut check = bridge_cli(home, "check", password);
        let began = Instant::now();
        while check.0 == Some(0) && began.elapsed() < Duration::from_secs(10) {
            check = bridge_cli(home, "check", password);
        }
        let (code, text, took) = check;
        assert_eq!(code, Some(1), "check without {named}:\n{text}");
        assert!(
            text.contains(&format!("missing: {named}")) && text.contains("kafka-acls.sh"),
            "check names {named} and its command:\n{text}"
        );
        slowest = slowest.max(took);
        let (code, text, took) = bridge_cli(home, "run", password);
        assert_eq!(
            code,
            Some(1),
            "run without {named} exits 1 within {FAIL_FAST:?} (took {took:?}):\n{}",
            tail(&text, 30)
        );
        assert!(
            text.contains(&format!("missing permission: {named}")),
            "run names {named}:\n{}",
            tail(&text, 30)
        );
        slowest = slowest.max(took);
        grant_as_printed(&text, acl);
        eprintln!("without {named}: check and run failed, run in {took:?}");
    }
    slowest
}

#[test]
fn the_documented_acls_suffice_and_each_is_needed() {
    let _serial = serial();
    let Granted {
        password,
        principal,
        sink,
        set,
        spec,
        ..
    } = Granted::new("aclb");
    let mut s = Scenario::on_secured_broker(spec, 2);
    s.env = password_env(&password);
    s.run(&[Produce(300, 1)]);
    let t0 = Instant::now();

    // Exactly the documented set: the bridge creates its sink and marker topics and bridges
    // everything exactly once.
    let (code, text, _) = bridge_cli(&s.home, "check", &password);
    assert_eq!(code, Some(0), "check with the documented ACLs:\n{text}");
    let began = Instant::now();
    s.run(&[Start, CommittedTo(300), Stop]);
    let bridged = began.elapsed();
    let mut log = s.log();
    // A restart recovers from the commit markers it reads back: the marker reader's side of the
    // set (Read on the marker topic, Describe on its group) at work.
    s.run(&[Start, CommittedTo(300), Stop]);
    assert!(
        s.log().contains("recovered outcome=\"committed\""),
        "the restart recovered from its checkpoint and marker:\n{}",
        tail(&s.log(), 30)
    );
    log.push_str(&s.log());
    assert!(!log.contains(&password), "the password appears in the log");
    // Exactly this set: no client of the bridge was refused anything (librdkafka's consumers look
    // up their group's coordinator, which would need Describe on the group, and say so if denied).
    assert!(
        !log.to_lowercase().contains("authorization failed"),
        "a request was refused with the documented ACLs:\n{}",
        tail(&log, 30)
    );
    // The one optional permission left out is shown as such, and check passes without it.
    let (code, text, _) = bridge_cli(&s.home, "check", &password);
    assert_eq!(code, Some(0), "check after the run:\n{text}");
    assert!(
        text.contains(&format!(
            "optional, missing: DescribeConfigs on topic '{sink}'"
        )),
        "check shows the optional DescribeConfigs:\n{text}"
    );
    // Kafka's read_committed console consumer, as admin, on both topics.
    let copied = s.judge();
    assert_eq!(copied, 300);
    eprintln!("set-up done; bridged and judged in {:?}", t0.elapsed());

    // Each permission the running bridge uses, removed in turn (Create is judged below: the
    // topics exist now).
    let removals: Vec<Acl> = set
        .iter()
        .filter(|a| a.operation != "Create")
        .cloned()
        .collect();
    let slowest = assert_each_removal_fails(&s.home, &principal, &password, &removals);
    eprintln!(
        "bridged 300 records exactly once as {principal} in {bridged:?}; slowest failure {slowest:?}"
    );
}

#[test]
fn creating_missing_topics_needs_create_on_them() {
    let _serial = serial();
    let g = Granted::new("aclc");
    secure_broker().create_topic(&g.source, 1);
    let home = BridgeHome::new(g.spec.clone());
    let creates: Vec<Acl> = g
        .set
        .iter()
        .filter(|a| a.operation == "Create")
        .cloned()
        .collect();
    // The probe stops both commands before anything is created, so the topics stay missing.
    let slowest = assert_each_removal_fails(&home, &g.principal, &g.password, &creates);
    for t in [&g.sink, &g.marker, &offsets_topic(&g.id)] {
        assert!(!topic_exists(t), "a failed start created topic {t}");
    }
    eprintln!("slowest failure without a Create: {slowest:?}");
}
