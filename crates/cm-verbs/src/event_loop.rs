//! The event loop: waits on the CM event channel and the device's asynchronous events,
//! runs the pump, and hands CM events to the application in order.
//!
//! The waiting itself is behind [`Waiter`] so that this logic is the same over file
//! descriptors (`poll(2)` on the real backend, see the `rdma` feature) and over a
//! simulated fabric that is stepped instead of waited on.
//!
//! Who it is for: code that owns its loop and one device (a single CM channel, one
//! device's asynchronous events, no connection state of its own), wanting the pump
//! and nothing else. A server should use [`Endpoint`](crate::Endpoint), which also owns
//! the queues, the completion channel, the deadlines and bounded, O(1) reporting; in
//! this project the loop's one user is the real-device bench's pump path, which
//! measures the pump's own cost against a hand-written loop.

use cm_core::{AsyncEventSource, CmBackend, CmError, CmEvent, CmEventSource, CmId};

use crate::{NotifyPump, PumpEvent};

/// Which sources a [`Waiter`] found ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Ready {
    /// The CM event channel may have events.
    pub cm_events: bool,
    /// The device may have asynchronous events.
    pub async_events: bool,
    /// Shutdown was requested: the loop returns.
    pub shutdown: bool,
}

/// Blocks until a source may be readable or shutdown is requested. Spurious wake-ups
/// are fine: the loop reads non-blockingly.
pub trait Waiter {
    /// Waits; errors end the loop.
    fn wait(&mut self) -> Result<Ready, CmError>;
}

/// What the loop hands to the application.
#[derive(Debug)]
pub enum LoopEvent<E> {
    /// A CM event, in channel order. Ack it (or drop it) when done.
    Cm(E),
    /// What the pump did with an asynchronous event.
    Pump(PumpEvent),
}

/// What the application's handler tells the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Control {
    /// Keep going.
    Continue,
    /// Return from [`EventLoop::run`] now.
    Stop,
}

/// Why [`EventLoop::run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Exit {
    /// The handler returned [`Control::Stop`].
    Stopped,
    /// Shutdown was requested through the waiter.
    Shutdown,
}

/// The [`EventLoop`] of one backend: its event channel, its device's asynchronous
/// events and a pump of its ids, named by the backend's [`CmBackend`] marker
/// (`cm_verbs::sys::RdmaBackend`, `cm_mock::sim::SimBackend`, `cm_mock::MockBackend`) so that
/// the three parts cannot come from different backends.
pub type BackendLoop<B> =
    EventLoop<<B as CmBackend>::Events, <B as CmBackend>::AsyncEvents, <B as CmBackend>::Id>;

/// Runs the pump over one CM event channel and one device's asynchronous events.
pub struct EventLoop<C, A, I> {
    cm_events: C,
    async_events: A,
    pump: NotifyPump<I>,
}

impl<C, A, I> EventLoop<C, A, I>
where
    C: CmEventSource,
    A: AsyncEventSource,
    I: CmId,
{
    /// A loop over `cm_events` and `async_events`, driving `pump`.
    pub fn new(cm_events: C, async_events: A, pump: NotifyPump<I>) -> Self {
        EventLoop {
            cm_events,
            async_events,
            pump,
        }
    }

    /// The pump, to register connections and read counters.
    pub fn pump(&mut self) -> &mut NotifyPump<I> {
        &mut self.pump
    }

    /// Gives the parts back.
    pub fn into_parts(self) -> (C, A, NotifyPump<I>) {
        (self.cm_events, self.async_events, self.pump)
    }

    /// Handles everything pending now, without waiting: asynchronous events first (a
    /// COMM_EST forwarded now lets its ESTABLISHED arrive sooner), then CM events in
    /// order. The pump sees each CM event before the handler does.
    pub fn poll_once(
        &mut self,
        ready: Ready,
        handler: &mut impl FnMut(&mut NotifyPump<I>, LoopEvent<C::Event>) -> Control,
    ) -> Result<Control, CmError> {
        if ready.async_events {
            while let Some(event) = self.async_events.try_next_async_event()? {
                let pumped = self.pump.on_async_event(event);
                if handler(&mut self.pump, LoopEvent::Pump(pumped)) == Control::Stop {
                    return Ok(Control::Stop);
                }
            }
        }
        if ready.cm_events {
            while let Some(event) = self.cm_events.try_next_event()? {
                self.pump.on_cm_event(event.event_type(), event.qp_num());
                if handler(&mut self.pump, LoopEvent::Cm(event)) == Control::Stop {
                    return Ok(Control::Stop);
                }
            }
        }
        Ok(Control::Continue)
    }

    /// Waits and handles events until the handler stops the loop or shutdown is
    /// requested. No busy waiting: between batches it blocks in `waiter`.
    pub fn run(
        &mut self,
        waiter: &mut impl Waiter,
        mut handler: impl FnMut(&mut NotifyPump<I>, LoopEvent<C::Event>) -> Control,
    ) -> Result<Exit, CmError> {
        loop {
            let ready = waiter.wait()?;
            if self.poll_once(ready, &mut handler)? == Control::Stop {
                return Ok(Exit::Stopped);
            }
            if ready.shutdown {
                return Ok(Exit::Shutdown);
            }
        }
    }
}
