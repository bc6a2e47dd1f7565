//! Queues a device context's connections share ([`EndpointOptions::shared_queues`]):
//! one shared receive queue with one registered pool of receive buffers, one pool of
//! send buffers, and one send and one receive completion queue, made when a listener
//! starts listening on an address of the device or else when the first connection on
//! it is set up, and given back with the last listener or connection on the device
//! (the device's reader closes then). A connection on them has only its QP: nothing is
//! registered and no completion queue created on its accept path; the receive queue
//! grows by the connection's receive depth until the pool is all posted.
//!
//! Receives: a receive completion names its QP, and the QP table its connection. The
//! message is copied out and the receive posted again at once, so one connection never
//! holds the pool's buffers: a peer meets RNR only when the whole pool is waiting to be
//! read (the server falls behind), never because one application reader is slow. What a
//! connection holds is bounded as with its own queues, by its receive depth: on a
//! shared queue nothing stops a peer from sending more, so a connection whose peer
//! sends past it while its messages wait untaken is closed
//! ([`CloseReason::ReceiveOverrun`]), never left to grow or to starve the others.
//!
//! Sends: a message is copied into a free buffer of the send pool, within both the
//! connection's send depth and the pool; the completion gives the buffer back. The
//! work request id carries the connection's generation, so that a completion of a QP
//! gone (its number reused by a later connection) is not taken for the new one's.
//!
//! [`EndpointOptions::shared_queues`]: crate::EndpointOptions::shared_queues

use cm_core::{AsyncEvent, AsyncEventType, CqKind, SharedCaps, Transport, WorkCompletion};

use super::inputs::Reading;
use super::{
    CloseReason, ConnError, ConnectionId, Endpoint, QpErrorDetail, APPLICATION_WR_ID, POLL_BATCH,
};

/// The completion-queue token of every shared queue set: no connection's token is 0,
/// and the device whose completion channel reported it says which set it is.
pub(super) const SHARED_TOKEN: u64 = 0;

/// The inbox slot of a message copied out of the shared pool (nothing to post again
/// when it is taken).
pub(super) const NO_SLOT: u32 = u32::MAX;

/// Bits of a shared send's work request id that name its buffer (the pool has at most
/// 65536); the connection's generation is above them.
const SLOT_BITS: u32 = 16;

/// One device context's shared queues.
struct SharedSet<T: Transport> {
    key: T::DeviceKey,
    queues: T::Shared,
    caps: SharedCaps,
    /// Send buffers not in flight.
    free_sends: Vec<u32>,
    /// Receive buffers handed to the receive queue so far (slots `0..posted`; each is
    /// posted again as soon as its message is copied out).
    posted: u32,
    /// Whether the limit event was armed once (it is once `posted` passes it).
    limit_armed: bool,
    /// Connections whose send was refused for want of a free send buffer, in turn:
    /// each buffer freed answers the first still waiting. A live connection is here
    /// at most once (its `pool_waiting` flag); entries of connections gone are
    /// skipped as met and dropped in bulk when they outnumber the connections.
    waiters: std::collections::VecDeque<ConnectionId>,
    /// The SRQ limit event came and is not armed again yet (armed again once the
    /// receive completions are read).
    limit_fired: bool,
}

/// Every device context's shared queues, and the devices where they could not be made
/// (their connections keep queues of their own).
pub(super) struct SharedQueues<T: Transport> {
    sets: Vec<SharedSet<T>>,
    refused: Vec<T::DeviceKey>,
    /// SRQ limit events seen.
    limit_events: u64,
    /// QPs made ahead that connections took, on queues released since.
    ready_taken_before: u64,
}

impl<T: Transport> Default for SharedQueues<T> {
    fn default() -> Self {
        SharedQueues {
            sets: Vec::new(),
            refused: Vec::new(),
            limit_events: 0,
            ready_taken_before: 0,
        }
    }
}

impl<T: Transport> SharedQueues<T> {
    fn index(&self, key: T::DeviceKey) -> Option<usize> {
        self.sets.iter().position(|s| s.key == key)
    }

    /// How many device contexts have shared queues.
    pub(super) fn sets(&self) -> usize {
        self.sets.len()
    }

    /// Send buffers free over every set, and SRQ limit events seen.
    pub(super) fn figures(&self) -> (usize, u64) {
        let free = self.sets.iter().map(|s| s.free_sends.len()).sum();
        (free, self.limit_events)
    }

    /// QPs made ahead: ready now over every set, and taken by accepts over every set
    /// this endpoint had.
    pub(super) fn ready_qps(&self, transport: &T) -> (usize, u64) {
        let (ready, taken) = self
            .sets
            .iter()
            .map(|s| transport.ready_qps(&s.queues))
            .fold((0, 0), |(r, t), (ready, taken)| (r + ready, t + taken));
        (ready, self.ready_taken_before + taken)
    }
}

impl<T: Transport> Endpoint<T> {
    /// The shared queues a connection of `conn_caps` being set up on `device_index`
    /// uses: made on the first use (a listener bound to the device made them already),
    /// `None` when the endpoint keeps per-connection queues, the connection's messages
    /// are larger than the pool's buffers, or the device could not make them (its
    /// connections then keep their own; the reason is logged once).
    pub(super) fn shared_for_setup(
        &mut self,
        id: &T::Id,
        device_index: usize,
        conn_caps: &cm_core::QueueCaps,
    ) -> Option<usize> {
        let index = self.shared_set(id, device_index, conn_caps)?;
        self.grow_receives(index, conn_caps.recv_depth);
        Some(index)
    }

    /// Makes the shared queues of a listener's device when it starts listening (on an
    /// address of the device), so that its first request does not wait for them: the
    /// pool's registration, the queues and the first QPs made ahead are ready before
    /// any client is. Nothing is posted yet (each connection brings its receives).
    pub(super) fn prepare_shared(
        &mut self,
        id: &T::Id,
        device_index: usize,
        caps: &cm_core::QueueCaps,
    ) {
        if let Some(index) = self.shared_set(id, device_index, caps) {
            self.transport
                .prepare_qps_shared(&self.shared.sets[index].queues, caps);
        }
    }

    /// The index of the shared set of `device_index`, made now if it is not yet.
    fn shared_set(
        &mut self,
        id: &T::Id,
        device_index: usize,
        conn_caps: &cm_core::QueueCaps,
    ) -> Option<usize> {
        let caps = self.options.shared_queues?;
        if conn_caps.buffer_size > caps.buffer_size {
            return None;
        }
        let key = self.device_keys[device_index];
        if let Some(index) = self.shared.index(key) {
            return Some(index);
        }
        if self.shared.refused.contains(&key) {
            return None;
        }
        let device = &self.devices[device_index];
        match self
            .transport
            .create_shared(id, device, SHARED_TOKEN, &caps)
        {
            Ok(queues) => {
                self.shared.sets.push(SharedSet {
                    key,
                    queues,
                    caps,
                    // Popped from the end: buffer 0 first.
                    free_sends: (0..caps.send_slots).rev().collect(),
                    posted: 0,
                    limit_armed: false,
                    waiters: std::collections::VecDeque::new(),
                    limit_fired: false,
                });
                Some(self.shared.sets.len() - 1)
            }
            Err(error) => {
                tracing::warn!(
                    "device {key:?}: no shared queues ({error}), each connection keeps its own"
                );
                self.shared.refused.push(key);
                None
            }
        }
    }

    /// Posts up to `by` more receives on set `index`'s queue (a connection joins it),
    /// up to the pool's size: the queue grows with the connections, each bringing its
    /// receive depth, so a device's first connection costs no more than one with its
    /// own queues, and a busy device holds the whole pool posted. Receives are never
    /// taken back (a connection gone leaves them to the others). The limit event is
    /// armed once more receives than it are posted.
    fn grow_receives(&mut self, index: usize, by: u32) {
        let set = &mut self.shared.sets[index];
        let target = set.posted.saturating_add(by).min(set.caps.recv_slots);
        while set.posted < target {
            let slot = set.posted;
            if let Err(error) = self
                .transport
                .post_shared_recv(&set.queues, slot, u64::from(slot))
            {
                // The queue stays smaller; what is posted still serves every connection.
                tracing::warn!(
                    "device {:?}: posting shared receive {slot}: {error}",
                    set.key
                );
                return;
            }
            set.posted += 1;
        }
        if !set.limit_armed && set.caps.limit > 0 && set.posted > set.caps.limit {
            set.limit_armed = true;
            if let Err(error) = self.transport.arm_shared_limit(&set.queues, set.caps.limit) {
                tracing::debug!("device {:?}: arming the SRQ limit: {error}", set.key);
            }
        }
    }

    /// The id's QP on the shared queues `set`.
    pub(super) fn create_qp_on_shared(
        &mut self,
        id: &T::Id,
        set: usize,
        caps: &cm_core::QueueCaps,
    ) -> Result<cm_core::QpNum, cm_core::CmError> {
        self.transport
            .create_qp_shared(id, &self.shared.sets[set].queues, caps)
    }

    /// The device whose shared queues `conn` uses (a connection with a QP and no
    /// buffers of its own), if any.
    pub(super) fn shared_key_of(&self, conn: ConnectionId) -> Option<T::DeviceKey> {
        if self.shared.sets.is_empty() {
            return None; // the common case without shared queues: no lookup
        }
        let entry = self.live(conn)?;
        let key = entry.device?;
        let shared = entry.qp.get().is_some() && entry.buffers.is_none() && !entry.application_qp;
        (shared && self.shared.index(key).is_some()).then_some(key)
    }

    /// The device at `device_index`, nothing uses any more, failed or lost: its shared
    /// queues go (the transport keeps them until the last QP on them is destroyed).
    /// Called while its reader is still open: a set never outlives its device's reader.
    pub(super) fn release_shared_of(&mut self, device_index: usize) {
        let key = self.device_keys[device_index];
        self.shared.refused.retain(|k| *k != key);
        if let Some(index) = self.shared.index(key) {
            let set = self.shared.sets.swap_remove(index);
            self.shared.ready_taken_before += self.transport.ready_qps(&set.queues).1;
            self.transport
                .release_shared(&self.devices[device_index], set.queues);
        }
    }

    /// `send` on a connection on shared queues: a free buffer of the pool, within the
    /// connection's send depth.
    pub(super) fn send_shared(
        &mut self,
        conn: ConnectionId,
        key: T::DeviceKey,
        data: &[u8],
    ) -> Result<(), ConnError> {
        let index = self
            .shared
            .index(key)
            .ok_or(ConnError::UnknownConnection(conn))?;
        let set = &mut self.shared.sets[index];
        if data.len() > set.caps.buffer_size as usize {
            return Err(ConnError::MessageTooLarge {
                len: data.len(),
                max: set.caps.buffer_size as usize,
            });
        }
        let slot_index = conn.index();
        let Some(super::Slot::Occupied(super::Entry::Live(entry))) = self.slots.get_mut(slot_index)
        else {
            return Err(ConnError::UnknownConnection(conn));
        };
        if entry.sends_in_flight >= entry.caps.send_depth {
            return Err(ConnError::SendQueueFull(conn));
        }
        let Some(slot) = set.free_sends.pop() else {
            // Answered in turn when a buffer comes free (an Event::Sent).
            if !std::mem::replace(&mut entry.pending.pool_waiting, true) {
                set.waiters.push_back(conn);
                if set.waiters.len() > 2 * self.live_conns + 64 {
                    let slots = &self.slots;
                    set.waiters.retain(|&c| {
                        super::table::live_in(slots, c).is_some_and(|c| c.pending.pool_waiting)
                    });
                }
            }
            return Err(ConnError::SendQueueFull(conn));
        };
        let wr_id = u64::from(slot) | (u64::from(conn.generation()) << SLOT_BITS);
        if let Err(error) =
            self.transport
                .post_shared_send(&entry.id, &set.queues, slot, data, wr_id)
        {
            set.free_sends.push(slot);
            return Err(error.into());
        }
        entry.sends_in_flight += 1;
        entry.traffic.count_sent(data.len());
        Ok(())
    }

    /// A completion event of device `device_index`'s shared queues: both re-armed,
    /// then read dry.
    pub(super) fn on_shared_cq_event(&mut self, device_index: usize) {
        let key = self.device_keys[device_index];
        let Some(index) = self.shared.index(key) else {
            return; // released since
        };
        if self.spinning {
            self.leave_shared_unarmed();
            return;
        }
        for kind in [CqKind::Recv, CqKind::Send] {
            let set = &self.shared.sets[index];
            if let Err(error) = self.transport.arm_shared_cq(&set.queues, kind) {
                // Nothing would be heard from the device's connections again.
                tracing::warn!(
                    "device {key:?}: re-arming the shared {kind:?} queue failed: {error}"
                );
                let errno = cm_core::Errno(error.errno());
                self.shared_failed(key, QpErrorDetail::ArmFailed { kind, errno });
                return;
            }
        }
        self.poll_shared(key, CqKind::Recv, None);
        self.poll_shared(key, CqKind::Send, None);
    }

    /// Busy polling reads the shared queues anyway: they are armed again before
    /// anything waits ([`Endpoint::arm_shared_again`]), so no event comes per message
    /// meanwhile. Out of line: the completion event's usual path stays as it was.
    #[cold]
    #[inline(never)]
    fn leave_shared_unarmed(&mut self) {
        self.shared_unarmed = true;
        self.poll_shared_all();
    }

    /// After a spin that left shared queues unarmed: arms every device's again, each
    /// then read dry (what came before the arm raises no event); whether there were any
    /// (then the caller reads its sources once more before it waits). O(devices).
    #[inline]
    pub(super) fn arm_shared_again(&mut self) -> bool {
        self.shared_unarmed && self.arm_unarmed_shared()
    }

    #[cold]
    #[inline(never)]
    fn arm_unarmed_shared(&mut self) -> bool {
        self.shared_unarmed = false;
        let keys = self.shared.sets.iter().map(|set| set.key);
        let devices: Vec<usize> = keys.filter_map(|key| self.device_index(key)).collect();
        for device_index in devices {
            self.on_shared_cq_event(device_index);
        }
        true
    }

    /// Busy polling: polls every device's shared completion queues dry, as their
    /// completion event would (the event, when it comes, finds them empty and is only
    /// acknowledged): a message reaches the application without the completion
    /// channel's reads and re-arms, as a spinning verbs loop's does. O(devices), plus
    /// O(1) per completion.
    pub(super) fn poll_shared_all(&mut self) {
        let mut index = 0;
        while let Some(key) = self.shared.sets.get(index).map(|set| set.key) {
            self.poll_shared(key, CqKind::Recv, None);
            self.poll_shared(key, CqKind::Send, None);
            index += 1;
        }
    }

    /// Polls one of `key`'s shared completion queues dry, each completion going to the
    /// connection its QP names. `focus`: the connection the caller reads for, and why
    /// (the others' completions are read as on their completion event).
    pub(super) fn poll_shared(
        &mut self,
        key: T::DeviceKey,
        kind: CqKind,
        focus: Option<(ConnectionId, Reading)>,
    ) {
        loop {
            let Some(index) = self.shared.index(key) else {
                return;
            };
            let mut batch = std::mem::take(&mut self.completions);
            batch.clear();
            let polled = self.transport.poll_shared_cq(
                &self.shared.sets[index].queues,
                kind,
                &mut batch,
                POLL_BATCH,
            );
            let n = polled.unwrap_or_else(|error| {
                tracing::warn!("device {key:?}: polling the shared {kind:?} queue failed: {error}");
                0
            });
            for completion in batch.iter().copied() {
                self.on_shared_completion(key, completion, focus);
            }
            self.completions = batch;
            if n < POLL_BATCH {
                break;
            }
        }
        if kind == CqKind::Recv {
            self.rearm_limit(key);
        }
    }

    fn on_shared_completion(
        &mut self,
        key: T::DeviceKey,
        completion: WorkCompletion,
        focus: Option<(ConnectionId, Reading)>,
    ) {
        let application = completion.wr_id & APPLICATION_WR_ID != 0;
        let mut conn = self.conn_of_qp(completion.qp);
        let mut data = None;
        if !application {
            match completion.kind {
                CqKind::Send => {
                    let slot = (completion.wr_id & ((1 << SLOT_BITS) - 1)) as u32;
                    let generation = (completion.wr_id >> SLOT_BITS) as u32;
                    if let Some(index) = self.shared.index(key) {
                        self.shared.sets[index].free_sends.push(slot);
                        self.answer_pool_waiter(index);
                    }
                    // A completion of a QP gone, its number now another connection's.
                    conn = conn.filter(|c| c.generation() == generation);
                }
                CqKind::Recv => data = self.take_shared_receive(key, &completion),
            }
        }
        let Some(conn) = conn else {
            return; // its connection is gone: the buffer is back in the pool
        };
        let reading = match focus {
            Some((focused, reading)) if focused == conn => reading,
            _ => Reading::Event,
        };
        if reading == Reading::PeerLeft && !completion.is_success() {
            return;
        }
        match data {
            Some(data) => self.hold_shared_message(conn, completion, reading, data),
            None => self.on_completion(conn, completion, reading),
        }
    }

    /// A send buffer of set `index` came free: the first connection still waiting for
    /// one is told (an [`Event::Sent`](crate::Event::Sent), and its waiting calls
    /// woken).
    fn answer_pool_waiter(&mut self, index: usize) {
        while let Some(conn) = self.shared.sets[index].waiters.pop_front() {
            let Some(entry) = self.live_mut(conn) else {
                continue;
            };
            if std::mem::take(&mut entry.pending.pool_waiting) {
                entry.pending.pool_freed = true;
                self.mark_ready(conn);
                return;
            }
        }
    }

    /// The message of a shared receive, copied out, and the receive posted again at
    /// once (`None` for a failed receive).
    fn take_shared_receive(
        &mut self,
        key: T::DeviceKey,
        completion: &WorkCompletion,
    ) -> Option<Vec<u8>> {
        let index = self.shared.index(key)?;
        let slot = completion.wr_id as u32;
        let queues = &self.shared.sets[index].queues;
        let mut data = Vec::new();
        let read = if completion.is_success() {
            self.transport
                .read_shared_recv(queues, slot, completion.byte_len as usize, &mut data)
        } else {
            Ok(())
        };
        if let Err(error) = self
            .transport
            .post_shared_recv(queues, slot, completion.wr_id)
        {
            // One receive fewer on the queue: the pool shrinks, nothing is lost.
            tracing::warn!("device {key:?}: posting shared receive {slot} again failed: {error}");
        }
        match read {
            Ok(()) if completion.is_success() => Some(data),
            Ok(()) => None,
            Err(error) => {
                tracing::warn!("device {key:?}: reading shared receive {slot} failed: {error}");
                None
            }
        }
    }

    /// A message of `conn` from the shared pool: held as one from its own queue would
    /// be, unless its peer sent past its receive depth.
    fn hold_shared_message(
        &mut self,
        conn: ConnectionId,
        completion: WorkCompletion,
        reading: Reading,
        data: Vec<u8>,
    ) {
        self.receive_trigger(conn, &completion, reading);
        let Some(entry) = self.live(conn) else {
            return;
        };
        let depth = entry.caps.recv_depth;
        if entry.inbox.len() >= depth as usize {
            self.close(conn, CloseReason::ReceiveOverrun { depth }, true);
            return;
        }
        self.hold_message(conn, NO_SLOT, data);
    }

    /// The SRQ limit event came: reported, and armed again once the receive queue was
    /// read (every receive read is posted again at once, so what brought it below the
    /// limit was completions not yet read).
    pub(super) fn on_srq_limit(&mut self, device_index: usize) {
        self.shared.limit_events += 1;
        let key = self.device_keys[device_index];
        if let Some(index) = self.shared.index(key) {
            self.shared.sets[index].limit_fired = true;
        }
        self.poll_shared(key, CqKind::Recv, None);
    }

    fn rearm_limit(&mut self, key: T::DeviceKey) {
        let Some(set) = self.shared.index(key).map(|i| &mut self.shared.sets[i]) else {
            return;
        };
        if std::mem::take(&mut set.limit_fired) {
            if let Err(error) = self.transport.arm_shared_limit(&set.queues, set.caps.limit) {
                tracing::debug!("device {key:?}: arming the SRQ limit again: {error}");
            }
        }
    }

    /// The device's shared queues failed (`IBV_EVENT_SRQ_ERR`, or a queue that cannot
    /// be re-armed): every connection on them ends with the cause, and the device's
    /// later connections keep queues of their own.
    pub(super) fn shared_failed(&mut self, key: T::DeviceKey, detail: QpErrorDetail) {
        if self.shared.index(key).is_none() {
            return;
        }
        let on_shared: Vec<ConnectionId> = self
            .conns_on(key)
            .into_iter()
            .filter(|&c| self.shared_key_of(c).is_some())
            .collect();
        for conn in on_shared {
            self.close(conn, CloseReason::QpError { detail }, true);
        }
        // Closing its connections may have closed the device, its queues with it.
        if let Some(device_index) = self.device_index(key) {
            self.release_shared_of(device_index);
        }
        self.shared.refused.push(key);
    }

    /// Whether `event` is about the shared queues (handled here); `true` when it was.
    pub(super) fn on_shared_event(&mut self, device_index: usize, event: AsyncEvent) -> bool {
        match event.event_type {
            AsyncEventType::SrqLimitReached => self.on_srq_limit(device_index),
            AsyncEventType::SrqErr => {
                let key = self.device_keys[device_index];
                self.shared_failed(key, QpErrorDetail::AsyncEvent(event));
            }
            _ => return false,
        }
        true
    }
}
