//! eos-bridge: an exactly-once Kafka bridge.
//!
//! The library holds everything; `src/main.rs` is a thin command-line front over it. The
//! pipeline owns the checkpoint protocol, the sink owns the transactional producer, recovery is a
//! pure decision over what was observed, and every metric is defined in `metrics`. The design:
//! docs/design.md.
//!
//! The public surface is what the command line and the integration tests need: the
//! configuration, `daemon::run`, `check`, the checkpoint store and savepoints, the error type, and
//! the sink admin client (the identity tests read cluster ids with it). Everything else is
//! private, so that the compiler reports what nothing uses.

#![warn(unreachable_pub)]

mod acl;
pub mod admin;
mod api;
pub mod check;
pub mod checkpoint;
pub mod config;
mod connectivity;
pub mod daemon;
pub mod error;
mod failpoint;
mod identity;
mod marker;
mod metrics;
mod mirror;
pub mod offsets;
mod pipeline;
mod positions;
mod recovery;
pub mod savepoint;
mod secrets;
mod sink;
mod source;
mod stable;
mod status;
mod transform;
