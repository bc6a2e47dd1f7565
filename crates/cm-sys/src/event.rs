//! `CmEvent`: one `rdma_cm_event`, acknowledged exactly once.

use std::ptr::NonNull;
use std::sync::Arc;

use cm_core::{CmError, CmEventType, QpNum};

use crate::channel::ChannelInner;
use crate::ffi;
use crate::id::{CmId, IdInner};

/// One RDMA CM event (`struct rdma_cm_event`), acknowledged exactly once: by
/// [`CmEvent::ack`] or when dropped.
///
/// The event holds its id (for CONNECT_REQUEST: the new id of the connection, and the
/// listener, to which librdmacm accounts the request), so that id cannot be destroyed
/// while the event is unacknowledged: `rdma_destroy_id` would wait for the
/// acknowledgement forever.
pub struct CmEvent {
    raw: NonNull<ffi::rdma_cm_event>,
    event_type: CmEventType,
    status: i32,
    id: Option<CmId>,
    listener: Option<CmId>,
    acked: bool,
}

// SAFETY: the event is owned by this value alone until acknowledged; librdmacm's
// rdma_ack_cm_event may be called from any thread. The private data it points to is
// read-only.
unsafe impl Send for CmEvent {}

/// What reading one event gave.
pub(crate) enum Decoded {
    /// An event for the application.
    Event(CmEvent),
    /// An event about an id being destroyed by another thread: to be dropped (which
    /// acknowledges it) once the channel's lock is released.
    Skipped(CmEvent),
}

impl std::fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmEvent")
            .field("event_type", &self.event_type)
            .field("status", &self.status)
            .field("id", &self.id)
            .field("listener", &self.listener)
            .field("private_data_len", &self.private_data().len())
            .finish()
    }
}

impl CmEvent {
    /// Wraps an event just returned by `rdma_get_cm_event` on `channel`.
    ///
    /// # Safety
    /// `raw` is a live, unacknowledged event read from `channel`, owned by the caller
    /// and given up to this function.
    pub(crate) unsafe fn from_raw(
        raw: NonNull<ffi::rdma_cm_event>,
        channel: &Arc<ChannelInner>,
    ) -> Decoded {
        let ptr = raw.as_ptr();
        // SAFETY: live event; `event` is a plain u32 in rdma-sys (constant module), so
        // any number is a valid value, and `status` is an int.
        let (raw_type, status, raw_id, raw_listener) =
            unsafe { ((*ptr).event, (*ptr).status, (*ptr).id, (*ptr).listen_id) };
        let event_type = CmEventType::from_raw(raw_type);
        let mut event = CmEvent {
            raw,
            event_type,
            status,
            id: None,
            listener: None,
            acked: false,
        };
        if event_type == CmEventType::ConnectRequest {
            // The new id inherits the listener's context from librdmacm: give it its own
            // owner. It is on the listener's channel.
            if let Some(new_id) = NonNull::new(raw_id) {
                // SAFETY: librdmacm just created this id for the request; nobody else
                // owns it, and no event was read for it.
                event.id = Some(unsafe { CmId::from_new_raw(new_id, Arc::clone(channel)) });
            }
            // librdmacm accounts the request to the listener: its rdma_destroy_id waits
            // for this acknowledgement, so the event holds the listener.
            // SAFETY: the listener is alive until this event is acknowledged.
            match unsafe { IdInner::upgrade(raw_listener) } {
                Some(listener) => {
                    listener.event_read();
                    event.listener = Some(CmId::from_inner(listener));
                    return Decoded::Event(event);
                }
                // The listener's last owner is destroying it and waits for this event:
                // the caller acknowledges it, then destroys the new id (the kernel
                // rejects the REQ).
                None => return Decoded::Skipped(event),
            }
        }
        // SAFETY: `event->id` is alive until this event is acknowledged.
        match unsafe { IdInner::upgrade(raw_id) } {
            Some(inner) => {
                inner.event_read();
                event.id = Some(CmId::from_inner(inner));
                Decoded::Event(event)
            }
            // The id's last owner is destroying it right now (rdma_destroy_id waits for
            // this very event): the caller acknowledges it so that the destroy can
            // finish.
            None if !raw_id.is_null() => Decoded::Skipped(event),
            None => Decoded::Event(event),
        }
    }

    /// What happened.
    pub fn event_type(&self) -> CmEventType {
        self.event_type
    }

    /// The event's status: 0, or a negative errno (UNREACHABLE after REP retries:
    /// `-ETIMEDOUT`), or the reject reason of REJECTED.
    pub fn status(&self) -> i32 {
        self.status
    }

    /// The id the event is about; for CONNECT_REQUEST the new id of the incoming
    /// connection (accept or reject it; dropping it rejects the request). Clone it to
    /// keep it past the event.
    pub fn id(&self) -> Option<&CmId> {
        self.id.as_ref()
    }

    /// For CONNECT_REQUEST, the listening id the request arrived on.
    pub fn listener(&self) -> Option<&CmId> {
        self.listener.as_ref()
    }

    /// The QP number of the event's id, when it has a QP.
    pub fn qp_num(&self) -> Option<QpNum> {
        self.id.as_ref().and_then(CmId::qp_num)
    }

    /// The private data of the connection message behind the event (REQ, REP, REJ,
    /// DREQ); empty when there is none. On InfiniBand and RoCE the CM hands over the
    /// message's whole private data field, zero-padded (56 bytes for a REQ): protocols
    /// carry their own length.
    pub fn private_data(&self) -> &[u8] {
        if !cm_core::decode::carries_private_data(self.event_type) {
            return &[];
        }
        let ptr = self.raw.as_ptr();
        // SAFETY: the event is live (not acknowledged while `self` exists); for these
        // connection events librdmacm fills `param.conn` (zeroed otherwise).
        let (data, len) = unsafe {
            let conn = &(*ptr).param.conn;
            (conn.private_data, conn.private_data_len)
        };
        let record = cm_core::decode::decode_cm_event(
            self.event_type.as_raw(),
            self.status,
            !data.is_null(),
            len,
        );
        if record.private_data_len == 0 {
            return &[];
        }
        // SAFETY: librdmacm copied `len` bytes of private data into the event, valid until
        // the acknowledgement, which needs `self` by value.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), record.private_data_len) }
    }

    /// The id librdmacm accounts the event to (whose destroy waits for its
    /// acknowledgement): the listener for CONNECT_REQUEST, else the event's id.
    fn accounted_id(&self) -> Option<&CmId> {
        if self.event_type == CmEventType::ConnectRequest {
            self.listener.as_ref()
        } else {
            self.id.as_ref()
        }
    }

    /// `rdma_ack_cm_event` now.
    pub fn ack(mut self) -> Result<(), CmError> {
        self.ack_once()
    }

    fn ack_once(&mut self) -> Result<(), CmError> {
        if self.acked {
            return Ok(());
        }
        self.acked = true;
        // SAFETY: the event is live and acknowledged only here, once.
        let ret = unsafe { ffi::rdma_ack_cm_event(self.raw.as_ptr()) };
        if let Some(id) = self.accounted_id() {
            id.inner().event_acked();
        }
        if ret == 0 {
            Ok(())
        } else {
            Err(CmError::from_errno("rdma_ack_cm_event", ffi::last_errno()))
        }
    }
}

impl Drop for CmEvent {
    fn drop(&mut self) {
        // Runs before the fields drop: the event is acknowledged before its id (if this
        // was the last owner) is destroyed.
        let _ = self.ack_once();
    }
}

impl cm_core::CmEvent for CmEvent {
    fn event_type(&self) -> CmEventType {
        CmEvent::event_type(self)
    }

    fn status(&self) -> i32 {
        CmEvent::status(self)
    }

    fn qp_num(&self) -> Option<QpNum> {
        CmEvent::qp_num(self)
    }

    fn private_data(&self) -> &[u8] {
        CmEvent::private_data(self)
    }

    fn ack(self) -> Result<(), CmError> {
        CmEvent::ack(self)
    }
}

/// Decodes the type of an `rdma_cm_event` in memory as the raw integer it is.
///
/// # Safety
/// `event` points to a readable `struct rdma_cm_event`.
#[cfg(test)]
unsafe fn raw_event_type(event: *const ffi::rdma_cm_event) -> CmEventType {
    // SAFETY: forwarded from the caller; the field is a u32.
    CmEventType::from_raw(unsafe { (*event).event })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn event_types_decode_from_raw_memory_including_unknown_numbers() {
        for raw in [0u32, 4, 9, 10, 19, 20, 21, 0x7fff_ffff, u32::MAX] {
            // SAFETY: rdma_cm_event is integers, pointers and unions of those: all zeroes
            // is valid.
            let mut event: ffi::rdma_cm_event = unsafe { std::mem::zeroed() };
            // Write the number as the kernel would: four bytes at the field's offset.
            let bytes = (&mut event as *mut ffi::rdma_cm_event).cast::<u8>();
            // SAFETY: the offset is inside the struct and the field is 4 bytes wide.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    raw.to_ne_bytes().as_ptr(),
                    bytes.add(offset_of!(ffi::rdma_cm_event, event)),
                    4,
                )
            };
            // SAFETY: `event` is a live rdma_cm_event.
            let decoded = unsafe { raw_event_type(&event) };
            assert_eq!(decoded, CmEventType::from_raw(raw));
            assert_eq!(decoded.as_raw(), raw);
        }
    }

    #[test]
    fn rdma_cm_event_layout_matches_librdmacm() {
        // struct rdma_cm_event { id*, listen_id*, enum event, int status, union param }.
        assert_eq!(offset_of!(ffi::rdma_cm_event, id), 0);
        assert_eq!(offset_of!(ffi::rdma_cm_event, listen_id), 8);
        assert_eq!(offset_of!(ffi::rdma_cm_event, event), 16);
        assert_eq!(offset_of!(ffi::rdma_cm_event, status), 20);
        assert_eq!(offset_of!(ffi::rdma_cm_event, param), 24);
    }
}
