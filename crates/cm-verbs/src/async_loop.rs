//! The event loop as async code on tokio: the same pump, with the CM event channel and the
//! device's asynchronous events registered with the reactor (`AsyncFd`) instead of a
//! `poll(2)` waiter. Like [`EventLoop`](crate::EventLoop) it is for code that owns its
//! loop; a tokio server should use [`crate::async_endpoint::AsyncEndpoint`].
//!
//! ```no_run
//! use cm_verbs::async_loop::AsyncEventLoop;
//! use cm_verbs::{LoopEvent, NotifyPump};
//!
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! let channel = cm_verbs::sys::EventChannel::new()?;
//! let listener = channel.create_id()?;
//! listener.bind_addr("10.77.1.1:7471".parse()?)?;
//! listener.listen(8)?;
//! let device = listener.async_events()?;
//! let mut events = AsyncEventLoop::new(channel, device, NotifyPump::<cm_verbs::sys::CmId>::new())?;
//! while let Some(event) = events.next().await? {
//!     match event {
//!         LoopEvent::Cm(event) => println!("{}", event.event_type()),
//!         LoopEvent::Pump(pumped) => println!("{pumped:?}"),
//!     }
//! }
//! # Ok(())
//! # }
//! ```

use cm_core::{CmError, CmId};
use cm_sys::{AsyncEvents, CmEvent, EventChannel};
use tokio::io::unix::AsyncFd;

use crate::{LoopEvent, NotifyPump};

/// The pump driven by tokio: asynchronous events first, then CM events in channel order,
/// yielded one at a time by [`AsyncEventLoop::next`].
pub struct AsyncEventLoop<I> {
    channel: AsyncFd<EventChannel>,
    device: AsyncFd<AsyncEvents>,
    pump: NotifyPump<I>,
}

impl<I: CmId> AsyncEventLoop<I> {
    /// Registers both descriptors with the current tokio runtime (switching them to
    /// non-blocking mode). Must be called from within a runtime with I/O enabled.
    /// (The registration itself lives in cm-sys, which owns the descriptors.)
    pub fn new(
        channel: EventChannel,
        device: AsyncEvents,
        pump: NotifyPump<I>,
    ) -> Result<Self, CmError> {
        Ok(AsyncEventLoop {
            channel: cm_sys::async_event_channel(channel)?,
            device: cm_sys::async_device_events(device)?,
            pump,
        })
    }

    /// The pump, to register connections and read counters.
    pub fn pump(&mut self) -> &mut NotifyPump<I> {
        &mut self.pump
    }

    /// The next event: what the pump did with an asynchronous event, or a CM event (which
    /// the pump has already seen). Waits without busy looping. `Ok(None)` never happens
    /// while the descriptors live; the `Option` keeps the shape of a stream.
    pub async fn next(&mut self) -> Result<Option<LoopEvent<CmEvent>>, CmError> {
        loop {
            if let Some(event) = self.device.get_ref().try_next_event()? {
                return Ok(Some(LoopEvent::Pump(self.pump.on_async_event(event))));
            }
            if let Some(event) = self.channel.get_ref().try_next_event()? {
                self.pump.on_cm_event(event.event_type(), event.qp_num());
                return Ok(Some(LoopEvent::Cm(event)));
            }
            // Both were empty: wait for either to become readable. Readiness is cleared
            // only after a read found nothing, so no wake-up is lost.
            let readiness = |e: std::io::Error| CmError::from_io("tokio readiness", &e);
            tokio::select! {
                guard = self.device.readable() => {
                    let mut guard = guard.map_err(readiness)?;
                    match self.device.get_ref().try_next_event()? {
                        Some(event) => {
                            return Ok(Some(LoopEvent::Pump(self.pump.on_async_event(event))));
                        }
                        None => guard.clear_ready(),
                    }
                }
                guard = self.channel.readable() => {
                    let mut guard = guard.map_err(readiness)?;
                    match self.channel.get_ref().try_next_event()? {
                        Some(event) => {
                            self.pump.on_cm_event(event.event_type(), event.qp_num());
                            return Ok(Some(LoopEvent::Cm(event)));
                        }
                        None => guard.clear_ready(),
                    }
                }
            }
        }
    }

    /// Gives the parts back (deregistering the descriptors).
    pub fn into_parts(self) -> (EventChannel, AsyncEvents, NotifyPump<I>) {
        (
            self.channel.into_inner(),
            self.device.into_inner(),
            self.pump,
        )
    }
}
