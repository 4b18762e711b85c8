//! Prometheus metrics: the text exposition format 0.0.4, rendered from a status snapshot's
//! typed figures (the histograms themselves are kept by the reactor, `crate::histogram`).
//!
//! Every name starts `turnstile_`; every label's values come from a bounded set (outcomes,
//! reasons, pools, states, platforms — at most `--max-platforms` of them).

use std::collections::BTreeMap;

use super::exposition::Exposition;
use crate::liveness::{BridgeStatus, JournalStatus, PlatformStatus, ServiceStatus};
use crate::liveness::{
    CleanupCounts, HttpStatus, MessageCounts, RuntimeState, SessionCounts, Status, ThreadStates,
    WorkerCounts,
};

/// The metrics of a status snapshot, in the text exposition format 0.0.4: one step per group
/// of families, in the order they are exposed.
pub(crate) fn render(s: &Status) -> String {
    let mut e = Exposition::new();
    render_process(&mut e, s);
    render_loop_lag(&mut e, s);
    if let Some(service) = s.frontend.as_ref().and_then(|f| f.service.as_ref()) {
        render_service(&mut e, service);
    }
    render_sessions(&mut e, &s.sessions);
    render_turns(&mut e, s);
    render_rejections(&mut e, s);
    render_cleanups(&mut e, &s.cleanups);
    render_workers(&mut e, &s.workers);
    render_deliveries(&mut e, &s.messages);
    render_llm_tokens(&mut e, &s.agent_usage_by_model);
    if let Some(f) = &s.frontend {
        if let Some(b) = &f.bridge {
            render_bridge(&mut e, b);
            render_outboxes(&mut e, &b.outboxes);
            if let Some(j) = &b.journal {
                render_journal(&mut e, j);
            }
            if let Some(c) = &b.cluster {
                super::cluster_metrics::render_cluster(&mut e, c);
            }
        }
        if let Some(h) = &f.http {
            render_http(&mut e, h);
        }
    }
    e.finish()
}

/// The process: start time, memory, whether it serves, heartbeat ticks.
fn render_process(e: &mut Exposition, s: &Status) {
    e.info(
        "turnstile_build_info",
        "The running build: 1, labelled with the version and the git revision.",
        &[("version", s.version), ("revision", s.revision)],
    );
    e.gauge(
        "turnstile_start_time_seconds",
        "When the gateway's loop started, in seconds since the Unix epoch.",
        s.process.started_unix_s,
    );
    render_process_standard(e, s);
    e.gauge(
        "turnstile_up",
        "1 while running, 0 while draining or stopped.",
        f64::from(u8::from(s.state == RuntimeState::Running)),
    );
    e.counter(
        "turnstile_ticks_total",
        "Heartbeat ticks of the reactor loop.",
        s.ticks as f64,
    );
}

/// The process collector's standard names (as the Prometheus client libraries export them),
/// read by the heartbeat at most once a second.
fn render_process_standard(e: &mut Exposition, s: &Status) {
    let p = &s.process;
    e.counter(
        "process_cpu_seconds_total",
        "Total user and system CPU time spent in seconds.",
        p.cpu_seconds,
    );
    e.gauge(
        "process_open_fds",
        "Number of open file descriptors.",
        p.open_fds as f64,
    );
    e.gauge(
        "process_max_fds",
        "Maximum number of open file descriptors.",
        p.max_fds as f64,
    );
    e.gauge(
        "process_resident_memory_bytes",
        "Resident memory size in bytes.",
        p.rss_bytes as f64,
    );
    e.gauge(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds (the loop's start).",
        p.started_unix_s,
    );
}

/// The tokens the agents' models consumed, when the agent factory counts them.
fn render_llm_tokens(e: &mut Exposition, by_model: &[crate::agent::ModelUsage]) {
    if by_model.is_empty() {
        return;
    }
    let samples: Vec<([(&str, &str); 2], f64)> = by_model
        .iter()
        .flat_map(|m| {
            [
                (
                    [("model", m.model.as_str()), ("direction", "prompt")],
                    m.usage.prompt_tokens as f64,
                ),
                (
                    [("model", m.model.as_str()), ("direction", "completion")],
                    m.usage.completion_tokens as f64,
                ),
            ]
        })
        .collect();
    let samples: Vec<(&[(&str, &str)], f64)> = samples.iter().map(|(l, v)| (&l[..], *v)).collect();
    e.counters(
        "turnstile_llm_tokens_total",
        "Tokens the agents' model requests used, by model and direction (prompt: in, completion: out).",
        &samples,
    );
}

/// The heartbeat's lateness: since start (a histogram) and over the last minute.
fn render_loop_lag(e: &mut Exposition, s: &Status) {
    let ms = 1e-3;
    e.histogram(
        "turnstile_loop_lag_seconds",
        "Lateness of the reactor's heartbeat ticks.",
        &s.histograms.loop_lag,
    );
    let w = &s.loop_lag_window_ms;
    e.gauges(
        "turnstile_loop_lag_window_seconds",
        "Loop lag over the last minute: p50, p99 and max.",
        &[
            (&[("stat", "p50")][..], w.p50 * ms),
            (&[("stat", "p99")][..], w.p99 * ms),
            (&[("stat", "max")][..], w.max * ms),
        ],
    );
}

/// The bridge server's service delays, beside the loop lag: how long ready connections
/// waited for their turn.
fn render_service(e: &mut Exposition, s: &ServiceStatus) {
    e.histogram(
        "turnstile_bridge_read_delay_seconds",
        "Time a readable bridge connection waited until it was read.",
        &s.read_delay,
    );
    e.histogram(
        "turnstile_bridge_write_delay_seconds",
        "Time a bridge connection with output waited until it was written.",
        &s.write_delay,
    );
    let (r, w, ms) = (&s.read_delay_recent_ms, &s.write_delay_recent_ms, 1e-3);
    e.gauges(
        "turnstile_bridge_service_delay_recent_seconds",
        "Bridge service delays over the last 10 to 12 s: p50, p99 and max.",
        &[
            (&[("direction", "read"), ("stat", "p50")][..], r.p50 * ms),
            (&[("direction", "read"), ("stat", "p99")][..], r.p99 * ms),
            (&[("direction", "read"), ("stat", "max")][..], r.max * ms),
            (&[("direction", "write"), ("stat", "p50")][..], w.p50 * ms),
            (&[("direction", "write"), ("stat", "p99")][..], w.p99 * ms),
            (&[("direction", "write"), ("stat", "max")][..], w.max * ms),
        ],
    );
}

/// Sessions and the agents they hold between turns.
fn render_sessions(e: &mut Exposition, s: &SessionCounts) {
    e.gauge(
        "turnstile_sessions",
        "Sessions holding a slot.",
        s.total as f64,
    );
    e.gauge(
        "turnstile_sessions_waiting_for_worker",
        "Sessions waiting for a free turn worker.",
        s.waiting_for_worker as f64,
    );
    e.gauges(
        "turnstile_agents",
        "Agents held between turns: idle (cached) or parked by a busy session.",
        &[
            (&[("state", "cached")][..], s.cached_agents as f64),
            (&[("state", "parked")][..], s.parked_agents as f64),
        ],
    );
    e.counter(
        "turnstile_agent_cache_overflows_total",
        "Agents kept beyond the cache cap because their session was busy.",
        s.cache_overflows as f64,
    );
}

/// Turns running and ended, their durations, and the messages waiting for them.
fn render_turns(e: &mut Exposition, s: &Status) {
    let t = &s.turns;
    e.gauge(
        "turnstile_turns_running",
        "Agent turns running now.",
        t.in_flight as f64,
    );
    e.gauge(
        "turnstile_turns_held",
        "Of the turns running, those waiting for their start record or a free worker.",
        t.held as f64,
    );
    e.gauge(
        "turnstile_messages_queued",
        "Messages waiting in session queues.",
        s.sessions.queued_messages as f64,
    );
    e.counters(
        "turnstile_turns_total",
        "Agent turns ended, by outcome.",
        &[
            (&[("outcome", "completed")][..], t.completed as f64),
            (&[("outcome", "failed")][..], t.failed as f64),
            (&[("outcome", "cancelled")][..], t.cancelled as f64),
            (&[("outcome", "abandoned")][..], t.abandoned as f64),
        ],
    );
    e.histogram(
        "turnstile_turn_duration_seconds",
        "Agent turn durations, from start to end (abandoned turns at abandonment).",
        &s.histograms.turn_duration,
    );
    e.counter(
        "turnstile_messages_accepted_total",
        "Messages accepted by the runtime.",
        s.messages.accepted as f64,
    );
    e.counter(
        "turnstile_messages_queued_cancelled_total",
        "Queued messages cancelled before their turn (/stop, /new, shutdown).",
        s.messages.queued_cancelled as f64,
    );
}

/// Refusals by reason, the runtime's three reasons always present.
fn render_rejections(e: &mut Exposition, s: &Status) {
    // The bridge counts every rejection, the runtime's included; without a bridge, the
    // runtime's own.
    let by_reason = match s.frontend.as_ref().and_then(|f| f.bridge.as_ref()) {
        Some(b) => &b.rejected,
        None => &s.rejected_by_reason,
    };
    let mut samples: Vec<(&str, f64)> = by_reason.iter().map(|(k, v)| (*k, *v as f64)).collect();
    // Always present, so an alert on them has a series before the first one happens.
    for reason in [
        "queue_full",
        "overloaded",
        "shutting_down",
        "backpressure",
        "storage",
    ] {
        if !by_reason.contains_key(reason) {
            samples.push((reason, 0.0));
        }
    }
    samples.sort_by(|a, b| a.0.cmp(b.0));
    e.counters_by(
        "turnstile_rejections_total",
        "Messages refused, by reason.",
        "reason",
        &samples,
    );
}

/// Agent cleanups: ended by result, queued, pending.
fn render_cleanups(e: &mut Exposition, c: &CleanupCounts) {
    e.counters(
        "turnstile_cleanups_total",
        "Agent cleanups (close) ended, by result.",
        &[
            (&[("result", "done")][..], c.done as f64),
            (&[("result", "timed_out")][..], c.timed_out as f64),
            (&[("result", "failed")][..], c.failed as f64),
        ],
    );
    e.gauge(
        "turnstile_cleanup_queue_depth",
        "Cleanups waiting for close() to start.",
        c.queued as f64,
    );
    e.gauge(
        "turnstile_cleanups_pending",
        "Cleanups not yet finished nor timed out.",
        c.pending as f64,
    );
}

/// Worker threads by pool and state, and the replacements for stuck ones.
fn render_workers(e: &mut Exposition, w: &WorkerCounts) {
    let states = |t: &ThreadStates| [("idle", t.idle), ("busy", t.busy), ("stuck", t.stuck)];
    let mut threads = Vec::new();
    for (pool, t) in [("turn", &w.turn_threads), ("cleanup", &w.cleanup_threads)] {
        for (state, n) in states(t) {
            threads.push(([("pool", pool), ("state", state)], n as f64));
        }
    }
    let threads: Vec<(&[(&str, &str)], f64)> = threads.iter().map(|(l, v)| (&l[..], *v)).collect();
    e.gauges(
        "turnstile_worker_threads",
        "Worker threads alive, by pool and state.",
        &threads,
    );
    e.gauges(
        "turnstile_async_tasks",
        "Async agents' turns and closes running as tasks on the embedder's executor.",
        &[
            (&[("kind", "turn")][..], w.async_turns as f64),
            (&[("kind", "close")][..], w.async_closes as f64),
        ],
    );
    e.counter(
        "turnstile_replaced_threads_total",
        "Threads given up on (stuck past a deadline) and replaced, both pools.",
        w.replaced as f64,
    );
}

/// Events handed back to the submitter: partials forwarded, events undelivered.
fn render_deliveries(e: &mut Exposition, m: &MessageCounts) {
    e.counter(
        "turnstile_partials_forwarded_total",
        "Partial replies delivered to the submitter.",
        m.partials_forwarded as f64,
    );
    e.counter(
        "turnstile_events_undelivered_total",
        "Events that could not be handed to their sink.",
        m.events_undelivered as f64,
    );
}

/// The bridge server's connections, platforms and errors.
fn render_bridge(e: &mut Exposition, b: &BridgeStatus) {
    let unauthenticated = b.unauthenticated as f64;
    e.gauges(
        "turnstile_connections",
        "Bridge connections open, by whether they have authenticated.",
        &[
            (
                &[("state", "authenticated")][..],
                b.connections as f64 - unauthenticated,
            ),
            (&[("state", "unauthenticated")][..], unauthenticated),
        ],
    );
    e.counter(
        "turnstile_connections_refused_total",
        "Bridge connections refused or closed at a bound.",
        b.connections_refused as f64,
    );
    e.gauge(
        "turnstile_platforms",
        "Platforms known to the bridge.",
        b.platforms as f64,
    );
    e.counter(
        "turnstile_bridge_errors_total",
        "Bridge lines answered with an error.",
        b.errors as f64,
    );
    e.counter(
        "turnstile_partials_dropped_total",
        "Partial replies dropped (connection gone or over its output bound).",
        b.partials_dropped as f64,
    );
    if let Some(t) = b.tls_cert_not_after_unix_s {
        let help =
            "When the served TLS certificate expires (notAfter), in seconds since the Unix epoch.";
        e.gauge("turnstile_tls_cert_expiry_seconds", help, t as f64);
    }
}

/// The journal (`--data-dir`): whether its writes fail, its batches, what waits for it.
fn render_journal(e: &mut Exposition, j: &JournalStatus) {
    e.gauge(
        "turnstile_journal_failing",
        "1 while the journal's last write failed (new messages are rejected `storage`).",
        f64::from(u8::from(j.failing)),
    );
    e.counter(
        "turnstile_journal_batches_total",
        "Transactions the journal wrote (group commits).",
        j.batches as f64,
    );
    e.counter(
        "turnstile_journal_failed_batches_total",
        "Transactions the journal failed to write.",
        j.failed_batches as f64,
    );
    e.gauge(
        "turnstile_journal_pending_durable",
        "Accepted messages waiting for the journal before their ack.",
        j.pending_durable as f64,
    );
    e.gauge(
        "turnstile_journal_queued_records",
        "Records sent to the journal thread and not yet taken.",
        j.queued_records as f64,
    );
    if let Some(bytes) = j.disk_bytes {
        e.gauge(
            "turnstile_journal_disk_bytes",
            "Bytes the journal's files take on disk (database, write-ahead log, mark).",
            bytes as f64,
        );
    }
    e.histogram(
        "turnstile_journal_write_seconds",
        "Time each journal write took: commit, sync and mark.",
        &j.write_seconds,
    );
}

/// Each platform's outbox: results waiting, their bytes, results owed.
fn render_outboxes(e: &mut Exposition, outboxes: &BTreeMap<String, PlatformStatus>) {
    type Figure = fn(&PlatformStatus) -> usize;
    let families: [(&str, &str, Figure); 5] = [
        (
            "turnstile_outbox_depth",
            "Results waiting in a platform's outbox for a bridge to read them.",
            |p| p.outbox_events,
        ),
        (
            "turnstile_outbox_bytes",
            "Bytes of the results waiting in a platform's outbox.",
            |p| p.outbox_bytes,
        ),
        (
            "turnstile_outbox_reserved",
            "Results a platform is owed (accepted, not yet delivered), outbox included.",
            |p| p.reserved_events,
        ),
        (
            "turnstile_outbox_held",
            "Results held back until room frees in --outbox-bytes (in order, none dropped).",
            |p| p.held_events,
        ),
        (
            "turnstile_outbox_held_bytes",
            "Text bytes of the held results.",
            |p| p.held_bytes,
        ),
    ];
    for (name, help, figure) in families {
        let samples: Vec<(&str, f64)> = outboxes
            .iter()
            .map(|(platform, p)| (platform.as_str(), figure(p) as f64))
            .collect();
        e.gauges_by(name, help, "platform", &samples);
    }
    let stale: Vec<(&str, f64)> = outboxes
        .iter()
        .map(|(platform, p)| (platform.as_str(), p.stale_dropped as f64))
        .collect();
    e.counters_by(
        "turnstile_outbox_stale_dropped_total",
        "Results dropped undelivered because their platform stayed absent past --outbox-stale-after (each logged).",
        "platform",
        &stale,
    );
}

/// The operations HTTP endpoint's connections and requests.
fn render_http(e: &mut Exposition, h: &HttpStatus) {
    e.gauges(
        "turnstile_http_connections",
        "Connections to the operations HTTP endpoint, and its cap.",
        &[
            (&[("state", "open")][..], h.connections as f64),
            (&[("state", "max")][..], h.max_connections as f64),
        ],
    );
    e.counters(
        "turnstile_http_requests_total",
        "Requests to the operations HTTP endpoint, by result.",
        &[
            (&[("result", "all")][..], h.requests as f64),
            (&[("result", "unauthorized")][..], h.unauthorized as f64),
            (&[("result", "bad_request")][..], h.bad_requests as f64),
        ],
    );
    e.counters(
        "turnstile_http_connections_closed_total",
        "HTTP connections refused at the cap, evicted for a newcomer, or closed idle or for a late first head.",
        &[
            (&[("reason", "refused")][..], h.refused as f64),
            (&[("reason", "idle")][..], h.idle_closed as f64),
            (&[("reason", "evicted")][..], h.evicted as f64),
            (&[("reason", "head_timeout")][..], h.head_timeouts as f64),
        ],
    );
    e.counters(
        "turnstile_http_renders_total",
        "Bodies of /status and /metrics rendered (once per status snapshot each, at most).",
        &[(&[][..], h.renders as f64)],
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::histogram::PromHistogram;
    use crate::ops::exposition::number;
    use std::time::Duration;

    /// Every figure of a snapshot reaches its sample: distinct values in, each found out.
    #[test]
    fn every_status_figure_is_rendered() {
        use crate::liveness::{Histograms, ProcessInfo, RuntimeState};
        let mut s = Status {
            state: RuntimeState::Running,
            ticks: 101,
            ..Status::default()
        };
        s.process = ProcessInfo {
            rss_bytes: 102,
            cpu_seconds: 12.5,
            open_fds: 99,
            max_fds: 1024,
            started_unix_s: 103.5,
            updated_unix_s: 0.0,
            tick_interval_s: 0.1,
        };
        s.loop_lag_window_ms.p50 = 1.0;
        s.loop_lag_window_ms.p99 = 2.0;
        s.loop_lag_window_ms.max = 3.0;
        s.sessions.total = 104;
        s.sessions.waiting_for_worker = 105;
        s.sessions.cached_agents = 106;
        s.sessions.parked_agents = 107;
        s.sessions.cache_overflows = 108;
        s.sessions.queued_messages = 109;
        s.turns.in_flight = 110;
        s.turns.completed = 111;
        s.turns.failed = 112;
        s.turns.cancelled = 113;
        s.turns.abandoned = 114;
        s.messages.accepted = 115;
        s.messages.queued_cancelled = 116;
        s.messages.partials_forwarded = 117;
        s.messages.events_undelivered = 118;
        s.cleanups.done = 119;
        s.cleanups.timed_out = 120;
        s.cleanups.failed = 121;
        s.cleanups.queued = 122;
        s.cleanups.pending = 123;
        s.workers.turn_threads = ThreadStates {
            idle: 124,
            busy: 125,
            stuck: 126,
        };
        s.workers.cleanup_threads = ThreadStates {
            idle: 127,
            busy: 128,
            stuck: 129,
        };
        s.workers.replaced = 130;
        s.workers.async_turns = 134;
        s.workers.async_closes = 135;
        s.rejected_by_reason.insert("overloaded", 131);
        s.agent_usage_by_model = vec![crate::agent::ModelUsage {
            model: "gpt-x".into(),
            usage: crate::agent::AgentUsage {
                prompt_tokens: 132,
                completion_tokens: 133,
            },
        }];
        let mut h = Histograms::default();
        h.loop_lag.record(Duration::from_micros(70));
        h.turn_duration.record(Duration::from_millis(7));
        h.turn_duration.record(Duration::from_secs(700));
        s.histograms = std::sync::Arc::new(h);
        let text = render(&s);
        let has = |line: &str| {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            )
        };
        for line in [
            "turnstile_start_time_seconds 103.5",
            "process_resident_memory_bytes 102",
            "process_cpu_seconds_total 12.5",
            "process_open_fds 99",
            "process_max_fds 1024",
            "process_start_time_seconds 103.5",
            "turnstile_async_tasks{kind=\"turn\"} 134",
            "turnstile_async_tasks{kind=\"close\"} 135",
            "turnstile_llm_tokens_total{model=\"gpt-x\",direction=\"prompt\"} 132",
            "turnstile_llm_tokens_total{model=\"gpt-x\",direction=\"completion\"} 133",
            "turnstile_up 1",
            "turnstile_ticks_total 101",
            "turnstile_loop_lag_seconds_bucket{le=\"0.00005\"} 0",
            "turnstile_loop_lag_seconds_bucket{le=\"0.0001\"} 1",
            "turnstile_loop_lag_seconds_bucket{le=\"+Inf\"} 1",
            "turnstile_loop_lag_seconds_count 1",
            "turnstile_loop_lag_seconds_sum 0.00007",
            "turnstile_loop_lag_window_seconds{stat=\"p50\"} 0.001",
            "turnstile_loop_lag_window_seconds{stat=\"p99\"} 0.002",
            "turnstile_loop_lag_window_seconds{stat=\"max\"} 0.003",
            "turnstile_sessions 104",
            "turnstile_sessions_waiting_for_worker 105",
            "turnstile_agents{state=\"cached\"} 106",
            "turnstile_agents{state=\"parked\"} 107",
            "turnstile_agent_cache_overflows_total 108",
            "turnstile_messages_queued 109",
            "turnstile_turns_running 110",
            "turnstile_turns_total{outcome=\"completed\"} 111",
            "turnstile_turns_total{outcome=\"failed\"} 112",
            "turnstile_turns_total{outcome=\"cancelled\"} 113",
            "turnstile_turns_total{outcome=\"abandoned\"} 114",
            "turnstile_turn_duration_seconds_bucket{le=\"0.01\"} 1",
            "turnstile_turn_duration_seconds_bucket{le=\"600\"} 1",
            "turnstile_turn_duration_seconds_bucket{le=\"+Inf\"} 2",
            "turnstile_turn_duration_seconds_count 2",
            "turnstile_messages_accepted_total 115",
            "turnstile_messages_queued_cancelled_total 116",
            "turnstile_partials_forwarded_total 117",
            "turnstile_events_undelivered_total 118",
            "turnstile_cleanups_total{result=\"done\"} 119",
            "turnstile_cleanups_total{result=\"timed_out\"} 120",
            "turnstile_cleanups_total{result=\"failed\"} 121",
            "turnstile_cleanup_queue_depth 122",
            "turnstile_cleanups_pending 123",
            "turnstile_worker_threads{pool=\"turn\",state=\"idle\"} 124",
            "turnstile_worker_threads{pool=\"turn\",state=\"busy\"} 125",
            "turnstile_worker_threads{pool=\"turn\",state=\"stuck\"} 126",
            "turnstile_worker_threads{pool=\"cleanup\",state=\"idle\"} 127",
            "turnstile_worker_threads{pool=\"cleanup\",state=\"busy\"} 128",
            "turnstile_worker_threads{pool=\"cleanup\",state=\"stuck\"} 129",
            "turnstile_replaced_threads_total 130",
            "turnstile_rejections_total{reason=\"overloaded\"} 131",
            "turnstile_rejections_total{reason=\"queue_full\"} 0",
            "turnstile_rejections_total{reason=\"shutting_down\"} 0",
        ] {
            has(line);
        }
        assert!(
            !text.contains("turnstile_connections"),
            "no bridge, no bridge figures"
        );
        // With the bridge's figures: its rejections replace the runtime's, its own families.
        let mut bridge = BridgeStatus {
            connections: 5,
            unauthenticated: 2,
            connections_refused: 6,
            platforms: 7,
            errors: 8,
            partials_dropped: 9,
            tls_cert_not_after_unix_s: Some(1_900_000_000),
            ..BridgeStatus::default()
        };
        bridge
            .rejected
            .extend([("invalid", 10), ("overloaded", 131)]);
        let outbox = PlatformStatus {
            outbox_events: 11,
            outbox_bytes: 12,
            reserved_events: 13,
            held_events: 23,
            held_bytes: 24,
            stale_dropped: 25,
            ..PlatformStatus::default()
        };
        bridge.outboxes.insert("tg\"x".into(), outbox);
        let http = HttpStatus {
            connections: 14,
            max_connections: 15,
            requests: 16,
            unauthorized: 17,
            bad_requests: 18,
            refused: 19,
            idle_closed: 20,
            ..HttpStatus::default()
        };
        let mut service = ServiceStatus::default();
        service.read_delay.record(Duration::from_millis(3));
        service.read_delay_recent_ms.p99 = 21.0;
        service.write_delay_recent_ms.max = 22.0;
        s.frontend = Some(crate::liveness::FrontendStatus {
            bridge: Some(bridge),
            http: Some(http),
            service: Some(service),
            ..Default::default()
        });
        s.state = RuntimeState::Draining;
        let text = render(&s);
        let has = |line: &str| {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            )
        };
        for line in [
            "turnstile_up 0",
            "turnstile_rejections_total{reason=\"invalid\"} 10",
            "turnstile_rejections_total{reason=\"overloaded\"} 131",
            "turnstile_rejections_total{reason=\"queue_full\"} 0",
            "turnstile_connections{state=\"authenticated\"} 3",
            "turnstile_connections{state=\"unauthenticated\"} 2",
            "turnstile_connections_refused_total 6",
            "turnstile_platforms 7",
            "turnstile_bridge_errors_total 8",
            "turnstile_partials_dropped_total 9",
            "turnstile_tls_cert_expiry_seconds 1900000000",
            "turnstile_outbox_depth{platform=\"tg\\\"x\"} 11",
            "turnstile_outbox_bytes{platform=\"tg\\\"x\"} 12",
            "turnstile_outbox_reserved{platform=\"tg\\\"x\"} 13",
            "turnstile_outbox_held{platform=\"tg\\\"x\"} 23",
            "turnstile_outbox_held_bytes{platform=\"tg\\\"x\"} 24",
            "turnstile_outbox_stale_dropped_total{platform=\"tg\\\"x\"} 25",
            "turnstile_http_connections{state=\"open\"} 14",
            "turnstile_http_connections{state=\"max\"} 15",
            "turnstile_http_requests_total{result=\"all\"} 16",
            "turnstile_http_requests_total{result=\"unauthorized\"} 17",
            "turnstile_http_requests_total{result=\"bad_request\"} 18",
            "turnstile_http_connections_closed_total{reason=\"refused\"} 19",
            "turnstile_http_connections_closed_total{reason=\"idle\"} 20",
            "turnstile_bridge_read_delay_seconds_bucket{le=\"0.0025\"} 0",
            "turnstile_bridge_read_delay_seconds_bucket{le=\"0.005\"} 1",
            "turnstile_bridge_write_delay_seconds_count 0",
            "turnstile_bridge_service_delay_recent_seconds{direction=\"read\",stat=\"p99\"} 0.021",
            "turnstile_bridge_service_delay_recent_seconds{direction=\"write\",stat=\"max\"} 0.022",
        ] {
            has(line);
        }
        assert_eq!(
            text.matches("turnstile_rejections_total{reason=\"overloaded\"}")
                .count(),
            1
        );
    }

    #[test]
    fn exposition_text() {
        let mut e = Exposition::new();
        e.counter("turnstile_ticks_total", "Ticks.", 3.0);
        e.gauges(
            "turnstile_outbox_events",
            "Outbox.",
            &[(&[("platform", "a\"b\\c\nd")][..], 2.0)],
        );
        let mut h = PromHistogram::new(&[0.5]);
        h.record(Duration::from_millis(250));
        e.histogram("turnstile_x_seconds", "X.", &h);
        assert_eq!(
            e.finish(),
            "# HELP turnstile_ticks_total Ticks.\n# TYPE turnstile_ticks_total counter\nturnstile_ticks_total 3\n\
             # HELP turnstile_outbox_events Outbox.\n# TYPE turnstile_outbox_events gauge\nturnstile_outbox_events{platform=\"a\\\"b\\\\c\\nd\"} 2\n\
             # HELP turnstile_x_seconds X.\n# TYPE turnstile_x_seconds histogram\nturnstile_x_seconds_bucket{le=\"0.5\"} 1\nturnstile_x_seconds_bucket{le=\"+Inf\"} 1\nturnstile_x_seconds_sum 0.25\nturnstile_x_seconds_count 1\n"
        );
        assert_eq!(number(f64::NEG_INFINITY), "-Inf");
        assert_eq!(number(f64::NAN), "NaN");
        assert_eq!(number(1e-5), "0.00001");
    }
}
