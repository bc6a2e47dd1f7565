//! Body of the `endpoint_ops` fuzz target (and of cm-verbs' endpoint property test):
//! cm-verbs' `Endpoint` on both nodes of the simulated fabric, driven by an arbitrary
//! sequence of application calls and faults.
//!
//! A server endpoint listens (one listener accepting on its own, one reporting each
//! request for `accept_request`/`reject_request`); a client endpoint connects. Each
//! operation is four bytes (kind and three arguments), so every byte string is a run
//! and a run shrinks by whole operations: connect, answer a request, send, recv,
//! established, accept, disconnect, next_event, poll until nothing is left, process,
//! advance virtual time, a fault rule on the wire (RTU loss or delay above all), a
//! device event (DEVICE_FATAL, a port event, a QP error or a COMM_EST on a known QP),
//! device removal, notify off, close or open a listener. Waiting calls wait zero or a
//! few virtual milliseconds (never `None`: on an idle fabric that is an error), and
//! while one endpoint waits the other handles its inputs, as a peer process would.
//!
//! Checked after every operation, on both endpoints:
//! - nothing panics, and `process`/`poll` never fail on the simulated fabric;
//! - every queue of `stats()` within its documented bound (the ready, accept and
//!   deadline queues against the most connections, closes and events held so far);
//! - each connection reported established at most once per side (an
//!   `Event::Established`, or `accept` returning it; `established` and `recv` take the
//!   event too, and asking `established` again is no second report), with the side's
//!   role, and no message or completed send reported before it;
//! - a handle closed by an `Event::Closed`, a `recv` answering `ConnError::Closed`, an
//!   accepted `disconnect` or a `reject_request` names nothing from then on: every call
//!   answers `UnknownConnection` at once and no event names it; a handle that once
//!   answered `UnknownConnection` never comes back.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use cm_mock::sim::{
    FaultAction, FaultRule, MsgKind, SimConfig, SimFabric, SimTransport, SimTransports,
};
use cm_verbs::core::EventElement;
use cm_verbs::{
    AsyncEvent, AsyncEventType, ConnError, ConnectOptions, ConnectionId, Endpoint, Event,
    ListenOptions, ListenerId, PrivateData, QueueCaps, Role, CLOSED_BACKLOG,
    ENDPOINT_EVENT_BACKLOG,
};

use crate::input::Input;

/// The ports a client may connect to: one accepting on its own, one reporting
/// requests, one nobody listens on (at first).
const PORTS: [u16; 3] = [7471, 7472, 7473];
/// Operations read from one input.
const MAX_OPS: usize = 128;
/// Connections the client may start in one run: enough for the queues' stale entries
/// to pass the 64 their compaction allows.
const MAX_CONNECTS: usize = 128;
/// Events one drain may take before the endpoint counts as reporting forever.
const MAX_DRAIN: usize = 1 << 14;
/// The buffer size of every connection: small, so that a longer message is refused.
const BUFFER: u32 = 64;

type SimEndpoint = Endpoint<SimTransport>;

/// Which endpoint an operation acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Who {
    /// The listening endpoint (node 0).
    Server,
    /// The connecting endpoint (node 1).
    Client,
}

/// What a device operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceOp {
    /// `IBV_EVENT_DEVICE_FATAL`.
    Fatal,
    /// The device is removed (`rdma link delete`).
    Remove,
    /// A port event (active or error), for the application to see.
    Port(bool),
    /// `IBV_EVENT_QP_FATAL` on a known connection's QP.
    QpFatal(u8),
    /// `IBV_EVENT_COMM_EST` on a known connection's QP.
    CommEst(u8),
}

/// One operation of a run; `pick` bytes choose among the handles the side has seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The client connects `count` times to `PORTS[port]`.
    Connect {
        /// Index into the ports.
        port: u8,
        /// How many connections.
        count: u8,
        /// A connect deadline of this many milliseconds.
        timeout_ms: Option<u8>,
        /// Private data longer than a REQ has room for (a typed error).
        too_long: bool,
    },
    /// The server answers a reported request.
    Answer {
        /// Which request.
        pick: u8,
        /// Accept (else reject).
        accept: bool,
        /// Private data longer than the REP or REJ has room for.
        too_long: bool,
    },
    /// A message of `len` bytes (more than [`BUFFER`] is refused).
    Send {
        /// Which endpoint.
        who: Who,
        /// Which connection.
        pick: u8,
        /// The message length.
        len: u8,
    },
    /// `recv` with a zero or small timeout.
    Recv {
        /// Which endpoint.
        who: Who,
        /// Which connection.
        pick: u8,
        /// The timeout's code ([`wait`]).
        wait: u8,
    },
    /// `established` with a zero or small timeout.
    Established {
        /// Which endpoint.
        who: Who,
        /// Which connection.
        pick: u8,
        /// The timeout's code ([`wait`]).
        wait: u8,
    },
    /// `accept` on the server with a zero or small timeout.
    Accept {
        /// The timeout's code ([`wait`]).
        wait: u8,
    },
    /// `disconnect`.
    Disconnect {
        /// Which endpoint.
        who: Who,
        /// Which connection.
        pick: u8,
    },
    /// `next_event` up to `count` times.
    NextEvent {
        /// Which endpoint.
        who: Who,
        /// The timeout's code ([`wait`]).
        wait: u8,
        /// How many events at most.
        count: u8,
    },
    /// `poll` until it reports nothing.
    Drain {
        /// Which endpoint.
        who: Who,
    },
    /// `process`.
    Process {
        /// Which endpoint.
        who: Who,
    },
    /// Virtual time moves on by 2^`exp` µs, both endpoints handling what it brings.
    Advance {
        /// The exponent.
        exp: u8,
    },
    /// A fault rule on the wire.
    Fault {
        /// The message kind (the RTU half the time).
        kind: MsgKind,
        /// What happens to it.
        action: FaultAction,
        /// Only the nth such message of a connection.
        nth: Option<u32>,
    },
    /// Something happens to a node's device.
    Device {
        /// Whose device.
        who: Who,
        /// What.
        what: DeviceOp,
    },
    /// `set_notify`.
    SetNotify {
        /// Which endpoint.
        who: Who,
        /// On or off.
        on: bool,
    },
    /// `close_listener` on one of the listeners opened so far.
    CloseListener {
        /// Which listener.
        pick: u8,
    },
    /// `listen` again on `PORTS[port]` (a bound port is a typed error).
    Listen {
        /// Index into the ports.
        port: u8,
        /// Report requests instead of accepting them.
        manual: bool,
        /// An establish deadline of this many milliseconds.
        timeout_ms: Option<u8>,
    },
}

/// The fabric and endpoint set-up a run starts from.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    /// The fabric's timing and COMM_EST.
    pub config: SimConfig,
    /// The fabric's seed.
    pub seed: u64,
    /// Every connection's queues.
    pub caps: QueueCaps,
    /// The first listener's establish deadline.
    pub establish_timeout: Option<Duration>,
}

/// The set-up (first four bytes) and the operations (four bytes each) of an input.
pub fn decode(data: &[u8]) -> (Setup, Vec<Op>) {
    let mut input = Input::new(data);
    let setup = Setup::decode(&mut input);
    let mut ops = Vec::new();
    while !input.is_empty() && ops.len() < MAX_OPS {
        ops.push(Op::decode(&mut input));
    }
    (setup, ops)
}

/// Runs one arbitrary input; panics when an invariant breaks.
pub fn run(data: &[u8]) {
    let (setup, ops) = decode(data);
    run_ops(&setup, &ops);
}

/// Runs `ops` from `setup`; panics, naming the operation, when an invariant breaks.
pub fn run_ops(setup: &Setup, ops: &[Op]) {
    let mut world = World::new(setup);
    for (index, op) in ops.iter().enumerate() {
        world.at = format!("op #{index} {op:?}");
        world.op(*op);
        world.check();
    }
    world.at = "the final drain".into();
    world.advance(20);
    for who in [Who::Server, Who::Client] {
        world.drain(who);
    }
    world.check();
}

/// A timeout from its code: zero half the time, else 1 to 16 virtual milliseconds.
fn wait(code: u8) -> Option<Duration> {
    if code & 1 == 0 {
        Some(Duration::ZERO)
    } else {
        Some(Duration::from_millis(1 << ((code >> 1) % 5)))
    }
}

fn who(byte: u8) -> Who {
    if byte & 1 == 0 {
        Who::Server
    } else {
        Who::Client
    }
}

/// A deadline of 4 to 67 milliseconds a quarter of the time, else none, from a byte.
fn deadline_ms(byte: u8) -> Option<u8> {
    (byte & 3 == 3).then_some(4 + (byte >> 2) % 64)
}

impl Setup {
    fn decode(input: &mut Input<'_>) -> Self {
        let [flags, depths, seed_lo, seed_hi] = input.u32().to_le_bytes();
        // Short CM timeouts (a few retries of a millisecond), so that REP retries and
        // UNREACHABLE happen within a run; kernel-like ones for the other half.
        let config = if flags & 4 == 0 {
            SimConfig {
                cm_response_timeout: Duration::from_millis(1),
                mra_service_timeout: Duration::from_millis(4),
                max_cm_retries: u32::from((flags >> 3) & 3),
                timewait: Duration::from_millis(1),
                ..SimConfig::default()
            }
        } else {
            SimConfig::default()
        };
        Setup {
            config: SimConfig {
                comm_est: flags & 1 == 0,
                delayed_mra: flags & 2 == 0,
                ..config
            },
            seed: u64::from(u16::from_le_bytes([seed_lo, seed_hi])),
            caps: QueueCaps {
                recv_depth: 1 + u32::from(depths & 3),
                send_depth: 1 + u32::from((depths >> 2) & 3),
                buffer_size: BUFFER,
                work_depth: 0,
            },
            establish_timeout: deadline_ms(flags >> 5)
                .map(|ms| Duration::from_millis(u64::from(ms))),
        }
    }
}

impl Op {
    fn decode(input: &mut Input<'_>) -> Self {
        let [kind, a, b, c] = input.u32().to_le_bytes();
        match kind % 24 {
            0..=2 => Op::Connect {
                // The accepting listener most of the time.
                port: [0, 0, 0, 0, 0, 1, 1, 2][usize::from(a % 8)],
                // Now and then a burst.
                count: [1, 1, 2, 3, 24][usize::from(b % 5)],
                timeout_ms: deadline_ms(c),
                too_long: c & 0x80 != 0 && c & 0x40 != 0,
            },
            3 | 4 => Op::Answer {
                pick: a,
                accept: b & 1 == 0,
                too_long: c % 16 == 0,
            },
            5 | 6 => Op::Send {
                who: who(a),
                pick: b,
                len: c,
            },
            7 | 8 => Op::Recv {
                who: who(a),
                pick: b,
                wait: c,
            },
            9 => Op::Established {
                who: who(a),
                pick: b,
                wait: c,
            },
            10 => Op::Accept { wait: a },
            11 => Op::Disconnect {
                who: who(a),
                pick: b,
            },
            12 | 13 => Op::NextEvent {
                who: who(a),
                wait: b,
                count: 1 + c % 4,
            },
            14 => Op::Drain { who: who(a) },
            15 => Op::Process { who: who(a) },
            16 | 17 => Op::Advance { exp: a % 24 },
            18 => {
                // Other kinds only once a connection: a rule for all of them would
                // leave nothing to connect.
                let (kind, nth) = if a & 1 == 0 {
                    (MsgKind::Rtu, (c & 1 == 1).then_some(u32::from(c >> 1) % 4))
                } else {
                    let kind = MsgKind::ALL[usize::from(a >> 1) % MsgKind::ALL.len()];
                    (kind, Some(u32::from(c >> 1) % 4))
                };
                let action = match b % 4 {
                    0 | 1 => FaultAction::Drop,
                    2 => FaultAction::Delay(Duration::from_micros(1 << ((b >> 2) % 24))),
                    _ => FaultAction::Duplicate,
                };
                Op::Fault { kind, action, nth }
            }
            19 => Op::Device {
                who: who(a),
                // The device lost (which ends the side's run) the least often.
                what: match b % 16 {
                    0 => DeviceOp::Fatal,
                    1 => DeviceOp::Remove,
                    2..=5 => DeviceOp::Port(b & 16 == 0),
                    6..=8 => DeviceOp::QpFatal(c),
                    _ => DeviceOp::CommEst(c),
                },
            },
            20 => Op::SetNotify {
                who: who(a),
                on: b & 1 == 1,
            },
            21 => Op::CloseListener { pick: a },
            22 => Op::Listen {
                port: a % 3,
                manual: b & 1 == 1,
                timeout_ms: deadline_ms(c),
            },
            _ => Op::Process { who: who(a) },
        }
    }
}

/// One endpoint and what the run saw of it.
struct Side {
    who: Who,
    role: Role,
    endpoint: Arc<Mutex<SimEndpoint>>,
    /// Every handle the application was given, in order.
    known: Vec<ConnectionId>,
    /// Handles reported established (or whose report a call took).
    established: HashSet<ConnectionId>,
    /// Handles that name nothing any more.
    gone: HashSet<ConnectionId>,
    /// The most connections, unreported closes and endpoint events held so far: the
    /// queues' stale entries are dropped against it.
    peak: usize,
    /// A fatal error or removal was raised on the side's device.
    device_lost: bool,
}

struct World {
    fabric: SimFabric,
    sides: [Side; 2],
    caps: QueueCaps,
    listeners: Vec<ListenerId>,
    /// Requests reported and not yet answered.
    requests: Vec<ConnectionId>,
    connects: usize,
    /// The operation being run, for failure messages.
    at: String,
}

/// Lets `other` handle its inputs while an endpoint waits (a hook on that endpoint's
/// transport; weak, so that the two endpoints do not keep each other alive). Skipped
/// when `other` is locked at that moment: a hook never waits for a lock, which the
/// thread running it could hold.
fn drive(other: &Weak<Mutex<SimEndpoint>>) {
    let Some(other) = other.upgrade() else { return };
    let Ok(mut other) = other.try_lock() else {
        return;
    };
    other
        .process()
        .expect("process never fails on the simulated fabric");
}

impl World {
    fn new(setup: &Setup) -> Self {
        let SimTransports {
            fabric,
            mut server,
            mut client,
        } = SimTransports::new(setup.config.clone(), setup.seed);
        // Each transport's hook drives the other endpoint: the client's is made first,
        // so that the server's hook can name it.
        let mut server_ep = None;
        let client_ep = Arc::new_cyclic(|client_weak: &Weak<Mutex<SimEndpoint>>| {
            let client_weak = client_weak.clone();
            server.on_step(move || drive(&client_weak));
            let server = Arc::new(Mutex::new(Endpoint::new(server)));
            let server_weak = Arc::downgrade(&server);
            client.on_step(move || drive(&server_weak));
            server_ep = Some(server);
            Mutex::new(Endpoint::new(client))
        });
        let server_ep = server_ep.expect("made with the client");
        let side = |who, role, endpoint| Side {
            who,
            role,
            endpoint,
            known: Vec::new(),
            established: HashSet::new(),
            gone: HashSet::new(),
            peak: 0,
            device_lost: false,
        };
        let mut world = World {
            fabric,
            sides: [
                side(Who::Server, Role::Passive, server_ep),
                side(Who::Client, Role::Active, client_ep),
            ],
            caps: setup.caps,
            listeners: Vec::new(),
            requests: Vec::new(),
            connects: 0,
            at: "the set-up".into(),
        };
        world.listen(0, false, setup.establish_timeout);
        world.listen(1, true, setup.establish_timeout);
        world
    }
}

fn millis(ms: u8) -> Duration {
    Duration::from_millis(u64::from(ms))
}

impl World {
    fn side(&mut self, who: Who) -> &mut Side {
        &mut self.sides[who as usize]
    }

    fn ep(&self, who: Who) -> MutexGuard<'_, SimEndpoint> {
        self.sides[who as usize].endpoint.lock().unwrap()
    }

    /// The timeout of a waiting call on `who` (also once its device is lost: a wait
    /// then ends at its timeout, cm-verbs' `a_wait_after_*` tests).
    fn wait(&self, _who: Who, code: u8) -> Option<Duration> {
        wait(code)
    }

    fn op(&mut self, op: Op) {
        match op {
            Op::Connect {
                port,
                count,
                timeout_ms,
                too_long,
            } => {
                for _ in 0..count {
                    self.connect(port, timeout_ms, too_long);
                }
            }
            Op::Answer {
                pick,
                accept,
                too_long,
            } => self.answer(pick, accept, too_long),
            Op::Send { who, pick, len } => self.send(who, pick, len),
            Op::Recv {
                who,
                pick,
                wait: code,
            } => self.recv(who, pick, self.wait(who, code)),
            Op::Established {
                who,
                pick,
                wait: code,
            } => self.established(who, pick, self.wait(who, code)),
            Op::Accept { wait: code } => self.accept(self.wait(Who::Server, code)),
            Op::Disconnect { who, pick } => self.disconnect(who, pick),
            Op::NextEvent {
                who,
                wait: code,
                count,
            } => {
                for _ in 0..count {
                    let timeout = self.wait(who, code);
                    let next = self.ep(who).next_event(timeout);
                    match next {
                        Ok(event) => self.observe(who, event),
                        Err(ConnError::Timeout) => break,
                        Err(error) => panic!("{}: next_event answered {error:?}", self.at),
                    }
                }
            }
            Op::Drain { who } => self.drain(who),
            Op::Process { who } => self.process(who),
            Op::Advance { exp } => self.advance(exp),
            Op::Fault { kind, action, nth } => {
                let rule = FaultRule::new(kind, action);
                self.fabric.add_fault(nth.map_or(rule, |nth| rule.nth(nth)));
            }
            Op::Device { who, what } => self.device(who, what),
            Op::SetNotify { who, on } => self.ep(who).set_notify(on),
            Op::CloseListener { pick } => {
                if !self.listeners.is_empty() {
                    let listener = self.listeners[usize::from(pick) % self.listeners.len()];
                    match self.ep(Who::Server).close_listener(listener) {
                        Ok(()) => {}
                        Err(ConnError::UnknownListener(l)) => assert_eq!(l, listener),
                        Err(other) => panic!("{}: close_listener answered {other:?}", self.at),
                    }
                }
            }
            Op::Listen {
                port,
                manual,
                timeout_ms,
            } => self.listen(port, manual, timeout_ms.map(millis)),
        }
    }

    fn listen(&mut self, port: u8, manual: bool, establish_timeout: Option<Duration>) {
        let options = ListenOptions {
            caps: self.caps,
            auto_accept: !manual,
            establish_timeout,
            ..ListenOptions::default()
        };
        let result = {
            let mut server = self.ep(Who::Server);
            let addr = server.transport().addr(PORTS[usize::from(port)]);
            server.listen(addr, options)
        };
        match result {
            Ok(listener) => self.listeners.push(listener),
            // The port is bound, or the device is gone.
            Err(ConnError::Cm(_)) => {}
            Err(other) => panic!("{}: listen answered {other:?}", self.at),
        }
    }

    /// Handles one handle the application was given: known from now on.
    fn learn(&mut self, who: Who, conn: ConnectionId) {
        let side = self.side(who);
        if !side.known.contains(&conn) {
            side.known.push(conn);
        }
    }

    /// Calls `f` on the handle `pick` chooses among those `who` knows: the handle,
    /// whether it named nothing before the call, and the answer.
    fn call_on<R>(
        &mut self,
        who: Who,
        pick: u8,
        f: impl FnOnce(&mut SimEndpoint, ConnectionId) -> Result<R, ConnError>,
    ) -> Option<(ConnectionId, bool, Result<R, ConnError>)> {
        let conn = self.pick(who, pick)?;
        let was_gone = self.sides[who as usize].gone.contains(&conn);
        let result = f(&mut self.ep(who), conn);
        Some((conn, was_gone, result))
    }

    fn pick(&self, who: Who, byte: u8) -> Option<ConnectionId> {
        let known = &self.sides[who as usize].known;
        (!known.is_empty()).then(|| known[usize::from(byte) % known.len()])
    }

    fn connect(&mut self, port: u8, timeout_ms: Option<u8>, too_long: bool) {
        if self.connects >= MAX_CONNECTS {
            return;
        }
        self.connects += 1;
        let data: &[u8] = if too_long {
            &[7; PrivateData::MAX_REQ + 1]
        } else {
            b"hello"
        };
        let to = self
            .ep(Who::Server)
            .transport()
            .addr(PORTS[usize::from(port)]);
        let options = ConnectOptions {
            caps: self.caps,
            private_data: PrivateData::from(data),
            timeout: timeout_ms.map(millis),
            ..ConnectOptions::default()
        };
        let result = self.ep(Who::Client).connect(to, options);
        match result {
            Ok(conn) => {
                assert!(!too_long, "{}: a REQ too long was sent", self.at);
                assert!(
                    !self.sides[Who::Client as usize].known.contains(&conn),
                    "{}: connect gave an old handle {conn}",
                    self.at
                );
                self.learn(Who::Client, conn);
            }
            Err(ConnError::PrivateDataTooLong { .. }) => assert!(too_long),
            // The device is gone.
            Err(ConnError::Cm(_)) => {}
            Err(other) => panic!("{}: connect answered {other:?}", self.at),
        }
    }

    fn answer(&mut self, pick: u8, accept: bool, too_long: bool) {
        let conn = if self.requests.is_empty() {
            match self.pick(Who::Server, pick) {
                Some(conn) => conn,
                None => return,
            }
        } else {
            self.requests
                .remove(usize::from(pick) % self.requests.len())
        };
        let was_gone = self.sides[0].gone.contains(&conn);
        let len = if too_long {
            PrivateData::MAX_REP + 1
        } else {
            4
        };
        let data = PrivateData::from(vec![1; len]);
        let result = if accept {
            self.ep(Who::Server).accept_request(conn, &data)
        } else {
            self.ep(Who::Server).reject_request(conn, &data)
        };
        match &result {
            Ok(()) if !accept => self.closed_for_good(Who::Server, conn),
            Err(ConnError::PrivateDataTooLong { .. }) => assert!(too_long),
            Ok(())
            | Err(ConnError::WrongState { .. })
            | Err(ConnError::Closed { .. })
            | Err(ConnError::UnknownConnection(_))
            | Err(ConnError::Cm(_)) => {}
            Err(other) => panic!("{}: answering a request answered {other:?}", self.at),
        }
        self.after_call(Who::Server, conn, was_gone, &result);
    }

    /// Checks a call's answer on `conn` against what the handle was, and learns
    /// whether it names anything still.
    fn after_call<T: std::fmt::Debug>(
        &mut self,
        who: Who,
        conn: ConnectionId,
        was_gone: bool,
        result: &Result<T, ConnError>,
    ) {
        if was_gone {
            // Arguments are checked before the handle.
            assert!(
                matches!(result, Err(ConnError::UnknownConnection(c)) if *c == conn)
                    || matches!(result, Err(ConnError::PrivateDataTooLong { .. })),
                "{}: {who:?} {conn} named nothing, then answered {result:?}",
                self.at
            );
        }
        if let Err(
            ConnError::UnknownConnection(c)
            | ConnError::Closed { conn: c, .. }
            | ConnError::WrongState { conn: c, .. }
            | ConnError::SendQueueFull(c),
        ) = result
        {
            assert_eq!(*c, conn, "{}: an error named another handle", self.at);
        }
        let info = self.ep(who).info(conn);
        match info {
            Err(ConnError::UnknownConnection(_)) => {
                self.side(who).gone.insert(conn);
            }
            Ok(_) | Err(ConnError::Closed { .. }) => assert!(
                !was_gone,
                "{}: {who:?} {conn} named nothing, then something",
                self.at
            ),
            Err(other) => panic!("{}: info answered {other:?}", self.at),
        }
    }

    /// `conn` was closed and its close reported (or the application closed it): from
    /// now on every call answers `UnknownConnection` at once.
    fn closed_for_good(&mut self, who: Who, conn: ConnectionId) {
        let unknown = Err::<(), _>(ConnError::UnknownConnection(conn));
        let mut ep = self.ep(who);
        let answers = [
            ep.info(conn).map(drop),
            ep.recv(conn, Some(Duration::ZERO)).map(drop),
            ep.established(conn, Some(Duration::ZERO)).map(drop),
            ep.send(conn, b"x"),
            ep.disconnect(conn),
        ];
        drop(ep);
        for answer in answers {
            assert_eq!(
                answer, unknown,
                "{}: {who:?} {conn} closed, yet it answers",
                self.at
            );
        }
        self.side(who).gone.insert(conn);
    }

    fn send(&mut self, who: Who, pick: u8, len: u8) {
        let Some((conn, was_gone, result)) = self.call_on(who, pick, |ep, conn| {
            ep.send(conn, &vec![len; usize::from(len)])
        }) else {
            return;
        };
        match &result {
            Ok(()) => assert!(u32::from(len) <= BUFFER, "{}: sent too long", self.at),
            Err(ConnError::MessageTooLarge { len, max }) => assert!(len > max),
            // The peer's QP is gone (the simulation refuses the post).
            Err(ConnError::Cm(_))
            | Err(ConnError::UnknownConnection(_))
            | Err(ConnError::Closed { .. })
            | Err(ConnError::WrongState { .. })
            | Err(ConnError::SendQueueFull(_)) => {}
            Err(other) => panic!("{}: send answered {other:?}", self.at),
        }
        self.after_call(who, conn, was_gone, &result);
    }

    fn recv(&mut self, who: Who, pick: u8, timeout: Option<Duration>) {
        let Some((conn, was_gone, result)) =
            self.call_on(who, pick, |ep, conn| ep.recv(conn, timeout))
        else {
            return;
        };
        match &result {
            Err(ConnError::Closed { .. }) => {
                self.after_call(who, conn, was_gone, &result);
                self.closed_for_good(who, conn);
                return;
            }
            Ok(_) | Err(ConnError::UnknownConnection(_)) | Err(ConnError::Timeout) => {}
            Err(other) => panic!("{}: recv answered {other:?}", self.at),
        }
        // Asking for a message of an established connection (or of a closed one
        // holding messages) takes its ESTABLISHED too, message or not.
        let established = matches!(
            self.ep(who).info(conn),
            Ok(info) if info.state == cm_verbs::ConnState::Established
        ) || matches!(self.ep(who).info(conn), Err(ConnError::Closed { .. }));
        if established {
            self.side(who).established.insert(conn);
        }
        self.after_call(who, conn, was_gone, &result);
    }

    fn established(&mut self, who: Who, pick: u8, timeout: Option<Duration>) {
        let Some((conn, was_gone, result)) =
            self.call_on(who, pick, |ep, conn| ep.established(conn, timeout))
        else {
            return;
        };
        match &result {
            // Asking again is no second report.
            Ok(_) => {
                self.side(who).established.insert(conn);
            }
            Err(ConnError::Closed { .. })
            | Err(ConnError::UnknownConnection(_))
            | Err(ConnError::Timeout) => {}
            Err(other) => panic!("{}: established answered {other:?}", self.at),
        }
        self.after_call(who, conn, was_gone, &result);
    }

    fn accept(&mut self, timeout: Option<Duration>) {
        let result = self.ep(Who::Server).accept(timeout);
        match result {
            Ok(conn) => {
                let at = self.at.clone();
                let side = self.side(Who::Server);
                assert!(!side.gone.contains(&conn), "{at}: accepted a closed {conn}");
                assert!(
                    side.established.insert(conn),
                    "{at}: {conn} accepted after it was reported established"
                );
                self.learn(Who::Server, conn);
            }
            Err(ConnError::Timeout) | Err(ConnError::ListenerClosed { .. }) => {}
            Err(other) => panic!("{}: accept answered {other:?}", self.at),
        }
    }

    fn disconnect(&mut self, who: Who, pick: u8) {
        let Some((conn, was_gone, result)) =
            self.call_on(who, pick, |ep, conn| ep.disconnect(conn))
        else {
            return;
        };
        self.requests.retain(|c| who == Who::Client || *c != conn);
        match &result {
            Ok(()) => {
                assert!(!was_gone, "{}: disconnected a closed {conn}", self.at);
                self.closed_for_good(who, conn);
            }
            Err(ConnError::UnknownConnection(_)) => {}
            Err(other) => panic!("{}: disconnect answered {other:?}", self.at),
        }
        self.after_call(who, conn, was_gone, &result);
    }

    /// Checks one reported event against what the side saw before.
    fn observe(&mut self, who: Who, event: Event) {
        let at = self.at.clone();
        if let Some(conn) = event.conn() {
            assert!(
                !self.sides[who as usize].gone.contains(&conn),
                "{at}: {who:?} reported {event:?} of a closed handle"
            );
            self.learn(who, conn);
        }
        match event {
            Event::Request { conn, .. } => {
                assert_eq!(who, Who::Server, "{at}: a request on the client");
                self.requests.push(conn);
            }
            Event::Established { conn, role, .. } => {
                let side = self.side(who);
                assert_eq!(role, side.role, "{at}: {conn} established in another role");
                assert!(
                    side.established.insert(conn),
                    "{at}: {who:?} {conn} reported established twice"
                );
            }
            Event::Closed { conn, .. } => {
                self.requests.retain(|c| who == Who::Client || *c != conn);
                self.closed_for_good(who, conn);
            }
            // Messages and completed sends come after the connection's ESTABLISHED.
            Event::Received { conn, .. } | Event::Sent { conn, .. } => assert!(
                self.sides[who as usize].established.contains(&conn),
                "{at}: {who:?} reported {conn}'s data before it was established"
            ),
            _ => {}
        }
    }

    fn process(&mut self, who: Who) {
        let result = self.ep(who).process();
        if let Err(error) = result {
            panic!("{}: {who:?} process answered {error:?}", self.at);
        }
    }

    /// `poll` until nothing is left to report.
    fn drain(&mut self, who: Who) {
        for _ in 0..MAX_DRAIN {
            let next = self.ep(who).poll();
            match next {
                Ok(Some(event)) => self.observe(who, event),
                Ok(None) => return,
                Err(error) => panic!("{}: {who:?} poll answered {error:?}", self.at),
            }
        }
        panic!("{}: {who:?} reports events without end", self.at);
    }

    /// Moves virtual time on by 2^`exp` µs, both endpoints handling what each step
    /// brings (as `Sim::advance` of the endpoint tests).
    fn advance(&mut self, exp: u8) {
        let until = self.fabric.now() + Duration::from_micros(1 << exp);
        for _ in 0..MAX_DRAIN {
            self.process(Who::Server);
            self.process(Who::Client);
            match self.fabric.next_due() {
                Some(due) if due <= until => {
                    self.fabric.step();
                }
                _ => {
                    self.fabric.advance(until.saturating_sub(self.fabric.now()));
                    self.process(Who::Server);
                    self.process(Who::Client);
                    return;
                }
            }
        }
        panic!("{}: the fabric never goes quiet", self.at);
    }

    fn device(&mut self, who: Who, what: DeviceOp) {
        if matches!(what, DeviceOp::Fatal | DeviceOp::Remove) {
            self.side(who).device_lost = true;
        }
        let ep = self.ep(who);
        let node = ep.transport().node().clone();
        let qp_of = |pick: u8| {
            self.pick(who, pick)
                .and_then(|conn| ep.info(conn).ok())
                .and_then(|info| info.qp)
        };
        let port = |event_type| AsyncEvent {
            event_type,
            element: EventElement::Port(1),
        };
        let event = match what {
            DeviceOp::Fatal => Some(port(AsyncEventType::DeviceFatal)),
            DeviceOp::Port(true) => Some(port(AsyncEventType::PortActive)),
            DeviceOp::Port(false) => Some(port(AsyncEventType::PortErr)),
            DeviceOp::QpFatal(pick) => {
                qp_of(pick).map(|qp| AsyncEvent::qp(AsyncEventType::QpFatal, qp))
            }
            DeviceOp::CommEst(pick) => {
                qp_of(pick).map(|qp| AsyncEvent::qp(AsyncEventType::CommEst, qp))
            }
            DeviceOp::Remove => {
                // Removing it twice is a typed error of the simulation.
                let _ = node.remove_device();
                None
            }
        };
        drop(ep);
        if let Some(event) = event {
            node.device().raise(event);
        }
    }

    /// The invariants that hold after every operation, on both endpoints.
    fn check(&mut self) {
        let depth = self.caps.recv_depth as usize;
        for side in &mut self.sides {
            let at = &self.at;
            let who = side.who;
            let ep = side.endpoint.lock().unwrap();
            let stats = ep.stats();
            assert_eq!(stats.connections, ep.connection_count(), "{at}");
            assert!(
                stats.closed_unreported <= CLOSED_BACKLOG,
                "{at}: {who:?} {stats:?}"
            );
            assert!(
                stats.endpoint_events <= ENDPOINT_EVENT_BACKLOG,
                "{at}: {who:?} {stats:?}"
            );
            assert!(
                stats.held_messages <= (stats.connections + stats.closed_unreported) * depth,
                "{at}: {who:?} holds more than the receive depths: {stats:?}"
            );
            // The bounds of the ready, accept and deadline queues are taken against
            // the most the side held so far: their stale entries are dropped when
            // entries are added (or deadlines come due), not when connections leave
            // (cm-verbs' ignored `accept_entries_*` and `deadlines_*` tests).
            side.peak = side
                .peak
                .max(stats.connections + stats.closed_unreported + stats.endpoint_events);
            let bound = 2 * side.peak + 64;
            assert!(
                stats.ready_entries <= bound
                    && stats.accept_entries <= bound
                    && stats.deadline_entries <= bound
                    && stats.awaiting_entries <= bound,
                "{at}: {who:?} queues past 2 x {} + 64: {stats:?}",
                side.peak
            );
            for conn in &side.gone {
                assert_eq!(
                    ep.info(*conn).map(drop),
                    Err(ConnError::UnknownConnection(*conn)),
                    "{at}: {who:?} {conn} named nothing, then something"
                );
            }
            let _ = ep.counters();
        }
    }
}
