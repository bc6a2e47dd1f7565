//! The notify pump: verbs asynchronous events (and receive completions) in, `rdma_notify`
//! calls and typed pump events out.

use crate::qp_table::QpTable;

use cm_core::{
    errno, AsyncEvent, AsyncEventSource, AsyncEventType, CmError, CmEventType, CmId, NotifyError,
    QpNum, Route, RoutingPolicy,
};

/// How many early triggers (CM-bound events, and receive completions, for QPs not yet
/// registered) the pump keeps of each kind, for replay at [`NotifyPump::register`]. The
/// oldest is evicted (and counted) when a newer one does not fit.
pub const EARLY_TRIGGERS: usize = 64;

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
    /// Accepted or connecting; not yet known to be established. A notify that failed
    /// with a retriable error (see [`notify_failure_is_final`]) leaves the connection
    /// here: the next trigger tries again.
    Pending,
    /// Established: an ESTABLISHED event was seen, or notify returned 0 or EISCONN.
    Established,
    /// notify failed with an errno that means the connection moved on (EINVAL, ENOENT,
    /// ENXIO, ENODEV): receive completions no longer trigger notify for it.
    NotifyFailed,
    /// The id's transport has nothing for notify to force ([`CmId::notify_forces`]:
    /// iWARP, whose MPA exchange has no RTU to lose): no trigger leads to a notify, and
    /// only the CM's own ESTABLISHED establishes the connection.
    NotForcible,
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
    /// notify(COMM_EST) returned 0: the CM forced the connection to ESTABLISHED; one
    /// `RDMA_CM_EVENT_ESTABLISHED` follows on the id's channel.
    Forced {
        /// The connection's QP.
        qp: QpNum,
        /// What triggered the notify.
        trigger: Trigger,
    },
    /// notify(COMM_EST) answered EISCONN: the RTU won the race. Harmless.
    AlreadyEstablished {
        /// The connection's QP.
        qp: QpNum,
        /// What triggered the notify.
        trigger: Trigger,
    },
    /// notify(PATH_MIG) succeeded (only with
    /// [`RoutingPolicy::forward_path_mig`]): the CM switched the connection to its
    /// alternate path. Says nothing about establishment; no CM event follows.
    PathMigrated {
        /// The connection's QP.
        qp: QpNum,
    },
    /// notify answered an error; the error keeps the errno. When
    /// [`notify_failure_is_final`] says no, the connection stays pending and the next
    /// trigger retries.
    NotifyFailed {
        /// The connection's QP.
        qp: QpNum,
        /// What triggered the notify.
        trigger: Trigger,
        /// The kernel's answer.
        error: NotifyError,
    },
    /// A CM-bound event (e.g. COMM_EST) for a QP no id is registered for. A COMM_EST is
    /// kept (the most recent [`EARLY_TRIGGERS`]) and replayed when an id registers for
    /// the QP.
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

/// Whether a failed notify means the connection moved on for good (`EINVAL`: the id is
/// no longer in a state that takes the event; `ENOENT`, `ENXIO`: the id is unknown or
/// being destroyed; `ENODEV`: the device is going away). Every other errno (`ENOMEM`,
/// `ENODATA`, …) is transient: the pump keeps the connection pending and retries on
/// the next trigger.
pub const fn notify_failure_is_final(error: &NotifyError) -> bool {
    matches!(
        error.errno(),
        errno::EINVAL | errno::ENOENT | errno::ENXIO | errno::ENODEV
    )
}

/// Running totals of what the pump did, readable at any time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PumpCounters {
    /// notify(COMM_EST) returned 0 (connection forced to ESTABLISHED).
    pub forced: u64,
    /// notify(COMM_EST) returned EISCONN (the RTU won the race).
    pub already_established: u64,
    /// notify(PATH_MIG) succeeded.
    pub path_migrated: u64,
    /// notify answered an error (every [`PumpEvent::NotifyFailed`]).
    pub notify_failed: u64,
    /// Of `notify_failed`, the transient ones: the connection stayed pending and the next
    /// trigger retries.
    pub notify_failed_retriable: u64,
    /// CM-bound events for unregistered QPs.
    pub unrouted: u64,
    /// Events passed through to the application.
    pub passed_through: u64,
    /// Receive completions seen for registered, pending connections (each one led to
    /// exactly one notify), replayed early ones included.
    pub receive_triggers: u64,
    /// Early triggers (COMM_EST or receive completion for an unregistered QP) kept for
    /// replay.
    pub early_kept: u64,
    /// Early triggers replayed at registration (each one led to exactly one notify).
    pub early_replayed: u64,
    /// Early triggers evicted because [`EARLY_TRIGGERS`] newer ones were kept.
    pub early_evicted: u64,
    /// Registrations that replaced a stale entry of the same QP number (the kernel reuses
    /// a number only once the old QP is destroyed).
    pub stale_replaced: u64,
    /// Entries dropped because their id no longer owns the QP number an event named.
    pub stale_dropped: u64,
    /// Early triggers dropped at [`NotifyPump::register_before_handshake`]: kept for a
    /// QP number before its current QP could receive anything, so a previous QP's.
    pub early_stale: u64,
    /// COMM_EST asynchronous events received, whatever became of each (a forced
    /// establish, EISCONN after another trigger won, an error, unrouted): says that the
    /// device's COMM_EST reaches the pump even where a receive completion came first.
    pub comm_est: u64,
    /// Triggers (COMM_EST or a receive completion) of registered connections whose
    /// transport has nothing for notify to force ([`Progress::NotForcible`]): no notify
    /// was made.
    pub not_forcible: u64,
}

/// Why a registration was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum RegisterError {
    /// The id has no QP yet (create it before accept/connect).
    #[error("the id has no QP: create the QP before registering it with the pump")]
    NoQp,
}

/// What [`NotifyPump::register`] did besides registering the id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration<I> {
    /// The id registered before under the same QP number, handed back: the kernel reuses
    /// a QP number only once the old QP is destroyed, so that entry was stale (its owner
    /// forgot to unregister it).
    pub replaced: Option<I>,
    /// What replaying an early trigger did: a COMM_EST (or, for a passive id, a receive
    /// completion) seen on this QP before it was registered leads to exactly one
    /// notify now, reported here like any other pump event.
    pub replayed: Option<PumpEvent>,
}

struct Entry<I> {
    id: I,
    role: Role,
    progress: Progress,
}

/// One early trigger: the QP it named and when it came (the pump's own sequence).
#[derive(Debug, Clone, Copy)]
struct Early {
    qp: QpNum,
    seq: u64,
}

/// A fixed set of the most recent early triggers of one kind, one per QP. Inline: keeping
/// one allocates nothing.
struct EarlyTriggers {
    slots: [Option<Early>; EARLY_TRIGGERS],
    /// Slots in use. Nearly always 0: every registration looks for a trigger of its QP,
    /// and the count spares it a scan of every slot.
    kept: usize,
}

impl EarlyTriggers {
    const fn new() -> Self {
        EarlyTriggers {
            slots: [None; EARLY_TRIGGERS],
            kept: 0,
        }
    }

    /// Remembers a trigger on `qp` (once per QP: the oldest is kept). Returns whether an
    /// older trigger of another QP was evicted to make room.
    fn keep(&mut self, qp: QpNum, seq: u64) -> bool {
        let mut free = None;
        let mut oldest: Option<(usize, u64)> = None;
        for (index, slot) in self.slots.iter().enumerate() {
            match slot {
                Some(early) if early.qp == qp => return false,
                Some(early) => {
                    if oldest.is_none_or(|(_, seq)| early.seq < seq) {
                        oldest = Some((index, early.seq));
                    }
                }
                None => {
                    free.get_or_insert(index);
                }
            }
        }
        let (index, evicted) = match (free, oldest) {
            (Some(index), _) => (index, false),
            (None, Some((index, _))) => (index, true),
            (None, None) => return false, // no slots at all: cannot happen
        };
        self.slots[index] = Some(Early { qp, seq });
        if !evicted {
            self.kept += 1;
        }
        evicted
    }

    /// Takes the trigger kept for `qp`, giving its sequence number.
    fn take(&mut self, qp: QpNum) -> Option<u64> {
        if self.kept == 0 {
            return None;
        }
        let early = self
            .slots
            .iter_mut()
            .find(|slot| slot.is_some_and(|early| early.qp == qp))
            .and_then(Option::take)?;
        self.kept -= 1;
        Some(early.seq)
    }

    fn len(&self) -> usize {
        self.kept
    }
}

/// Forwards COMM_EST (and, opt-in, PATH_MIG) to the CM id that owns the QP, and turns
/// receive completions on not-yet-established passive connections into the same
/// forced establish.
///
/// Generic over the backend's id type: the same pump runs on the real backend and on
/// the simulated fabric. Lookups are O(1) and handling an event allocates nothing.
///
/// A trigger that arrives before its QP is registered (COMM_EST, or a receive
/// completion) is kept (the most recent [`EARLY_TRIGGERS`] of each kind) and replayed
/// by [`NotifyPump::register`]. A QP number the kernel reused never reaches the old id:
/// registering replaces the stale entry, and an event whose entry's id no longer owns
/// that QP drops the entry and is treated as early.
///
/// ```
/// use cm_verbs::core::{AsyncEvent, AsyncEventType, CmId, NotifyError, NotifyOutcome, QpNum};
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
///     pump.on_async_event(event),
///     PumpEvent::Forced { qp: QpNum(7), trigger: Trigger::AsyncEvent(AsyncEventType::CommEst) }
/// );
/// assert_eq!(pump.counters().forced, 1);
/// ```
pub struct NotifyPump<I> {
    // QP numbers come from the kernel, close together: indexed directly, one load per
    // event, about one slot per number in use.
    entries: QpTable<Entry<I>>,
    early_comm_est: EarlyTriggers,
    early_receive: EarlyTriggers,
    early_seq: u64,
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
    /// beyond it still works; it only grows the table, which shrinks back towards
    /// `capacity` as connections are unregistered).
    pub fn with_policy(policy: RoutingPolicy, capacity: usize) -> Self {
        NotifyPump {
            entries: QpTable::with_capacity(capacity),
            early_comm_est: EarlyTriggers::new(),
            early_receive: EarlyTriggers::new(),
            early_seq: 0,
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
    ///
    /// An entry already registered under the same number is stale (the kernel reuses a
    /// QP number only once the old QP is destroyed): it is replaced and its id handed
    /// back in [`Registration::replaced`]. A trigger kept for this QP before it was
    /// registered is replayed now: exactly one notify, reported in
    /// [`Registration::replayed`].
    pub fn register(&mut self, id: I, role: Role) -> Result<Registration<I>, RegisterError> {
        let qp = id.qp_num().ok_or(RegisterError::NoQp)?;
        let progress = if id.notify_forces() {
            Progress::Pending
        } else {
            Progress::NotForcible
        };
        let fresh = Entry { id, role, progress };
        let replaced = self.entries.insert(qp, fresh).map(|stale| {
            self.counters.stale_replaced += 1;
            debug_cold(format_args!(
                "{qp}: registered again; the stale entry is replaced"
            ));
            stale.id
        });
        let entry = self.entries.get_mut(qp).expect("inserted above");
        let comm_est = self.early_comm_est.take(qp);
        let receive = self.early_receive.take(qp);
        let receive = receive.filter(|_| role == Role::Passive);
        let trigger = match (comm_est, receive) {
            (Some(c), Some(r)) if r < c => Some(Trigger::ReceiveCompletion),
            (Some(_), _) => Some(Trigger::AsyncEvent(AsyncEventType::CommEst)),
            (None, Some(_)) => Some(Trigger::ReceiveCompletion),
            (None, None) => None,
        };
        if trigger.is_some() && progress == Progress::NotForcible {
            self.counters.not_forcible += 1;
        }
        let trigger = trigger.filter(|_| progress != Progress::NotForcible);
        let replayed = trigger.map(|trigger| {
            self.counters.early_replayed += 1;
            if trigger == Trigger::ReceiveCompletion {
                self.counters.receive_triggers += 1;
            }
            debug_cold(format_args!("{qp}: replaying an early {trigger:?}"));
            Self::notify(
                &mut self.counters,
                entry,
                qp,
                AsyncEventType::CommEst,
                trigger,
            )
        });
        Ok(Registration { replaced, replayed })
    }

    /// [`NotifyPump::register`] for a QP whose REQ or REP has not left yet, as a
    /// connection layer that registers before the handshake does: no trigger of this
    /// QP can have happened, so one kept for its number belongs to a previous QP with
    /// that number and is dropped (counted in [`PumpCounters::early_stale`]) instead of
    /// replayed (a notify before `rdma_accept` answers EINVAL, which would end the notify
    /// path of the new connection).
    pub fn register_before_handshake(
        &mut self,
        id: I,
        role: Role,
    ) -> Result<Registration<I>, RegisterError> {
        let qp = id.qp_num().ok_or(RegisterError::NoQp)?;
        let stale = u64::from(self.early_comm_est.take(qp).is_some())
            + u64::from(self.early_receive.take(qp).is_some());
        if stale > 0 {
            debug_cold(format_args!(
                "{qp}: {stale} early trigger(s) of a previous QP dropped"
            ));
            self.counters.early_stale += stale;
        }
        self.register(id, role)
    }

    /// Removes the id registered for `qp` (on disconnect or before destroying it) and
    /// gives it back. Early triggers kept for other, unregistered QPs are left alone.
    ///
    /// Report no receive completion of `qp` after unregistering it (flushed work
    /// requests included): it would be kept as an early trigger of the next QP to get
    /// that number.
    pub fn unregister(&mut self, qp: QpNum) -> Option<I> {
        self.entries.remove(qp).map(|e| e.id)
    }

    /// How many connections are registered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no connection is registered.
    pub fn is_empty(&self) -> bool {
        self.entries.len() == 0
    }

    /// How many connections the table holds without growing. The table is indexed by
    /// QP number in pages of 512 numbers: it grows by a page when a registration needs
    /// one and gives a page back when its last connection goes (keeping the capacity
    /// asked for at construction), so for the close numbers a device hands out it stays
    /// within a small multiple of the largest of [`NotifyPump::len`] and that capacity;
    /// scattered numbers cost up to a page each.
    pub fn capacity(&self) -> usize {
        self.entries.capacity()
    }

    /// How many early triggers (of both kinds) are kept for replay.
    pub fn early_triggers(&self) -> usize {
        self.early_comm_est.len() + self.early_receive.len()
    }

    /// What the pump knows of the connection on `qp`.
    pub fn progress(&self, qp: QpNum) -> Option<Progress> {
        self.entries.get(qp).map(|e| e.progress)
    }

    /// The counters so far.
    pub fn counters(&self) -> PumpCounters {
        self.counters
    }

    /// Handles one asynchronous event (already acknowledged by its source).
    pub fn on_async_event(&mut self, event: AsyncEvent) -> PumpEvent {
        match self.policy.route(&event) {
            Route::Application => {
                self.counters.passed_through += 1;
                PumpEvent::PassThrough(event)
            }
            Route::Notify { qp, event: kind } => {
                if kind == AsyncEventType::CommEst {
                    self.counters.comm_est += 1;
                }
                match self.entries.get_mut(qp) {
                    Some(entry) if entry.id.qp_num() == Some(qp) => {
                        if entry.progress == Progress::NotForcible {
                            return self.not_forcible(event);
                        }
                        return Self::notify(
                            &mut self.counters,
                            entry,
                            qp,
                            kind,
                            Trigger::AsyncEvent(kind),
                        );
                    }
                    Some(_) => self.drop_stale(qp),
                    None => {}
                }
                self.counters.unrouted += 1;
                if kind == AsyncEventType::CommEst {
                    let seq = self.next_seq();
                    self.counters.early_kept += 1;
                    if self.early_comm_est.keep(qp, seq) {
                        self.counters.early_evicted += 1;
                    }
                    debug_cold(format_args!(
                        "{event}: no id registered for it yet; kept for replay"
                    ));
                } else {
                    debug_cold(format_args!("{event}: no id registered for it"));
                }
                PumpEvent::Unrouted(event)
            }
        }
    }

    /// The second trigger: a receive completed on `qp`. When `qp` is a registered
    /// passive connection not yet known to be established, the CM is notified exactly as
    /// for COMM_EST; when no id is registered for `qp`, the completion is kept (the most
    /// recent [`EARLY_TRIGGERS`]) and replayed at registration; otherwise this costs one
    /// table lookup and returns `None`.
    pub fn on_receive_completion(&mut self, qp: QpNum) -> Option<PumpEvent> {
        let entry = match self.entries.get_mut(qp) {
            Some(entry) if entry.id.qp_num() == Some(qp) => entry,
            stale_or_none => {
                if stale_or_none.is_some() {
                    self.drop_stale(qp);
                }
                let seq = self.next_seq();
                self.counters.early_kept += 1;
                if self.early_receive.keep(qp, seq) {
                    self.counters.early_evicted += 1;
                }
                return None;
            }
        };
        if entry.role != Role::Passive || entry.progress != Progress::Pending {
            if entry.role == Role::Passive && entry.progress == Progress::NotForcible {
                self.counters.not_forcible += 1;
            }
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
                if let Some(entry) = self.entries.get_mut(qp) {
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
            sink(self.on_async_event(event));
            handled += 1;
        }
        Ok(handled)
    }

    /// Drops the entry of `qp`, whose id reports another QP (or none: its QP was
    /// destroyed): the number was reused, and no trigger of the new QP may reach the
    /// old id.
    fn drop_stale(&mut self, qp: QpNum) {
        self.counters.stale_dropped += 1;
        debug_cold(format_args!(
            "{qp}: the registered id no longer owns this QP; entry dropped"
        ));
        self.unregister(qp);
    }

    /// A trigger event of a connection whose transport notify cannot force: handed to
    /// the application, no notify made. Out of line: iWARP raises no COMM_EST.
    #[cold]
    #[inline(never)]
    fn not_forcible(&mut self, event: AsyncEvent) -> PumpEvent {
        self.counters.not_forcible += 1;
        self.counters.passed_through += 1;
        PumpEvent::PassThrough(event)
    }

    fn next_seq(&mut self) -> u64 {
        self.early_seq += 1;
        self.early_seq
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
        // PATH_MIG says nothing about establishment; only COMM_EST moves progress.
        if kind != AsyncEventType::CommEst {
            return match result {
                Ok(_) => {
                    counters.path_migrated += 1;
                    debug_cold(format_args!("{qp}: notify({kind}) migrated the path"));
                    PumpEvent::PathMigrated { qp }
                }
                Err(error) => {
                    counters.notify_failed += 1;
                    if !notify_failure_is_final(&error) {
                        counters.notify_failed_retriable += 1;
                    }
                    warn_cold(format_args!("{qp}: notify({kind}) failed: {error}"));
                    PumpEvent::NotifyFailed { qp, trigger, error }
                }
            };
        }
        match result {
            Ok(cm_core::NotifyOutcome::Established) => {
                counters.forced += 1;
                entry.progress = Progress::Established;
                if crate::tracing_gate::debug_wanted() {
                    trace_forced(qp, kind, trigger);
                }
                PumpEvent::Forced { qp, trigger }
            }
            Ok(cm_core::NotifyOutcome::AlreadyEstablished) => {
                counters.already_established += 1;
                entry.progress = Progress::Established;
                PumpEvent::AlreadyEstablished { qp, trigger }
            }
            Err(error) => {
                counters.notify_failed += 1;
                if notify_failure_is_final(&error) {
                    if entry.progress == Progress::Pending {
                        entry.progress = Progress::NotifyFailed;
                    }
                    warn_cold(format_args!(
                        "{qp}: notify({kind}) failed for good: {error}"
                    ));
                } else {
                    counters.notify_failed_retriable += 1;
                    warn_cold(format_args!(
                        "{qp}: notify({kind}) failed, the next trigger retries: {error}"
                    ));
                }
                PumpEvent::NotifyFailed { qp, trigger, error }
            }
        }
    }
}

/// A debug line written out of line: a tracing callsite is inline code (level and
/// interest checks, the log bridge's) that the event path would otherwise carry, and
/// that keeps the compiler from inlining the path's small functions.
#[cold]
#[inline(never)]
fn debug_cold(line: std::fmt::Arguments<'_>) {
    tracing::debug!("{line}");
}

/// A notify that forced `qp` established: out of line and with its values as they are,
/// as this is the path the pump exists for.
#[cold]
#[inline(never)]
fn trace_forced(qp: QpNum, kind: AsyncEventType, trigger: Trigger) {
    tracing::debug!("{qp}: notify({kind}) forced ESTABLISHED ({trigger:?})");
}

/// A warning written out of line (see [`debug_cold`]).
#[cold]
#[inline(never)]
fn warn_cold(line: std::fmt::Arguments<'_>) {
    tracing::warn!("{line}");
}
