//! The hand-written server: the cm-sys calls an application would make itself, with no
//! cm-verbs on the path. Two ways of seeing the receive completion:
//!
//! - spinning on the receive CQ ([`HandServer::trigger_to_established`]), then
//!   `rdma_notify` and `poll(2)` until ESTABLISHED: the baseline of the pump;
//! - blocking in `poll(2)` on the CM channel, the device's asynchronous events and a
//!   completion channel shared by the server's CQs ([`HandServer::send_to_established`]),
//!   as the connection API waits: the baseline of the `Endpoint` server.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::Instant;

use cm_core::{AsyncEventType, CmEventType, NotifyOutcome};
use cm_sys::{
    AsyncEvents, CmEvent, CmId, Completion, CompletionChannel, CqKind, EventChannel, MemoryRegion,
};

use super::fixture::{
    accept, err, expect_event, listener, nonblocking_events, spin_receive, Setup, WAIT,
};
use super::Phases;

/// The server of the hand-written loop: reads its own channel, accepts, sees the
/// receive completion, calls notify and waits until ESTABLISHED. Like the pump's event
/// loop it checks the device's asynchronous events (forwarding a COMM_EST itself) before
/// each read of the channel, so both loops watch the same sources.
pub(super) struct HandServer {
    pub(super) channel: EventChannel,
    device: AsyncEvents,
    /// The completion channel of the waiting flavour's CQs (on the listener's device).
    completions: CompletionChannel,
    /// Completions polled by the waiting flavour, reused.
    polled: Vec<Completion>,
    _listener: CmId,
    pub(super) addr: SocketAddr,
}

/// The token of the waiting flavour's CQs on the completion channel.
const TOKEN: u64 = 1;

impl HandServer {
    /// A hand-loop server listening on the setup's A address.
    pub(super) fn new(setup: &Setup) -> Result<HandServer, String> {
        let channel = EventChannel::new().map_err(err("rdma_create_event_channel"))?;
        // Non-blocking, as the endpoint's: a look at it is then one read, no poll first.
        channel.set_nonblocking(true).map_err(err("O_NONBLOCK"))?;
        let (listener_id, addr) = listener(setup, &channel)?;
        Ok(HandServer {
            channel,
            device: nonblocking_events(&listener_id)?,
            completions: CompletionChannel::new(&listener_id)
                .map_err(err("ibv_create_comp_channel"))?,
            polled: Vec::with_capacity(4),
            _listener: listener_id,
            addr,
        })
    }

    /// Spins (never blocks, as the event loop of the pump server spins) until the next
    /// CM event, which must be `kind`; the device's asynchronous events are read first.
    fn spin_event(&self, kind: CmEventType) -> Result<CmEvent, String> {
        let deadline = Instant::now() + WAIT;
        loop {
            while self
                .device
                .try_next_event()
                .map_err(err("ibv_get_async_event"))?
                .is_some()
            {}
            if let Some(event) = self
                .channel
                .try_next_event()
                .map_err(err("rdma_get_cm_event"))?
            {
                if event.event_type() != kind {
                    return Err(format!("{} while waiting for {kind}", event.event_type()));
                }
                return Ok(event);
            }
            if Instant::now() > deadline {
                return Err(format!("no {kind}"));
            }
        }
    }

    /// Accepts the next request; `waiting`: its CQs on the completion channel (for
    /// [`HandServer::send_to_established`]), else polled only.
    pub(super) fn accept_one(&self, waiting: bool) -> Result<(CmId, MemoryRegion), String> {
        let request = self.spin_event(CmEventType::ConnectRequest)?;
        let id = request.id().ok_or("a request carries its id")?.clone();
        request.ack().map_err(err("ack"))?;
        let memory = accept(&id, waiting.then_some((&self.completions, TOKEN)))?;
        Ok((id, memory))
    }

    /// Receive completion to ESTABLISHED read by the application: spins on the receive
    /// CQ, notifies, then blocks in `poll(2)` on the channel and the device's
    /// asynchronous events (as a server waits), forwarding a COMM_EST of this QP if one
    /// comes first. Returns when the completion was seen and when ESTABLISHED was read.
    pub(super) fn trigger_to_established(&self, id: &CmId) -> Result<(Instant, Instant), String> {
        let trigger = spin_receive(id)?;
        match id.notify(AsyncEventType::CommEst) {
            Ok(NotifyOutcome::Established) => {}
            other => return Err(format!("notify with the RTU dropped answered {other:?}")),
        }
        let deadline = trigger + WAIT;
        let qp = id.qp_num();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ready =
                cm_sys::poll_readable(&[self.channel.as_fd(), self.device.as_fd()], Some(left))
                    .map_err(err("poll"))?;
            if ready.is_empty() {
                return Err("no ESTABLISHED after notify".into());
            }
            // Only what poll says is readable, as the event loop does.
            if ready.is_ready(1) {
                self.forward_comm_est(id, qp)?;
            }
            if !ready.is_ready(0) {
                continue;
            }
            if let Some(established) = self.established()? {
                return Ok((trigger, established));
            }
        }
    }

    /// The client's send to ESTABLISHED read by the application, waiting as the
    /// connection API waits: `poll(2)` on the CM channel, the device's asynchronous
    /// events and the completion channel; on a completion event the CQs are re-armed
    /// and polled (both: the event does not say which), and the first receive is
    /// forwarded with notify, then (as the endpoint does, and any server must) the
    /// message is copied out and the receive posted again. Only what poll says is
    /// readable is read. `id` and `memory` must come from [`HandServer::accept_one`]
    /// with `waiting`. Returns the send to the notify's return and the send to
    /// ESTABLISHED read.
    pub(super) fn send_to_established(
        &mut self,
        id: &CmId,
        memory: &MemoryRegion,
        sent: Instant,
    ) -> Result<Phases, String> {
        let deadline = sent + WAIT;
        let qp = id.qp_num();
        let mut notified = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ready = cm_sys::poll_readable(
                &[
                    self.channel.as_fd(),
                    self.device.as_fd(),
                    self.completions.as_fd(),
                ],
                Some(left),
            )
            .map_err(err("poll"))?;
            if ready.is_empty() {
                return Err(format!("no ESTABLISHED (notified: {})", notified.is_some()));
            }
            if ready.is_ready(1) {
                self.forward_comm_est(id, qp)?;
            }
            if ready.is_ready(2) {
                while self
                    .completions
                    .try_next()
                    .map_err(err("ibv_get_cq_event"))?
                    .is_some()
                {
                    for kind in [CqKind::Recv, CqKind::Send] {
                        id.arm_cq(kind).map_err(err("ibv_req_notify_cq"))?;
                    }
                    for kind in [CqKind::Recv, CqKind::Send] {
                        self.polled.clear();
                        id.poll_cq(kind, &mut self.polled, 4)
                            .map_err(err("ibv_poll_cq"))?;
                        if let Some(completion) = self.polled.iter().find(|c| !c.is_success()) {
                            return Err(format!("completion failed: {}", completion.status_str()));
                        }
                        if kind != CqKind::Recv {
                            continue;
                        }
                        for completion in &self.polled {
                            if notified.is_none() {
                                match id.notify(AsyncEventType::CommEst) {
                                    Ok(NotifyOutcome::Established) => {}
                                    other => {
                                        return Err(format!(
                                            "notify with the RTU dropped answered {other:?}"
                                        ))
                                    }
                                }
                                notified = Some(sent.elapsed());
                            }
                            let message = id
                                .read_memory(memory, 0..completion.byte_len as usize)
                                .map_err(err("read"))?;
                            std::hint::black_box(message);
                            id.post_recv(memory, 0..16, completion.wr_id)
                                .map_err(err("ibv_post_recv"))?;
                        }
                    }
                }
            }
            if !ready.is_ready(0) {
                continue;
            }
            if self.established()?.is_some() {
                let established = sent.elapsed();
                let Some(notified) = notified else {
                    return Err("ESTABLISHED before the receive completion".into());
                };
                return Ok(Phases {
                    notified,
                    established,
                });
            }
        }
    }

    /// Reads the device's asynchronous events, forwarding a COMM_EST of `qp` itself.
    fn forward_comm_est(&self, id: &CmId, qp: Option<cm_core::QpNum>) -> Result<(), String> {
        while let Some(event) = self
            .device
            .try_next_event()
            .map_err(err("ibv_get_async_event"))?
        {
            if event.event_type == AsyncEventType::CommEst && event.qp_num() == qp {
                let _ = id.notify(AsyncEventType::CommEst);
            }
        }
        Ok(())
    }

    /// One read of the channel: when ESTABLISHED was read and acknowledged, `None` when
    /// nothing was there; any other event is an error.
    fn established(&self) -> Result<Option<Instant>, String> {
        let Some(event) = self
            .channel
            .try_next_event()
            .map_err(err("rdma_get_cm_event"))?
        else {
            return Ok(None);
        };
        let kind = event.event_type();
        event.ack().map_err(err("ack"))?;
        let seen = Instant::now();
        if kind == CmEventType::Established {
            return Ok(Some(seen));
        }
        Err(format!("{kind} before ESTABLISHED"))
    }

    /// Reads the DISCONNECTED of `id` and disconnects it.
    pub(super) fn answer_disconnect(&self, id: &CmId) -> Result<(), String> {
        self.spin_event(CmEventType::Disconnected)?
            .ack()
            .map_err(err("ack"))?;
        id.disconnect().map_err(err("rdma_disconnect"))
    }

    /// Waits for the ESTABLISHED of an accepted connection whose RTU arrives.
    pub(super) fn expect_established(&self) -> Result<(), String> {
        expect_event(&self.channel, CmEventType::Established)?
            .ack()
            .map_err(err("ack"))
    }
}
