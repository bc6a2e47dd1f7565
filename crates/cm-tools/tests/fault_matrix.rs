//! The fault matrix: every fault of the notify path × {pump on, pump off} × 20 seeds on
//! the simulated fabric, asserting in every cell that each side of each connection saw
//! at most one ESTABLISHED and never one after a failure (exactly one per side, or a
//! failure), that misuse was refused with typed errors, and that teardown left nothing
//! behind.
//!
//! The table of outcomes is written to stderr (uncaptured, so it shows in
//! `cargo test` and `cargo xtask ci` logs) and to `target/fault-matrix.md`.
//!
//! Message faults run through `cm_tools::sim_run` (server and client each on a
//! cm-verbs `Endpoint` over the simulated transport); faults that need the application to act mid-run (disconnect,
//! destroy) run through the one-connection driver below.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use cm_core::{
    AsyncEventSource, AsyncEventType, CmError, CmEvent, CmEventSource, CmEventType, CmId,
    NotifyError,
};
use cm_mock::sim::{
    FaultAction, FaultOdds, FaultRule, MsgKind, NodeId, SimChannel, SimCmEvent, SimCmId, SimConfig,
    SimDevice, SimFabric, SimPair,
};
use cm_tools::sim_run::{run, SimRun};
use cm_verbs::{CloseReason, NotifyPump, PumpEvent, Role};

const SEEDS: u64 = 20;
const CONNECTIONS: u32 = 4;
const PORT: u16 = 4791;
/// Steps after which a one-connection run counts as endless.
const MAX_STEPS: u32 = 100_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    RtuLost,
    RtuLate,
    RtuDuplicated,
    ReqLost,
    RepLostThenRetried,
    AllRepLost,
    DreqInForcedEstablishWindow,
    DisconnectRacingNotify,
    IdDestroyedWithUnackedEvents,
    ChannelDestroyedWithLiveIds,
}

impl Fault {
    const ALL: [Fault; 10] = [
        Fault::RtuLost,
        Fault::RtuLate,
        Fault::RtuDuplicated,
        Fault::ReqLost,
        Fault::RepLostThenRetried,
        Fault::AllRepLost,
        Fault::DreqInForcedEstablishWindow,
        Fault::DisconnectRacingNotify,
        Fault::IdDestroyedWithUnackedEvents,
        Fault::ChannelDestroyedWithLiveIds,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::RtuLost => "RTU lost",
            Fault::RtuLate => "RTU late",
            Fault::RtuDuplicated => "RTU duplicated",
            Fault::ReqLost => "REQ lost (retried)",
            Fault::RepLostThenRetried => "REP lost (retried)",
            Fault::AllRepLost => "every REP lost",
            Fault::DreqInForcedEstablishWindow => "DREQ in forced-establish window",
            Fault::DisconnectRacingNotify => "disconnect racing notify",
            Fault::IdDestroyedWithUnackedEvents => "id destroyed with un-acked event",
            Fault::ChannelDestroyedWithLiveIds => "channel destroyed with live ids",
        }
    }
}

/// What one side of one connection saw.
#[derive(Debug, Clone, Default)]
struct SideRecord {
    established: u32,
    /// The event (one-connection driver) or close reason (whole run) that ended it.
    failure: Option<String>,
    established_after_failure: bool,
}

impl SideRecord {
    fn observe(&mut self, kind: CmEventType) {
        match kind {
            CmEventType::Established => {
                self.established += 1;
                self.established_after_failure |= self.failure.is_some();
            }
            failure if failure.is_connect_failure() => {
                self.failure.get_or_insert_with(|| failure.to_string());
            }
            _ => {}
        }
    }

    /// At most one ESTABLISHED, never after a failure. (A failure after ESTABLISHED is
    /// the connection breaking later: the kernel reports a REJ reaching an
    /// ESTABLISHED id as REJECTED.)
    fn holds(&self) -> bool {
        self.established <= 1 && !self.established_after_failure
    }
}

/// Totals of one cell (one fault, pump on or off, every seed).
#[derive(Debug, Clone, Default)]
struct Cell {
    connections: u32,
    established: u32,
    forced: u32,
    raced: u32,
    notify_refused: u32,
    passive_failed: u32,
    active_failed: u32,
    typed_refusals: u32,
    violations: Vec<String>,
}

impl Cell {
    fn add_connection(&mut self, active: SideRecord, passive: SideRecord, what: &str) {
        self.connections += 1;
        if active.established == 1 && passive.established == 1 {
            self.established += 1;
        }
        self.active_failed += u32::from(active.failure.is_some());
        self.passive_failed += u32::from(passive.failure.is_some());
        if !active.holds() || !passive.holds() {
            self.violations
                .push(format!("{what}: active {active:?}, passive {passive:?}"));
        }
    }
}

fn message_rules(fault: Fault, seed: u64) -> Vec<FaultRule> {
    match fault {
        Fault::RtuLost => vec![FaultRule::new(MsgKind::Rtu, FaultAction::Drop)],
        // Late by up to 100 µs: racing the client's first data packet, itself jittered.
        Fault::RtuLate => vec![FaultRule::new(
            MsgKind::Rtu,
            FaultAction::Delay(Duration::from_micros(1 + seed * 37 % 100)),
        )],
        Fault::RtuDuplicated => vec![FaultRule::new(MsgKind::Rtu, FaultAction::Duplicate)],
        Fault::ReqLost => vec![FaultRule::new(MsgKind::Req, FaultAction::Drop).nth(0)],
        Fault::RepLostThenRetried => vec![
            FaultRule::new(MsgKind::Rep, FaultAction::Drop).nth(0),
            FaultRule::new(MsgKind::Rep, FaultAction::Drop).nth(1),
        ],
        Fault::AllRepLost => vec![FaultRule::new(MsgKind::Rep, FaultAction::Drop)],
        _ => Vec::new(),
    }
}

/// Seeded jitter on the data path, so that seeds give different interleavings.
fn jitter() -> FaultOdds {
    FaultOdds {
        delay: 0.5,
        max_delay: Duration::from_micros(80),
        ..FaultOdds::default()
    }
}

/// A message fault through the whole server/client run (two endpoints).
fn message_cell(fault: Fault, pump: bool) -> Cell {
    let mut cell = Cell::default();
    for seed in 0..SEEDS {
        let report = run(&SimRun {
            connections: CONNECTIONS,
            rtu_loss: 0.0,
            pump,
            seed,
            odds: vec![(MsgKind::Data, jitter())],
            rules: message_rules(fault, seed),
            ..SimRun::default()
        });
        for (conn, outcome) in report.outcomes.iter().enumerate() {
            let side = |established, failure: &Option<CloseReason>| SideRecord {
                established,
                failure: failure.as_ref().map(|reason| format!("{reason:?}")),
                established_after_failure: false,
            };
            cell.add_connection(
                side(outcome.active_established, &outcome.active_failure),
                side(outcome.passive_established, &outcome.passive_failure),
                &format!("seed {seed} conn {conn}"),
            );
            // With no application action, every side settles: exactly one ESTABLISHED,
            // or a failure.
            let settled = |established: u32, failure: &Option<CloseReason>| {
                established == 1 || failure.is_some()
            };
            if !settled(outcome.active_established, &outcome.active_failure)
                || !settled(outcome.passive_established, &outcome.passive_failure)
            {
                cell.violations
                    .push(format!("seed {seed} conn {conn}: unsettled {outcome:?}"));
            }
            if !outcome.holds_invariant() {
                cell.violations
                    .push(format!("seed {seed} conn {conn}: {outcome:?}"));
            }
        }
        cell.forced += report.forced() as u32;
        cell.raced += report.raced() as u32;
        cell.notify_refused += report.pump.notify_failed as u32;
        if report.teardown_failures != 0 {
            cell.violations.push(format!(
                "seed {seed}: {} ids could not be destroyed",
                report.teardown_failures
            ));
        }
    }
    cell
}

/// One connection whose RTU is lost, the application acting mid-run as `fault` says.
struct Driver {
    fault: Fault,
    pump_on: bool,
    seed: u64,
    fabric: SimFabric,
    server: NodeId,
    server_events: SimChannel,
    client_events: SimChannel,
    listener: SimCmId,
    active: SimCmId,
    passive: Option<SimCmId>,
    pump: NotifyPump<SimCmId>,
    held: Option<SimCmEvent>,
    /// Steps until the mid-run action; armed by the fault's trigger.
    countdown: Option<u64>,
    acted: bool,
    active_record: SideRecord,
    passive_record: SideRecord,
    forced: bool,
    raced: bool,
    notify_refused: u32,
    typed_refusals: u32,
    violations: Vec<String>,
}

impl Driver {
    fn new(fault: Fault, pump_on: bool, seed: u64) -> Self {
        let pair = SimPair::new(SimConfig::default(), seed);
        pair.fabric
            .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
        pair.fabric.set_fault_odds(MsgKind::Data, jitter());
        let listener = pair.listen(PORT).expect("a fresh node binds and listens");
        let active = pair.client.channel.create_id();
        active
            .resolve_addr(pair.server.node.id(), PORT)
            .expect("resolving a live node");
        Driver {
            fault,
            pump_on,
            seed,
            server: pair.server.node.id(),
            fabric: pair.fabric,
            server_events: pair.server.channel,
            client_events: pair.client.channel,
            listener,
            active,
            passive: None,
            pump: NotifyPump::new(),
            held: None,
            countdown: None,
            acted: false,
            active_record: SideRecord::default(),
            passive_record: SideRecord::default(),
            forced: false,
            raced: false,
            notify_refused: 0,
            typed_refusals: 0,
            violations: Vec::new(),
        }
    }

    fn arm(&mut self) {
        if self.countdown.is_none() && !self.acted {
            self.countdown = Some(self.seed % 4);
        }
    }

    fn run(mut self) -> Self {
        let mut server_device = self.server_device();
        let mut steps = 0;
        loop {
            self.client_events();
            self.server_async_events(&mut server_device);
            self.server_cm_events();
            if let Some(left) = self.countdown {
                if left == 0 {
                    self.countdown = None;
                    self.acted = true;
                    self.act();
                } else {
                    self.countdown = Some(left - 1);
                }
            }
            steps += 1;
            if steps > MAX_STEPS {
                self.violations.push("the run never ends".into());
                break;
            }
            if !self.fabric.step() {
                break;
            }
        }
        self.teardown();
        self
    }

    fn server_device(&self) -> SimDevice {
        self.fabric
            .node(self.server)
            .expect("the server node")
            .device()
    }

    fn client_events(&mut self) {
        while let Some(event) = self.client_events.try_next_event().expect("a live channel") {
            let (id, kind) = (event.id(), event.event_type());
            event.ack().expect("acked once");
            self.active_record.observe(kind);
            match kind {
                CmEventType::AddrResolved => id.resolve_route().expect("address resolved"),
                CmEventType::RouteResolved => {
                    id.create_qp().expect("route resolved");
                    id.connect(b"").expect("route and QP ready");
                }
                CmEventType::Established => {
                    id.post_send(64).expect("an established QP sends");
                }
                CmEventType::Disconnected => {
                    let _ = id.disconnect();
                }
                _ => {}
            }
        }
    }

    fn server_async_events(&mut self, device: &mut SimDevice) {
        while let Some(event) = device.try_next_async_event().expect("a simulated device") {
            let comm_est = event.event_type == AsyncEventType::CommEst;
            let disconnect_first = self.seed % 2 == 0;
            if comm_est && self.fault == Fault::DisconnectRacingNotify && disconnect_first {
                self.disconnect_passive();
            }
            if self.pump_on {
                let pumped = self.pump.on_async_event(event);
                self.pumped(pumped);
            } else if comm_est && self.fault == Fault::DreqInForcedEstablishWindow {
                // No pump, no forced establish: the DREQ meets a REP_SENT id instead.
                self.arm();
            }
            if comm_est && self.fault == Fault::DisconnectRacingNotify && !disconnect_first {
                self.disconnect_passive();
            }
        }
        let mut device = device.clone();
        while let Some(completion) = device.poll_cq() {
            if self.pump_on {
                if let Some(pumped) = self.pump.on_receive_completion(completion.qp) {
                    self.pumped(pumped);
                }
            }
        }
    }

    fn pumped(&mut self, event: PumpEvent) {
        match event {
            PumpEvent::Forced { .. } => {
                self.forced = true;
                if self.fault == Fault::DreqInForcedEstablishWindow {
                    self.arm();
                }
            }
            PumpEvent::AlreadyEstablished { .. } => self.raced = true,
            PumpEvent::NotifyFailed { error, .. } => {
                self.notify_refused += 1;
                if !matches!(error, NotifyError::WrongState | NotifyError::UnknownId) {
                    self.violations
                        .push(format!("notify failed unexpectedly: {error}"));
                }
            }
            PumpEvent::PathMigrated { .. } | PumpEvent::Unrouted(_) | PumpEvent::PassThrough(_) => {
            }
        }
    }

    fn disconnect_passive(&mut self) {
        if let Some(passive) = &self.passive {
            if let Err(error) = passive.disconnect() {
                self.violations
                    .push(format!("disconnect of a live passive id failed: {error}"));
            }
        }
    }

    fn server_cm_events(&mut self) {
        loop {
            let event = match self.server_events.try_next_event() {
                Ok(Some(event)) => event,
                Ok(None) => break,
                Err(CmError::Gone {
                    what: "channel", ..
                }) if self.server_events.is_destroyed() => break,
                Err(error) => {
                    self.violations.push(format!("server channel: {error}"));
                    break;
                }
            };
            let (id, kind) = (event.id(), event.event_type());
            if self.pump_on {
                self.pump.on_cm_event(kind, event.qp_num());
            }
            if Some(&id) == self.passive.as_ref() || kind == CmEventType::ConnectRequest {
                self.passive_record.observe(kind);
            }
            match kind {
                CmEventType::ConnectRequest => {
                    id.create_qp().expect("a request's id has a device");
                    id.accept(b"").expect("a fresh request is accepted");
                    if self.pump_on {
                        self.pump
                            .register(id.clone(), Role::Passive)
                            .expect("a new QP number");
                    }
                    self.passive = Some(id);
                    match self.fault {
                        Fault::IdDestroyedWithUnackedEvents => {
                            self.held = Some(event);
                            self.arm();
                            self.try_destroy_held_passive();
                            continue;
                        }
                        Fault::ChannelDestroyedWithLiveIds => self.arm(),
                        _ => {}
                    }
                }
                CmEventType::Disconnected => {
                    let _ = id.disconnect();
                }
                _ => {}
            }
            event.ack().expect("acked once");
        }
    }

    /// Destroying the passive id while its CONNECT_REQUEST is held must be refused.
    fn try_destroy_held_passive(&mut self) {
        let Some(passive) = &self.passive else { return };
        match passive.destroy() {
            Err(CmError::UnackedEvents { unacked: 1, .. }) => self.typed_refusals += 1,
            other => self
                .violations
                .push(format!("destroy with a held event answered {other:?}")),
        }
        // The channel cannot go either while the event is out.
        match self.server_events.destroy() {
            Err(CmError::UnackedEvents { .. }) => self.typed_refusals += 1,
            other => self.violations.push(format!(
                "channel destroy with a held event answered {other:?}"
            )),
        }
    }

    /// The fault's mid-run action.
    fn act(&mut self) {
        match self.fault {
            Fault::DreqInForcedEstablishWindow => {
                if let Err(error) = self.active.disconnect() {
                    self.violations
                        .push(format!("active disconnect failed: {error}"));
                }
            }
            Fault::IdDestroyedWithUnackedEvents => {
                if let Some(event) = self.held.take() {
                    event.ack().expect("acked once");
                }
                if let Some(passive) = self.passive.take() {
                    if let Some(qp) = passive.qp_num() {
                        self.pump.unregister(qp);
                    }
                    if let Err(error) = passive.destroy() {
                        self.violations
                            .push(format!("destroy after the ack failed: {error}"));
                    }
                    match passive.notify(AsyncEventType::CommEst) {
                        Err(NotifyError::UnknownId) => self.typed_refusals += 1,
                        other => self
                            .violations
                            .push(format!("notify on a destroyed id answered {other:?}")),
                    }
                }
            }
            Fault::ChannelDestroyedWithLiveIds => {
                // The pump keeps the passive id registered on purpose: a COMM_EST that
                // still arrives must be refused as UnknownId, not panic.
                match self.server_events.destroy() {
                    Ok(()) => {
                        let gone = [Some(&self.listener), self.passive.as_ref()]
                            .into_iter()
                            .flatten()
                            .all(|id| !id.is_alive());
                        if !gone {
                            self.violations
                                .push("a destroyed channel left live ids".into());
                        }
                        match self.server_events.try_next_event() {
                            Err(CmError::Gone { .. }) => self.typed_refusals += 1,
                            other => self
                                .violations
                                .push(format!("reading a destroyed channel: {other:?}")),
                        }
                    }
                    Err(error) => self
                        .violations
                        .push(format!("channel destroy refused: {error}")),
                }
                if let Some(passive) = self.passive.take() {
                    if passive.notify(AsyncEventType::CommEst) == Err(NotifyError::UnknownId) {
                        self.typed_refusals += 1;
                    } else {
                        self.violations
                            .push("notify after the channel went was not UnknownId".into());
                    }
                }
            }
            _ => {}
        }
    }

    /// Disconnects what is connected, drains and acknowledges everything, destroys
    /// every live id.
    fn teardown(&mut self) {
        if let Some(event) = self.held.take() {
            event.ack().expect("acked once");
        }
        let _ = self.active.disconnect();
        if let Some(passive) = &self.passive {
            let _ = passive.disconnect();
        }
        let mut server_device = self.server_device();
        loop {
            self.client_events();
            while server_device
                .try_next_async_event()
                .expect("a simulated device")
                .is_some()
            {}
            self.server_cm_events();
            if !self.fabric.step() {
                break;
            }
        }
        let ids = [
            Some(&self.active),
            Some(&self.listener),
            self.passive.as_ref(),
        ];
        for id in ids.into_iter().flatten() {
            if id.is_alive() {
                if let Err(error) = id.destroy() {
                    self.violations
                        .push(format!("teardown destroy of {id:?} failed: {error}"));
                }
            }
        }
        let stats = self.fabric.stats();
        if stats.events_acked != stats.events_delivered {
            self.violations.push(format!(
                "{} events delivered, {} acknowledged",
                stats.events_delivered, stats.events_acked
            ));
        }
    }
}

/// An application-action fault through the one-connection driver.
fn action_cell(fault: Fault, pump: bool) -> Cell {
    let mut cell = Cell::default();
    for seed in 0..SEEDS {
        let run = Driver::new(fault, pump, seed).run();
        cell.add_connection(
            run.active_record,
            run.passive_record,
            &format!("seed {seed}"),
        );
        cell.forced += u32::from(run.forced);
        cell.raced += u32::from(run.raced);
        cell.notify_refused += run.notify_refused;
        cell.typed_refusals += run.typed_refusals;
        cell.violations.extend(
            run.violations
                .into_iter()
                .map(|v| format!("seed {seed}: {v}")),
        );
    }
    cell
}

fn cell(fault: Fault, pump: bool) -> Cell {
    match fault {
        Fault::RtuLost
        | Fault::RtuLate
        | Fault::RtuDuplicated
        | Fault::ReqLost
        | Fault::RepLostThenRetried
        | Fault::AllRepLost => message_cell(fault, pump),
        _ => action_cell(fault, pump),
    }
}

/// What each cell must show beyond the invariant (facts that do not depend on the seed).
fn expectations(fault: Fault, pump: bool, cell: &Cell) -> Vec<String> {
    let mut failed = Vec::new();
    let mut expect = |ok: bool, what: &str| {
        if !ok {
            failed.push(format!("{what}: {cell:?}"));
        }
    };
    let all = cell.connections;
    match (fault, pump) {
        (Fault::RtuLost, true) => {
            expect(cell.established == all, "every connection rescued");
            expect(cell.forced == all, "every rescue is a forced establish");
        }
        (Fault::RtuLost, false) => {
            expect(cell.established == 0, "no rescue without the pump");
            expect(cell.passive_failed == all, "every server side UNREACHABLE");
        }
        (Fault::RtuLate | Fault::RtuDuplicated | Fault::ReqLost | Fault::RepLostThenRetried, _) => {
            expect(cell.established == all, "every connection established");
        }
        (Fault::AllRepLost, _) => {
            expect(cell.established == 0, "nothing established without a REP");
            expect(cell.passive_failed == all, "every server side fails");
            expect(cell.forced == 0, "nothing to force");
        }
        (Fault::DreqInForcedEstablishWindow, true) => {
            expect(
                cell.forced == all,
                "every connection forced before the DREQ",
            );
        }
        (Fault::IdDestroyedWithUnackedEvents, _) => {
            expect(
                cell.typed_refusals == 3 * all,
                "destroys refused while the event is held, notify refused after",
            );
        }
        (Fault::ChannelDestroyedWithLiveIds, _) => {
            expect(
                cell.typed_refusals == 2 * all,
                "reads of the closed channel and notify refused",
            );
        }
        _ => {}
    }
    failed
}

fn report_path() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    target.join("fault-matrix.md")
}

#[test]
fn fault_matrix_holds_the_invariant_in_every_cell() {
    let mut table = String::new();
    writeln!(
        table,
        "# Fault matrix: {SEEDS} seeds per cell ({CONNECTIONS} connections per seed for \
         message faults, 1 for application actions)\n"
    )
    .unwrap();
    writeln!(
        table,
        "| fault | pump | conns | established | forced | EISCONN | notify refused | \
         server failed | client failed | typed refusals | invariant |"
    )
    .unwrap();
    writeln!(
        table,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    .unwrap();
    let mut failures = Vec::new();
    for fault in Fault::ALL {
        for pump in [true, false] {
            let cell = cell(fault, pump);
            let unmet = expectations(fault, pump, &cell);
            let holds = cell.violations.is_empty();
            writeln!(
                table,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                fault.name(),
                if pump { "on" } else { "off" },
                cell.connections,
                cell.established,
                cell.forced,
                cell.raced,
                cell.notify_refused,
                cell.passive_failed,
                cell.active_failed,
                cell.typed_refusals,
                if holds && unmet.is_empty() {
                    "holds"
                } else {
                    "VIOLATED"
                },
            )
            .unwrap();
            let pump = if pump { "pump on" } else { "pump off" };
            failures.extend(
                cell.violations
                    .iter()
                    .chain(&unmet)
                    .map(|v| format!("{} / {pump}: {v}", fault.name())),
            );
        }
    }
    // Written straight to the stderr handle: the test harness captures print macros
    // of passing tests, not the handle, so the table always shows.
    let _ = std::io::stderr().write_all(format!("\n{table}\n").as_bytes());
    let path = report_path();
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&path, &table).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        failures.is_empty(),
        "{} violation(s):\n{}",
        failures.len(),
        failures.join("\n")
    );
}
