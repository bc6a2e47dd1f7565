//! Scenarios for instruction counting (`cm-bench-count`, run under callgrind by
//! `cargo xtask bench --count`): each runs one operation on the simulated fabric a
//! given number of times, every run of it through [`measured`].
//!
//! Callgrind is told to count only inside [`measured`] (`--toggle-collect`, pattern
//! [`MEASURED_SYMBOL`]): the fixture, the teardown between connections and the
//! process's start are not counted. Running a scenario for two iteration counts and
//! dividing the difference of the totals by the difference of the counts leaves the
//! instructions of one operation, without the warm-up either.
//!
//! Everything here is deterministic: the simulated fabric's clock is virtual and its
//! seed fixed, and nothing reads the wall clock. The same build gives the same counts
//! on every run.

use std::hint::black_box;

use cm_core::{AsyncEvent, AsyncEventType, QpNum};
use cm_verbs::{ConnectOptions, ConnectionId, Event, ListenOptions, NotifyPump, Role};

use crate::endpoint::{EchoFixture, ListeningPair};
use crate::sim::{established_connections, KernelLikeId};

/// The pattern callgrind's `--toggle-collect` is given: every instance of
/// [`measured`] (one per closure type; the pattern covers the generic suffix of
/// either symbol mangling).
pub const MEASURED_SYMBOL: &str = "cm_benches::count::measured*";

/// Operations run before the counted ones, so that every table and buffer the
/// operation touches has reached its steady size in both runs being compared.
pub const WARM_UP: u32 = 100;

/// Connections registered with the pump in the pump scenarios (as in the criterion
/// bench `pump/*`): the lookup is in a table of realistic size.
pub const PUMP_CONNECTIONS: u32 = 1024;

/// Simulated connections behind the pump in `pump_comm_est_sim` (as in the criterion
/// bench `pump/comm_est_sim`).
const SIM_PUMP_CONNECTIONS: usize = 64;

/// One counted operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// One COMM_EST through the pump on an already forced connection (notify answers
    /// EISCONN): the steady state of the lost-RTU trigger path (criterion: `pump/comm_est`).
    PumpCommEst,
    /// One COMM_EST through the pump that forces the establishment (notify answers 0):
    /// the first trigger of a lost-RTU connection (criterion: `pump/comm_est_forced`).
    PumpCommEstForced,
    /// One COMM_EST through the pump in front of simulated ids (criterion:
    /// `pump/comm_est_sim`).
    PumpCommEstSim,
    /// One echo of a 4-byte message on an established connection through `Endpoint`
    /// (`send`, `recv`; criterion: `endpoint_echo/0`).
    EndpointEcho,
    /// The setup of one connection through `Endpoint`: `connect` to ESTABLISHED on
    /// both sides, the fabric stepped in between. The teardown is not counted.
    EndpointSetup,
}

impl Scenario {
    /// Every scenario, in the report's order.
    pub const ALL: [Scenario; 5] = [
        Scenario::PumpCommEst,
        Scenario::PumpCommEstForced,
        Scenario::PumpCommEstSim,
        Scenario::EndpointEcho,
        Scenario::EndpointSetup,
    ];

    /// The scenario's name (the binary's argument and the baseline's key).
    pub fn name(self) -> &'static str {
        match self {
            Scenario::PumpCommEst => "pump_comm_est",
            Scenario::PumpCommEstForced => "pump_comm_est_forced",
            Scenario::PumpCommEstSim => "pump_comm_est_sim",
            Scenario::EndpointEcho => "endpoint_echo",
            Scenario::EndpointSetup => "endpoint_setup",
        }
    }

    /// The scenario named `name`.
    pub fn from_name(name: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Runs [`WARM_UP`] + `iterations` operations, each through [`measured`].
    pub fn run(self, iterations: u32) {
        let total = WARM_UP + iterations;
        match self {
            Scenario::PumpCommEst => pump_comm_est(total),
            Scenario::PumpCommEstForced => pump_comm_est_forced(total),
            Scenario::PumpCommEstSim => pump_comm_est_sim(total),
            Scenario::EndpointEcho => endpoint_echo(total),
            Scenario::EndpointSetup => endpoint_setup(total),
        }
    }
}

/// Runs `op`: the only code callgrind counts. Never inlined, so that its symbol
/// exists for `--toggle-collect`.
#[inline(never)]
pub fn measured<R>(op: impl FnOnce() -> R) -> R {
    black_box(op())
}

/// A pump with [`PUMP_CONNECTIONS`] kernel-like ids, none forced yet.
fn fresh_pump() -> NotifyPump<KernelLikeId> {
    let mut pump = NotifyPump::with_policy(Default::default(), PUMP_CONNECTIONS as usize);
    for n in 0..PUMP_CONNECTIONS {
        pump.register(KernelLikeId::new(QpNum(n)), Role::Passive)
            .expect("unique QP numbers");
    }
    pump
}

/// A pump with [`PUMP_CONNECTIONS`] kernel-like ids, each already forced once, so every
/// further COMM_EST is the steady state: route, lookup, notify (EISCONN), counters.
pub fn warm_pump() -> NotifyPump<KernelLikeId> {
    let mut pump = fresh_pump();
    for n in 0..PUMP_CONNECTIONS {
        pump.on_async_event(AsyncEvent::qp(AsyncEventType::CommEst, QpNum(n)));
    }
    pump
}

fn comm_est(qp: QpNum) -> AsyncEvent {
    AsyncEvent::qp(AsyncEventType::CommEst, qp)
}

fn pump_comm_est(total: u32) {
    let mut pump = warm_pump();
    for i in 0..total {
        let event = comm_est(QpNum(i % PUMP_CONNECTIONS));
        measured(|| pump.on_async_event(black_box(event)));
    }
}

fn pump_comm_est_forced(total: u32) {
    let mut pump = fresh_pump();
    for i in 0..total {
        let qp = i % PUMP_CONNECTIONS;
        // Every id forced once: a fresh pump (not counted) for the next round.
        if qp == 0 && i > 0 {
            pump = fresh_pump();
        }
        let event = comm_est(QpNum(qp));
        measured(|| pump.on_async_event(black_box(event)));
    }
}

fn pump_comm_est_sim(total: u32) {
    let conns = established_connections(SIM_PUMP_CONNECTIONS);
    let (mut pump, qps) = conns.passive_pump();
    for i in 0..total as usize {
        let event = comm_est(qps[i % qps.len()]);
        measured(|| pump.on_async_event(black_box(event)));
    }
}

fn endpoint_echo(total: u32) {
    let mut fixture = EchoFixture::new(0);
    for _ in 0..total {
        let len = measured(|| fixture.echo(black_box(b"ping")));
        assert_eq!(len, 4, "the echo came back whole");
    }
}

/// Connections set up and torn down one after another on a [`ListeningPair`].
struct SetupFixture(ListeningPair);

impl SetupFixture {
    fn new() -> Self {
        SetupFixture(ListeningPair::new(ListenOptions::default()))
    }

    /// `connect` and the fabric stepped until both sides report ESTABLISHED. Returns
    /// both sides' connections (client, server).
    fn connect(&mut self) -> (ConnectionId, ConnectionId) {
        let client_conn = self
            .0
            .client
            .connect(self.0.to, ConnectOptions::default())
            .expect("connect");
        let (mut client_up, mut server_conn) = (false, None);
        while !client_up || server_conn.is_none() {
            while let Some(event) = self.0.client.poll().expect("client") {
                match event {
                    Event::Established { conn, .. } if conn == client_conn => client_up = true,
                    other => panic!("client, connecting: unexpected {other:?}"),
                }
            }
            while let Some(event) = self.0.server.poll().expect("server") {
                match event {
                    Event::Established { conn, .. } => server_conn = Some(conn),
                    other => panic!("server, accepting: unexpected {other:?}"),
                }
            }
            if (!client_up || server_conn.is_none()) && !self.0.fabric.step() {
                panic!("the fabric went idle before the connection was established");
            }
        }
        (client_conn, server_conn.expect("established"))
    }

    /// Both sides disconnect and the fabric runs until nothing is scheduled (time-wait
    /// included), so the next setup starts from the same state.
    fn tear_down(&mut self, client_conn: ConnectionId, server_conn: ConnectionId) {
        self.0
            .client
            .disconnect(client_conn)
            .expect("live connection");
        self.0
            .server
            .disconnect(server_conn)
            .expect("live connection");
        loop {
            let mut progressed = self.0.fabric.step();
            for endpoint in [&mut self.0.client, &mut self.0.server] {
                while let Some(event) = endpoint.poll().expect("endpoint") {
                    progressed = true;
                    // Events of the connections just disconnected (sends completed,
                    // the peer's close) are all this can see.
                    black_box(event);
                }
            }
            if !progressed {
                break;
            }
        }
    }
}

fn endpoint_setup(total: u32) {
    let mut fixture = SetupFixture::new();
    for _ in 0..total {
        let (client_conn, server_conn) = measured(|| fixture.connect());
        fixture.tear_down(client_conn, server_conn);
    }
    assert_eq!(
        fixture.0.server.connection_count(),
        0,
        "every connection closed"
    );
    assert_eq!(
        fixture.0.client.connection_count(),
        0,
        "every connection closed"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_runs_and_names_itself() {
        for scenario in Scenario::ALL {
            assert_eq!(Scenario::from_name(scenario.name()), Some(scenario));
            scenario.run(3);
        }
        assert_eq!(Scenario::from_name("nothing"), None);
    }

    #[test]
    fn the_forced_scenario_forces_every_event() {
        let mut pump = fresh_pump();
        for n in 0..PUMP_CONNECTIONS {
            pump.on_async_event(comm_est(QpNum(n)));
        }
        assert_eq!(pump.counters().forced, u64::from(PUMP_CONNECTIONS));
    }

    #[test]
    fn setups_run_back_to_back_on_one_fabric() {
        let mut fixture = SetupFixture::new();
        for _ in 0..5 {
            let (client, server) = fixture.connect();
            fixture.tear_down(client, server);
        }
        assert_eq!(fixture.0.fabric.pending(), 0);
    }
}
