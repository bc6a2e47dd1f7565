//! Unit tests of the pump and the loop against mockall mocks: every notify answer,
//! unregistered QPs, pass-through, the receive-completion trigger.

use cm_core::{
    AsyncEvent, AsyncEventType, CmError, CmEventType, Errno, EventElement, NotifyError,
    NotifyOutcome, QpNum, RoutingPolicy,
};
use cm_mock::{MockAsyncEventSource, MockCmEvent, MockCmEventSource, MockCmId};
use cm_verbs::{
    Control, EventLoop, LoopEvent, NotifyPump, Progress, PumpEvent, Ready, RegisterError, Role,
    Trigger,
};
use mockall::predicate::eq;

const QP: QpNum = QpNum(0x42);
const COMM_EST: Trigger = Trigger::AsyncEvent(AsyncEventType::CommEst);

fn id_answering(times: usize, answer: Result<NotifyOutcome, NotifyError>) -> MockCmId {
    let mut id = MockCmId::new();
    id.expect_qp_num().return_const(Some(QP));
    id.expect_notify()
        .with(eq(AsyncEventType::CommEst))
        .times(times)
        .returning(move |_| answer);
    id
}

/// A pump with one passive connection: `id`, on [`QP`].
fn passive_pump(id: MockCmId) -> NotifyPump<MockCmId> {
    let mut pump = NotifyPump::new();
    pump.register(id, Role::Passive).unwrap();
    pump
}

fn comm_est(qp: QpNum) -> AsyncEvent {
    AsyncEvent::qp(AsyncEventType::CommEst, qp)
}

#[test]
fn comm_est_forces_established() {
    let mut pump = passive_pump(id_answering(1, Ok(NotifyOutcome::Established)));
    assert_eq!(
        pump.on_async_event(comm_est(QP)),
        PumpEvent::Forced {
            qp: QP,
            trigger: COMM_EST
        }
    );
    assert_eq!(pump.progress(QP), Some(Progress::Established));
    let c = pump.counters();
    assert_eq!(
        (c.forced, c.already_established, c.notify_failed),
        (1, 0, 0)
    );
}

#[test]
fn eisconn_is_success() {
    let mut pump = passive_pump(id_answering(1, Ok(NotifyOutcome::AlreadyEstablished)));
    assert_eq!(
        pump.on_async_event(comm_est(QP)),
        PumpEvent::AlreadyEstablished {
            qp: QP,
            trigger: COMM_EST
        }
    );
    assert_eq!(pump.progress(QP), Some(Progress::Established));
    assert_eq!(pump.counters().already_established, 1);
}

#[test]
fn every_notify_error_is_surfaced_typed_with_its_errno() {
    // The errors that mean the connection moved on; transient ones are in pump_retry.rs.
    let errors = [
        NotifyError::WrongState,
        NotifyError::UnknownId,
        NotifyError::IdDestroyed,
        NotifyError::NoDevice,
        NotifyError::Os(Errno(22)),
    ];
    for (i, error) in errors.into_iter().enumerate() {
        let mut pump = passive_pump(id_answering(1, Err(error)));
        let event = pump.on_async_event(comm_est(QP));
        assert_eq!(
            event,
            PumpEvent::NotifyFailed {
                qp: QP,
                trigger: COMM_EST,
                error
            }
        );
        assert!(event.is_failure());
        let PumpEvent::NotifyFailed { error: got, .. } = event else {
            unreachable!()
        };
        assert_eq!(got.errno(), error.errno(), "case {i}");
        assert_eq!(pump.counters().notify_failed, 1);
        assert_eq!(pump.counters().notify_failed_retriable, 0);
        // A connection that moved on no longer turns receives into notify calls.
        assert_eq!(pump.progress(QP), Some(Progress::NotifyFailed));
        assert_eq!(pump.on_receive_completion(QP), None);
    }
}

#[test]
fn comm_est_for_an_unregistered_qp_is_unrouted_not_lost() {
    let mut pump: NotifyPump<MockCmId> = NotifyPump::new();
    let event = comm_est(QpNum(9));
    assert_eq!(pump.on_async_event(event), PumpEvent::Unrouted(event));
    assert_eq!(pump.counters().unrouted, 1);
    // After unregistering, the same holds, and the id is given back.
    pump.register(
        id_answering(0, Ok(NotifyOutcome::Established)),
        Role::Passive,
    )
    .unwrap();
    assert!(pump.unregister(QP).is_some());
    assert_eq!(
        pump.on_async_event(comm_est(QP)),
        PumpEvent::Unrouted(comm_est(QP))
    );
    assert!(pump.is_empty());
}

#[test]
fn application_events_pass_through_without_notify() {
    let mut pump = NotifyPump::new();
    // times(0): any notify call fails the test.
    pump.register(
        id_answering(0, Ok(NotifyOutcome::Established)),
        Role::Passive,
    )
    .unwrap();
    for &kind in AsyncEventType::ALL {
        if kind == AsyncEventType::CommEst {
            continue;
        }
        let event = AsyncEvent::qp(kind, QP);
        assert_eq!(pump.on_async_event(event), PumpEvent::PassThrough(event));
    }
    let port = AsyncEvent {
        event_type: AsyncEventType::PortErr,
        element: EventElement::Port(1),
    };
    assert_eq!(pump.on_async_event(port), PumpEvent::PassThrough(port));
    let unknown = AsyncEvent {
        event_type: AsyncEventType::Unknown(99),
        element: EventElement::Unknown,
    };
    assert_eq!(
        pump.on_async_event(unknown),
        PumpEvent::PassThrough(unknown)
    );
    assert_eq!(
        pump.counters().passed_through,
        AsyncEventType::ALL.len() as u64 + 1
    );
}

#[test]
fn path_mig_goes_to_the_cm_only_when_configured() {
    let mut id = MockCmId::new();
    id.expect_qp_num().return_const(Some(QP));
    id.expect_notify()
        .with(eq(AsyncEventType::PathMig))
        .times(1)
        .returning(|_| Err(NotifyError::WrongState));
    let mut pump = NotifyPump::with_policy(
        RoutingPolicy {
            forward_path_mig: true,
        },
        4,
    );
    pump.register(id, Role::Passive).unwrap();
    let event = AsyncEvent::qp(AsyncEventType::PathMig, QP);
    assert_eq!(
        pump.on_async_event(event),
        PumpEvent::NotifyFailed {
            qp: QP,
            trigger: Trigger::AsyncEvent(AsyncEventType::PathMig),
            error: NotifyError::WrongState
        }
    );
    // A PATH_MIG refusal says nothing about establishment.
    assert_eq!(pump.progress(QP), Some(Progress::Pending));
}

#[test]
fn receive_completion_notifies_once_for_a_pending_passive_connection() {
    let mut pump = passive_pump(id_answering(1, Ok(NotifyOutcome::Established)));
    assert_eq!(
        pump.on_receive_completion(QP),
        Some(PumpEvent::Forced {
            qp: QP,
            trigger: Trigger::ReceiveCompletion
        })
    );
    // Further receives cost a lookup and call nothing (times(1) above).
    for _ in 0..10 {
        assert_eq!(pump.on_receive_completion(QP), None);
    }
    assert_eq!(pump.counters().receive_triggers, 1);
    assert_eq!(pump.on_receive_completion(QpNum(1)), None);
}

#[test]
fn receive_completion_after_established_event_calls_nothing() {
    let mut pump = passive_pump(id_answering(0, Ok(NotifyOutcome::Established)));
    assert!(pump
        .on_cm_event(CmEventType::Established, Some(QP))
        .is_none());
    assert_eq!(pump.on_receive_completion(QP), None);
}

#[test]
fn receive_completion_on_the_active_side_calls_nothing() {
    let mut pump = NotifyPump::new();
    pump.register(
        id_answering(0, Ok(NotifyOutcome::Established)),
        Role::Active,
    )
    .unwrap();
    assert_eq!(pump.on_receive_completion(QP), None);
}

#[test]
fn registration_errors_are_typed() {
    let mut pump = NotifyPump::new();
    let mut no_qp = MockCmId::new();
    no_qp.expect_qp_num().return_const(None);
    assert_eq!(
        pump.register(no_qp, Role::Passive).err(),
        Some(RegisterError::NoQp)
    );
    assert!(pump.is_empty());
}

#[test]
fn failure_events_unregister_the_connection() {
    for kind in [
        CmEventType::Disconnected,
        CmEventType::Unreachable,
        CmEventType::Rejected,
        CmEventType::ConnectError,
        CmEventType::DeviceRemoval,
    ] {
        let mut pump = passive_pump(id_answering(0, Ok(NotifyOutcome::Established)));
        assert!(pump.on_cm_event(kind, Some(QP)).is_some(), "{kind}");
        assert!(pump.is_empty());
    }
}

#[test]
fn drain_handles_every_pending_event_and_stops_on_none() {
    let mut source = MockAsyncEventSource::new();
    let mut queue = vec![
        comm_est(QP),
        AsyncEvent::qp(AsyncEventType::QpFatal, QP),
        comm_est(QpNum(3)),
    ]
    .into_iter();
    source
        .expect_try_next_async_event()
        .times(4)
        .returning(move || Ok(queue.next()));
    let mut pump = passive_pump(id_answering(1, Ok(NotifyOutcome::Established)));
    let mut seen = Vec::new();
    assert_eq!(pump.drain(&mut source, |e| seen.push(e)).unwrap(), 3);
    assert!(matches!(seen[0], PumpEvent::Forced { .. }));
    assert!(matches!(seen[1], PumpEvent::PassThrough(_)));
    assert!(matches!(seen[2], PumpEvent::Unrouted(_)));
}

#[test]
fn drain_passes_source_errors_up() {
    let mut source = MockAsyncEventSource::new();
    source
        .expect_try_next_async_event()
        .returning(|| Err(CmError::from_errno("ibv_get_async_event", 5)));
    let mut pump: NotifyPump<MockCmId> = NotifyPump::new();
    assert_eq!(pump.drain(&mut source, |_| {}).unwrap_err().errno(), 5);
}

fn cm_event(kind: CmEventType, qp: QpNum) -> MockCmEvent {
    let mut event = MockCmEvent::new();
    event.expect_event_type().return_const(kind);
    event.expect_qp_num().return_const(Some(qp));
    event
}

#[test]
fn loop_pumps_async_events_first_then_hands_cm_events_in_order() {
    let mut asyncs = MockAsyncEventSource::new();
    let mut pending = Some(comm_est(QP));
    asyncs
        .expect_try_next_async_event()
        .returning(move || Ok(pending.take()));
    let mut cms = MockCmEventSource::new();
    let mut queue = vec![
        cm_event(CmEventType::Established, QP),
        cm_event(CmEventType::Disconnected, QP),
    ]
    .into_iter();
    cms.expect_try_next_event()
        .returning(move || Ok(queue.next()));

    let pump = passive_pump(id_answering(1, Ok(NotifyOutcome::Established)));
    let mut event_loop = EventLoop::new(cms, asyncs, pump);
    let mut order = Vec::new();
    let ready = Ready {
        cm_events: true,
        async_events: true,
        shutdown: false,
    };
    let control = event_loop
        .poll_once(ready, &mut |_pump, event| {
            order.push(match event {
                LoopEvent::Pump(p) => format!("pump {p:?}"),
                LoopEvent::Cm(e) => format!("cm {}", cm_core::CmEvent::event_type(&e)),
            });
            Control::Continue
        })
        .unwrap();
    assert_eq!(control, Control::Continue);
    assert_eq!(order.len(), 3);
    assert!(order[0].starts_with("pump Forced"));
    assert_eq!(order[1], "cm RDMA_CM_EVENT_ESTABLISHED");
    assert_eq!(order[2], "cm RDMA_CM_EVENT_DISCONNECTED");
    // DISCONNECTED unregistered the connection.
    assert!(event_loop.pump().is_empty());
}

#[test]
fn loop_runs_until_shutdown_and_stops_when_told() {
    struct Scripted(Vec<Ready>);
    impl cm_verbs::Waiter for Scripted {
        fn wait(&mut self) -> Result<Ready, CmError> {
            Ok(self.0.remove(0))
        }
    }
    let mut asyncs = MockAsyncEventSource::new();
    asyncs.expect_try_next_async_event().returning(|| Ok(None));
    let mut cms = MockCmEventSource::new();
    cms.expect_try_next_event().returning(|| Ok(None));
    let mut event_loop = EventLoop::new(cms, asyncs, NotifyPump::<MockCmId>::new());
    let mut waiter = Scripted(vec![
        Ready {
            cm_events: true,
            ..Ready::default()
        },
        Ready {
            shutdown: true,
            ..Ready::default()
        },
    ]);
    assert_eq!(
        event_loop
            .run(&mut waiter, |_, _| Control::Continue)
            .unwrap(),
        cm_verbs::Exit::Shutdown
    );

    let mut cms = MockCmEventSource::new();
    let mut one = Some(cm_event(CmEventType::Established, QP));
    cms.expect_try_next_event()
        .returning(move || Ok(one.take()));
    let mut asyncs = MockAsyncEventSource::new();
    asyncs.expect_try_next_async_event().returning(|| Ok(None));
    let mut event_loop = EventLoop::new(cms, asyncs, NotifyPump::<MockCmId>::new());
    let mut waiter = Scripted(vec![Ready {
        cm_events: true,
        ..Ready::default()
    }]);
    assert_eq!(
        event_loop.run(&mut waiter, |_, _| Control::Stop).unwrap(),
        cm_verbs::Exit::Stopped
    );
}
