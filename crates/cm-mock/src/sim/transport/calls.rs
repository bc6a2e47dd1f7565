//! [`Transport`] for [`SimTransport`]: each call of the connection API answered on the
//! fabric (the CM calls through the node's channel and ids, the data path through the
//! transport's own queues, the wait by running virtual time).

use std::num::NonZeroU16;
use std::time::Duration;

use cm_core::{
    AsyncEvent, AsyncEventSource, CmError, CmEventSource, ConnectionParams, CqKind, IdOption,
    QpNum, QueueCaps, SharedCaps, Transport, WorkCompletion,
};

use super::queues::Queues;
use super::{SimAddr, SimBuffers, SimDeviceReader, SimShared, SimTransport};
use crate::sim::{NodeId, SimCmEvent, SimCmId};

impl Transport for SimTransport {
    type Addr = SimAddr;
    type Id = SimCmId;
    type Event = SimCmEvent;
    type Device = SimDeviceReader;
    type DeviceKey = NodeId;
    type Buffers = SimBuffers;
    type Shared = SimShared;

    fn create_id(&mut self) -> Result<SimCmId, CmError> {
        Ok(self.channel.create_id())
    }

    fn create_id_in(&mut self, space: cm_core::PortSpace) -> Result<SimCmId, CmError> {
        Ok(self.channel.create_id_in(space))
    }

    /// The simulated wire has no RNR NAK: a QP's timer changes nothing there, so it is
    /// taken (checked as the device would, for a QP that exists) and not kept.
    fn set_min_rnr_timer(&mut self, id: &SimCmId, timer: u8) -> Result<(), CmError> {
        if timer > cm_core::ConnectionParams::MAX_MIN_RNR_TIMER {
            return Err(CmError::InvalidArgument {
                op: "ibv_modify_qp",
                reason: "min_rnr_timer above 31",
            });
        }
        match cm_core::CmId::qp_num(id) {
            Some(_) => Ok(()),
            None => Err(CmError::InvalidArgument {
                op: "ibv_modify_qp",
                reason: "the id has no QP yet",
            }),
        }
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

    fn set_id_context(&mut self, id: &SimCmId, context: u32) -> bool {
        id.set_context(context)
    }

    fn event_context(&self, event: &SimCmEvent) -> Option<u32> {
        event.context()
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

    fn listen(&mut self, id: &SimCmId, backlog: u16) -> Result<(), CmError> {
        id.listen_with_backlog(u32::from(backlog))
    }

    fn set_option(&mut self, id: &SimCmId, option: IdOption) -> Result<(), CmError> {
        id.set_option(option)
    }

    /// Destroys the id on the fabric, as the real backend's last handle does: a
    /// listener's port is free again, and requests to it are refused.
    fn release_id(&mut self, id: SimCmId) {
        // Refused only while an event of the id is unacknowledged (none is, for a
        // listener: its requests' events name the new ids): the id then stays.
        let _ = id.destroy();
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

    fn connect(
        &mut self,
        id: &SimCmId,
        private_data: &[u8],
        params: &ConnectionParams,
    ) -> Result<(), CmError> {
        id.connect_with(private_data, params).map(drop)
    }

    fn accept(
        &mut self,
        id: &SimCmId,
        private_data: &[u8],
        params: &ConnectionParams,
    ) -> Result<(), CmError> {
        id.accept_with(private_data, params)
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
        self.take_one_sided();
        let mark = self.device.arrivals();
        if mark != self.collected_at {
            self.collect_completions(|_| ());
            self.collected_at = mark;
        }
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
        // Checked by `validate`: 1 to 16384.
        let recv_depth = u16::try_from(caps.recv_depth)
            .ok()
            .and_then(NonZeroU16::new)
            .ok_or(CmError::InvalidArgument {
                op: "create_qp",
                reason: "receive depth out of range",
            })?;
        let (qp, ids_destroyed) = id.with(|f| {
            if f.id_node(id.key) != Some(device.node) {
                return Err(CmError::InvalidArgument {
                    op: "create_qp",
                    reason: "the device reader belongs to another node",
                });
            }
            Ok((f.create_qp(id.key)?, f.ids_destroyed()))
        })?;
        if id.fabric.same(self.node.fabric()) {
            // The receives are posted next.
            self.hint(id, Some(qp), ids_destroyed);
        }
        self.free_destroyed();
        let slot = self.queues.put(Queues::new(token, recv_depth));
        self.by_qp.set(qp, slot);
        // The QP's setup time passes (arrivals meanwhile handled), the lock free.
        id.fabric.charge_setup(crate::sim::Setup::CreateQp);
        Ok(qp)
    }

    fn register_buffers(&mut self, _id: &SimCmId, caps: &QueueCaps) -> Result<SimBuffers, CmError> {
        caps.validate()?;
        let out_of_range = || CmError::InvalidArgument {
            op: "register_buffers",
            reason: "queue depth out of range",
        };
        let buffers = SimBuffers {
            fabric: self.node.fabric().clone(),
            recv_depth: u16::try_from(caps.recv_depth)
                .ok()
                .and_then(NonZeroU16::new)
                .ok_or_else(out_of_range)?,
            send_depth: u16::try_from(caps.send_depth).map_err(|_| out_of_range())?,
            buffer_size: caps.buffer_size,
        };
        buffers.fabric.inner.registered.add_buffers(buffers.bytes());
        // The registration's setup time passes (arrivals meanwhile handled).
        self.node.fabric().charge_setup(crate::sim::Setup::Register);
        Ok(buffers)
    }

    fn post_recv(
        &mut self,
        id: &SimCmId,
        buffers: &SimBuffers,
        slot: u32,
        wr_id: u64,
    ) -> Result<(), CmError> {
        if slot >= u32::from(buffers.recv_depth.get()) {
            return Err(CmError::InvalidArgument {
                op: "ibv_post_recv",
                reason: "no such receive buffer",
            });
        }
        let (qp, queues, pool) = self.queues(id, "ibv_post_recv")?;
        queues.post(wr_id, pool);
        let token = queues.token;
        if Self::land(queues, qp) {
            self.tokens.push_back(token);
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
        if slot >= u32::from(buffers.send_depth) || data.len() > buffers.buffer_size as usize {
            return Err(CmError::InvalidArgument {
                op: "ibv_post_send",
                reason: "no such send buffer, or the message does not fit it",
            });
        }
        // After the one-sided work posted before it; on a QP a refused piece put in the
        // error state, it flushes and carries nothing.
        self.take_one_sided();
        if self.one_sided.any_errored() {
            let qp = self.qp_of(id);
            if let Some(qp) = qp.filter(|&qp| self.one_sided.errored(qp)) {
                return self.complete_send(Some(qp), wr_id, cm_core::WcStatus::WrFlushErr);
            }
        }
        let qp = id.with(|f| {
            f.post_send_data(id.key, data)?;
            Ok::<_, CmError>(f.id_qp(id.key))
        })?;
        self.complete_send(qp, wr_id, cm_core::WcStatus::Success)
    }

    fn read_recv(
        &mut self,
        id: &SimCmId,
        _buffers: &SimBuffers,
        slot: u32,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CmError> {
        let (_, queues, pool) = self.queues(id, "read_recv")?;
        let data = queues
            .busy
            .as_mut()
            .and_then(|busy| busy.landed.remove(&u64::from(slot)))
            .unwrap_or_default();
        queues.settle(pool);
        super::append_landed(out, data, len);
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
        // As on a device, a completion is in its queue once it landed, whether or not
        // the completion channel was read since (busy polling polls queues first). The
        // id's QP is read under the same lock when the id is of this fabric.
        self.take_one_sided();
        let qp = if id.fabric.same(&self.device.fabric) {
            self.collect_completions(|f| f.id_qp(id.key))
        } else {
            self.collect_completions(|_| ());
            cm_core::CmId::qp_num(id)
        };
        let (_, queues, pool) = self.queues_of(qp, "ibv_poll_cq")?;
        let Some(busy) = queues.busy.as_mut() else {
            return Ok(0);
        };
        let queue = match kind {
            CqKind::Recv => &mut busy.recv,
            CqKind::Send => &mut busy.send,
        };
        let n = max.min(queue.len());
        out.extend(queue.drain(..n));
        queues.settle(pool);
        Ok(n)
    }

    fn create_shared(
        &mut self,
        id: &SimCmId,
        device: &SimDeviceReader,
        token: u64,
        caps: &SharedCaps,
    ) -> Result<SimShared, CmError> {
        self.shared_create(id, device, token, caps)
    }

    fn create_qp_shared(
        &mut self,
        id: &SimCmId,
        shared: &SimShared,
        caps: &QueueCaps,
    ) -> Result<QpNum, CmError> {
        self.shared_create_qp(id, shared, caps)
    }

    fn post_shared_recv(
        &mut self,
        shared: &SimShared,
        slot: u32,
        wr_id: u64,
    ) -> Result<(), CmError> {
        self.shared_post_recv(shared, slot, wr_id)
    }

    fn post_shared_send(
        &mut self,
        id: &SimCmId,
        shared: &SimShared,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError> {
        self.shared_post_send(id, shared, slot, data, wr_id)
    }

    fn read_shared_recv(
        &mut self,
        shared: &SimShared,
        slot: u32,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CmError> {
        self.shared_read_recv(shared, slot, len, out)
    }

    fn arm_shared_cq(&mut self, shared: &SimShared, kind: CqKind) -> Result<(), CmError> {
        self.shared_arm_cq(shared, kind)
    }

    fn poll_shared_cq(
        &mut self,
        shared: &SimShared,
        kind: CqKind,
        out: &mut Vec<WorkCompletion>,
        max: usize,
    ) -> Result<usize, CmError> {
        self.shared_poll_cq(shared, kind, out, max)
    }

    fn arm_shared_limit(&mut self, shared: &SimShared, limit: u32) -> Result<(), CmError> {
        self.shared_arm_limit(shared, limit)
    }

    fn release_shared(&mut self, _device: &SimDeviceReader, shared: SimShared) {
        self.shared_release(shared);
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
        let fabric = self.node.fabric();
        // In the fabric's nanoseconds (saturating, as `SimFabric::advance` counts).
        let deadline = timeout.map(|t| {
            let t = u64::try_from(t.as_nanos()).unwrap_or(u64::MAX);
            fabric.lock().now_nanos().saturating_add(t)
        });
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
            // The next action, or the deadline: one lock.
            let mut locked = fabric.lock();
            match (locked.next_due(), deadline) {
                (Some(due), Some(deadline)) if due > deadline => {
                    locked.set_now(deadline);
                    return Ok(false);
                }
                (Some(_), _) => {
                    let before = locked.arrivals.activity();
                    locked.step();
                    // Another party, read by a driver of its own (no hook here reads
                    // it), may have got something: it reads before time moves any
                    // further, as on a real fabric it would act meanwhile.
                    if self.on_step.is_none() && locked.arrivals.activity() != before {
                        drop(locked);
                        return Ok(self.ready(reading));
                    }
                }
                (None, Some(deadline)) => {
                    locked.set_now(deadline);
                    return Ok(false);
                }
                // Nothing scheduled, but another party, read by a driver of its own,
                // has something to act on (an event that makes it connect, send…):
                // not idle yet.
                (None, None) if self.on_step.is_none() && locked.anything_unread() => {
                    drop(locked);
                    return Ok(self.ready(reading));
                }
                (None, None) => return Err(CmError::Idle { op: "wait" }),
            }
        }
    }

    fn wait_step(
        &mut self,
        devices: &[SimDeviceReader],
        _timeout: Option<Duration>,
    ) -> Result<bool, CmError> {
        if self.ready(!devices.is_empty()) {
            return Ok(true);
        }
        // Only what is due now runs: a step never moves the clock. Time moves on in
        // `wait`, once every party had its turns with nothing happening anywhere
        // ([`Transport::activity`]); a step that jumped to the next timer (a CM retry
        // seconds away) would run it while another side still had an event to read
        // (a REP whose RTU its reader sends), and that side would act seconds late.
        let fabric = self.node.fabric();
        let mut locked = fabric.lock();
        match locked.next_due() {
            Some(due) if due <= locked.now_nanos() => {
                locked.step();
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn activity(&self) -> u64 {
        self.node.fabric().activity()
    }
}
