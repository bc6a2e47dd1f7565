//! A connection over the application's own QP: the endpoint is its CM and its notify
//! path, the data path is the application's. On the passive side the application makes
//! its QP on the request's id (`Endpoint::cm_id`: its own completion queues, protection
//! domain, memory) before `Endpoint::accept_request`; the endpoint then makes nothing
//! for it, never reads its completion queues, forwards its COMM_EST as for any QP, and
//! takes the application's word for a receive that completed before ESTABLISHED
//! ([`Endpoint::received`]): the trigger of a lost RTU on a device without COMM_EST.
//! Through handles: `Request::with_id`, `Request::accept`, `Connection::received`.
//! The active side keeps the endpoint's own queues.

use cm_core::{QpNum, Transport};

use super::{ConnError, ConnState, ConnectionId, Endpoint, QpSlot, SlotIndex};
use crate::Role;

impl<T: Transport> Endpoint<T> {
    /// The application's QP on `conn`'s id: known by its number (its COMM_EST and
    /// [`Endpoint::received`] reach the pump), nothing made for it.
    pub(super) fn adopt_application_qp(
        &mut self,
        conn: ConnectionId,
        id: T::Id,
        qp: QpNum,
        role: Role,
    ) -> Result<(), cm_core::CmError> {
        self.by_qp.insert(qp, SlotIndex::of(conn));
        let entry = self.live_mut(conn).expect("live connection");
        entry.qp = QpSlot::new(qp);
        entry.application_qp = true;
        entry.buffers = None;
        self.register_with_pump(conn, id, qp, role);
        Ok(())
    }

    /// A receive completed on `conn`'s QP, which the application made and reads
    /// itself: on a passive connection not yet established, the endpoint's notify
    /// path takes it as its trigger (the peer sends only once it is established, so
    /// its RTU is late or lost): `rdma_notify` forces the establish, and
    /// [`Event::Established`](crate::Event::Established) follows with
    /// [`EstablishedVia::Notify`](crate::EstablishedVia::Notify). Call it for every
    /// receive completion: once established (or on an active connection) it does
    /// nothing. [`ConnError::WrongState`] before the connection has a QP. O(1).
    pub fn received(&mut self, conn: ConnectionId) -> Result<(), ConnError> {
        let entry = self.conn(conn)?;
        let Some(qp) = entry.qp.get() else {
            return Err(ConnError::WrongState {
                conn,
                what: "received",
                needs: "a QP",
            });
        };
        if entry.state != ConnState::Accepted || entry.via.is_some() {
            return Ok(());
        }
        if let Some(pumped) = self.pump.on_receive_completion(qp) {
            self.on_pumped(Some(conn), pumped);
            // The ESTABLISHED the kernel then delivers may be there already.
            self.read_cm_ahead();
        }
        Ok(())
    }

    /// Whether `conn`'s QP is the application's (see the module's documentation).
    pub fn has_application_qp(&self, conn: ConnectionId) -> Result<bool, ConnError> {
        Ok(self.conn(conn)?.application_qp)
    }
}
