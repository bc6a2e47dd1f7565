//! Decoding of the records the kernel and the libraries hand over, as pure functions.
//!
//! A backend reads C memory (`struct ibv_async_event`, `struct rdma_cm_event`); what it
//! makes of the numbers it finds there is decided here, without pointers, so that every
//! possible input can be tested and fuzzed. The backend keeps only the reads themselves.
//!
//! ```
//! use cm_core::decode::{decode_async_event, decode_cm_event, CmEventStatus};
//! use cm_core::{errno, AsyncEventType, CmEventType, EventElement, EventObject, QpNum};
//!
//! // COMM_EST names a QP: the backend is asked for the QP's number, and only for that.
//! let event = decode_async_event(4, 0, |object| {
//!     assert_eq!(object, EventObject::Qp);
//!     Some(0x11)
//! });
//! assert_eq!(event.element, EventElement::Qp(QpNum(0x11)));
//!
//! // An unknown event type: the element is never read.
//! let event = decode_async_event(99, 0, |_| unreachable!("never read"));
//! assert_eq!(event.event_type, AsyncEventType::Unknown(99));
//! assert_eq!(event.element, EventElement::Unknown);
//!
//! // UNREACHABLE after the REP retries: status -ETIMEDOUT.
//! let record = decode_cm_event(7, -errno::ETIMEDOUT, true, 0);
//! assert_eq!(record.event_type, CmEventType::Unreachable);
//! assert_eq!(record.status, CmEventStatus::Errno(cm_core::Errno(errno::ETIMEDOUT)));
//! ```
//!
//! Acknowledging a CM event consumes it, so a second acknowledgement, or a use after
//! the acknowledgement, does not compile, whichever backend the event comes from:
//!
//! ```compile_fail
//! fn acknowledge_twice<E: cm_core::CmEvent>(event: E) {
//!     let _ = event.ack();
//!     let _ = event.ack();
//! }
//! ```
//!
//! ```compile_fail
//! fn read_after_ack<E: cm_core::CmEvent>(event: E) -> usize {
//!     let _ = event.ack();
//!     event.private_data().len()
//! }
//! ```

use crate::{AsyncEvent, AsyncEventType, CmEventType, Errno, EventElement, EventObject, QpNum};

/// Decodes one `struct ibv_async_event`.
///
/// `raw_type` is the `event_type` field and `port_num` the `element.port_num` member.
/// `read_object` reads the object member the event type selects (the QP number of a
/// QP, the handle of a CQ, SRQ or WQ) and returns `None` when the pointer is NULL; it is
/// called at most once, and never for port events or unknown event types (whose
/// element cannot be interpreted safely). Port numbers outside `0..=255` are not port
/// numbers and decode as [`EventElement::Unknown`].
pub fn decode_async_event(
    raw_type: u32,
    port_num: i32,
    read_object: impl FnOnce(EventObject) -> Option<u32>,
) -> AsyncEvent {
    let event_type = AsyncEventType::from_raw(raw_type);
    let object = event_type.object();
    let element = match object {
        EventObject::Qp => {
            read_object(object).map_or(EventElement::Unknown, |qp| EventElement::Qp(QpNum(qp)))
        }
        EventObject::Cq => read_object(object).map_or(EventElement::Unknown, EventElement::Cq),
        EventObject::Srq => read_object(object).map_or(EventElement::Unknown, EventElement::Srq),
        EventObject::Wq => read_object(object).map_or(EventElement::Unknown, EventElement::Wq),
        EventObject::Port => {
            u8::try_from(port_num).map_or(EventElement::Unknown, EventElement::Port)
        }
        EventObject::Unknown => EventElement::Unknown,
    };
    AsyncEvent {
        event_type,
        element,
    }
}

/// What the `status` of an `rdma_cm_event` means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmEventStatus {
    /// 0.
    Success,
    /// A negative status: `-errno` (UNREACHABLE after the REP retries: `-ETIMEDOUT`).
    Errno(Errno),
    /// A positive status on REJECTED: the IB CM reject reason (28: consumer-defined).
    RejectReason(u32),
    /// A positive status on any other event, or `i32::MIN` (which negates to no errno):
    /// kept as is.
    Other(i32),
}

impl CmEventStatus {
    /// Interprets `status` for an event of type `event_type`.
    pub const fn decode(event_type: CmEventType, status: i32) -> Self {
        if status == 0 {
            return CmEventStatus::Success;
        }
        if status < 0 {
            return match status.checked_neg() {
                Some(errno) => CmEventStatus::Errno(Errno(errno)),
                None => CmEventStatus::Other(status),
            };
        }
        match event_type {
            CmEventType::Rejected => CmEventStatus::RejectReason(status as u32),
            _ => CmEventStatus::Other(status),
        }
    }

    /// The raw status this was decoded from.
    pub const fn as_raw(self) -> i32 {
        match self {
            CmEventStatus::Success => 0,
            CmEventStatus::Errno(Errno(errno)) => -errno,
            CmEventStatus::RejectReason(reason) => reason as i32,
            CmEventStatus::Other(status) => status,
        }
    }
}

/// The numbers of one `struct rdma_cm_event`, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmEventRecord {
    /// The event type.
    pub event_type: CmEventType,
    /// The status, interpreted for the type.
    pub status: CmEventStatus,
    /// How many bytes of `param.conn.private_data` the event really carries (0 when the
    /// type carries none or the pointer is NULL).
    pub private_data_len: usize,
}

/// Whether events of this type fill `param.conn` (and so may carry private data).
pub const fn carries_private_data(event_type: CmEventType) -> bool {
    matches!(
        event_type,
        CmEventType::ConnectRequest
            | CmEventType::ConnectResponse
            | CmEventType::Established
            | CmEventType::Rejected
            | CmEventType::Disconnected
    )
}

/// Decodes one `struct rdma_cm_event`: the `event` and `status` fields, and the private
/// data's `private_data_len` with whether `private_data` is non-NULL.
///
/// The private data is only read for the connection events that carry it
/// ([`carries_private_data`]): for the others `param` holds another union member and
/// its bytes are no length.
pub const fn decode_cm_event(
    raw_type: u32,
    status: i32,
    private_data_present: bool,
    private_data_len: u8,
) -> CmEventRecord {
    let event_type = CmEventType::from_raw(raw_type);
    let private_data_len = if private_data_present && carries_private_data(event_type) {
        private_data_len as usize
    } else {
        0
    };
    CmEventRecord {
        event_type,
        status: CmEventStatus::decode(event_type, status),
        private_data_len,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::errno;

    #[test]
    fn every_event_type_reads_only_the_member_it_names() {
        for raw in (0u32..64).chain([u32::MAX, 0x8000_0000]) {
            let mut asked = None;
            let event = decode_async_event(raw, 3, |object| {
                asked = Some(object);
                Some(7)
            });
            let expected = AsyncEventType::from_raw(raw).object();
            match expected {
                EventObject::Port => {
                    assert_eq!(asked, None);
                    assert_eq!(event.element, EventElement::Port(3));
                }
                EventObject::Unknown => {
                    assert_eq!(asked, None);
                    assert_eq!(event.element, EventElement::Unknown);
                }
                _ => assert_eq!(asked, Some(expected)),
            }
        }
    }

    #[test]
    fn null_objects_and_impossible_ports_decode_as_unknown() {
        assert_eq!(
            decode_async_event(AsyncEventType::CommEst.as_raw(), 0, |_| None).element,
            EventElement::Unknown
        );
        for port in [-1, 256, i32::MIN, i32::MAX] {
            let event = decode_async_event(AsyncEventType::PortActive.as_raw(), port, |_| None);
            assert_eq!(event.element, EventElement::Unknown, "port {port}");
        }
        let event = decode_async_event(AsyncEventType::PortErr.as_raw(), 255, |_| None);
        assert_eq!(event.element, EventElement::Port(255));
    }

    #[test]
    fn statuses_decode_and_round_trip() {
        let cases = [
            (CmEventType::Established, 0, CmEventStatus::Success),
            (
                CmEventType::Unreachable,
                -errno::ETIMEDOUT,
                CmEventStatus::Errno(Errno(errno::ETIMEDOUT)),
            ),
            (CmEventType::Rejected, 28, CmEventStatus::RejectReason(28)),
            (CmEventType::Established, 5, CmEventStatus::Other(5)),
            (
                CmEventType::ConnectError,
                i32::MIN,
                CmEventStatus::Other(i32::MIN),
            ),
        ];
        for (event_type, raw, expected) in cases {
            let status = CmEventStatus::decode(event_type, raw);
            assert_eq!(status, expected);
            assert_eq!(status.as_raw(), raw);
        }
    }

    #[test]
    fn private_data_is_read_only_for_connection_events() {
        let request = decode_cm_event(CmEventType::ConnectRequest.as_raw(), 0, true, 56);
        assert_eq!(request.private_data_len, 56);
        let null = decode_cm_event(CmEventType::ConnectRequest.as_raw(), 0, false, 56);
        assert_eq!(null.private_data_len, 0);
        let addr = decode_cm_event(CmEventType::AddrResolved.as_raw(), 0, true, 200);
        assert_eq!(addr.private_data_len, 0);
        let unknown = decode_cm_event(1000, 0, true, 200);
        assert_eq!(unknown.event_type, CmEventType::Unknown(1000));
        assert_eq!(unknown.private_data_len, 0);
    }
}
