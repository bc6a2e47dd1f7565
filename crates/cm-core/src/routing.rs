//! Which asynchronous events belong to the CM and which to the application.

use crate::{AsyncEvent, AsyncEventType, QpNum};

/// How the notify path routes asynchronous events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RoutingPolicy {
    /// Also forward `IBV_EVENT_PATH_MIG` to the CM (needed only by applications that
    /// load alternate paths; off by default, as the kernel answers EINVAL without one).
    pub forward_path_mig: bool,
}

impl RoutingPolicy {
    /// Forward COMM_EST only: what every kernel user of `rdma_notify` does.
    pub const COMM_EST_ONLY: RoutingPolicy = RoutingPolicy {
        forward_path_mig: false,
    };

    /// Where `event` goes under this policy.
    pub const fn route(self, event: &AsyncEvent) -> Route {
        let to_cm = match event.event_type {
            AsyncEventType::CommEst => true,
            AsyncEventType::PathMig => self.forward_path_mig,
            _ => false,
        };
        match (to_cm, event.qp_num()) {
            (true, Some(qp)) => Route::Notify {
                qp,
                event: event.event_type,
            },
            _ => Route::Application,
        }
    }
}

/// The decision for one asynchronous event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// Forward `event` with `rdma_notify` to the CM id that owns QP `qp`.
    Notify {
        /// The QP the event is about.
        qp: QpNum,
        /// The event to forward.
        event: AsyncEventType,
    },
    /// The event is the application's: pass it through.
    Application,
}
