//! The ABI numbers and strings of cm-core match the C libraries (the tables of
//! docs/notify-semantics.md, "Numbers").

use cm_core::{AsyncEventType, CmEventType, CmIdState, EventObject, IbCmState};

#[test]
fn async_event_numbers_are_the_libibverbs_abi() {
    use AsyncEventType::*;
    let expected = [
        (CqErr, 0),
        (QpFatal, 1),
        (QpReqErr, 2),
        (QpAccessErr, 3),
        (CommEst, 4),
        (SqDrained, 5),
        (PathMig, 6),
        (PathMigErr, 7),
        (DeviceFatal, 8),
        (PortActive, 9),
        (PortErr, 10),
        (LidChange, 11),
        (PkeyChange, 12),
        (SmChange, 13),
        (SrqErr, 14),
        (SrqLimitReached, 15),
        (QpLastWqeReached, 16),
        (ClientReregister, 17),
        (GidChange, 18),
        (WqFatal, 19),
        (DeviceSpeedChange, 20),
    ];
    assert_eq!(AsyncEventType::ALL.len(), expected.len());
    for (event, raw) in expected {
        assert_eq!(event.as_raw(), raw, "{event:?}");
        assert_eq!(AsyncEventType::from_raw(raw), event);
    }
}

#[test]
fn unknown_numbers_decode_without_panic_and_round_trip() {
    for raw in [21, 22, 100, 0x7fff_ffff, u32::MAX] {
        let event = AsyncEventType::from_raw(raw);
        assert_eq!(event, AsyncEventType::Unknown(raw));
        assert_eq!(event.as_raw(), raw);
        assert_eq!(event.object(), EventObject::Unknown);
        assert_eq!(event.libibverbs_str(), "unknown");
        assert_eq!(event.to_string(), format!("unknown({raw})"));
        let cm = CmEventType::from_raw(raw);
        assert_eq!(cm.as_raw(), raw);
        assert_eq!(cm.librdmacm_str(), "UNKNOWN EVENT");
    }
    for raw in 0..=u16::MAX as u32 {
        assert_eq!(AsyncEventType::from_raw(raw).as_raw(), raw);
        assert_eq!(CmEventType::from_raw(raw).as_raw(), raw);
    }
}

#[test]
fn async_event_strings_match_ibv_event_type_str() {
    let expected = [
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
    for (raw, text) in expected.iter().enumerate() {
        let event = AsyncEventType::from_raw(raw as u32);
        assert_eq!(event.to_string(), *text);
        assert_eq!(event.libibverbs_str(), *text);
    }
}

#[test]
fn async_event_objects_follow_the_element_union() {
    use AsyncEventType::*;
    for event in AsyncEventType::ALL {
        let want = match event {
            QpFatal | QpReqErr | QpAccessErr | CommEst | SqDrained | PathMig | PathMigErr
            | QpLastWqeReached => EventObject::Qp,
            CqErr => EventObject::Cq,
            SrqErr | SrqLimitReached => EventObject::Srq,
            WqFatal => EventObject::Wq,
            _ => EventObject::Port,
        };
        assert_eq!(event.object(), want, "{event:?}");
    }
}

#[test]
fn cm_event_numbers_and_strings_match_librdmacm() {
    let names = [
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
    assert_eq!(CmEventType::ALL.len(), names.len());
    for (raw, name) in names.iter().enumerate() {
        let event = CmEventType::from_raw(raw as u32);
        assert_eq!(event.as_raw(), raw as u32);
        assert_eq!(event.name(), Some(*name));
        assert_eq!(event.to_string(), *name);
        // rdma_event_str knows 0..=17; USER and INTERNAL are internal to librdmacm.
        let c_str = if raw <= 17 { *name } else { "UNKNOWN EVENT" };
        assert_eq!(event.librdmacm_str(), c_str);
    }
    assert_eq!(CmEventType::Established.as_raw(), 9);
    assert_eq!(CmEventType::Unreachable.as_raw(), 7);
}

#[test]
fn ib_cm_states_have_kernel_numbers() {
    let names = [
        "IB_CM_IDLE",
        "IB_CM_LISTEN",
        "IB_CM_REQ_SENT",
        "IB_CM_REQ_RCVD",
        "IB_CM_MRA_REQ_SENT",
        "IB_CM_MRA_REQ_RCVD",
        "IB_CM_REP_SENT",
        "IB_CM_REP_RCVD",
        "IB_CM_MRA_REP_SENT",
        "IB_CM_MRA_REP_RCVD",
        "IB_CM_ESTABLISHED",
        "IB_CM_DREQ_SENT",
        "IB_CM_DREQ_RCVD",
        "IB_CM_TIMEWAIT",
        "IB_CM_SIDR_REQ_SENT",
        "IB_CM_SIDR_REQ_RCVD",
    ];
    assert_eq!(IbCmState::ALL.len(), 16);
    for (raw, name) in names.iter().enumerate() {
        let state = IbCmState::from_raw(raw as u32).expect("defined");
        assert_eq!(state.as_raw(), raw as u32);
        assert_eq!(state.name(), *name);
    }
    assert_eq!(IbCmState::from_raw(16), None);
    assert_eq!(IbCmState::RepSent.as_raw(), 6);
    assert_eq!(IbCmState::MraRepRcvd.as_raw(), 9);
    assert_eq!(IbCmState::Established.as_raw(), 10);
}

#[test]
fn cm_id_states_have_kernel_numbers() {
    let names = [
        "RDMA_CM_IDLE",
        "RDMA_CM_ADDR_QUERY",
        "RDMA_CM_ADDR_RESOLVED",
        "RDMA_CM_ROUTE_QUERY",
        "RDMA_CM_ROUTE_RESOLVED",
        "RDMA_CM_CONNECT",
        "RDMA_CM_DISCONNECT",
        "RDMA_CM_ADDR_BOUND",
        "RDMA_CM_LISTEN",
        "RDMA_CM_DEVICE_REMOVAL",
        "RDMA_CM_DESTROYING",
    ];
    assert_eq!(CmIdState::ALL.len(), names.len());
    for (raw, name) in names.iter().enumerate() {
        let state = CmIdState::from_raw(raw as u32).expect("defined");
        assert_eq!(state.as_raw(), raw as u32);
        assert_eq!(state.to_string(), *name);
    }
    assert_eq!(CmIdState::from_raw(11), None);
}
