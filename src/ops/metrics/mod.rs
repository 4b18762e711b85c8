//! Prometheus metrics: the text exposition format 0.0.4, rendered from a status snapshot's
//! typed figures (the histograms themselves are kept by the reactor, `crate::histogram`).
//!
//! Each family is declared once, in a table beside the figures it reads (a
//! [`Metric`] per family: name, help, kind, and the figure); [`render`] iterates the tables
//! in the order they are exposed, and the tests iterate the same tables.
//!
//! Every name starts `turnstile_`; every label's values come from a bounded set (outcomes,
//! reasons, pools, states, platforms — at most `--max-platforms` of them).

use std::collections::BTreeMap;

use super::exposition::{Exposition, Kind, Metric, Reading, by, labelled};
use crate::agent::{AgentFigures, ModelUsage};
use crate::core::RejectReason;
use crate::liveness::{BridgeStatus, JournalStatus, PlatformStatus, ServiceStatus};
use crate::liveness::{
    CleanupCounts, HttpStatus, MessageCounts, RuntimeState, SessionCounts, Status, ThreadStates,
    WorkerCounts,
};
use crate::liveness::{SupervisedBridge, SupervisedState};

use Kind::{Counter, Gauge, Histogram};
use Reading::Value;

/// The metrics of a status snapshot, in the text exposition format 0.0.4: one table per
/// group of families, in the order they are exposed.
pub(crate) fn render(s: &Status) -> String {
    let mut e = Exposition::new();
    e.expose(PROCESS, s);
    if let Some(service) = s.frontend.as_ref().and_then(|f| f.service.as_ref()) {
        e.expose(SERVICE, service);
    }
    e.expose(SESSIONS, &s.sessions);
    e.expose(TURNS, s);
    e.expose(CLEANUPS, &s.cleanups);
    e.expose(WORKERS, &s.workers);
    e.expose(DELIVERIES, &s.messages);
    e.expose(LLM_TOKENS, &s.agent_usage_by_model[..]);
    e.expose(AGENT_FAILURES, s);
    if !s.agents.is_empty() {
        e.expose(PER_AGENT, &s.agents[..]);
    }
    if let Some(f) = &s.frontend {
        if let Some(b) = &f.bridge {
            e.expose(BRIDGE, b);
            e.expose(OUTBOXES, &b.outboxes);
            if let Some(j) = &b.journal {
                e.expose(JOURNAL, j);
            }
            if let Some(c) = &b.cluster {
                e.expose(super::cluster_metrics::CLUSTER, c);
            }
        }
        if let Some(h) = &f.http {
            e.expose(HTTP, h);
        }
        if !f.bridges.is_empty() {
            e.expose(SUPERVISED, &f.bridges[..]);
        }
    }
    e.finish()
}

/// Milliseconds to seconds.
const MS: f64 = 1e-3;

/// A `usize` or `u64` figure as a sample value.
fn n(v: impl TryInto<u64>) -> f64 {
    v.try_into().map_or(f64::MAX, |v: u64| v as f64)
}

/// 1 for true, 0 for false.
fn flag(b: bool) -> f64 {
    f64::from(u8::from(b))
}

/// The process (start time, memory, whether it serves, heartbeat ticks; the process
/// collector's standard names as the Prometheus client libraries export them, read by the
/// heartbeat at most once a second), and the heartbeat's lateness: since start (a
/// histogram) and over the last minute.
const PROCESS: &[Metric<Status>] = &[
    Metric {
        name: "turnstile_build_info",
        help: "The running build: 1, labelled with the version and the git revision.",
        kind: Gauge,
        read: |s| labelled([([("version", s.version), ("revision", s.revision)], 1.0)]),
    },
    Metric {
        name: "turnstile_start_time_seconds",
        help: "When the gateway's loop started, in seconds since the Unix epoch.",
        kind: Gauge,
        read: |s| Value(s.process.started_unix_s),
    },
    Metric {
        name: "process_cpu_seconds_total",
        help: "Total user and system CPU time spent in seconds.",
        kind: Counter,
        read: |s| Value(s.process.cpu_seconds),
    },
    Metric {
        name: "process_open_fds",
        help: "Number of open file descriptors.",
        kind: Gauge,
        read: |s| Value(n(s.process.open_fds)),
    },
    Metric {
        name: "process_max_fds",
        help: "Maximum number of open file descriptors.",
        kind: Gauge,
        read: |s| Value(n(s.process.max_fds)),
    },
    Metric {
        name: "process_resident_memory_bytes",
        help: "Resident memory size in bytes.",
        kind: Gauge,
        read: |s| Value(n(s.process.rss_bytes)),
    },
    Metric {
        name: "process_start_time_seconds",
        help: "Start time of the process since unix epoch in seconds (the loop's start).",
        kind: Gauge,
        read: |s| Value(s.process.started_unix_s),
    },
    Metric {
        name: "turnstile_up",
        help: "1 while running, 0 while draining or stopped.",
        kind: Gauge,
        read: |s| Value(flag(s.state == RuntimeState::Running)),
    },
    Metric {
        name: "turnstile_ticks_total",
        help: "Heartbeat ticks of the reactor loop.",
        kind: Counter,
        read: |s| Value(n(s.ticks)),
    },
    Metric {
        name: "turnstile_loop_lag_seconds",
        help: "Lateness of the reactor's heartbeat ticks.",
        kind: Histogram,
        read: |s| Reading::Histogram(&s.histograms.loop_lag),
    },
    Metric {
        name: "turnstile_loop_lag_window_seconds",
        help: "Loop lag over the last minute: p50, p99 and max.",
        kind: Gauge,
        read: |s| {
            let w = &s.loop_lag_window_ms;
            by(
                "stat",
                [
                    ("p50", w.p50 * MS),
                    ("p99", w.p99 * MS),
                    ("max", w.max * MS),
                ],
            )
        },
    },
];

/// The bridge server's service delays, beside the loop lag: how long ready connections
/// waited for their turn.
const SERVICE: &[Metric<ServiceStatus>] = &[
    Metric {
        name: "turnstile_bridge_read_delay_seconds",
        help: "Time a readable bridge connection waited until it was read.",
        kind: Histogram,
        read: |s| Reading::Histogram(&s.read_delay),
    },
    Metric {
        name: "turnstile_bridge_write_delay_seconds",
        help: "Time a bridge connection with output waited until it was written.",
        kind: Histogram,
        read: |s| Reading::Histogram(&s.write_delay),
    },
    Metric {
        name: "turnstile_bridge_service_delay_recent_seconds",
        help: "Bridge service delays over the last 10 to 12 s: p50, p99 and max.",
        kind: Gauge,
        read: |s| {
            let (r, w) = (&s.read_delay_recent_ms, &s.write_delay_recent_ms);
            labelled([
                ([("direction", "read"), ("stat", "p50")], r.p50 * MS),
                ([("direction", "read"), ("stat", "p99")], r.p99 * MS),
                ([("direction", "read"), ("stat", "max")], r.max * MS),
                ([("direction", "write"), ("stat", "p50")], w.p50 * MS),
                ([("direction", "write"), ("stat", "p99")], w.p99 * MS),
                ([("direction", "write"), ("stat", "max")], w.max * MS),
            ])
        },
    },
];

/// Sessions and the agents they hold between turns.
const SESSIONS: &[Metric<SessionCounts>] = &[
    Metric {
        name: "turnstile_sessions",
        help: "Sessions holding a slot.",
        kind: Gauge,
        read: |s| Value(n(s.total)),
    },
    Metric {
        name: "turnstile_sessions_waiting_for_worker",
        help: "Sessions waiting for a free turn worker.",
        kind: Gauge,
        read: |s| Value(n(s.waiting_for_worker)),
    },
    Metric {
        name: "turnstile_agents",
        help: "Agents held between turns: idle (cached) or parked by a busy session.",
        kind: Gauge,
        read: |s| {
            by(
                "state",
                [
                    ("cached", n(s.cached_agents)),
                    ("parked", n(s.parked_agents)),
                ],
            )
        },
    },
    Metric {
        name: "turnstile_agent_cache_overflows_total",
        help: "Agents kept beyond the cache cap because their session was busy.",
        kind: Counter,
        read: |s| Value(n(s.cache_overflows)),
    },
];

/// Turns running and ended, their durations, the messages waiting for them, and the
/// refusals by reason.
const TURNS: &[Metric<Status>] = &[
    Metric {
        name: "turnstile_turns_running",
        help: "Agent turns running now.",
        kind: Gauge,
        read: |s| Value(n(s.turns.in_flight)),
    },
    Metric {
        name: "turnstile_turns_held",
        help: "Of the turns running, those waiting for their start record or a free worker.",
        kind: Gauge,
        read: |s| Value(n(s.turns.held)),
    },
    Metric {
        name: "turnstile_messages_queued",
        help: "Messages waiting in session queues.",
        kind: Gauge,
        read: |s| Value(n(s.sessions.queued_messages)),
    },
    Metric {
        name: "turnstile_turns_total",
        help: "Agent turns ended, by outcome.",
        kind: Counter,
        read: |s| {
            let t = &s.turns;
            by(
                "outcome",
                [
                    ("completed", n(t.completed)),
                    ("failed", n(t.failed)),
                    ("cancelled", n(t.cancelled)),
                    ("abandoned", n(t.abandoned)),
                ],
            )
        },
    },
    Metric {
        name: "turnstile_turn_duration_seconds",
        help: "Agent turn durations, from start to end (abandoned turns at abandonment).",
        kind: Histogram,
        read: |s| Reading::Histogram(&s.histograms.turn_duration),
    },
    Metric {
        name: "turnstile_messages_accepted_total",
        help: "Messages accepted by the runtime.",
        kind: Counter,
        read: |s| Value(n(s.messages.accepted)),
    },
    Metric {
        name: "turnstile_messages_queued_cancelled_total",
        help: "Queued messages cancelled before their turn (/stop, /new, shutdown).",
        kind: Counter,
        read: |s| Value(n(s.messages.queued_cancelled)),
    },
    Metric {
        name: "turnstile_rejections_total",
        help: "Messages refused, by reason.",
        kind: Counter,
        read: rejections,
    },
];

/// Reasons exposed before the first refusal for them, so an alert on them has a series:
/// the runtime's (named where they are defined) and the bridge server's two of its own.
const ALWAYS_REJECTED: [&str; 5] = [
    RejectReason::QueueFull.as_str(),
    RejectReason::Overloaded.as_str(),
    RejectReason::ShuttingDown.as_str(),
    "backpressure",
    "storage",
];

/// Refusals by reason, [`ALWAYS_REJECTED`] always present. The bridge counts every
/// rejection, the runtime's included; without a bridge, the runtime's own.
fn rejections(s: &Status) -> Reading<'_> {
    let by_reason = match s.frontend.as_ref().and_then(|f| f.bridge.as_ref()) {
        Some(b) => &b.rejected,
        None => &s.rejected_by_reason,
    };
    let mut samples: Vec<(&str, f64)> = by_reason.iter().map(|(k, v)| (*k, n(*v))).collect();
    for reason in ALWAYS_REJECTED {
        if !by_reason.contains_key(reason) {
            samples.push((reason, 0.0));
        }
    }
    samples.sort_by(|a, b| a.0.cmp(b.0));
    by("reason", samples)
}

/// Agent cleanups: ended by result, queued, pending.
const CLEANUPS: &[Metric<CleanupCounts>] = &[
    Metric {
        name: "turnstile_cleanups_total",
        help: "Agent cleanups (close) ended, by result.",
        kind: Counter,
        read: |c| {
            by(
                "result",
                [
                    ("done", n(c.done)),
                    ("timed_out", n(c.timed_out)),
                    ("failed", n(c.failed)),
                ],
            )
        },
    },
    Metric {
        name: "turnstile_cleanup_queue_depth",
        help: "Cleanups waiting for close() to start.",
        kind: Gauge,
        read: |c| Value(n(c.queued)),
    },
    Metric {
        name: "turnstile_cleanups_pending",
        help: "Cleanups not yet finished nor timed out.",
        kind: Gauge,
        read: |c| Value(n(c.pending)),
    },
];

/// Worker threads by pool and state, and the replacements for stuck ones.
const WORKERS: &[Metric<WorkerCounts>] = &[
    Metric {
        name: "turnstile_worker_threads",
        help: "Worker threads alive, by pool and state.",
        kind: Gauge,
        read: |w| {
            let states =
                |t: &ThreadStates| [("idle", t.idle), ("busy", t.busy), ("stuck", t.stuck)];
            labelled(
                [("turn", &w.turn_threads), ("cleanup", &w.cleanup_threads)]
                    .into_iter()
                    .flat_map(|(pool, t)| {
                        states(t).map(|(state, k)| ([("pool", pool), ("state", state)], n(k)))
                    }),
            )
        },
    },
    Metric {
        name: "turnstile_async_tasks",
        help: "Async agents' turns and closes running as tasks on the embedder's executor.",
        kind: Gauge,
        read: |w| {
            by(
                "kind",
                [("turn", n(w.async_turns)), ("close", n(w.async_closes))],
            )
        },
    },
    Metric {
        name: "turnstile_replaced_threads_total",
        help: "Threads given up on (stuck past a deadline) and replaced, both pools.",
        kind: Counter,
        read: |w| Value(n(w.replaced)),
    },
];

/// Events handed back to the submitter: partials forwarded and skipped, events undelivered.
const DELIVERIES: &[Metric<MessageCounts>] = &[
    Metric {
        name: "turnstile_partials_forwarded_total",
        help: "Partial replies delivered to the submitter.",
        kind: Counter,
        read: |m| Value(n(m.partials_forwarded)),
    },
    Metric {
        name: "turnstile_partials_skipped_total",
        help: "Partial replies not sent to the embedder's Events stream, which held events_backlog unread events.",
        kind: Counter,
        read: |m| Value(n(m.partials_skipped)),
    },
    Metric {
        name: "turnstile_events_undelivered_total",
        help: "Events that could not be handed to their sink.",
        kind: Counter,
        read: |m| Value(n(m.events_undelivered)),
    },
];

/// The tokens the agents' models consumed, when the agent factory counts them.
const LLM_TOKENS: &[Metric<[ModelUsage]>] = &[Metric {
    name: "turnstile_llm_tokens_total",
    help: "Tokens the agents' model requests used, by model and direction (prompt: in, completion: out).",
    kind: Counter,
    read: |by_model| {
        if by_model.is_empty() {
            return Reading::Absent;
        }
        labelled(by_model.iter().flat_map(|m| {
            [
                (
                    [("model", m.model.as_str()), ("direction", "prompt")],
                    n(m.usage.prompt_tokens),
                ),
                (
                    [("model", m.model.as_str()), ("direction", "completion")],
                    n(m.usage.completion_tokens),
                ),
            ]
        }))
    },
}];

/// The agents' failed model requests by kind, when the factory counts them (openai).
const AGENT_FAILURES: &[Metric<Status>] = &[Metric {
    name: "turnstile_agent_failures_total",
    help: "The agents' failed model requests by kind: connect (no answer: refused, reset, timed out, DNS, TLS), status (an answer other than 2xx, each retry counted), stall (the reply stopped, or passed its deadline).",
    kind: Counter,
    read: |s| {
        s.agent_failures.map_or(Reading::Absent, |f| {
            by(
                "kind",
                [
                    ("connect", n(f.connect)),
                    ("status", n(f.status)),
                    ("stall", n(f.stall)),
                ],
            )
        })
    },
}];

/// Per named agent (`[[agent]]` tables and the top-level `default`), bounded by the tables.
const PER_AGENT: &[Metric<[AgentFigures]>] = &[
    Metric {
        name: "turnstile_agent_sessions",
        help: "Sessions each named agent serves now (their agents are live).",
        kind: Gauge,
        read: |agents| {
            by(
                "agent",
                agents.iter().map(|a| (a.name.as_str(), n(a.sessions))),
            )
        },
    },
    Metric {
        name: "turnstile_agent_tokens_total",
        help: "Tokens each named agent's model requests used, by direction (since the reload that last changed the agent tables).",
        kind: Counter,
        read: |agents| {
            labelled(
                agents
                    .iter()
                    .filter_map(|a| a.usage.map(|u| (a, u)))
                    .flat_map(|(a, u)| {
                        [
                            (
                                [("agent", a.name.as_str()), ("direction", "prompt")],
                                n(u.prompt_tokens),
                            ),
                            (
                                [("agent", a.name.as_str()), ("direction", "completion")],
                                n(u.completion_tokens),
                            ),
                        ]
                    }),
            )
        },
    },
    Metric {
        name: "turnstile_agent_request_failures_total",
        help: "Each named agent's failed model requests, by kind (as turnstile_agent_failures_total; since the reload that last changed the agent tables).",
        kind: Counter,
        read: |agents| {
            labelled(
                agents
                    .iter()
                    .filter_map(|a| a.failures.map(|f| (a, f)))
                    .flat_map(|(a, f)| {
                        [
                            ("connect", f.connect),
                            ("status", f.status),
                            ("stall", f.stall),
                        ]
                        .map(|(kind, v)| ([("agent", a.name.as_str()), ("kind", kind)], n(v)))
                    }),
            )
        },
    },
];

/// The bridge server's connections, platforms and errors.
const BRIDGE: &[Metric<BridgeStatus>] = &[
    Metric {
        name: "turnstile_connections",
        help: "Bridge connections open, by whether they have authenticated.",
        kind: Gauge,
        read: |b| {
            let unauthenticated = n(b.unauthenticated);
            by(
                "state",
                [
                    ("authenticated", n(b.connections) - unauthenticated),
                    ("unauthenticated", unauthenticated),
                ],
            )
        },
    },
    Metric {
        name: "turnstile_connections_refused_total",
        help: "Bridge connections refused or closed at a bound.",
        kind: Counter,
        read: |b| Value(n(b.connections_refused)),
    },
    Metric {
        name: "turnstile_platforms",
        help: "Platforms known to the bridge.",
        kind: Gauge,
        read: |b| Value(n(b.platforms)),
    },
    Metric {
        name: "turnstile_bridge_errors_total",
        help: "Bridge lines answered with an error.",
        kind: Counter,
        read: |b| Value(n(b.errors)),
    },
    Metric {
        name: "turnstile_partials_dropped_total",
        help: "Partial replies dropped (connection gone or over its output bound).",
        kind: Counter,
        read: |b| Value(n(b.partials_dropped)),
    },
    Metric {
        name: "turnstile_access_refused_total",
        help: "Messages the access policy answered instead of an agent, by platform and notice (pairing, denied, rate_limited, admin, ignored).",
        kind: Counter,
        read: |b| {
            labelled(b.access.refused.iter().filter_map(|(key, count)| {
                let (platform, notice) = key.split_once(':')?;
                Some(([("platform", platform), ("notice", notice)], n(*count)))
            }))
        },
    },
    Metric {
        name: "turnstile_access_pending_codes",
        help: "Pairing codes waiting for an admin's !approve.",
        kind: Gauge,
        read: |b| Value(n(b.access.pending_codes)),
    },
    Metric {
        name: "turnstile_tls_cert_expiry_seconds",
        help: "When the served TLS certificate expires (notAfter), in seconds since the Unix epoch.",
        kind: Gauge,
        read: |b| {
            b.tls_cert_not_after_unix_s
                .map_or(Reading::Absent, |t| Value(t as f64))
        },
    },
];

/// One figure of each platform's outbox, labelled by platform.
fn per_platform(
    outboxes: &BTreeMap<String, PlatformStatus>,
    figure: fn(&PlatformStatus) -> f64,
) -> Reading<'_> {
    by(
        "platform",
        outboxes
            .iter()
            .map(|(platform, p)| (platform.as_str(), figure(p))),
    )
}

/// Each platform's outbox: results waiting, their bytes, results owed and held, results
/// dropped for a stale platform.
const OUTBOXES: &[Metric<BTreeMap<String, PlatformStatus>>] = &[
    Metric {
        name: "turnstile_outbox_depth",
        help: "Results waiting in a platform's outbox for a bridge to read them.",
        kind: Gauge,
        read: |o| per_platform(o, |p| n(p.outbox_events)),
    },
    Metric {
        name: "turnstile_outbox_bytes",
        help: "Bytes of the results waiting in a platform's outbox.",
        kind: Gauge,
        read: |o| per_platform(o, |p| n(p.outbox_bytes)),
    },
    Metric {
        name: "turnstile_outbox_reserved",
        help: "Results a platform is owed (accepted, not yet delivered), outbox included.",
        kind: Gauge,
        read: |o| per_platform(o, |p| n(p.reserved_events)),
    },
    Metric {
        name: "turnstile_outbox_held",
        help: "Results held back until room frees in --outbox-bytes (in order, none dropped).",
        kind: Gauge,
        read: |o| per_platform(o, |p| n(p.held_events)),
    },
    Metric {
        name: "turnstile_outbox_held_bytes",
        help: "Text bytes of the held results.",
        kind: Gauge,
        read: |o| per_platform(o, |p| n(p.held_bytes)),
    },
    Metric {
        name: "turnstile_outbox_stale_dropped_total",
        help: "Results dropped undelivered because their platform stayed absent past --outbox-stale-after (each logged).",
        kind: Counter,
        read: |o| per_platform(o, |p| n(p.stale_dropped)),
    },
];

/// The journal (`--data-dir`): whether its writes fail, its batches, what waits for it.
const JOURNAL: &[Metric<JournalStatus>] = &[
    Metric {
        name: "turnstile_journal_failing",
        help: "1 while the journal's last write failed (new messages are rejected `storage`).",
        kind: Gauge,
        read: |j| Value(flag(j.failing)),
    },
    Metric {
        name: "turnstile_journal_batches_total",
        help: "Transactions the journal wrote (group commits).",
        kind: Counter,
        read: |j| Value(n(j.batches)),
    },
    Metric {
        name: "turnstile_journal_failed_batches_total",
        help: "Transactions the journal failed to write.",
        kind: Counter,
        read: |j| Value(n(j.failed_batches)),
    },
    Metric {
        name: "turnstile_journal_pending_durable",
        help: "Accepted messages waiting for the journal before their ack.",
        kind: Gauge,
        read: |j| Value(n(j.pending_durable)),
    },
    Metric {
        name: "turnstile_journal_queued_records",
        help: "Records sent to the journal thread and not yet taken.",
        kind: Gauge,
        read: |j| Value(n(j.queued_records)),
    },
    Metric {
        name: "turnstile_journal_disk_bytes",
        help: "Bytes the journal's files take on disk (database, write-ahead log, mark).",
        kind: Gauge,
        read: |j| j.disk_bytes.map_or(Reading::Absent, |b| Value(n(b))),
    },
    Metric {
        name: "turnstile_history_sessions",
        help: "Sessions with a stored conversation (the openai agent's durable history).",
        kind: Gauge,
        read: |j| j.history.map_or(Reading::Absent, |h| Value(n(h.sessions))),
    },
    Metric {
        name: "turnstile_history_bytes",
        help: "Bytes of the stored conversations together (bounded by --history-bytes).",
        kind: Gauge,
        read: |j| j.history.map_or(Reading::Absent, |h| Value(n(h.bytes))),
    },
    Metric {
        name: "turnstile_history_deleted_total",
        help: "Stored conversations deleted: past --history-bytes (evicted) or --history-ttl (expired).",
        kind: Counter,
        read: |j| {
            j.history.map_or(Reading::Absent, |h| {
                by(
                    "reason",
                    [("evicted", n(h.evicted)), ("expired", n(h.expired))],
                )
            })
        },
    },
    Metric {
        name: "turnstile_journal_write_seconds",
        help: "Time each journal write took: commit, sync and mark.",
        kind: Histogram,
        read: |j| Reading::Histogram(&j.write_seconds),
    },
];

/// The operations HTTP endpoint's connections and requests.
const HTTP: &[Metric<HttpStatus>] = &[
    Metric {
        name: "turnstile_http_connections",
        help: "Connections to the operations HTTP endpoint, and its cap.",
        kind: Gauge,
        read: |h| {
            by(
                "state",
                [("open", n(h.connections)), ("max", n(h.max_connections))],
            )
        },
    },
    Metric {
        name: "turnstile_http_requests_total",
        help: "Requests to the operations HTTP endpoint, by result.",
        kind: Counter,
        read: |h| {
            by(
                "result",
                [
                    ("all", n(h.requests)),
                    ("unauthorized", n(h.unauthorized)),
                    ("bad_request", n(h.bad_requests)),
                ],
            )
        },
    },
    Metric {
        name: "turnstile_http_connections_closed_total",
        help: "HTTP connections refused at the cap, evicted for a newcomer, or closed idle or for a late first head.",
        kind: Counter,
        read: |h| {
            by(
                "reason",
                [
                    ("refused", n(h.refused)),
                    ("idle", n(h.idle_closed)),
                    ("evicted", n(h.evicted)),
                    ("head_timeout", n(h.head_timeouts)),
                ],
            )
        },
    },
    Metric {
        name: "turnstile_http_renders_total",
        help: "Bodies of /status and /metrics rendered (once per status snapshot each, at most).",
        kind: Counter,
        read: |h| Value(n(h.renders)),
    },
];

#[cfg(test)]
mod tests;

/// A table's number as a label value (serve runs at most 16 tables).
fn table_label(index: usize) -> &'static str {
    const TABLES: [&str; 17] = [
        "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
    ];
    TABLES.get(index).copied().unwrap_or("many")
}

/// The bridges `serve` supervises (`[[bridge]]` tables), by platform and table number.
const SUPERVISED: &[Metric<[SupervisedBridge]>] = &[
    Metric {
        name: "turnstile_bridge_up",
        help: "1 while a supervised bridge is ready (connected to the gateway and, as it reports, to its platform), else 0.",
        kind: Gauge,
        read: |bridges| {
            labelled(bridges.iter().map(|b| {
                let labels = [
                    ("platform", b.platform.as_str()),
                    ("table", table_label(b.index)),
                ];
                (labels, flag(b.state == SupervisedState::Ready))
            }))
        },
    },
    Metric {
        name: "turnstile_bridge_restarts_total",
        help: "Times a supervised bridge's process was started again after it exited.",
        kind: Counter,
        read: |bridges| {
            labelled(bridges.iter().map(|b| {
                let labels = [
                    ("platform", b.platform.as_str()),
                    ("table", table_label(b.index)),
                ];
                (labels, n(b.restarts))
            }))
        },
    },
    Metric {
        name: "turnstile_bridge_state",
        help: "A supervised bridge's state: 1 on the state it is in (starting, ready, reconnecting, backoff).",
        kind: Gauge,
        read: |bridges| {
            use SupervisedState::{Backoff, Ready, Reconnecting, Starting};
            labelled(bridges.iter().flat_map(|b| {
                [
                    (Starting, "starting"),
                    (Ready, "ready"),
                    (Reconnecting, "reconnecting"),
                    (Backoff, "backoff"),
                ]
                .map(|(state, name)| {
                    let labels = [
                        ("platform", b.platform.as_str()),
                        ("table", table_label(b.index)),
                        ("state", name),
                    ];
                    (labels, flag(b.state == state))
                })
            }))
        },
    },
];
