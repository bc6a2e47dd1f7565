//! The notify pump: verbs asynchronous events (and receive completions) in, `rdma_notify`
//! calls and typed pump events out.

use std::collections::hash_map::Entry as Slot;

use rustc_hash::FxHashMap;

use cm_core::{
    AsyncEvent, AsyncEventSource, AsyncEventType, CmError, CmEventType, CmId, NotifyError,
    NotifyOutcome, QpNum, Route, RoutingPolicy,
};

/// Which side of the connection an id is: only the passive side is ever forced to
/// ESTABLISHED by a receive completion (the active side sends the RTU itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The id accepted a connection request (its REP may still wait for the RTU).
    Passive,
    /// The id connected (it sends the RTU).
    Active,
}

/// What a registered connection is known to be, as far as the pump can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Progress {
    /// Accepted or connecting; not yet known to be established.
    Pending,
    /// Established: an ESTABLISHED event was seen, or notify returned 0 or EISCONN.
    Established,
    /// notify was refused (the connection failed or moved on): receive completions no
    /// longer trigger notify for it.
    Refused,
}

/// Which trigger made the pump call notify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Trigger {
    /// The device raised an asynchronous event (COMM_EST, or PATH_MIG when configured).
    AsyncEvent(AsyncEventType),
    /// The application reported a receive completion on a connection not yet established
    /// (soft-RoCE and some devices never raise COMM_EST).
    ReceiveCompletion,
}

/// What the pump did with one input, for the application to see. Plain data: producing
/// it allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PumpEvent {
    /// notify returned 0: the CM forced the connection to ESTABLISHED; one
    /// `RDMA_CM_EVENT_ESTABLISHED` follows on the id's channel.
    Forced {
        /// The connection's QP.
        qp: QpNum,
        /// What triggered the notify.
        trigger: Trigger,
    },
    /// notify answered EISCONN: the RTU won the race. Harmless.
    AlreadyEstablished {
        /// The connection's QP.
        qp: QpNum,
        /// What triggered the notify.
        trigger: Trigger,
    },
    /// notify was refused; the error keeps the errno.
    NotifyFailed {
        /// The connection's QP.
        qp: QpNum,
        /// What triggered the notify.
        trigger: Trigger,
        /// The kernel's answer.
        error: NotifyError,
    },
    /// A CM-bound event (e.g. COMM_EST) for a QP no id is registered for.
    Unrouted(AsyncEvent),
    /// An event that belongs to the application (QP_FATAL, CQ_ERR, PORT_ERR, …).
    PassThrough(AsyncEvent),
}

impl PumpEvent {
    /// Whether this is a failure the application should look at.
    pub const fn is_failure(&self) -> bool {
        matches!(self, PumpEvent::NotifyFailed { .. })
    }
}

/// Running totals of what the pump did, readable at any time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PumpCounters {
    /// notify returned 0 (connection forced to ESTABLISHED).
    pub forced: u64,
    /// notify returned EISCONN (the RTU won the race).
    pub already_established: u64,
    /// notify returned an error.
    pub rejected: u64,
    /// CM-bound events for unregistered QPs.
    pub unrouted: u64,
    /// Events passed through to the application.
    pub passed_through: u64,
    /// Receive completions seen for registered, pending connections (each one led to
    /// exactly one notify).
    pub receive_triggers: u64,
}

/// Why a registration was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum RegisterError {
    /// The id has no QP yet (create it before accept/connect).
    #[error("the id has no QP: create the QP before registering it with the pump")]
    NoQp,
    /// Another id is already registered for this QP number.
    #[error("{0} is already registered")]
    Duplicate(QpNum),
}

struct Entry<I> {
    id: I,
    role: Role,
    progress: Progress,
}

/// Forwards COMM_EST (and, opt-in, PATH_MIG) to the CM id that owns the QP, and turns
/// receive completions on not-yet-established passive connections into the same
/// forced establish.
///
/// Generic over the backend's id type: the same pump runs on the real backend and on
/// the simulated fabric. Lookups are O(1) and handling an event allocates nothing.
///
/// ```
/// use cm_core::{AsyncEvent, AsyncEventType, CmId, NotifyError, NotifyOutcome, QpNum};
/// use cm_verbs::{NotifyPump, PumpEvent, Role, Trigger};
///
/// struct Accepted; // stands for a backend's id in REP_SENT
/// impl CmId for Accepted {
///     fn notify(&self, _: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
///         Ok(NotifyOutcome::Established)
///     }
///     fn qp_num(&self) -> Option<QpNum> { Some(QpNum(7)) }
/// }
///
/// let mut pump = NotifyPump::new();
/// pump.register(Accepted, Role::Passive).unwrap();
/// let event = AsyncEvent::qp(AsyncEventType::CommEst, QpNum(7));
/// assert_eq!(
///     pump.handle_async_event(event),
///     PumpEvent::Forced { qp: QpNum(7), trigger: Trigger::AsyncEvent(AsyncEventType::CommEst) }
/// );
/// assert_eq!(pump.counters().forced, 1);
/// ```
pub struct NotifyPump<I> {
    // QP numbers come from the kernel, not from peers: a fast non-keyed hash is safe here
    // and halves the cost of the lookup every event pays.
    entries: FxHashMap<QpNum, Entry<I>>,
    policy: RoutingPolicy,
    counters: PumpCounters,
}

impl<I: CmId> Default for NotifyPump<I> {
    fn default() -> Self {
        Self::new()
    }
}

impl<I: CmId> NotifyPump<I> {
    /// A pump forwarding COMM_EST only.
    pub fn new() -> Self {
        Self::with_policy(RoutingPolicy::default(), 0)
    }

    /// A pump with a routing policy and room for `capacity` connections (registering
    /// beyond it still works; it only grows the table).
    pub fn with_policy(policy: RoutingPolicy, capacity: usize) -> Self {
        NotifyPump {
            entries: FxHashMap::with_capacity_and_hasher(capacity, Default::default()),
            policy,
            counters: PumpCounters::default(),
        }
    }

    /// The routing policy in force.
    pub fn policy(&self) -> RoutingPolicy {
        self.policy
    }

    /// Registers `id` under its QP number: call it right after accept (passive) or
    /// connect (active).
    pub fn register(&mut self, id: I, role: Role) -> Result<(), RegisterError> {
        let qp = id.qp_num().ok_or(RegisterError::NoQp)?;
        match self.entries.entry(qp) {
            Slot::Occupied(_) => Err(RegisterError::Duplicate(qp)),
            Slot::Vacant(slot) => {
                slot.insert(Entry {
                    id,
                    role,
                    progress: Progress::Pending,
                });
                Ok(())
            }
        }
    }

    /// Removes the id registered for `qp` (on disconnect or before destroying it) and
    /// gives it back.
    pub fn unregister(&mut self, qp: QpNum) -> Option<I> {
        self.entries.remove(&qp).map(|e| e.id)
    }

    /// How many connections are registered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no connection is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What the pump knows of the connection on `qp`.
    pub fn progress(&self, qp: QpNum) -> Option<Progress> {
        self.entries.get(&qp).map(|e| e.progress)
    }

    /// The counters so far.
    pub fn counters(&self) -> PumpCounters {
        self.counters
    }

    /// Handles one asynchronous event (already acknowledged by its source).
    pub fn handle_async_event(&mut self, event: AsyncEvent) -> PumpEvent {
        match self.policy.route(&event) {
            Route::Application => {
                self.counters.passed_through += 1;
                PumpEvent::PassThrough(event)
            }
            Route::Notify { qp, event: kind } => match self.entries.get_mut(&qp) {
                Some(entry) => Self::notify(
                    &mut self.counters,
                    entry,
                    qp,
                    kind,
                    Trigger::AsyncEvent(kind),
                ),
                None => {
                    self.counters.unrouted += 1;
                    log::debug!("{event}: no id registered for it");
                    PumpEvent::Unrouted(event)
                }
            },
        }
    }

    /// The second trigger: a receive completed on `qp`. When `qp` is a registered
    /// passive connection not yet known to be established, the CM is notified exactly as
    /// for COMM_EST; otherwise this costs one table lookup and returns `None`.
    pub fn on_receive_completion(&mut self, qp: QpNum) -> Option<PumpEvent> {
        let entry = self.entries.get_mut(&qp)?;
        if entry.role != Role::Passive || entry.progress != Progress::Pending {
            return None;
        }
        self.counters.receive_triggers += 1;
        Some(Self::notify(
            &mut self.counters,
            entry,
            qp,
            AsyncEventType::CommEst,
            Trigger::ReceiveCompletion,
        ))
    }

    /// Feeds a CM event seen by the application: ESTABLISHED marks the connection
    /// established (no further receive-triggered notify); DISCONNECTED, UNREACHABLE,
    /// REJECTED, CONNECT_ERROR and DEVICE_REMOVAL unregister it and give the id back.
    pub fn on_cm_event(&mut self, event_type: CmEventType, qp: Option<QpNum>) -> Option<I> {
        let qp = qp?;
        match event_type {
            CmEventType::Established => {
                if let Some(entry) = self.entries.get_mut(&qp) {
                    entry.progress = Progress::Established;
                }
                None
            }
            CmEventType::Disconnected
            | CmEventType::Unreachable
            | CmEventType::Rejected
            | CmEventType::ConnectError
            | CmEventType::DeviceRemoval => self.unregister(qp),
            _ => None,
        }
    }

    /// Reads every pending event of `source`, handles each and hands the result to
    /// `sink`. Returns how many events were handled.
    pub fn drain<S: AsyncEventSource + ?Sized>(
        &mut self,
        source: &mut S,
        mut sink: impl FnMut(PumpEvent),
    ) -> Result<usize, CmError> {
        let mut handled = 0;
        while let Some(event) = source.try_next_async_event()? {
            sink(self.handle_async_event(event));
            handled += 1;
        }
        Ok(handled)
    }

    /// Calls notify on `entry` and records the outcome (one lookup per event: the caller
    /// found the entry).
    fn notify(
        counters: &mut PumpCounters,
        entry: &mut Entry<I>,
        qp: QpNum,
        kind: AsyncEventType,
        trigger: Trigger,
    ) -> PumpEvent {
        let result = entry.id.notify(kind);
        // PATH_MIG success says nothing about establishment; only COMM_EST moves progress.
        let establishes = kind == AsyncEventType::CommEst;
        match result {
            Ok(NotifyOutcome::Established) => {
                counters.forced += 1;
                if establishes {
                    entry.progress = Progress::Established;
                }
                log::debug!("{qp}: notify({kind}) forced ESTABLISHED ({trigger:?})");
                PumpEvent::Forced { qp, trigger }
            }
            Ok(NotifyOutcome::AlreadyEstablished) => {
                counters.already_established += 1;
                if establishes {
                    entry.progress = Progress::Established;
                }
                PumpEvent::AlreadyEstablished { qp, trigger }
            }
            Err(error) => {
                counters.rejected += 1;
                if establishes && entry.progress == Progress::Pending {
                    entry.progress = Progress::Refused;
                }
                log::warn!("{qp}: notify({kind}) refused: {error}");
                PumpEvent::NotifyFailed { qp, trigger, error }
            }
        }
    }
}
