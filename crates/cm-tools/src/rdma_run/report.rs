//! What a real-device run reports: the cmtime-style step table, the counts, the JSON
//! document (its field names are a stable interface) and the human summary.

use std::fmt::Write as _;

use cm_verbs::PumpCounters;
use serde::Serialize;

use crate::steps::StepStats;

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
    /// Endpoints the run used, each on its own thread (`--endpoints`).
    pub endpoints: u32,
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
    /// Passive connections the CM reported disconnected before established, taken as
    /// established by the peer's message (its DREQ overtook its lost RTU).
    pub via_peer_message: usize,
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
    /// Accepts that took a QP made ahead of their request (server, shared queues).
    pub ready_qps_taken: u64,
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
    /// COMM_EST events the pump received, whatever became of them (forced, EISCONN
    /// after a receive completion won, unrouted).
    pub comm_est: u64,
    /// Triggers on connections whose transport notify cannot force (iWARP): no notify.
    pub not_forcible: u64,
}

impl PumpJson {
    /// Adds another endpoint's counters.
    pub fn add(&mut self, other: &PumpJson) {
        self.forced += other.forced;
        self.already_established += other.already_established;
        self.notify_failed += other.notify_failed;
        self.rejected += other.rejected;
        self.receive_triggers += other.receive_triggers;
        self.unrouted += other.unrouted;
        self.passed_through += other.passed_through;
        self.comm_est += other.comm_est;
        self.not_forcible += other.not_forcible;
    }
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
            comm_est: c.comm_est,
            not_forcible: c.not_forcible,
        }
    }
}

/// The human summary: a header, cmtime's step table, then outcomes.
pub fn human(r: &RealReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cmnotify: rdma {} {}{}, {} connection(s){}, {}, pump {}",
        r.role,
        r.local.as_deref().unwrap_or("-"),
        r.remote
            .as_deref()
            .map(|a| format!(" {} {a}", if r.role == "server" { "<-" } else { "->" }))
            .unwrap_or_default(),
        r.connections,
        if r.endpoints > 1 {
            format!(" over {} endpoints on their own threads", r.endpoints)
        } else {
            String::new()
        },
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
        "established {}/{} (by the handshake {}, forced by notify {} [COMM_EST {}, receive completion {}], \
         EISCONN races {}, by the peer's message {}), disconnected {}, timed out {}, \
         failed {}",
        r.established,
        r.connections,
        r.via_rtu,
        r.via_notify,
        r.via_comm_est,
        r.via_receive,
        r.already_established_races,
        r.via_peer_message,
        r.disconnected,
        r.timed_out,
        r.failed
    );
    let _ = writeln!(
        out,
        "messages sent {}, received {}; resolve retries {}; {:.3} s",
        r.messages_sent, r.messages_received, r.resolve_retries, r.seconds
    );
    if r.role == "server" {
        let _ = writeln!(out, "accepts on QPs made ahead {}", r.ready_qps_taken);
    }
    let p = &r.pump_counters;
    if r.pump {
        let _ = writeln!(
            out,
            "pump: forced {}, EISCONN {}, notify failed {}, receive triggers {}, unrouted {}, passed through {}, COMM_EST {}, nothing to force (iWARP) {}",
            p.forced, p.already_established, p.notify_failed, p.receive_triggers, p.unrouted, p.passed_through, p.comm_est, p.not_forcible
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
    use crate::steps::tests::span;
    use crate::steps::Step;

    #[test]
    fn json_field_names_are_stable() {
        let report = RealReport {
            backend: "rdma",
            role: "client",
            local: None,
            remote: Some("10.77.1.1:7471".into()),
            connections: 2,
            endpoints: 1,
            pump: false,
            messages: 1,
            message_size: 100,
            established: 2,
            via_rtu: 2,
            via_notify: 0,
            via_comm_est: 0,
            via_receive: 0,
            already_established_races: 0,
            via_peer_message: 0,
            failed: 0,
            disconnected: 2,
            timed_out: 0,
            aborted: None,
            resolve_retries: 1,
            messages_sent: 2,
            messages_received: 2,
            ready_qps_taken: 0,
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
            "endpoints",
            "pump",
            "messages",
            "message_size",
            "established",
            "via_rtu",
            "via_notify",
            "via_comm_est",
            "via_receive",
            "already_established_races",
            "via_peer_message",
            "failed",
            "disconnected",
            "timed_out",
            "aborted",
            "resolve_retries",
            "messages_sent",
            "messages_received",
            "ready_qps_taken",
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
            endpoints: 2,
            pump: true,
            messages: 0,
            message_size: 100,
            established: 1,
            via_rtu: 0,
            via_notify: 1,
            via_comm_est: 0,
            via_receive: 1,
            already_established_races: 0,
            via_peer_message: 0,
            failed: 0,
            disconnected: 1,
            timed_out: 0,
            aborted: None,
            resolve_retries: 0,
            messages_sent: 1,
            messages_received: 1,
            ready_qps_taken: 1,
            pump_counters: PumpCounters::default().into(),
            steps,
            failures: vec![],
            seconds: 0.5,
        };
        assert!(report.is_clean());
        let text = human(&report);
        for needle in [
            "rdma server 10.77.1.1:7471",
            "1 connection(s) over 2 endpoints on their own threads",
            "echoing",
            "create_qp",
            "accept",
            "established 1/1 (by the handshake 0, forced by notify 1 [COMM_EST 0, receive completion 1]",
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
