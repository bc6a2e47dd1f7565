//! What a real-device run reports: the cmtime-style step table, the counts, the JSON
//! document (its field names are a stable interface) and the human summary.

use std::fmt::Write as _;
use std::time::Duration;

use cm_verbs::PumpCounters;
use serde::Serialize;

/// The timed steps of a connection, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Client: `rdma_resolve_addr` to ADDR_RESOLVED (the successful attempt).
    ResolveAddr,
    /// Client: `rdma_resolve_route` to ROUTE_RESOLVED.
    ResolveRoute,
    /// `rdma_create_qp`.
    CreateQp,
    /// The `rdma_connect` (client) or `rdma_accept` (server) call.
    Connect,
    /// From the return of the connect/accept call until the connection is established
    /// (ESTABLISHED, or the notify that forced it).
    Established,
    /// From ESTABLISHED until this side's messages are sent and as many received.
    Exchange,
    /// On the side that disconnects: from the disconnect call until the connection is
    /// closed (the side disconnected by its peer records none).
    Disconnect,
}

impl Step {
    /// Every step, in order.
    pub const ALL: [Step; 7] = [
        Step::ResolveAddr,
        Step::ResolveRoute,
        Step::CreateQp,
        Step::Connect,
        Step::Established,
        Step::Exchange,
        Step::Disconnect,
    ];

    /// The step's name in the table and the JSON.
    pub const fn name(self, server: bool) -> &'static str {
        match self {
            Step::ResolveAddr => "resolve_addr",
            Step::ResolveRoute => "resolve_route",
            Step::CreateQp => "create_qp",
            Step::Connect if server => "accept",
            Step::Connect => "connect",
            Step::Established => "established",
            Step::Exchange => "exchange",
            Step::Disconnect => "disconnect",
        }
    }

    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}

/// When one step of one connection started and ended, on the endpoint's clock (time
/// since the transport was created).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    /// Start.
    pub start: Option<Duration>,
    /// End.
    pub end: Option<Duration>,
}

impl Span {
    /// A span from `start` to `end`, either possibly unknown.
    pub fn between(start: Option<Duration>, end: Option<Duration>) -> Self {
        let mut span = Span::default();
        if let Some(start) = start {
            span.begin(start);
        }
        if let Some(end) = end {
            span.finish(end);
        }
        span
    }

    /// Notes the start (the first one counts).
    pub fn begin(&mut self, at: Duration) {
        self.start.get_or_insert(at);
    }

    /// Notes the end (the first one after a start counts).
    pub fn finish(&mut self, at: Duration) {
        if self.start.is_some() {
            self.end.get_or_insert(at);
        }
    }

    /// The duration, when the step both started and ended.
    pub fn duration(&self) -> Option<Duration> {
        Some(self.end?.saturating_sub(self.start?))
    }
}

/// One step over all connections, as cmtime reports it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct StepStats {
    /// The step's name.
    pub step: &'static str,
    /// Connections that completed the step.
    pub count: usize,
    /// Wall time from the first start to the last end, µs.
    pub total_us: u64,
    /// `total_us` divided by the connections of the run (cmtime's "avg/conn").
    pub avg_per_conn_us: u64,
    /// Sum of the per-connection durations, µs.
    pub sum_us: u64,
    /// `sum_us` divided by the connections of the run (cmtime's "us/conn").
    pub us_per_conn: u64,
    /// Longest per-connection duration, µs.
    pub max_us: u64,
    /// Shortest per-connection duration, µs.
    pub min_us: u64,
}

impl StepStats {
    /// Summarises `spans` (one per connection that took part) over a run of
    /// `connections`.
    pub fn from_spans(step: &'static str, spans: &[Span], connections: u32) -> Self {
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let done: Vec<(Duration, Duration)> = spans
            .iter()
            .filter_map(|s| Some((s.start?, s.end?)))
            .collect();
        let mut stats = StepStats {
            step,
            count: done.len(),
            ..StepStats::default()
        };
        if done.is_empty() {
            return stats;
        }
        let first = done.iter().map(|d| d.0).min().expect("non-empty");
        let last = done.iter().map(|d| d.1).max().expect("non-empty");
        let per_conn: Vec<u64> = done
            .iter()
            .map(|(start, end)| micros(end.saturating_sub(*start)))
            .collect();
        let connections = u64::from(connections.max(1));
        stats.total_us = micros(last.saturating_sub(first));
        stats.avg_per_conn_us = stats.total_us / connections;
        stats.sum_us = per_conn.iter().sum();
        stats.us_per_conn = stats.sum_us / connections;
        stats.max_us = per_conn.iter().copied().max().unwrap_or(0);
        stats.min_us = per_conn.iter().copied().min().unwrap_or(0);
        stats
    }
}

/// What a real-device run found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RealReport {
    /// Always "rdma".
    pub backend: &'static str,
    /// "server" or "client".
    pub role: &'static str,
    /// The local address (server: listening; client: of the first connection).
    pub local: Option<String>,
    /// The server's address (client).
    pub remote: Option<String>,
    /// Connections asked for.
    pub connections: u32,
    /// Whether the pump ran.
    pub pump: bool,
    /// Messages per connection this side sent first (0 on an echoing server).
    pub messages: u32,
    /// Bytes per message sent first.
    pub message_size: usize,
    /// Connections that reached ESTABLISHED.
    pub established: usize,
    /// Of those, established by the handshake itself (the RTU or REP came first,
    /// EISCONN races included).
    pub via_rtu: usize,
    /// Of those, rescued by notify (server side): `via_comm_est + via_receive`.
    pub via_notify: usize,
    /// Rescued by notify after a COMM_EST asynchronous event.
    pub via_comm_est: usize,
    /// Rescued by notify after a receive completion (soft-RoCE raises no COMM_EST).
    pub via_receive: usize,
    /// Connections where notify answered EISCONN: the RTU had won the race.
    pub already_established_races: usize,
    /// Connections that failed (never established, or an error on the way).
    pub failed: usize,
    /// Connections torn down cleanly (disconnect called and DISCONNECTED received).
    pub disconnected: usize,
    /// Address resolutions retried after ADDR_ERROR (client).
    pub resolve_retries: u32,
    /// Connections closed because a deadline passed (connect, establish, or no activity).
    pub timed_out: usize,
    /// Set when the run stopped early: the device went away or failed.
    pub aborted: Option<String>,
    /// Messages sent (completed sends).
    pub messages_sent: u64,
    /// Messages received (completed receives).
    pub messages_received: u64,
    /// What the pump did.
    pub pump_counters: PumpJson,
    /// Per-step timings, cmtime style.
    pub steps: Vec<StepStats>,
    /// Why connections failed, one line each.
    pub failures: Vec<String>,
    /// Wall time of the whole run, seconds.
    pub seconds: f64,
}

impl RealReport {
    /// Whether every connection was established, exchanged and torn down cleanly.
    pub fn is_clean(&self) -> bool {
        let all = usize::try_from(self.connections).unwrap_or(usize::MAX);
        self.aborted.is_none()
            && self.failed == 0
            && self.established == all
            && self.disconnected == all
    }
}

/// The pump's counters, for JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PumpJson {
    /// notify returned 0.
    pub forced: u64,
    /// notify returned EISCONN.
    pub already_established: u64,
    /// notify answered an error.
    pub notify_failed: u64,
    /// The same count under its former name, kept for readers of the stable JSON.
    pub rejected: u64,
    /// Receive completions that triggered a notify.
    pub receive_triggers: u64,
    /// COMM_EST for QPs no connection owns.
    pub unrouted: u64,
    /// Asynchronous events passed to the application.
    pub passed_through: u64,
}

impl From<PumpCounters> for PumpJson {
    fn from(c: PumpCounters) -> Self {
        PumpJson {
            forced: c.forced,
            already_established: c.already_established,
            notify_failed: c.notify_failed,
            rejected: c.notify_failed,
            receive_triggers: c.receive_triggers,
            unrouted: c.unrouted,
            passed_through: c.passed_through,
        }
    }
}

/// The human summary: a header, cmtime's step table, then outcomes.
pub fn human(r: &RealReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cmnotify: rdma {} {}{}, {} connection(s), {}, pump {}",
        r.role,
        r.local.as_deref().unwrap_or("-"),
        r.remote
            .as_deref()
            .map(|a| format!(" {} {a}", if r.role == "server" { "<-" } else { "->" }))
            .unwrap_or_default(),
        r.connections,
        match (r.role, r.messages) {
            ("server", 0) => "echoing what clients send".to_string(),
            (_, 0) => "no data".to_string(),
            (_, n) => format!("{n} message(s) of {} B each way", r.message_size),
        },
        if r.pump { "on" } else { "OFF" }
    );
    let _ = writeln!(
        out,
        "step             avg/conn  total(us)    us/conn    sum(us)    max(us)    min(us)"
    );
    for s in &r.steps {
        let _ = writeln!(
            out,
            "{:<13}  {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            s.step, s.avg_per_conn_us, s.total_us, s.us_per_conn, s.sum_us, s.max_us, s.min_us
        );
    }
    let _ = writeln!(
        out,
        "established {}/{} (by RTU {}, forced by notify {} [COMM_EST {}, receive completion {}], \
         EISCONN races {}), disconnected {}, timed out {}, failed {}",
        r.established,
        r.connections,
        r.via_rtu,
        r.via_notify,
        r.via_comm_est,
        r.via_receive,
        r.already_established_races,
        r.disconnected,
        r.timed_out,
        r.failed
    );
    let _ = writeln!(
        out,
        "messages sent {}, received {}; resolve retries {}; {:.3} s",
        r.messages_sent, r.messages_received, r.resolve_retries, r.seconds
    );
    let p = &r.pump_counters;
    if r.pump {
        let _ = writeln!(
            out,
            "pump: forced {}, EISCONN {}, notify failed {}, receive triggers {}, unrouted {}, passed through {}",
            p.forced, p.already_established, p.notify_failed, p.receive_triggers, p.unrouted, p.passed_through
        );
    }
    for failure in &r.failures {
        let _ = writeln!(out, "failed: {failure}");
    }
    if let Some(why) = &r.aborted {
        let _ = writeln!(out, "stopped: {why}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(start_us: u64, end_us: u64) -> Span {
        Span::between(
            Some(Duration::from_micros(start_us)),
            Some(Duration::from_micros(end_us)),
        )
    }

    #[test]
    fn step_stats_follow_cmtime() {
        let spans = [
            span(0, 100),
            span(50, 350),
            Span::default(),
            Span::between(Some(Duration::ZERO), None),
        ];
        let stats = StepStats::from_spans("connect", &spans, 4);
        assert_eq!(stats.count, 2);
        assert_eq!(stats.total_us, 350, "first start to last end");
        assert_eq!(stats.avg_per_conn_us, 350 / 4);
        assert_eq!(stats.sum_us, 400);
        assert_eq!(stats.us_per_conn, 100);
        assert_eq!((stats.max_us, stats.min_us), (300, 100));
    }

    #[test]
    fn a_step_nobody_completed_is_all_zeroes() {
        let stats = StepStats::from_spans("disconnect", &[Span::default()], 1);
        assert_eq!(
            stats,
            StepStats {
                step: "disconnect",
                ..StepStats::default()
            }
        );
    }

    #[test]
    fn spans_keep_their_first_start_and_end() {
        let base = Duration::from_secs(5);
        let mut s = Span::default();
        s.finish(base);
        assert_eq!(s.end, None, "no end without a start");
        s.begin(base);
        s.begin(base + Duration::from_secs(1));
        s.finish(base + Duration::from_millis(3));
        s.finish(base + Duration::from_secs(2));
        assert_eq!(s.duration(), Some(Duration::from_millis(3)));
    }

    #[test]
    fn json_field_names_are_stable() {
        let report = RealReport {
            backend: "rdma",
            role: "client",
            local: None,
            remote: Some("10.77.1.1:7471".into()),
            connections: 2,
            pump: false,
            messages: 1,
            message_size: 100,
            established: 2,
            via_rtu: 2,
            via_notify: 0,
            via_comm_est: 0,
            via_receive: 0,
            already_established_races: 0,
            failed: 0,
            disconnected: 2,
            timed_out: 0,
            aborted: None,
            resolve_retries: 1,
            messages_sent: 2,
            messages_received: 2,
            pump_counters: PumpCounters::default().into(),
            steps: vec![StepStats::from_spans("connect", &[], 2)],
            failures: vec![],
            seconds: 0.25,
        };
        let json = serde_json::to_value(&report).unwrap();
        let mut fields: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut expected = vec![
            "backend",
            "role",
            "local",
            "remote",
            "connections",
            "pump",
            "messages",
            "message_size",
            "established",
            "via_rtu",
            "via_notify",
            "via_comm_est",
            "via_receive",
            "already_established_races",
            "failed",
            "disconnected",
            "timed_out",
            "aborted",
            "resolve_retries",
            "messages_sent",
            "messages_received",
            "pump_counters",
            "steps",
            "failures",
            "seconds",
        ];
        fields.sort_unstable();
        expected.sort_unstable();
        assert_eq!(
            fields, expected,
            "add new fields to this list; never rename"
        );
        let step = &json["steps"][0];
        for key in [
            "step",
            "count",
            "total_us",
            "avg_per_conn_us",
            "sum_us",
            "us_per_conn",
            "max_us",
            "min_us",
        ] {
            assert!(step.get(key).is_some(), "{key}: {step}");
        }
        assert_eq!(json["pump_counters"]["forced"], 0);
    }

    #[test]
    fn the_human_summary_names_every_step_and_the_outcome() {
        let steps: Vec<StepStats> = [Step::CreateQp, Step::Connect, Step::Established]
            .iter()
            .map(|s| StepStats::from_spans(s.name(true), &[span(0, 10)], 1))
            .collect();
        let report = RealReport {
            backend: "rdma",
            role: "server",
            local: Some("10.77.1.1:7471".into()),
            remote: None,
            connections: 1,
            pump: true,
            messages: 0,
            message_size: 100,
            established: 1,
            via_rtu: 0,
            via_notify: 1,
            via_comm_est: 0,
            via_receive: 1,
            already_established_races: 0,
            failed: 0,
            disconnected: 1,
            timed_out: 0,
            aborted: None,
            resolve_retries: 0,
            messages_sent: 1,
            messages_received: 1,
            pump_counters: PumpCounters::default().into(),
            steps,
            failures: vec![],
            seconds: 0.5,
        };
        assert!(report.is_clean());
        let text = human(&report);
        for needle in [
            "rdma server 10.77.1.1:7471",
            "echoing",
            "create_qp",
            "accept",
            "established 1/1 (by RTU 0, forced by notify 1 [COMM_EST 0, receive completion 1]",
            "pump: forced 0",
        ] {
            assert!(text.contains(needle), "{needle}: {text}");
        }
        let unclean = RealReport {
            disconnected: 0,
            ..report.clone()
        };
        assert!(!unclean.is_clean());
        let aborted = RealReport {
            aborted: Some("the device of 10.77.1.1:7471 was removed".into()),
            ..report
        };
        assert!(
            !aborted.is_clean(),
            "a run stopped by the device is not clean"
        );
        assert!(human(&aborted).contains("stopped: the device"));
    }
}
