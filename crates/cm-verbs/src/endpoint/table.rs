//! The endpoint's tables: device readers, connection slots (generation-checked
//! handles), the id and QP indexes, and teardown.

use cm_core::{CmError, IdOptions, QpNum, Transport};

use std::collections::VecDeque;

use super::queue::{ClosedConn, Pending, CLOSED_BACKLOG};
use super::slots::Slots;
use super::{
    CloseReason, Conn, ConnError, ConnState, ConnectionId, Endpoint, Entry, Event, Listener,
    ListenerId, Owner, Slot,
};
use crate::Role;

impl<T: Transport> Endpoint<T> {
    /// A new id with `options` set (`rdma_set_option`, only for what is set); an id
    /// whose options the transport refuses is released, not leaked.
    pub(super) fn create_id_with(&mut self, options: &IdOptions) -> Result<T::Id, CmError> {
        let id = self.transport.create_id_in(options.port_space)?;
        for option in options.calls() {
            if let Err(error) = self.transport.set_option(&id, option) {
                self.transport.release_id(id);
                return Err(error);
            }
        }
        Ok(id)
    }

    // ----- bookkeeping -----------------------------------------------------------

    /// The reader of `id`'s device context, opened on first use.
    pub(super) fn device_for(
        &mut self,
        id: &T::Id,
    ) -> Result<Option<(usize, T::DeviceKey)>, cm_core::CmError> {
        let Some(key) = self.transport.device_key(id) else {
            return Ok(None);
        };
        if let Some(index) = self.device_index(key) {
            return Ok(Some((index, key)));
        }
        let device = self.transport.open_device(id)?;
        self.device_keys.push(key);
        self.devices.push(device);
        self.device_users.push(0);
        Ok(Some((self.devices.len() - 1, key)))
    }

    /// Where the reader of `key` is in `devices`, if it is open. O(devices).
    pub(super) fn device_index(&self, key: T::DeviceKey) -> Option<usize> {
        self.device_keys.iter().position(|k| *k == key)
    }

    /// A listener or connection uses the reader of `key` from now on.
    pub(super) fn device_use(&mut self, key: T::DeviceKey) {
        if let Some(index) = self.device_index(key) {
            self.device_users[index] += 1;
        }
    }

    /// A listener or connection no longer uses the reader of `key`: the last one gone,
    /// the reader is closed, so that nothing of ours keeps the device (a reader already
    /// given back after a removal is not there any more).
    pub(super) fn device_unuse(&mut self, key: T::DeviceKey) {
        let Some(index) = self.device_index(key) else {
            return;
        };
        self.device_users[index] = self.device_users[index].saturating_sub(1);
        if self.device_users[index] == 0 {
            self.release_shared_of(index);
            self.device_keys.swap_remove(index);
            self.device_users.swap_remove(index);
            let device = self.devices.swap_remove(index);
            self.transport.close_device(device);
        }
    }

    /// The device is going away: every connection and listener on it is torn down, and
    /// its reader closed, so that nothing of ours keeps it open.
    pub(super) fn device_removed(&mut self, key: T::DeviceKey) {
        self.device_lost(key, &CloseReason::DeviceRemoved);
    }

    /// The device is gone (removed) or unusable (fatal error): every connection and
    /// listener on it ends with `reason`, and its reader is given back to the transport,
    /// so that nothing of ours keeps the device open.
    pub(super) fn device_lost(&mut self, key: T::DeviceKey, reason: &CloseReason) {
        // The reader first, given back as lost: the closes below then find no reader to
        // close as unused.
        if let Some(index) = self.device_index(key) {
            self.release_shared_of(index);
            self.device_keys.swap_remove(index);
            self.device_users.swap_remove(index);
            let device = self.devices.swap_remove(index);
            self.transport.release_device(device);
            self.device_released = true;
        }
        for conn in self.conns_on(key) {
            self.close(conn, reason.clone(), false);
        }
        for index in 0..self.listeners.len() {
            let listener = ListenerId::new(index, self.listener_generations[index]);
            let on_device = self.listeners[index]
                .as_ref()
                .is_some_and(|l| self.transport.device_key(&l.id) == Some(key));
            if on_device {
                if let Some(entry) = self.take_listener(listener) {
                    self.by_id.remove(&self.transport.id_key(&entry.id));
                }
                self.push_endpoint_event(Event::ListenerClosed {
                    listener,
                    reason: reason.clone(),
                });
            }
        }
    }

    /// Every connection on the device, those not set up yet (a request waiting for an
    /// answer, an address being resolved) included.
    pub(super) fn conns_on(&self, key: T::DeviceKey) -> Vec<ConnectionId> {
        self.live_conns_iter()
            .filter(|(_, c)| {
                c.device == Some(key)
                    || (c.device.is_none() && self.transport.device_key(&c.id) == Some(key))
            })
            .map(|(conn, _)| conn)
            .collect()
    }

    /// Every live (not closed) connection with its handle. O(slots).
    pub(super) fn live_conns_iter(&self) -> impl Iterator<Item = (ConnectionId, &Conn<T>)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(index, slot)| match slot.entry() {
                Some(Entry::Live(c)) => {
                    Some((ConnectionId::new(index as u32, slot.generation()), c))
                }
                _ => None,
            })
    }

    /// Ends `conn`: unregisters it and destroys the id with its QP, queues and memory
    /// (at the end of the pass when the CM read ended it, see `ended_ids`); keeps what it has to report, and the close itself, for the application
    /// (unless it never saw the connection and setting it up failed).
    pub(super) fn close(&mut self, conn: ConnectionId, reason: CloseReason, disconnect: bool) {
        let seen = self.live(conn).is_some_and(|entry| {
            entry.role == Role::Active
                || entry.state == ConnState::Established
                || entry
                    .listener
                    .and_then(|l| self.listener_entry(l))
                    .is_some_and(|l| !l.options.auto_accept)
        });
        let report = seen || !matches!(reason, CloseReason::SetupFailed(_));
        self.end(conn, disconnect, report.then_some(reason));
    }

    /// Ends `conn` because the application said so: nothing more is reported of it.
    pub(super) fn forget(&mut self, conn: ConnectionId) {
        if self.live(conn).is_some() {
            self.end(conn, true, None);
        } else if self.closed(conn).is_some() {
            self.free_closed(conn);
        }
    }

    fn end(&mut self, conn: ConnectionId, disconnect: bool, report: Option<CloseReason>) {
        let Some(entry) = self.remove_live(conn) else {
            return;
        };
        super::trace::closed(conn, report.as_ref(), entry.traffic);
        if disconnect {
            if let Err(error) = self.transport.disconnect(&entry.id) {
                tracing::debug!("{conn}: disconnect: {error}");
            }
        }
        let Conn {
            id,
            role,
            state,
            listener,
            via,
            mut rare,
            inbox,
            pending,
            traffic,
            ..
        } = entry;
        // The id goes now (its QP, queues and memory with it, whatever is kept below),
        // or at the end of the CM read that ended it.
        if self.reading_cm {
            self.ended_ids.push(id);
        } else {
            self.transport.release_id(id);
        }
        let kept = report.filter(|_| {
            let room = pending.held || self.closed_conns < CLOSED_BACKLOG;
            if !room {
                self.dropped_events += 1;
            }
            room
        });
        let Some(reason) = kept else {
            self.held_messages -= inbox.len();
            self.free_slot(conn);
            return;
        };
        // Messages are deliverable only on a connection that got established.
        let inbox: VecDeque<Vec<u8>> = if state == ConnState::Established {
            inbox.into_messages()
        } else {
            self.held_messages -= inbox.len();
            VecDeque::new()
        };
        let ticket = pending.ticket;
        self.slots[conn.index()].put(Entry::Closed(ClosedConn {
            generation: 0,
            reason,
            role,
            listener,
            established: via.filter(|_| state == ConnState::Established),
            peer_private: rare.take_private(),
            inbox,
            traffic,
            pending: Pending {
                established: pending.established,
                sent: pending.sent,
                ticket,
                held: pending.held,
                ..Pending::default()
            },
        }));
        self.closed_conns += 1;
        self.requeue(conn);
    }

    /// Takes a live connection out of every index; its slot is left empty (the caller
    /// puts a closed record there or frees it).
    fn remove_live(&mut self, conn: ConnectionId) -> Option<Conn<T>> {
        let slot = self.slots.get_mut(conn.index())?;
        if slot.generation() != conn.generation() || !matches!(slot.entry(), Some(Entry::Live(_))) {
            return None;
        }
        let Some(Entry::Live(entry)) = slot.take() else {
            return None;
        };
        self.live_conns -= 1;
        if entry.state != ConnState::Established {
            self.left_setup(entry.listener);
        }
        self.by_id.remove(&self.transport.id_key(&entry.id));
        // The QP's claim goes before the device may be given back with its last user.
        if let Some(qp) = entry.qp.get() {
            self.by_qp.remove(qp);
            let device = entry.device.and_then(|key| self.device_index(key));
            if let Some(index) = device {
                self.transport.release_qp(&self.devices[index], qp);
            }
            drop(self.pump.unregister(qp));
        }
        if let Some(key) = entry.device {
            self.device_unuse(key);
        }
        shrink(&mut self.by_id);
        Some(entry)
    }

    /// Frees a closed connection's record (its close has been reported); its reason.
    pub(super) fn free_closed(&mut self, conn: ConnectionId) -> CloseReason {
        let slot = &mut self.slots[conn.index()];
        let Some(Entry::Closed(closed)) = slot.take() else {
            unreachable!("free_closed is called on a closed record");
        };
        self.closed_conns -= 1;
        self.held_messages -= closed.inbox.len();
        self.free_slot(conn);
        closed.reason
    }

    fn free_slot(&mut self, conn: ConnectionId) {
        // The application's one-sided completions outlive the QP (a failed one closed
        // it, the ones before it must still be told apart): they go with the record.
        self.work_done.remove(&conn);
        let slot = &mut self.slots[conn.index()];
        *slot = Slot::Vacant(slot.generation().wrapping_add(1));
        self.free_slots.push(conn.index() as u32);
        // Entries naming it are stale now: once they outnumber the live ones, they go
        // (amortised O(1): a sweep at least halves its queue).
        self.compact_ready();
        self.compact_accepted();
        self.compact_deadlines();
        self.compact_awaiting();
    }

    /// The connection that owns `qp`.
    pub(super) fn conn_of_qp(&self, qp: QpNum) -> Option<ConnectionId> {
        let index = self.by_qp.get(qp)?.get();
        let slot = self.slots.get(index as usize)?;
        Some(ConnectionId::new(index, slot.generation()))
    }

    pub(super) fn insert(&mut self, conn: Conn<T>) -> ConnectionId {
        let key = self.transport.id_key(&conn.id);
        let index = match self.free_slots.pop() {
            Some(index) => index as usize,
            None => self.slots.push(Slot::Vacant(0)),
        };
        let kept = self.transport.set_id_context(&conn.id, index as u32);
        let slot = &mut self.slots[index];
        slot.put(Entry::Live(conn));
        self.live_conns += 1;
        let conn = ConnectionId::new(index as u32, slot.generation());
        if !kept {
            self.by_id.insert(key, Owner::Conn(conn));
        }
        conn
    }

    /// The live connection in slot `index`, if its id is `id` (the id's context named
    /// the slot: the connection may have gone since).
    pub(super) fn conn_with_id(&self, index: u32, id: &T::Id) -> Option<ConnectionId> {
        let slot = self.slots.get(index as usize)?;
        match slot.entry() {
            Some(Entry::Live(c)) if self.transport.id_key(&c.id) == self.transport.id_key(id) => {
                Some(ConnectionId::new(index, slot.generation()))
            }
            _ => None,
        }
    }

    fn entry(&self, conn: ConnectionId) -> Option<&Entry<T>> {
        entry_in(&self.slots, conn)
    }

    fn entry_mut(&mut self, conn: ConnectionId) -> Option<&mut Entry<T>> {
        let slot = self.slots.get_mut(conn.index())?;
        if slot.generation() == conn.generation() {
            slot.entry_mut()
        } else {
            None
        }
    }

    /// The live connection `conn` names.
    pub(super) fn live(&self, conn: ConnectionId) -> Option<&Conn<T>> {
        live_in(&self.slots, conn)
    }

    /// The live connection `conn` names.
    pub(super) fn live_mut(&mut self, conn: ConnectionId) -> Option<&mut Conn<T>> {
        match self.entry_mut(conn)? {
            Entry::Live(c) => Some(c),
            Entry::Closed(_) => None,
        }
    }

    /// The closed, not yet reported connection `conn` names.
    pub(super) fn closed(&self, conn: ConnectionId) -> Option<&ClosedConn> {
        match self.entry(conn)? {
            Entry::Closed(c) => Some(c),
            Entry::Live(_) => None,
        }
    }

    /// The closed, not yet reported connection `conn` names.
    pub(super) fn closed_mut(&mut self, conn: ConnectionId) -> Option<&mut ClosedConn> {
        match self.entry_mut(conn)? {
            Entry::Closed(c) => Some(c),
            Entry::Live(_) => None,
        }
    }

    /// What `conn` has to report, live or closed.
    pub(super) fn pending_mut(&mut self, conn: ConnectionId) -> Option<&mut Pending> {
        match self.entry_mut(conn)? {
            Entry::Live(c) => Some(&mut c.pending),
            Entry::Closed(c) => Some(&mut c.pending),
        }
    }

    /// The transport and a live connection, borrowed together.
    pub(super) fn split(&mut self, conn: ConnectionId) -> Option<(&mut T, &mut Conn<T>)> {
        let slot = self.slots.get_mut(conn.index())?;
        if slot.generation() != conn.generation() {
            return None;
        }
        match slot.entry_mut()? {
            Entry::Live(c) => Some((&mut self.transport, c)),
            Entry::Closed(_) => None,
        }
    }

    /// The live connection, or the typed error a call on it answers.
    pub(super) fn conn(&self, conn: ConnectionId) -> Result<&Conn<T>, ConnError> {
        match self.entry(conn) {
            Some(Entry::Live(c)) => Ok(c),
            Some(Entry::Closed(c)) => Err(ConnError::Closed {
                conn,
                reason: c.reason.clone(),
            }),
            None => Err(ConnError::UnknownConnection(conn)),
        }
    }

    pub(super) fn listener(&self, listener: ListenerId) -> Result<&Listener<T>, ConnError> {
        self.listener_entry(listener)
            .ok_or(ConnError::UnknownListener(listener))
    }

    /// The live listener `listener` names (not one that took its slot since).
    pub(super) fn listener_entry(&self, listener: ListenerId) -> Option<&Listener<T>> {
        let index = listener.index();
        (self.listener_generations.get(index) == Some(&listener.generation()))
            .then(|| self.listeners[index].as_ref())
            .flatten()
    }

    /// `listener`'s entry, to change (`None` once closed).
    pub(super) fn listener_entry_mut(&mut self, listener: ListenerId) -> Option<&mut Listener<T>> {
        let index = listener.index();
        if self.listener_generations.get(index) != Some(&listener.generation()) {
            return None;
        }
        self.listeners[index].as_mut()
    }

    /// `conn` (of `listener`, if any) leaves its listener's setup count: it is
    /// established or gone.
    pub(super) fn left_setup(&mut self, listener: Option<ListenerId>) {
        if let Some(entry) = listener.and_then(|l| self.listener_entry_mut(l)) {
            entry.in_setup = entry.in_setup.saturating_sub(1);
        }
    }

    /// Takes the listener out; its handle (and every copy) names nothing from now on.
    pub(super) fn take_listener(&mut self, listener: ListenerId) -> Option<Listener<T>> {
        self.listener_entry(listener)?;
        let index = listener.index();
        let entry = self.listeners[index].take()?;
        self.listener_generations[index] = self.listener_generations[index].wrapping_add(1);
        self.live_listeners -= 1;
        if let Some(key) = entry.device {
            self.device_unuse(key);
        }
        Some(entry)
    }
}

/// The entry `conn` names in `slots` (its slot, at its generation): [`Endpoint::entry`]
/// for code that holds the slots beside another of the endpoint's fields it changes.
pub(super) fn entry_in<T: Transport>(
    slots: &Slots<Slot<T>>,
    conn: ConnectionId,
) -> Option<&Entry<T>> {
    let slot = slots.get(conn.index())?;
    (slot.generation() == conn.generation())
        .then_some(slot.entry())
        .flatten()
}

/// The live connection `conn` names in `slots`: [`Endpoint::live`], as [`entry_in`].
pub(super) fn live_in<T: Transport>(
    slots: &Slots<Slot<T>>,
    conn: ConnectionId,
) -> Option<&Conn<T>> {
    match entry_in(slots, conn)? {
        Entry::Live(c) => Some(c),
        Entry::Closed(_) => None,
    }
}

/// Gives back a hash map's memory once it is mostly empty (after a burst of closes).
fn shrink<K: std::hash::Hash + Eq, V>(map: &mut rustc_hash::FxHashMap<K, V>) {
    if map.capacity() > 4 * map.len() + 64 {
        map.shrink_to(2 * map.len());
    }
}
