//! Connection states: the kernel IB CM's (`enum ib_cm_state`) and the RDMA CM id's
//! (`enum rdma_cm_state`), with their exact kernel numbers.

use core::fmt;

macro_rules! numbered_state {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $value:literal => $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u32)]
        pub enum $name {
            $($(#[$vmeta])* $variant = $value,)+
        }

        impl $name {
            /// Every state, in kernel order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// Decodes a kernel number; `None` for numbers the kernel does not define.
            pub const fn from_raw(raw: u32) -> Option<Self> {
                match raw {
                    $($value => Some($name::$variant),)+
                    _ => None,
                }
            }

            /// The kernel number.
            pub const fn as_raw(self) -> u32 {
                self as u32
            }

            /// The kernel's enumerator name.
            pub const fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

numbered_state! {
    /// The state of a kernel IB CM id (`enum ib_cm_state`, drivers/infiniband/core/cm.c).
    ///
    /// `rdma_notify(COMM_EST)` succeeds only in [`IbCmState::RepSent`] and
    /// [`IbCmState::MraRepRcvd`]; see [`crate::kernel_model::ib_cm_notify`].
    IbCmState {
        /// `IB_CM_IDLE`.
        Idle = 0 => "IB_CM_IDLE",
        /// `IB_CM_LISTEN`.
        Listen = 1 => "IB_CM_LISTEN",
        /// `IB_CM_REQ_SENT`.
        ReqSent = 2 => "IB_CM_REQ_SENT",
        /// `IB_CM_REQ_RCVD`.
        ReqRcvd = 3 => "IB_CM_REQ_RCVD",
        /// `IB_CM_MRA_REQ_SENT`.
        MraReqSent = 4 => "IB_CM_MRA_REQ_SENT",
        /// `IB_CM_MRA_REQ_RCVD`.
        MraReqRcvd = 5 => "IB_CM_MRA_REQ_RCVD",
        /// `IB_CM_REP_SENT`: the passive side accepted and waits for the RTU.
        RepSent = 6 => "IB_CM_REP_SENT",
        /// `IB_CM_REP_RCVD`: the active side got the REP and has not sent its RTU yet.
        RepRcvd = 7 => "IB_CM_REP_RCVD",
        /// `IB_CM_MRA_REP_SENT`.
        MraRepSent = 8 => "IB_CM_MRA_REP_SENT",
        /// `IB_CM_MRA_REP_RCVD`: the passive side's REP was acknowledged by an MRA.
        MraRepRcvd = 9 => "IB_CM_MRA_REP_RCVD",
        /// `IB_CM_ESTABLISHED`.
        Established = 10 => "IB_CM_ESTABLISHED",
        /// `IB_CM_DREQ_SENT`.
        DreqSent = 11 => "IB_CM_DREQ_SENT",
        /// `IB_CM_DREQ_RCVD`.
        DreqRcvd = 12 => "IB_CM_DREQ_RCVD",
        /// `IB_CM_TIMEWAIT`.
        Timewait = 13 => "IB_CM_TIMEWAIT",
        /// `IB_CM_SIDR_REQ_SENT`.
        SidrReqSent = 14 => "IB_CM_SIDR_REQ_SENT",
        /// `IB_CM_SIDR_REQ_RCVD`.
        SidrReqRcvd = 15 => "IB_CM_SIDR_REQ_RCVD",
    }
}

numbered_state! {
    /// The state of an RDMA CM id (`enum rdma_cm_state`, drivers/infiniband/core/cma_priv.h).
    CmIdState {
        /// `RDMA_CM_IDLE`.
        Idle = 0 => "RDMA_CM_IDLE",
        /// `RDMA_CM_ADDR_QUERY`.
        AddrQuery = 1 => "RDMA_CM_ADDR_QUERY",
        /// `RDMA_CM_ADDR_RESOLVED`.
        AddrResolved = 2 => "RDMA_CM_ADDR_RESOLVED",
        /// `RDMA_CM_ROUTE_QUERY`.
        RouteQuery = 3 => "RDMA_CM_ROUTE_QUERY",
        /// `RDMA_CM_ROUTE_RESOLVED`.
        RouteResolved = 4 => "RDMA_CM_ROUTE_RESOLVED",
        /// `RDMA_CM_CONNECT`.
        Connect = 5 => "RDMA_CM_CONNECT",
        /// `RDMA_CM_DISCONNECT`.
        Disconnect = 6 => "RDMA_CM_DISCONNECT",
        /// `RDMA_CM_ADDR_BOUND`.
        AddrBound = 7 => "RDMA_CM_ADDR_BOUND",
        /// `RDMA_CM_LISTEN`.
        Listen = 8 => "RDMA_CM_LISTEN",
        /// `RDMA_CM_DEVICE_REMOVAL`.
        DeviceRemoval = 9 => "RDMA_CM_DEVICE_REMOVAL",
        /// `RDMA_CM_DESTROYING`.
        Destroying = 10 => "RDMA_CM_DESTROYING",
    }
}
