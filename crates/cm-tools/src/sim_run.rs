//! A server and a client on the simulated fabric, many connections at once: the same
//! [`Session`] code as the real mode (`cmnotify --backend rdma`), each side one
//! [`Endpoint`] over a [`SimTransport`] on one [`SimPair`]; only the transport differs.
//! Both endpoints are driven in one thread, alternately and without waiting, and the
//! fabric's virtual time moves only when neither has anything left to handle: events
//! the fabric brought, completions of its own sends, deadlines due. The client
//! disconnects each connection once its message came back, as the real client does.
//!
//! How every connection ended comes from the endpoints' events (ESTABLISHED reports per
//! side, how each got there, why each closed); the fabric contributes its counters and,
//! for a traced connection, its trace.

use std::time::Duration;

use cm_core::QpNum;
use cm_mock::sim::{
    ConnId, FaultAction, FaultOdds, FaultRule, MsgKind, SimAddr, SimConfig, SimFabric, SimPair,
    SimSide, SimStats, SimTransport, SimTransports, TraceEntry, TraceEvent,
};
use cm_verbs::{CloseReason, ConnectionId, Endpoint, EstablishedVia, Event, PumpCounters};

use crate::session::{endpoint_options, queue_caps, ConnRecord, Plan, Session};
use crate::stats::LatencySummary;

/// The port the simulated server listens on.
const PORT: u16 = 7471;
/// Bytes of the message the client sends once its side is established.
const PAYLOAD: usize = 64;
/// With a traced connection, the fabric's trace (which records every connection) is
/// drained and filtered every this many steps, so that memory follows one connection,
/// not the whole run.
const TRACE_DRAIN_STEPS: u64 = 1024;

/// What to simulate.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRun {
    /// Connections the client opens (all at once).
    pub connections: u32,
    /// Probability that each RTU is lost.
    pub rtu_loss: f64,
    /// Connections (0-based) whose every RTU is dropped, in addition to `rtu_loss`. A
    /// connection listed twice counts once (the report's copy is sorted and deduplicated).
    pub drop_rtu_of: Vec<u32>,
    /// Whether the client sends data as soon as its side is established (the data that
    /// raises COMM_EST on the server when the RTU is late or lost).
    pub send_data: bool,
    /// Whether the endpoints' notify path runs ([`Endpoint::set_notify`]); without it
    /// COMM_EST is ignored, as by an application that does not forward it.
    pub pump: bool,
    /// Model soft-RoCE: no COMM_EST is ever raised; only the receive completion tells.
    pub soft_roce: bool,
    /// Seed of every random decision.
    pub seed: u64,
    /// Record the timeline of this connection.
    pub trace_conn: Option<u32>,
    /// Further random faults per message kind (for fault matrices and property tests).
    pub odds: Vec<(MsgKind, FaultOdds)>,
    /// Disconnect every connection: the client each one as soon as its message came
    /// back (with `send_data`), then, once the fabric is quiet, whatever the client and
    /// then the server still hold, checking that the endpoints hold nothing more and
    /// that every CM event was acknowledged.
    pub teardown: bool,
    /// Deterministic faults (drop, delay, duplicate the nth REQ, REP, RTU, …), applied
    /// in addition to the random ones.
    pub rules: Vec<FaultRule>,
    /// Both sides' connections with queues of their own (`--own-queues`).
    pub own_queues: bool,
}

impl Default for SimRun {
    fn default() -> Self {
        SimRun {
            connections: 100,
            rtu_loss: 1.0,
            drop_rtu_of: Vec::new(),
            send_data: true,
            pump: true,
            soft_roce: false,
            seed: 1,
            trace_conn: None,
            odds: Vec::new(),
            teardown: true,
            rules: Vec::new(),
            own_queues: false,
        }
    }
}

/// How one connection ended.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConnOutcome {
    /// [`Event::Established`] reports the client's endpoint gave.
    pub active_established: u32,
    /// [`Event::Established`] reports the server's endpoint gave.
    pub passive_established: u32,
    /// The server side was established by the notify path
    /// ([`EstablishedVia::Notify`]).
    pub forced: bool,
    /// The notify path's notify answered EISCONN: the RTU won the race
    /// ([`EstablishedVia::RtuWonRace`]).
    pub raced: bool,
    /// Why the client side failed, if it did: how it closed ([`Event::Closed`]), unless
    /// it was established and then disconnected.
    pub active_failure: Option<CloseReason>,
    /// Why the server side failed, if it did (as `active_failure`).
    pub passive_failure: Option<CloseReason>,
}

impl ConnOutcome {
    /// The invariant: each side saw exactly one ESTABLISHED, or none and a failure.
    pub fn holds_invariant(&self) -> bool {
        let side = |established: u32, failure: &Option<CloseReason>| match established {
            1 => failure.is_none(),
            0 => true,
            _ => false,
        };
        side(self.active_established, &self.active_failure)
            && side(self.passive_established, &self.passive_failure)
    }

    /// Whether both sides are established.
    pub fn established(&self) -> bool {
        self.active_established == 1 && self.passive_established == 1
    }
}

/// Everything a run produced.
#[derive(Debug, Clone)]
pub struct SimReport {
    /// The configuration that ran.
    pub run: SimRun,
    /// Per connection, indexed by connection number.
    pub outcomes: Vec<ConnOutcome>,
    /// The server endpoint's notify counters (all zero without the pump).
    pub pump: PumpCounters,
    /// Asynchronous events (on this fabric, COMM_EST) the server's notify path did not
    /// take: the endpoint's `unrouted` counter. Without the pump, every COMM_EST.
    pub comm_est_ignored: u64,
    /// For connections the notify path rescued: virtual time from the server's accept
    /// returning (REP sent) to the connection established, from the endpoint's
    /// [`cm_verbs::ConnTimes`].
    pub trigger_to_established: LatencySummary,
    /// Virtual time the whole run took.
    pub virtual_time: Duration,
    /// The fabric's counters.
    pub fabric: SimStats,
    /// Connections the endpoints still held after the teardown, plus CM events handed
    /// to them and never acknowledged (must be 0).
    pub teardown_failures: u64,
    /// The timeline of the traced connection.
    pub trace: Option<String>,
    /// The traced connection's trace entries, the timeline's source (empty without a
    /// traced connection).
    pub trace_entries: Vec<TraceEntry>,
    /// Trace entries the fabric recorded, every connection's (0 without a traced
    /// connection).
    pub trace_entries_recorded: u64,
    /// The most trace entries held at once before being filtered down to the traced
    /// connection's: bounded by the drain interval, not by the number of connections.
    pub trace_entries_held_max: usize,
}

impl SimReport {
    /// Connections established on both sides.
    pub fn established(&self) -> usize {
        self.outcomes.iter().filter(|o| o.established()).count()
    }
    /// Connections whose server side was established through the pump's notify.
    pub fn forced(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| o.established() && o.forced)
            .count()
    }
    /// Connections established by the RTU alone.
    pub fn via_rtu(&self) -> usize {
        self.established() - self.forced()
    }
    /// Connections where notify met EISCONN (RTU won the race).
    pub fn raced(&self) -> usize {
        self.outcomes.iter().filter(|o| o.raced).count()
    }
    /// Connections whose server side ended UNREACHABLE.
    pub fn unreachable(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| matches!(o.passive_failure, Some(CloseReason::Unreachable { .. })))
            .count()
    }
    /// Connections not established on both sides.
    pub fn failed(&self) -> usize {
        self.outcomes.len() - self.established()
    }
    /// Connections breaking the exactly-once invariant (must be 0).
    pub fn invariant_violations(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|o| !o.holds_invariant())
            .count()
    }
}

/// Runs the simulation to completion (virtual time; no wall clock, no threads).
pub fn run(config: &SimRun) -> SimReport {
    run_with_progress(config, &mut |_| {})
}

/// The side of the shared server or client this run plays.
fn plan(config: &SimRun, server: bool, addr: SimAddr) -> Plan<SimAddr> {
    Plan {
        server,
        addr,
        source: None,
        connections: config.connections,
        notify: config.pump,
        // The client sends one message at once (the data that raises COMM_EST on a
        // server whose RTU is late or lost); the server echoes it.
        messages: u32::from(!server && config.send_data),
        message_size: PAYLOAD,
        caps: queue_caps(PAYLOAD),
        resolve_timeout: Duration::from_secs(2),
        resolve_attempts: 1,
        // The CM's own REP retries decide, as the demo without the pump shows.
        establish_timeout: None,
        // The client disconnects as soon as its message came back, as the real one
        // does: waiting for a quiet fabric would let every stale CM timer (a REP's
        // retry, 4.29 s) pass first. Without data there is no exchange to wait for,
        // and a DREQ at ESTABLISHED would end a server still waiting for a lost RTU
        // before its retries run out; those connections wait for the teardown.
        disconnect_when_done: config.teardown && config.send_data,
        connect_window: None,
        id_options: cm_verbs::core::IdOptions::default(),
    }
}

/// [`run`], calling `progress` now and then with how many connections have settled
/// (server side established or failed).
pub fn run_with_progress(config: &SimRun, progress: &mut dyn FnMut(usize)) -> SimReport {
    let mut drop_rtu_of = config.drop_rtu_of.clone();
    drop_rtu_of.sort_unstable();
    drop_rtu_of.dedup();
    let config = &SimRun {
        drop_rtu_of,
        ..config.clone()
    };
    let mut sim_config = if config.soft_roce {
        SimConfig::soft_roce()
    } else {
        SimConfig::default()
    };
    sim_config.trace = config.trace_conn.is_some();
    let pair = SimPair::new(sim_config, config.seed);
    let inputs = (Inputs::of(&pair.server), Inputs::of(&pair.client));
    let SimTransports {
        fabric,
        server,
        client,
    } = pair.into();
    if config.rtu_loss > 0.0 {
        fabric.set_fault_odds(MsgKind::Rtu, FaultOdds::drop(config.rtu_loss));
    }
    for &(kind, odds) in &config.odds {
        fabric.set_fault_odds(kind, odds);
    }
    for &rule in &config.rules {
        fabric.add_fault(rule);
    }
    for &conn in &config.drop_rtu_of {
        fabric.add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop).on_conn(ConnId(conn)));
    }

    let addr = server.addr(PORT);
    let options = endpoint_options(config.own_queues, PAYLOAD, None);
    let mut world = World {
        server_inputs: inputs.0,
        client_inputs: inputs.1,
        server: Session::new(
            Endpoint::with_options(server, options),
            plan(config, true, addr),
        ),
        client: Session::new(
            Endpoint::with_options(client, options),
            plan(config, false, addr),
        ),
        trace: config.trace_conn.map(|conn| TraceKeeper {
            conn: ConnId(conn),
            handle: None,
            qp: None,
            kept: Vec::new(),
            recorded: 0,
            held_max: 0,
        }),
        fabric,
    };
    world
        .server
        .start()
        .expect("a fresh node binds and listens");
    world
        .client
        .start()
        .expect("connecting on the simulated fabric starts");
    world.run_until_quiet(&mut |world| progress(world.server.settled()));
    progress(world.server.settled());

    let mut teardown_failures = 0;
    if config.teardown {
        // The client ends what it still holds (connections with no exchange, or one
        // that never completed); then the server. Each side is polled next whatever
        // the fabric brings it: its calls may have left work only its endpoint sees.
        world.client.close_all();
        world.client_inputs.busy = true;
        world.run_until_quiet(&mut |_| {});
        world.server.close_all();
        world.server_inputs.busy = true;
        world.run_until_quiet(&mut |_| {});
        let left =
            world.client.endpoint().connection_count() + world.server.endpoint().connection_count();
        // Every CM event the fabric handed over was read and acknowledged.
        let stats = world.fabric.stats();
        let unacked = stats.events_delivered.saturating_sub(stats.events_acked);
        teardown_failures = left as u64 + unacked;
    }
    world.drain_trace();
    world.report(config, teardown_failures)
}

/// The two sides on one fabric, and what the run needs to name connections as the
/// fabric does.
struct World {
    fabric: SimFabric,
    server: Session<SimTransport>,
    client: Session<SimTransport>,
    server_inputs: Inputs,
    client_inputs: Inputs,
    trace: Option<TraceKeeper>,
}

impl World {
    /// Handles both sides' events and lets virtual time pass until neither side has
    /// anything to handle and nothing is scheduled; `every` runs now and then.
    fn run_until_quiet(&mut self, every: &mut dyn FnMut(&World)) {
        let mut steps = 0u64;
        loop {
            let handled = self.handle_ready(false);
            steps += 1;
            if steps % 4096 == 0 {
                every(self);
            }
            if steps % TRACE_DRAIN_STEPS == 0 {
                self.drain_trace();
            }
            // Time moves only once neither side had anything (see `handle_ready` for
            // what "anything" covers); with nothing scheduled, a last look at both.
            if handled == 0 && !self.fabric.step() && self.handle_ready(true) == 0 {
                break;
            }
        }
    }

    /// Both sides' ready events, answered; how many. A side is polled only when it may
    /// have work (`sweep`: always): the fabric brought it something, it handled events
    /// last time (its own calls may have queued completions only its endpoint sees),
    /// or one of its endpoint's deadlines is due. Each poll costs the endpoint a pass.
    fn handle_ready(&mut self, sweep: bool) -> usize {
        let now = self.fabric.now();
        let mut client = 0;
        if sweep || self.client_inputs.ready() || deadline_due(&self.client, now) {
            // Each record is tagged with the fabric's number of its connection: on the
            // server side when requested, on the client side once established (one
            // that never was keeps the number of its place in the order of connects,
            // as the fabric numbers them).
            client = self
                .client
                .handle_ready(&mut |endpoint, event| {
                    fabric_number(endpoint, event).map(|(_, number)| number)
                })
                .expect("the simulated transport does not fail");
            self.client_inputs.busy = client > 0;
        }
        if !(sweep || self.server_inputs.ready() || deadline_due(&self.server, now)) {
            return client;
        }
        let trace = &mut self.trace;
        let server = self
            .server
            .handle_ready(&mut |endpoint, event| {
                let (conn, number) = fabric_number(endpoint, event)?;
                if let Some(keeper) = trace.as_mut().filter(|k| k.conn.0 == number) {
                    keeper.handle.get_or_insert(conn);
                }
                Some(number)
            })
            .expect("the simulated transport does not fail");
        self.server_inputs.busy = server > 0;
        if let Some(keeper) = self.trace.as_mut().filter(|k| k.qp.is_none()) {
            // Accepted by now: its QP names the device's events for it.
            keeper.qp = keeper
                .handle
                .and_then(|h| self.server.endpoint().info(h).ok())
                .and_then(|info| info.qp);
        }
        client + server
    }

    fn drain_trace(&mut self) {
        if let Some(keeper) = &mut self.trace {
            keeper.drain(&self.fabric);
        }
    }

    fn report(mut self, config: &SimRun, teardown_failures: u64) -> SimReport {
        let counters = self.server.endpoint().counters();
        let (virtual_time, fabric_stats) = (self.fabric.now(), self.fabric.stats());
        let (trace, trace_entries, trace_entries_recorded, trace_entries_held_max) =
            match self.trace.take() {
                Some(keeper) => (
                    Some(keeper.kept.iter().map(|e| format!("{e}\n")).collect()),
                    keeper.kept,
                    keeper.recorded,
                    keeper.held_max,
                ),
                None => (None, Vec::new(), 0, 0),
            };
        // The endpoints and the fabric go before the outcomes are gathered: a run's
        // peak memory is then its peak of connections, not that plus its report.
        let World {
            server,
            client,
            fabric,
            ..
        } = self;
        drop(fabric);
        let (client, server) = (client.into_conns(), server.into_conns());
        let mut outcomes = vec![ConnOutcome::default(); config.connections as usize];
        for (index, record) in client.iter().enumerate() {
            let number = record.tag().map_or(index, |n| n as usize);
            if let Some(outcome) = outcomes.get_mut(number) {
                outcome.active_established = record.established_reports();
                outcome.active_failure = failure(record);
            }
        }
        drop(client);
        let mut latencies = Vec::new();
        for record in &server {
            let number = record.tag();
            let Some(outcome) = number.and_then(|n| outcomes.get_mut(n as usize)) else {
                continue;
            };
            outcome.passive_established = record.established_reports();
            outcome.passive_failure = failure(record);
            outcome.forced = matches!(record.established(), Some(EstablishedVia::Notify(_)));
            outcome.raced = matches!(record.established(), Some(EstablishedVia::RtuWonRace(_)));
            if outcome.forced {
                latencies.extend(record.established_in());
            }
        }
        drop(server);
        SimReport {
            run: config.clone(),
            outcomes,
            pump: counters,
            comm_est_ignored: counters.unrouted,
            trigger_to_established: LatencySummary::from_durations(&mut latencies),
            virtual_time,
            fabric: fabric_stats,
            teardown_failures,
            trace,
            trace_entries,
            trace_entries_recorded,
            trace_entries_held_max,
        }
    }
}

/// The fabric's number of the connection `event` names, when this side learns of it
/// (a request, or the connection established), while the endpoint still knows it.
fn fabric_number(endpoint: &Endpoint<SimTransport>, event: &Event) -> Option<(ConnectionId, u32)> {
    let (Event::Request { conn, .. } | Event::Established { conn, .. }) = event else {
        return None;
    };
    let ConnId(number) = endpoint.cm_id(*conn).ok()?.conn()?;
    Some((*conn, number))
}

/// Whether one of the side's endpoint deadlines (a connect or accept timing out) is
/// due: work the fabric does not know of, to be done before time moves on.
fn deadline_due(side: &Session<SimTransport>, now: Duration) -> bool {
    side.endpoint()
        .next_deadline()
        .is_some_and(|due| due <= now)
}

/// What the fabric holds for one side's endpoint, seen from outside it.
struct Inputs {
    side: SimSide,
    /// The side handled events last time: it may have queued work of its own.
    busy: bool,
}

impl Inputs {
    fn of(side: &SimSide) -> Self {
        Inputs {
            side: side.clone(),
            busy: true,
        }
    }

    fn ready(&self) -> bool {
        self.busy || self.side.has_input()
    }
}

/// Why one side failed: how it closed, unless it was established and then
/// disconnected (by either side).
fn failure(record: &ConnRecord) -> Option<CloseReason> {
    match record.closed() {
        Some(CloseReason::Disconnected) if record.established().is_some() => None,
        other => other,
    }
}

/// The timeline of one connection, kept while the run goes.
struct TraceKeeper {
    conn: ConnId,
    /// The server's handle of the connection, once requested.
    handle: Option<ConnectionId>,
    /// The connection's server QP, once accepted.
    qp: Option<QpNum>,
    kept: Vec<TraceEntry>,
    recorded: u64,
    held_max: usize,
}

impl TraceKeeper {
    /// Takes what the fabric recorded since the last call and keeps this connection's.
    fn drain(&mut self, fabric: &SimFabric) {
        let Some(trace) = fabric.take_trace() else {
            return;
        };
        self.recorded += trace.entries.len() as u64;
        self.held_max = self.held_max.max(trace.entries.len());
        let (conn, qp) = (self.conn, self.qp);
        self.kept.extend(
            trace
                .entries
                .into_iter()
                .filter(|e| concerns(&e.event, conn, qp)),
        );
    }
}

/// Whether a trace line is about connection `conn` (whose server QP is `passive_qp`).
fn concerns(event: &TraceEvent, conn: ConnId, passive_qp: Option<QpNum>) -> bool {
    match event {
        TraceEvent::Sent { conn: c, .. }
        | TraceEvent::Fault { conn: c, .. }
        | TraceEvent::Delivered { conn: c, .. }
        | TraceEvent::Ignored { conn: c, .. }
        | TraceEvent::State { conn: c, .. }
        | TraceEvent::CmEvent { conn: c, .. }
        | TraceEvent::Notify { conn: c, .. } => *c == Some(conn),
        TraceEvent::AsyncEvent { event, .. } => {
            passive_qp.is_some() && event.qp_num() == passive_qp
        }
        TraceEvent::RecvCompletion { qp, .. } => Some(*qp) == passive_qp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_holds_one_connection_not_the_whole_run() {
        let report = run(&SimRun {
            connections: 3000,
            trace_conn: Some(2999),
            ..SimRun::default()
        });
        let trace = report.trace.expect("a trace");
        assert!(trace.contains("conn2999 RTU dropped"), "{trace}");
        assert!(!trace.contains("conn0 "), "{trace}");
        // The fabric records every connection; what is held at once is drained and
        // filtered as the run goes, so it is a small part of what was recorded.
        let (held, recorded) = (
            report.trace_entries_held_max as u64,
            report.trace_entries_recorded,
        );
        assert!(held > 0 && held * 8 < recorded, "held {held} of {recorded}");
    }

    #[test]
    fn a_connection_listed_twice_gets_one_rule() {
        let report = run(&SimRun {
            connections: 4,
            rtu_loss: 0.0,
            drop_rtu_of: vec![2, 1, 2, 2],
            ..SimRun::default()
        });
        assert_eq!(report.run.drop_rtu_of, [1, 2]);
        assert_eq!(report.forced(), 2);
    }
}
