//! A connection over the application's own QP: the endpoint is its CM and its notify
//! path, the data path is the application's. On the passive side the application makes
//! its QP on the request's id (`Endpoint::cm_id`: its own completion queues, protection
//! domain, memory) before `Endpoint::accept_request`; the endpoint then makes nothing
//! for it, never reads its completion queues, forwards its COMM_EST as for any QP, and
//! takes the application's word for a receive that completed before ESTABLISHED
//! ([`Endpoint::received`]): the trigger of a lost RTU on a device without COMM_EST.
//! Through handles: `Request::with_id`, `Request::accept`, `Connection::received`.
//! On the active side (`ConnectOptions::application_qp`) the endpoint stops once the
//! route is resolved (`Event::RouteResolved`), the application makes its QP on the id,
//! and [`Endpoint::connect_application_qp`] sends the REQ; the active side needs no
//! notify (its ESTABLISHED comes from the REP), the endpoint is its CM.

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
        device_index: usize,
        qp: QpNum,
        role: Role,
    ) -> Result<(), cm_core::CmError> {
        self.by_qp.insert(qp, SlotIndex::of(conn));
        self.transport.claim_qp(&self.devices[device_index], qp);
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

    /// Sends the REQ of an active connection made with
    /// [`ConnectOptions::application_qp`](crate::ConnectOptions::application_qp), over the
    /// QP the application made on its id ([`Endpoint::cm_id`]) after
    /// [`Event::RouteResolved`](crate::Event::RouteResolved). [`ConnError::WrongState`]
    /// before the route is resolved, once the REQ is sent, or while the id has no QP;
    /// a connect the CM refuses closes the connection
    /// ([`CloseReason::SetupFailed`](crate::CloseReason::SetupFailed), reported) and is
    /// returned. O(1).
    pub fn connect_application_qp(&mut self, conn: ConnectionId) -> Result<(), ConnError> {
        let entry = self.conn(conn)?;
        if entry.state != ConnState::AwaitingQp {
            return Err(ConnError::WrongState {
                conn,
                what: "connect_application_qp",
                needs: "its route resolved and no REQ sent (ConnectOptions::application_qp)",
            });
        }
        if cm_core::CmId::qp_num(&entry.id).is_none() {
            return Err(ConnError::WrongState {
                conn,
                what: "connect_application_qp",
                needs: "a QP made on its id (Endpoint::cm_id)",
            });
        }
        if let Err(error) = self.connect_resolved(conn) {
            self.close(conn, super::CloseReason::SetupFailed(error.clone()), false);
            return Err(error.into());
        }
        Ok(())
    }

    /// Sets `timer` ([`ConnectionParams::min_rnr_timer`](crate::ConnectionParams::min_rnr_timer))
    /// on `conn`'s QP, in RTS: not on a QP the application made, nor on iWARP (no RNR
    /// NAK there, and its CM forces nothing either: [`crate::core::CmId::notify_forces`]).
    pub(super) fn apply_min_rnr_timer(
        &mut self,
        conn: ConnectionId,
        timer: Option<u8>,
    ) -> Result<(), cm_core::CmError> {
        let Some(timer) = timer else {
            return Ok(());
        };
        let Some(entry) = self.live(conn).filter(|c| !c.application_qp) else {
            return Ok(());
        };
        let id = entry.id.clone();
        if !cm_core::CmId::notify_forces(&id) {
            return Ok(());
        }
        self.transport.set_min_rnr_timer(&id, timer)
    }

    /// Whether `conn`'s QP is the application's (see the module's documentation).
    pub fn has_application_qp(&self, conn: ConnectionId) -> Result<bool, ConnError> {
        Ok(self.conn(conn)?.application_qp)
    }
}
