//! The endpoint's tables: device readers, connection slots (generation-checked
//! handles), the id and QP indexes, and teardown.

use cm_core::Transport;

use super::{
    CloseReason, Conn, ConnError, ConnState, ConnectionId, Endpoint, Event, Listener, ListenerId,
    Owner, Slot,
};
use crate::Role;

impl<T: Transport> Endpoint<T> {
    // ----- bookkeeping -----------------------------------------------------------

    /// The reader of `id`'s device context, opened on first use.
    pub(super) fn device_for(
        &mut self,
        id: &T::Id,
    ) -> Result<Option<(usize, T::DeviceKey)>, cm_core::CmError> {
        let Some(key) = self.transport.device_key(id) else {
            return Ok(None);
        };
        if let Some(index) = self.device_keys.iter().position(|k| *k == key) {
            return Ok(Some((index, key)));
        }
        let device = self.transport.open_device(id)?;
        self.device_keys.push(key);
        self.devices.push(device);
        Ok(Some((self.devices.len() - 1, key)))
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
        for conn in self.conns_on(key) {
            self.close(conn, reason.clone(), false);
        }
        for index in 0..self.listeners.len() {
            let on_device = self.listeners[index]
                .as_ref()
                .is_some_and(|l| self.transport.device_key(&l.id) == Some(key));
            if on_device {
                if let Some(entry) = self.listeners[index].take() {
                    self.by_id.remove(&self.transport.id_key(&entry.id));
                }
                self.events.push_back(Event::ListenerClosed {
                    listener: ListenerId(index as u32),
                    reason: reason.clone(),
                });
            }
        }
        if let Some(index) = self.device_keys.iter().position(|k| *k == key) {
            self.device_keys.swap_remove(index);
            let device = self.devices.swap_remove(index);
            self.transport.release_device(device);
            self.device_released = true;
        }
    }

    /// Every connection on the device, those not set up yet (a request waiting for an
    /// answer, an address being resolved) included.
    pub(super) fn conns_on(&self, key: T::DeviceKey) -> Vec<ConnectionId> {
        self.live()
            .filter(|(_, c)| {
                c.device == Some(key)
                    || (c.device.is_none() && self.transport.device_key(&c.id) == Some(key))
            })
            .map(|(conn, _)| conn)
            .collect()
    }

    pub(super) fn live(&self) -> impl Iterator<Item = (ConnectionId, &Conn<T>)> {
        self.slots.iter().enumerate().filter_map(|(index, slot)| {
            slot.conn
                .as_ref()
                .map(|c| (ConnectionId::new(index as u32, slot.generation), c))
        })
    }

    /// Ends `conn`: reports [`Event::Closed`] (unless the application never saw it),
    /// unregisters it and drops the id, which destroys its QP, queues and memory.
    pub(super) fn close(&mut self, conn: ConnectionId, reason: CloseReason, disconnect: bool) {
        let Some(entry) = self.remove(conn) else {
            return;
        };
        if disconnect {
            if let Err(error) = self.transport.disconnect(&entry.id) {
                log::debug!("{conn}: disconnect: {error}");
            }
        }
        let seen = entry.role == Role::Active
            || entry.state == ConnState::Established
            || entry
                .listener
                .and_then(|l| self.listeners.get(l.0 as usize))
                .is_some_and(|l| l.as_ref().is_some_and(|l| !l.options.auto_accept));
        if seen || !matches!(reason, CloseReason::SetupFailed(_)) {
            self.events.push_back(Event::Closed { conn, reason });
        }
        drop(entry);
    }

    pub(super) fn remove(&mut self, conn: ConnectionId) -> Option<Conn<T>> {
        let slot = self.slots.get_mut(conn.index())?;
        if slot.generation != conn.generation() {
            return None;
        }
        let entry = slot.conn.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        self.free_slots.push(conn.index() as u32);
        self.by_id.remove(&self.transport.id_key(&entry.id));
        if let Some(qp) = entry.qp {
            self.by_qp.remove(&qp);
            drop(self.pump.unregister(qp));
        }
        // Messages held for a connection that never got established are dropped with it.
        Some(entry)
    }

    pub(super) fn insert(&mut self, conn: Conn<T>) -> ConnectionId {
        let key = self.transport.id_key(&conn.id);
        let index = match self.free_slots.pop() {
            Some(index) => index as usize,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    conn: None,
                });
                self.slots.len() - 1
            }
        };
        let slot = &mut self.slots[index];
        slot.conn = Some(conn);
        let id = ConnectionId::new(index as u32, slot.generation);
        self.by_id.insert(key, Owner::Conn(id));
        id
    }

    pub(super) fn slot(&self, conn: ConnectionId) -> Option<&Conn<T>> {
        let slot = self.slots.get(conn.index())?;
        (slot.generation == conn.generation())
            .then_some(slot.conn.as_ref())
            .flatten()
    }

    pub(super) fn slot_mut(&mut self, conn: ConnectionId) -> Option<&mut Conn<T>> {
        let slot = self.slots.get_mut(conn.index())?;
        if slot.generation == conn.generation() {
            slot.conn.as_mut()
        } else {
            None
        }
    }

    /// The transport and a connection, borrowed together.
    pub(super) fn split(&mut self, conn: ConnectionId) -> Option<(&mut T, &mut Conn<T>)> {
        let slot = self.slots.get_mut(conn.index())?;
        if slot.generation != conn.generation() {
            return None;
        }
        Some((&mut self.transport, slot.conn.as_mut()?))
    }

    pub(super) fn conn(&self, conn: ConnectionId) -> Result<&Conn<T>, ConnError> {
        self.slot(conn).ok_or(ConnError::UnknownConnection(conn))
    }

    pub(super) fn listener(&self, listener: ListenerId) -> Result<&Listener<T>, ConnError> {
        self.listeners
            .get(listener.0 as usize)
            .and_then(Option::as_ref)
            .ok_or(ConnError::UnknownListener(listener))
    }

    /// For the async flavour: handles what is ready and looks for an event.
    #[cfg(feature = "tokio")]
    pub(crate) fn take_with<R>(
        &mut self,
        take: &mut impl FnMut(&mut std::collections::VecDeque<Event>) -> Option<Result<R, ConnError>>,
    ) -> Option<Result<R, ConnError>> {
        if let Err(error) = self.process() {
            return Some(Err(error));
        }
        take(&mut self.events)
    }

    /// For the async flavour: the transport and the device readers.
    #[cfg(feature = "tokio")]
    pub(crate) fn parts(&self) -> (&T, &[T::Device]) {
        (&self.transport, &self.devices)
    }
}
