//! Secrets on the real broker: passwords and the admin token referenced from a file and from the
//! environment (`${file:...}`, `${env:...}`), a bridge that runs with them and bridges exactly
//! once (judged by Kafka's console consumer, read_committed), and every output a person or a log
//! collector can see grepped for each secret: the log at debug level (librdkafka's too),
//! /api/v1/status, /metrics, `eos-bridge check`, failing configurations and a panic. Then the
//! API over HTTPS with a certificate made here: health, status and an admin call with the bearer
//! token over TLS, and plain HTTP refused on that port.

mod common;

use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::Duration;

use common::bridge::*;
use common::scenario::*;
use common::*;

/// The secrets of one test, random so that a hit can only come from a leak.
struct Secrets {
    file_password: String,
    env_password: String,
    env_token: String,
}

impl Secrets {
    fn new() -> Secrets {
        Secrets {
            file_password: format!("filepw-{}", random_alnum(16)),
            env_password: format!("envpw-{}", random_alnum(16)),
            env_token: format!("envtok-{}", random_alnum(16)),
        }
    }

    fn all(&self) -> [&str; 3] {
        [&self.file_password, &self.env_password, &self.env_token]
    }

    /// Fails naming the secret and where it appeared (but not the text around it).
    #[track_caller]
    fn assert_absent(&self, what: &str, text: &str) {
        for secret in self.all() {
            assert!(!text.contains(secret), "a secret appears in {what}");
        }
    }
}

/// The variable names the configuration references; not `EOS_BRIDGE__*` overrides.
const PASSWORD_VAR: &str = "SECRETS_TEST_SINK_PASSWORD";
const TOKEN_VAR: &str = "SECRETS_TEST_ADMIN_TOKEN";

/// The `[api]` and `kafka` lines referencing the secrets. The passwords are set on plaintext
/// listeners, where librdkafka does not use them: what is tested is that they never show.
fn secret_lines(password_file: &Path) -> String {
    format!(
        r#"
[source.kafka]
"sasl.password" = "${{file:{pw}}}"
"debug" = "conf,security"

[sink.kafka]
"sasl.password" = "${{env:{PASSWORD_VAR}}}"
"debug" = "conf,security"
"#,
        pw = password_file.display()
    )
}

/// The `[api]` line referencing the admin token from the environment.
fn token_line() -> String {
    format!("admin_token = \"${{env:{TOKEN_VAR}}}\"\n")
}

/// A scenario whose bridge references new secrets by `secret_lines`; the password file ends in a
/// newline, as `kubectl create secret --from-file` leaves one.
fn with_secrets(name: &str, partitions: u32) -> (Secrets, Scenario) {
    let secrets = Secrets::new();
    let mut s = Scenario::new(name, partitions);
    let password_file = s.home.dir.path().join("source-password");
    std::fs::write(&password_file, format!("{}\n", secrets.file_password)).unwrap();
    s.spec().extra = secret_lines(&password_file);
    (secrets, s)
}

/// `eos-bridge COMMAND --config CONFIG` run to its end with `env`: its exit status and its
/// stdout and stderr as one text.
fn cli(command: &str, config: &Path, env: &[(&str, &str)]) -> (ExitStatus, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_eos-bridge"))
        .args([command, "--config", path_str(config)])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

#[test]
fn secrets_from_a_file_and_the_environment_never_appear_in_any_output() {
    let _serial = serial();
    let (secrets, mut s) = with_secrets("secrets", 2);
    s.spec().api_extra = token_line();
    let env = [
        (PASSWORD_VAR, secrets.env_password.as_str()),
        (TOKEN_VAR, secrets.env_token.as_str()),
        ("EOS_BRIDGE_LOG", "debug"),
    ];
    s.run(&[Produce(1000, 1), StartWith(&env), Committed]);
    let id = s.home.spec.id.clone();
    let config = s.config();
    let bridge = s.bridge();
    let port = bridge.port;

    // The token came from ${env:...}: the admin endpoint takes it, and refuses a wrong one.
    let url = format!("http://127.0.0.1:{port}/api/v1/savepoints");
    let post = |token: &str| {
        let mut resp = http_agent()
            .post(&url)
            .header("Content-Type", "application/json")
            .header("Authorization", &format!("Bearer {token}"))
            .send(r#"{"name": "sp-secrets"}"#)
            .unwrap();
        let code = resp.status().as_u16();
        (code, resp.body_mut().read_to_string().unwrap_or_default())
    };
    assert_eq!(post("wrong").0, 401);
    let (code, body) = post(&secrets.env_token);
    assert_eq!(code, 201, "{body}");
    secrets.assert_absent("a savepoint answer", &body);

    let (code, status) = bridge.get("/api/v1/status").unwrap();
    assert_eq!(code, 200);
    assert!(status.contains(&id), "{status}");
    secrets.assert_absent("/api/v1/status", &status);
    let (code, metrics) = bridge.get("/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(
        metrics.contains("eos_bridge_checkpoints_total"),
        "{metrics}"
    );
    secrets.assert_absent("/metrics", &metrics);
    for path in ["/health/ready", "/api/v1/checkpoints", "/api/v1/savepoints"] {
        let (_, body) = bridge.get(path).unwrap();
        secrets.assert_absent(path, &body);
    }

    s.run(&[Stop]);
    assert_eq!(s.judge(), 1000);

    let text = s.log();
    // The log really is at debug level, librdkafka's debug contexts included.
    assert!(text.contains("DEBUG"), "{}", tail(&text, 20));
    // librdkafka's dump of its configuration is in it, and names the password it redacts.
    assert!(
        text.contains("sasl.password = [redacted]"),
        "{}",
        tail(&text, 20)
    );
    secrets.assert_absent("the bridge's log at debug level", &text);

    // `check`, at debug level too, passes with the same references and shows none of them.
    let (status, text) = cli("check", &config, &env);
    assert!(status.success(), "{text}");
    assert!(text.contains("configuration"), "{text}");
    secrets.assert_absent("`eos-bridge check`", &text);
}

#[test]
fn failing_configurations_do_not_show_secrets() {
    let secrets = Secrets::new();
    let dir = temp_state_dir();
    let password_file = dir.path().join("pw");
    std::fs::write(&password_file, &secrets.file_password).unwrap();
    let env = [
        (PASSWORD_VAR, secrets.env_password.as_str()),
        (TOKEN_VAR, secrets.env_token.as_str()),
        ("EOS_BRIDGE_LOG", "debug"),
    ];
    let mut spec = BridgeSpec::new("secrets-bad-in", "secrets-bad-out");
    spec.api_extra = token_line();
    let good = spec.toml(&dir.path().join("state"), free_port()) + &secret_lines(&password_file);

    // Each bad file still holds every secret: referenced, written inline, or both; its errors
    // must be reported without them.
    let cases: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "rule violations beside inline and referenced secrets",
            good.replace("interval = \"300ms\"", "interval = \"fast\"")
                + &format!(
                    "\"sasl.username\" = \"u\"\n\"ssl.key.password\" = \"{}\"\n",
                    secrets.file_password
                ),
            vec!["checkpoint.interval"],
        ),
        (
            "a misspelled secret key",
            good.replacen(
                "[api]\n",
                &format!("[api]\nadmin_tokn = \"{}\"\n", secrets.env_token),
                1,
            ),
            vec!["api.admin_tokn", "unknown key"],
        ),
        (
            "a TOML syntax error on the line of an inline secret",
            good.replacen(
                "[api]\n",
                &format!("[api]\nready_max_age = \"{}\n", secrets.env_password),
                1,
            ),
            vec!["line"],
        ),
        (
            "a secret set twice",
            good.clone() + &format!("sasl_password = \"{}\"\n", secrets.env_password),
            vec!["sink.kafka.sasl.password", "set twice"],
        ),
        (
            "a reference to a missing file and to an unset variable",
            good.replace(path_str(&password_file), "/nonexistent/eos-bridge-secret")
                .replace(TOKEN_VAR, "SECRETS_TEST_UNSET_VAR"),
            vec![
                "/nonexistent/eos-bridge-secret",
                "SECRETS_TEST_UNSET_VAR is not set",
            ],
        ),
    ];
    for (what, toml, needles) in cases {
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, &toml).unwrap();
        for command in ["run", "check"] {
            let (status, text) = cli(command, &file, &env);
            assert!(!status.success(), "{what}: {command} accepted it:\n{text}");
            for needle in &needles {
                assert!(
                    text.contains(needle),
                    "{what}: {command} lacks {needle:?}:\n{text}"
                );
            }
            secrets.assert_absent(&format!("`{command}` output for {what}"), &text);
        }
    }
    // The good file is good: the cases fail for their own fault only.
    let file = dir.path().join("good.toml");
    std::fs::write(&file, &good).unwrap();
    let (_, text) = cli("check", &file, &env);
    assert!(text.contains("parsed and validated"), "{text}");
    secrets.assert_absent("`check` of the good file", &text);
}

/// A panic in the pipeline thread, which holds the whole configuration, with a full backtrace.
#[cfg(feature = "failpoints")]
#[test]
fn a_panic_does_not_show_secrets() {
    let _serial = serial();
    let (secrets, mut s) = with_secrets("secrets-panic", 1);
    s.run(&[
        Produce(100, 1),
        StartWith(&[
            (PASSWORD_VAR, secrets.env_password.as_str()),
            ("EOS_BRIDGE_LOG", "debug"),
            ("EOS_BRIDGE_FAILPOINT", "after-produce"),
            ("EOS_BRIDGE_FAILPOINT_ACTION", "panic"),
            ("RUST_BACKTRACE", "full"),
        ]),
    ]);
    let exit = s.wait_exit(Duration::from_secs(60));
    let text = s.log();
    assert!(!exit.success(), "{exit}: {}", tail(&text, 30));
    assert!(
        text.contains("panicked") && text.contains("failpoint 'after-produce' reached"),
        "{}",
        tail(&text, 30)
    );
    secrets.assert_absent("a panic's output", &text);
}

/// A self-signed certificate for 127.0.0.1, written as PEM files.
fn certificate(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, Vec<u8>) {
    let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let cert = dir.join("tls.crt");
    let key = dir.join("tls.key");
    std::fs::write(&cert, made.cert.pem()).unwrap();
    std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
    (cert, key, made.cert.der().to_vec())
}

fn https_agent(ca_der: &[u8]) -> ureq::Agent {
    use ureq::tls::{Certificate, RootCerts, TlsConfig};
    let root = Certificate::from_der(ca_der).to_owned();
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .tls_config(
            TlsConfig::builder()
                .root_certs(RootCerts::new_with_certs(&[root]))
                .build(),
        )
        .build()
        .into()
}

#[test]
fn the_api_serves_https_and_the_admin_token_works_over_it() {
    let _serial = serial();
    let mut s = Scenario::new("tls", 2);
    let (cert, key, ca) = certificate(s.home.dir.path());
    let token = format!("tok-{}", random_alnum(20));
    s.spec().api_extra = format!(
        "tls_cert = {:?}\ntls_key = {:?}\n{}",
        path_str(&cert),
        path_str(&key),
        token_line()
    );
    s.run(&[Produce(500, 1), StartWith(&[(TOKEN_VAR, &token)])]);
    let id = s.home.spec.id.clone();
    let config = s.config();
    let port = s.bridge().port;

    let https = https_agent(&ca);
    let base = format!("https://127.0.0.1:{port}");
    let get = |path: &str| -> Option<(u16, String)> {
        let mut resp = https.get(&format!("{base}{path}")).call().ok()?;
        let code = resp.status().as_u16();
        Some((code, resp.body_mut().read_to_string().ok()?))
    };
    let committed = || -> Option<i64> {
        let (_, body) = get("/api/v1/status")?;
        let st: serde_json::Value = serde_json::from_str(&body).ok()?;
        Some(
            st["partitions"]
                .as_array()?
                .iter()
                .map(|p| p["position"].as_i64().unwrap_or(0))
                .sum(),
        )
    };
    let done = wait_until(Duration::from_secs(60), || committed() == Some(500));
    assert!(done, "{:?}: {}", committed(), tail(&s.log(), 30));

    assert_eq!(get("/health/live").map(|r| r.0), Some(200));
    let (_, text) = cli("check", &config, &[(TOKEN_VAR, &token)]);
    assert!(
        text.lines()
            .any(|l| l.starts_with("api tls") && l.contains("ok")),
        "{text}"
    );
    let (code, status) = get("/api/v1/status").unwrap();
    assert_eq!(code, 200);
    assert!(status.contains(&id), "{status}");

    let post = |bearer: Option<&str>| -> (u16, String) {
        let mut req = https
            .post(&format!("{base}/api/v1/savepoints"))
            .header("Content-Type", "application/json");
        if let Some(t) = bearer {
            req = req.header("Authorization", &format!("Bearer {t}"));
        }
        let mut resp = req.send(r#"{"name": "over-tls"}"#).unwrap();
        let code = resp.status().as_u16();
        (code, resp.body_mut().read_to_string().unwrap_or_default())
    };
    assert_eq!(post(None).0, 401);
    let (code, body) = post(Some(&token));
    assert_eq!(code, 201, "{body}");
    assert!(body.contains("over-tls"), "{body}");

    // Plain HTTP on the same port gets no HTTP answer; nor does a client that does not trust the
    // certificate.
    let plain = http_agent()
        .get(&format!("http://127.0.0.1:{port}/health/live"))
        .call();
    assert!(
        plain.is_err(),
        "plain HTTP answered: {:?}",
        plain.map(|r| r.status())
    );
    let untrusted = http_agent().get(&format!("{base}/health/live")).call();
    assert!(untrusted.is_err(), "a client without the CA was answered");
    // The server is still up after the refused connections.
    assert_eq!(get("/health/live").map(|r| r.0), Some(200));

    s.run(&[Stop]);
    assert_eq!(s.judge(), 500);
    let text = s.log();
    assert!(!text.contains(&token), "the token appears in the log");
    assert!(text.contains("tls=true"), "{}", tail(&text, 30));
}

#[test]
fn a_bad_tls_setting_stops_the_start_naming_the_setting() {
    let dir = temp_state_dir();
    let (cert, key, _) = certificate(dir.path());
    let spec = BridgeSpec::new("tls-bad-in", "tls-bad-out");
    let base = spec.toml(&dir.path().join("state"), free_port());
    let not_pem = dir.path().join("not-pem.key");
    std::fs::write(&not_pem, "not a key\n").unwrap();
    let cases = [
        (
            format!("[api]\ntls_cert = {:?}\n", path_str(&cert)),
            2,
            vec!["api.tls_key", "both"],
        ),
        (
            format!(
                "[api]\ntls_cert = {:?}\ntls_key = {:?}\n",
                path_str(&cert),
                path_str(&not_pem)
            ),
            2,
            vec!["api.tls_key", path_str(&not_pem), "no PEM private key"],
        ),
        (
            format!(
                "[api]\ntls_cert = {:?}\ntls_key = {:?}\n",
                "/nonexistent/tls.crt",
                path_str(&key)
            ),
            2,
            vec!["api.tls_cert", "/nonexistent/tls.crt", "cannot read"],
        ),
    ];
    for (api, code, needles) in cases {
        let file = dir.path().join("bad-tls.toml");
        std::fs::write(&file, base.replacen("[api]\n", &api, 1)).unwrap();
        let (status, text) = cli("run", &file, &[]);
        assert_eq!(status.code(), Some(code), "{text}");
        for needle in needles {
            assert!(text.contains(needle), "lacks {needle:?}: {text}");
        }
    }
}
