//! Body of the `sim_ops` fuzz target: the simulated fabric driven by an arbitrary
//! sequence of application calls and wire faults.
//!
//! Checked after every call and at the end:
//! - nothing panics, and the run ends (no endless message exchange);
//! - every id sees at most one ESTABLISHED, and none after a connection failure
//!   (exactly one ESTABLISHED per side, or a failure; a REJECTED may still follow an
//!   ESTABLISHED when the peer gives up, as in the kernel);
//! - bad calls are refused with typed errors: calls on a destroyed id answer
//!   [`CmError::Gone`] (notify: [`NotifyError::UnknownId`]), a live id never answers
//!   `Gone`, and destroying an id with unacknowledged events answers
//!   [`CmError::UnackedEvents`] with the right count;
//! - once every event is acknowledged, every id can be destroyed, and every event
//!   handed out was acknowledged exactly once.

use std::time::Duration;

use cm_core::{
    errno, AsyncEvent, AsyncEventSource, AsyncEventType, CmError, CmEvent, CmEventSource,
    CmEventType, CmId, NotifyError, NotifyOutcome, QpNum,
};
use cm_mock::sim::{
    FaultAction, FaultOdds, FaultRule, MsgKind, SimChannel, SimCmEvent, SimCmId, SimConfig,
    SimDevice, SimFabric, SimNode, SimPair,
};

use crate::input::Input;

/// The port the server listens on.
const PORT: u16 = 4791;
/// Ids the fuzzer may create (beyond those connection requests create).
const MAX_IDS: usize = 12;
/// Events the application may hold unacknowledged at once.
const MAX_HELD: usize = 8;
/// Operations read from one input.
const MAX_OPS: usize = 256;
/// Simulation steps after which the run counts as endless.
const MAX_STEPS: usize = 200_000;

/// Which node an id or channel is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Server,
    Client,
}

/// One id the application knows, with what it saw.
#[derive(Debug)]
struct Tracked {
    id: SimCmId,
    side: Side,
    established: u32,
    failure: Option<CmEventType>,
    destroyed: bool,
}

struct World {
    fabric: SimFabric,
    nodes: [SimNode; 2],
    channels: Vec<(Side, SimChannel)>,
    devices: [SimDevice; 2],
    ids: Vec<Tracked>,
    held: Vec<SimCmEvent>,
    created: usize,
}

/// Runs one arbitrary sequence of operations; panics when an invariant breaks.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let mut world = World::new(&mut input);
    for _ in 0..MAX_OPS {
        if input.is_empty() {
            break;
        }
        world.op(&mut input);
    }
    world.finish();
}

/// Checks the typed-error contract of a call on an id.
fn check_call<T>(result: &Result<T, CmError>, tracked: &Tracked, op: &str) {
    if let Err(error) = result {
        assert!(error.errno() > 0, "{op}: {error:?} has no errno");
        assert!(!error.to_string().is_empty());
        match error {
            CmError::Gone { what: "id", .. } => {
                assert!(tracked.destroyed, "{op} on a live id answered {error:?}")
            }
            // The other object of the call is gone (migrate to a destroyed channel).
            CmError::Gone { .. } => {}
            _ => assert!(
                !tracked.destroyed,
                "{op} on a destroyed id answered {error:?}, not Gone"
            ),
        }
    } else {
        assert!(!tracked.destroyed, "{op} on a destroyed id succeeded");
    }
}

impl World {
    fn new(input: &mut Input<'_>) -> Self {
        let flags = input.u8();
        let config = SimConfig {
            comm_est: flags & 1 == 0,
            delayed_mra: flags & 2 == 0,
            max_cm_retries: u32::from((flags >> 2) & 3),
            cm_response_timeout: Duration::from_millis(1),
            mra_service_timeout: Duration::from_millis(4),
            timewait: Duration::from_millis(1),
            ..SimConfig::default()
        };
        let pair = SimPair::new(config, u64::from(input.u16()));
        let listener = pair.listen(PORT).expect("a fresh node binds and listens");
        let SimPair {
            fabric,
            server,
            client,
        } = pair;
        let nodes = [server.node.clone(), client.node.clone()];
        // Two channels a node: the pair's and one more.
        let channels = vec![
            (Side::Server, server.channel),
            (Side::Server, server.node.create_channel()),
            (Side::Client, client.channel),
            (Side::Client, client.node.create_channel()),
        ];
        let devices = [server.device, client.device];
        World {
            fabric,
            nodes,
            channels,
            devices,
            ids: vec![Tracked {
                id: listener,
                side: Side::Server,
                established: 0,
                failure: None,
                destroyed: false,
            }],
            held: Vec::new(),
            created: 1,
        }
    }

    fn pick(&self, input: &mut Input<'_>) -> Option<usize> {
        (!self.ids.is_empty()).then(|| input.below(self.ids.len()))
    }

    fn op(&mut self, input: &mut Input<'_>) {
        match input.below(22) {
            0 => self.create_active(input),
            1 => self.call(input, "resolve_route", |id, _| id.resolve_route()),
            2 => self.call(input, "create_qp", |id, _| id.create_qp().map(drop)),
            3 => self.call(input, "connect", |id, input| {
                let len = input.below(80);
                id.connect(input.slice(len)).map(drop)
            }),
            4 => self.call(input, "accept", |id, input| {
                let len = input.below(80);
                id.accept(input.slice(len))
            }),
            5 => self.call(input, "reject", |id, _| id.reject(b"no")),
            6 => self.call(input, "disconnect", |id, _| id.disconnect()),
            7 => self.destroy(input),
            8 => self.notify(input),
            9 => self.call(input, "post_send", |id, input| {
                id.post_send(u32::from(input.u16()))
            }),
            10 => self.read_events(input),
            11 => self.ack_held(input),
            12 => {
                for _ in 0..=input.below(16) {
                    self.fabric.step();
                }
            }
            13 => {
                let micros = 1u64 << input.below(24);
                self.fabric.advance(Duration::from_micros(micros));
            }
            14 => self.add_rule(input),
            15 => self.pump(),
            16 => self.migrate(input),
            17 => {
                let node = input.below(2);
                self.nodes[node]
                    .set_going_down(input.bool())
                    .expect("a node of the fabric");
            }
            18 => self.raise(input),
            19 => {
                for device in &mut self.devices {
                    while device.poll_cq().is_some() {}
                }
            }
            20 => self.destroy_channel(input),
            _ => self.set_odds(input),
        }
    }

    fn create_active(&mut self, input: &mut Input<'_>) {
        if self.created >= MAX_IDS {
            return;
        }
        self.created += 1;
        let (side, channel) = &self.channels[input.below(self.channels.len())];
        let id = channel.create_id();
        let to = self.nodes[input.below(2)].id();
        let port = if input.bool() { PORT } else { PORT + 1 };
        // An id created on a destroyed channel is born destroyed.
        assert_eq!(id.is_alive(), !channel.is_destroyed());
        let tracked = Tracked {
            destroyed: !id.is_alive(),
            id,
            side: *side,
            established: 0,
            failure: None,
        };
        let result = tracked.id.resolve_addr(to, port);
        check_call(&result, &tracked, "resolve_addr");
        self.ids.push(tracked);
    }

    fn call(
        &mut self,
        input: &mut Input<'_>,
        op: &str,
        f: impl FnOnce(&SimCmId, &mut Input<'_>) -> Result<(), CmError>,
    ) {
        let Some(i) = self.pick(input) else { return };
        let result = f(&self.ids[i].id, input);
        check_call(&result, &self.ids[i], op);
    }

    fn held_for(&self, id: &SimCmId) -> usize {
        self.held.iter().filter(|e| e.id() == *id).count()
    }

    fn destroy(&mut self, input: &mut Input<'_>) {
        let Some(i) = self.pick(input) else { return };
        let held = self.held_for(&self.ids[i].id);
        let result = self.ids[i].id.destroy();
        check_call(&result, &self.ids[i], "destroy");
        match result {
            Ok(()) => {
                assert_eq!(held, 0, "destroyed with {held} events unacknowledged");
                self.ids[i].destroyed = true;
                assert!(!self.ids[i].id.is_alive());
            }
            Err(CmError::UnackedEvents { unacked, .. }) => assert_eq!(unacked, held),
            Err(_) => {}
        }
    }

    fn notify(&mut self, input: &mut Input<'_>) {
        let Some(i) = self.pick(input) else { return };
        let event = match input.below(4) {
            0..=1 => AsyncEventType::CommEst,
            2 => AsyncEventType::PathMig,
            _ => AsyncEventType::from_raw(input.u32()),
        };
        let tracked = &self.ids[i];
        let result = tracked.id.notify(event);
        check_notify(result, tracked, event);
    }

    fn destroy_channel(&mut self, input: &mut Input<'_>) {
        let channel = input.below(self.channels.len());
        let was_destroyed = self.channels[channel].1.is_destroyed();
        match self.channels[channel].1.destroy() {
            Ok(()) => {
                assert!(!was_destroyed, "a channel was destroyed twice");
                for tracked in &mut self.ids {
                    if !tracked.destroyed && !tracked.id.is_alive() {
                        tracked.destroyed = true;
                        let held = self.held.iter().filter(|e| e.id() == tracked.id).count();
                        assert_eq!(held, 0, "a channel went with events unacknowledged");
                    }
                }
            }
            Err(CmError::Gone { what, .. }) => {
                assert!(was_destroyed);
                assert_eq!(what, "channel");
            }
            Err(CmError::UnackedEvents { unacked, .. }) => {
                assert!(unacked > 0 && unacked <= self.held.len());
            }
            Err(other) => panic!("destroying a channel answered {other:?}"),
        }
    }

    /// The next event of a channel; a destroyed channel answers `Gone`.
    fn next_event(&mut self, channel: usize) -> Option<SimCmEvent> {
        let destroyed = self.channels[channel].1.is_destroyed();
        match self.channels[channel].1.try_next_event() {
            Ok(event) => {
                assert!(!destroyed, "a destroyed channel was read");
                event
            }
            Err(CmError::Gone {
                what: "channel", ..
            }) if destroyed => None,
            Err(other) => panic!("reading a channel answered {other:?}"),
        }
    }

    fn read_events(&mut self, input: &mut Input<'_>) {
        let channel = input.below(self.channels.len());
        let mode = input.below(3);
        for _ in 0..=input.below(4) {
            let Some(event) = self.next_event(channel) else {
                break;
            };
            self.observe(&event, self.channels[channel].0);
            match mode {
                0 if self.held.len() < MAX_HELD => self.held.push(event),
                1 => drop(event),
                _ => event.ack().expect("a simulated event acks"),
            }
        }
    }

    /// Counts what an event tells about its id and checks the exactly-once invariant.
    fn observe(&mut self, event: &SimCmEvent, side: Side) {
        let id = event.id();
        let index = match self.ids.iter().position(|t| t.id == id) {
            Some(index) => index,
            None => {
                // A connection request's new id.
                self.ids.push(Tracked {
                    id: id.clone(),
                    side,
                    established: 0,
                    failure: None,
                    destroyed: false,
                });
                self.ids.len() - 1
            }
        };
        let tracked = &mut self.ids[index];
        assert!(
            !tracked.destroyed,
            "an event of a destroyed id was delivered"
        );
        assert_eq!(tracked.side, side, "an event on another node's channel");
        match event.event_type() {
            CmEventType::Established => {
                tracked.established += 1;
                assert_eq!(tracked.established, 1, "a second ESTABLISHED on {id:?}");
                assert_eq!(
                    tracked.failure, None,
                    "ESTABLISHED after a connection failure on {id:?}"
                );
            }
            // A failure after ESTABLISHED is the connection breaking later, as in the
            // kernel's cm_rej_handler: a REJ reaching an ESTABLISHED id (the peer gave
            // up on its REP, or destroyed its id) is reported as REJECTED.
            failure if failure.is_connect_failure() => {
                tracked.failure.get_or_insert(failure);
            }
            _ => {}
        }
        assert!(!event.event_type().to_string().is_empty());
        let _ = (event.status(), event.private_data().len(), event.qp_num());
    }

    fn ack_held(&mut self, input: &mut Input<'_>) {
        if self.held.is_empty() {
            return;
        }
        let event = self.held.remove(input.below(self.held.len()));
        if input.bool() {
            event.ack().expect("a simulated event acks");
        }
    }

    fn add_rule(&mut self, input: &mut Input<'_>) {
        let kind = MsgKind::ALL[input.below(MsgKind::ALL.len())];
        let action = match input.below(4) {
            0 => FaultAction::Drop,
            1 => FaultAction::Delay(Duration::from_micros(1 << input.below(22))),
            2 => FaultAction::Duplicate,
            _ => FaultAction::Reorder,
        };
        let mut rule = FaultRule::new(kind, action);
        if input.bool() {
            rule = rule.nth(u32::from(input.u8() % 4));
        }
        self.fabric.add_fault(rule);
    }

    fn set_odds(&mut self, input: &mut Input<'_>) {
        let kind = MsgKind::ALL[input.below(MsgKind::ALL.len())];
        let probability = |input: &mut Input<'_>| f64::from(input.u8() % 5) / 4.0;
        let odds = FaultOdds {
            drop: probability(input),
            duplicate: probability(input),
            delay: probability(input),
            max_delay: Duration::from_micros(u64::from(input.u16())),
            reorder: probability(input),
        };
        self.fabric.set_fault_odds(kind, odds);
    }

    /// What the notify pump does: every COMM_EST goes to the id owning the QP.
    fn pump(&mut self) {
        for (node, side) in [(0, Side::Server), (1, Side::Client)] {
            while let Some(event) = self.devices[node]
                .try_next_async_event()
                .expect("the simulated device does not fail")
            {
                if event.event_type != AsyncEventType::CommEst {
                    continue;
                }
                let Some(qp) = event.qp_num() else { continue };
                let owner = self
                    .ids
                    .iter()
                    .find(|t| t.side == side && !t.destroyed && t.id.qp_num() == Some(qp));
                if let Some(tracked) = owner {
                    check_notify(
                        tracked.id.notify(AsyncEventType::CommEst),
                        tracked,
                        event.event_type,
                    );
                }
            }
        }
    }

    fn migrate(&mut self, input: &mut Input<'_>) {
        let Some(i) = self.pick(input) else { return };
        let channel = input.below(self.channels.len());
        let held = self.held_for(&self.ids[i].id);
        let result = self.ids[i].id.migrate(&self.channels[channel].1);
        check_call(&result, &self.ids[i], "migrate");
        if let Err(CmError::Gone {
            what: "channel", ..
        }) = result
        {
            assert!(self.channels[channel].1.is_destroyed());
        }
        match result {
            Ok(()) => {
                assert_eq!(held, 0, "migrated with {held} events unacknowledged");
                self.ids[i].side = self.channels[channel].0;
            }
            Err(CmError::UnackedEvents { unacked, .. }) => assert_eq!(unacked, held),
            Err(_) => {}
        }
    }

    fn raise(&mut self, input: &mut Input<'_>) {
        let node = input.below(2);
        let qp = match self.pick(input) {
            Some(i) => self.ids[i].id.qp_num().unwrap_or(QpNum(input.u32())),
            None => QpNum(input.u32()),
        };
        let event_type = if input.bool() {
            AsyncEventType::CommEst
        } else {
            AsyncEventType::from_raw(u32::from(input.u8()))
        };
        self.devices[node].raise(AsyncEvent::qp(event_type, qp));
    }

    /// Acknowledges everything, runs the fabric dry, destroys every id.
    fn finish(mut self) {
        for event in self.held.drain(..) {
            event.ack().expect("a simulated event acks");
        }
        let mut steps = 0;
        loop {
            for c in 0..self.channels.len() {
                while let Some(event) = self.next_event(c) {
                    self.observe(&event, self.channels[c].0);
                    event.ack().expect("a simulated event acks");
                }
            }
            self.pump();
            for device in &mut self.devices {
                while device.poll_cq().is_some() {}
            }
            steps += 1;
            assert!(steps < MAX_STEPS, "the fabric never goes idle");
            if !self.fabric.step() {
                break;
            }
        }
        for tracked in &mut self.ids {
            if tracked.destroyed {
                continue;
            }
            assert_eq!(tracked.id.unacked_events().expect("a live id"), 0);
            tracked
                .id
                .destroy()
                .expect("an id without unacknowledged events is destroyed");
            tracked.destroyed = true;
        }
        for tracked in &self.ids {
            check_call(&tracked.id.disconnect(), tracked, "disconnect");
            check_call(&tracked.id.destroy(), tracked, "destroy");
            check_notify(
                tracked.id.notify(AsyncEventType::CommEst),
                tracked,
                AsyncEventType::CommEst,
            );
        }
        let stats = self.fabric.stats();
        assert_eq!(
            stats.events_acked, stats.events_delivered,
            "every event handed out is acknowledged exactly once"
        );
    }
}

/// Checks what notify answered against the kernel's contract.
fn check_notify(
    result: Result<NotifyOutcome, NotifyError>,
    tracked: &Tracked,
    event: AsyncEventType,
) {
    if tracked.destroyed {
        assert_eq!(result, Err(NotifyError::UnknownId));
        return;
    }
    match result {
        Ok(NotifyOutcome::AlreadyEstablished) => assert_eq!(event, AsyncEventType::CommEst),
        Ok(NotifyOutcome::Established) => assert!(matches!(
            event,
            AsyncEventType::CommEst | AsyncEventType::PathMig
        )),
        Err(error) => {
            assert_ne!(error, NotifyError::UnknownId, "a live id is unknown");
            assert!(matches!(error.errno(), errno::EINVAL | errno::ENODEV));
        }
    }
}
