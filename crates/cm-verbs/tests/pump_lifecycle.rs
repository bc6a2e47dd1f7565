//! The pump over a connection's whole life: transient notify failures retried, early
//! triggers replayed at registration, QP numbers reused after a stale entry, PATH_MIG
//! reported as such, and a table that gives its memory back.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;

use cm_core::{
    AsyncEvent, AsyncEventType, CmEventType, CmId, Errno, NotifyError, NotifyOutcome, QpNum,
    RoutingPolicy,
};
use cm_mock::KernelLikeId;
use cm_verbs::{
    notify_failure_is_final, NotifyPump, Progress, PumpEvent, Role, Trigger, EARLY_TRIGGERS,
};

const QP: QpNum = QpNum(0x42);
const COMM_EST: Trigger = Trigger::AsyncEvent(AsyncEventType::CommEst);
const ENOMEM: NotifyError = NotifyError::Os(Errno(12));

/// What a test id saw, shared with the test.
#[derive(Default)]
struct Seen {
    qp: Cell<Option<QpNum>>,
    answers: RefCell<VecDeque<Result<NotifyOutcome, NotifyError>>>,
    notified: RefCell<Vec<AsyncEventType>>,
    /// On an iWARP device: notify forces nothing there.
    iwarp: Cell<bool>,
}

/// An id answering from a script (then `Ok(Established)` once the script is over).
#[derive(Clone)]
struct TestId(Rc<Seen>);

impl TestId {
    fn new(qp: QpNum, answers: &[Result<NotifyOutcome, NotifyError>]) -> Self {
        let seen = Seen::default();
        seen.qp.set(Some(qp));
        seen.answers.borrow_mut().extend(answers.iter().copied());
        TestId(Rc::new(seen))
    }

    fn calls(&self) -> usize {
        self.0.notified.borrow().len()
    }

    /// The QP is destroyed: the id no longer reports a QP number.
    fn destroy_qp(&self) {
        self.0.qp.set(None);
    }

    fn same(&self, other: &TestId) -> bool {
        Rc::ptr_eq(&self.0, &other.0)
    }
}

impl CmId for TestId {
    fn notify(&self, event: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
        self.0.notified.borrow_mut().push(event);
        self.0
            .answers
            .borrow_mut()
            .pop_front()
            .unwrap_or(Ok(NotifyOutcome::Established))
    }

    fn qp_num(&self) -> Option<QpNum> {
        self.0.qp.get()
    }

    fn notify_forces(&self) -> bool {
        !self.0.iwarp.get()
    }
}

fn comm_est(qp: QpNum) -> AsyncEvent {
    AsyncEvent::qp(AsyncEventType::CommEst, qp)
}

// --- transient notify failures (issue 14) ---

#[test]
fn only_errnos_that_mean_the_connection_moved_on_are_final() {
    for final_error in [
        NotifyError::WrongState,
        NotifyError::UnknownId,
        NotifyError::IdDestroyed,
        NotifyError::NoDevice,
        NotifyError::Os(Errno(22)),
    ] {
        assert!(notify_failure_is_final(&final_error), "{final_error}");
    }
    for transient in [ENOMEM, NotifyError::ShortWrite, NotifyError::Os(Errno(16))] {
        assert!(!notify_failure_is_final(&transient), "{transient}");
    }
}

#[test]
fn a_transient_failure_leaves_the_connection_pending_and_the_next_receive_retries() {
    let id = TestId::new(QP, &[Err(ENOMEM)]);
    let mut pump = NotifyPump::new();
    pump.register(id.clone(), Role::Passive).unwrap();
    assert_eq!(
        pump.on_receive_completion(QP),
        Some(PumpEvent::NotifyFailed {
            qp: QP,
            trigger: Trigger::ReceiveCompletion,
            error: ENOMEM
        })
    );
    assert_eq!(pump.progress(QP), Some(Progress::Pending));
    assert_eq!(
        pump.on_receive_completion(QP),
        Some(PumpEvent::Forced {
            qp: QP,
            trigger: Trigger::ReceiveCompletion
        })
    );
    assert_eq!(pump.progress(QP), Some(Progress::Established));
    assert_eq!(pump.on_receive_completion(QP), None);
    assert_eq!(id.calls(), 2);
    let c = pump.counters();
    assert_eq!(
        (
            c.notify_failed,
            c.notify_failed_retriable,
            c.forced,
            c.receive_triggers
        ),
        (1, 1, 1, 2)
    );
}

#[test]
fn a_transient_failure_of_comm_est_is_retried_by_a_receive_completion() {
    let id = TestId::new(QP, &[Err(NotifyError::ShortWrite)]);
    let mut pump = NotifyPump::new();
    pump.register(id.clone(), Role::Passive).unwrap();
    assert!(pump.on_async_event(comm_est(QP)).is_failure());
    assert!(matches!(
        pump.on_receive_completion(QP),
        Some(PumpEvent::Forced { .. })
    ));
    assert_eq!(id.calls(), 2);
}

#[test]
fn a_final_failure_stops_receive_triggers() {
    let id = TestId::new(QP, &[Err(NotifyError::WrongState)]);
    let mut pump = NotifyPump::new();
    pump.register(id.clone(), Role::Passive).unwrap();
    assert!(pump.on_receive_completion(QP).is_some());
    assert_eq!(pump.progress(QP), Some(Progress::NotifyFailed));
    assert_eq!(pump.on_receive_completion(QP), None);
    assert_eq!(id.calls(), 1);
    assert_eq!(pump.counters().notify_failed_retriable, 0);
}

#[test]
fn every_comm_est_is_counted_whichever_trigger_won() {
    // The receive completion forces the establish; the device's COMM_EST of the same
    // packet, read after it, answers EISCONN; one of a QP nobody registered is unrouted.
    let id = TestId::new(QP, &[Ok(NotifyOutcome::Established)]);
    let mut pump = NotifyPump::new();
    pump.register(id.clone(), Role::Passive).unwrap();
    assert!(matches!(
        pump.on_receive_completion(QP),
        Some(PumpEvent::Forced { .. })
    ));
    assert_eq!(pump.counters().comm_est, 0, "a receive is no COMM_EST");
    id.0.answers
        .borrow_mut()
        .push_back(Ok(NotifyOutcome::AlreadyEstablished));
    assert!(matches!(
        pump.on_async_event(comm_est(QP)),
        PumpEvent::AlreadyEstablished { .. }
    ));
    assert!(matches!(
        pump.on_async_event(comm_est(QpNum(0x43))),
        PumpEvent::Unrouted(_)
    ));
    let c = pump.counters();
    assert_eq!(
        (c.comm_est, c.forced, c.already_established, c.unrouted),
        (2, 1, 1, 1)
    );
}

// --- early triggers (issue 13, item 4) ---

#[test]
fn comm_est_before_register_is_replayed_once_at_register() {
    let mut pump = NotifyPump::new();
    assert_eq!(
        pump.on_async_event(comm_est(QP)),
        PumpEvent::Unrouted(comm_est(QP))
    );
    // The same event raised twice is kept once.
    pump.on_async_event(comm_est(QP));
    assert_eq!(pump.early_triggers(), 1);
    let id = TestId::new(QP, &[]);
    let registration = pump.register(id.clone(), Role::Passive).unwrap();
    assert_eq!(
        registration.replayed,
        Some(PumpEvent::Forced {
            qp: QP,
            trigger: COMM_EST
        })
    );
    assert!(registration.replaced.is_none());
    assert_eq!(*id.0.notified.borrow(), [AsyncEventType::CommEst]);
    assert_eq!(pump.progress(QP), Some(Progress::Established));
    assert_eq!(pump.early_triggers(), 0);
    let c = pump.counters();
    assert_eq!((c.early_kept, c.early_replayed, c.forced), (2, 1, 1));
    // Nothing left to replay: a second registration of the QP replays nothing.
    let again = TestId::new(QP, &[]);
    assert_eq!(
        pump.register(again.clone(), Role::Passive)
            .unwrap()
            .replayed,
        None
    );
    assert_eq!(again.calls(), 0);
}

#[test]
fn a_receive_completion_before_register_is_replayed_for_a_passive_id_only() {
    let mut pump = NotifyPump::new();
    assert_eq!(pump.on_receive_completion(QP), None);
    assert_eq!(pump.on_receive_completion(QpNum(7)), None);
    let passive = TestId::new(QP, &[]);
    assert_eq!(
        pump.register(passive.clone(), Role::Passive)
            .unwrap()
            .replayed,
        Some(PumpEvent::Forced {
            qp: QP,
            trigger: Trigger::ReceiveCompletion
        })
    );
    assert_eq!(passive.calls(), 1);
    assert_eq!(pump.counters().receive_triggers, 1);
    let active = TestId::new(QpNum(7), &[]);
    assert_eq!(
        pump.register(active.clone(), Role::Active)
            .unwrap()
            .replayed,
        None
    );
    assert_eq!(active.calls(), 0);
}

#[test]
fn both_early_triggers_lead_to_exactly_one_notify() {
    let mut pump = NotifyPump::new();
    pump.on_async_event(comm_est(QP));
    pump.on_receive_completion(QP);
    let id = TestId::new(QP, &[]);
    let replayed = pump.register(id.clone(), Role::Passive).unwrap().replayed;
    assert_eq!(
        replayed,
        Some(PumpEvent::Forced {
            qp: QP,
            trigger: COMM_EST
        }),
        "the first one to arrive is replayed"
    );
    assert_eq!(id.calls(), 1);
    assert_eq!(pump.early_triggers(), 0);
}

#[test]
fn early_triggers_are_bounded_the_oldest_evicted_and_counted() {
    let mut pump = NotifyPump::new();
    let first = 1000;
    for n in 0..=EARLY_TRIGGERS as u32 {
        pump.on_async_event(comm_est(QpNum(first + n)));
    }
    assert_eq!(pump.early_triggers(), EARLY_TRIGGERS);
    assert_eq!(pump.counters().early_evicted, 1);
    let oldest = TestId::new(QpNum(first), &[]);
    assert_eq!(
        pump.register(oldest.clone(), Role::Passive)
            .unwrap()
            .replayed,
        None
    );
    assert_eq!(oldest.calls(), 0);
    let newest = TestId::new(QpNum(first + EARLY_TRIGGERS as u32), &[]);
    assert!(pump
        .register(newest.clone(), Role::Passive)
        .unwrap()
        .replayed
        .is_some());
    assert_eq!(newest.calls(), 1);
    // Receive completions have their own room: they do not evict COMM_ESTs.
    for n in 0..(4 * EARLY_TRIGGERS as u32) {
        pump.on_receive_completion(QpNum(5000 + n));
    }
    let second = TestId::new(QpNum(first + 1), &[]);
    assert!(pump
        .register(second.clone(), Role::Passive)
        .unwrap()
        .replayed
        .is_some());
}

#[test]
fn unregister_leaves_the_early_triggers_of_other_qps_alone() {
    let mut pump = NotifyPump::new();
    pump.on_async_event(comm_est(QpNum(1)));
    pump.on_receive_completion(QpNum(2));
    let other = TestId::new(QpNum(3), &[]);
    pump.register(other, Role::Passive).unwrap();
    assert!(pump.unregister(QpNum(3)).is_some());
    assert!(pump
        .on_cm_event(CmEventType::Disconnected, Some(QpNum(3)))
        .is_none());
    assert_eq!(pump.early_triggers(), 2);
    let one = TestId::new(QpNum(1), &[]);
    let two = TestId::new(QpNum(2), &[]);
    assert!(pump
        .register(one.clone(), Role::Passive)
        .unwrap()
        .replayed
        .is_some());
    assert!(pump
        .register(two.clone(), Role::Passive)
        .unwrap()
        .replayed
        .is_some());
    assert_eq!((one.calls(), two.calls()), (1, 1));
}

// --- QP numbers reused (issue 14) ---

#[test]
fn registering_a_reused_qp_number_replaces_the_stale_entry_and_hands_it_back() {
    let mut pump = NotifyPump::new();
    let old = TestId::new(QP, &[]);
    pump.register(old.clone(), Role::Passive).unwrap();
    pump.on_cm_event(CmEventType::Established, Some(QP));
    // The application forgot to unregister it; the kernel destroyed the QP and gave the
    // number to a new one.
    let new = TestId::new(QP, &[]);
    let registration = pump.register(new.clone(), Role::Passive).unwrap();
    assert!(registration.replaced.expect("the stale id").same(&old));
    assert_eq!(pump.progress(QP), Some(Progress::Pending));
    assert_eq!(pump.len(), 1);
    assert_eq!(
        pump.on_async_event(comm_est(QP)),
        PumpEvent::Forced {
            qp: QP,
            trigger: COMM_EST
        }
    );
    assert_eq!((old.calls(), new.calls()), (0, 1));
    assert_eq!(pump.counters().stale_replaced, 1);
}

#[test]
fn comm_est_of_a_reused_qp_before_its_register_never_reaches_the_stale_id() {
    let mut pump = NotifyPump::new();
    let old = TestId::new(QP, &[]);
    pump.register(old.clone(), Role::Passive).unwrap();
    old.destroy_qp();
    // The new QP with the same number raises COMM_EST before its id is registered.
    assert_eq!(
        pump.on_async_event(comm_est(QP)),
        PumpEvent::Unrouted(comm_est(QP))
    );
    assert_eq!(old.calls(), 0);
    assert!(pump.is_empty(), "the stale entry is dropped");
    let new = TestId::new(QP, &[]);
    let registration = pump.register(new.clone(), Role::Passive).unwrap();
    assert!(registration.replaced.is_none());
    assert_eq!(
        registration.replayed,
        Some(PumpEvent::Forced {
            qp: QP,
            trigger: COMM_EST
        })
    );
    assert_eq!((old.calls(), new.calls()), (0, 1));
    assert_eq!(pump.counters().stale_dropped, 1);
}

#[test]
fn a_receive_on_a_reused_qp_is_not_swallowed_by_a_settled_stale_entry() {
    let mut pump = NotifyPump::new();
    let old = TestId::new(QP, &[]);
    pump.register(old.clone(), Role::Passive).unwrap();
    pump.on_cm_event(CmEventType::Established, Some(QP));
    old.destroy_qp();
    assert_eq!(pump.on_receive_completion(QP), None);
    let new = TestId::new(QP, &[]);
    assert_eq!(
        pump.register(new.clone(), Role::Passive).unwrap().replayed,
        Some(PumpEvent::Forced {
            qp: QP,
            trigger: Trigger::ReceiveCompletion
        })
    );
    assert_eq!((old.calls(), new.calls()), (0, 1));
}

// --- PATH_MIG has its own outcome (issue 16) ---

#[test]
fn a_successful_path_mig_is_path_migrated_not_forced() {
    let id = TestId::new(QP, &[Ok(NotifyOutcome::Established)]);
    let mut pump = NotifyPump::with_policy(
        RoutingPolicy {
            forward_path_mig: true,
        },
        0,
    );
    pump.register(id.clone(), Role::Passive).unwrap();
    assert_eq!(
        pump.on_async_event(AsyncEvent::qp(AsyncEventType::PathMig, QP)),
        PumpEvent::PathMigrated { qp: QP }
    );
    let c = pump.counters();
    assert_eq!((c.path_migrated, c.forced, c.notify_failed), (1, 0, 0));
    assert_eq!(pump.progress(QP), Some(Progress::Pending));
    assert_eq!(*id.0.notified.borrow(), [AsyncEventType::PathMig]);
}

// --- the table gives its memory back (issue 14) ---

#[test]
fn the_table_shrinks_when_connections_are_unregistered() {
    const N: u32 = 100_000;
    let mut pump = NotifyPump::new();
    let info = allocation_counter::measure(|| {
        for n in 0..N {
            pump.register(KernelLikeId::new(QpNum(n)), Role::Passive)
                .unwrap();
        }
        assert!(pump.capacity() >= N as usize);
        for n in 0..N {
            pump.unregister(QpNum(n));
        }
    });
    assert!(pump.is_empty());
    assert!(pump.capacity() <= 128, "capacity {}", pump.capacity());
    assert!(
        info.bytes_current <= 16 * 1024,
        "bytes still held by an empty pump: {info:?}"
    );
}

#[test]
fn the_table_stays_within_a_multiple_of_what_is_registered() {
    const N: u32 = 100_000;
    let mut pump = NotifyPump::with_policy(RoutingPolicy::default(), 1000);
    for n in 0..N {
        pump.register(KernelLikeId::new(QpNum(n)), Role::Passive)
            .unwrap();
    }
    for n in 0..(N - 500) {
        pump.unregister(QpNum(n));
    }
    assert_eq!(pump.len(), 500);
    // Never below what was reserved, never far above the larger of it and the load.
    assert!(
        (1000..=8 * 1000).contains(&pump.capacity()),
        "capacity {}",
        pump.capacity()
    );
    // Disconnect events unregister (and shrink) the same way.
    for n in (N - 500)..N {
        pump.on_cm_event(CmEventType::Disconnected, Some(QpNum(n)));
    }
    assert!(pump.is_empty());
    assert!(pump.capacity() >= 1000);
}

/// A trigger kept for a QP number, then a new QP with that number registered before its
/// handshake: the trigger was the previous QP's. Dropped, not replayed (before
/// `rdma_accept` the kernel answers EINVAL, which is final), the new connection's own
/// receive completion still forces its establish.
#[test]
fn a_stale_early_trigger_is_not_replayed_for_a_qp_registered_before_its_handshake() {
    const EINVAL: NotifyError = NotifyError::Os(Errno(22));
    let mut pump = NotifyPump::new();
    // A late COMM_EST of the number's previous QP: nobody owns it now, it is kept.
    pump.on_async_event(comm_est(QP));
    assert_eq!(pump.counters().early_kept, 1);
    let id = TestId::new(QP, &[Err(EINVAL)]);
    let registration = pump
        .register_before_handshake(id.clone(), Role::Passive)
        .expect("registered");
    assert!(registration.replayed.is_none(), "not replayed");
    assert_eq!(pump.counters().early_stale, 1);
    assert_eq!(id.calls(), 0, "no notify before the handshake");
    assert_eq!(pump.progress(QP), Some(Progress::Pending));
    // The script's EINVAL stood for the kernel before accept; after it, the receive
    // trigger forces the establish.
    id.0.answers.borrow_mut().clear();
    assert_eq!(
        pump.on_receive_completion(QP),
        Some(PumpEvent::Forced {
            qp: QP,
            trigger: Trigger::ReceiveCompletion
        })
    );
}

// --- iWARP: nothing for notify to force ---

/// On iWARP the kernel answers every notify with 0 and does nothing: the pump never
/// calls it, for either trigger (early ones included), and never reports a rescue; the
/// CM's own ESTABLISHED establishes the connection.
#[test]
fn an_id_on_iwarp_is_never_notified_and_never_reported_forced() {
    let early = TestId::new(QP, &[]);
    early.0.iwarp.set(true);
    let mut pump = NotifyPump::new();
    assert_eq!(pump.on_receive_completion(QP), None, "kept for replay");
    let registration = pump.register(early.clone(), Role::Passive).unwrap();
    assert_eq!(
        registration.replayed, None,
        "nothing to replay into a notify"
    );
    assert_eq!(pump.progress(QP), Some(Progress::NotForcible));
    assert_eq!(pump.on_receive_completion(QP), None);
    assert_eq!(
        pump.on_async_event(comm_est(QP)),
        PumpEvent::PassThrough(comm_est(QP))
    );
    assert_eq!(early.calls(), 0, "notify never called");
    let counters = pump.counters();
    assert_eq!(
        (counters.forced, counters.not_forcible),
        (0, 3),
        "{counters:?}"
    );
    pump.on_cm_event(CmEventType::Established, Some(QP));
    assert_eq!(pump.progress(QP), Some(Progress::Established));
}
