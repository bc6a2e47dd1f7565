//! Setting a connection up: its QP (made, taken from the device's shared queues, or the
//! application's, adopted), buffers and posted receives, its registration with the
//! pump, then the accept (passive side) or the connect (active side).

use std::cmp::Reverse;

use cm_core::Transport;

use super::{CloseReason, ConnState, ConnectionId, Endpoint, Event, Nanos, Step};
use crate::Role;

impl<T: Transport> Endpoint<T> {
    /// Sets up and accepts a request queued for an auto-accepting listener, if it is
    /// still waiting (its listener or device may have gone since); a setup that fails
    /// rejects the request and reports it.
    pub(super) fn set_up_request(&mut self, conn: ConnectionId) {
        let Some(listener) = self
            .live(conn)
            .filter(|c| c.state == ConnState::Requested)
            .and_then(|c| c.listener)
        else {
            return;
        };
        let Some(private_data) = self
            .listener_entry(listener)
            .map(|l| l.options.private_data.clone())
        else {
            return;
        };
        if let Err(error) = self.setup_and_accept(conn, private_data.as_bytes()) {
            let id = self.live(conn).map(|c| c.id.clone());
            if let Some(id) = id {
                let _ = self.transport.reject(&id, &[]);
            }
            tracing::warn!("{listener}: a request was rejected, its setup failed: {error}");
            self.close(conn, CloseReason::SetupFailed(error.clone()), false);
            self.push_endpoint_event(Event::AcceptFailed { listener, error });
        }
    }

    /// QP, buffers, posted receives and the pump registration, all before the REP
    /// leaves: no trigger can arrive before the pump knows the QP.
    pub(super) fn setup_and_accept(
        &mut self,
        conn: ConnectionId,
        private_data: &[u8],
    ) -> Result<(), cm_core::CmError> {
        let _span = super::trace::conn_span(conn).entered();
        self.setup_qp(conn, Role::Passive)?;
        let entry = self.live(conn).expect("set up above");
        let id = entry.id.clone();
        let listener = entry.listener.and_then(|l| self.listener_entry(l));
        let timeout = listener.and_then(|l| l.options.establish_timeout);
        // The listener's parameters (checked by `listen`); one closed meanwhile leaves
        // none to answer with, and its requests are rejected, not accepted.
        let params = listener.map(|l| l.options.params).unwrap_or_default();
        let ack_timeout = listener.and_then(|l| l.options.id_options.ack_timeout);
        // The ACK timeout is per id, not inherited from the listening one.
        if let Some(timeout) = ack_timeout {
            self.transport
                .set_option(&id, cm_core::IdOption::AckTimeout(timeout))?;
        }
        let called = self.transport.now();
        self.transport.accept(&id, private_data, &params)?;
        self.apply_min_rnr_timer(conn, params.min_rnr_timer)?;
        super::trace::step(conn, "accepted");
        let now = self.transport.now();
        if let Some(entry) = self.live_mut(conn) {
            entry.times.mark(Step::ConnectCalled, called);
            entry.times.mark(Step::ConnectReturned, now);
            entry.state = ConnState::Accepted;
            entry.deadline = Nanos::new(timeout.map(|t| now.saturating_add(t)));
            if let Some(deadline) = entry.deadline.get() {
                self.deadlines.push(Reverse((deadline, conn)));
            }
            // Read only while busy polling: kept only with it on.
            if self.notify && self.options.busy_poll.is_some() {
                self.awaiting.push_back(conn);
                self.compact_awaiting();
            }
        }
        Ok(())
    }

    pub(super) fn setup_qp(
        &mut self,
        conn: ConnectionId,
        role: Role,
    ) -> Result<(), cm_core::CmError> {
        let id = self.live(conn).expect("live connection").id.clone();
        // A QP the application made on the id (passive side, before `accept_request`).
        let application_qp = cm_core::CmId::qp_num(&id);
        let (device_index, key) =
            self.device_for(&id)?
                .ok_or(cm_core::CmError::InvalidArgument {
                    op: "create_qp",
                    reason: "the id is not bound to a device",
                })?;
        // A user of the reader from now on, even if the rest of the set-up fails: its
        // close is what closes a reader nothing else uses.
        if let Some(entry) = self.live_mut(conn) {
            entry.device = Some(key);
        }
        self.device_use(key);
        if let Some(qp) = application_qp {
            return self.adopt_application_qp(conn, id, device_index, qp, role);
        }
        let caps = self.live(conn).expect("live connection").caps;
        let shared = self.shared_for_setup(&id, device_index, &caps);
        let called = self.transport.now();
        let qp = match shared {
            Some(set) => self.create_qp_on_shared(&id, set, &caps)?,
            None => {
                self.transport
                    .create_qp(&id, &self.devices[device_index], conn.token(), &caps)?
            }
        };
        let created = self.transport.now();
        if let Some(entry) = self.live_mut(conn) {
            entry.times.mark(Step::CreateQpCalled, called);
            entry.times.mark(Step::QpCreated, created);
        }
        // On shared queues the pool's receives are posted already: nothing of its own.
        let buffers = match shared {
            Some(_) => None,
            None => {
                let buffers = self.transport.register_buffers(&id, &caps)?;
                for slot in 0..caps.recv_depth {
                    self.transport
                        .post_recv(&id, &buffers, slot, u64::from(slot))?;
                }
                Some(buffers)
            }
        };
        self.by_qp.insert(qp, super::SlotIndex::of(conn));
        self.transport.claim_qp(&self.devices[device_index], qp);
        let entry = self.live_mut(conn).expect("live connection");
        entry.qp = super::QpSlot::new(qp);
        entry.buffers = buffers;
        entry.send_next = 0;
        entry.sends_in_flight = 0;
        self.register_with_pump(conn, id, qp, role);
        Ok(())
    }

    /// Registers `conn`'s QP with the pump, before the REQ or REP leaves, so that no
    /// trigger of this QP can come first: one kept for its number is a previous QP's,
    /// and is dropped.
    pub(super) fn register_with_pump(
        &mut self,
        conn: ConnectionId,
        id: T::Id,
        qp: cm_core::QpNum,
        role: Role,
    ) {
        if !self.notify {
            return;
        }
        match self.pump.register_before_handshake(id, role) {
            Ok(registration) => {
                if let Some(pumped) = registration.replayed {
                    self.on_pumped(Some(conn), pumped);
                }
            }
            Err(error) => tracing::warn!("{qp}: {error}"),
        }
    }

    pub(super) fn connect_resolved(&mut self, conn: ConnectionId) -> Result<(), cm_core::CmError> {
        self.setup_qp(conn, Role::Active)?;
        let entry = self.live_mut(conn).expect("set up above");
        let request = entry.rare.take_private();
        let params = entry.rare.take_params();
        let id = entry.id.clone();
        let called = self.transport.now();
        self.transport.connect(&id, request.as_bytes(), &params)?;
        super::trace::step(conn, "connecting");
        let now = self.transport.now();
        if let Some(entry) = self.live_mut(conn) {
            // Set once the QP is in RTS: at ESTABLISHED.
            entry.rare.set_params(cm_core::ConnectionParams {
                min_rnr_timer: params.min_rnr_timer,
                ..cm_core::ConnectionParams::default()
            });
            entry.times.mark(Step::ConnectCalled, called);
            entry.times.mark(Step::ConnectReturned, now);
            entry.state = ConnState::Connecting;
        }
        Ok(())
    }
}
