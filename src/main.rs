//! The eos-bridge command line: a thin front over the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};

use eos_bridge::config::Config;
use eos_bridge::daemon;
use eos_bridge::error::BridgeError;
use eos_bridge::savepoint::{Restore, Savepoint};

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
        /// Start from a savepoint exported with `savepoint export` (repeat to merge the
        /// savepoints of every instance of an old layout).
        #[arg(long = "from-savepoint", value_name = "FILE.json")]
        from_savepoint: Vec<PathBuf>,
        /// Allow a savepoint of another bridge id or instance layout; positions are then
        /// redistributed by partition.
        #[arg(long, requires = "from_savepoint")]
        allow_layout_change: bool,
    },
    /// Validate the configuration against both clusters without starting: exit 0 when every
    /// check passes, 1 otherwise.
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Savepoints: export one from a state directory as portable JSON.
    Savepoint {
        #[command(subcommand)]
        command: SavepointCommand,
    },
    /// Inspect the checkpoints of a state directory (the bridge must not be running on it).
    Checkpoints {
        #[command(subcommand)]
        command: CheckpointsCommand,
    },
    /// Consumer-group offsets: move a group from the source cluster to the sink cluster.
    Offsets {
        #[command(subcommand)]
        command: OffsetsCommand,
    },
}

#[derive(Subcommand)]
enum OffsetsCommand {
    /// Print the sink offsets at which GROUP resumes exactly after what it committed on the source
    /// (from the bridge's offset mapping); with --apply, commit them for GROUP on the sink. Exit 0
    /// when every partition translated (and, with --apply, was committed), 1 otherwise.
    Translate {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long)]
        group: String,
        /// Commit the translated offsets for the group on the sink cluster (refused while the group
        /// has members there, or while a partition cannot be translated).
        #[arg(long)]
        apply: bool,
        /// Failover, with the source cluster gone: the group's source offsets from this file, as
        /// `kafka-consumer-groups --reset-offsets --to-current --export --dry-run` wrote them
        /// (topic,partition,offset), instead of from the source cluster.
        #[arg(long, value_name = "FILE.csv")]
        source_offsets: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum SavepointCommand {
    /// Write savepoint NAME of a state directory to stdout as JSON (the bridge must not be
    /// running on it; a running bridge serves the same at GET /api/v1/savepoints/NAME).
    Export {
        #[arg(long)]
        state_dir: PathBuf,
        #[arg(long)]
        name: String,
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

/// glibc gives every thread that allocates an arena of its own, up to 8 per core, and freed memory
/// stays in them: librdkafka's broker threads each fill one with fetch and produce buffers, which
/// doubled peak RSS (1 KB records, 100 ms checkpoints: 123 MB with the default arenas, 66 MB with
/// two, the same throughput; bench/README.md, with a read-ahead thread the bridge no longer has).
/// Two arenas still keep the pipeline thread and librdkafka's threads from contending for one
/// lock. MALLOC_ARENA_MAX in the environment still wins: it is only set here when the operator did
/// not set it.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only changes allocator tuning; called before any other thread starts.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
    }
}

fn main() -> ExitCode {
    limit_malloc_arenas();
    let cli = Cli::parse();
    init_tracing(&cli.log_format);
    match cli.command {
        Command::Run {
            config,
            from_savepoint,
            allow_layout_change,
        } => {
            let result = run(&config, &from_savepoint, allow_layout_change);
            ExitCode::from(BridgeError::exit_code_of(&result))
        }
        Command::Check { config } => {
            let cfg = match Config::from_process_env(Some(&config)) {
                Ok(c) => c,
                Err(errors) => {
                    println!(
                        "check          ok    detail\nconfiguration  FAIL  invalid ({}):\n{errors}",
                        config.display()
                    );
                    return ExitCode::FAILURE;
                }
            };
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("eos-bridge: cannot start a runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let findings = eos_bridge::check::run(&cfg, &runtime);
            print!("{}", eos_bridge::check::render(&findings));
            if findings.iter().all(|f| f.ok) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Command::Savepoint {
            command: SavepointCommand::Export { state_dir, name },
        } => match export_savepoint(&state_dir, &name) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("eos-bridge: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Offsets {
            command:
                OffsetsCommand::Translate {
                    config,
                    group,
                    apply,
                    source_offsets,
                },
        } => {
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
            match translate_offsets(&cfg, &group, apply, source_offsets.as_deref()) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
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

/// Prints the translation; says whether every partition translated (and was applied).
fn translate_offsets(
    cfg: &Config,
    group: &str,
    apply: bool,
    source_offsets: Option<&std::path::Path>,
) -> anyhow::Result<bool> {
    use eos_bridge::offsets::translate;
    let given = match source_offsets {
        Some(f) => {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            Some(
                translate::parse_offsets_csv(&text)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?,
            )
        }
        None => None,
    };
    let report = translate::translate(cfg, group, given)?;
    if report.rows.is_empty() {
        println!("group '{group}' has no committed offset on the bridge's source topics");
        return Ok(false);
    }
    print!("{}", report.render());
    let all = report.untranslated().next().is_none();
    if apply {
        let n = translate::apply(cfg, &report)?;
        println!(
            "applied: committed {n} partition offset(s) for group '{group}' on the sink cluster"
        );
    }
    Ok(all)
}

/// `run`: every way it stops is a `BridgeError`, printed here; its cause decides the exit code.
fn run(
    config: &std::path::Path,
    from_savepoint: &[PathBuf],
    allow_layout_change: bool,
) -> Result<(), BridgeError> {
    let cfg = match Config::from_process_env(Some(config)) {
        Ok(c) => c,
        Err(errors) => {
            eprintln!(
                "eos-bridge: invalid configuration ({}):\n{errors}",
                config.display()
            );
            return Err(BridgeError::Config(errors));
        }
    };
    let result = read_savepoints(from_savepoint)
        .map_err(|e| BridgeError::SavepointFile(format!("{e:#}")))
        .and_then(|savepoints| {
            let restore = (!savepoints.is_empty()).then_some(Restore {
                savepoints,
                allow_layout_change,
            });
            daemon::run(Arc::new(cfg), restore)
        });
    if let Err(e) = &result {
        eprintln!("eos-bridge: {e:#}");
    }
    result
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

fn read_savepoints(files: &[PathBuf]) -> anyhow::Result<Vec<Savepoint>> {
    files
        .iter()
        .map(|f| {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            Ok(Savepoint::from_json(&f.display().to_string(), &text)?)
        })
        .collect()
}

fn export_savepoint(dir: &std::path::Path, name: &str) -> anyhow::Result<()> {
    let store = eos_bridge::checkpoint::CheckpointStore::open(dir, usize::MAX)
        .with_context(|| format!("opening {}", dir.display()))?;
    let loaded = store.load()?;
    if let Some(c) = loaded.checkpoints.iter().find(|c| {
        c.savepoint.as_deref() == Some(name)
            && c.state == eos_bridge::checkpoint::CheckpointState::Pending
    }) {
        anyhow::bail!(
            "savepoint '{name}' is not usable: checkpoint {} carrying it in {} is still pending (the bridge \
             stopped before its commit was recorded), so its transaction may not have committed. Start the bridge \
             on this state directory once: recovery keeps the savepoint if the commit marker proves the commit and \
             drops it otherwise; then take or export the savepoint again",
            c.id,
            dir.display()
        );
    }
    let sp = loaded
        .checkpoints
        .iter()
        .filter_map(Savepoint::from_checkpoint)
        .find(|sp| sp.name == name)
        .with_context(|| format!("no savepoint named '{name}' in {}", dir.display()))?;
    println!("{}", sp.to_json());
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::Cli;

    /// The process list shows every argument: no flag may take a secret, which belongs in a file
    /// or the environment (referenced from the configuration).
    #[test]
    fn no_flag_takes_a_secret() {
        fn walk(cmd: &clap::Command, seen: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                seen.push(arg.get_id().to_string());
            }
            for sub in cmd.get_subcommands() {
                walk(sub, seen);
            }
        }
        let mut ids = Vec::new();
        walk(&Cli::command(), &mut ids);
        assert!(ids.iter().any(|id| id == "config"), "{ids:?}");
        for id in &ids {
            let id = id.to_ascii_lowercase();
            for word in ["password", "secret", "token", "key", "credential", "jaas"] {
                assert!(
                    !id.contains(word),
                    "flag --{id} looks like it takes a secret"
                );
            }
        }
    }
}
