//! A server and a client on the simulated fabric, many connections at once, the server
//! written against `cm-verbs` exactly as a real one would be: the same [`EventLoop`] and
//! [`NotifyPump`], fed from a [`SimFabric`] instead of file descriptors.

use std::time::Duration;

use cm_core::{CmEvent, CmEventSource, CmEventType, CmId, QpNum};
use cm_mock::sim::{
    ConnId, FaultAction, FaultOdds, FaultRule, MsgKind, SimBackend, SimCmId, SimConfig, SimFabric,
    SimPair, SimStats, TraceEntry, TraceEvent,
};
use cm_verbs::{
    BackendLoop, Control, EventLoop, LoopEvent, NotifyPump, PumpCounters, PumpEvent, Ready, Role,
};

use crate::stats::LatencySummary;

/// The port the simulated server listens on.
const PORT: u16 = 7471;
/// Bytes of the SEND the client posts once its side is established.
const PAYLOAD: u32 = 64;
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
    /// Whether the server runs the notify pump; without it COMM_EST is ignored, as by
    /// an application that does not forward it.
    pub pump: bool,
    /// Model soft-RoCE: no COMM_EST is ever raised; only the receive completion tells.
    pub soft_roce: bool,
    /// Seed of every random decision.
    pub seed: u64,
    /// Record the timeline of this connection.
    pub trace_conn: Option<u32>,
    /// Further random faults per message kind (for fault matrices and property tests).
    pub odds: Vec<(MsgKind, FaultOdds)>,
    /// Disconnect and destroy every id at the end, checking that nothing is left
    /// unacknowledged.
    pub teardown: bool,
    /// Deterministic faults (drop, delay, duplicate the nth REQ, REP, RTU, …), applied
    /// in addition to the random ones.
    pub rules: Vec<FaultRule>,
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
        }
    }
}

/// How one connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnOutcome {
    /// ESTABLISHED events the client saw.
    pub active_established: u32,
    /// ESTABLISHED events the server saw.
    pub passive_established: u32,
    /// The server's ESTABLISHED followed a forced establish by the pump.
    pub forced: bool,
    /// The pump's notify answered EISCONN (the RTU won the race).
    pub raced: bool,
    /// The failure event of the client side, if any.
    pub active_failure: Option<CmEventType>,
    /// The failure event of the server side, if any.
    pub passive_failure: Option<CmEventType>,
}

impl ConnOutcome {
    /// The invariant: each side saw exactly one ESTABLISHED, or none and a failure.
    pub fn holds_invariant(&self) -> bool {
        let side = |established: u32, failure: Option<CmEventType>| match established {
            1 => failure.is_none(),
            0 => true,
            _ => false,
        };
        side(self.active_established, self.active_failure)
            && side(self.passive_established, self.passive_failure)
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
    /// The pump's counters (all zero without the pump).
    pub pump: PumpCounters,
    /// COMM_EST events the server's device raised that nobody forwarded.
    pub comm_est_ignored: u64,
    /// Virtual time from the trigger (COMM_EST or receive completion) to ESTABLISHED,
    /// for forced connections.
    pub trigger_to_established: LatencySummary,
    /// Virtual time the whole run took.
    pub virtual_time: Duration,
    /// The fabric's counters.
    pub fabric: SimStats,
    /// Ids that could not be destroyed at teardown (must be 0).
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
            .filter(|o| o.passive_failure == Some(CmEventType::Unreachable))
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
    let fabric = &pair.fabric;
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

    pair.listen(PORT).expect("a fresh node binds and listens");
    let SimPair {
        fabric,
        server,
        client,
    } = pair;
    let (server_channel, mut server_cq) = (server.channel, server.device);
    let (mut client_channel, mut client_cq) = (client.channel, client.device);

    let mut world = World {
        outcomes: vec![ConnOutcome::default(); config.connections as usize],
        trigger_at: vec![None; config.connections as usize],
        latencies: Vec::new(),
        conn_of_qp: ConnOfQp::default(),
        passive_ids: Vec::with_capacity(config.connections as usize),
        active_ids: Vec::with_capacity(config.connections as usize),
        comm_est_ignored: 0,
        settled: 0,
        trace: config.trace_conn.map(|conn| TraceKeeper {
            conn: ConnId(conn),
            qp: None,
            kept: Vec::new(),
            recorded: 0,
            held_max: 0,
        }),
    };
    for _ in 0..config.connections {
        let id = client_channel.create_id();
        id.resolve_addr(server.node.id(), PORT)
            .expect("resolving a live node is accepted");
        world.active_ids.push(id);
    }

    let pump = NotifyPump::with_policy(Default::default(), config.connections as usize);
    let mut server_loop = EventLoop::new(server_channel, server.node.device(), pump);
    let all = Ready {
        cm_events: true,
        async_events: true,
        shutdown: false,
    };
    let mut steps = 0u64;
    loop {
        world.client_events(&mut client_channel, config, &fabric);
        while client_cq.poll_cq().is_some() {}
        server_loop
            .poll_once(all, &mut |pump, event| {
                world.server_event(pump, event, config, &fabric);
                Control::Continue
            })
            .expect("the simulated sources do not fail");
        while let Some(completion) = server_cq.poll_cq() {
            if config.pump {
                if let Some(event) = server_loop.pump().on_receive_completion(completion.qp) {
                    world.pump_event(event, &fabric);
                }
            }
        }
        steps += 1;
        if steps % 4096 == 0 {
            progress(world.settled);
        }
        if steps % TRACE_DRAIN_STEPS == 0 {
            world.drain_trace(&fabric);
        }
        if !fabric.step() {
            break;
        }
    }
    progress(world.settled);

    let mut teardown_failures = 0;
    if config.teardown {
        teardown_failures = world.teardown(&fabric, &mut client_channel, &mut server_loop);
    }
    let (_, _, pump) = server_loop.into_parts();
    world.drain_trace(&fabric);
    let (trace, trace_entries, trace_entries_recorded, trace_entries_held_max) =
        match world.trace.take() {
            Some(keeper) => (
                Some(keeper.kept.iter().map(|e| format!("{e}\n")).collect()),
                keeper.kept,
                keeper.recorded,
                keeper.held_max,
            ),
            None => (None, Vec::new(), 0, 0),
        };
    SimReport {
        run: config.clone(),
        outcomes: world.outcomes,
        pump: pump.counters(),
        comm_est_ignored: world.comm_est_ignored,
        trigger_to_established: LatencySummary::from_durations(&mut world.latencies),
        virtual_time: fabric.now(),
        fabric: fabric.stats(),
        teardown_failures,
        trace,
        trace_entries,
        trace_entries_recorded,
        trace_entries_held_max,
    }
}

/// The timeline of one connection, kept while the run goes.
struct TraceKeeper {
    conn: ConnId,
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

/// The connection of each server QP. The fabric numbers QPs densely from a small base,
/// so a table indexed by QP number beats a hash map: no hashing, and the run touches it
/// in QP order, which keeps it in cache at any scale.
#[derive(Default)]
struct ConnOfQp {
    conns: Vec<Option<ConnId>>,
}

impl ConnOfQp {
    fn insert(&mut self, qp: QpNum, conn: ConnId) {
        let index = qp.0 as usize;
        if index >= self.conns.len() {
            self.conns.resize(index + 1, None);
        }
        self.conns[index] = Some(conn);
    }

    fn get(&self, qp: QpNum) -> Option<ConnId> {
        self.conns.get(qp.0 as usize).copied().flatten()
    }
}

struct World {
    outcomes: Vec<ConnOutcome>,
    /// When the pump forced each connection (indexed by connection), until ESTABLISHED.
    trigger_at: Vec<Option<Duration>>,
    latencies: Vec<Duration>,
    conn_of_qp: ConnOfQp,
    passive_ids: Vec<SimCmId>,
    active_ids: Vec<SimCmId>,
    comm_est_ignored: u64,
    settled: usize,
    trace: Option<TraceKeeper>,
}

impl World {
    fn drain_trace(&mut self, fabric: &SimFabric) {
        if let Some(keeper) = &mut self.trace {
            keeper.drain(fabric);
        }
    }

    fn outcome(&mut self, conn: Option<ConnId>) -> Option<&mut ConnOutcome> {
        self.outcomes.get_mut(conn?.0 as usize)
    }

    fn client_events(
        &mut self,
        channel: &mut cm_mock::sim::SimChannel,
        config: &SimRun,
        fabric: &SimFabric,
    ) {
        while let Some(event) = channel.try_next_event().expect("simulated channel") {
            let id = event.id();
            let kind = event.event_type();
            let conn = event.conn();
            event.ack().expect("acked once");
            match kind {
                CmEventType::AddrResolved => {
                    id.resolve_route().expect("address resolved");
                }
                CmEventType::RouteResolved => {
                    id.create_qp().expect("route resolved: the id has a device");
                    id.connect(b"cmnotify").expect("route and QP ready");
                }
                CmEventType::Established => {
                    if let Some(o) = self.outcome(conn) {
                        o.active_established += 1;
                    }
                    if config.send_data {
                        id.post_send(PAYLOAD).expect("established QP can send");
                    }
                }
                CmEventType::Disconnected => {
                    // The other side must answer with its own disconnect, or teardown
                    // waits for a long CM timeout.
                    let _ = id.disconnect();
                }
                failure if failure.is_connect_failure() => {
                    if let Some(o) = self.outcome(conn) {
                        o.active_failure.get_or_insert(failure);
                    }
                }
                _ => {}
            }
        }
        let _ = fabric;
    }

    fn server_event(
        &mut self,
        pump: &mut NotifyPump<SimCmId>,
        event: LoopEvent<cm_mock::sim::SimCmEvent>,
        config: &SimRun,
        fabric: &SimFabric,
    ) {
        let event = match event {
            LoopEvent::Pump(pumped) => {
                self.pump_event(pumped, fabric);
                return;
            }
            LoopEvent::Cm(event) => event,
        };
        let id = event.id();
        let kind = event.event_type();
        let conn = event.conn();
        event.ack().expect("acked once");
        match kind {
            CmEventType::ConnectRequest => {
                let qp = id.create_qp().expect("a request's id has a device");
                id.accept(b"").expect("a fresh request can be accepted");
                if let Some(conn) = conn {
                    self.conn_of_qp.insert(qp, conn);
                    if let Some(keeper) = self.trace.as_mut().filter(|k| k.conn == conn) {
                        keeper.qp.get_or_insert(qp);
                    }
                }
                if config.pump {
                    let registration = pump
                        .register(id.clone(), Role::Passive)
                        .expect("an accepted id has a QP");
                    if let Some(replayed) = registration.replayed {
                        self.pump_event(replayed, fabric);
                    }
                }
                self.passive_ids.push(id);
            }
            CmEventType::Established => {
                let now = fabric.now();
                if let Some(conn) = conn {
                    let at = self
                        .trigger_at
                        .get_mut(conn.0 as usize)
                        .and_then(Option::take);
                    if let Some(at) = at {
                        self.latencies.push(now.saturating_sub(at));
                    }
                }
                if let Some(o) = self.outcome(conn) {
                    o.passive_established += 1;
                    self.settled += 1;
                }
            }
            CmEventType::Disconnected => {
                let _ = id.disconnect();
            }
            failure if failure.is_connect_failure() => {
                if let Some(o) = self.outcome(conn) {
                    o.passive_failure.get_or_insert(failure);
                    self.settled += 1;
                }
            }
            _ => {}
        }
    }

    fn pump_event(&mut self, event: PumpEvent, fabric: &SimFabric) {
        match event {
            PumpEvent::Forced { qp, .. } => {
                if let Some(conn) = self.conn_of_qp.get(qp) {
                    if let Some(at) = self.trigger_at.get_mut(conn.0 as usize) {
                        *at = Some(fabric.now());
                    }
                    if let Some(o) = self.outcome(Some(conn)) {
                        o.forced = true;
                    }
                }
            }
            PumpEvent::AlreadyEstablished { qp, .. } => {
                if let Some(conn) = self.conn_of_qp.get(qp) {
                    if let Some(o) = self.outcome(Some(conn)) {
                        o.raced = true;
                    }
                }
            }
            PumpEvent::Unrouted(e) if e.event_type == cm_core::AsyncEventType::CommEst => {
                self.comm_est_ignored += 1;
            }
            PumpEvent::NotifyFailed { .. }
            | PumpEvent::PathMigrated { .. }
            | PumpEvent::Unrouted(_)
            | PumpEvent::PassThrough(_) => {}
        }
    }

    /// Disconnects every connection, answers every DISCONNECTED, acks every event and
    /// destroys every id. Returns how many ids could not be destroyed.
    fn teardown(
        &mut self,
        fabric: &SimFabric,
        client_channel: &mut cm_mock::sim::SimChannel,
        server_loop: &mut BackendLoop<SimBackend>,
    ) -> u64 {
        for id in &self.active_ids {
            let _ = id.disconnect();
        }
        let mut steps = 0u64;
        loop {
            steps += 1;
            if steps % TRACE_DRAIN_STEPS == 0 {
                self.drain_trace(fabric);
            }
            while let Some(event) = client_channel.try_next_event().expect("simulated channel") {
                if event.event_type() == CmEventType::Disconnected {
                    let _ = event.id().disconnect();
                }
                event.ack().expect("acked once");
            }
            let all = Ready {
                cm_events: true,
                async_events: true,
                shutdown: false,
            };
            server_loop
                .poll_once(all, &mut |_pump, event| {
                    if let LoopEvent::Cm(event) = event {
                        if event.event_type() == CmEventType::Disconnected {
                            let _ = event.id().disconnect();
                        }
                        event.ack().expect("acked once");
                    }
                    Control::Continue
                })
                .expect("the simulated sources do not fail");
            if !fabric.step() {
                break;
            }
        }
        let mut failures = 0;
        // Only server ids were registered with the pump; a client QP would be one more
        // (missing) lookup in its table per connection.
        for id in self.active_ids.drain(..) {
            if id.destroy().is_err() {
                failures += 1;
            }
        }
        // The pump drops an id on its DISCONNECTED or failure event, so after the
        // drain above it is normally empty: then skip a lookup per connection.
        let registered = !server_loop.pump().is_empty();
        for id in self.passive_ids.drain(..) {
            if let Some(qp) = registered.then(|| id.qp_num()).flatten() {
                server_loop.pump().unregister(qp);
            }
            if id.destroy().is_err() {
                failures += 1;
            }
        }
        failures
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
