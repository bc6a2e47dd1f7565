//! The server on cm-verbs' pump: the event loop (pump first, then CM events), spun while
//! setting up, waiting in its [`PollWaiter`] after the trigger as the hand loop waits.

use std::net::SocketAddr;
use std::time::Instant;

use cm_core::CmEventType;
use cm_sys::{CmEvent, CmId, EventChannel, MemoryRegion, RdmaBackend};
use cm_verbs::{
    rdma::{PollWaiter, Shutdown},
    BackendLoop, Control, EventLoop, LoopEvent, NotifyPump, PumpEvent, Ready, Role, Waiter,
};

use super::fixture::{accept, err, listener, nonblocking_events, spin_receive, Setup, WAIT};

type PumpLoop = BackendLoop<RdmaBackend>;

/// The server on cm-verbs: the event loop (pump first, then CM events), spun while
/// setting up, waiting in its [`PollWaiter`] after the trigger as the hand loop waits.
pub(super) struct PumpServer {
    event_loop: PumpLoop,
    waiter: PollWaiter,
    /// Kept open: the waiter would read a dropped handle's end as a shutdown request.
    _shutdown: Shutdown,
    _listener: CmId,
    pub(super) addr: SocketAddr,
}

const ALL: Ready = Ready {
    cm_events: true,
    async_events: true,
    shutdown: false,
};

impl PumpServer {
    /// A pump server listening on the setup's A address.
    pub(super) fn new(setup: &Setup) -> Result<PumpServer, String> {
        let pump_channel = EventChannel::new().map_err(err("rdma_create_event_channel"))?;
        // Non-blocking, as the hand loop's and the endpoint's.
        pump_channel
            .set_nonblocking(true)
            .map_err(err("O_NONBLOCK"))?;
        let (pump_listener, pump_addr) = listener(setup, &pump_channel)?;
        let device = nonblocking_events(&pump_listener)?;
        let (mut waiter, shutdown) = PollWaiter::new(&pump_channel).map_err(err("waiter"))?;
        waiter.watch_async_events(&device).map_err(err("waiter"))?;
        // Bounds each wait, so that a lost ESTABLISHED ends the measurement instead of
        // hanging.
        waiter.set_tick(Some(WAIT));
        Ok(PumpServer {
            event_loop: EventLoop::new(pump_channel, device, NotifyPump::new()),
            waiter,
            _shutdown: shutdown,
            _listener: pump_listener,
            addr: pump_addr,
        })
    }

    /// One pass of the loop over the sources `ready` names (the pump sees every event
    /// first); the first CM event, unacknowledged, if there was one.
    fn next_cm_event(&mut self, ready: Ready) -> Result<Option<CmEvent>, String> {
        let mut seen = None;
        self.event_loop
            .poll_once(ready, &mut |_pump, event| match event {
                LoopEvent::Cm(event) => {
                    seen = Some(event);
                    Control::Stop
                }
                LoopEvent::Pump(_) => Control::Continue,
            })
            .map_err(err("event loop"))?;
        Ok(seen)
    }

    /// Spins the loop until a CM event of `kind` comes; returns its id.
    fn until(&mut self, kind: CmEventType) -> Result<CmId, String> {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(event) = self.next_cm_event(ALL)? {
                let (event_type, id) = (event.event_type(), event.id().cloned());
                let _ = event.ack();
                if event_type != kind {
                    return Err(format!("{event_type} while waiting for {kind}"));
                }
                if let Some(id) = id {
                    return Ok(id);
                }
            }
            if Instant::now() > deadline {
                return Err(format!("no {kind}"));
            }
        }
    }

    /// Accepts the next request and registers it with the pump.
    pub(super) fn accept_one(&mut self) -> Result<(CmId, MemoryRegion), String> {
        let id = self.until(CmEventType::ConnectRequest)?;
        let memory = accept(&id, None)?;
        self.event_loop
            .pump()
            .register(id.clone(), Role::Passive)
            .map_err(|e| e.to_string())?;
        Ok((id, memory))
    }

    /// Spins on the receive CQ, hands the completion to the pump, then waits until the
    /// loop reads ESTABLISHED. Returns when the completion was seen and when
    /// ESTABLISHED was read.
    pub(super) fn trigger_to_established(
        &mut self,
        id: &CmId,
    ) -> Result<(Instant, Instant), String> {
        let trigger = spin_receive(id)?;
        let qp = id.qp_num().ok_or("accepted id without QP")?;
        match self.event_loop.pump().on_receive_completion(qp) {
            Some(PumpEvent::Forced { .. }) => {}
            other => return Err(format!("the pump answered {other:?}")),
        }
        let deadline = trigger + WAIT;
        loop {
            let ready = self.waiter.wait().map_err(err("poll"))?;
            if ready == Ready::default() && Instant::now() > deadline {
                return Err("no ESTABLISHED after notify".into());
            }
            if let Some(event) = self.next_cm_event(ready)? {
                let kind = event.event_type();
                let _ = event.ack();
                if kind != CmEventType::Established {
                    return Err(format!("{kind} before ESTABLISHED"));
                }
                break;
            }
        }
        Ok((trigger, Instant::now()))
    }

    /// Reads the DISCONNECTED of `id` and disconnects it.
    pub(super) fn answer_disconnect(&mut self, id: &CmId) -> Result<(), String> {
        self.until(CmEventType::Disconnected)?;
        id.disconnect().map_err(err("rdma_disconnect"))
    }
}
