//! Verbs asynchronous events (`ibv_event_type`) and the object each one is about.

use core::fmt;

use crate::QpNum;

/// An `enum ibv_event_type` value, decoded totally: numbers this crate does not know
/// become [`AsyncEventType::Unknown`] instead of undefined behaviour.
///
/// The numbers are the libibverbs ABI and must never change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AsyncEventType {
    /// `IBV_EVENT_CQ_ERR` (0): a completion queue overran.
    CqErr,
    /// `IBV_EVENT_QP_FATAL` (1): the QP went to the error state.
    QpFatal,
    /// `IBV_EVENT_QP_REQ_ERR` (2): invalid request on a QP's work queue.
    QpReqErr,
    /// `IBV_EVENT_QP_ACCESS_ERR` (3): local access violation on a QP.
    QpAccessErr,
    /// `IBV_EVENT_COMM_EST` (4): the first packet arrived on a QP in RTR: the one event
    /// to forward to the CM with `rdma_notify`.
    CommEst,
    /// `IBV_EVENT_SQ_DRAINED` (5): the send queue of a QP in SQD drained.
    SqDrained,
    /// `IBV_EVENT_PATH_MIG` (6): the QP migrated to its alternate path.
    PathMig,
    /// `IBV_EVENT_PATH_MIG_ERR` (7): path migration failed.
    PathMigErr,
    /// `IBV_EVENT_DEVICE_FATAL` (8): the device is in a fatal state.
    DeviceFatal,
    /// `IBV_EVENT_PORT_ACTIVE` (9): a port became active.
    PortActive,
    /// `IBV_EVENT_PORT_ERR` (10): a port went down.
    PortErr,
    /// `IBV_EVENT_LID_CHANGE` (11): a port's LID changed.
    LidChange,
    /// `IBV_EVENT_PKEY_CHANGE` (12): a port's P_Key table changed.
    PkeyChange,
    /// `IBV_EVENT_SM_CHANGE` (13): the subnet manager changed.
    SmChange,
    /// `IBV_EVENT_SRQ_ERR` (14): a shared receive queue failed.
    SrqErr,
    /// `IBV_EVENT_SRQ_LIMIT_REACHED` (15): an SRQ fell below its limit.
    SrqLimitReached,
    /// `IBV_EVENT_QP_LAST_WQE_REACHED` (16): last WQE of a QP attached to an SRQ.
    QpLastWqeReached,
    /// `IBV_EVENT_CLIENT_REREGISTER` (17): the SM asks clients to re-register.
    ClientReregister,
    /// `IBV_EVENT_GID_CHANGE` (18): a port's GID table changed.
    GidChange,
    /// `IBV_EVENT_WQ_FATAL` (19): a work queue went to the error state.
    WqFatal,
    /// `IBV_EVENT_DEVICE_SPEED_CHANGE` (20): a port's link speed changed.
    DeviceSpeedChange,
    /// A number this crate does not know (a newer kernel or rdma-core).
    Unknown(u32),
}

/// Every known event type, in ABI order (index == number).
const KNOWN: [AsyncEventType; 21] = [
    AsyncEventType::CqErr,
    AsyncEventType::QpFatal,
    AsyncEventType::QpReqErr,
    AsyncEventType::QpAccessErr,
    AsyncEventType::CommEst,
    AsyncEventType::SqDrained,
    AsyncEventType::PathMig,
    AsyncEventType::PathMigErr,
    AsyncEventType::DeviceFatal,
    AsyncEventType::PortActive,
    AsyncEventType::PortErr,
    AsyncEventType::LidChange,
    AsyncEventType::PkeyChange,
    AsyncEventType::SmChange,
    AsyncEventType::SrqErr,
    AsyncEventType::SrqLimitReached,
    AsyncEventType::QpLastWqeReached,
    AsyncEventType::ClientReregister,
    AsyncEventType::GidChange,
    AsyncEventType::WqFatal,
    AsyncEventType::DeviceSpeedChange,
];

/// `ibv_event_type_str` of libibverbs, index == number.
const LIBIBVERBS_STR: [&str; 21] = [
    "CQ error",
    "local work queue catastrophic error",
    "invalid request local work queue error",
    "local access violation work queue error",
    "communication established",
    "send queue drained",
    "path migrated",
    "path migration request error",
    "local catastrophic error",
    "port active",
    "port error",
    "LID change",
    "P_Key change",
    "SM change",
    "SRQ catastrophic error",
    "SRQ limit reached",
    "last WQE reached",
    "client reregistration",
    "GID table change",
    "WQ fatal",
    "Device link speed change",
];

impl AsyncEventType {
    /// Every known event type, in ABI order.
    pub const ALL: &'static [AsyncEventType] = &KNOWN;

    /// Decodes a raw `ibv_event_type` number. Total: never fails, never panics.
    #[inline]
    pub const fn from_raw(raw: u32) -> Self {
        if (raw as usize) < KNOWN.len() {
            KNOWN[raw as usize]
        } else {
            AsyncEventType::Unknown(raw)
        }
    }

    /// The raw `ibv_event_type` number.
    #[inline]
    pub const fn as_raw(self) -> u32 {
        match self {
            AsyncEventType::CqErr => 0,
            AsyncEventType::QpFatal => 1,
            AsyncEventType::QpReqErr => 2,
            AsyncEventType::QpAccessErr => 3,
            AsyncEventType::CommEst => 4,
            AsyncEventType::SqDrained => 5,
            AsyncEventType::PathMig => 6,
            AsyncEventType::PathMigErr => 7,
            AsyncEventType::DeviceFatal => 8,
            AsyncEventType::PortActive => 9,
            AsyncEventType::PortErr => 10,
            AsyncEventType::LidChange => 11,
            AsyncEventType::PkeyChange => 12,
            AsyncEventType::SmChange => 13,
            AsyncEventType::SrqErr => 14,
            AsyncEventType::SrqLimitReached => 15,
            AsyncEventType::QpLastWqeReached => 16,
            AsyncEventType::ClientReregister => 17,
            AsyncEventType::GidChange => 18,
            AsyncEventType::WqFatal => 19,
            AsyncEventType::DeviceSpeedChange => 20,
            AsyncEventType::Unknown(raw) => raw,
        }
    }

    /// Which member of `ibv_async_event.element` the event carries.
    pub const fn object(self) -> EventObject {
        match self {
            AsyncEventType::QpFatal
            | AsyncEventType::QpReqErr
            | AsyncEventType::QpAccessErr
            | AsyncEventType::CommEst
            | AsyncEventType::SqDrained
            | AsyncEventType::PathMig
            | AsyncEventType::PathMigErr
            | AsyncEventType::QpLastWqeReached => EventObject::Qp,
            AsyncEventType::CqErr => EventObject::Cq,
            AsyncEventType::SrqErr | AsyncEventType::SrqLimitReached => EventObject::Srq,
            AsyncEventType::WqFatal => EventObject::Wq,
            AsyncEventType::DeviceFatal
            | AsyncEventType::PortActive
            | AsyncEventType::PortErr
            | AsyncEventType::LidChange
            | AsyncEventType::PkeyChange
            | AsyncEventType::SmChange
            | AsyncEventType::ClientReregister
            | AsyncEventType::GidChange
            | AsyncEventType::DeviceSpeedChange => EventObject::Port,
            AsyncEventType::Unknown(_) => EventObject::Unknown,
        }
    }

    /// The text `ibv_event_type_str` gives for this event ("unknown" for unknown numbers).
    pub const fn libibverbs_str(self) -> &'static str {
        match self {
            AsyncEventType::Unknown(_) => "unknown",
            known => LIBIBVERBS_STR[known.as_raw() as usize],
        }
    }
}

impl From<u32> for AsyncEventType {
    fn from(raw: u32) -> Self {
        AsyncEventType::from_raw(raw)
    }
}

impl From<AsyncEventType> for u32 {
    fn from(event: AsyncEventType) -> Self {
        event.as_raw()
    }
}

impl fmt::Display for AsyncEventType {
    /// Same text as libibverbs' `ibv_event_type_str`; unknown numbers add the number.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AsyncEventType::Unknown(raw) => write!(f, "unknown({raw})"),
            known => f.write_str(known.libibverbs_str()),
        }
    }
}

/// Which object an asynchronous event is about (the live member of
/// `ibv_async_event.element`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventObject {
    /// `element.qp`.
    Qp,
    /// `element.cq`.
    Cq,
    /// `element.srq`.
    Srq,
    /// `element.wq`.
    Wq,
    /// `element.port_num`.
    Port,
    /// An unknown event type: which member is live cannot be known.
    Unknown,
}

/// The object an asynchronous event names, copied out of the C event so that the
/// event can be acknowledged at once.
///
/// CQ, SRQ and WQ objects have no stable number in verbs; backends identify them with
/// an opaque handle of their own (the real backend uses the object's kernel handle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventElement {
    /// The QP the event is about.
    Qp(QpNum),
    /// A completion queue, by backend handle.
    Cq(u32),
    /// A shared receive queue, by backend handle.
    Srq(u32),
    /// A work queue, by backend handle.
    Wq(u32),
    /// A port number of the device.
    Port(u8),
    /// The event type is unknown, so the element cannot be read safely.
    Unknown,
}

/// One verbs asynchronous event, already acknowledged by the source that read it.
///
/// Plain data (`Copy`): holding it pins no verbs object, so no destroy can hang on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AsyncEvent {
    /// What happened.
    pub event_type: AsyncEventType,
    /// What it happened to.
    pub element: EventElement,
}

impl AsyncEvent {
    /// An event about a QP (COMM_EST, QP_FATAL, …).
    pub const fn qp(event_type: AsyncEventType, qp: QpNum) -> Self {
        AsyncEvent {
            event_type,
            element: EventElement::Qp(qp),
        }
    }

    /// The QP number, when the event is about a QP.
    pub const fn qp_num(&self) -> Option<QpNum> {
        match self.element {
            EventElement::Qp(qp) => Some(qp),
            _ => None,
        }
    }
}

impl fmt::Display for AsyncEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.element {
            EventElement::Qp(qp) => write!(f, "{} on {qp}", self.event_type),
            EventElement::Cq(h) => write!(f, "{} on CQ {h}", self.event_type),
            EventElement::Srq(h) => write!(f, "{} on SRQ {h}", self.event_type),
            EventElement::Wq(h) => write!(f, "{} on WQ {h}", self.event_type),
            EventElement::Port(p) => write!(f, "{} on port {p}", self.event_type),
            EventElement::Unknown => write!(f, "{}", self.event_type),
        }
    }
}
