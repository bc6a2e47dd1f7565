//! The world a run acts on: both endpoints on one simulated fabric, each driving the
//! other while it waits, and the operations that are not a call on one handle
//! (listening, processing, draining, virtual time, device events).

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use cm_mock::sim::{FaultRule, SimFabric, SimTransports};
use cm_verbs::core::EventElement;
use cm_verbs::{
    AsyncEvent, AsyncEventType, ConnError, ConnectionId, Endpoint, EndpointOptions, ListenOptions,
    ListenerId, QueueCaps, Role,
};

use super::work::WorkLog;
use super::{wait, DeviceOp, Op, Setup, SimEndpoint, Who, MAX_DRAIN, PORTS};

/// One endpoint and what the run saw of it.
pub(super) struct Side {
    pub(super) who: Who,
    pub(super) role: Role,
    pub(super) endpoint: Arc<Mutex<SimEndpoint>>,
    /// Every handle the application was given, in order.
    pub(super) known: Vec<ConnectionId>,
    /// Handles reported established (or whose report a call took).
    pub(super) established: HashSet<ConnectionId>,
    /// Handles that name nothing any more.
    pub(super) gone: HashSet<ConnectionId>,
    /// The most connections, unreported closes and endpoint events held so far: the
    /// queues' stale entries are dropped against it.
    pub(super) peak: usize,
    /// A fatal error or removal was raised on the side's device.
    pub(super) device_lost: bool,
    /// The one-sided work posted and the sends made on each connection, in handle
    /// order (a run is the same every time).
    pub(super) work: BTreeMap<ConnectionId, WorkLog>,
    /// The number in the next work request id of the side's one-sided work.
    pub(super) next_work: u64,
}

pub(super) struct World {
    pub(super) fabric: SimFabric,
    pub(super) sides: [Side; 2],
    pub(super) caps: QueueCaps,
    pub(super) listeners: Vec<ListenerId>,
    /// Requests reported and not yet answered.
    pub(super) requests: Vec<ConnectionId>,
    pub(super) connects: usize,
    /// The operation being run, for failure messages.
    pub(super) at: String,
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

/// The endpoints' options: shared queues when the set-up says so, else queues of each
/// connection's own.
fn shared_options(setup: &Setup) -> EndpointOptions {
    match setup.shared_queues {
        Some(caps) => EndpointOptions::shared_queues(caps),
        None => EndpointOptions::own_queues(),
    }
}

impl World {
    pub(super) fn new(setup: &Setup) -> Self {
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
            let options = shared_options(setup);
            let mut server = Endpoint::with_options(server, options);
            server.set_busy_poll(setup.busy_poll);
            let server = Arc::new(Mutex::new(server));
            let server_weak = Arc::downgrade(&server);
            client.on_step(move || drive(&server_weak));
            server_ep = Some(server);
            Mutex::new(Endpoint::with_options(client, shared_options(setup)))
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
            work: BTreeMap::new(),
            next_work: 0,
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

pub(super) fn millis(ms: u8) -> Duration {
    Duration::from_millis(u64::from(ms))
}

impl World {
    pub(super) fn side(&mut self, who: Who) -> &mut Side {
        &mut self.sides[who as usize]
    }

    pub(super) fn ep(&self, who: Who) -> MutexGuard<'_, SimEndpoint> {
        self.sides[who as usize].endpoint.lock().unwrap()
    }

    /// The timeout of a waiting call on `who` (also once its device is lost: a wait
    /// then ends at its timeout, cm-verbs' `a_wait_after_*` tests).
    fn wait(&self, _who: Who, code: u8) -> Option<Duration> {
        wait(code)
    }

    pub(super) fn op(&mut self, op: Op) {
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
            Op::Work {
                who,
                pick,
                count,
                refused,
                len,
            } => self.post_work(who, pick, count, refused, len),
            Op::TakeWork {
                who,
                pick,
                count,
                process,
            } => self.take_work(who, pick, count, process),
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
    pub(super) fn learn(&mut self, who: Who, conn: ConnectionId) {
        let side = self.side(who);
        if !side.known.contains(&conn) {
            side.known.push(conn);
        }
    }

    /// Calls `f` on the handle `pick` chooses among those `who` knows: the handle,
    /// whether it named nothing before the call, and the answer.
    pub(super) fn call_on<R>(
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

    pub(super) fn pick(&self, who: Who, byte: u8) -> Option<ConnectionId> {
        let known = &self.sides[who as usize].known;
        (!known.is_empty()).then(|| known[usize::from(byte) % known.len()])
    }

    fn process(&mut self, who: Who) {
        let result = self.ep(who).process();
        if let Err(error) = result {
            panic!("{}: {who:?} process answered {error:?}", self.at);
        }
    }

    /// `poll` until nothing is left to report.
    pub(super) fn drain(&mut self, who: Who) {
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
    pub(super) fn advance(&mut self, exp: u8) {
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
}
