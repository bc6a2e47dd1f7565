//! The two-node set-up nearly every simulation test starts from: a server and a client,
//! each with one event channel and its device, and the handshake steps as helpers; or
//! the same two sides as transports, for tests of the connection API.

use std::time::Duration;

use cm_core::{CmError, CmEvent, CmEventSource, CmEventType};

use super::{
    SimChannel, SimCmEvent, SimCmId, SimConfig, SimDevice, SimFabric, SimNode, SimTransport,
};

/// One side of a [`SimPair`]: a node, an event channel on it and its device.
#[derive(Debug, Clone)]
pub struct SimSide {
    /// The node.
    pub node: SimNode,
    /// The node's event channel (ids the helpers create live on it).
    pub channel: SimChannel,
    /// The node's device: asynchronous events and receive completions.
    pub device: SimDevice,
}

impl SimSide {
    /// A new event channel on `node`, with the node's device (a second channel on a
    /// side of a [`SimPair`] is `SimSide::new(pair.client.node.clone())`).
    pub fn new(node: SimNode) -> Self {
        SimSide {
            channel: node.create_channel(),
            device: node.device(),
            node,
        }
    }

    /// Whether anything waits for the side: events on its channel, or asynchronous
    /// events or receive completions on its device. One look at the fabric, where
    /// `channel.queued() > 0 || device.has_pending()` takes two.
    pub fn has_input(&self) -> bool {
        self.channel.queued_or_pending(Some(&self.device))
    }

    /// The next pending event of the channel; `Ok(None)` when none is waiting.
    pub fn next_event(&mut self) -> Result<Option<SimCmEvent>, CmError> {
        self.channel.try_next_event()
    }

    /// The next pending event, which must be of type `expected` (left unacknowledged);
    /// an error names the step that did not happen.
    pub fn expect_event(&mut self, expected: CmEventType) -> Result<SimCmEvent, CmError> {
        match self.channel.try_next_event()? {
            Some(event) if event.event_type() == expected => Ok(event),
            _ => Err(CmError::InvalidArgument {
                op: "SimPair setup",
                reason: "an expected setup event did not arrive",
            }),
        }
    }

    /// Reads and acknowledges every pending event, as (id, type, status), in order.
    ///
    /// # Panics
    ///
    /// When the channel was destroyed.
    pub fn drain(&mut self) -> Vec<(SimCmId, CmEventType, i32)> {
        let mut out = Vec::new();
        while let Some(event) = self.channel.try_next_event().expect("a live channel") {
            out.push((event.id(), event.event_type(), event.status()));
            event.ack().expect("a simulated ack");
        }
        out
    }
}

/// A fresh fabric with two nodes, node 0 the server and node 1 the client, each with
/// an event channel and its device; the helpers walk one connection through the
/// handshake a step (of [`SimPair::STEP`] virtual time) at a time.
///
/// ```
/// use cm_core::{CmEventType, IbCmState};
/// use cm_mock::sim::{SimConfig, SimPair};
///
/// let mut pair = SimPair::new(SimConfig::default(), 7);
/// let _listener = pair.listen(4791).unwrap();
/// let (active, passive) = pair.connect_until_rep(4791).unwrap();
/// assert_eq!(passive.ib_state().unwrap(), Some(IbCmState::RepSent));
/// let events = pair.client.drain();
/// assert_eq!(events[0].1, CmEventType::Established);
/// pair.fabric.advance(SimPair::STEP);
/// assert_eq!(pair.server.drain()[0].1, CmEventType::Established);
/// assert_eq!(active.ib_state().unwrap(), Some(IbCmState::Established));
/// ```
#[derive(Debug, Clone)]
pub struct SimPair {
    /// The fabric (faults, clock, trace, stats).
    pub fabric: SimFabric,
    /// Node 0: the passive side.
    pub server: SimSide,
    /// Node 1: the active side.
    pub client: SimSide,
}

impl SimPair {
    /// The virtual time each helper lets pass after a call that sends or resolves.
    pub const STEP: Duration = Duration::from_millis(1);

    /// A fresh fabric with `config` and `seed` and its two nodes (nothing listens yet).
    pub fn new(config: SimConfig, seed: u64) -> Self {
        let fabric = SimFabric::new(config, seed);
        let (server, client) = (fabric.add_node(), fabric.add_node());
        SimPair {
            server: SimSide::new(server),
            client: SimSide::new(client),
            fabric,
        }
    }

    /// A listening id on the server's channel, bound to `port`.
    pub fn listen(&self, port: u16) -> Result<SimCmId, CmError> {
        let listener = self.server.channel.create_id();
        listener.bind(port)?;
        listener.listen()?;
        Ok(listener)
    }

    /// A client id on its way to the server's `port`: address and route resolved (each
    /// event read and acknowledged), QP created, REQ sent (not yet delivered).
    pub fn connect(&mut self, port: u16) -> Result<SimCmId, CmError> {
        let active = self.client.channel.create_id();
        active.resolve_addr(self.server.node.id(), port)?;
        self.fabric.advance(Self::STEP);
        self.client.expect_event(CmEventType::AddrResolved)?.ack()?;
        active.resolve_route()?;
        self.fabric.advance(Self::STEP);
        self.client
            .expect_event(CmEventType::RouteResolved)?
            .ack()?;
        active.create_qp()?;
        active.connect(&[])?;
        Ok(active)
    }

    /// Lets the REQ arrive, then reads and acknowledges the server's CONNECT_REQUEST:
    /// its new (passive) id, not yet accepted.
    pub fn request(&mut self) -> Result<SimCmId, CmError> {
        self.fabric.advance(Self::STEP);
        let request = self.server.expect_event(CmEventType::ConnectRequest)?;
        let passive = request.id();
        request.ack()?;
        Ok(passive)
    }

    /// Accepts on `passive` (QP created, REP sent) and lets the REP arrive; the client
    /// has not read it yet (no RTU sent).
    pub fn accept(&mut self, passive: &SimCmId) -> Result<(), CmError> {
        passive.create_qp()?;
        passive.accept(&[])?;
        self.fabric.advance(Self::STEP);
        Ok(())
    }

    /// [`SimPair::connect`], [`SimPair::request`] and [`SimPair::accept`]: one
    /// connection up to the REP reaching the client, as (active, passive).
    pub fn connect_until_rep(&mut self, port: u16) -> Result<(SimCmId, SimCmId), CmError> {
        let active = self.connect(port)?;
        let passive = self.request()?;
        self.accept(&passive)?;
        Ok((active, passive))
    }

    /// Lets `duration` of virtual time pass ([`SimFabric::advance`]).
    pub fn drive(&self, duration: Duration) -> usize {
        self.fabric.advance(duration)
    }

    /// Runs until nothing is scheduled ([`SimFabric::run_until_idle`]).
    pub fn run_until_idle(&self) -> usize {
        self.fabric.run_until_idle()
    }
}

/// The two sides of a [`SimPair`] as transports ([`SimTransport::on_side`]), for tests
/// that run the connection API on both: node 0 the server, node 1 the client.
#[derive(Debug)]
pub struct SimTransports {
    /// The fabric (faults, clock, trace, stats).
    pub fabric: SimFabric,
    /// Node 0's transport: the passive side.
    pub server: SimTransport,
    /// Node 1's transport: the active side.
    pub client: SimTransport,
}

impl SimTransports {
    /// A fresh fabric with `config` and `seed` and its two nodes, made as
    /// [`SimPair::new`] makes them, each side a transport.
    pub fn new(config: SimConfig, seed: u64) -> Self {
        SimPair::new(config, seed).into()
    }
}

/// For a test that needs a side as a [`SimSide`] before it becomes a transport.
impl From<SimPair> for SimTransports {
    fn from(pair: SimPair) -> Self {
        SimTransports {
            server: SimTransport::on_side(pair.server),
            client: SimTransport::on_side(pair.client),
            fabric: pair.fabric,
        }
    }
}
