//! The daemon's frame: the async runtime (API and signals), the pipeline's own thread, the one
//! shutdown token, and the drain deadline.
//!
//! The first SIGTERM or SIGINT cancels the token: the pipeline ends its epoch with a final
//! checkpoint and commit. If that takes longer than `shutdown.timeout`, or a second signal
//! arrives, the process exits at once; recovery makes that safe.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::api::{self, ApiState};
use crate::checkpoint::CheckpointStore;
use crate::config::Config;
use crate::error::{BridgeError, Result};
use crate::metrics::Metrics;
use crate::pipeline::{self, Shared};
use crate::savepoint::Restore;
use crate::status::{snapshot, RunState, Status};

pub fn run(cfg: Arc<Config>, restore: Option<Restore>) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("eos-bridge-rt")
        .enable_all()
        .build()
        .map_err(|e| BridgeError::Runtime(format!("cannot start the async runtime: {e}")))?;
    let result = runtime.block_on(serve(cfg, restore));
    // The pipeline thread may still hold blocking calls after a forced exit; do not wait on them.
    runtime.shutdown_timeout(Duration::from_millis(100));
    result
}

async fn serve(cfg: Arc<Config>, restore: Option<Restore>) -> Result<()> {
    let metrics = Arc::new(Metrics::new());
    // Opened here, before anything else, so that a second process on the same state directory
    // stops at once with a clear message.
    let store = Arc::new(CheckpointStore::open(
        &cfg.bridge.state_dir,
        cfg.checkpoint.retain,
    )?);
    let (commands, command_rx) = std::sync::mpsc::channel();
    let status = Status::new(
        &cfg.bridge.id,
        cfg.bridge.instance,
        cfg.bridge.instances,
        cfg.bridge.delivery.as_str(),
    )
    .shared();
    let shutdown = CancellationToken::new();

    // Read before listening: a bad certificate stops the start with its own message.
    let tls = match (&cfg.api.tls_cert, &cfg.api.tls_key) {
        (Some(cert), Some(key)) => Some(
            api::tls_config(cert, key)
                .map_err(|e| BridgeError::Config(crate::config::ConfigErrors(vec![e])))?,
        ),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(cfg.api.listen)
        .await
        .map_err(|e| BridgeError::ApiListen {
            listen: cfg.api.listen.to_string(),
            reason: e.to_string(),
        })?;
    info!(listen = %cfg.api.listen, tls = tls.is_some(), "HTTP API listening");
    let app = api::router(ApiState {
        metrics: metrics.clone(),
        status: status.clone(),
        store: store.clone(),
        commands: commands.clone(),
        admin_token: cfg.api.admin_token.clone(),
        savepoint_wait: cfg.checkpoint.interval + cfg.checkpoint.timeout + Duration::from_secs(5),
        ready_max_age: cfg.ready_max_age(),
        live_max_silence: cfg.checkpoint.interval
            + cfg.checkpoint.timeout
            + Duration::from_secs(60),
    });
    let api_shutdown = shutdown.clone();
    tokio::spawn(async move {
        let served = match tls {
            None => {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move { api_shutdown.cancelled().await })
                    .await
            }
            Some(tls) => serve_tls(listener, tls, app, api_shutdown).await,
        };
        if let Err(e) = served {
            error!(error = %e, "HTTP API stopped");
        }
    });

    tokio::spawn(watch_signals(shutdown.clone()));

    let (done_tx, done_rx) = oneshot::channel();
    let pipeline_status = status.clone();
    let shared = Shared {
        metrics,
        status,
        shutdown: shutdown.clone(),
        runtime: tokio::runtime::Handle::current(),
        store,
    };
    let pipeline_cfg = cfg.clone();
    std::thread::Builder::new()
        .name("eos-bridge-pipeline".into())
        .spawn(move || {
            let r = pipeline::run(pipeline_cfg, shared, command_rx, restore);
            let _ = done_tx.send(r);
        })
        .map_err(|e| BridgeError::Runtime(format!("cannot start the pipeline thread: {e}")))?;

    let mut done_rx = done_rx;
    tokio::select! {
        r = &mut done_rx => return flatten(r),
        _ = shutdown.cancelled() => {}
    }
    // Start-up can be blocked for up to a minute in a call to a cluster that is down; before the
    // first epoch no transaction is open and nothing waits to be committed, so do not wait.
    let st = snapshot(&pipeline_status);
    if st.epoch_started_at.is_none()
        && matches!(st.state, RunState::Starting | RunState::Recovering)
    {
        info!("shutdown requested during start-up: nothing to finish");
        return Ok(());
    }
    let drain = cfg.shutdown.timeout;
    info!(timeout = ?drain, "shutdown requested: finishing the current checkpoint");
    match tokio::time::timeout(drain, done_rx).await {
        Ok(r) => flatten(r),
        Err(_) => Err(BridgeError::ShutdownIncomplete(format!(
            "the final checkpoint did not finish within shutdown.timeout ({drain:?}); exiting anyway: nothing is \
             lost, the next start recovers from the last committed checkpoint"
        ))),
    }
}

/// HTTPS only on the API's port: a plain HTTP request fails its TLS handshake.
async fn serve_tls(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: axum::Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let handle = axum_server::Handle::new();
    let stopping = handle.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        stopping.graceful_shutdown(Some(Duration::from_secs(1)));
    });
    let config = axum_server::tls_rustls::RustlsConfig::from_config(tls);
    axum_server::from_tcp_rustls(listener.into_std()?, config)?
        .handle(handle)
        .serve(app.into_make_service())
        .await
}

fn flatten(r: std::result::Result<Result<()>, oneshot::error::RecvError>) -> Result<()> {
    r.unwrap_or_else(|_| {
        Err(BridgeError::Runtime(
            "the pipeline thread ended without a result".into(),
        ))
    })
}

async fn watch_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        error!("cannot install signal handlers; SIGTERM will kill the process without a final checkpoint");
        return;
    };
    tokio::select! {
        _ = term.recv() => info!(signal = "SIGTERM", "stopping gracefully"),
        _ = int.recv() => info!(signal = "SIGINT", "stopping gracefully"),
    }
    shutdown.cancel();
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    warn!("second signal: exiting at once");
    std::process::exit(130);
}
