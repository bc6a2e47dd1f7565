//! Connections as values: an [`EndpointHandle`] shares one [`Endpoint`] between
//! threads and tasks, a [`Listener`] yields each accepted connection as a
//! [`Connection`] that moves into a thread or a task of its own, in the shape of
//! tokio's `TcpListener`/`TcpStream` and quinn's `Endpoint`/`Connection`.
//!
//! # Who drives the endpoint
//!
//! A driver owns the passes: it waits on the endpoint's sources, runs the notify path,
//! and wakes the calls waiting on the connections that have news (and only those: the
//! work per event does not grow with the number of connections or of waiting calls).
//! Start it with the handle: [`EndpointHandle::spawn_thread`] runs it on a thread of its
//! own, [`EndpointHandle::spawn_tokio`] (feature `tokio`) as a task on the current
//! runtime. It ends when the last handle (endpoint, listener or connection) is dropped.
//!
//! A listener with [`ListenOptions::auto_accept`] off hands out each connection request
//! as a [`Request`] ([`Listener::next_request`]): the peer's private data and address,
//! to [`Request::accept`] with private data of its own (the REP's: where RDMA services
//! send rkeys and credits) or [`Request::reject`]; a `Request` dropped unanswered is
//! rejected. [`Connection::peer_private_data`] keeps the other side's private data.
//!
//! Every call exists twice, whichever driver runs: `recv().await` for async code and
//! `blocking_recv(timeout)` for a thread (the naming of tokio's channels). A blocking
//! call inside async code blocks its runtime thread: use the async one there.
//!
//! # Lifetimes and bounds
//!
//! A [`Connection`] and its clones share one connection: the last one dropped
//! disconnects it (DREQ) and frees it. A [`Listener`] dropped stops listening and
//! disconnects the connections it had established and not yet handed out. Established
//! connections wait for `accept` in their listener's queue, at most
//! [`ListenOptions::max_in_setup`] of them: past it the newest is disconnected and
//! counted ([`EndpointHandle::accepts_refused`]). Requests not yet taken wait in their
//! listener's queue, bounded by the endpoint: at most [`ListenOptions::max_in_setup`]
//! connections in setup per listener (a request past it is rejected at once), each
//! request rejected and dropped from the queue once [`ListenOptions::request_timeout`]
//! passed unanswered; a [`Listener`] dropped rejects those it holds. Endpoint-wide
//! events (devices) are kept up to [`crate::ENDPOINT_EVENT_BACKLOG`] for
//! [`EndpointHandle::endpoint_event`], the oldest dropped first. A connection closed
//! before anyone held it is freed at once. Nothing else is kept.
//!
//! # Cancellation
//!
//! Every message and event stays in the endpoint until a call takes it: an async call
//! dropped at its `.await` (a `select!`, a timeout) loses nothing.
//!
//! ```no_run
//! # #[cfg(feature = "rdma")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use cm_verbs::handle::EndpointHandle;
//! use cm_verbs::rdma::RdmaTransport;
//! use cm_verbs::{Endpoint, ListenOptions};
//!
//! let endpoint = EndpointHandle::spawn_thread(Endpoint::new(RdmaTransport::new()?))?;
//! let listener = endpoint.listen("10.77.1.1:7471".parse()?, ListenOptions::default())?;
//! loop {
//!     let conn = listener.blocking_accept(None)?; // a lost RTU is rescued before this returns
//!     std::thread::spawn(move || {
//!         while let Ok(message) = conn.blocking_recv(None) {
//!             if conn.blocking_send(&message, None).is_err() {
//!                 break;
//!             }
//!         }
//!     });
//! }
//! # }
//! # #[cfg(not(feature = "rdma"))]
//! # fn main() {}
//! ```

mod call;
mod core;
mod driver;
mod pacing;
mod request;

use std::fmt;
use std::future::poll_fn;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::Waker;
use std::time::Duration;

use cm_core::{CmError, Transport, WorkCompletion};

use crate::{
    ConnError, ConnectOptions, ConnectionId, ConnectionInfo, Endpoint, EstablishedVia, Event,
    ListenOptions, ListenerId, PrivateData,
};

use self::call::Call;
use self::core::{Core, WaitOn};
pub use self::request::Request;
use crate::wake::LockGate;

/// What the handles hold and wait on ([`EndpointHandle::stats`]): every figure is
/// bounded by what the application holds or does now, never by history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct HandleStats {
    /// Calls registered as waiting (at most one entry per waiting call: a call that
    /// answered, timed out or was dropped has none).
    pub waiting_calls: usize,
    /// Deadlines of waiting blocking calls.
    pub timers: usize,
    /// Connections held by a handle or queued for `accept`.
    pub held_connections: usize,
    /// Established connections waiting in the listeners' queues for `accept`.
    pub accept_queued: usize,
    /// Requests waiting in their listeners' queues for `next_request` (each listener's
    /// at most its [`ListenOptions::max_in_setup`]).
    pub requests_queued: usize,
}

/// What the driver and every handle share.
struct Shared<T: Transport> {
    core: Mutex<Core<T>>,
    /// The thread driver, on a transport whose wait never blocks in real time, sleeps
    /// here when nothing is pending anywhere, until a call changes something.
    idle: Condvar,
    /// Calls waiting for the lock, and whether the thread driver waits in the
    /// transport holding it (the handshake is model-checked: `crate::wake`).
    gate: LockGate,
    /// Ends the transport's wait (`None`: a wait that never blocks in real time).
    transport_waker: Option<Waker>,
}

impl<T: Transport> Shared<T> {
    /// The lock, for a call: a driver blocked in the transport's wait is woken so it
    /// lets go.
    fn lock(&self) -> MutexGuard<'_, Core<T>> {
        if self.gate.want() {
            if let Some(waker) = &self.transport_waker {
                waker.wake_by_ref();
            }
        }
        let guard = self.core.lock().unwrap_or_else(PoisonError::into_inner);
        self.gate.got();
        guard
    }

    /// Tells the driver that a call changed what it waits on.
    fn poke(&self, core: &mut Core<T>) {
        if core.poke() {
            self.idle.notify_one();
        }
    }

    /// Waits on the calling thread until `take` answers, at most `timeout` (the
    /// transport's clock): the async call's path ([`Call`]), parking the thread
    /// between looks.
    fn blocking_wait<R>(
        &self,
        timeout: Option<Duration>,
        on: WaitOn,
        take: impl FnMut(&mut Core<T>) -> Option<Result<R, ConnError>>,
    ) -> Result<R, ConnError> {
        Call::new(self, on, timeout).block_on(take)
    }

    /// Waits in async code until `take` answers; dropped, it leaves nothing behind.
    async fn wait<R>(
        &self,
        on: WaitOn,
        mut take: impl FnMut(&mut Core<T>) -> Option<Result<R, ConnError>>,
    ) -> Result<R, ConnError> {
        let mut call = Call::new(self, on, None);
        poll_fn(|cx| call.poll(cx.waker(), &mut take)).await
    }

    /// Runs `f` on the endpoint, then tells the driver if it must look again.
    fn with<R>(&self, f: impl FnOnce(&mut Core<T>) -> R) -> R {
        let mut core = self.lock();
        let answer = f(&mut core);
        self.poke(&mut core);
        answer
    }
}

/// For `work_completed`: a completion, the connection's end, or nothing yet.
fn take_work<T: Transport>(
    endpoint: &mut Endpoint<T>,
    conn: ConnectionId,
) -> Option<Result<WorkCompletion, ConnError>> {
    match endpoint.take_work_completion(conn) {
        Ok(Some(completion)) => Some(Ok(completion)),
        Ok(None) => None,
        Err(error) => Some(Err(error)),
    }
}

/// Held by every public handle: the last one gone stops the driver.
struct Owner<T: Transport> {
    shared: Arc<Shared<T>>,
}

impl<T: Transport> Drop for Owner<T> {
    fn drop(&mut self) {
        let mut core = self.shared.lock();
        core.stop();
        self.shared.poke(&mut core);
        drop(core);
        if let Some(waker) = &self.shared.transport_waker {
            waker.wake_by_ref();
        }
    }
}

/// One [`Endpoint`] shared by threads and tasks, with its driver. Cheap to clone;
/// [`Send`] and [`Sync`] when `Endpoint<T>` is [`Send`] (generic code says
/// `where Endpoint<T>: Send`: the transport's device key counts too, so `T: Send`
/// alone does not prove it).
pub struct EndpointHandle<T: Transport> {
    owner: Arc<Owner<T>>,
}

impl<T: Transport> Clone for EndpointHandle<T> {
    fn clone(&self) -> Self {
        EndpointHandle {
            owner: Arc::clone(&self.owner),
        }
    }
}

impl<T: Transport> fmt::Debug for EndpointHandle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EndpointHandle").finish_non_exhaustive()
    }
}

impl<T: Transport + 'static> EndpointHandle<T>
where
    Endpoint<T>: Send,
{
    /// Shares `endpoint`, driven by a thread of its own (named `cm-endpoint`), which ends
    /// when the last handle is dropped.
    pub fn spawn_thread(endpoint: Endpoint<T>) -> Result<Self, ConnError> {
        let handle = Self::share(endpoint)?;
        let ended = driver::Ended(Arc::clone(&handle.owner.shared));
        std::thread::Builder::new()
            .name("cm-endpoint".into())
            .spawn(move || driver::run_thread(&ended.0))
            .map_err(|e| ConnError::Cm(CmError::from_io("spawn", &e)))?;
        Ok(handle)
    }

    /// Shares `endpoint`, driven by a task spawned on the current tokio runtime (with
    /// I/O enabled, for a transport with descriptors), which ends when the last handle
    /// is dropped. Outside a runtime: [`CmError::InvalidArgument`].
    #[cfg(feature = "tokio")]
    pub fn spawn_tokio(endpoint: Endpoint<T>) -> Result<Self, ConnError>
    where
        T: crate::async_endpoint::AsyncWait,
    {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            ConnError::Cm(CmError::InvalidArgument {
                op: "spawn_tokio",
                reason: "called outside a tokio runtime",
            })
        })?;
        let handle = Self::share(endpoint)?;
        // Moved into the task: dropped with it, even unpolled (its runtime shut down).
        let ended = driver::Ended(Arc::clone(&handle.owner.shared));
        runtime.spawn(async move { driver::run_tokio(&ended.0).await });
        Ok(handle)
    }
}

impl<T: Transport> EndpointHandle<T> {
    fn share(mut endpoint: Endpoint<T>) -> Result<Self, ConnError> {
        let transport_waker = endpoint.transport_waker()?;
        let virtual_time = transport_waker.is_none();
        Ok(EndpointHandle {
            owner: Arc::new(Owner {
                shared: Arc::new(Shared {
                    core: Mutex::new(Core::new(endpoint, virtual_time)),
                    idle: Condvar::new(),
                    gate: LockGate::new(),
                    transport_waker,
                }),
            }),
        })
    }

    fn shared(&self) -> &Shared<T> {
        &self.owner.shared
    }

    /// Binds a listener to `addr` and listens (see [`Endpoint::listen`]). With
    /// `options.auto_accept` (the default) its connections come out of
    /// [`Listener::accept`]; without, its requests come out of
    /// [`Listener::next_request`], each for the application to answer.
    pub fn listen(&self, addr: T::Addr, options: ListenOptions) -> Result<Listener<T>, ConnError> {
        let bound = options.max_in_setup;
        let id = self
            .shared()
            .with(|core| core.listen(addr, options, bound))?;
        Ok(Listener {
            id,
            owner: Arc::clone(&self.owner),
        })
    }

    /// Starts connecting to `dst` (see [`Endpoint::connect`]); the connection is usable
    /// once [`Connection::established`] answers. A connection over the application's own
    /// QP ([`ConnectOptions::application_qp`]) is made on the [`Endpoint`] instead
    /// ([`ConnError::InvalidOptions`] here).
    pub fn connect(
        &self,
        dst: T::Addr,
        options: ConnectOptions<T::Addr>,
    ) -> Result<Connection<T>, ConnError> {
        let id = self.shared().with(|core| core.connect(dst, options))?;
        Ok(Connection::new(id, &self.owner))
    }

    /// Runs `f` on the endpoint (counters, stats, options), holding it meanwhile: keep
    /// `f` short, every other call waits for it. What `f` changes reaches the handles
    /// only through the endpoint's events: a connection disconnected here wakes no call
    /// waiting on it (use [`Connection::close`]).
    pub fn with_endpoint<R>(&self, f: impl FnOnce(&mut Endpoint<T>) -> R) -> R {
        self.shared().with(|core| f(core.endpoint_mut()))
    }

    /// The oldest endpoint-wide event not yet taken ([`Event::Device`],
    /// [`Event::DeviceFailed`], …), without waiting. O(1).
    pub fn endpoint_event(&self) -> Option<Event> {
        self.shared().lock().take_endpoint_event()
    }

    /// Established connections that no `accept` returned: disconnected because their
    /// listener's queue was full, or their listener was closed before it accepted
    /// them. Every established connection is either accepted (by `accept` or a
    /// [`Request::accept`]) or counted here. O(1).
    pub fn accepts_refused(&self) -> u64 {
        self.shared().lock().accepts_refused()
    }

    /// What the handles hold and wait on. O(listeners).
    pub fn stats(&self) -> HandleStats {
        self.shared().lock().stats()
    }
}

/// A listening address: each connection established on it comes out of
/// [`Listener::accept`] once, or (with [`ListenOptions::auto_accept`] off) each request
/// out of [`Listener::next_request`] once. Dropping it stops listening.
pub struct Listener<T: Transport> {
    id: ListenerId,
    owner: Arc<Owner<T>>,
}

impl<T: Transport> fmt::Debug for Listener<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener").field("id", &self.id).finish()
    }
}

impl<T: Transport> Listener<T> {
    /// The endpoint's name for it.
    pub fn id(&self) -> ListenerId {
        self.id
    }

    /// Its local address (its port, when bound to port 0).
    pub fn local_addr(&self) -> Result<Option<T::Addr>, ConnError> {
        self.owner
            .shared
            .lock()
            .endpoint_mut()
            .listener_addr(self.id)
    }

    /// The next connection established on this listener, lost RTUs rescued before it
    /// comes. A connection whose peer left before it was accepted is returned too, as
    /// TCP's `accept` does: what the peer sent is read from it, then its close. Ends
    /// with [`ConnError::ListenerClosed`] once its device went away. On a listener
    /// whose requests wait for an answer (`auto_accept` off):
    /// [`ConnError::InvalidOptions`] (its connections come from [`Request::accept`]).
    /// Cancellation-safe.
    pub async fn accept(&self) -> Result<Connection<T>, ConnError> {
        let id = self.id;
        let (conn, via, peer) = self
            .owner
            .shared
            .wait(WaitOn::Listener(id), |core| core.try_accept(id))
            .await?;
        Ok(Connection::accepted(conn, via, peer, &self.owner))
    }

    /// [`Listener::accept`] on the calling thread, at most `timeout` (`None`: as long
    /// as it takes; [`ConnError::Timeout`] when it passed).
    pub fn blocking_accept(&self, timeout: Option<Duration>) -> Result<Connection<T>, ConnError> {
        let id = self.id;
        let (conn, via, peer) =
            self.owner
                .shared
                .blocking_wait(timeout, WaitOn::Listener(id), |core| core.try_accept(id))?;
        Ok(Connection::accepted(conn, via, peer, &self.owner))
    }

    /// The next connection request on this listener (`auto_accept` off), oldest first,
    /// for the application to answer: [`Request::accept`], [`Request::reject`], or
    /// dropped (rejected). A request that timed out
    /// ([`ListenOptions::request_timeout`]) or whose peer gave up before it was taken
    /// never comes out. Ends with [`ConnError::ListenerClosed`] once its device went
    /// away; on a listener that accepts by itself: [`ConnError::InvalidOptions`].
    /// Cancellation-safe: a request is taken only by the call that returns it.
    pub async fn next_request(&self) -> Result<Request<T>, ConnError> {
        let id = self.id;
        let taken = self
            .owner
            .shared
            .wait(WaitOn::Requests(id), |core| core.try_request(id))
            .await?;
        Ok(Request::new(taken, id, &self.owner))
    }

    /// [`Listener::next_request`] on the calling thread, at most `timeout` (`None`: as
    /// long as it takes; [`ConnError::Timeout`] when it passed).
    pub fn blocking_next_request(
        &self,
        timeout: Option<Duration>,
    ) -> Result<Request<T>, ConnError> {
        let id = self.id;
        let taken = self
            .owner
            .shared
            .blocking_wait(timeout, WaitOn::Requests(id), |core| core.try_request(id))?;
        Ok(Request::new(taken, id, &self.owner))
    }
}

impl<T: Transport> Drop for Listener<T> {
    fn drop(&mut self) {
        let id = self.id;
        self.owner.shared.with(|core| core.close_listener(id));
    }
}

/// One connection, as a value: [`Send`] (when `Endpoint<T>` is: generic code says
/// `where Endpoint<T>: Send`, which the real and the simulated transports meet), cheap to clone
/// (clones share it), usable from a thread or a task of its own. The last clone
/// dropped disconnects it.
///
/// At most one call should wait to receive and one to send at a time; more are
/// allowed and each is woken, but they take turns.
pub struct Connection<T: Transport> {
    inner: Arc<ConnInner<T>>,
}

struct ConnInner<T: Transport> {
    id: ConnectionId,
    owner: Arc<Owner<T>>,
    /// How it was established, once known: kept after the endpoint has forgotten the
    /// connection (its close reported), since it stays true.
    established: OnceLock<EstablishedVia>,
    /// The peer's private data, once known: kept likewise, after the peer left.
    peer_private: OnceLock<PrivateData>,
}

impl<T: Transport> Drop for ConnInner<T> {
    fn drop(&mut self) {
        let id = self.id;
        self.owner.shared.with(|core| core.release(id));
    }
}

impl<T: Transport> Clone for Connection<T> {
    fn clone(&self) -> Self {
        Connection {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T: Transport> fmt::Debug for Connection<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl<T: Transport> Connection<T> {
    fn new(id: ConnectionId, owner: &Arc<Owner<T>>) -> Self {
        Connection {
            inner: Arc::new(ConnInner {
                id,
                owner: Arc::clone(owner),
                established: OnceLock::new(),
                peer_private: OnceLock::new(),
            }),
        }
    }

    /// A connection `accept` (or a request's) returns, established `via`, the peer's
    /// private data `peer`.
    fn accepted(
        id: ConnectionId,
        via: Option<EstablishedVia>,
        peer: Option<PrivateData>,
        owner: &Arc<Owner<T>>,
    ) -> Self {
        let conn = Self::new(id, owner);
        if let Some(via) = via {
            let _ = conn.inner.established.set(via);
        }
        if let Some(peer) = peer {
            let _ = conn.inner.peer_private.set(peer);
        }
        conn
    }

    /// Keeps the peer's private data once the endpoint knows it (an active connection:
    /// once established), so that it outlives the endpoint's record.
    fn note_peer_private(&self, endpoint: &Endpoint<T>) {
        if self.inner.peer_private.get().is_none() {
            if let Some(data) = endpoint.peer_private_data(self.inner.id) {
                let _ = self.inner.peer_private.set(data);
            }
        }
    }

    /// For `established`: the endpoint's answer, kept once it is known, and answered
    /// again after the endpoint has forgotten the connection.
    fn take_established(&self, core: &mut Core<T>) -> Option<Result<EstablishedVia, ConnError>> {
        let known = &self.inner.established;
        match core.endpoint_mut().try_established(self.inner.id) {
            Some(Ok(via)) => {
                let _ = known.set(via);
                self.note_peer_private(core.endpoint());
                Some(Ok(via))
            }
            Some(Err(ConnError::UnknownConnection(_))) if known.get().is_some() => {
                known.get().copied().map(Ok)
            }
            answer => answer,
        }
    }

    fn shared(&self) -> &Shared<T> {
        &self.inner.owner.shared
    }

    /// The endpoint's name for it.
    pub fn id(&self) -> ConnectionId {
        self.inner.id
    }

    /// What the endpoint knows of it (see [`Endpoint::info`]).
    pub fn info(&self) -> Result<ConnectionInfo<T::Addr>, ConnError> {
        self.shared().lock().endpoint_mut().info(self.inner.id)
    }

    /// What it carried (see [`Endpoint::traffic`]): while it lives, and once closed
    /// until its close is taken.
    pub fn traffic(&self) -> Result<crate::Traffic, ConnError> {
        self.shared().lock().endpoint_mut().traffic(self.inner.id)
    }

    /// How it became established, once it is (`None` before, or if it never was; for
    /// an accepted connection it always is). Established is a fact about the past: the
    /// answer stays after the connection closed.
    pub fn established_via(&self) -> Option<EstablishedVia> {
        let known = &self.inner.established;
        if let Some(via) = known.get() {
            return Some(*via);
        }
        let core = self.shared().lock();
        let via = core.endpoint().established_via(self.inner.id)?;
        self.note_peer_private(core.endpoint());
        Some(*known.get_or_init(|| via))
    }

    /// The peer's private data: on an accepted connection the REQ's, on a connected one
    /// the REP's (`None` until it is established). Kept once known, also after the peer
    /// left. On the real kernel it comes padded with zeros to the CM message's room
    /// ([`PrivateData::MAX_REQ`], [`PrivateData::MAX_REP`]): compare a prefix.
    pub fn peer_private_data(&self) -> Option<&PrivateData> {
        let known = &self.inner.peer_private;
        if known.get().is_none() {
            self.note_peer_private(self.shared().lock().endpoint());
        }
        known.get()
    }

    /// Runs `f` with its CM id, for what this API does not wrap (its QP, protection
    /// domain and device, to register memory of the application's own), holding the
    /// endpoint meanwhile.
    pub fn with_id<R>(&self, f: impl FnOnce(&T::Id) -> R) -> Result<R, ConnError> {
        let core = self.shared().lock();
        Ok(f(core.endpoint().cm_id(self.inner.id)?))
    }

    /// A receive completed on its QP, which the application made and reads itself
    /// ([`Request::with_id`]): the endpoint's notify path takes it as its trigger
    /// while the connection is not established (see [`Endpoint::received`]); after
    /// that it does nothing. O(1).
    pub fn received(&self) -> Result<(), ConnError> {
        let id = self.inner.id;
        self.shared().with(|core| core.endpoint_mut().received(id))
    }

    /// Waits until it is established (after [`EndpointHandle::connect`]) and says how;
    /// once it was, it answers so for good, also after the peer has left (the close
    /// comes from [`Connection::recv`]). [`ConnError::Closed`] if it closed before it
    /// got established. Cancellation-safe.
    pub async fn established(&self) -> Result<EstablishedVia, ConnError> {
        let id = self.inner.id;
        self.shared()
            .wait(WaitOn::Conn(id), |core| self.take_established(core))
            .await
    }

    /// [`Connection::established`] on the calling thread, at most `timeout`.
    pub fn blocking_established(
        &self,
        timeout: Option<Duration>,
    ) -> Result<EstablishedVia, ConnError> {
        let id = self.inner.id;
        self.shared()
            .blocking_wait(timeout, WaitOn::Conn(id), |core| {
                self.take_established(core)
            })
    }

    /// The next message (taking it posts its receive again). After the last message of
    /// a connection that closed: [`ConnError::Closed`], then
    /// [`ConnError::UnknownConnection`]. Cancellation-safe: a message is taken only by
    /// the call that returns it.
    pub async fn recv(&self) -> Result<Vec<u8>, ConnError> {
        let id = self.inner.id;
        self.shared()
            .wait(WaitOn::Conn(id), |core| core.endpoint_mut().try_recv(id))
            .await
    }

    /// [`Connection::recv`] on the calling thread, at most `timeout`.
    pub fn blocking_recv(&self, timeout: Option<Duration>) -> Result<Vec<u8>, ConnError> {
        let id = self.inner.id;
        self.shared()
            .blocking_wait(timeout, WaitOn::Conn(id), |core| {
                core.endpoint_mut().try_recv(id)
            })
    }

    /// Sends one message, waiting for a free send buffer if every one is in flight.
    /// Cancellation-safe: dropped before it answers, nothing was sent.
    pub async fn send(&self, data: &[u8]) -> Result<(), ConnError> {
        let id = self.inner.id;
        self.shared()
            .wait(WaitOn::Conn(id), |core| core.try_send(id, data))
            .await
    }

    /// [`Connection::send`] on the calling thread, at most `timeout`.
    pub fn blocking_send(&self, data: &[u8], timeout: Option<Duration>) -> Result<(), ConnError> {
        let id = self.inner.id;
        self.shared()
            .blocking_wait(timeout, WaitOn::Conn(id), |core| core.try_send(id, data))
    }

    /// Sends one message if a send buffer is free: [`ConnError::SendQueueFull`] when
    /// every one is in flight. Never waits.
    pub fn try_send(&self, data: &[u8]) -> Result<(), ConnError> {
        let id = self.inner.id;
        self.shared()
            .with(|core| core.endpoint_mut().send(id, data))
    }

    /// The next completion of the application's own one-sided work on it (work requests
    /// posted through [`Connection::with_id`] with [`crate::APPLICATION_WR_ID`] set; see
    /// [`Endpoint::take_work_completion`]). Cancellation-safe.
    pub async fn work_completed(&self) -> Result<WorkCompletion, ConnError> {
        let id = self.inner.id;
        self.shared()
            .wait(WaitOn::Conn(id), |core| take_work(core.endpoint_mut(), id))
            .await
    }

    /// [`Connection::work_completed`] on the calling thread, at most `timeout`.
    pub fn blocking_work_completed(
        &self,
        timeout: Option<Duration>,
    ) -> Result<WorkCompletion, ConnError> {
        let id = self.inner.id;
        self.shared()
            .blocking_wait(timeout, WaitOn::Conn(id), |core| {
                take_work(core.endpoint_mut(), id)
            })
    }

    /// Closes it gracefully: what was sent is delivered first, then the DREQ
    /// ([`Endpoint::close_gracefully`](crate::Endpoint::close_gracefully)); its sends
    /// are refused from now on, and the other clones answer
    /// [`ConnError::UnknownConnection`] once it is gone. Dropping the last clone closes
    /// it so too.
    pub fn close(self) -> Result<(), ConnError> {
        let id = self.inner.id;
        self.shared().with(|core| core.close(id))
    }

    /// Disconnects it now, the forced close: sends still in flight are lost (the other
    /// clones then answer [`ConnError::UnknownConnection`]).
    pub fn abort(self) -> Result<(), ConnError> {
        let id = self.inner.id;
        self.shared().with(|core| core.disconnect(id))
    }
}
