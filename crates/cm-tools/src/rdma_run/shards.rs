//! `--endpoints K`: K endpoints of one process, each driven by its own thread, as a
//! server on a many-core machine runs them (one per core, on one device): endpoint `i`
//! listens on (server) or connects to (client) port `port + i` with its share of the
//! connections; one report merges theirs, their steps on one clock.

use std::time::Duration;

use cm_core::CmError;

use super::report::RealReport;
use super::session::{run_one, step_stats, Shard};
use super::RealRun;
use crate::steps::{Step, StepTotals};

/// The most endpoints a run takes.
pub const MAX_ENDPOINTS: u32 = 64;

/// Runs `config.endpoints` endpoints side by side and merges their reports. The first
/// error of an endpoint that could not run is returned (the others end first).
pub(super) fn run(config: &RealRun) -> Result<RealReport, CmError> {
    let plans = plans(config)?;
    let threads: Vec<_> = plans
        .into_iter()
        .map(|plan| std::thread::spawn(move || run_one(&plan)))
        .collect();
    let mut shards = Vec::with_capacity(threads.len());
    let mut first_error = None;
    for thread in threads {
        match thread.join() {
            Ok(Ok(shard)) => shards.push(shard),
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(merge(config, shards)),
    }
}

/// Each endpoint's run: its port, its share of the connections (the first ones take
/// one more where they do not divide evenly), the timeline written by the first only.
fn plans(config: &RealRun) -> Result<Vec<RealRun>, CmError> {
    let k = config.endpoints;
    if !(1..=MAX_ENDPOINTS).contains(&k) {
        return Err(CmError::InvalidArgument {
            op: "cmnotify --endpoints",
            reason: "1 to 64 endpoints",
        });
    }
    if config.connections < k {
        return Err(CmError::InvalidArgument {
            op: "cmnotify --endpoints",
            reason: "fewer connections than endpoints: every endpoint needs one",
        });
    }
    if u32::from(config.port) + k - 1 > u32::from(u16::MAX) {
        return Err(CmError::InvalidArgument {
            op: "cmnotify --endpoints",
            reason: "the endpoints' ports would pass 65535",
        });
    }
    Ok((0..k)
        .map(|i| RealRun {
            port: config.port + i as u16,
            connections: config.connections / k + u32::from(i < config.connections % k),
            timeline: config.timeline.clone().filter(|_| i == 0),
            endpoints: 1,
            ..config.clone()
        })
        .collect())
}

/// One report of the whole run: counts summed, steps merged on the clock of the
/// endpoint made first, the longest run's wall time.
fn merge(config: &RealRun, shards: Vec<Shard>) -> RealReport {
    let origin = shards.iter().map(|s| s.origin).min();
    let mut totals = vec![StepTotals::default(); Step::ALL.len()];
    for shard in &shards {
        let shift = origin.map_or(Duration::ZERO, |o| shard.origin.duration_since(o));
        for (merged, theirs) in totals.iter_mut().zip(&shard.totals) {
            merged.merge(theirs, shift);
        }
    }
    let mut reports = shards.into_iter().map(|s| s.report);
    let mut merged = reports.next().expect("at least one endpoint");
    for r in reports {
        merged.established += r.established;
        merged.via_rtu += r.via_rtu;
        merged.via_notify += r.via_notify;
        merged.via_comm_est += r.via_comm_est;
        merged.via_receive += r.via_receive;
        merged.already_established_races += r.already_established_races;
        merged.via_peer_message += r.via_peer_message;
        merged.failed += r.failed;
        merged.disconnected += r.disconnected;
        merged.resolve_retries += r.resolve_retries;
        merged.timed_out += r.timed_out;
        merged.aborted = merged.aborted.or(r.aborted);
        merged.messages_sent += r.messages_sent;
        merged.messages_received += r.messages_received;
        merged.ready_qps_taken += r.ready_qps_taken;
        merged.pump_counters.add(&r.pump_counters);
        merged.failures.extend(r.failures);
        merged.remote = merged.remote.or(r.remote);
        merged.seconds = merged.seconds.max(r.seconds);
    }
    merged.connections = config.connections;
    merged.endpoints = config.endpoints;
    merged.steps = step_stats(config, |step| totals[step.index()]);
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_and_ports_are_shared_out() {
        let config = RealRun {
            server: true,
            port: 7000,
            connections: 7,
            endpoints: 3,
            timeline: Some("t.txt".into()),
            ..RealRun::default()
        };
        let plans = plans(&config).expect("plans");
        let shares: Vec<(u16, u32, bool)> = plans
            .iter()
            .map(|p| (p.port, p.connections, p.timeline.is_some()))
            .collect();
        assert_eq!(
            shares,
            [(7000, 3, true), (7001, 2, false), (7002, 2, false)]
        );
        assert!(plans.iter().all(|p| p.endpoints == 1 && p.server));
    }

    #[test]
    fn impossible_shares_are_refused() {
        let refused = |connections, endpoints, port| {
            let config = RealRun {
                connections,
                endpoints,
                port,
                ..RealRun::default()
            };
            matches!(plans(&config), Err(CmError::InvalidArgument { .. }))
        };
        assert!(refused(1, 2, 7000), "an endpoint with no connection");
        assert!(refused(100, 65, 7000), "too many endpoints");
        assert!(refused(100, 0, 7000), "no endpoint");
        assert!(refused(4, 2, u16::MAX), "ports past 65535");
        assert!(!refused(4, 2, u16::MAX - 1));
    }
}
