//! The traits a backend implements so that higher layers (the notify pump, the event
//! loop, the conformance suite) run unchanged on real hardware and on a simulation.
//!
//! Design rules:
//! - the notify path allocates nothing: `notify` takes `&self` and an enum, returns an
//!   enum; events are read one at a time into caller-owned values;
//! - every CM event is acknowledged exactly once: by [`CmEvent::ack`] or, if the
//!   application forgets, when the event is dropped;
//! - asynchronous events are copied out and acknowledged by the source before they are
//!   returned ([`AsyncEvent`] is plain data), so none can be leaked.

use crate::{AsyncEvent, AsyncEventType, CmError, CmEventType, NotifyError, NotifyOutcome, QpNum};

/// An RDMA CM id as the notify path sees it.
pub trait CmId {
    /// `rdma_notify(id, event)`: tells the CM that `event` happened on the id's QP.
    ///
    /// `Ok(Established)` means the connection was forced to ESTABLISHED and one
    /// `RDMA_CM_EVENT_ESTABLISHED` follows; `Ok(AlreadyEstablished)` is the harmless
    /// EISCONN (the RTU won the race).
    fn notify(&self, event: AsyncEventType) -> Result<NotifyOutcome, NotifyError>;

    /// The number of the id's QP, once one exists.
    fn qp_num(&self) -> Option<QpNum>;

    /// Whether `rdma_notify` can force this id's connection established: the transport
    /// of its device. True unless the id is known to be on iWARP.
    fn notify_forces(&self) -> bool {
        true
    }
}

/// The transport of an RDMA device (`ibv_device.transport_type`), as far as the notify
/// path cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceTransport {
    /// InfiniBand and RoCE (`IBV_TRANSPORT_IB`): the CM's handshake ends with an RTU,
    /// which can be lost; `rdma_notify` forces the connection established.
    InfiniBand,
    /// iWARP (`IBV_TRANSPORT_IWARP`): the connection is set up by the MPA exchange over
    /// TCP, which has no RTU to lose. The kernel answers `rdma_notify` with 0 there and
    /// does nothing, so calling it would claim a rescue that never happened.
    Iwarp,
    /// Any other value (usNIC, unknown), kept.
    Other(i32),
}

impl DeviceTransport {
    /// Decodes `ibv_transport_type`.
    pub const fn from_raw(raw: i32) -> Self {
        match raw {
            0 => DeviceTransport::InfiniBand,
            1 => DeviceTransport::Iwarp,
            other => DeviceTransport::Other(other),
        }
    }

    /// Whether `rdma_notify` can force a connection on this transport (only InfiniBand
    /// and RoCE: the kernel's `rdma_notify` passes it to the IB CM on those alone).
    pub const fn notify_forces(self) -> bool {
        matches!(self, DeviceTransport::InfiniBand)
    }
}

/// One RDMA CM event. Acknowledged exactly once: explicitly with [`CmEvent::ack`], or
/// when dropped.
pub trait CmEvent {
    /// What happened.
    fn event_type(&self) -> CmEventType;

    /// The event's status (0, or a negative errno such as `-ETIMEDOUT` on UNREACHABLE,
    /// or a reject reason on REJECTED).
    fn status(&self) -> i32;

    /// The QP number of the id the event is about, when it has a QP.
    fn qp_num(&self) -> Option<QpNum>;

    /// The private data the peer sent with the message behind the event.
    fn private_data(&self) -> &[u8];

    /// Acknowledges the event now (`rdma_ack_cm_event`).
    fn ack(self) -> Result<(), CmError>
    where
        Self: Sized;
}

/// A source of CM events: one event channel.
pub trait CmEventSource {
    /// The event type this source yields.
    type Event: CmEvent;

    /// The next event, without blocking; `Ok(None)` when none is pending.
    fn try_next_event(&mut self) -> Result<Option<Self::Event>, CmError>;
}

/// A source of verbs asynchronous events: one device context.
pub trait AsyncEventSource {
    /// The next asynchronous event, without blocking; `Ok(None)` when none is pending.
    /// The event is acknowledged before it is returned.
    fn try_next_async_event(&mut self) -> Result<Option<AsyncEvent>, CmError>;
}

/// Ties together the types of one backend (real librdmacm, simulated fabric, mocks), so
/// that code over one backend names it once: `cm_verbs::BackendLoop<B>` is the event
/// loop over `B`'s event channel and device with a pump of `B`'s ids. (The connection
/// API's full backend, with QPs and addresses, is [`crate::Transport`].)
pub trait CmBackend {
    /// The backend's CM id handle, as registered with the notify pump.
    type Id: CmId;
    /// The backend's CM event.
    type Event: CmEvent;
    /// The backend's event channel.
    type Events: CmEventSource<Event = Self::Event>;
    /// The backend's device asynchronous event source.
    type AsyncEvents: AsyncEventSource;
}

impl<T: CmId + ?Sized> CmId for &T {
    fn notify(&self, event: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
        (**self).notify(event)
    }
    fn qp_num(&self) -> Option<QpNum> {
        (**self).qp_num()
    }
    fn notify_forces(&self) -> bool {
        (**self).notify_forces()
    }
}
