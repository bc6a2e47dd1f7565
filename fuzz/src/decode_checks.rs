//! Bodies of the decoding fuzz targets: each takes arbitrary bytes, decodes them as
//! the backend would decode kernel and library records, and panics when a decoder
//! breaks its contract (a panic is a finding).

use std::fmt::Write as _;

use cm_core::decode::{carries_private_data, decode_async_event, decode_cm_event, CmEventStatus};
use cm_core::kernel_model::{ib_cm_notify, notify_delivers_established, LapState};
use cm_core::{
    errno, notify_result_from_errno, AsyncEventType, CmError, CmEventType, CmIdState, EventElement,
    EventObject, IbCmState, NotifyOutcome, Route, RoutingPolicy,
};

use crate::input::Input;

/// Records `struct ibv_async_event` as the device reports them: type, port number and
/// the object the pointer names (or NULL).
pub fn async_event(data: &[u8]) {
    let mut input = Input::new(data);
    let mut text = String::new();
    while !input.is_empty() {
        let raw_type = input.u32();
        let port_num = input.i32();
        let object = input.bool().then(|| input.u32());
        let mut reads = 0;
        let event = decode_async_event(raw_type, port_num, |asked| {
            reads += 1;
            assert!(
                matches!(
                    asked,
                    EventObject::Qp | EventObject::Cq | EventObject::Srq | EventObject::Wq
                ),
                "type {raw_type} read a {asked:?} member"
            );
            object
        });
        let kind = event.event_type.object();
        assert_eq!(event.event_type.as_raw(), raw_type);
        assert_eq!(AsyncEventType::from_raw(raw_type), event.event_type);
        let expected_reads = match kind {
            EventObject::Qp | EventObject::Cq | EventObject::Srq | EventObject::Wq => 1,
            EventObject::Port | EventObject::Unknown => 0,
        };
        assert_eq!(reads, expected_reads, "type {raw_type}");
        let consistent = match (kind, event.element) {
            (_, EventElement::Unknown) => {
                kind == EventObject::Unknown
                    || (kind == EventObject::Port && u8::try_from(port_num).is_err())
                    || (reads == 1 && object.is_none())
            }
            (EventObject::Qp, EventElement::Qp(qp)) => Some(qp.0) == object,
            (EventObject::Cq, EventElement::Cq(h))
            | (EventObject::Srq, EventElement::Srq(h))
            | (EventObject::Wq, EventElement::Wq(h)) => Some(h) == object,
            (EventObject::Port, EventElement::Port(p)) => i32::from(p) == port_num,
            _ => false,
        };
        assert!(consistent, "type {raw_type}: {event:?}");
        assert_eq!(
            event.qp_num().is_some(),
            matches!(event.element, EventElement::Qp(_))
        );
        for policy in [
            RoutingPolicy::COMM_EST_ONLY,
            RoutingPolicy {
                forward_path_mig: true,
            },
        ] {
            if let Route::Notify { qp, event: routed } = policy.route(&event) {
                assert_eq!(Some(qp), event.qp_num());
                assert_eq!(routed, event.event_type);
                assert!(matches!(
                    routed,
                    AsyncEventType::CommEst | AsyncEventType::PathMig
                ));
            }
        }
        assert!(!event.event_type.libibverbs_str().is_empty());
        text.clear();
        write!(text, "{event}").expect("formatting into a String");
        assert!(!text.is_empty());
    }
}

/// Records `struct rdma_cm_event` as librdmacm returns them: type, status, and the
/// private data's pointer (NULL or not) and length.
pub fn cm_event(data: &[u8]) {
    let mut input = Input::new(data);
    let mut text = String::new();
    while !input.is_empty() {
        let raw_type = input.u32();
        let status = input.i32();
        let present = input.bool();
        let len = input.u8();
        let record = decode_cm_event(raw_type, status, present, len);
        assert_eq!(record.event_type.as_raw(), raw_type);
        assert_eq!(record.status.as_raw(), status);
        assert_eq!(
            record.status,
            CmEventStatus::decode(record.event_type, status)
        );
        match record.status {
            CmEventStatus::Success => assert_eq!(status, 0),
            CmEventStatus::Errno(e) => assert!(e.0 > 0 && status < 0),
            CmEventStatus::RejectReason(_) => {
                assert_eq!(record.event_type, CmEventType::Rejected);
                assert!(status > 0);
            }
            CmEventStatus::Other(_) => {
                assert!(
                    status == i32::MIN
                        || (status > 0 && record.event_type != CmEventType::Rejected)
                );
            }
        }
        assert!(record.private_data_len <= usize::from(len));
        if record.private_data_len > 0 {
            assert!(present && carries_private_data(record.event_type));
        }
        assert_eq!(
            record.private_data_len,
            if present && carries_private_data(record.event_type) {
                usize::from(len)
            } else {
                0
            }
        );
        let librdmacm = record.event_type.librdmacm_str();
        assert!(librdmacm.starts_with("RDMA_CM_EVENT_") || librdmacm == "UNKNOWN EVENT");
        text.clear();
        write!(text, "{}", record.event_type).expect("formatting into a String");
        assert!(text.starts_with("RDMA_CM_EVENT_") || text == format!("unknown({raw_type})"));
    }
}

/// What `rdma_notify` and the other calls answer: arbitrary errnos, both signs.
pub fn errno_mapping(data: &[u8]) {
    let mut input = Input::new(data);
    let mut text = String::new();
    while !input.is_empty() {
        let raw = input.i32();
        let magnitude = raw.wrapping_abs();
        let result = notify_result_from_errno(raw);
        match result {
            Ok(NotifyOutcome::Established) => assert_eq!(magnitude, 0),
            Ok(NotifyOutcome::AlreadyEstablished) => assert_eq!(magnitude, errno::EISCONN),
            Err(error) => {
                assert!(magnitude != 0 && magnitude != errno::EISCONN);
                assert_eq!(error.errno(), magnitude, "{raw}");
                text.clear();
                write!(text, "{error}").expect("formatting into a String");
                assert!(!text.is_empty());
            }
        }
        let error = CmError::from_errno("rdma_notify", raw);
        assert_eq!(error.errno(), raw);
        assert_eq!(error.is_no_device(), raw == errno::ENODEV);
        text.clear();
        write!(text, "{error}").expect("formatting into a String");
        assert!(text.contains("rdma_notify"));
        if let Some(name) = errno::name(raw) {
            assert!(name.starts_with('E'));
        }
    }
}

/// Kernel state and event numbers: `ib_cm_state`, `rdma_cm_state`, event types, and
/// the kernel's notify table over every combination they decode to.
pub fn event_numbers(data: &[u8]) {
    let mut input = Input::new(data);
    while !input.is_empty() {
        let raw_state = input.u32();
        let raw_event = input.u32();
        let lap = match input.below(3) {
            0 => LapState::Uninit,
            1 => LapState::Idle,
            _ => LapState::Busy,
        };
        match IbCmState::from_raw(raw_state) {
            Some(state) => {
                assert!(raw_state < 16);
                assert_eq!(state.as_raw(), raw_state);
                assert!(state.name().starts_with("IB_CM_"));
                let event = AsyncEventType::from_raw(raw_event);
                assert_eq!(event.as_raw(), raw_event);
                let answer = ib_cm_notify(state, lap, event);
                let forced = notify_delivers_established(state, event);
                match event {
                    AsyncEventType::CommEst => match state {
                        IbCmState::RepSent | IbCmState::MraRepRcvd => {
                            assert_eq!(answer, Ok(NotifyOutcome::Established));
                            assert!(forced);
                        }
                        IbCmState::Established => {
                            assert_eq!(answer, Ok(NotifyOutcome::AlreadyEstablished));
                            assert!(!forced);
                        }
                        _ => {
                            assert_eq!(answer.map_err(|e| e.errno()), Err(errno::EINVAL));
                            assert!(!forced);
                        }
                    },
                    AsyncEventType::PathMig => {
                        assert!(!forced);
                        let accepted = state == IbCmState::Established && lap != LapState::Busy;
                        assert_eq!(answer.is_ok(), accepted);
                    }
                    _ => {
                        assert!(!forced);
                        assert_eq!(answer.map_err(|e| e.errno()), Err(errno::EINVAL));
                    }
                }
            }
            None => assert!(raw_state >= 16),
        }
        match CmIdState::from_raw(raw_state) {
            Some(state) => {
                assert!(raw_state < 11);
                assert_eq!(state.as_raw(), raw_state);
                assert!(state.name().starts_with("RDMA_CM_"));
            }
            None => assert!(raw_state >= 11),
        }
        let cm_event = CmEventType::from_raw(raw_event);
        assert_eq!(cm_event.as_raw(), raw_event);
        assert_eq!(cm_event.name().is_some(), raw_event < 20);
        if cm_event.is_connect_failure() {
            assert!(matches!(raw_event, 6..=8));
        }
    }
}
