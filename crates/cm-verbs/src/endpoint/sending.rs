//! Sending a message on a connection: into a buffer of its own, or of its device's
//! shared send pool.

use cm_core::Transport;

use super::{ConnError, ConnState, ConnectionId, Endpoint};

impl<T: Transport> Endpoint<T> {
    /// Sends one message (a SEND of `data`) on an established connection. The buffer
    /// is free again once its completion is read ([`ConnError::SendQueueFull`] until
    /// then; [`Event::Sent`](crate::Event::Sent) says a buffer came free). O(1).
    pub fn send(&mut self, conn: ConnectionId, data: &[u8]) -> Result<(), ConnError> {
        self.conn(conn)?;
        if self.is_closing(conn) {
            return Err(ConnError::WrongState {
                conn,
                what: "send",
                needs: "not closing",
            });
        }
        let shared = self.shared_key_of(conn);
        let (transport, entry) = self.split(conn).ok_or(ConnError::UnknownConnection(conn))?;
        if entry.state != ConnState::Established {
            return Err(ConnError::WrongState {
                conn,
                what: "send",
                needs: "established",
            });
        }
        let max = entry.caps.buffer_size as usize;
        if data.len() > max {
            return Err(ConnError::MessageTooLarge {
                len: data.len(),
                max,
            });
        }
        let Some(buffers) = entry.buffers.as_ref() else {
            if let Some(key) = shared {
                return self.send_shared(conn, key, data);
            }
            return Err(ConnError::WrongState {
                conn,
                what: "send",
                needs: "buffers",
            });
        };
        if entry.sends_in_flight >= entry.caps.send_depth {
            return Err(ConnError::SendQueueFull(conn));
        }
        let slot = entry.send_next;
        transport.post_send(&entry.id, buffers, slot, data, u64::from(slot))?;
        entry.send_next = (slot + 1) % entry.caps.send_depth;
        entry.sends_in_flight += 1;
        entry.traffic.count_sent(data.len());
        Ok(())
    }
}
