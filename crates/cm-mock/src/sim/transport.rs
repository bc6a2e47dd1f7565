//! [`SimTransport`]: the simulated fabric as a [`Transport`], so that code written
//! against a connection API over the trait (cm-verbs' `Endpoint`) runs on the
//! simulation unchanged.
//!
//! One transport per node: it reads the node's device (asynchronous events and every
//! receive completion), as the real backend reads one device context once. Sends carry
//! their bytes; receives land in the buffers the connection posted, in order.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::Duration;

use cm_core::{
    AsyncEvent, AsyncEventSource, CmError, CmEventSource, CqKind, QpNum, QueueCaps, Transport,
    WorkCompletion,
};

use super::{NodeId, SimChannel, SimCmEvent, SimCmId, SimDevice, SimNode, SimSide};

/// An address on the simulated fabric: a node and a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimAddr {
    /// The node.
    pub node: NodeId,
    /// The port (the RDMA CM service).
    pub port: u16,
}

/// The device reader of a [`SimTransport`] (the node has one device).
#[derive(Debug)]
pub struct SimDeviceReader {
    node: NodeId,
}

/// A connection's buffers on the simulation: the sizes only (payloads travel with the
/// simulated packets).
#[derive(Debug)]
pub struct SimBuffers {
    caps: QueueCaps,
}

#[derive(Debug, Default)]
struct Queues {
    token: u64,
    posted: VecDeque<u64>,
    /// Payloads that arrived with no receive posted (the real QP would RNR-retry them).
    unposted: VecDeque<(Vec<u8>, u32)>,
    landed: HashMap<u64, Vec<u8>>,
    recv: VecDeque<WorkCompletion>,
    send: VecDeque<WorkCompletion>,
}

/// The simulated fabric seen from one node, as a [`Transport`].
pub struct SimTransport {
    node: SimNode,
    channel: SimChannel,
    device: SimDevice,
    queues: HashMap<QpNum, Queues>,
    tokens: VecDeque<u64>,
    on_step: Option<Box<dyn FnMut()>>,
}

impl fmt::Debug for SimTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimTransport")
            .field("node", &self.node.id())
            .finish_non_exhaustive()
    }
}

impl SimTransport {
    /// A transport on `node`, with a channel of its own.
    pub fn new(node: &SimNode) -> Self {
        Self::on_side(SimSide::new(node.clone()))
    }

    /// A transport on one side of a [`super::SimPair`] (its node, channel and device).
    pub fn on_side(side: SimSide) -> Self {
        SimTransport {
            node: side.node,
            channel: side.channel,
            device: side.device,
            queues: HashMap::new(),
            tokens: VecDeque::new(),
            on_step: None,
        }
    }

    /// The node.
    pub fn node(&self) -> &SimNode {
        &self.node
    }

    /// The address of `port` on this node.
    pub fn addr(&self, port: u16) -> SimAddr {
        SimAddr {
            node: self.node.id(),
            port,
        }
    }

    /// Runs `hook` before every step of virtual time a wait takes: the place to drive
    /// the other side of a test (another endpoint's non-blocking poll) while this one
    /// blocks.
    pub fn on_step(&mut self, hook: impl FnMut() + 'static) {
        self.on_step = Some(Box::new(hook));
    }

    /// Whether the channel, or the device when the caller reads it (`reading`), has
    /// something: a device whose reader was given back (or never opened) is not waited
    /// on, as `poll(2)` would not watch its descriptors.
    fn ready(&self, reading: bool) -> bool {
        self.channel.queued() > 0
            || (reading && (!self.tokens.is_empty() || self.device.has_pending()))
    }

    fn queues(&mut self, id: &SimCmId, op: &'static str) -> Result<&mut Queues, CmError> {
        let qp = cm_core::CmId::qp_num(id).ok_or(CmError::InvalidArgument {
            op,
            reason: "the id has no QP",
        })?;
        self.queues.get_mut(&qp).ok_or(CmError::InvalidArgument {
            op,
            reason: "the QP was not created by this transport",
        })
    }

    /// Moves every receive completion of the node into its QP's queue.
    fn collect_completions(&mut self) {
        let mut payload = Vec::new();
        while let Some(completion) = self.device.poll_cq_data(&mut payload) {
            let data = std::mem::take(&mut payload);
            let Some(queues) = self.queues.get_mut(&completion.qp) else {
                continue;
            };
            queues.unposted.push_back((data, completion.byte_len));
            let token = queues.token;
            if Self::land(queues, completion.qp) {
                self.tokens.push_back(token);
            }
        }
    }

    /// Lands waiting payloads in posted receives; whether any landed.
    fn land(queues: &mut Queues, qp: QpNum) -> bool {
        let mut landed = false;
        while !queues.unposted.is_empty() && !queues.posted.is_empty() {
            let (Some((data, byte_len)), Some(wr_id)) =
                (queues.unposted.pop_front(), queues.posted.pop_front())
            else {
                break;
            };
            queues.landed.insert(wr_id, data);
            queues.recv.push_back(WorkCompletion {
                wr_id,
                qp,
                kind: CqKind::Recv,
                status: cm_core::WcStatus::Success,
                byte_len,
            });
            landed = true;
        }
        landed
    }
}

impl Transport for SimTransport {
    type Addr = SimAddr;
    type Id = SimCmId;
    type Event = SimCmEvent;
    type Device = SimDeviceReader;
    type DeviceKey = NodeId;
    type Buffers = SimBuffers;

    fn create_id(&mut self) -> Result<SimCmId, CmError> {
        Ok(self.channel.create_id())
    }

    fn id_key(&self, id: &SimCmId) -> usize {
        let key = id.key();
        (key.generation as usize) << 32 | key.index as usize
    }

    fn next_cm_event(&mut self) -> Result<Option<SimCmEvent>, CmError> {
        self.channel.try_next_event()
    }

    fn event_id(&self, event: &SimCmEvent) -> Option<SimCmId> {
        Some(event.id())
    }

    fn event_listener(&self, event: &SimCmEvent) -> Option<SimCmId> {
        event.listen_id()
    }

    fn bind(&mut self, id: &SimCmId, addr: SimAddr) -> Result<(), CmError> {
        if addr.node != self.node.id() {
            return Err(CmError::Os {
                op: "rdma_bind_addr",
                errno: cm_core::Errno(99 /* EADDRNOTAVAIL */),
            });
        }
        id.bind(addr.port)
    }

    fn listen(&mut self, id: &SimCmId, _backlog: u16) -> Result<(), CmError> {
        id.listen()
    }

    fn resolve_addr(
        &mut self,
        id: &SimCmId,
        _src: Option<SimAddr>,
        dst: SimAddr,
        _timeout: Duration,
    ) -> Result<(), CmError> {
        id.resolve_addr(dst.node, dst.port)
    }

    fn resolve_route(&mut self, id: &SimCmId, _timeout: Duration) -> Result<(), CmError> {
        id.resolve_route()
    }

    fn connect(&mut self, id: &SimCmId, private_data: &[u8]) -> Result<(), CmError> {
        id.connect(private_data).map(drop)
    }

    fn accept(&mut self, id: &SimCmId, private_data: &[u8]) -> Result<(), CmError> {
        id.accept(private_data)
    }

    fn reject(&mut self, id: &SimCmId, private_data: &[u8]) -> Result<(), CmError> {
        id.reject(private_data)
    }

    fn disconnect(&mut self, id: &SimCmId) -> Result<(), CmError> {
        id.disconnect()
    }

    fn local_addr(&self, id: &SimCmId) -> Option<SimAddr> {
        id.node().map(|node| SimAddr { node, port: 0 })
    }

    fn peer_addr(&self, _id: &SimCmId) -> Option<SimAddr> {
        None
    }

    fn device_key(&self, id: &SimCmId) -> Option<NodeId> {
        id.node()
    }

    fn open_device(&mut self, id: &SimCmId) -> Result<SimDeviceReader, CmError> {
        let node = id.node().ok_or(CmError::Gone {
            op: "open_device",
            what: "id",
        })?;
        Ok(SimDeviceReader { node })
    }

    fn next_async_event(
        &mut self,
        _device: &mut SimDeviceReader,
    ) -> Result<Option<AsyncEvent>, CmError> {
        self.device.try_next_async_event()
    }

    fn next_cq_event(&mut self, _device: &mut SimDeviceReader) -> Result<Option<u64>, CmError> {
        self.collect_completions();
        Ok(self.tokens.pop_front())
    }

    fn create_qp(
        &mut self,
        id: &SimCmId,
        device: &SimDeviceReader,
        token: u64,
        caps: &QueueCaps,
    ) -> Result<QpNum, CmError> {
        caps.validate()?;
        if id.node() != Some(device.node) {
            return Err(CmError::InvalidArgument {
                op: "create_qp",
                reason: "the device reader belongs to another node",
            });
        }
        let qp = id.create_qp()?;
        self.queues.insert(
            qp,
            Queues {
                token,
                ..Queues::default()
            },
        );
        Ok(qp)
    }

    fn register_buffers(&mut self, _id: &SimCmId, caps: &QueueCaps) -> Result<SimBuffers, CmError> {
        caps.validate()?;
        Ok(SimBuffers { caps: *caps })
    }

    fn post_recv(
        &mut self,
        id: &SimCmId,
        buffers: &SimBuffers,
        slot: u32,
        wr_id: u64,
    ) -> Result<(), CmError> {
        if slot >= buffers.caps.recv_depth {
            return Err(CmError::InvalidArgument {
                op: "ibv_post_recv",
                reason: "no such receive buffer",
            });
        }
        let qp = cm_core::CmId::qp_num(id);
        let queues = self.queues(id, "ibv_post_recv")?;
        queues.posted.push_back(wr_id);
        let token = queues.token;
        if let Some(qp) = qp {
            if Self::land(queues, qp) {
                self.tokens.push_back(token);
            }
        }
        Ok(())
    }

    fn post_send(
        &mut self,
        id: &SimCmId,
        buffers: &SimBuffers,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError> {
        if slot >= buffers.caps.send_depth || data.len() > buffers.caps.buffer_size as usize {
            return Err(CmError::InvalidArgument {
                op: "ibv_post_send",
                reason: "no such send buffer, or the message does not fit it",
            });
        }
        id.post_send_data(data)?;
        let qp = cm_core::CmId::qp_num(id).unwrap_or(QpNum(0));
        let queues = self.queues(id, "ibv_post_send")?;
        queues.send.push_back(WorkCompletion {
            wr_id,
            qp,
            kind: CqKind::Send,
            status: cm_core::WcStatus::Success,
            byte_len: 0,
        });
        let token = queues.token;
        self.tokens.push_back(token);
        Ok(())
    }

    fn read_recv(
        &mut self,
        id: &SimCmId,
        _buffers: &SimBuffers,
        slot: u32,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CmError> {
        let queues = self.queues(id, "read_recv")?;
        let data = queues.landed.remove(&u64::from(slot)).unwrap_or_default();
        out.extend_from_slice(&data[..len.min(data.len())]);
        // A length-only send carries no bytes: the receiver sees zeroes, as in a fresh
        // buffer.
        out.resize(len, 0);
        Ok(())
    }

    fn arm_cq(&mut self, id: &SimCmId, _kind: CqKind) -> Result<(), CmError> {
        self.queues(id, "ibv_req_notify_cq").map(drop)
    }

    fn poll_cq(
        &mut self,
        id: &SimCmId,
        kind: CqKind,
        out: &mut Vec<WorkCompletion>,
        max: usize,
    ) -> Result<usize, CmError> {
        let queues = self.queues(id, "ibv_poll_cq")?;
        let queue = match kind {
            CqKind::Recv => &mut queues.recv,
            CqKind::Send => &mut queues.send,
        };
        let n = max.min(queue.len());
        out.extend(queue.drain(..n));
        Ok(n)
    }

    fn now(&self) -> Duration {
        self.node.fabric().now()
    }

    fn wait(
        &mut self,
        devices: &[SimDeviceReader],
        timeout: Option<Duration>,
    ) -> Result<bool, CmError> {
        let reading = !devices.is_empty();
        let fabric = self.node.fabric().clone();
        let deadline = timeout.map(|t| fabric.now().saturating_add(t));
        loop {
            if self.ready(reading) {
                return Ok(true);
            }
            if let Some(hook) = self.on_step.as_mut() {
                hook();
                if self.ready(reading) {
                    return Ok(true);
                }
            }
            match (fabric.next_due(), deadline) {
                (Some(due), Some(deadline)) if due > deadline => {
                    fabric.advance(deadline.saturating_sub(fabric.now()));
                    return Ok(false);
                }
                (Some(_), _) => {
                    fabric.step();
                }
                (None, Some(deadline)) => {
                    fabric.advance(deadline.saturating_sub(fabric.now()));
                    return Ok(false);
                }
                (None, None) => {
                    return Err(CmError::Busy {
                        op: "wait",
                        reason: "the simulated fabric is idle: nothing can ever happen",
                    })
                }
            }
        }
    }
}
