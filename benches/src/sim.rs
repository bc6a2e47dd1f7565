//! Fixtures on the mock and simulated backends, and the scale runs.

use cm_core::{CmEvent, CmEventType, CmId, QpNum};
use cm_mock::sim::{SimCmId, SimConfig, SimPair};
use cm_tools::sim_run::SimRun;
use cm_tools::stats::peak_rss_bytes;
use cm_verbs::{NotifyPump, Role};

pub use cm_mock::KernelLikeId;

/// Established connections on a [`SimPair`]: both sides got ESTABLISHED (the RTU
/// arrived), so `notify` on either id answers EISCONN, as on a live server.
#[derive(Debug)]
pub struct SimConnections {
    /// The fabric and its two nodes (the channels stay open as long as the ids are used).
    pub pair: SimPair,
    /// The passive (server) ids, one per connection.
    pub passive: Vec<SimCmId>,
    /// The active (client) ids.
    pub active: Vec<SimCmId>,
}

impl SimConnections {
    /// A pump with every passive id registered (as a server's pump would hold them),
    /// and their QP numbers in the same order: the events a bench feeds it.
    pub fn passive_pump(&self) -> (NotifyPump<SimCmId>, Vec<QpNum>) {
        let mut pump = NotifyPump::with_policy(Default::default(), self.passive.len());
        let qps = self
            .passive
            .iter()
            .map(|id| id.qp_num().expect("accepted ids have a QP"))
            .collect();
        for id in &self.passive {
            pump.register(id.clone(), Role::Passive)
                .expect("unique QP numbers");
        }
        (pump, qps)
    }
}

/// Opens `count` connections on a fresh fabric and runs it until every one is
/// established on both sides. Panics if one is not: the fixture is wrong then.
pub fn established_connections(count: usize) -> SimConnections {
    const PORT: u16 = 7471;
    let mut pair = SimPair::new(SimConfig::default(), 1);
    pair.listen(PORT).expect("a fresh node binds and listens");
    let mut active = Vec::with_capacity(count);
    for _ in 0..count {
        let id = pair.client.channel.create_id();
        id.resolve_addr(pair.server.node.id(), PORT)
            .expect("live node");
        active.push(id);
    }
    let mut passive = Vec::with_capacity(count);
    let mut established = 0;
    while established < 2 * count {
        let mut progressed = pair.fabric.step();
        while let Some(event) = pair.client.next_event().expect("simulated channel") {
            progressed = true;
            let id = event.id();
            let kind = event.event_type();
            event.ack().expect("acked once");
            match kind {
                CmEventType::AddrResolved => id.resolve_route().expect("resolved"),
                CmEventType::RouteResolved => {
                    id.create_qp().expect("device");
                    id.connect(b"").expect("route and QP ready");
                }
                CmEventType::Established => established += 1,
                other => panic!("client side: unexpected {other}"),
            }
        }
        while let Some(event) = pair.server.next_event().expect("simulated channel") {
            progressed = true;
            let id = event.id();
            let kind = event.event_type();
            event.ack().expect("acked once");
            match kind {
                CmEventType::ConnectRequest => {
                    id.create_qp().expect("device");
                    id.accept(b"").expect("fresh request");
                    passive.push(id);
                }
                CmEventType::Established => established += 1,
                other => panic!("server side: unexpected {other}"),
            }
        }
        assert!(
            progressed,
            "the fabric went idle before every connection was established"
        );
    }
    SimConnections {
        pair,
        passive,
        active,
    }
}

/// The process's minor page faults so far (`minflt` of `/proc/self/stat`): the first
/// touches of memory the kernel had to map, which a run on a reused heap does not pay.
pub fn minor_page_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the command name (in parentheses, may hold spaces): state, ppid, pgrp,
    // session, tty_nr, tpgid, flags, minflt.
    let (_, fields) = stat.rsplit_once(')')?;
    fields.split_whitespace().nth(7)?.parse().ok()
}

/// Whether glibc was told to keep freed memory (`GLIBC_TUNABLES` with a trim
/// threshold, as `cargo xtask bench` sets): then every repeated run reuses a heap that
/// is already mapped, whatever its size, as small runs always do.
pub fn heap_kept_warm() -> bool {
    std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.trim_threshold"))
}

/// The connection counts of the scale curve (one list, in cm-testkit).
pub use cm_testkit::SCALE_POINTS;

/// The probability of losing each RTU in the scale runs.
pub const SCALE_RTU_LOSS: f64 = 0.1;

/// The scale run of `connections`: a server and a client, each one `Endpoint` (the
/// connection API) over the simulated transport, the client opening every connection
/// at once, [`SCALE_RTU_LOSS`] of the RTUs lost (the client's
/// first SEND raises COMM_EST and the pump forces those), then a full teardown that
/// checks nothing is left unacknowledged.
pub fn scale_config(connections: u32) -> SimRun {
    SimRun {
        connections,
        rtu_loss: SCALE_RTU_LOSS,
        seed: 0x5ca1e,
        teardown: true,
        ..SimRun::default()
    }
}

/// Figure key: wall time of one simulated run of a million connections (the workload
/// of `cmnotify -c 1000000`), in its own process.
pub const MILLION_SECONDS: &str = "million/seconds";
/// Figure key: that process's peak resident set, MB.
pub const MILLION_PEAK_RSS_MB: &str = "million/peak_rss_mb";
/// Connections of the million run.
pub const MILLION: u32 = 1_000_000;
/// Set in the environment of the process the bench starts for the million run.
pub const MILLION_CHILD_VAR: &str = "CMNOTIFY_BENCH_MILLION_CHILD";

/// The million run as `cmnotify -c 1000000` runs it (its defaults: every RTU lost,
/// data sent, teardown); prints `<nanoseconds> <peak RSS bytes> <established>` for the
/// process that started this one. Its own process, so the peak is the run's alone.
pub fn million_child() {
    let config = cm_tools::sim_run::SimRun {
        connections: MILLION,
        ..cm_tools::sim_run::SimRun::default()
    };
    let started = std::time::Instant::now();
    let report = cm_tools::sim_run::run(&config);
    let took = started.elapsed();
    println!(
        "{} {} {}",
        took.as_nanos(),
        peak_rss_bytes().unwrap_or(0),
        report.established()
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use cm_core::{AsyncEventType, CmId, NotifyOutcome};

    #[test]
    fn established_simulated_ids_answer_eisconn() {
        let conns = established_connections(3);
        assert_eq!(conns.passive.len(), 3);
        for id in conns.passive.iter().chain(&conns.active) {
            assert_eq!(
                id.notify(AsyncEventType::CommEst),
                Ok(NotifyOutcome::AlreadyEstablished)
            );
        }
    }

    #[test]
    fn page_faults_are_counted_and_grow_with_fresh_memory() {
        let before = minor_page_faults().expect("Linux /proc/self/stat");
        // 64 MiB touched page by page: well past any heap the test already mapped.
        let mut fresh = vec![0u8; 64 << 20];
        for page in fresh.chunks_mut(4096) {
            page[0] = 1;
        }
        std::hint::black_box(&fresh);
        let after = minor_page_faults().expect("Linux /proc/self/stat");
        assert!(after > before, "{before} -> {after}");
    }

    #[test]
    fn a_small_scale_run_completes_and_keeps_the_invariant() {
        let report = cm_tools::sim_run::run(&scale_config(200));
        assert_eq!(report.established(), 200);
        assert_eq!(report.invariant_violations(), 0);
        assert_eq!(report.teardown_failures, 0);
        assert!(report.forced() > 0, "10% of 200 RTUs lost: some forced");
    }
}
