//! The real-device waiter: `poll(2)` over the CM event channel, the device's asynchronous
//! events and a wake-up socket, so that [`EventLoop::run`](crate::EventLoop::run) blocks
//! between batches and another thread can stop it with a [`Shutdown`] handle.
//!
//! ```no_run
//! use cm_verbs::rdma::PollWaiter;
//! use cm_verbs::{Control, EventLoop, Exit, NotifyPump};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let channel = cm_verbs::sys::EventChannel::new()?;
//! let listener = channel.create_id()?;
//! listener.bind_addr("10.77.1.1:7471".parse()?)?;
//! listener.listen(8)?;
//! let device = listener.async_events()?;
//! device.set_nonblocking(true)?;
//! channel.set_nonblocking(true)?;
//!
//! let (mut waiter, shutdown) = PollWaiter::new(&channel)?;
//! waiter.watch_async_events(&device)?;
//! let mut event_loop = EventLoop::new(channel, device, NotifyPump::<cm_verbs::sys::CmId>::new());
//! std::thread::spawn(move || {
//!     std::thread::sleep(std::time::Duration::from_secs(5));
//!     shutdown.request().expect("wake the loop");
//! });
//! let exit = event_loop.run(&mut waiter, |_pump, event| {
//!     println!("{event:?}");
//!     Control::Continue
//! })?;
//! assert_eq!(exit, Exit::Shutdown);
//! # Ok(())
//! # }
//! ```

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use cm_core::CmError;

use crate::wake::WakeFlag;
use crate::{Ready, Waiter};

pub use crate::rdma_transport::{RdmaBuffers, RdmaDevice, RdmaTransport};

/// Asks a [`PollWaiter`] (and so the [`EventLoop`](crate::EventLoop) it serves) to return.
///
/// Cheap to clone and [`Send`]: hand a clone to a signal-handling or supervising thread.
/// Requests coalesce: any number of them before the waiter wakes count as one.
#[derive(Debug, Clone)]
pub struct Shutdown {
    inner: Arc<WakeWriter>,
}

/// The writing end of a wake-up socket, shared by every handle that wakes one waiter
/// (a [`Shutdown`], an endpoint's waker): a request writes one byte, coalesced.
#[derive(Debug)]
pub(crate) struct WakeWriter {
    writer: UnixStream,
    /// Whether a request's byte is pending: at most one byte is ever in flight, so a
    /// request never blocks (the protocol is model-checked: `crate::wake`).
    pending: WakeFlag,
}

impl WakeWriter {
    /// Wakes the waiter's current or next wait. Never blocks.
    fn request(&self) -> Result<(), CmError> {
        if !self.pending.request() {
            return Ok(());
        }
        match (&self.writer).write(&[1]) {
            Ok(_) => Ok(()),
            // A byte already waits in the socket: the waiter wakes anyway.
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(()),
            // The waiter is gone, so it is not waiting: nothing left to wake.
            Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(()),
            Err(e) => Err(io_error("write(wake-up socket)", &e)),
        }
    }
}

impl std::task::Wake for WakeWriter {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Err(error) = self.request() {
            tracing::warn!("waking the endpoint failed: {error}");
        }
    }
}

/// The waiting end of a wake-up socket: poll it with the other descriptors, drain it
/// when readable.
#[derive(Debug)]
pub(crate) struct WakeReader {
    reader: UnixStream,
    shared: Arc<WakeWriter>,
}

impl WakeReader {
    /// A wake-up socket: its waiting end, and the shared writing end to hand out.
    pub(crate) fn new() -> Result<(WakeReader, Arc<WakeWriter>), CmError> {
        let (writer, reader) = UnixStream::pair().map_err(|e| io_error("socketpair", &e))?;
        for end in [&writer, &reader] {
            end.set_nonblocking(true)
                .map_err(|e| io_error("fcntl(O_NONBLOCK)", &e))?;
        }
        let shared = Arc::new(WakeWriter {
            writer,
            pending: WakeFlag::new(),
        });
        Ok((
            WakeReader {
                reader,
                shared: Arc::clone(&shared),
            },
            shared,
        ))
    }

    /// The shared writing end, for another handle.
    pub(crate) fn shared(&self) -> Arc<WakeWriter> {
        Arc::clone(&self.shared)
    }

    /// Consumes pending requests; whether there was one. The socket is emptied first
    /// and the flag settled after: the other order loses wake-ups ([`WakeFlag`]).
    pub(crate) fn drain(&mut self) -> Result<bool, CmError> {
        let mut sink = [0u8; 16];
        let mut read_any = false;
        loop {
            match self.reader.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => read_any = true,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_error("read(wake-up socket)", &e)),
            }
        }
        let requested = self.shared.pending.settle();
        Ok(requested || read_any)
    }
}

impl AsFd for WakeReader {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.reader.as_fd()
    }
}

impl Shutdown {
    /// Requests shutdown: the waiter's current or next wait returns with
    /// [`Ready::shutdown`] set. Never blocks.
    pub fn request(&self) -> Result<(), CmError> {
        self.inner.request()
    }
}

/// A [`Waiter`] over real descriptors: the CM event channel, optionally a device's
/// asynchronous events, and the wake-up socket of its [`Shutdown`] handles.
///
/// It holds duplicates of the descriptors it watches (`dup(2)`), so the sources
/// themselves can be moved into the [`EventLoop`](crate::EventLoop); drop the waiter with
/// the loop. Any [`AsFd`] works: tests use pipes and sockets in place of a device.
///
/// Blocks in `poll(2)` until a descriptor is readable, shutdown is requested or the
/// optional tick passes (then it returns an empty [`Ready`]): no busy waiting.
#[derive(Debug)]
pub struct PollWaiter {
    cm_events: OwnedFd,
    async_events: Option<OwnedFd>,
    wake: WakeReader,
    tick: Option<Duration>,
}

impl PollWaiter {
    /// A waiter on `cm_events` (the event channel's descriptor) and its shutdown handle.
    pub fn new(cm_events: impl AsFd) -> Result<(PollWaiter, Shutdown), CmError> {
        let cm_events = duplicate(cm_events)?;
        let (wake, shutdown) = WakeReader::new()?;
        let waiter = PollWaiter {
            cm_events,
            async_events: None,
            wake,
            tick: None,
        };
        Ok((waiter, Shutdown { inner: shutdown }))
    }

    /// Also watches `async_events` (a device's asynchronous event descriptor), replacing
    /// any watched before. A client learns its device only once an address is resolved,
    /// hence a separate call.
    pub fn watch_async_events(&mut self, async_events: impl AsFd) -> Result<(), CmError> {
        self.async_events = Some(duplicate(async_events)?);
        Ok(())
    }

    /// Whether asynchronous events are watched.
    pub fn watches_async_events(&self) -> bool {
        self.async_events.is_some()
    }

    /// Makes every wait return after at most `tick` (an empty [`Ready`] if nothing
    /// happened), for callers that also poll something without a descriptor, such as a
    /// completion queue; `None` (the default) waits as long as it takes.
    pub fn set_tick(&mut self, tick: Option<Duration>) {
        self.tick = tick;
    }

    /// A new handle on this waiter's shutdown request.
    pub fn shutdown_handle(&self) -> Shutdown {
        Shutdown {
            inner: Arc::clone(&self.wake.shared),
        }
    }
}

impl Waiter for PollWaiter {
    fn wait(&mut self) -> Result<Ready, CmError> {
        let cm = self.cm_events.as_fd();
        let wake = self.wake.as_fd();
        let mut ready = Ready::default();
        let woken = match &self.async_events {
            Some(async_events) => {
                let set = cm_sys::poll_readable(&[cm, wake, async_events.as_fd()], self.tick)?;
                ready.async_events = set.is_ready(2);
                ready.cm_events = set.is_ready(0);
                set.is_ready(1)
            }
            None => {
                let set = cm_sys::poll_readable(&[cm, wake], self.tick)?;
                ready.cm_events = set.is_ready(0);
                set.is_ready(1)
            }
        };
        if woken {
            ready.shutdown = self.wake.drain()?;
        }
        Ok(ready)
    }
}

fn duplicate(fd: impl AsFd) -> Result<OwnedFd, CmError> {
    fd.as_fd()
        .try_clone_to_owned()
        .map_err(|e| io_error("dup", &e))
}

pub(crate) fn io_error(op: &'static str, error: &std::io::Error) -> CmError {
    CmError::from_io(op, error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BackendLoop, Control, EventLoop, Exit, LoopEvent, NotifyPump};
    use cm_mock::{MockAsyncEventSource, MockBackend, MockCmEventSource, MockCmId};

    /// A loop over mocked sources that are always empty.
    fn empty_loop() -> BackendLoop<MockBackend> {
        let mut cm = MockCmEventSource::new();
        cm.expect_try_next_event().returning(|| Ok(None));
        let mut device = MockAsyncEventSource::new();
        device.expect_try_next_async_event().returning(|| Ok(None));
        EventLoop::new(cm, device, NotifyPump::new())
    }

    #[test]
    fn shutdown_from_another_thread_stops_the_loop() {
        let (channel_writer, channel) = UnixStream::pair().unwrap();
        let (_device_writer, device) = UnixStream::pair().unwrap();
        let (mut waiter, shutdown) = PollWaiter::new(&channel).unwrap();
        waiter.watch_async_events(&device).unwrap();
        let mut event_loop = empty_loop();
        let stopper = std::thread::spawn(move || shutdown.request().unwrap());
        let mut handled = 0;
        let exit = event_loop
            .run(&mut waiter, |_, _| {
                handled += 1;
                Control::Continue
            })
            .unwrap();
        stopper.join().unwrap();
        assert_eq!(exit, Exit::Shutdown);
        assert_eq!(handled, 0, "the sources were empty");
        drop(channel_writer);
    }

    #[test]
    fn a_request_after_the_waiter_is_gone_is_a_no_op() {
        // Two threads stop the same loop: the first wakes it, the loop returns and its
        // waiter is dropped, then the second request finds the socket's peer closed.
        let (_channel_writer, channel) = UnixStream::pair().unwrap();
        let (waiter, first) = PollWaiter::new(&channel).unwrap();
        let second = first.clone();
        let mut waiter = waiter;
        waiter.set_tick(Some(Duration::ZERO));
        first.request().unwrap();
        assert!(waiter.wait().unwrap().shutdown);
        drop(waiter);
        assert_eq!(second.request(), Ok(()));
        assert_eq!(first.request(), Ok(()));
    }

    #[test]
    fn readable_descriptors_are_reported_by_source() {
        let (mut channel_writer, channel) = UnixStream::pair().unwrap();
        let (mut device_writer, device) = UnixStream::pair().unwrap();
        let (mut waiter, _shutdown) = PollWaiter::new(&channel).unwrap();
        waiter.set_tick(Some(Duration::ZERO));
        assert!(!waiter.watches_async_events());
        assert_eq!(waiter.wait().unwrap(), Ready::default());

        device_writer.write_all(b"a").unwrap();
        // Not watched yet: only the channel counts.
        assert_eq!(waiter.wait().unwrap(), Ready::default());
        waiter.watch_async_events(&device).unwrap();
        assert!(waiter.watches_async_events());
        let ready = waiter.wait().unwrap();
        assert!(ready.async_events && !ready.cm_events && !ready.shutdown);

        channel_writer.write_all(b"c").unwrap();
        let ready = waiter.wait().unwrap();
        assert!(ready.async_events && ready.cm_events && !ready.shutdown);
    }

    /// A request racing a drain must never leave the request flag set with no byte in
    /// the socket: every later request would then be coalesced into a wake-up that never
    /// comes, and the waiter would sleep through them all (an endpoint's driver did,
    /// holding its lock). The reader drains only when the socket polls readable, as a
    /// waiter does; once both threads stop, a set flag must have its byte.
    #[test]
    fn a_request_racing_a_drain_is_never_lost() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let (mut reader, writer) = WakeReader::new().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(std::sync::Barrier::new(2));
        let draining = {
            let (stop, started) = (Arc::clone(&stop), Arc::clone(&started));
            std::thread::spawn(move || {
                started.wait();
                while !stop.load(Ordering::Acquire) {
                    let ready =
                        cm_sys::poll_readable(&[reader.as_fd()], Some(Duration::ZERO)).unwrap();
                    if ready.is_ready(0) {
                        reader.drain().unwrap();
                    }
                }
                reader
            })
        };
        started.wait();
        for n in 0..200_000 {
            writer.request().unwrap();
            // Now and then let the reader run, so that requests land during drains.
            if n % 8 == 0 {
                std::thread::yield_now();
            }
        }
        stop.store(true, Ordering::Release);
        let reader = draining.join().unwrap();
        let readable = cm_sys::poll_readable(&[reader.as_fd()], Some(Duration::ZERO))
            .unwrap()
            .is_ready(0);
        if writer.pending.is_pending() {
            assert!(
                readable,
                "a request is pending with nothing to wake the waiter"
            );
        }
        // And the waiter still wakes for the next one.
        let mut reader = reader;
        reader.drain().unwrap();
        writer.request().unwrap();
        assert!(
            cm_sys::poll_readable(&[reader.as_fd()], Some(Duration::ZERO))
                .unwrap()
                .is_ready(0),
            "a request after the drains wakes the waiter"
        );
    }

    #[test]
    fn requests_coalesce_and_are_consumed_by_one_wait() {
        let (_channel_writer, channel) = UnixStream::pair().unwrap();
        let (mut waiter, shutdown) = PollWaiter::new(&channel).unwrap();
        waiter.set_tick(Some(Duration::ZERO));
        let other = shutdown.clone();
        let third = waiter.shutdown_handle();
        drop(shutdown);
        for _ in 0..100_000 {
            other.request().unwrap();
            third.request().unwrap();
        }
        assert!(waiter.wait().unwrap().shutdown);
        assert!(!waiter.wait().unwrap().shutdown, "consumed");
        third.request().unwrap();
        assert!(
            waiter.wait().unwrap().shutdown,
            "a later request wakes again"
        );
    }

    #[test]
    fn the_handle_crosses_threads() {
        fn assert_send_sync_clone<T: Send + Sync + Clone>() {}
        assert_send_sync_clone::<Shutdown>();
    }

    #[test]
    fn the_tick_bounds_a_wait_with_nothing_ready() {
        let (_channel_writer, channel) = UnixStream::pair().unwrap();
        let (mut waiter, _shutdown) = PollWaiter::new(&channel).unwrap();
        waiter.set_tick(Some(Duration::from_millis(1)));
        assert_eq!(waiter.wait().unwrap(), Ready::default());
    }

    #[test]
    fn a_stop_from_the_handler_wins_over_shutdown() {
        let (mut channel_writer, channel) = UnixStream::pair().unwrap();
        let (mut waiter, shutdown) = PollWaiter::new(&channel).unwrap();
        channel_writer.write_all(b"c").unwrap();
        shutdown.request().unwrap();
        let mut cm = MockCmEventSource::new();
        let mut established = cm_mock::MockCmEvent::new();
        established
            .expect_event_type()
            .return_const(cm_core::CmEventType::Established);
        established.expect_qp_num().return_const(None);
        let mut events = vec![established];
        cm.expect_try_next_event()
            .returning(move || Ok(events.pop()));
        let mut device = MockAsyncEventSource::new();
        device.expect_try_next_async_event().returning(|| Ok(None));
        let mut event_loop: EventLoop<_, _, MockCmId> =
            EventLoop::new(cm, device, NotifyPump::new());
        let exit = event_loop
            .run(&mut waiter, |_, event| match event {
                LoopEvent::Cm(_) => Control::Stop,
                LoopEvent::Pump(_) => Control::Continue,
            })
            .unwrap();
        assert_eq!(exit, Exit::Stopped);
    }

    use cm_testkit::skip;

    #[test]
    fn shutdown_stops_a_loop_on_a_real_channel_and_device() {
        const TEST: &str = "shutdown_stops_a_loop_on_a_real_channel_and_device";
        let channel = match cm_sys::EventChannel::new() {
            Ok(channel) => channel,
            Err(e) if e.is_no_device() => return skip(TEST, &e.to_string()),
            Err(e) => panic!("rdma_create_event_channel: {e}"),
        };
        let Some(addr) = std::env::var(cm_testkit::env::ADDR_A)
            .ok()
            .and_then(|a| a.parse::<std::net::IpAddr>().ok())
        else {
            return skip(TEST, "CMNOTIFY_ADDR_A names no test address");
        };
        channel.set_nonblocking(true).expect("O_NONBLOCK");
        let listener = channel.create_id().expect("id");
        listener
            .bind_addr(std::net::SocketAddr::new(addr, 0))
            .expect("bind to the test address");
        listener.listen(4).expect("listen");
        let device = listener.async_events().expect("the device's async events");
        device.set_nonblocking(true).expect("O_NONBLOCK");

        let (mut waiter, shutdown) = PollWaiter::new(&channel).unwrap();
        waiter.watch_async_events(&device).unwrap();
        let mut event_loop = EventLoop::new(channel, device, NotifyPump::<cm_sys::CmId>::new());
        let stopper = std::thread::spawn(move || shutdown.request().unwrap());
        let mut events = 0;
        let exit = event_loop
            .run(&mut waiter, |_, _| {
                events += 1;
                Control::Continue
            })
            .expect("run");
        stopper.join().unwrap();
        assert_eq!(exit, Exit::Shutdown);
        assert_eq!(events, 0, "nobody connected");
        drop(event_loop);
        drop(listener);
    }
}
