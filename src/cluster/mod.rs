//! Cluster mode (`--cluster`, feature `cluster`, docs/cluster.md): sessions partitioned
//! across instances sharing one Redis. The whole wing is here, one module per concern:
//!
//! - `store/`: the Redis store ([`RedisStore`]) — leases, the partitions' streams, loads,
//!   the hello registry, the Lua scripts;
//! - `ownership`: which partitions this instance holds, renews, drains and acquires
//!   ([`Ownership`], a pure planner);
//! - `member`: the member's journal thread (`Journal::start_cluster`, [`ClusterLink`]): records become pipelined Redis
//!   writes, the ownership pass runs between batches, and each batch's [`ClusterReport`]
//!   goes to the reactor beside the journal's own [`Committed`](crate::journal::Committed);
//! - `reader`: the stream reader's thread ([`Reader`]): outcomes of messages run elsewhere,
//!   messages accepted into owned partitions, forwards;
//!
//! - `access`: the access policy's state in Redis (`RedisAccess`, the policy's shared store);
//! - `shell`: the bridge server as a member ([`shell::Member`]: the threads' start, each
//!   report paired with its completion, the reader's arrivals, the status), with its no-op
//!   twin (`shell/off.rs`); the server holds one and gives it the bridge when it needs it.
//!
//! Two more parts live in this folder but are mounted (`#[path]`) where the code they extend
//! lives, so that they reach its private rooms without widening them, and so that no room
//! below imports from a room above:
//! - `bridge/`, mounted as the bridge's `cluster` module (`server/bridge/mod.rs`): the
//!   bridge's cluster side (`ClusterSide`, a sibling of the bridge's `Durable`: remote waits,
//!   hand-overs, drains, forwards, early outcomes, its hooks returning decisions), and the
//!   few `impl Bridge` methods that still apply the cluster's report and arrivals across
//!   the bridge's rooms; without the feature, its no-op twin (`bridge/off.rs`) stands in;
//! - `metrics.rs`, mounted as ops' `cluster_metrics` (`ops/mod.rs`): the cluster's
//!   Prometheus families, from the status's `ClusterStatus` (always compiled: the status
//!   type is).
//!
//! Only this folder says `cfg(feature = "cluster")`, bar a handful of lines (`.ci/walls.py`
//! holds it to five outside).

// Set up by `serve --cluster` (feature `cli`) only.
#[cfg(feature = "cluster")]
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
mod access;
#[cfg(feature = "cluster")]
#[cfg_attr(not(feature = "cli"), allow(dead_code))] // started by `serve --cluster`
pub(crate) mod leash;
#[cfg(feature = "cluster")]
mod member;
#[cfg(feature = "cluster")]
mod ownership;
#[cfg(feature = "cluster")]
mod reader;
pub(crate) mod shell;
#[cfg(feature = "cluster")]
mod store;

#[cfg(feature = "cluster")]
#[cfg_attr(not(feature = "cli"), allow(unused_imports))]
pub(crate) use access::access_store;
#[cfg(feature = "cluster")]
pub use member::{ClusterLink, ClusterReport, cluster_tag, tag_parts};
#[cfg(feature = "cluster")]
pub use ownership::{Ownership, Plan};
#[cfg(feature = "cluster")]
pub use reader::{Arrival, ClusterRequest, Reader};
#[cfg(feature = "cluster")]
pub use store::{
    Accept, Acquire, ClusterConfig, Done, FWD_MAXLEN, FwdEntry, Lease, LoadedPartition, Op,
    RedisStore, Stream, StreamEntry, partition_of,
};
#[cfg(feature = "cluster")]
#[cfg_attr(not(feature = "cli"), allow(unused_imports))] // for `serve --cluster` and the CLI
pub(crate) use store::{DEFAULT_DRAIN, default_instance_id, export_history, history_loader};
