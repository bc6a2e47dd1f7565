//! The vocabulary of the connection API: handles, options, events and errors.

use std::num::NonZeroU64;
use std::time::Duration;

use cm_core::{AsyncEvent, CmError, NotifyError, QpNum, RejectReason};

use super::PrivateData;

use crate::{Role, Trigger};

/// Names one connection of an [`Endpoint`](crate::Endpoint). A handle of a connection
/// that is gone names nothing (every call on it answers [`ConnError::UnknownConnection`]),
/// even when its slot is reused.
// Stored one above `generation << 32 | index`: never zero, so an `Option` of it is
// eight bytes too (the order is the same).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(NonZeroU64);

/// `generation << 32 | index`, stored one above so that it is never zero. The slot
/// index never reaches `u32::MAX` (the slot table would hold four billion entries).
fn packed(index: u32, generation: u32) -> NonZeroU64 {
    NonZeroU64::new((u64::from(generation) << 32 | u64::from(index)).wrapping_add(1))
        .expect("a slot index below u32::MAX")
}

fn unpacked(raw: NonZeroU64) -> (usize, u32) {
    let value = raw.get() - 1;
    ((value & u64::from(u32::MAX)) as usize, (value >> 32) as u32)
}

/// Writes `Name(index.generation)`: the slot and generation `Display` shows, not the
/// stored value (one above the packed pair), which would name another slot.
fn debug_packed(name: &str, raw: NonZeroU64, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    let (index, generation) = unpacked(raw);
    write!(f, "{name}({index}.{generation})")
}

impl ConnectionId {
    pub(crate) fn new(index: u32, generation: u32) -> Self {
        ConnectionId(packed(index, generation))
    }

    pub(crate) fn index(self) -> usize {
        unpacked(self.0).0
    }

    /// The handle's slot in its endpoint: connections held at the same time have
    /// distinct slots, and a slot is reused once its connection is gone, so slots stay
    /// below the most connections the endpoint held at once. An application can key a
    /// dense table by it (checking the full handle, as a reused slot names another
    /// connection).
    pub fn slot(self) -> usize {
        self.index()
    }

    pub(crate) fn generation(self) -> u32 {
        unpacked(self.0).1
    }

    /// The completion-queue token of this connection (never 0).
    pub(crate) fn token(self) -> u64 {
        self.0.get()
    }

    /// The connection a completion-queue token names (`None` for 0, which no
    /// connection's token is).
    pub(crate) fn from_token(token: u64) -> Option<Self> {
        NonZeroU64::new(token).map(ConnectionId)
    }
}

impl std::fmt::Debug for ConnectionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        debug_packed("ConnectionId", self.0, f)
    }
}

impl std::fmt::Display for ConnectionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "connection {}.{}", self.index(), self.generation())
    }
}

/// Names one listener of an [`Endpoint`](crate::Endpoint). A handle of a listener that
/// is gone names nothing (every call on it answers [`ConnError::UnknownListener`]), even
/// when a new listener takes its place.
// Stored as a `ConnectionId` is: an `Option` of it is eight bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ListenerId(NonZeroU64);

impl ListenerId {
    pub(crate) fn new(index: usize, generation: u32) -> Self {
        let index = u32::try_from(index).expect("fewer than u32::MAX listeners");
        ListenerId(packed(index, generation))
    }

    pub(crate) fn index(self) -> usize {
        unpacked(self.0).0
    }

    /// The handle's slot in its endpoint: connections held at the same time have
    /// distinct slots, and a slot is reused once its connection is gone, so slots stay
    /// below the most connections the endpoint held at once. An application can key a
    /// dense table by it (checking the full handle, as a reused slot names another
    /// connection).
    pub fn slot(self) -> usize {
        self.index()
    }

    pub(crate) fn generation(self) -> u32 {
        unpacked(self.0).1
    }
}

impl std::fmt::Debug for ListenerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        debug_packed("ListenerId", self.0, f)
    }
}

impl std::fmt::Display for ListenerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "listener {}.{}", self.index(), self.generation())
    }
}

/// How a connection became established.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EstablishedVia {
    /// The handshake completed on its own: the CM reported ESTABLISHED with no notify
    /// (the RTU arrived on InfiniBand and RoCE, the MPA exchange completed on iWARP,
    /// where nothing is lost for notify to rescue), or the REP was answered (active side).
    Handshake,
    /// The RTU was late or lost: `rdma_notify` forced the establish, after `Trigger`.
    Notify(Trigger),
    /// `rdma_notify` was called after `Trigger` but the RTU had won the race (EISCONN,
    /// harmless).
    RtuWonRace(Trigger),
    /// Passive side only: the CM never reported it established, because the peer's
    /// disconnect (DREQ) overtook both its lost RTU and this side's notify, so the CM
    /// reported DISCONNECTED straight from the REP. The peer's message stands for the
    /// establish: the peer can send only once it is established (after this side's
    /// REP), as a TCP segment that acknowledges the SYN-ACK completes the handshake
    /// when the final ACK was lost. The connection is reported established, its
    /// messages delivered, then its close ([`CloseReason::Disconnected`]).
    PeerMessage,
}

/// When a connection passed the steps of its setup, on the transport's clock
/// ([`Transport::now`](crate::Transport::now)). A step not (yet) passed, or one this
/// side never takes (address and route resolution on a passive side), is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ConnTimes {
    /// [`Endpoint::connect`](crate::Endpoint::connect) was called (active side), or the
    /// connection request was handled (passive side).
    pub started: Duration,
    /// ADDR_RESOLVED was handled (active side).
    pub addr_resolved: Option<Duration>,
    /// ROUTE_RESOLVED was handled (active side).
    pub route_resolved: Option<Duration>,
    /// QP creation began (`rdma_create_qp` called).
    pub create_qp_called: Option<Duration>,
    /// QP creation returned.
    pub qp_created: Option<Duration>,
    /// `rdma_connect` (active) or `rdma_accept` (passive) was called, after the buffers
    /// were registered and the receives posted.
    pub connect_called: Option<Duration>,
    /// `rdma_connect` or `rdma_accept` returned.
    pub connect_returned: Option<Duration>,
    /// The connection was found established (the event or the notify that did it).
    pub established: Option<Duration>,
}

/// What a connection's messages carried, counted by the endpoint ([`Endpoint::send`]
/// and the receives it posts; the application's own work requests, posted with
/// [`APPLICATION_WR_ID`](crate::APPLICATION_WR_ID), are the application's to count).
/// Counted from the start, never reset: a service that logs rates takes differences.
///
/// [`Endpoint::send`]: crate::Endpoint::send
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Traffic {
    /// Messages [`Endpoint::send`](crate::Endpoint::send) posted to the QP.
    pub messages_sent: u64,
    /// Their bytes.
    pub bytes_sent: u64,
    /// Messages that arrived, taken by the application or not.
    pub messages_received: u64,
    /// Their bytes.
    pub bytes_received: u64,
}

impl Traffic {
    /// Counts one message of `len` bytes sent.
    pub(super) fn count_sent(&mut self, len: usize) {
        self.messages_sent += 1;
        self.bytes_sent += len as u64;
    }

    /// Counts one message of `len` bytes received.
    pub(super) fn count_received(&mut self, len: usize) {
        self.messages_received += 1;
        self.bytes_received += len as u64;
    }
}

/// Why a connection (or a listener) ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloseReason {
    /// Disconnected by the peer (DREQ) or by this side.
    Disconnected,
    /// The peer refused the connection.
    Rejected {
        /// The IB CM reason.
        reason: RejectReason,
        /// The peer's private data in the REJ.
        private_data: PrivateData,
    },
    /// The peer never answered (REP or REQ retries exhausted); the status is the
    /// event's negative errno (usually -ETIMEDOUT).
    Unreachable {
        /// The event's status.
        status: i32,
    },
    /// Address resolution failed (status: negative errno).
    AddressError {
        /// The event's status.
        status: i32,
    },
    /// Route resolution failed (status: negative errno).
    RouteError {
        /// The event's status.
        status: i32,
    },
    /// The CM reported a connection error (status: negative errno).
    ConnectError {
        /// The event's status.
        status: i32,
    },
    /// The RDMA device went away (RDMA_CM_EVENT_DEVICE_REMOVAL); everything on it is
    /// torn down so that the kernel's removal completes.
    DeviceRemoved,
    /// The device reported a fatal error (IBV_EVENT_DEVICE_FATAL).
    DeviceFatal,
    /// Reading the device failed (its asynchronous events or completion channel
    /// answered an error): it is taken as lost, and everything on it ends.
    DeviceFailed(CmError),
    /// The connection's QP went to the error state (an asynchronous QP error or a
    /// failed work completion, e.g. retries exceeded because the peer is gone), or one
    /// of its completion queues could not be re-armed, so that it would report nothing
    /// more.
    QpError {
        /// What reported it: an asynchronous event, or a completion status.
        detail: QpErrorDetail,
    },
    /// The connect or establish deadline passed.
    TimedOut,
    /// Setting the connection up failed (QP creation, memory registration, accept…).
    SetupFailed(CmError),
    /// The application rejected the request.
    RejectedHere,
    /// On shared queues ([`EndpointOptions::shared_queues`]), the peer sent a message
    /// while `depth` (the connection's receive depth) were waiting untaken: a shared
    /// receive queue cannot hold one peer back, so the connection ends rather than
    /// hold without bound or take the other connections' buffers. A peer that keeps
    /// within the receive depth (its own credits, request and answer) never meets it.
    ReceiveOverrun {
        /// The connection's receive depth.
        depth: u32,
    },
}

/// What reported a QP error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QpErrorDetail {
    /// An asynchronous event on the QP (QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR).
    AsyncEvent(AsyncEvent),
    /// A work completion that ended with this status.
    Completion(cm_core::WcStatus),
    /// Re-arming the completion notification of one of the connection's queues
    /// (`ibv_req_notify_cq`) failed: no completion on it would raise an event again.
    ArmFailed {
        /// The queue.
        kind: cm_core::CqKind,
        /// What the call answered.
        errno: cm_core::Errno,
    },
}

/// Something the endpoint reports, in the order it happened per connection.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A connection request to a listener with `auto_accept` off: answer it with
    /// `accept_request` or `reject_request`.
    Request {
        /// The listener it came to.
        listener: ListenerId,
        /// The connection to answer.
        conn: ConnectionId,
        /// The REQ's private data.
        private_data: PrivateData,
    },
    /// An active connection made with
    /// [`ConnectOptions::application_qp`](crate::ConnectOptions::application_qp): its route is
    /// resolved, and it waits for the application to make its QP on
    /// [`Endpoint::cm_id`](crate::Endpoint::cm_id) and call
    /// [`Endpoint::connect_application_qp`](crate::Endpoint::connect_application_qp),
    /// which sends the REQ (until then the connection's `timeout` runs).
    RouteResolved {
        /// The connection.
        conn: ConnectionId,
    },
    /// The connection is established: reported exactly once per connection, whichever
    /// of RTU, COMM_EST and receive completion came first.
    Established {
        /// The connection.
        conn: ConnectionId,
        /// Passive (accepted) or active (connected).
        role: Role,
        /// How it got there.
        via: EstablishedVia,
        /// The peer's private data (the REQ's for a passive side, the REP's for an
        /// active side).
        private_data: PrivateData,
    },
    /// Messages sent with [`Endpoint::send`](crate::Endpoint::send) completed: the
    /// peer's queue pair acknowledged them and their send buffers are free again. One
    /// event stands for every completion since the last one was taken. On shared
    /// queues `completed` may be 0: a send of this connection was refused because the
    /// device's send pool was all in flight ([`ConnError::SendQueueFull`]), and a
    /// buffer has come free for it (the refused connections are answered in turn, one
    /// per buffer freed), so it can send again.
    Sent {
        /// The connection.
        conn: ConnectionId,
        /// Sends completed since the last [`Event::Sent`] of the connection.
        completed: u32,
    },
    /// A message arrived. Messages that arrive before the connection is reported
    /// established are held and reported right after [`Event::Established`].
    Received {
        /// The connection.
        conn: ConnectionId,
        /// The message.
        data: Vec<u8>,
    },
    /// The connection ended; its handle names nothing any more.
    Closed {
        /// The connection.
        conn: ConnectionId,
        /// Why.
        reason: CloseReason,
    },
    /// The listener ended (its device was removed); its handle names nothing any more.
    ListenerClosed {
        /// The listener.
        listener: ListenerId,
        /// Why.
        reason: CloseReason,
    },
    /// A device event that belongs to no connection (port up/down, device fatal, GID
    /// change…), for the application to see.
    Device(AsyncEvent),
    /// Reading a device failed: it is taken as lost (its listeners and connections
    /// end with [`CloseReason::DeviceFailed`], reported after this), and the endpoint
    /// goes on with its other devices.
    DeviceFailed {
        /// The read's error, errno kept.
        error: CmError,
    },
    /// A request to a listener with automatic accept could not be set up (QP creation,
    /// memory registration, `rdma_accept`…): it was rejected, and this says why (e.g.
    /// ENOMEM once pinned memory passes RLIMIT_MEMLOCK). The connection was never
    /// reported, so no handle names it.
    AcceptFailed {
        /// The listener the request came to.
        listener: ListenerId,
        /// What failed, errno kept.
        error: CmError,
    },
    /// `rdma_notify` answered an error the notify path could not use (the connection
    /// carries on; a later trigger retries if the error was transient).
    NotifyFailed {
        /// The connection.
        conn: ConnectionId,
        /// The QP.
        qp: QpNum,
        /// The kernel's answer.
        error: NotifyError,
    },
    /// The CM reported ADDR_CHANGE on the connection: the network device under its
    /// address changed its hardware address, as when a bond fails over to another
    /// port. The connection stays as it is (the kernel does not end it); an
    /// application that wants the new path reconnects. Several changes before this is
    /// taken are one event; [`ConnectionInfo::address_changes`](crate::ConnectionInfo::address_changes) counts them all.
    AddressChanged {
        /// The connection.
        conn: ConnectionId,
    },
    /// The same on a listener (an endpoint-wide event): it keeps listening.
    ListenerAddressChanged {
        /// The listener.
        listener: ListenerId,
    },
}

impl Event {
    /// The connection it is about; `None` for an endpoint-wide event.
    pub fn conn(&self) -> Option<ConnectionId> {
        match self {
            Event::Request { conn, .. }
            | Event::RouteResolved { conn }
            | Event::Established { conn, .. }
            | Event::Sent { conn, .. }
            | Event::Received { conn, .. }
            | Event::Closed { conn, .. }
            | Event::NotifyFailed { conn, .. }
            | Event::AddressChanged { conn } => Some(*conn),
            _ => None,
        }
    }
}

/// What went wrong in a call of the connection API.
///
/// Converts into [`std::io::Error`] for code written against `io::Result`: a backend
/// call's error ([`ConnError::Cm`]) converts as its [`CmError`] does (an errno becomes
/// the OS error, [`std::io::Error::raw_os_error`]); the endpoint's end
/// ([`ConnError::Endpoint`]) takes the kind of its errno and keeps this error as the
/// source, so that [`ConnError::ends_endpoint`] can still be asked; the others map to
/// the nearest [`std::io::ErrorKind`] (an unknown handle `NotFound`, a wrong state
/// `NotConnected`, data that does not fit `InvalidInput`, a full send queue
/// `WouldBlock`, a timeout `TimedOut`, a wait cut short by a waker `Interrupted`, a closed
/// connection by its reason: disconnected `ConnectionReset`, rejected
/// `ConnectionRefused`, unreachable or timed out `TimedOut`, otherwise
/// `ConnectionAborted`, as is a closed listener), with the error as its source.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnError {
    /// A backend call made for this call's connection or listener failed (errno kept);
    /// the endpoint goes on.
    #[error(transparent)]
    Cm(#[from] CmError),
    /// The endpoint's own source failed: reading its CM event channel, or waiting
    /// (errno kept). Nothing more will come from it: stop serving
    /// ([`ConnError::ends_endpoint`]). A read of the channel that answers ENOMEM is
    /// not this: it is logged and retried on the next pass.
    #[error("the endpoint cannot go on: {0}")]
    Endpoint(CmError),
    /// The handle names no live connection.
    #[error("{0:?} names no live connection")]
    UnknownConnection(ConnectionId),
    /// The handle names no live listener.
    #[error("{0:?} names no live listener")]
    UnknownListener(ListenerId),
    /// The connection is not in a state that allows the call (e.g. send before
    /// established, accept twice).
    #[error("{conn}: {what} needs the connection {needs}")]
    WrongState {
        /// The connection.
        conn: ConnectionId,
        /// The call.
        what: &'static str,
        /// What it needs.
        needs: &'static str,
    },
    /// Private data longer than the message has room for.
    #[error("{len} bytes of private data do not fit a {message} (at most {max})")]
    PrivateDataTooLong {
        /// The CM message.
        message: &'static str,
        /// Bytes given.
        len: usize,
        /// Room in the message.
        max: usize,
    },
    /// A message longer than the connection's buffers.
    #[error("a {len}-byte message does not fit the {max}-byte buffers")]
    MessageTooLarge {
        /// Bytes given.
        len: usize,
        /// The buffer size.
        max: usize,
    },
    /// Options that the call cannot work with (what is wrong is said).
    #[error("invalid options: {0}")]
    InvalidOptions(&'static str),
    /// Every send buffer is in flight: wait for events (sends complete) and retry.
    #[error("{0}: every send buffer is in flight")]
    SendQueueFull(ConnectionId),
    /// The deadline passed before the awaited event.
    #[error("timed out")]
    Timeout,
    /// An [`EndpointWaker`](crate::EndpointWaker) cut the wait short.
    #[error("woken")]
    Woken,
    /// A listener ended (its device went away) while [`Endpoint::accept`](crate::Endpoint::accept) waited.
    #[error("{listener} closed: {reason:?}")]
    ListenerClosed {
        /// The listener.
        listener: ListenerId,
        /// Why.
        reason: CloseReason,
    },
    /// The connection ended while a call waited on it.
    #[error("{conn} closed: {reason:?}")]
    Closed {
        /// The connection.
        conn: ConnectionId,
        /// Why.
        reason: CloseReason,
    },
}

/// How an [`Endpoint`](crate::Endpoint) waits, and where its connections' queues live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct EndpointOptions {
    /// Busy polling: a waiting call spins on its sources (non-blocking reads) for up
    /// to this long before it sleeps in the transport, as latency-bound RDMA servers
    /// do; it trades a core for the wake-up latency. Each round first polls the
    /// receive queues of the connections accepted with it on and not yet established
    /// (no list of them is kept with it off; at most
    /// [`PASS_BATCH`](crate::PASS_BATCH) of them, in turn): a receive there is
    /// forwarded with notify at once and the CM channel read for its ESTABLISHED,
    /// without waiting for the completion event; then each device's shared completion
    /// queues are polled (a message taken without the completion channel's reads; the
    /// queues are left unarmed while spinning and armed again before the call returns);
    /// every eighth round one zero-timeout look at every source says which to read. Between rounds the thread yields its
    /// CPU (`sched_yield`), so that kernel work the connection waits for (a software
    /// device's packets, the CM's worker) is not held off for a scheduler slice.
    /// `None` (the default): sleep at once.
    pub busy_poll: Option<Duration>,
    /// Queues every connection on a device context shares, of these sizes: one shared
    /// receive queue with one registered receive pool, one send pool and one send and
    /// one receive completion queue per device, made with its first connection. A
    /// connection then has only its QP: its accept path registers nothing and creates
    /// no completion queue, and registered memory does not grow with connections (the
    /// default sizes register 5 MiB per device, under an 8 MiB `RLIMIT_MEMLOCK`).
    /// A connection whose messages are larger than the pool's `buffer_size` keeps
    /// queues of its own; what a connection holds stays bounded by its receive depth
    /// ([`CloseReason::ReceiveOverrun`] past it: nothing on a shared queue holds one
    /// peer back, where its own queue would make it meet RNR). A device that cannot
    /// make them (no SRQ) keeps per-connection queues, logged once. The default:
    /// [`SharedCaps::default`](crate::SharedCaps::default). `None`
    /// ([`EndpointOptions::own_queues`]): each connection has its own queues, buffers
    /// and posted receives, and a slow reader holds its peer back with RNR.
    pub shared_queues: Option<cm_core::SharedCaps>,
}

impl Default for EndpointOptions {
    /// Sleep at once (no busy polling); connections on shared queues of the default
    /// sizes.
    fn default() -> Self {
        EndpointOptions {
            busy_poll: None,
            shared_queues: Some(cm_core::SharedCaps::default()),
        }
    }
}

impl EndpointOptions {
    /// The defaults, with each connection on queues and buffers of its own
    /// ([`EndpointOptions::shared_queues`] `None`).
    pub fn own_queues() -> Self {
        EndpointOptions {
            shared_queues: None,
            ..EndpointOptions::default()
        }
    }

    /// These options with each connection on queues and buffers of its own.
    pub fn with_own_queues(mut self) -> Self {
        self.shared_queues = None;
        self
    }

    /// The defaults, with busy polling for up to `budget` per wait.
    pub fn busy_poll(budget: Duration) -> Self {
        EndpointOptions {
            busy_poll: Some(budget),
            ..EndpointOptions::default()
        }
    }

    /// The defaults, with every device's connections on shared queues of `caps`
    /// ([`EndpointOptions::shared_queues`]).
    pub fn shared_queues(caps: cm_core::SharedCaps) -> Self {
        EndpointOptions {
            shared_queues: Some(caps),
            ..EndpointOptions::default()
        }
    }

    /// These options with the connections on shared queues of `caps`.
    pub fn with_shared_queues(mut self, caps: cm_core::SharedCaps) -> Self {
        self.shared_queues = Some(caps);
        self
    }
}

/// What an [`Endpoint`](crate::Endpoint) holds for the application, with the bound of
/// each ([`Endpoint::stats`](crate::Endpoint::stats)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct EndpointStats {
    /// Live connections.
    pub connections: usize,
    /// Connections closed whose close is not yet reported (at most
    /// [`CLOSED_BACKLOG`](crate::CLOSED_BACKLOG)).
    pub closed_unreported: usize,
    /// Messages received and not yet taken, over every connection (at most each
    /// connection's receive depth).
    pub held_messages: usize,
    /// Endpoint-wide events not yet taken (at most
    /// [`ENDPOINT_EVENT_BACKLOG`](crate::ENDPOINT_EVENT_BACKLOG)).
    pub endpoint_events: usize,
    /// Entries of the ready queue, stale ones included (at most about twice the
    /// connections and endpoint events, plus 64).
    pub ready_entries: usize,
    /// Entries of `accept`'s queue, stale ones included (the same bound).
    pub accept_entries: usize,
    /// Deadlines kept, stale ones included (at most about twice the connections, plus
    /// 64).
    pub deadline_entries: usize,
    /// Accepted connections kept for busy polling to poll their receive queues, stale
    /// ones included (the same bound; kept while notify is on, read only while busy
    /// polling).
    pub awaiting_entries: usize,
    /// Requests read from the CM channel and waiting for their setup, stale ones
    /// included (at most each auto-accepting listener's
    /// [`ListenOptions::max_in_setup`](crate::ListenOptions::max_in_setup), plus the stale).
    pub setup_entries: usize,
    /// Ids of ended connections not yet destroyed: those that ended while the CM
    /// channel was read wait for the end of the pass, or for a pass that leaves no
    /// full batch of events unread (at most
    /// [`DEFERRED_DESTROY_MAX`](crate::DEFERRED_DESTROY_MAX)): destroying an
    /// id makes the kernel walk every event still unread on the channel.
    pub ended_ids: usize,
    /// Events dropped because a bound was reached.
    pub dropped_events: u64,
    /// Connection requests rejected at once because their listener had
    /// [`ListenOptions::max_in_setup`](crate::ListenOptions::max_in_setup) connections in setup.
    pub requests_refused: u64,
    /// Device contexts whose connections share queues
    /// ([`EndpointOptions::shared_queues`]).
    pub shared_queue_devices: usize,
    /// Send buffers of the shared pools not in flight, over every device.
    pub shared_sends_free: usize,
    /// `IBV_EVENT_SRQ_LIMIT_REACHED` events seen: the shared receive pool ran low
    /// because completions came faster than they were read.
    pub srq_limit_events: u64,
    /// QPs made ahead of requests and ready now, over every device
    /// ([`SharedCaps::ready_qps`](crate::SharedCaps::ready_qps)).
    pub ready_qps: usize,
    /// Connections (accepted or connecting) that took a QP made ahead
    /// ([`SharedCaps::ready_qps`](crate::SharedCaps::ready_qps)), over the endpoint's life.
    pub ready_qps_taken: u64,
}

impl EndpointStats {
    /// Everything still to be reported or taken, counted once per entry.
    pub fn queued(&self) -> usize {
        self.closed_unreported + self.held_messages + self.endpoint_events
    }
}

impl ConnError {
    /// Whether the endpoint itself failed ([`ConnError::Endpoint`]): stop serving.
    /// Every other error concerns one call, connection or listener, and the endpoint
    /// goes on, so a server that serves many connections handles those where they
    /// happen rather than with `?` on its loop.
    pub fn ends_endpoint(&self) -> bool {
        matches!(self, ConnError::Endpoint(_))
    }
}

impl From<ConnError> for std::io::Error {
    fn from(error: ConnError) -> Self {
        use std::io::ErrorKind;
        let kind = match &error {
            // Cheap: a CM error is a few words, all `Copy`.
            ConnError::Cm(cm) => return std::io::Error::from(cm.clone()),
            ConnError::Endpoint(cm) => std::io::Error::from_raw_os_error(cm.errno()).kind(),
            ConnError::UnknownConnection(_) | ConnError::UnknownListener(_) => ErrorKind::NotFound,
            ConnError::WrongState { .. } => ErrorKind::NotConnected,
            ConnError::PrivateDataTooLong { .. }
            | ConnError::MessageTooLarge { .. }
            | ConnError::InvalidOptions(_) => ErrorKind::InvalidInput,
            ConnError::SendQueueFull(_) => ErrorKind::WouldBlock,
            ConnError::Timeout => ErrorKind::TimedOut,
            ConnError::Woken => ErrorKind::Interrupted,
            ConnError::ListenerClosed { .. } => ErrorKind::ConnectionAborted,
            ConnError::Closed { reason, .. } => match reason {
                CloseReason::Disconnected => ErrorKind::ConnectionReset,
                CloseReason::Rejected { .. } | CloseReason::RejectedHere => {
                    ErrorKind::ConnectionRefused
                }
                CloseReason::Unreachable { .. } | CloseReason::TimedOut => ErrorKind::TimedOut,
                _ => ErrorKind::ConnectionAborted,
            },
        };
        std::io::Error::new(kind, error)
    }
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;

    use super::*;

    fn kind(error: ConnError) -> ErrorKind {
        std::io::Error::from(error).kind()
    }

    #[test]
    fn handles_debug_as_the_slot_and_generation_they_display() {
        let conn = ConnectionId::new(0, 0);
        assert_eq!(format!("{conn:?}"), "ConnectionId(0.0)");
        assert_eq!(conn.to_string(), "connection 0.0");
        let conn = ConnectionId::new(7, 3);
        assert_eq!(format!("{conn:?}"), "ConnectionId(7.3)");
        let listener = ListenerId::new(2, 5);
        assert_eq!(format!("{listener:?}"), "ListenerId(2.5)");
        assert_eq!(listener.to_string(), "listener 2.5");
    }

    #[test]
    fn conn_errors_become_io_errors_of_the_nearest_kind_with_errno_kept() {
        let conn = ConnectionId::new(1, 0);
        let refused = CmError::from_errno("rdma_connect", 111);
        let io = std::io::Error::from(ConnError::Cm(refused.clone()));
        assert_eq!(io.kind(), ErrorKind::ConnectionRefused);
        assert_eq!(io.raw_os_error(), Some(111), "the errno is the OS error");
        let ended = ConnError::Endpoint(refused);
        let io = std::io::Error::from(ended.clone());
        assert_eq!(io.kind(), ErrorKind::ConnectionRefused);
        let source = io.get_ref().and_then(|e| e.downcast_ref::<ConnError>());
        assert_eq!(source, Some(&ended), "the endpoint's end is the source");
        assert!(source.is_some_and(ConnError::ends_endpoint));
        assert_eq!(
            kind(ConnError::UnknownConnection(conn)),
            ErrorKind::NotFound
        );
        assert_eq!(kind(ConnError::SendQueueFull(conn)), ErrorKind::WouldBlock);
        assert_eq!(kind(ConnError::Timeout), ErrorKind::TimedOut);
        let closed = |reason| ConnError::Closed { conn, reason };
        assert_eq!(
            kind(closed(CloseReason::Disconnected)),
            ErrorKind::ConnectionReset
        );
        assert_eq!(
            kind(closed(CloseReason::Unreachable { status: -110 })),
            ErrorKind::TimedOut
        );
        assert_eq!(
            kind(closed(CloseReason::DeviceRemoved)),
            ErrorKind::ConnectionAborted
        );
        assert_eq!(
            kind(ConnError::MessageTooLarge { len: 2, max: 1 }),
            ErrorKind::InvalidInput
        );
    }
}
