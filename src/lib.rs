//! eos-bridge: an exactly-once Kafka bridge.
//!
//! The library holds everything; `src/main.rs` is a thin command-line front over it. The
//! pipeline owns the checkpoint protocol, the sink owns the transactional producer, recovery is a
//! pure decision over what was observed, and every metric is defined in `metrics`.

pub mod acl;
pub mod admin;
pub mod api;
pub mod check;
pub mod checkpoint;
pub mod config;
pub mod connectivity;
pub mod daemon;
pub mod error;
pub mod failpoint;
pub mod identity;
pub mod marker;
pub mod metrics;
pub mod pipeline;
pub mod positions;
pub mod recovery;
pub mod savepoint;
pub mod sink;
pub mod source;
pub mod status;
pub mod transform;
