//! Why a cluster cannot be reached: wrong credentials, an untrusted certificate, or no broker
//! answering.
//!
//! librdkafka does not fail a call for these reasons: it reconnects in the background and the
//! call times out with a transport error that says nothing about the cause. The cause only
//! reaches the client context's error callback (`_AUTHENTICATION`, `_SSL`, `_ALL_BROKERS_DOWN`).
//! The source consumer and sink producer report what their callbacks see here, for
//! `/health/ready`; start-up and `check` probe a cluster with a client of their own (the admin
//! client never serves its callbacks) and turn what the probe saw into a typed error naming the
//! settings to fix.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::ClientContext;
use tracing::warn;

use crate::config::Config;
use crate::error::BridgeError;
use crate::sink::is_client_wide;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cluster {
    Source,
    Sink,
}

impl Cluster {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Cluster::Source => "source",
            Cluster::Sink => "sink",
        }
    }

    fn slot(self) -> usize {
        self as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Trouble {
    /// The broker refused the SASL credentials (or the mechanism).
    Authentication,
    /// The TLS handshake failed: an untrusted or mismatching certificate, no client certificate
    /// where one is required, or TLS spoken to a plaintext listener (and the reverse).
    Tls,
    /// No broker of the cluster answers.
    Unreachable,
}

#[derive(Clone, Debug)]
pub(crate) struct Problem {
    pub cluster: Cluster,
    pub trouble: Trouble,
    /// librdkafka's text of the latest report (never holds a secret).
    pub detail: String,
    pub last: Instant,
}

impl Problem {
    pub(crate) fn into_error(self, waited: Duration) -> BridgeError {
        let cluster = self.cluster.name();
        let detail = self.detail;
        match self.trouble {
            Trouble::Authentication => BridgeError::Authentication { cluster, detail },
            Trouble::Tls => BridgeError::Tls { cluster, detail },
            Trouble::Unreachable => BridgeError::Unreachable {
                cluster,
                detail,
                waited,
            },
        }
    }

    /// The settings to look at, for `check`.
    pub(crate) fn fix(&self) -> String {
        let c = self.cluster.name();
        match self.trouble {
            Trouble::Authentication => format!(
                "correct sasl.mechanism, sasl.username and sasl.password (or sasl.oauthbearer.*) in [{c}.kafka]"
            ),
            Trouble::Tls => format!(
                "correct security.protocol, ssl.ca.location (the CA that signed the brokers' certificates) and, \
                 for mutual TLS, ssl.certificate.location and ssl.key.location in [{c}.kafka]"
            ),
            Trouble::Unreachable => format!(
                "check {c}.bootstrap_servers, the network, and that the brokers run"
            ),
        }
    }

    /// One line for `/health/ready`.
    pub(crate) fn summary(&self) -> String {
        let what = match self.trouble {
            Trouble::Authentication => "authentication failed",
            Trouble::Tls => "TLS handshake failed",
            Trouble::Unreachable => "unreachable",
        };
        format!("{} cluster {what}: {}", self.cluster.name(), self.detail)
    }
}

/// Sorts one report of librdkafka's error callback; None for what is not about reaching the
/// cluster (or a single broker's disconnect, which the client survives).
pub(crate) fn classify(code: RDKafkaErrorCode, reason: &str) -> Option<Trouble> {
    let lower = reason.to_ascii_lowercase();
    match code {
        RDKafkaErrorCode::Authentication | RDKafkaErrorCode::SaslAuthenticationFailed => {
            Some(Trouble::Authentication)
        }
        // A connection reset by a stopping broker is also reported as an SSL error; only a failed
        // handshake or certificate check is a setting to fix.
        RDKafkaErrorCode::SSL if lower.contains("handshake") || lower.contains("certificate") => {
            Some(Trouble::Tls)
        }
        // Plaintext spoken to a TLS listener: librdkafka only sees the connection close.
        RDKafkaErrorCode::BrokerTransportFailure if lower.contains("security.protocol") => {
            Some(Trouble::Tls)
        }
        RDKafkaErrorCode::AllBrokersDown | RDKafkaErrorCode::Resolve => Some(Trouble::Unreachable),
        _ => None,
    }
}

/// How long a refused login or handshake explains the cluster's brokers being down.
const CAUSE_MEMORY: Duration = Duration::from_secs(30);

static LATEST: Mutex<[Option<Problem>; 2]> = Mutex::new([None, None]);

pub(crate) fn report(cluster: Cluster, code: RDKafkaErrorCode, reason: &str) {
    let Some(trouble) = classify(code, reason) else {
        return;
    };
    let mut latest = LATEST.lock().unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    // After a refused login or handshake librdkafka also says all brokers are down: that is the
    // consequence, the refusal stays the cause.
    if let Some(p) = latest[cluster.slot()].as_mut() {
        if trouble == Trouble::Unreachable
            && p.trouble != Trouble::Unreachable
            && now.duration_since(p.last) < CAUSE_MEMORY
        {
            p.last = now;
            return;
        }
    }
    latest[cluster.slot()] = Some(Problem {
        cluster,
        trouble,
        detail: reason.to_string(),
        last: now,
    });
}

/// The latest problem reported for `cluster` since `since`.
pub(crate) fn latest(cluster: Cluster, since: Option<Instant>) -> Option<Problem> {
    let latest = LATEST.lock().unwrap_or_else(|p| p.into_inner());
    latest[cluster.slot()]
        .clone()
        .filter(|p| since.is_none_or(|s| p.last > s))
}

/// Why the bridge cannot work right now, per cluster, for `/health/ready`: problems reported
/// after the last completed checkpoint (or at all, before the first).
pub(crate) fn unready_reasons(last_checkpoint: Option<Instant>) -> Vec<String> {
    [Cluster::Source, Cluster::Sink]
        .into_iter()
        .filter_map(|c| latest(c, last_checkpoint))
        .map(|p| p.summary())
        .collect()
}

/// A client context that reports connection problems of its cluster, and logs each callback
/// once as librdkafka's error.
#[derive(Debug)]
pub(crate) struct Watch(pub Cluster);

impl ClientContext for Watch {
    fn error(&self, error: KafkaError, reason: &str) {
        on_error(self.0, &error, reason);
    }
}

impl ConsumerContext for Watch {}

/// What a client context's error callback does: report, then log one line.
pub(crate) fn on_error(cluster: Cluster, error: &KafkaError, reason: &str) {
    if let Some(code) = error.rdkafka_error_code() {
        report(cluster, code, reason);
    }
    warn!(cluster = cluster.name(), error = %error, reason, "librdkafka error");
}

/// Connects to a cluster with a short-lived client and says what stops it, if anything: None
/// when the cluster answered a metadata request within `timeout`.
pub(crate) fn probe(
    cluster: Cluster,
    bootstrap: &str,
    kafka: &[(String, String)],
    timeout: Duration,
) -> Option<Problem> {
    let began = Instant::now();
    let mut cc = ClientConfig::new();
    for (k, v) in kafka.iter().filter(|(k, _)| is_client_wide(k)) {
        cc.set(k, v);
    }
    // The consumer only stands in for a connection: it never subscribes, so it joins no group.
    cc.set("bootstrap.servers", bootstrap);
    let consumer: BaseConsumer<Watch> = match cc.create_with_context(Watch(cluster)) {
        Ok(c) => c,
        // A configuration librdkafka refuses is found by the real clients with a better message.
        Err(_) => return None,
    };
    // Short metadata requests in turn with serving the callbacks: a refused login or certificate
    // shows within a second, without waiting out the whole timeout.
    let deadline = began + timeout;
    loop {
        if consumer
            .fetch_metadata(None, Duration::from_millis(250))
            .is_ok()
        {
            return None;
        }
        // A poll returns after the first event it serves (often a log line): poll a few times.
        for _ in 0..8 {
            consumer.poll(Duration::from_millis(25));
        }
        let seen = latest(cluster, Some(began));
        let out_of_time = Instant::now() >= deadline;
        match seen {
            Some(p) if p.trouble != Trouble::Unreachable || out_of_time => return Some(p),
            _ if out_of_time => {
                return Some(Problem {
                    cluster,
                    trouble: Trouble::Unreachable,
                    detail: format!("no broker answered a metadata request within {timeout:?}"),
                    last: Instant::now(),
                })
            }
            _ => {}
        }
    }
}

/// How long one probe waits for a metadata answer.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Probes the source and the sink cluster as configured; the problems found, source first.
pub(crate) fn probe_config(cfg: &Config) -> Vec<Problem> {
    let pairs = crate::config::KafkaProps::pairs;
    [
        (
            Cluster::Source,
            &cfg.source.bootstrap_servers,
            pairs(&cfg.source.kafka),
        ),
        (
            Cluster::Sink,
            &cfg.sink.bootstrap_servers,
            pairs(&cfg.sink.kafka),
        ),
    ]
    .into_iter()
    .filter_map(|(c, bootstrap, kafka)| probe(c, bootstrap, &kafka, PROBE_TIMEOUT))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What docs/security.md calls "only built": librdkafka has the code for Kerberos and OIDC
    /// client credentials and accepts their settings; no test has a KDC or an identity provider.
    #[test]
    fn librdkafka_is_built_with_kerberos_and_oidc() {
        let native = ClientConfig::new().create_native_config().unwrap();
        let features = native.get("builtin.features").unwrap();
        for f in [
            "ssl",
            "sasl_plain",
            "sasl_scram",
            "sasl_oauthbearer",
            "sasl_gssapi",
            "oidc",
        ] {
            assert!(features.split(',').any(|x| x == f), "{f} in {features}");
        }
        let mut oidc = ClientConfig::new();
        oidc.set("bootstrap.servers", "127.0.0.1:1")
            .set("security.protocol", "SASL_SSL")
            .set("sasl.mechanism", "OAUTHBEARER")
            .set("sasl.oauthbearer.method", "oidc")
            .set("sasl.oauthbearer.client.id", "bridge")
            .set("sasl.oauthbearer.client.secret", "not-a-secret")
            .set(
                "sasl.oauthbearer.token.endpoint.url",
                "https://127.0.0.1:1/token",
            );
        let created: Result<BaseConsumer, _> = oidc.create();
        assert!(created.is_ok(), "OIDC client: {:?}", created.err());
        let mut kerberos = ClientConfig::new();
        kerberos
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("security.protocol", "SASL_PLAINTEXT")
            .set("sasl.mechanism", "GSSAPI")
            .set("sasl.kerberos.service.name", "kafka")
            // No kinit at creation: there is no KDC here.
            .set("sasl.kerberos.min.time.before.relogin", "0");
        let created: Result<BaseConsumer, _> = kerberos.create();
        assert!(created.is_ok(), "GSSAPI client: {:?}", created.err());
    }

    #[test]
    fn brokers_down_after_a_refused_login_keeps_the_refusal_as_the_cause() {
        report(
            Cluster::Source,
            RDKafkaErrorCode::Authentication,
            "SASL authentication error: Authentication failed",
        );
        let before = Instant::now();
        report(
            Cluster::Source,
            RDKafkaErrorCode::AllBrokersDown,
            "1/1 brokers are down",
        );
        let p = latest(Cluster::Source, Some(before)).expect("still failing");
        assert_eq!(p.trouble, Trouble::Authentication);
        assert!(unready_reasons(Some(before))[0].contains("source cluster authentication failed"));
    }

    #[test]
    fn callbacks_are_sorted_by_the_setting_that_fixes_them() {
        let auth = "SASL authentication error: Authentication failed during authentication due to \
                    invalid credentials with SASL mechanism SCRAM-SHA-512";
        assert_eq!(
            classify(RDKafkaErrorCode::Authentication, auth),
            Some(Trouble::Authentication)
        );
        let tls = "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: error:0A000086:SSL \
                   routines::certificate verify failed: broker certificate could not be verified";
        assert_eq!(classify(RDKafkaErrorCode::SSL, tls), Some(Trouble::Tls));
        assert_eq!(
            classify(
                RDKafkaErrorCode::SSL,
                "SSL transport error: Connection reset by peer"
            ),
            None
        );
        let plaintext = "Disconnected while requesting ApiVersion: might be caused by incorrect \
                         security.protocol configuration (connecting to a SSL listener?)";
        assert_eq!(
            classify(RDKafkaErrorCode::BrokerTransportFailure, plaintext),
            Some(Trouble::Tls)
        );
        assert_eq!(
            classify(RDKafkaErrorCode::AllBrokersDown, "1/1 brokers are down"),
            Some(Trouble::Unreachable)
        );
        assert_eq!(
            classify(
                RDKafkaErrorCode::BrokerTransportFailure,
                "Connect to ipv4#127.0.0.1:1 failed: Connection refused"
            ),
            None
        );
    }
}
