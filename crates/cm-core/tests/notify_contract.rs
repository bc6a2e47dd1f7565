//! The notify contract: errno mapping, the kernel table, the routing policy.

use cm_core::kernel_model::{ib_cm_notify, notify_delivers_established, LapState};
use cm_core::{
    errno, notify_result_from_errno, AsyncEvent, AsyncEventType, CmError, EventElement, IbCmState,
    NotifyError, NotifyOutcome, QpNum, Route, RoutingPolicy,
};

#[test]
fn errno_table_is_the_documented_table() {
    let table: [(i32, Result<NotifyOutcome, NotifyError>); 7] = [
        (0, Ok(NotifyOutcome::Established)),
        (106, Ok(NotifyOutcome::AlreadyEstablished)),
        (22, Err(NotifyError::WrongState)),
        (2, Err(NotifyError::UnknownId)),
        (6, Err(NotifyError::IdDestroyed)),
        (19, Err(NotifyError::NoDevice)),
        (61, Err(NotifyError::ShortWrite)),
    ];
    for (e, want) in table {
        assert_eq!(notify_result_from_errno(e), want, "errno {e}");
        assert_eq!(notify_result_from_errno(-e), want, "-errno {e}");
        if let Err(err) = want {
            assert_eq!(err.errno(), e);
        }
    }
    let other = notify_result_from_errno(errno::EAGAIN).unwrap_err();
    assert_eq!(other, NotifyError::Os(cm_core::Errno(11)));
    assert_eq!(other.errno(), 11);
    assert!(other.to_string().contains("EAGAIN (11)"), "{other}");
    // i32::MIN has no absolute value: still no panic, errno kept.
    assert!(notify_result_from_errno(i32::MIN).is_err());
}

#[test]
fn error_messages_name_the_errno() {
    assert!(NotifyError::WrongState.to_string().contains("EINVAL"));
    assert!(NotifyError::UnknownId.to_string().contains("ENOENT"));
    assert!(NotifyError::IdDestroyed.to_string().contains("ENXIO"));
    assert!(NotifyError::NoDevice.to_string().contains("ENODEV"));
    assert!(NotifyError::ShortWrite.to_string().contains("ENODATA"));
    let e = CmError::from_errno("rdma_create_event_channel", errno::ENODEV);
    assert!(e.is_no_device());
    assert_eq!(e.errno(), 19);
    let e = CmError::from_errno("rdma_accept", errno::EINVAL);
    assert!(!e.is_no_device());
    assert_eq!(e.to_string(), "rdma_accept failed: EINVAL (22)");
}

/// The kernel's table, written out state by state (cm.c: cm_establish, cm_migrate).
#[test]
fn cm_errors_become_io_errors_with_errno_or_message_kept() {
    use std::io::ErrorKind;
    let io = std::io::Error::from(CmError::from_errno("rdma_create_qp", errno::ENOMEM));
    assert_eq!(io.raw_os_error(), Some(errno::ENOMEM));
    assert_eq!(io.kind(), ErrorKind::OutOfMemory);
    let io = std::io::Error::from(CmError::from_errno("rdma_bind_addr", errno::ENODEV));
    assert_eq!(io.raw_os_error(), Some(errno::ENODEV));

    let refused = CmError::InvalidArgument {
        op: "rdma_connect",
        reason: "no address",
    };
    let io = std::io::Error::from(refused.clone());
    assert_eq!(io.raw_os_error(), None, "no call answered an errno");
    assert_eq!(io.kind(), ErrorKind::InvalidInput);
    assert_eq!(io.to_string(), refused.to_string(), "the message is kept");

    fn returns_io_result() -> std::io::Result<()> {
        Err(CmError::from_errno("rdma_listen", errno::EBUSY))?
    }
    assert_eq!(
        returns_io_result().unwrap_err().kind(),
        ErrorKind::ResourceBusy
    );
}

#[test]
fn kernel_notify_table_for_every_state_and_event() {
    for &state in IbCmState::ALL {
        for raw in 0..=40u32 {
            let event = AsyncEventType::from_raw(raw);
            for lap in [LapState::Uninit, LapState::Idle, LapState::Busy] {
                let want = match (event, state) {
                    (AsyncEventType::CommEst, IbCmState::RepSent | IbCmState::MraRepRcvd) => {
                        Ok(NotifyOutcome::Established)
                    }
                    (AsyncEventType::CommEst, IbCmState::Established) => {
                        Ok(NotifyOutcome::AlreadyEstablished)
                    }
                    (AsyncEventType::PathMig, IbCmState::Established) if lap != LapState::Busy => {
                        Ok(NotifyOutcome::Established)
                    }
                    _ => Err(NotifyError::WrongState),
                };
                assert_eq!(
                    ib_cm_notify(state, lap, event),
                    want,
                    "{state} {event:?} {lap:?}"
                );
            }
            let delivers = event == AsyncEventType::CommEst
                && matches!(state, IbCmState::RepSent | IbCmState::MraRepRcvd);
            assert_eq!(notify_delivers_established(state, event), delivers);
        }
    }
}

#[test]
fn routing_sends_comm_est_to_the_cm_and_the_rest_to_the_application() {
    let qp = QpNum(0x1234);
    for &event_type in AsyncEventType::ALL {
        let event = AsyncEvent::qp(event_type, qp);
        let default_route = RoutingPolicy::default().route(&event);
        let with_mig = RoutingPolicy {
            forward_path_mig: true,
        }
        .route(&event);
        match event_type {
            AsyncEventType::CommEst => {
                let want = Route::Notify {
                    qp,
                    event: event_type,
                };
                assert_eq!(default_route, want);
                assert_eq!(with_mig, want);
            }
            AsyncEventType::PathMig => {
                assert_eq!(default_route, Route::Application);
                assert_eq!(
                    with_mig,
                    Route::Notify {
                        qp,
                        event: event_type
                    }
                );
            }
            _ => {
                assert_eq!(default_route, Route::Application);
                assert_eq!(with_mig, Route::Application);
            }
        }
    }
    // A COMM_EST without a QP element cannot be routed to an id: the application's.
    let odd = AsyncEvent {
        event_type: AsyncEventType::CommEst,
        element: EventElement::Port(1),
    };
    assert_eq!(RoutingPolicy::COMM_EST_ONLY.route(&odd), Route::Application);
    let unknown = AsyncEvent {
        event_type: AsyncEventType::Unknown(77),
        element: EventElement::Unknown,
    };
    assert_eq!(RoutingPolicy::default().route(&unknown), Route::Application);
}

#[test]
fn events_print_what_and_where() {
    let e = AsyncEvent::qp(AsyncEventType::CommEst, QpNum(0x11));
    assert_eq!(e.to_string(), "communication established on QP 0x11");
    assert_eq!(e.qp_num(), Some(QpNum(0x11)));
}
