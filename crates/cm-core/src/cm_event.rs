//! RDMA CM event types (`rdma_cm_event_type`).

use core::fmt;

/// An `enum rdma_cm_event_type` value, decoded totally: numbers this crate does not
/// know become [`CmEventType::Unknown`].
///
/// The numbers are the librdmacm ABI and must never change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmEventType {
    /// `RDMA_CM_EVENT_ADDR_RESOLVED` (0).
    AddrResolved,
    /// `RDMA_CM_EVENT_ADDR_ERROR` (1).
    AddrError,
    /// `RDMA_CM_EVENT_ROUTE_RESOLVED` (2).
    RouteResolved,
    /// `RDMA_CM_EVENT_ROUTE_ERROR` (3).
    RouteError,
    /// `RDMA_CM_EVENT_CONNECT_REQUEST` (4): a REQ reached a listener; the event carries a new id.
    ConnectRequest,
    /// `RDMA_CM_EVENT_CONNECT_RESPONSE` (5): REP received by an active id without a QP.
    ConnectResponse,
    /// `RDMA_CM_EVENT_CONNECT_ERROR` (6).
    ConnectError,
    /// `RDMA_CM_EVENT_UNREACHABLE` (7): e.g. the REP retries ran out.
    Unreachable,
    /// `RDMA_CM_EVENT_REJECTED` (8).
    Rejected,
    /// `RDMA_CM_EVENT_ESTABLISHED` (9): the connection is up.
    Established,
    /// `RDMA_CM_EVENT_DISCONNECTED` (10).
    Disconnected,
    /// `RDMA_CM_EVENT_DEVICE_REMOVAL` (11).
    DeviceRemoval,
    /// `RDMA_CM_EVENT_MULTICAST_JOIN` (12).
    MulticastJoin,
    /// `RDMA_CM_EVENT_MULTICAST_ERROR` (13).
    MulticastError,
    /// `RDMA_CM_EVENT_ADDR_CHANGE` (14).
    AddrChange,
    /// `RDMA_CM_EVENT_TIMEWAIT_EXIT` (15).
    TimewaitExit,
    /// `RDMA_CM_EVENT_ADDRINFO_RESOLVED` (16).
    AddrinfoResolved,
    /// `RDMA_CM_EVENT_ADDRINFO_ERROR` (17).
    AddrinfoError,
    /// `RDMA_CM_EVENT_USER` (18): librdmacm-internal.
    User,
    /// `RDMA_CM_EVENT_INTERNAL` (19): librdmacm-internal.
    Internal,
    /// A number this crate does not know.
    Unknown(u32),
}

const KNOWN: [CmEventType; 20] = [
    CmEventType::AddrResolved,
    CmEventType::AddrError,
    CmEventType::RouteResolved,
    CmEventType::RouteError,
    CmEventType::ConnectRequest,
    CmEventType::ConnectResponse,
    CmEventType::ConnectError,
    CmEventType::Unreachable,
    CmEventType::Rejected,
    CmEventType::Established,
    CmEventType::Disconnected,
    CmEventType::DeviceRemoval,
    CmEventType::MulticastJoin,
    CmEventType::MulticastError,
    CmEventType::AddrChange,
    CmEventType::TimewaitExit,
    CmEventType::AddrinfoResolved,
    CmEventType::AddrinfoError,
    CmEventType::User,
    CmEventType::Internal,
];

/// The C enumerator names, index == number.
const NAMES: [&str; 20] = [
    "RDMA_CM_EVENT_ADDR_RESOLVED",
    "RDMA_CM_EVENT_ADDR_ERROR",
    "RDMA_CM_EVENT_ROUTE_RESOLVED",
    "RDMA_CM_EVENT_ROUTE_ERROR",
    "RDMA_CM_EVENT_CONNECT_REQUEST",
    "RDMA_CM_EVENT_CONNECT_RESPONSE",
    "RDMA_CM_EVENT_CONNECT_ERROR",
    "RDMA_CM_EVENT_UNREACHABLE",
    "RDMA_CM_EVENT_REJECTED",
    "RDMA_CM_EVENT_ESTABLISHED",
    "RDMA_CM_EVENT_DISCONNECTED",
    "RDMA_CM_EVENT_DEVICE_REMOVAL",
    "RDMA_CM_EVENT_MULTICAST_JOIN",
    "RDMA_CM_EVENT_MULTICAST_ERROR",
    "RDMA_CM_EVENT_ADDR_CHANGE",
    "RDMA_CM_EVENT_TIMEWAIT_EXIT",
    "RDMA_CM_EVENT_ADDRINFO_RESOLVED",
    "RDMA_CM_EVENT_ADDRINFO_ERROR",
    "RDMA_CM_EVENT_USER",
    "RDMA_CM_EVENT_INTERNAL",
];

impl CmEventType {
    /// Every known event type, in ABI order.
    pub const ALL: &'static [CmEventType] = &KNOWN;

    /// Decodes a raw `rdma_cm_event_type` number. Total: never fails, never panics.
    #[inline]
    pub const fn from_raw(raw: u32) -> Self {
        if (raw as usize) < KNOWN.len() {
            KNOWN[raw as usize]
        } else {
            CmEventType::Unknown(raw)
        }
    }

    /// The raw `rdma_cm_event_type` number.
    #[inline]
    pub const fn as_raw(self) -> u32 {
        match self {
            CmEventType::AddrResolved => 0,
            CmEventType::AddrError => 1,
            CmEventType::RouteResolved => 2,
            CmEventType::RouteError => 3,
            CmEventType::ConnectRequest => 4,
            CmEventType::ConnectResponse => 5,
            CmEventType::ConnectError => 6,
            CmEventType::Unreachable => 7,
            CmEventType::Rejected => 8,
            CmEventType::Established => 9,
            CmEventType::Disconnected => 10,
            CmEventType::DeviceRemoval => 11,
            CmEventType::MulticastJoin => 12,
            CmEventType::MulticastError => 13,
            CmEventType::AddrChange => 14,
            CmEventType::TimewaitExit => 15,
            CmEventType::AddrinfoResolved => 16,
            CmEventType::AddrinfoError => 17,
            CmEventType::User => 18,
            CmEventType::Internal => 19,
            CmEventType::Unknown(raw) => raw,
        }
    }

    /// The C enumerator name ("RDMA_CM_EVENT_ESTABLISHED"); `None` for unknown numbers.
    pub const fn name(self) -> Option<&'static str> {
        match self {
            CmEventType::Unknown(_) => None,
            known => Some(NAMES[known.as_raw() as usize]),
        }
    }

    /// Exactly what a current librdmacm's `rdma_event_str` returns: the enumerator name,
    /// or "UNKNOWN EVENT" for the internal USER/INTERNAL values and unknown numbers.
    /// (librdmacm before the ADDRINFO events, e.g. rdma-core 44, also says
    /// "UNKNOWN EVENT" for 16 and 17.)
    pub const fn librdmacm_str(self) -> &'static str {
        match self {
            CmEventType::User | CmEventType::Internal | CmEventType::Unknown(_) => "UNKNOWN EVENT",
            known => NAMES[known.as_raw() as usize],
        }
    }

    /// Whether this event ends a connection attempt without a connection.
    pub const fn is_connect_failure(self) -> bool {
        matches!(
            self,
            CmEventType::ConnectError | CmEventType::Unreachable | CmEventType::Rejected
        )
    }
}

impl From<u32> for CmEventType {
    fn from(raw: u32) -> Self {
        CmEventType::from_raw(raw)
    }
}

impl From<CmEventType> for u32 {
    fn from(event: CmEventType) -> Self {
        event.as_raw()
    }
}

impl fmt::Display for CmEventType {
    /// The enumerator name as `rdma_event_str` prints it; unknown numbers print
    /// `unknown(N)` so the number is never lost.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "unknown({})", self.as_raw()),
        }
    }
}
