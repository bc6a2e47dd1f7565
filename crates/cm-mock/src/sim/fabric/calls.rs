//! What the handles call: verbs (async events, completions, QPs, sends), the rdma_cm
//! calls (bind, listen, resolve, connect, accept, reject, disconnect, destroy,
//! migrate, notify), the event channels and inspection.

use std::collections::VecDeque;

use cm_core::kernel_model::{ib_cm_notify, notify_delivers_established, LapState};
use cm_core::{
    errno, AsyncEvent, AsyncEventType, CmError, CmEventType, CmIdState, ConnectionParams,
    IbCmState, IdOption, NotifyError, NotifyOutcome, QpNum,
};

use super::{
    gone, nanos, os, Action, ConnRecord, Fabric, IdData, IdExtras, IdState, Listener, MaybeConn,
    MaybeKey, MaybeQp, Message, Private, Qp, QpState, QueuedKind, ReadEvent, TraceEvent,
    EADDRINUSE, FIRST_QPN, REJ_CONSUMER_DEFINED, REJ_TIMEOUT,
};
use crate::sim::types::{ConnId, DeviceKind, MsgKind, NodeId, RecvCompletion, SimIdKey};

impl Fabric {
    // ----- verbs -------------------------------------------------------------------

    pub(crate) fn next_async_event(&mut self, node: NodeId) -> Option<AsyncEvent> {
        let event = self
            .nodes
            .get_mut(node.0 as usize)?
            .async_events
            .pop_front()?;
        self.arrivals.bump_activity();
        Some(event)
    }

    pub(crate) fn poll_cq(&mut self, node: NodeId) -> Option<RecvCompletion> {
        let (completion, _) = self
            .nodes
            .get_mut(node.0 as usize)?
            .completions
            .pop_front()?;
        self.arrivals.bump_activity();
        Some(completion)
    }

    /// The next receive completion and its payload, appended to `out`.
    pub(crate) fn poll_cq_data(
        &mut self,
        node: NodeId,
        out: &mut Vec<u8>,
    ) -> Option<RecvCompletion> {
        let (completion, payload) = self
            .nodes
            .get_mut(node.0 as usize)?
            .completions
            .pop_front()?;
        self.arrivals.bump_activity();
        if let Some(bytes) = payload {
            if out.is_empty() {
                // The payload's own memory, not a copy of it.
                *out = bytes.into_vec();
            } else {
                out.extend_from_slice(&bytes);
            }
        }
        Some(completion)
    }

    /// Whether the node's device has asynchronous events or completions waiting.
    pub(crate) fn device_pending(&self, node: NodeId) -> bool {
        self.nodes
            .get(node.0 as usize)
            .is_some_and(|n| !n.async_events.is_empty() || !n.completions.is_empty())
    }

    pub(crate) fn raise_async_event(&mut self, node: NodeId, event: AsyncEvent) {
        if let Some(n) = self.nodes.get_mut(node.0 as usize) {
            n.fatal |= event.event_type == AsyncEventType::DeviceFatal;
            n.async_events.push_back(event);
            self.arrivals.bump_node(node);
            self.record(|| TraceEvent::AsyncEvent { node, event });
        }
    }

    pub(crate) fn create_qp(&mut self, key: SimIdKey) -> Result<QpNum, CmError> {
        const OP: &str = "rdma_create_qp";
        let qpn = QpNum(FIRST_QPN + self.qps.len() as u32);
        let id = self.live(key, OP)?;
        if !id.state.has(IdState::DEVICE) {
            return Err(os(OP, errno::EINVAL));
        }
        if id.qp.get().is_some() {
            return Err(os(OP, errno::EBUSY));
        }
        let place = id.place;
        let node = self.node_of(key.index, place);
        if let Some(budget) = self.nodes[node.0 as usize].qp_budget.as_mut() {
            if *budget == 0 {
                return Err(os(OP, errno::ENOMEM));
            }
            *budget -= 1;
        }
        let id = self.live(key, OP)?;
        id.qp = MaybeQp::new(Some(qpn));
        self.qps.push(Qp {
            node,
            owner: key.index,
            state: QpState::Init,
            peer: MaybeQp::NONE,
            got_first_packet: false,
            alive: true,
        });
        Ok(qpn)
    }

    pub(crate) fn post_send(&mut self, key: SimIdKey, len: u32) -> Result<(), CmError> {
        self.post_send_payload(key, len, None)
    }

    /// A SEND carrying `data`, which travels with the message.
    pub(crate) fn post_send_data(&mut self, key: SimIdKey, data: &[u8]) -> Result<(), CmError> {
        let len = u32::try_from(data.len()).map_err(|_| os("ibv_post_send", errno::EINVAL))?;
        self.live(key, "ibv_post_send")?;
        let payload = (!data.is_empty()).then(|| Box::from(data));
        self.post_send_payload(key, len, payload)
    }

    pub(super) fn post_send_payload(
        &mut self,
        key: SimIdKey,
        len: u32,
        payload: Option<Box<[u8]>>,
    ) -> Result<(), CmError> {
        const OP: &str = "ibv_post_send";
        let id = self.live(key, OP)?;
        let (conn, place) = (id.conn.get(), id.place);
        let qpn = id.qp.get().ok_or(os(OP, errno::EINVAL))?;
        let node = self.node_of(key.index, place);
        let qp = self.qp(qpn).ok_or(os(OP, errno::EINVAL))?;
        if !qp.alive || qp.state != QpState::Rts {
            return Err(os(OP, errno::EINVAL));
        }
        let peer = qp.peer.get().ok_or(os(OP, errno::EINVAL))?;
        let to = self.qp(peer).map_or(node, |q| q.node);
        let mut msg = Message::new(MsgKind::Data, conn, node, to);
        msg.qp = peer;
        msg.value = i32::try_from(len).unwrap_or(i32::MAX);
        msg.payload = payload;
        self.send(msg);
        Ok(())
    }

    pub(crate) fn qp_state(&self, key: SimIdKey) -> Option<QpState> {
        let qp = self.id(key)?.qp.get()?;
        self.qp(qp).filter(|q| q.alive).map(|q| q.state)
    }

    // ----- rdma_cm calls -----------------------------------------------------------

    pub(crate) fn bind(&mut self, key: SimIdKey, port: u16) -> Result<(), CmError> {
        const OP: &str = "rdma_bind_addr";
        let id = self.live(key, OP)?;
        if id.state.cm() != CmIdState::Idle {
            return Err(os(OP, errno::EINVAL));
        }
        id.state.set_cm(CmIdState::AddrBound);
        id.state.set(IdState::DEVICE, true);
        id.set_port(port);
        Ok(())
    }

    /// `rdma_set_option(RDMA_OPTION_ID, ..)` as ucma checks it: an ACK timeout above 31
    /// is refused, an address option (reuse, IPv6 only) once the id is bound is EINVAL.
    /// The value is recorded ([`SimCmId::id_options`](crate::sim::SimCmId::id_options));
    /// the simulated wire does not depend on it.
    pub(crate) fn set_option(&mut self, key: SimIdKey, option: IdOption) -> Result<(), CmError> {
        const OP: &str = "rdma_set_option";
        option.validate()?;
        let id = self.live(key, OP)?;
        if option.before_bind_only() && id.state.cm() != CmIdState::Idle {
            return Err(os(OP, errno::EINVAL));
        }
        self.update_extras(key.index, |extras| {
            let options = &mut extras.options;
            match option {
                IdOption::TypeOfService(tos) => options.type_of_service = Some(tos),
                IdOption::AckTimeout(timeout) => options.ack_timeout = Some(timeout),
                IdOption::ReuseAddr(on) => options.reuse_addr = on,
                IdOption::Ipv6Only(on) => options.ipv6_only = Some(on),
            }
        });
        Ok(())
    }

    /// `rdma_listen` with `backlog` CONNECT_REQUESTs queued unread at most: as ucma,
    /// 0 (or more than [`SimConfig::max_backlog`]) is the maximum. `None`: no limit
    /// (`u32::MAX`), for callers that queue any number of requests unread.
    ///
    /// [`SimConfig::max_backlog`]: crate::sim::SimConfig::max_backlog
    pub(crate) fn listen(&mut self, key: SimIdKey, backlog: Option<u32>) -> Result<(), CmError> {
        const OP: &str = "rdma_listen";
        let max = self.config.max_backlog;
        let backlog = match backlog {
            None => u32::MAX,
            Some(b) if b == 0 || b > max => max,
            Some(b) => b,
        };
        let id = self.live(key, OP)?;
        if id.state.cm() != CmIdState::AddrBound {
            return Err(os(OP, errno::EINVAL));
        }
        let (place, port) = (id.place, id.port());
        let at = (self.node_of(key.index, place), port);
        let space = self.port_space(key);
        if self.listener(at, space).is_some() {
            return Err(os(OP, EADDRINUSE));
        }
        if let Some(id) = self.id_mut(key) {
            id.state.set_cm(CmIdState::Listen);
        }
        self.listeners.push(Listener {
            at,
            space,
            key,
            backlog,
        });
        self.set_ib(key, IbCmState::Listen);
        Ok(())
    }

    pub(crate) fn resolve_addr(
        &mut self,
        key: SimIdKey,
        to: NodeId,
        port: u16,
    ) -> Result<(), CmError> {
        const OP: &str = "rdma_resolve_addr";
        if !self.node_exists(to) {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "no such node",
            });
        }
        let delay = nanos(self.config.resolve_delay);
        let place = self.live(key, OP)?.place;
        if self.device_removed(self.node_of(key.index, place)) {
            // The source address has no RDMA device under it any more.
            return Err(CmError::from_errno(OP, errno::ENODEV));
        }
        let id = self.live(key, OP)?;
        if !matches!(id.state.cm(), CmIdState::Idle | CmIdState::AddrBound) {
            return Err(os(OP, errno::EINVAL));
        }
        id.state.set_cm(CmIdState::AddrQuery);
        id.set_dst(to, port);
        self.schedule(delay, Action::AddrResolved(key));
        Ok(())
    }

    pub(crate) fn resolve_route(&mut self, key: SimIdKey) -> Result<(), CmError> {
        const OP: &str = "rdma_resolve_route";
        let delay = nanos(self.config.resolve_delay);
        let id = self.live(key, OP)?;
        if id.state.cm() != CmIdState::AddrResolved {
            return Err(os(OP, errno::EINVAL));
        }
        id.state.set_cm(CmIdState::RouteQuery);
        self.schedule(delay, Action::RouteResolved(key));
        Ok(())
    }

    pub(crate) fn connect(
        &mut self,
        key: SimIdKey,
        private: &[u8],
        params: &ConnectionParams,
    ) -> Result<ConnId, CmError> {
        const OP: &str = "rdma_connect";
        let conn = ConnId(self.conns.len() as u32);
        let private = self.privates.store(private);
        let id = self.live(key, OP)?;
        if id.state.cm() != CmIdState::RouteResolved {
            return Err(os(OP, errno::EINVAL));
        }
        if id.qp.get().is_none() {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "the simulated fabric needs a QP before connect (rdma_create_qp)",
            });
        }
        id.state.set_cm(CmIdState::Connect);
        id.conn = MaybeConn::new(Some(conn));
        self.update_extras(key.index, |extras| {
            extras.private = private;
            extras.set_params(params);
        });
        self.conns.push(ConnRecord::default());
        self.set_ib(key, IbCmState::ReqSent);
        self.send_req(key, false);
        self.start_retry(key, MsgKind::Req);
        Ok(conn)
    }

    pub(crate) fn accept(
        &mut self,
        key: SimIdKey,
        private: &[u8],
        params: &ConnectionParams,
    ) -> Result<(), CmError> {
        const OP: &str = "rdma_accept";
        let private = self.privates.store(private);
        let id = self.live(key, OP)?;
        if !matches!(
            id.state.ib(),
            Some(IbCmState::ReqRcvd | IbCmState::MraReqSent)
        ) {
            return Err(os(OP, errno::EINVAL));
        }
        let qp = id.qp.get().ok_or(CmError::InvalidArgument {
            op: OP,
            reason: "the simulated fabric needs a QP before accept (rdma_create_qp)",
        })?;
        let peer = id.remote_qp.get();
        self.update_extras(key.index, |extras| {
            extras.private = private;
            extras.set_params(params);
        });
        // librdmacm moves the QP to RTR and RTS before it sends the REP.
        if let Some(q) = self.qp_mut(qp) {
            q.peer = MaybeQp::new(peer);
            q.state = QpState::Rts;
        }
        self.set_ib(key, IbCmState::RepSent);
        self.send_rep(key, false);
        if self.on_iwarp(key) {
            // iWARP: the MPA reply goes on TCP (no retries here, no RTU to wait for) and
            // the driver raises ESTABLISHED as it accepts, through the iWARP CM's work
            // queue.
            self.set_ib(key, IbCmState::Established);
            let delay = nanos(self.config.establish_work_delay);
            self.schedule(delay, Action::EstablishWork(key));
        } else {
            self.start_retry(key, MsgKind::Rep);
        }
        Ok(())
    }

    /// Whether live id `key` is on an iWARP node.
    pub(crate) fn on_iwarp(&self, key: SimIdKey) -> bool {
        self.id(key).is_some_and(|id| {
            self.nodes[self.node_of(key.index, id.place).0 as usize].kind == DeviceKind::Iwarp
        })
    }

    pub(crate) fn reject(&mut self, key: SimIdKey, private: &[u8]) -> Result<(), CmError> {
        const OP: &str = "rdma_reject";
        let id = self.live(key, OP)?;
        if !matches!(
            id.state.ib(),
            Some(IbCmState::ReqRcvd | IbCmState::MraReqSent)
        ) {
            return Err(os(OP, errno::EINVAL));
        }
        if let Some(mut msg) = self.to_peer(key, MsgKind::Rej) {
            msg.value = REJ_CONSUMER_DEFINED;
            msg.private = self.privates.store(private);
            self.send(msg);
        }
        self.cancel_timer(key);
        self.set_ib(key, IbCmState::Idle);
        Ok(())
    }

    pub(crate) fn disconnect(&mut self, key: SimIdKey) -> Result<(), CmError> {
        const OP: &str = "rdma_disconnect";
        let id = self.live(key, OP)?;
        let (ib, qp) = (id.state.ib(), id.qp.get());
        if ib.is_none() {
            return Err(os(OP, errno::EINVAL));
        }
        // librdmacm moves the QP to the error state first.
        self.set_qp_state(qp, QpState::Error);
        // DREQ from ESTABLISHED, else DREP from DREQ_RCVD, else nothing: the kernel's
        // rdma_disconnect ignores both sends' errors and returns 0.
        match ib {
            Some(IbCmState::Established) => {
                self.set_ib(key, IbCmState::DreqSent);
                self.send_to_peer(key, MsgKind::Dreq, 0);
                self.start_retry(key, MsgKind::Dreq);
            }
            Some(IbCmState::DreqRcvd) => {
                self.send_to_peer(key, MsgKind::Drep, 0);
                self.enter_timewait(key);
            }
            _ => {}
        }
        Ok(())
    }

    pub(crate) fn destroy(&mut self, key: SimIdKey) -> Result<(), CmError> {
        const OP: &str = "rdma_destroy_id";
        let id = self.id(key).ok_or_else(|| gone(OP))?;
        let unacked = self.unacked_of(key.index, id.unacked);
        if unacked > 0 {
            return Err(CmError::UnackedEvents {
                op: OP,
                unacked: unacked as usize,
            });
        }
        let node = self.node_of(key.index, id.place);
        let walked = self.channels[self.channel_of(key.index, id.place)]
            .queue
            .len() as u64;
        let (ib, qp) = (id.state.ib(), id.qp.get());
        let from_req = id.remote().filter(|_| id.state.has(IdState::FROM_REQ));
        // What ib_destroy_cm_id tells the peer, by state.
        use IbCmState as S;
        match ib {
            Some(S::Established) => self.send_to_peer(key, MsgKind::Dreq, 0),
            Some(S::DreqRcvd) => self.send_to_peer(key, MsgKind::Drep, 0),
            Some(S::ReqSent | S::MraReqRcvd) => self.send_to_peer_or_req(key, REJ_TIMEOUT),
            Some(
                S::ReqRcvd
                | S::MraReqSent
                | S::RepSent
                | S::MraRepRcvd
                | S::RepRcvd
                | S::MraRepSent,
            ) => self.send_to_peer(key, MsgKind::Rej, REJ_CONSUMER_DEFINED),
            _ => {}
        }
        if ib == Some(S::Listen) {
            self.listeners.retain(|l| l.key != key);
        }
        if let Some(from) = from_req {
            self.remote_reqs.remove(from.0, from.1);
        }
        if let Some(q) = qp.and_then(|q| self.qp_mut(q)) {
            q.alive = false;
        }
        if let (Some(qp), Some(watched)) = (qp, self.destroyed_qps(node)) {
            watched.push(qp);
        }
        let slot = self
            .ids
            .get_mut(key.index as usize)
            .expect("a live id's slot");
        slot.data = None;
        slot.generation = slot.generation.wrapping_add(1);
        self.update_extras(key.index, |extras| *extras = IdExtras::default());
        self.free_ids.push(key.index);
        self.stats.ids_destroyed += 1;
        self.stats.events_walked_by_destroy += walked;
        Ok(())
    }

    /// REJ to the peer; an active id whose peer is not known yet (REQ_SENT) addresses
    /// the REJ by its own id, which the passive side's duplicate-REQ table knows.
    pub(super) fn send_to_peer_or_req(&mut self, key: SimIdKey, reason: i32) {
        if self.id(key).is_some_and(|id| id.remote().is_some()) {
            self.send_to_peer(key, MsgKind::Rej, reason);
        } else if let Some(id) = self.id(key) {
            if let Some((to, _)) = id.dst() {
                let node = self.node_of(key.index, id.place);
                let mut msg = Message::new(MsgKind::Rej, id.conn.get(), node, to);
                msg.src = MaybeKey(key);
                msg.value = reason;
                // The passive id, if the REQ got there (as in the kernel, a REJ
                // overtaking its REQ finds no id and is dropped).
                msg.dst = MaybeKey::new(self.remote_reqs.get(node, key));
                self.send(msg);
            }
        }
    }

    pub(crate) fn channel_closed(&self, channel: usize) -> bool {
        self.channels.get(channel).is_none_or(|c| c.closed)
    }

    /// `rdma_destroy_event_channel`. Closing the channel's file makes the kernel destroy
    /// every id still on it (ucma_close), each telling its peer as `destroy` does. Refused
    /// while events of those ids are unacknowledged: their memory belongs to the channel.
    pub(crate) fn destroy_channel(&mut self, channel: usize) -> Result<(), CmError> {
        const OP: &str = "rdma_destroy_event_channel";
        if self.channel_closed(channel) {
            return Err(CmError::Gone {
                op: OP,
                what: "channel",
            });
        }
        let mut keys = Vec::new();
        let mut unacked = 0;
        for (index, slot) in self.ids.iter().enumerate() {
            let on_channel = |id: &&IdData| self.channel_of(index as u32, id.place) == channel;
            if let Some(id) = slot.data.as_ref().filter(on_channel) {
                unacked += self.unacked_of(index as u32, id.unacked) as usize;
                keys.push(SimIdKey {
                    index: index as u32,
                    generation: slot.generation,
                });
            }
        }
        if unacked > 0 {
            return Err(CmError::UnackedEvents { op: OP, unacked });
        }
        for key in keys {
            self.destroy(key)?;
        }
        let closed = &mut self.channels[channel];
        closed.closed = true;
        self.arrivals.bump_channel(channel);
        self.stats.events_discarded += closed.queue.len() as u64;
        let discarded = std::mem::take(&mut closed.queue);
        // A listener migrated away keeps listening: its requests left here give their
        // backlog back.
        for listener in discarded.iter().filter_map(|e| e.listen_id) {
            self.give_backlog(listener);
        }
        Ok(())
    }

    pub(crate) fn migrate(&mut self, key: SimIdKey, channel: usize) -> Result<(), CmError> {
        const OP: &str = "rdma_migrate_id";
        if self.channel_closed(channel) {
            return Err(CmError::Gone {
                op: OP,
                what: "channel",
            });
        }
        let id = self.id(key).ok_or_else(|| gone(OP))?;
        let unacked = self.unacked_of(key.index, id.unacked);
        if unacked > 0 {
            return Err(CmError::UnackedEvents {
                op: OP,
                unacked: unacked as usize,
            });
        }
        let old = self.channel_of(key.index, id.place);
        self.set_channel(key, channel);
        if old != channel {
            // Pending events follow the id (linear in the old queue, like the kernel).
            let queue = std::mem::take(&mut self.channels[old].queue);
            let (moving, staying): (VecDeque<_>, VecDeque<_>) =
                queue.into_iter().partition(|e| e.id == key);
            self.channels[old].queue = staying;
            self.channels[channel].queue.extend(moving);
            self.arrivals.bump_channel(channel);
        }
        Ok(())
    }

    pub(crate) fn notify(
        &mut self,
        key: SimIdKey,
        event: AsyncEventType,
    ) -> Result<NotifyOutcome, NotifyError> {
        let result = self.notify_inner(key, event);
        let conn = self.id(key).and_then(|id| id.conn.get());
        self.record(|| TraceEvent::Notify {
            id: key,
            conn,
            event,
            result,
        });
        result
    }

    pub(super) fn notify_inner(
        &mut self,
        key: SimIdKey,
        event: AsyncEventType,
    ) -> Result<NotifyOutcome, NotifyError> {
        // ucma: a destroyed id's handle is unknown to the kernel.
        let Some(id) = self.id(key) else {
            return Err(NotifyError::UnknownId);
        };
        // ucma: no device bound yet; rdma_notify: no IB CM id attached.
        if !id.state.has(IdState::DEVICE) {
            return Err(NotifyError::WrongState);
        }
        let Some(state) = id.state.ib() else {
            return Err(NotifyError::WrongState);
        };
        let node = &self.nodes[self.node_of(key.index, id.place).0 as usize];
        if node.kind == DeviceKind::Iwarp {
            return Ok(NotifyOutcome::Established);
        }
        if event == AsyncEventType::CommEst && node.going_down {
            return Err(NotifyError::NoDevice);
        }
        let result = ib_cm_notify(state, self.extras(key.index).lap, event);
        if result.is_ok() && notify_delivers_established(state, event) {
            self.cancel_timer(key);
            self.set_ib(key, IbCmState::Established);
            self.stats.forced_establishes += 1;
            let delay = nanos(self.config.establish_work_delay);
            self.schedule(delay, Action::EstablishWork(key));
        }
        result
    }

    /// Keeps `context` with id `key` (never `u32::MAX`); whether the id is alive.
    pub(crate) fn set_context(&mut self, key: SimIdKey, context: u32) -> bool {
        match self.id_mut(key) {
            Some(id) if context != u32::MAX => {
                id.context = context;
                true
            }
            _ => false,
        }
    }

    // ----- event channels ----------------------------------------------------------

    pub(crate) fn next_event(&mut self, channel: usize) -> Option<ReadEvent> {
        loop {
            let queued = self.channels.get_mut(channel)?.queue.pop_front()?;
            self.arrivals.bump_activity();
            // ucma_get_event: a CONNECT_REQUEST read gives its listener's backlog back.
            if let Some(listener) = queued.listen_id {
                self.give_backlog(listener);
            }
            if !self.is_alive(queued.id) {
                self.stats.events_discarded += 1;
                continue;
            }
            let (event_type, status, private) = match queued.kind {
                QueuedKind::Event(t) => (t, queued.status, queued.private),
                QueuedKind::ConnectResponse => self.process_connect_response(queued.id),
            };
            self.count_unacked(queued.id, true);
            let id = self.id(queued.id)?;
            let qp = id.qp.get();
            let context = (id.context != u32::MAX).then_some(id.context);
            self.stats.events_delivered += 1;
            return Some(ReadEvent {
                id: queued.id,
                listen_id: queued.listen_id,
                event_type,
                status,
                qp,
                private: self.privates.get(private).into(),
                context,
            });
        }
    }

    /// What librdmacm does with CONNECT_RESPONSE: QP to RTR and RTS, send the RTU
    /// (ucma accept), and report ESTABLISHED with the REP's private data.
    pub(super) fn process_connect_response(
        &mut self,
        key: SimIdKey,
    ) -> (CmEventType, i32, Private) {
        let Some(id) = self.id_mut(key) else {
            return (
                CmEventType::ConnectError,
                -errno::EINVAL,
                Private::default(),
            );
        };
        let ready = matches!(
            id.state.ib(),
            Some(IbCmState::RepRcvd | IbCmState::MraRepSent)
        );
        if !ready || id.state.cm() != CmIdState::Connect {
            return (
                CmEventType::ConnectError,
                -errno::EINVAL,
                Private::default(),
            );
        }
        let (qp, peer) = (id.qp.get(), id.remote_qp.get());
        let mut private = Private::default();
        self.update_extras(key.index, |extras| {
            private = std::mem::take(&mut extras.peer_private);
        });
        if let Some(q) = qp.and_then(|q| self.qp_mut(q)) {
            q.peer = MaybeQp::new(peer);
            q.state = QpState::Rts;
        }
        if !self.on_iwarp(key) {
            self.send_to_peer(key, MsgKind::Rtu, 0);
        }
        self.set_ib(key, IbCmState::Established);
        let conn = self.id(key).and_then(|id| id.conn.get());
        self.record(|| TraceEvent::CmEvent {
            id: key,
            conn,
            event: CmEventType::Established,
            status: 0,
        });
        (CmEventType::Established, 0, private)
    }

    pub(crate) fn ack(&mut self, key: SimIdKey) {
        self.count_unacked(key, false);
        self.stats.events_acked += 1;
    }

    /// Whether a channel or a device holds something its reader has not taken yet.
    /// O(channels + nodes), asked only when nothing is scheduled.
    pub(crate) fn anything_unread(&self) -> bool {
        self.channels
            .iter()
            .any(|c| !c.closed && !c.queue.is_empty())
            || self
                .nodes
                .iter()
                .any(|n| !n.async_events.is_empty() || !n.completions.is_empty())
    }

    pub(crate) fn channel_len(&self, channel: usize) -> usize {
        self.channels.get(channel).map_or(0, |c| c.queue.len())
    }

    // ----- inspection --------------------------------------------------------------

    pub(crate) fn ib_state(&self, key: SimIdKey) -> Result<Option<IbCmState>, CmError> {
        self.id(key).map(|id| id.state.ib()).ok_or(gone("ib_state"))
    }

    pub(crate) fn cm_state(&self, key: SimIdKey) -> Result<CmIdState, CmError> {
        self.id(key).map(|id| id.state.cm()).ok_or(gone("cm_state"))
    }

    /// From now on, remembers the QPs of `node` that are destroyed, for
    /// [`Fabric::take_destroyed_qps`].
    pub(crate) fn watch_destroyed_qps(&mut self, node: NodeId) {
        if let Some(n) = self.nodes.get_mut(node.0 as usize) {
            n.destroyed_qps.get_or_insert_with(Vec::new);
        }
    }

    /// Moves the QPs of `node` destroyed since the last call to `out`.
    pub(crate) fn take_destroyed_qps(&mut self, node: NodeId, out: &mut Vec<QpNum>) {
        if let Some(destroyed) = self.destroyed_qps(node) {
            out.append(destroyed);
        }
    }

    fn destroyed_qps(&mut self, node: NodeId) -> Option<&mut Vec<QpNum>> {
        self.nodes.get_mut(node.0 as usize)?.destroyed_qps.as_mut()
    }

    /// What is left of the backlog of listening id `key` (`None`: not listening).
    pub(crate) fn backlog_left(&self, key: SimIdKey) -> Option<u32> {
        self.listeners
            .iter()
            .find_map(|l| (l.key == key).then_some(l.backlog))
    }

    pub(crate) fn id_qp(&self, key: SimIdKey) -> Option<QpNum> {
        self.id(key)?.qp.get()
    }

    /// How many ids were destroyed so far: an id's QP number stays what it was read as
    /// while this does not change (it is set once, and cleared only with the id).
    pub(crate) fn ids_destroyed(&self) -> u64 {
        self.stats.ids_destroyed
    }

    pub(crate) fn id_conn(&self, key: SimIdKey) -> Option<ConnId> {
        self.id(key)?.conn.get()
    }

    pub(crate) fn id_node(&self, key: SimIdKey) -> Option<NodeId> {
        self.id(key).map(|id| self.node_of(key.index, id.place))
    }

    pub(crate) fn id_unacked(&self, key: SimIdKey) -> Option<u32> {
        self.id(key)
            .map(|id| self.unacked_of(key.index, id.unacked))
    }

    pub(crate) fn force_ib_state(
        &mut self,
        key: SimIdKey,
        state: IbCmState,
    ) -> Result<(), CmError> {
        let id = self.live(key, "force_ib_state")?;
        id.state.set(IdState::DEVICE, true);
        self.cancel_timer(key);
        self.set_ib(key, state);
        Ok(())
    }

    pub(crate) fn set_lap_state(&mut self, key: SimIdKey, lap: LapState) -> Result<(), CmError> {
        self.live(key, "set_lap_state")?;
        self.update_extras(key.index, |extras| extras.lap = lap);
        Ok(())
    }
}
