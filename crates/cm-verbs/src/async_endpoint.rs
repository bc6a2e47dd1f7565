//! The connection API on tokio: [`AsyncEndpoint`] drives the same [`Endpoint`] as the
//! blocking calls, over any transport that says how it waits ([`AsyncWait`]). On the
//! real transport (feature `rdma`) its descriptors (the CM channel, and per device
//! context the asynchronous event descriptor and the completion channel) are registered
//! with the reactor instead of waited on in `poll(2)`; on the simulated fabric (feature
//! `sim`), whose waits move virtual time, the endpoint waits through the transport and
//! lets the runtime's other tasks run between passes: the same async server runs in an
//! application's unit test.
//!
//! Cancellation-safe: every event lives in the endpoint until a call takes it, so a
//! future dropped at an `.await` loses no event, and the connections it was waiting on
//! stay owned by the endpoint (nothing leaks).
//!
//! The watched set is rebuilt when the endpoint's devices change, told apart by each
//! reader's serial number (not by descriptor numbers, which a device removed and opened
//! again can reuse). If duplicating or registering a descriptor fails (EMFILE, ENOMEM),
//! no call fails for it and no event is lost: what the endpoint has is still answered,
//! and until the set is whole again the wait also wakes at a short, growing interval
//! (10 ms to 500 ms) to read the sources it could not watch.
//!
//! ```no_run
//! use cm_verbs::async_endpoint::AsyncEndpoint;
//! use cm_verbs::rdma::RdmaTransport;
//! use cm_verbs::ListenOptions;
//!
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! let mut server = AsyncEndpoint::new(RdmaTransport::new()?)?;
//! server.endpoint().listen("10.77.1.1:7471".parse()?, ListenOptions::default())?;
//! loop {
//!     // Lost RTUs are rescued before `accept` returns: nothing to write for it.
//!     let conn = server.accept().await?;
//!     let message = server.recv(conn).await?;
//!     server.endpoint().send(conn, &message)?;
//! }
//! # }
//! ```

use std::future::poll_fn;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::task::Poll;
use std::time::Duration;

use cm_core::{CmError, Transport};
use tokio::io::unix::AsyncFd;

use crate::endpoint::IDLE_TURNS;
use crate::{ConnError, ConnectionId, Endpoint, EstablishedVia, Event};

/// How an [`AsyncEndpoint`] waits on a transport without blocking the runtime.
pub trait AsyncWait: Transport {
    /// The descriptors whose readability ends a wait (the CM channel, the devices'
    /// readers, anything else the transport reads), each with a number that changes
    /// when the descriptor behind it does; `None` for a transport whose
    /// [`Transport::wait`] never blocks in real time (the simulation moves virtual
    /// time): the async endpoint then waits through it, yielding between passes.
    ///
    /// Called before every wait: an iterator, so that a wait allocates nothing.
    fn watched<'a>(
        &'a self,
        devices: &'a [Self::Device],
    ) -> Option<impl Iterator<Item = (BorrowedFd<'a>, u64)> + 'a>;

    /// The reactor found the descriptor at `index` in [`AsyncWait::watched`]'s order
    /// readable (its readiness now cleared), or could not watch it: the next pass must
    /// read it. What [`Transport::wait`] notes when its `poll(2)` says so, for a
    /// transport that reads a source only when its wait found it ready. By default
    /// nothing: every source is read on every pass.
    fn note_readable(&self, _index: usize) {}
}

/// Where [`crate::rdma::RdmaTransport`]'s watched descriptors list the removal monitor:
/// after the CM channel.
#[cfg(feature = "rdma")]
const MONITOR_PLACE: usize = 1;

#[cfg(feature = "rdma")]
impl AsyncWait for crate::rdma::RdmaTransport {
    fn watched<'a>(
        &'a self,
        devices: &'a [Self::Device],
    ) -> Option<impl Iterator<Item = (BorrowedFd<'a>, u64)> + 'a> {
        // The channel, the monitor and the wake-up socket live as long as the
        // transport: serial 0. The monitor comes second (`MONITOR_PLACE`), the wake-up
        // socket after it: `note_readable` knows them by that.
        let fixed = std::iter::once(self.channel_fd())
            .chain(self.monitor_fd())
            .chain(std::iter::once(self.wake_fd()));
        Some(
            fixed
                .map(|fd| (fd, 0))
                .chain(devices.iter().flat_map(|device| {
                    [
                        (device.async_fd(), device.serial()),
                        (device.completion_fd(), device.serial()),
                    ]
                })),
        )
    }

    fn note_readable(&self, index: usize) {
        // The monitor is read only when a wait found it readable, as after `poll(2)`.
        let monitor = self.monitor_fd().is_some();
        if index == MONITOR_PLACE && monitor {
            self.note_monitor_readable();
        }
        // Another endpoint's mail for this one (device events): drained, then read.
        if index == MONITOR_PLACE + usize::from(monitor) {
            self.note_wake_readable();
        }
    }
}

#[cfg(feature = "sim")]
impl AsyncWait for cm_mock::sim::SimTransport {
    fn watched<'a>(
        &'a self,
        _devices: &'a [Self::Device],
    ) -> Option<impl Iterator<Item = (BorrowedFd<'a>, u64)> + 'a> {
        None::<std::iter::Empty<_>>
    }
}

/// An [`Endpoint`] driven by tokio.
#[derive(Debug)]
pub struct AsyncEndpoint<T: AsyncWait> {
    endpoint: Endpoint<T>,
    watch: WatchSet,
}

/// Duplicates of an endpoint's descriptors, registered with the reactor; rebuilt (and
/// the duplicates closed) as soon as the endpoint's set changes, so that a removed
/// device is not kept open by them.
#[derive(Debug, Default)]
pub(crate) struct WatchSet {
    /// Each registered duplicate with its place in [`AsyncWait::watched`]'s order.
    watched: Vec<(usize, AsyncFd<OwnedFd>)>,
    /// The places of the descriptors the last wait found readable, until handed over to
    /// the transport ([`WatchSet::hand_over`]): a wait holds no reference to the
    /// transport, so that its future is `Send` with a transport that is not `Sync`.
    readable: Vec<usize>,
    /// The serial numbers of the descriptors `watched` covers, in order; `None` when a
    /// descriptor could not be watched (the next wait tries again).
    serials: Option<Vec<u64>>,
    /// While the set is not whole: the interval the wait also wakes at.
    fallback: Option<Duration>,
}

/// Registers a duplicate descriptor for readability with the current runtime.
#[cfg(feature = "rdma")]
use cm_sys::async_owned_fd as register;

/// Registers a duplicate descriptor for readability with the current runtime (without
/// cm-sys, through tokio's older safe call).
#[cfg(not(feature = "rdma"))]
fn register(fd: OwnedFd) -> Result<AsyncFd<OwnedFd>, CmError> {
    // Deprecated because a general `AsRawFd` may close its descriptor under the
    // reactor; an `OwnedFd` keeps it open and the same until the AsyncFd drops it.
    #[allow(deprecated)]
    AsyncFd::with_interest(fd, tokio::io::Interest::READABLE)
        .map_err(|e| CmError::from_io("tokio AsyncFd", &e))
}

/// The first interval at which a wait with descriptors it could not watch wakes.
const FALLBACK_FIRST: Duration = Duration::from_millis(10);
/// The longest such interval.
const FALLBACK_MAX: Duration = Duration::from_millis(500);

impl WatchSet {
    /// Registers the endpoint's current descriptors if its device readers changed (one
    /// opened or closed), or if the last try could not watch them all. Never fails: a
    /// descriptor that cannot be duplicated or registered is left out and the wait falls
    /// back to waking at an interval until it can.
    ///
    /// Returns whether the transport has descriptors at all (`false`: its wait moves
    /// virtual time).
    pub(crate) fn sync<T: AsyncWait>(&mut self, endpoint: &Endpoint<T>) -> bool {
        let Some(current) = endpoint.transport().watched(endpoint.devices()) else {
            return false;
        };
        // Compared as they come: the usual wait, nothing changed, allocates nothing.
        let unchanged = self
            .serials
            .as_deref()
            .is_some_and(|known| known.iter().copied().eq(current.map(|(_, serial)| serial)));
        if unchanged {
            return true;
        }
        // The old duplicates go first: their descriptors make room for the new ones.
        self.watched.clear();
        let mut whole = true;
        let mut serials = Vec::new();
        let transport = endpoint.transport();
        let current = transport.watched(endpoint.devices());
        for (index, (fd, serial)) in current.into_iter().flatten().enumerate() {
            serials.push(serial);
            let watched = fd
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| CmError::from_io("dup", &e))
                .and_then(register);
            match watched {
                Ok(watched) => self.watched.push((index, watched)),
                Err(error) => {
                    if whole {
                        tracing::warn!("a descriptor is not watched, falling back to waking at an interval: {error}");
                    }
                    whole = false;
                    // Not watched, so read on every pass until it is.
                    transport.note_readable(index);
                }
            }
        }
        if whole {
            self.serials = Some(serials);
            self.fallback = None;
        } else {
            self.serials = None;
            self.fallback = Some(match self.fallback {
                None => FALLBACK_FIRST,
                Some(previous) => (previous * 2).min(FALLBACK_MAX),
            });
        }
        true
    }

    /// When a wait with `left` to the endpoint's next deadline should end at the
    /// latest (sources not watched are read again after the fallback interval).
    pub(crate) fn deadline(&self, left: Option<Duration>) -> Option<tokio::time::Instant> {
        // A deadline beyond what the clock can count is no deadline.
        let deadline = left.and_then(|left| tokio::time::Instant::now().checked_add(left));
        let fallback = self
            .fallback
            .and_then(|after| tokio::time::Instant::now().checked_add(after));
        [deadline, fallback].into_iter().flatten().min()
    }

    /// Ready once a watched descriptor is readable. Every readable one has its
    /// readiness cleared and is kept for [`WatchSet::hand_over`]: the caller's next
    /// pass reads them all, so no wake-up is lost between a read and the wait. Checks
    /// the reactor's readiness only: no system call.
    pub(crate) fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Result<(), CmError>> {
        let found = self.readable.len();
        for (index, fd) in &self.watched {
            match fd.poll_read_ready(cx) {
                Poll::Ready(Ok(mut guard)) => {
                    guard.clear_ready();
                    self.readable.push(*index);
                }
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(Err(CmError::from_io("tokio readiness", &e)))
                }
                Poll::Pending => {}
            }
        }
        if self.readable.len() > found {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    /// Tells `transport` which descriptors the last wait found readable
    /// ([`AsyncWait::note_readable`]), as its own `poll(2)` wait would: called before
    /// each pass, so that a source it reads only when told (the removal monitor) is
    /// read by that pass.
    pub(crate) fn hand_over<T: AsyncWait>(&mut self, transport: &T) {
        for index in self.readable.drain(..) {
            transport.note_readable(index);
        }
    }
}

impl<T: AsyncWait> AsyncEndpoint<T> {
    /// An endpoint over `transport`; must be called within a tokio runtime (with I/O
    /// enabled, for a transport with descriptors).
    pub fn new(transport: T) -> Result<Self, ConnError> {
        let mut endpoint = AsyncEndpoint {
            endpoint: Endpoint::new(transport),
            watch: WatchSet::default(),
        };
        endpoint.watch.sync(&endpoint.endpoint);
        Ok(endpoint)
    }

    /// The endpoint, for the calls that never wait (`listen`, `connect`, `send`,
    /// `disconnect`, `info`, `counters`, …).
    pub fn endpoint(&mut self) -> &mut Endpoint<T> {
        &mut self.endpoint
    }

    /// The next event.
    pub async fn next_event(&mut self) -> Result<Event, ConnError> {
        self.wait_for(|ep| ep.try_next_event().map(Ok)).await
    }

    /// The next accepted connection, once established (see [`Endpoint::accept`]).
    pub async fn accept(&mut self) -> Result<ConnectionId, ConnError> {
        self.wait_for(Endpoint::try_accept).await
    }

    /// Waits for `conn` to be established (see [`Endpoint::established`]).
    pub async fn established(&mut self, conn: ConnectionId) -> Result<EstablishedVia, ConnError> {
        self.wait_for(|ep| ep.try_established(conn)).await
    }

    /// The next message on `conn` (see [`Endpoint::recv`]).
    pub async fn recv(&mut self, conn: ConnectionId) -> Result<Vec<u8>, ConnError> {
        self.wait_for(|ep| ep.try_recv(conn)).await
    }

    async fn wait_for<R>(
        &mut self,
        mut take: impl FnMut(&mut Endpoint<T>) -> Option<Result<R, ConnError>>,
    ) -> Result<R, ConnError> {
        let mut idle_turns = 0;
        loop {
            // What is already there is answered before anything is read.
            if let Some(found) = take(&mut self.endpoint) {
                return found;
            }
            self.watch.hand_over(self.endpoint.transport());
            let more = self.endpoint.process_pass()?;
            // Taken before anything else can fail: an event read is never lost.
            if let Some(found) = take(&mut self.endpoint) {
                return found;
            }
            let has_descriptors = self.watch.sync(&self.endpoint);
            if more {
                // A source had more than one pass takes: read again without clearing
                // its readiness (no new edge would come), letting other tasks run.
                tokio::task::yield_now().await;
                continue;
            }
            let now = self.endpoint.transport().now();
            let left = self.endpoint.next_deadline().map(|d| d.saturating_sub(now));
            if !has_descriptors {
                // A wait in virtual time: the transport's own, then the other tasks
                // (a peer on the same fabric, a timer) run before the next pass. With
                // nothing pending at all, the other tasks get their turns first; only
                // when none of them brings anything is the wait refused (`Idle`), as a
                // blocking one is.
                match self.endpoint.wait_transport(left) {
                    Err(ConnError::Cm(CmError::Idle { .. })) if idle_turns < IDLE_TURNS => {
                        idle_turns += 1;
                    }
                    Err(error) => return Err(error),
                    Ok(()) => idle_turns = 0,
                }
                tokio::task::yield_now().await;
                continue;
            }
            let deadline = self.watch.deadline(left);
            let watch = &mut self.watch;
            let ready = poll_fn(|cx| watch.poll_ready(cx));
            match deadline {
                Some(deadline) => {
                    tokio::select! {
                        result = ready => result.map_err(ConnError::Endpoint)?,
                        () = tokio::time::sleep_until(deadline) => {}
                    }
                }
                None => ready.await.map_err(ConnError::Endpoint)?,
            }
        }
    }
}
