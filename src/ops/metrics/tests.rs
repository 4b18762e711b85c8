//! The metrics' tables, iterated: well-formed, all exposed, each reading its own figures.

use super::*;
use crate::histogram::PromHistogram;
use crate::liveness::Histograms;
use crate::ops::exposition::number;
use std::time::Duration;

/// Every declared family, in exposition order: name, help, kind.
fn declared() -> Vec<(&'static str, &'static str, Kind)> {
    fn heads<T: ?Sized>(
        t: &[Metric<T>],
    ) -> impl Iterator<Item = (&'static str, &'static str, Kind)> + '_ {
        t.iter().map(|m| (m.name, m.help, m.kind))
    }
    heads(PROCESS)
        .chain(heads(SERVICE))
        .chain(heads(SESSIONS))
        .chain(heads(TURNS))
        .chain(heads(CLEANUPS))
        .chain(heads(WORKERS))
        .chain(heads(DELIVERIES))
        .chain(heads(LLM_TOKENS))
        .chain(heads(AGENT_FAILURES))
        .chain(heads(BRIDGE))
        .chain(heads(OUTBOXES))
        .chain(heads(JOURNAL))
        .chain(heads(HTTP))
        .chain(heads(SUPERVISED))
        .collect()
}

/// A snapshot with every part present (bridge with its TLS expiry, journal with its disk figure, HTTP,
/// service delays, a platform, a model) and every number a different one (1000, 1001,
/// ... in the order of the JSON), read back typed.
fn full_status() -> Status {
    let mut bridge = BridgeStatus {
        journal: Some(JournalStatus {
            disk_bytes: Some(0),
            history: Some(crate::HistoryStatus::default()),
            ..JournalStatus::default()
        }),
        tls_cert_not_after_unix_s: Some(0),
        ..BridgeStatus::default()
    };
    bridge.rejected.insert("invalid", 0);
    bridge.access.refused.insert("matrix:pairing".into(), 0);
    bridge
        .outboxes
        .insert("tg\"x".into(), PlatformStatus::default());
    let mut s = Status {
        state: RuntimeState::Running,
        agent_usage_by_model: vec![ModelUsage::default()],
        agent_failures: Some(crate::agent::AgentFailures::default()),
        frontend: Some(crate::liveness::FrontendStatus {
            bridge: Some(bridge),
            http: Some(HttpStatus::default()),
            service: Some(ServiceStatus::default()),
            bridges: vec![SupervisedBridge {
                index: 1,
                platform: "matrix".into(),
                ..SupervisedBridge::default()
            }],
            ..Default::default()
        }),
        ..Status::default()
    };
    s.rejected_by_reason.insert("overloaded", 0);
    fn renumber(v: &mut serde_json::Value, next: &mut u64) {
        match v {
            serde_json::Value::Number(_) => {
                *v = (*next).into();
                *next += 1;
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(|v| renumber(v, next)),
            serde_json::Value::Object(o) => o.values_mut().for_each(|v| renumber(v, next)),
            _ => {}
        }
    }
    let mut v = serde_json::to_value(&s).unwrap();
    renumber(&mut v, &mut 1000);
    let text: &'static str = Box::leak(v.to_string().into_boxed_str());
    s = serde_json::from_str(text).unwrap();
    let mut h = Histograms::default();
    h.loop_lag.record(Duration::from_micros(70));
    h.turn_duration.record(Duration::from_secs(700));
    s.histograms = std::sync::Arc::new(h);
    s
}

/// The families' samples by family: `(family, labels, value)` per sample line
/// (histograms' series under their family's name).
fn samples(text: &str) -> Vec<(String, String, f64)> {
    let mut family = String::new();
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            family = rest.split(' ').next().unwrap().to_owned();
        } else if !line.starts_with('#') {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            assert!(name.starts_with(&family), "{line} outside {family}");
            out.push((family.clone(), labels.to_owned(), value.parse().unwrap()));
        }
    }
    out
}

/// The declarations are well-formed: names unique and valid Prometheus names with our
/// prefix (or a process collector's standard one), counters ending `_total` and only
/// they, help on one line.
#[test]
fn the_declared_families_are_well_formed() {
    let families = declared();
    let mut names: Vec<&str> = families.iter().map(|f| f.0).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), families.len(), "a name declared twice");
    for (name, help, kind) in families {
        let mut chars = name.chars();
        assert!(
            chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{name} is not a metric name"
        );
        assert!(
            name.starts_with("turnstile_") || name.starts_with("process_"),
            "{name} lacks the prefix"
        );
        assert_eq!(name.ends_with("_total"), kind == Kind::Counter, "{name}");
        assert!(!help.is_empty() && !help.contains('\n'), "{name}: {help:?}");
    }
}

/// A snapshot with every part present exposes exactly the declared families, in their
/// order, each with its help and type and at least one sample; `promtool` (when
/// installed) accepts the text.
#[test]
fn every_declared_family_is_exposed_and_nothing_else() {
    let text = render(&full_status());
    let heads: Vec<String> = declared()
        .iter()
        .flat_map(|(name, help, kind)| {
            [
                format!("# HELP {name} {help}"),
                format!("# TYPE {name} {}", kind.as_str()),
            ]
        })
        .collect();
    let exposed: Vec<&str> = text.lines().filter(|l| l.starts_with('#')).collect();
    assert_eq!(exposed, heads, "in\n{text}");
    let samples = samples(&text);
    for (name, _, _) in declared() {
        assert!(samples.iter().any(|s| s.0 == name), "{name} has no sample");
    }
    match std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(mut child) => {
            use std::io::Write;
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(text.as_bytes()).unwrap();
            drop(stdin);
            let out = child.wait_with_output().unwrap();
            let said = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "promtool check metrics: {said}\n{text}"
            );
        }
        Err(e) => eprintln!("promtool not run: {e}"),
    }
}

/// Every figure a family reads is its own: with every number of the snapshot a
/// different one, no figure shows up in two families (but the start time, which the
/// process collector's standard name repeats), and every family that reads a count
/// shows one.
#[test]
fn each_family_reads_its_own_figures() {
    let text = render(&full_status());
    let mut seen: BTreeMap<u64, &str> = BTreeMap::new();
    let samples = samples(&text);
    for (family, _, v) in &samples {
        // Counts are 1000 and up; flags, differences, milliseconds in seconds and the
        // always-present reasons' zeros are not figures of their own.
        if *v < 1000.0 || family.ends_with("_seconds") && !family.contains("start_time") {
            continue;
        }
        let first = *seen.entry(*v as u64).or_insert(family);
        assert!(
            first == family
                || [first, family.as_str()]
                    .iter()
                    .all(|n| n.ends_with("start_time_seconds")),
            "{v} in {family} and {first}\n{text}"
        );
    }
    let shown: Vec<&str> = samples
        .iter()
        .filter(|(_, _, v)| *v >= 1000.0)
        .map(|(f, _, _)| f.as_str())
        .collect();
    let derived = [
        "turnstile_build_info",
        "turnstile_up",
        "turnstile_loop_lag_seconds",
        "turnstile_loop_lag_window_seconds",
        "turnstile_bridge_read_delay_seconds",
        "turnstile_bridge_write_delay_seconds",
        "turnstile_bridge_service_delay_recent_seconds",
        "turnstile_turn_duration_seconds",
        "turnstile_journal_failing",
        "turnstile_journal_write_seconds",
        "turnstile_bridge_up",
        "turnstile_bridge_state",
    ];
    for (name, _, _) in declared() {
        assert!(
            derived.contains(&name) || shown.contains(&name),
            "{name} shows no figure of the snapshot\n{text}"
        );
    }
}

/// What the tables decide beyond reading a figure: the runtime's reasons always
/// present and the bridge's replacing the runtime's, `up` from the state, the
/// authenticated connections derived, labels escaped, absent parts absent.
#[test]
fn the_families_decisions() {
    let mut s = full_status();
    let text = render(&s);
    let b = s.frontend.as_ref().and_then(|f| f.bridge.clone()).unwrap();
    for line in [
        "turnstile_up 1".to_owned(),
        format!(
            "turnstile_rejections_total{{reason=\"invalid\"}} {}",
            b.rejected["invalid"]
        ),
        "turnstile_rejections_total{reason=\"queue_full\"} 0".to_owned(),
        "turnstile_rejections_total{reason=\"storage\"} 0".to_owned(),
        format!(
            "turnstile_connections{{state=\"authenticated\"}} {}",
            b.connections as f64 - b.unauthenticated as f64
        ),
        format!(
            "turnstile_outbox_depth{{platform=\"tg\\\"x\"}} {}",
            b.outboxes["tg\"x"].outbox_events
        ),
        "turnstile_loop_lag_seconds_bucket{le=\"0.0001\"} 1".to_owned(),
        "turnstile_turn_duration_seconds_bucket{le=\"+Inf\"} 1".to_owned(),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in\n{text}"
        );
    }
    assert!(
        !text.contains("reason=\"overloaded\"} 1"),
        "the runtime's replaced"
    );
    s.state = RuntimeState::Draining;
    s.frontend = None;
    s.agent_usage_by_model.clear();
    let text = render(&s);
    assert!(text.lines().any(|l| l == "turnstile_up 0"), "{text}");
    let overloaded = s.rejected_by_reason["overloaded"];
    assert!(text.contains(&format!(
        "turnstile_rejections_total{{reason=\"overloaded\"}} {overloaded}"
    )));
    for absent in [
        "turnstile_connections",
        "turnstile_llm_tokens",
        "turnstile_http",
        "turnstile_journal",
    ] {
        assert!(!text.contains(absent), "{absent} without its part\n{text}");
    }
    let mut j = JournalStatus::default();
    let mut e = Exposition::new();
    e.expose(JOURNAL, &j);
    assert!(
        !e.finish().contains("disk_bytes"),
        "no disk figure, no family"
    );
    j.disk_bytes = Some(5);
    let mut e = Exposition::new();
    e.expose(JOURNAL, &j);
    let text = e.finish();
    assert!(text.contains("turnstile_journal_disk_bytes 5\n"));
    assert!(
        !text.contains("turnstile_history"),
        "no stored conversations, no family"
    );
    j.history = Some(crate::HistoryStatus {
        sessions: 2,
        bytes: 300,
        evicted: 4,
        expired: 1,
    });
    let mut e = Exposition::new();
    e.expose(JOURNAL, &j);
    let text = e.finish();
    for line in [
        "turnstile_history_sessions 2\n",
        "turnstile_history_bytes 300\n",
        "turnstile_history_deleted_total{reason=\"evicted\"} 4\n",
        "turnstile_history_deleted_total{reason=\"expired\"} 1\n",
    ] {
        assert!(text.contains(line), "{line:?} missing\n{text}");
    }
}

#[test]
fn exposition_text() {
    const TEXT: &[Metric<f64>] = &[
        Metric {
            name: "turnstile_ticks_total",
            help: "Ticks.",
            kind: Counter,
            read: |v| Value(*v),
        },
        Metric {
            name: "turnstile_outbox_events",
            help: "Outbox.",
            kind: Gauge,
            read: |_| labelled([([("platform", "a\"b\\c\nd")], 2.0)]),
        },
    ];
    let mut e = Exposition::new();
    e.expose(TEXT, &3.0);
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

/// The windows' milliseconds in the snapshot are seconds in the exposition.
#[test]
fn the_windows_milliseconds_are_exposed_in_seconds() {
    let s = full_status();
    let text = render(&s);
    let samples = samples(&text);
    let exposed = |family: &str, labels: &str| {
        let labels = format!("{labels}}}");
        samples
            .iter()
            .find(|(f, l, _)| f == family && *l == labels)
            .map(|(_, _, v)| *v)
            .unwrap_or_else(|| panic!("no {family}{{{labels}\n{text}"))
    };
    let lag = &s.loop_lag_window_ms;
    let service = s.frontend.as_ref().and_then(|f| f.service.as_ref());
    let service = service.expect("a service part");
    let (r, w) = (
        &service.read_delay_recent_ms,
        &service.write_delay_recent_ms,
    );
    let recent = "turnstile_bridge_service_delay_recent_seconds";
    for (family, labels, ms) in [
        (
            "turnstile_loop_lag_window_seconds",
            r#"stat="p50""#,
            lag.p50,
        ),
        (
            "turnstile_loop_lag_window_seconds",
            r#"stat="p99""#,
            lag.p99,
        ),
        (
            "turnstile_loop_lag_window_seconds",
            r#"stat="max""#,
            lag.max,
        ),
        (recent, r#"direction="read",stat="p50""#, r.p50),
        (recent, r#"direction="read",stat="p99""#, r.p99),
        (recent, r#"direction="read",stat="max""#, r.max),
        (recent, r#"direction="write",stat="p50""#, w.p50),
        (recent, r#"direction="write",stat="p99""#, w.p99),
        (recent, r#"direction="write",stat="max""#, w.max),
    ] {
        assert!(
            ms >= 1000.0,
            "{family}{{{labels}}}: the snapshot's figure is {ms}"
        );
        let v = exposed(family, labels);
        assert!(
            (v - ms / 1000.0).abs() < 1e-9,
            "{family}{{{labels}}} = {v}, not {ms} ms"
        );
    }
}
