//! What a connection API needs from a backend: the RDMA CM calls, one device context's
//! event streams (asynchronous events and completion events) and a minimal data path.
//!
//! A [`Transport`] is a driver, not a set of objects: the connection layer owns its
//! handles (ids, events, devices, buffers) and passes them back in each call, so the
//! same engine runs over librdmacm/libibverbs and over a simulated fabric. Nothing here
//! reads a clock or waits: waiting, with a deadline, is [`Transport::wait`], which a
//! real backend implements with `poll(2)` and a simulation by running virtual time.

use core::fmt::Debug;
use core::hash::Hash;
use core::time::Duration;

use crate::{
    AsyncEvent, CmError, CmEvent, CmId, ConnectionParams, IdOption, PortSpace, QpNum, WcStatus,
};

/// Which of a connection's two completion queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CqKind {
    /// Completions of posted sends.
    Send,
    /// Completions of posted receives.
    Recv,
}

/// One work completion, copied out of the completion queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkCompletion {
    /// The work request id given when posting.
    pub wr_id: u64,
    /// The QP the work request was on.
    pub qp: QpNum,
    /// Which queue it completed on.
    pub kind: CqKind,
    /// How it ended.
    pub status: WcStatus,
    /// Bytes received (receive completions).
    pub byte_len: u32,
}

impl WorkCompletion {
    /// Whether the work request succeeded.
    pub const fn is_success(&self) -> bool {
        self.status.is_success()
    }

    /// Whether the QP was flushed (`IBV_WC_WR_FLUSH_ERR`): the connection went to the
    /// error state and this request never ran.
    pub const fn is_flush(&self) -> bool {
        matches!(self.status, WcStatus::WrFlushErr)
    }
}

/// Sizes of a connection's queues and buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QueueCaps {
    /// Receives kept posted at all times (each one buffer of `buffer_size` bytes).
    pub recv_depth: u32,
    /// Sends in flight at most (each one buffer of `buffer_size` bytes).
    pub send_depth: u32,
    /// Bytes of every send and receive buffer: the largest message.
    pub buffer_size: u32,
    /// One-sided work requests (RDMA READ/WRITE) the application may have in flight on
    /// the QP's send queue besides the messages (0: none). The queue and its completion
    /// queue are made this much deeper; their completions go to the application.
    pub work_depth: u32,
}

impl Default for QueueCaps {
    /// 16 receives, 16 sends, 4 KiB messages, no one-sided work.
    fn default() -> Self {
        QueueCaps {
            recv_depth: 16,
            send_depth: 16,
            buffer_size: 4096,
            work_depth: 0,
        }
    }
}

impl QueueCaps {
    /// Checks the sizes: every depth at least 1, buffers of 1 byte to 1 GiB, and the
    /// whole buffer area addressable.
    pub fn validate(&self) -> Result<(), CmError> {
        let invalid = |reason| {
            Err(CmError::InvalidArgument {
                op: "QueueCaps",
                reason,
            })
        };
        if self.recv_depth == 0 || self.send_depth == 0 {
            return invalid("queue depths must be at least 1");
        }
        if self.recv_depth > 1 << 14 || self.send_depth > 1 << 14 || self.work_depth > 1 << 14 {
            return invalid("queue depths above 16384");
        }
        if self.buffer_size == 0 || self.buffer_size > 1 << 30 {
            return invalid("buffer size must be 1 byte to 1 GiB");
        }
        if self.area_len().is_none() {
            return invalid("buffer area larger than the address space");
        }
        Ok(())
    }

    /// Bytes of the whole buffer area: receive buffers, then send buffers.
    pub fn area_len(&self) -> Option<usize> {
        let slots = (self.recv_depth as usize).checked_add(self.send_depth as usize)?;
        slots.checked_mul(self.buffer_size as usize)
    }
}

/// Sizes of the queues every connection on one device context shares
/// ([`Transport::create_shared`]): one shared receive queue (SRQ) with its receive
/// buffers, one pool of send buffers, and one completion queue for each direction.
///
/// Memory registered is `(recv_slots + send_slots) * buffer_size` per device context,
/// however many connections use it: with the defaults, 5 MiB (1024 receive and 256
/// send buffers of 4 KiB), under the 8 MiB `RLIMIT_MEMLOCK` many systems give users.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SharedCaps {
    /// Receive buffers of the pool (each one buffer): the most receives the shared
    /// receive queue holds. The connection layer posts them as connections join, each
    /// bringing its receive depth, so the queue grows with the load up to this.
    pub recv_slots: u32,
    /// Send buffers shared by every connection's messages in flight.
    pub send_slots: u32,
    /// Bytes of every buffer: the largest message of a connection on these queues.
    pub buffer_size: u32,
    /// Receives posted below which the device raises `IBV_EVENT_SRQ_LIMIT_REACHED`
    /// (0: never armed). The endpoint re-posts a receive as soon as it has copied its
    /// message out, so the limit is reached only when completions come faster than
    /// they are read: a sign the pool is too small for the load.
    pub limit: u32,
    /// QPs the backend keeps made ahead of requests on these queues, so that an accept
    /// takes a ready QP instead of creating one while its peer waits for the REP (0:
    /// none; at most 1024). The real backend makes them on a thread of its own, started
    /// by a listener on the device ([`Transport::prepare_qps_shared`]) or else with the
    /// first QP, and refilled as they are taken; a backend with nothing to gain
    /// (the simulated fabric, which creates a QP at no cost) ignores it.
    pub ready_qps: u32,
}

impl Default for SharedCaps {
    /// 1024 receives, 256 send buffers, 4 KiB messages, limit at a sixteenth, 8 QPs
    /// made ahead.
    fn default() -> Self {
        SharedCaps {
            recv_slots: 1024,
            send_slots: 256,
            buffer_size: 4096,
            limit: 64,
            ready_qps: 8,
        }
    }
}

/// The most [`SharedCaps::ready_qps`]: QPs made ahead hold device resources while
/// nobody uses them.
pub const MAX_READY_QPS: u32 = 1024;

impl SharedCaps {
    /// Checks the sizes: each count 1 to 65536 (`limit` below `recv_slots`), buffers
    /// of 1 byte to 1 GiB, and the whole pool addressable.
    pub fn validate(&self) -> Result<(), CmError> {
        let invalid = |reason| {
            Err(CmError::InvalidArgument {
                op: "SharedCaps",
                reason,
            })
        };
        if self.recv_slots == 0 || self.send_slots == 0 {
            return invalid("shared queue sizes must be at least 1");
        }
        if self.recv_slots > 1 << 16 || self.send_slots > 1 << 16 {
            return invalid("shared queue sizes above 65536");
        }
        if self.limit >= self.recv_slots {
            return invalid("the SRQ limit must be below its receive count");
        }
        if self.buffer_size == 0 || self.buffer_size > 1 << 30 {
            return invalid("buffer size must be 1 byte to 1 GiB");
        }
        if self.pool_len().is_none() {
            return invalid("buffer pool larger than the address space");
        }
        if self.ready_qps > MAX_READY_QPS {
            return invalid("more than 1024 QPs made ahead");
        }
        Ok(())
    }

    /// Bytes of the registered pool: receive buffers, then send buffers.
    pub fn pool_len(&self) -> Option<usize> {
        let slots = (self.recv_slots as usize).checked_add(self.send_slots as usize)?;
        slots.checked_mul(self.buffer_size as usize)
    }
}

/// A backend the connection layer drives: one CM event channel and any number of
/// device contexts, ids, queue pairs and buffers.
///
/// Every method that names a handle gets it from the caller, which owns it; handles of
/// one transport are never given to another.
pub trait Transport {
    /// A peer or local address (`SocketAddr` on the real backend).
    type Addr: Copy + Debug + Eq;
    /// A CM id handle; clones name the same id.
    type Id: CmId + Clone + Debug;
    /// A CM event read from the channel.
    type Event: CmEvent + Debug;
    /// The state kept per device context: its asynchronous events and its completion
    /// events, each read by exactly one reader.
    type Device: Debug;
    /// The identity of a device context, to share one [`Transport::Device`] among every
    /// id on it.
    type DeviceKey: Copy + Eq + Hash + Debug;
    /// A connection's registered memory.
    type Buffers: Debug;
    /// The queues and registered pool a device context's connections share
    /// ([`Transport::create_shared`]); a transport without them names `()`.
    type Shared: Debug;

    // ----- the CM ----------------------------------------------------------------

    /// A new id on the transport's channel, in [`PortSpace::Tcp`].
    fn create_id(&mut self) -> Result<Self::Id, CmError>;
    /// A new id in `space`. The default makes [`PortSpace::Tcp`] ids only and refuses
    /// another space (EPROTONOSUPPORT, as a kernel without it answers).
    fn create_id_in(&mut self, space: PortSpace) -> Result<Self::Id, CmError> {
        match space {
            PortSpace::Tcp => self.create_id(),
            PortSpace::Ib => Err(CmError::from_errno("rdma_create_id", 93)),
        }
    }
    /// A number naming the id among the live ids of this transport (its address, its
    /// table index), to find an event's owner without comparing handles.
    fn id_key(&self, id: &Self::Id) -> usize;
    /// The next CM event, without waiting.
    fn next_cm_event(&mut self) -> Result<Option<Self::Event>, CmError>;
    /// The id an event is about (for CONNECT_REQUEST: the new id).
    fn event_id(&self, event: &Self::Event) -> Option<Self::Id>;
    /// Keeps `context` with `id` (rdma_cm's `id->context`), for
    /// [`Transport::event_context`] to give back with the id's events; whether it is
    /// kept. A transport that keeps none (the default) leaves the caller to find an
    /// event's id by [`Transport::id_key`].
    fn set_id_context(&mut self, id: &Self::Id, context: u32) -> bool {
        let _ = (id, context);
        false
    }
    /// The context last kept with the id an event is about ([`Transport::set_id_context`];
    /// `None`: none, or the transport keeps none). For CONNECT_REQUEST, the new id's.
    fn event_context(&self, event: &Self::Event) -> Option<u32> {
        let _ = event;
        None
    }
    /// For CONNECT_REQUEST: the listening id the request came to.
    fn event_listener(&self, event: &Self::Event) -> Option<Self::Id>;
    /// `rdma_bind_addr`.
    fn bind(&mut self, id: &Self::Id, addr: Self::Addr) -> Result<(), CmError>;
    /// `rdma_listen`.
    fn listen(&mut self, id: &Self::Id, backlog: u16) -> Result<(), CmError>;
    /// `rdma_set_option(id, RDMA_OPTION_ID, ..)`. A transport without options refuses
    /// every one (the default); callers make the call only for an option a user set.
    fn set_option(&mut self, id: &Self::Id, option: IdOption) -> Result<(), CmError> {
        let _ = (id, option);
        Err(CmError::InvalidArgument {
            op: "rdma_set_option",
            reason: "this transport takes no id options",
        })
    }
    /// Sets the RNR NAK timer of `id`'s QP, in RTS (`ibv_modify_qp` RTS to RTS with
    /// `IBV_QP_MIN_RNR_TIMER`; see [`ConnectionParams::min_rnr_timer`]). A transport
    /// without RNR NAKs refuses it (the default).
    fn set_min_rnr_timer(&mut self, id: &Self::Id, timer: u8) -> Result<(), CmError> {
        let _ = (id, timer);
        Err(CmError::InvalidArgument {
            op: "ibv_modify_qp",
            reason: "this transport has no RNR NAK timer",
        })
    }
    /// `rdma_resolve_addr` (ADDR_RESOLVED or ADDR_ERROR follows).
    fn resolve_addr(
        &mut self,
        id: &Self::Id,
        src: Option<Self::Addr>,
        dst: Self::Addr,
        timeout: Duration,
    ) -> Result<(), CmError>;
    /// `rdma_resolve_route` (ROUTE_RESOLVED or ROUTE_ERROR follows).
    fn resolve_route(&mut self, id: &Self::Id, timeout: Duration) -> Result<(), CmError>;
    /// `rdma_connect` with private data and the connection's parameters (sent in the
    /// REQ), already checked ([`ConnectionParams::validate`]).
    fn connect(
        &mut self,
        id: &Self::Id,
        private_data: &[u8],
        params: &ConnectionParams,
    ) -> Result<(), CmError>;
    /// `rdma_accept` with private data and this side's parameters (sent in the REP),
    /// already checked ([`ConnectionParams::validate`]).
    fn accept(
        &mut self,
        id: &Self::Id,
        private_data: &[u8],
        params: &ConnectionParams,
    ) -> Result<(), CmError>;
    /// `rdma_reject` with private data.
    fn reject(&mut self, id: &Self::Id, private_data: &[u8]) -> Result<(), CmError>;
    /// `rdma_disconnect`.
    fn disconnect(&mut self, id: &Self::Id) -> Result<(), CmError>;
    /// The id's local address, once bound or resolved.
    fn local_addr(&self, id: &Self::Id) -> Option<Self::Addr>;
    /// The id's peer address, once resolved or connected.
    fn peer_addr(&self, id: &Self::Id) -> Option<Self::Addr>;

    // ----- device contexts -------------------------------------------------------

    /// The device context the id is bound to, if any yet.
    fn device_key(&self, id: &Self::Id) -> Option<Self::DeviceKey>;
    /// Opens the reader state of the id's device context (asynchronous events and a
    /// completion channel). Called once per device context.
    fn open_device(&mut self, id: &Self::Id) -> Result<Self::Device, CmError>;
    /// The device's next asynchronous event (already acknowledged), without waiting.
    fn next_async_event(
        &mut self,
        device: &mut Self::Device,
    ) -> Result<Option<AsyncEvent>, CmError>;
    /// The caller owns `qp` on `device` (a QP it made, or the application's it
    /// adopted): the device's asynchronous events about it are the caller's. Called
    /// before the QP takes part in a connection. The default does nothing: a transport
    /// that is the only reader of its devices' events gets them all anyway (the real
    /// backend shares a device's events among the endpoints of a process on that device
    /// and routes them by these claims).
    fn claim_qp(&mut self, device: &Self::Device, qp: QpNum) {
        let _ = (device, qp);
    }
    /// The caller is done with `qp` on `device` ([`Transport::claim_qp`]). The default
    /// does nothing.
    fn release_qp(&mut self, device: &Self::Device, qp: QpNum) {
        let _ = (device, qp);
    }
    /// Takes back the reader of a device that went away, once nothing of the caller's
    /// uses the device any more. The default drops it.
    fn release_device(&mut self, device: Self::Device) {
        drop(device);
    }
    /// The caller is done with `id` (a listener it closed, a connection that ended):
    /// no handle of it is used again. The default drops it (the real backend destroys an id with its last
    /// handle, which frees its address); a backend whose ids outlive their handles
    /// destroys it here.
    fn release_id(&mut self, id: Self::Id) {
        drop(id);
    }
    /// Takes back the reader of a device still there that nothing of the caller's uses
    /// any more (its last listener and connection closed). The default drops it.
    fn close_device(&mut self, device: Self::Device) {
        drop(device);
    }
    /// Whether the transport has housekeeping to do now ([`Transport::housekeeping`]),
    /// learnt while it waited (the real backend: the kernel announced a device's
    /// removal). Read on every pass: cheap. The default: never.
    fn wants_housekeeping(&self) -> bool {
        false
    }
    /// A handle, usable from any thread, that makes the current or next
    /// [`Transport::wait`] return at once (spurious returns are allowed). `None` (the
    /// default): the transport's wait never blocks in real time (the simulation's moves
    /// virtual time), so nothing needs waking.
    fn waker(&mut self) -> Result<Option<core::task::Waker>, CmError> {
        Ok(None)
    }
    /// Work the transport finishes on its own after a device went away (the real
    /// backend lets librdmacm close the removed device's context, which the kernel's
    /// removal waits for). Called on every pass of the connection layer; returns how
    /// soon it wants to be called again (`None`: nothing pending).
    fn housekeeping(&mut self) -> Option<Duration> {
        None
    }
    /// The token of the next completion queue of the device with new completions
    /// (its notification is then disarmed until [`Transport::arm_cq`]), without waiting.
    fn next_cq_event(&mut self, device: &mut Self::Device) -> Result<Option<u64>, CmError>;

    // ----- queue pairs and data ----------------------------------------------------

    /// Creates the id's RC QP with a send and a receive completion queue on `device`'s
    /// completion channel, both armed, reporting `token`.
    fn create_qp(
        &mut self,
        id: &Self::Id,
        device: &Self::Device,
        token: u64,
        caps: &QueueCaps,
    ) -> Result<QpNum, CmError>;
    /// Registers the id's buffer area for `caps`.
    fn register_buffers(
        &mut self,
        id: &Self::Id,
        caps: &QueueCaps,
    ) -> Result<Self::Buffers, CmError>;
    /// Posts receive buffer `slot` (0..recv_depth) with work request id `wr_id`.
    fn post_recv(
        &mut self,
        id: &Self::Id,
        buffers: &Self::Buffers,
        slot: u32,
        wr_id: u64,
    ) -> Result<(), CmError>;
    /// Copies `data` into send buffer `slot` (0..send_depth) and posts one SEND of it.
    fn post_send(
        &mut self,
        id: &Self::Id,
        buffers: &Self::Buffers,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError>;
    /// Appends the first `len` bytes of receive buffer `slot` to `out`.
    fn read_recv(
        &mut self,
        id: &Self::Id,
        buffers: &Self::Buffers,
        slot: u32,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CmError>;
    /// Re-arms the completion notification of one of the id's queues.
    fn arm_cq(&mut self, id: &Self::Id, kind: CqKind) -> Result<(), CmError>;
    /// Appends up to `max` completions of one of the id's queues to `out`; how many.
    fn poll_cq(
        &mut self,
        id: &Self::Id,
        kind: CqKind,
        out: &mut Vec<WorkCompletion>,
        max: usize,
    ) -> Result<usize, CmError>;

    // ----- queues shared by a device context's connections -----------------------
    //
    // A transport without them answers `InvalidArgument` from `create_shared` (the
    // defaults below), and the connection layer keeps each connection's own queues.

    /// Creates the queues every connection on `device` may share: a shared receive
    /// queue, a registered pool of `caps` buffers, and a send and a receive completion
    /// queue on the device's completion channel, both armed, reporting `token`. `id` is
    /// any id bound to the device (its context is the device's). Nothing is posted yet.
    fn create_shared(
        &mut self,
        id: &Self::Id,
        device: &Self::Device,
        token: u64,
        caps: &SharedCaps,
    ) -> Result<Self::Shared, CmError> {
        let _ = (id, device, token, caps);
        Err(unsupported("create_shared"))
    }
    /// Creates the id's RC QP on `shared`'s receive queue and completion queues, with
    /// a send queue of `caps.send_depth + caps.work_depth` (its receive depth unused).
    fn create_qp_shared(
        &mut self,
        id: &Self::Id,
        shared: &Self::Shared,
        caps: &QueueCaps,
    ) -> Result<QpNum, CmError> {
        let _ = (id, shared, caps);
        Err(unsupported("create_qp_shared"))
    }
    /// Posts receive buffer `slot` (0..recv_slots) of `shared` on its receive queue.
    fn post_shared_recv(
        &mut self,
        shared: &Self::Shared,
        slot: u32,
        wr_id: u64,
    ) -> Result<(), CmError> {
        let _ = (shared, slot, wr_id);
        Err(unsupported("ibv_post_srq_recv"))
    }
    /// Copies `data` into send buffer `slot` (0..send_slots) of `shared` and posts one
    /// SEND of it on the id's QP.
    fn post_shared_send(
        &mut self,
        id: &Self::Id,
        shared: &Self::Shared,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError> {
        let _ = (id, shared, slot, data, wr_id);
        Err(unsupported("ibv_post_send"))
    }
    /// Appends the first `len` bytes of receive buffer `slot` of `shared` to `out`.
    fn read_shared_recv(
        &mut self,
        shared: &Self::Shared,
        slot: u32,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CmError> {
        let _ = (shared, slot, len, out);
        Err(unsupported("read_shared_recv"))
    }
    /// Re-arms the completion notification of one of `shared`'s completion queues.
    fn arm_shared_cq(&mut self, shared: &Self::Shared, kind: CqKind) -> Result<(), CmError> {
        let _ = (shared, kind);
        Err(unsupported("ibv_req_notify_cq"))
    }
    /// Appends up to `max` completions of one of `shared`'s completion queues to `out`
    /// (each names its QP); how many.
    fn poll_shared_cq(
        &mut self,
        shared: &Self::Shared,
        kind: CqKind,
        out: &mut Vec<WorkCompletion>,
        max: usize,
    ) -> Result<usize, CmError> {
        let _ = (shared, kind, out, max);
        Err(unsupported("ibv_poll_cq"))
    }
    /// Arms the shared receive queue's limit event (`IBV_EVENT_SRQ_LIMIT_REACHED` once
    /// fewer than `limit` receives are posted; `ibv_modify_srq`). The default: no limit
    /// event (nothing is lost without it: the endpoint re-posts as it reads).
    fn arm_shared_limit(&mut self, shared: &Self::Shared, limit: u32) -> Result<(), CmError> {
        let _ = (shared, limit);
        Ok(())
    }
    /// Starts making QPs ahead on `shared` ([`SharedCaps::ready_qps`]) for connections
    /// of `caps`, before any asks for one (a listener does so when it starts
    /// listening). Otherwise the first [`Transport::create_qp_shared`] starts them.
    /// The default does nothing (a backend that makes none ahead).
    fn prepare_qps_shared(&mut self, shared: &Self::Shared, caps: &QueueCaps) {
        let _ = (shared, caps);
    }
    /// The QPs made ahead on `shared` ([`SharedCaps::ready_qps`]): how many are ready
    /// now, and how many connections took so far. The default: none (a backend that makes
    /// none ahead).
    fn ready_qps(&self, shared: &Self::Shared) -> (usize, u64) {
        let _ = shared;
        (0, 0)
    }
    /// Takes back `device`'s shared queues, which nothing uses any more (every QP on
    /// them destroyed). The default drops them.
    fn release_shared(&mut self, device: &Self::Device, shared: Self::Shared) {
        let _ = device;
        drop(shared);
    }

    // ----- time and waiting ------------------------------------------------------

    /// The transport's clock: time since an origin of its choosing (virtual time on a
    /// simulation). The connection layer reads time only from here.
    fn now(&self) -> Duration;
    /// Blocks until the channel or one of `devices` may be readable, or `timeout`
    /// passes (`None`: as long as it takes). Returns whether something may be ready;
    /// spurious wake-ups are fine. A simulation runs virtual time instead, and answers
    /// [`CmError::Idle`] when nothing can ever happen and no timeout was given.
    fn wait(
        &mut self,
        devices: &[Self::Device],
        timeout: Option<Duration>,
    ) -> Result<bool, CmError>;
    /// One step of a wait, for an endpoint that shares a simulated fabric with others
    /// driven in turn (connection handles, each side its own driver): runs at most one
    /// action due now and never moves time (a party moves it with [`Transport::wait`]
    /// once nothing happened anywhere for a while, [`Transport::activity`]), so that
    /// the other parties act before time moves on. Returns whether anything moved or
    /// is ready. A transport whose wait blocks in real time (the default) waits as
    /// [`Transport::wait`] does, at most `timeout`.
    fn wait_step(
        &mut self,
        devices: &[Self::Device],
        timeout: Option<Duration>,
    ) -> Result<bool, CmError> {
        self.wait(devices, timeout)
    }
    /// A count that moves whenever anything happens on a transport whose virtual time
    /// several parties share (an event delivered or taken, a message or a timer
    /// scheduled): a party that sees it move gives the others their turns again before
    /// it lets time move on. A transport in real time answers 0 (the default).
    fn activity(&self) -> u64 {
        0
    }
}

/// What a transport without shared queues answers.
fn unsupported(op: &'static str) -> CmError {
    CmError::InvalidArgument {
        op,
        reason: "this transport has no shared receive queue",
    }
}

/// Why the peer (or its CM) refused a connection: the IB CM reject reason carried by a
/// REJECTED event's status. On iWARP the status is a negative errno instead, decoded to
/// the same meaning (see [`RejectReason::from_status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The peer has no QP for it (1).
    NoQp,
    /// The peer ran out of resources (3).
    NoResources,
    /// The peer's CM timed out waiting (4).
    Timeout,
    /// Nobody listens on the service (port) asked for (8).
    NoListener,
    /// The peer saw a stale connection with the same identifiers (10).
    StaleConnection,
    /// The application on the other side refused it, with its private data (28).
    Consumer,
    /// Any other reason number.
    Other(u32),
}

/// `-ECONNRESET`: the status of an iWARP REJECTED event after the peer's MPA reject.
const IWARP_PEER_REJECTED: i32 = -crate::errno::ECONNRESET;
/// `-ECONNREFUSED`: the status of an iWARP REJECTED event after a TCP reset.
const IWARP_REFUSED: i32 = -crate::errno::ECONNREFUSED;

impl RejectReason {
    /// Decodes the status of a REJECTED event: a positive IB CM reason on InfiniBand and
    /// RoCE; on iWARP `-ECONNRESET` (the peer's MPA reject: its application refused,
    /// private data included) is [`RejectReason::Consumer`] and `-ECONNREFUSED` (a TCP
    /// reset: nobody listens on the port) [`RejectReason::NoListener`]. Anything else is
    /// [`RejectReason::Other`] with the value as is.
    pub const fn from_status(status: i32) -> Self {
        match status {
            IWARP_PEER_REJECTED => RejectReason::Consumer,
            IWARP_REFUSED => RejectReason::NoListener,
            1 => RejectReason::NoQp,
            3 => RejectReason::NoResources,
            4 => RejectReason::Timeout,
            8 => RejectReason::NoListener,
            10 => RejectReason::StaleConnection,
            28 => RejectReason::Consumer,
            other => RejectReason::Other(other as u32),
        }
    }

    /// The IB CM reason number.
    pub const fn as_raw(self) -> u32 {
        match self {
            RejectReason::NoQp => 1,
            RejectReason::NoResources => 3,
            RejectReason::Timeout => 4,
            RejectReason::NoListener => 8,
            RejectReason::StaleConnection => 10,
            RejectReason::Consumer => 28,
            RejectReason::Other(n) => n,
        }
    }
}

impl core::fmt::Display for RejectReason {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            RejectReason::NoQp => f.write_str("no QP (1)"),
            RejectReason::NoResources => f.write_str("no resources (3)"),
            RejectReason::Timeout => f.write_str("timeout (4)"),
            RejectReason::NoListener => f.write_str("nobody listens on that port (8)"),
            RejectReason::StaleConnection => f.write_str("stale connection (10)"),
            RejectReason::Consumer => f.write_str("refused by the peer application (28)"),
            RejectReason::Other(n) => write!(f, "reason {n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reject_reasons_round_trip_and_keep_unknown_numbers() {
        for raw in 0..64u32 {
            assert_eq!(RejectReason::from_status(raw as i32).as_raw(), raw);
        }
        assert_eq!(RejectReason::from_status(8), RejectReason::NoListener);
        // iWARP's errnos mean the same.
        assert_eq!(RejectReason::from_status(-104), RejectReason::Consumer);
        assert_eq!(RejectReason::from_status(-111), RejectReason::NoListener);
        assert_eq!(
            RejectReason::from_status(-110),
            RejectReason::Other(-110i32 as u32)
        );
    }

    #[test]
    fn queue_caps_refuse_sizes_that_cannot_work() {
        assert!(QueueCaps::default().validate().is_ok());
        for bad in [
            QueueCaps {
                recv_depth: 0,
                ..QueueCaps::default()
            },
            QueueCaps {
                send_depth: 0,
                ..QueueCaps::default()
            },
            QueueCaps {
                buffer_size: 0,
                ..QueueCaps::default()
            },
            QueueCaps {
                buffer_size: u32::MAX,
                ..QueueCaps::default()
            },
            QueueCaps {
                recv_depth: u32::MAX,
                ..QueueCaps::default()
            },
            QueueCaps {
                work_depth: u32::MAX,
                ..QueueCaps::default()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(CmError::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
    }
}
