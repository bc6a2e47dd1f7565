//! What `cmnotify` prints: a short human summary, or stable JSON.

use std::fmt::Write as _;
use std::io;
use std::time::Duration;

use serde::Serialize;

use crate::sim_run::SimReport;
use crate::stats::LatencySummary;

/// The JSON document of a simulated run. Field names are a stable interface: add
/// fields, never rename or remove them.
#[derive(Debug, Serialize)]
pub struct SimJson {
    /// Always "sim".
    pub backend: &'static str,
    /// Connections attempted.
    pub connections: u32,
    /// The seed.
    pub seed: u64,
    /// RTU loss probability.
    pub rtu_loss: f64,
    /// Whether the pump ran.
    pub pump: bool,
    /// Whether soft-RoCE was modelled (no COMM_EST).
    pub soft_roce: bool,
    /// Whether the client sent data once established.
    pub send_data: bool,
    /// Connections established on both sides.
    pub established: usize,
    /// Of those, the server side by the RTU.
    pub via_rtu: usize,
    /// Of those, the server side forced by notify.
    pub via_notify: usize,
    /// notify answered EISCONN (the RTU won the race).
    pub already_established_races: usize,
    /// Connections not established.
    pub failed: usize,
    /// Of those, the server side UNREACHABLE.
    pub unreachable: usize,
    /// Connections breaking "exactly one ESTABLISHED per side or a failure" (always 0).
    pub invariant_violations: usize,
    /// notify calls that answered an error (the pump's `notify_failed`).
    pub notify_failed: u64,
    /// Of `notify_failed`, the transient ones (the connection stayed pending and the next
    /// trigger retried).
    pub notify_failed_retriable: u64,
    /// The same figure as `notify_failed`, under its first name (kept for readers of
    /// older documents).
    pub notify_errors: u64,
    /// COMM_EST events nobody forwarded (the server endpoint's `unrouted` counter).
    pub comm_est_ignored: u64,
    /// RTUs the client sent, whether delivered or lost.
    pub rtus_sent: u64,
    /// Messages of any kind lost to the fault model (with cmnotify's flags only RTUs
    /// are faulted, so these are the RTUs lost).
    pub messages_dropped: u64,
    /// RTUs that arrived after a forced establish (counted and dropped).
    pub late_rtus: u64,
    /// For connections rescued by notify: virtual microseconds from the server's accept
    /// returning (REP sent) to ESTABLISHED (the key's name is the field's first meaning,
    /// from the trigger; the endpoint does not say when its notify ran).
    pub trigger_to_established_us: LatencyJson,
    /// Virtual seconds the run took.
    pub virtual_seconds: f64,
    /// Connections the endpoints still held after the teardown, plus CM events never
    /// acknowledged (always 0).
    pub teardown_failures: u64,
    /// With `--trace N`: the timeline of connection N, one line per entry (absent
    /// otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<Vec<String>>,
}

/// Percentiles in microseconds.
#[derive(Debug, Serialize)]
pub struct LatencyJson {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

/// Prints `value` as one pretty JSON document when `json` is set, else the `human` text.
/// A closed stdout (EPIPE: the reader went away, as `| head` does) is not an error.
/// `Err` carries the one-line message for an encoding or any other write failure (a
/// full disk); nothing panics.
pub fn emit(
    json: bool,
    value: &impl Serialize,
    human: impl FnOnce() -> String,
) -> Result<(), String> {
    let text = if json {
        let mut text =
            serde_json::to_string_pretty(value).map_err(|e| format!("cannot encode JSON: {e}"))?;
        text.push('\n');
        text
    } else {
        human()
    };
    write_quietly(&mut io::stdout().lock(), text.as_bytes())
}

/// Writes and flushes `bytes`; EPIPE is success, any other error one line of text.
pub(crate) fn write_quietly(out: &mut impl io::Write, bytes: &[u8]) -> Result<(), String> {
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(format!("cannot write the output: {e}")),
    }
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

impl From<LatencySummary> for LatencyJson {
    fn from(s: LatencySummary) -> Self {
        LatencyJson {
            count: s.count,
            p50: micros(s.p50),
            p99: micros(s.p99),
            max: micros(s.max),
        }
    }
}

impl From<&SimReport> for SimJson {
    fn from(r: &SimReport) -> Self {
        SimJson {
            backend: "sim",
            connections: r.run.connections,
            seed: r.run.seed,
            rtu_loss: r.run.rtu_loss,
            pump: r.run.pump,
            soft_roce: r.run.soft_roce,
            send_data: r.run.send_data,
            established: r.established(),
            via_rtu: r.via_rtu(),
            via_notify: r.forced(),
            already_established_races: r.raced(),
            failed: r.failed(),
            unreachable: r.unreachable(),
            invariant_violations: r.invariant_violations(),
            notify_failed: r.pump.notify_failed,
            notify_failed_retriable: r.pump.notify_failed_retriable,
            notify_errors: r.pump.notify_failed,
            comm_est_ignored: r.comm_est_ignored,
            rtus_sent: r.fabric.sent_of(cm_mock::sim::MsgKind::Rtu),
            messages_dropped: r.fabric.dropped,
            late_rtus: r.fabric.late_rtus,
            trigger_to_established_us: r.trigger_to_established.into(),
            virtual_seconds: r.virtual_time.as_secs_f64(),
            teardown_failures: r.teardown_failures,
            trace: r
                .trace
                .as_ref()
                .map(|trace| trace.lines().map(str::to_owned).collect()),
        }
    }
}

fn show(d: Duration) -> String {
    if d >= Duration::from_secs(1) {
        format!("{:.2} s", d.as_secs_f64())
    } else if d >= Duration::from_millis(1) {
        format!("{:.2} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.1} µs", micros(d))
    }
}

/// The human summary of a simulated run.
pub fn human(r: &SimReport) -> String {
    let run = &r.run;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cmnotify: simulated fabric, {} connection(s), RTU loss {:.0}%{}, {}, {}, seed {}",
        run.connections,
        run.rtu_loss * 100.0,
        if run.drop_rtu_of.is_empty() {
            String::new()
        } else {
            format!(" + RTU dropped on {:?}", run.drop_rtu_of)
        },
        if run.send_data {
            "client sends at once"
        } else {
            "no data"
        },
        match (run.pump, run.soft_roce) {
            (true, false) => "pump on (COMM_EST)",
            (true, true) => "pump on (soft-RoCE: receive completions)",
            (false, _) => "pump OFF",
        },
        run.seed
    );
    let _ = writeln!(out, "  established          {:>8}", r.established());
    let _ = writeln!(out, "    via RTU            {:>8}", r.via_rtu());
    let _ = writeln!(
        out,
        "    rescued by notify  {:>8}   (RTU lost or late; COMM_EST/receive -> rdma_notify)",
        r.forced()
    );
    let _ = writeln!(
        out,
        "  EISCONN races        {:>8}   (RTU won; harmless)",
        r.raced()
    );
    let _ = writeln!(
        out,
        "  failed               {:>8}   (server UNREACHABLE: {})",
        r.failed(),
        r.unreachable()
    );
    if r.comm_est_ignored > 0 {
        let _ = writeln!(
            out,
            "  COMM_EST ignored     {:>8}   (no pump: nobody forwarded them)",
            r.comm_est_ignored
        );
    }
    if r.pump.notify_failed > 0 {
        let _ = writeln!(
            out,
            "  notify failed        {:>8}   (retriable: {})",
            r.pump.notify_failed, r.pump.notify_failed_retriable
        );
    }
    let t = &r.trigger_to_established;
    if t.count > 0 {
        let _ = writeln!(
            out,
            "  REP -> ESTABLISHED   p50 {}  p99 {}  max {}  (rescued ones; virtual time, {} samples)",
            show(t.p50),
            show(t.p99),
            show(t.max),
            t.count
        );
    }
    let _ = writeln!(
        out,
        "  exactly-once violations {}   teardown failures {}   virtual time {}",
        r.invariant_violations(),
        r.teardown_failures,
        show(r.virtual_time)
    );
    if let Some(trace) = &r.trace {
        let _ = writeln!(
            out,
            "\ntimeline of connection {}:",
            run.trace_conn.unwrap_or(0)
        );
        out.push_str(trace);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer failing every write with `kind`.
    struct Failing(io::ErrorKind);

    impl io::Write for Failing {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(self.0.into())
        }
        fn flush(&mut self) -> io::Result<()> {
            Err(self.0.into())
        }
    }

    #[test]
    fn a_closed_pipe_is_quiet_and_other_write_errors_are_one_line() {
        assert_eq!(
            write_quietly(&mut Failing(io::ErrorKind::BrokenPipe), b"x"),
            Ok(())
        );
        let full = write_quietly(&mut Failing(io::ErrorKind::StorageFull), b"x").unwrap_err();
        assert!(full.starts_with("cannot write the output: "), "{full}");
        assert_eq!(full.lines().count(), 1);
        let mut fine = Vec::new();
        assert_eq!(write_quietly(&mut fine, b"ok\n"), Ok(()));
        assert_eq!(fine, b"ok\n");
    }
}
