//! The eos-bridge command line: a thin front over the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};

use eos_bridge::config::Config;
use eos_bridge::daemon;

#[derive(Parser)]
#[command(name = "eos-bridge", version, about = "Exactly-once Kafka bridge")]
struct Cli {
    /// Log format: "text" or "json".
    #[arg(
        long,
        global = true,
        default_value = "text",
        env = "EOS_BRIDGE_LOG_FORMAT"
    )]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the bridge until SIGTERM or SIGINT.
    Run {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Inspect the checkpoints of a state directory (the bridge must not be running on it).
    Checkpoints {
        #[command(subcommand)]
        command: CheckpointsCommand,
    },
}

#[derive(Subcommand)]
enum CheckpointsCommand {
    /// List the stored checkpoints, newest last.
    List {
        #[arg(long)]
        state_dir: PathBuf,
    },
}

fn init_tracing(format: &str) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("EOS_BRIDGE_LOG").unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new("info,librdkafka=warn,rdkafka=warn")
        });
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(&cli.log_format);
    match cli.command {
        Command::Run { config } => {
            let cfg = match Config::from_process_env(Some(&config)) {
                Ok(c) => c,
                Err(errors) => {
                    eprintln!(
                        "eos-bridge: invalid configuration ({}):\n{errors}",
                        config.display()
                    );
                    return ExitCode::from(2);
                }
            };
            match daemon::run(Arc::new(cfg)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("eos-bridge: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Checkpoints {
            command: CheckpointsCommand::List { state_dir },
        } => match list_checkpoints(&state_dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("eos-bridge: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}

fn list_checkpoints(dir: &std::path::Path) -> anyhow::Result<()> {
    let store = eos_bridge::checkpoint::CheckpointStore::open(dir, usize::MAX)
        .with_context(|| format!("opening {}", dir.display()))?;
    let loaded = store.load()?;
    println!(
        "{:>10}  {:<9}  {:>14}  {:<12}  positions",
        "id", "state", "created_ms", "savepoint"
    );
    for c in &loaded.checkpoints {
        println!(
            "{:>10}  {:<9}  {:>14}  {:<12}  {}",
            c.id,
            format!("{:?}", c.state).to_lowercase(),
            c.created_ms,
            c.savepoint.as_deref().unwrap_or("-"),
            serde_json::to_string(&c.positions)?
        );
    }
    for c in &loaded.corrupt {
        println!(
            "{:>10}  corrupt    key {} ({})",
            c.id.map(|i| i.to_string()).unwrap_or_default(),
            c.key,
            c.reason
        );
    }
    Ok(())
}
