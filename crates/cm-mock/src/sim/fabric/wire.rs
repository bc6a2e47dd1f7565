//! The wire and the clock: sending a message (fault rules and odds, latency), running
//! the earliest scheduled action, and the IB CM's answer to each message delivered
//! (cm_req_handler, cm_rep_handler, cm_rtu_handler, cm_rej_handler, DREQ/DREP, MRA),
//! and to each packet on a QP (receive completions, COMM_EST).

use std::time::Duration;

use cm_core::kernel_model::LapState;
use cm_core::{errno, AsyncEvent, AsyncEventType, CmEventType, CmIdState, IbCmState, QpNum};

use super::{
    nanos, Action, Fabric, IdState, MaybeConn, MaybeKey, MaybeQp, Message, Private, QpState,
    QueuedKind, TraceEvent, REJ_INVALID_SERVICE_ID, REJ_STALE_CONN,
};
use crate::sim::types::{FaultAction, MsgKind, RecvCompletion, SimIdKey};

impl Fabric {
    // ----- the wire ----------------------------------------------------------------

    pub(super) fn send(&mut self, mut msg: Message) {
        if self.nodes.get(msg.from.0 as usize).is_some_and(|n| n.fatal) {
            // A device in fatal error sends nothing (an id destroyed on it sends no
            // DREQ or REJ).
            self.stats.dropped += 1;
            return;
        }
        let kind = msg.kind;
        let conn = msg.conn;
        self.stats.sent[kind.index()] += 1;
        if msg.retransmit {
            self.stats.retransmissions += 1;
        }
        self.record(|| TraceEvent::Sent {
            kind,
            conn,
            from: msg.from,
            to: msg.to,
            retransmit: msg.retransmit,
        });
        let nth = conn.map_or(0, |c| self.count_sent(c, kind));
        let mut fault = self
            .rules
            .iter()
            .find(|r| r.matches(kind, conn, nth))
            .map(|r| r.action);
        if fault.is_none() && self.any_odds {
            fault = self.draw_fault(kind);
        }
        let latency = nanos(self.config.wire_latency);
        match fault {
            None => self.schedule(latency, Action::Deliver(msg)),
            Some(action) => {
                self.record(|| TraceEvent::Fault { kind, conn, action });
                match action {
                    FaultAction::Drop => self.stats.dropped += 1,
                    FaultAction::Duplicate => {
                        self.stats.duplicated += 1;
                        // The copy is never delivered as data: it needs no payload.
                        let payload = msg.payload.take();
                        let mut copy = msg.clone();
                        copy.copy = true;
                        msg.payload = payload;
                        self.schedule(latency, Action::Deliver(msg));
                        self.schedule(latency.saturating_mul(2), Action::Deliver(copy));
                    }
                    FaultAction::Delay(extra) => {
                        self.stats.delayed += 1;
                        self.schedule_irregular(
                            latency.saturating_add(nanos(extra)),
                            Action::Deliver(msg),
                        );
                    }
                    FaultAction::Reorder => {
                        self.stats.delayed += 1;
                        let extra = self.rng.up_to(nanos(self.config.reorder_window));
                        self.schedule_irregular(
                            latency.saturating_add(extra),
                            Action::Deliver(msg),
                        );
                    }
                }
            }
        }
    }

    pub(super) fn draw_fault(&mut self, kind: MsgKind) -> Option<FaultAction> {
        let odds = self.odds[kind.index()];
        if odds.is_zero() {
            return None;
        }
        if self.rng.chance(odds.drop) {
            Some(FaultAction::Drop)
        } else if self.rng.chance(odds.duplicate) {
            Some(FaultAction::Duplicate)
        } else if self.rng.chance(odds.delay) {
            let d = self.rng.up_to(nanos(odds.max_delay));
            Some(FaultAction::Delay(Duration::from_nanos(d)))
        } else if self.rng.chance(odds.reorder) {
            Some(FaultAction::Reorder)
        } else {
            None
        }
    }

    /// Builds the message `kind` from id `key` to its peer.
    pub(super) fn to_peer(&self, key: SimIdKey, kind: MsgKind) -> Option<Message> {
        let id = self.id(key)?;
        let (peer_node, peer) = id.remote()?;
        let node = self.node_of(key.index, id.place);
        let mut msg = Message::new(kind, id.conn.get(), node, peer_node);
        msg.src = MaybeKey(key);
        msg.dst = MaybeKey(peer);
        Some(msg)
    }

    pub(super) fn send_to_peer(&mut self, key: SimIdKey, kind: MsgKind, value: i32) {
        if let Some(mut msg) = self.to_peer(key, kind) {
            msg.value = value;
            self.send(msg);
        }
    }

    pub(super) fn send_req(&mut self, key: SimIdKey, retransmit: bool) {
        let Some(id) = self.id(key) else { return };
        let Some((to, port)) = id.dst() else { return };
        let node = self.node_of(key.index, id.place);
        let mut msg = Message::new(MsgKind::Req, id.conn.get(), node, to);
        msg.src = MaybeKey(key);
        msg.qp = id.qp.get().unwrap_or(QpNum(0));
        msg.port = port;
        msg.private = self.extras(key.index).private;
        msg.retransmit = retransmit;
        self.send(msg);
    }

    pub(super) fn send_rep(&mut self, key: SimIdKey, retransmit: bool) {
        let Some(mut msg) = self.to_peer(key, MsgKind::Rep) else {
            return;
        };
        let Some(id) = self.id(key) else { return };
        msg.qp = id.qp.get().unwrap_or(QpNum(0));
        msg.private = self.extras(key.index).private;
        msg.retransmit = retransmit;
        self.send(msg);
    }

    pub(super) fn resend(&mut self, key: SimIdKey, kind: MsgKind) {
        match kind {
            MsgKind::Req => self.send_req(key, true),
            MsgKind::Rep => self.send_rep(key, true),
            other => {
                if let Some(mut msg) = self.to_peer(key, other) {
                    msg.retransmit = true;
                    self.send(msg);
                }
            }
        }
    }

    // ----- the clock ---------------------------------------------------------------

    pub(crate) fn next_due(&self) -> Option<u64> {
        self.queue.next_due()
    }

    pub(crate) fn set_now(&mut self, at: u64) {
        self.now = self.now.max(at);
    }

    pub(crate) fn now_nanos(&self) -> u64 {
        self.now
    }

    /// Runs every action due within `duration` from now, then sets the clock to now +
    /// `duration`; how many actions ran.
    pub(crate) fn advance(&mut self, duration: Duration) -> usize {
        let until = self.now.saturating_add(nanos(duration));
        let mut ran = 0;
        while self.next_due().is_some_and(|at| at <= until) {
            self.step();
            ran += 1;
        }
        self.set_now(until);
        ran
    }

    /// An application's setup work took `cost` (see `SimConfig::create_qp_cost`):
    /// virtual time passes as in [`Fabric::advance`], messages and timers due
    /// meanwhile handled. The clock moving counts as activity, so that parties sharing
    /// the fabric look at their deadlines again.
    pub(crate) fn spend(&mut self, cost: Duration) {
        if cost.is_zero() {
            return;
        }
        self.arrivals.bump_activity();
        self.advance(cost);
    }

    /// Runs the earliest scheduled action; `false` when there is none.
    pub(crate) fn step(&mut self) -> bool {
        let Some((at, action)) = self.queue.pop() else {
            return false;
        };
        self.now = self.now.max(at);
        match action {
            Action::Deliver(msg) => self.deliver(msg),
            Action::Timer { id, gen } => self.on_timer(id, gen),
            Action::AddrResolved(key) => {
                let resolved = self.id_mut(key).is_some_and(|id| {
                    let querying = id.state.cm() == CmIdState::AddrQuery;
                    if querying {
                        id.state.set_cm(CmIdState::AddrResolved);
                        id.state.set(IdState::DEVICE, true);
                    }
                    querying
                });
                if resolved {
                    let ev = QueuedKind::Event(CmEventType::AddrResolved);
                    self.push_event(key, None, ev, 0, Private::default());
                }
            }
            Action::RouteResolved(key) => {
                let resolved = self.id_mut(key).is_some_and(|id| {
                    let querying = id.state.cm() == CmIdState::RouteQuery;
                    if querying {
                        id.state.set_cm(CmIdState::RouteResolved);
                    }
                    querying
                });
                if resolved {
                    let ev = QueuedKind::Event(CmEventType::RouteResolved);
                    self.push_event(key, None, ev, 0, Private::default());
                }
            }
            Action::EstablishWork(key) => {
                // The kernel's work handler re-checks the state: a DREQ (or anything
                // else) that moved the id on suppresses the event.
                if self.id(key).and_then(|id| id.state.ib()) == Some(IbCmState::Established) {
                    let ev = QueuedKind::Event(CmEventType::Established);
                    self.queue_cm_event(key, ev, 0, Private::default());
                }
            }
        }
        true
    }

    pub(super) fn on_timer(&mut self, key: SimIdKey, gen: u32) {
        let timeouts = (
            self.config.cm_response_timeout,
            self.config.mra_service_timeout,
        );
        let Some(id) = self.id_mut(key) else { return };
        if id.timer_gen != gen {
            return;
        }
        let (retrying, retries, ib) = (id.state.retrying(), id.retries_left, id.state.ib());
        let timeout = nanos(if id.state.has(IdState::MRA_TIMEOUT) {
            timeouts.1
        } else {
            timeouts.0
        });
        let retries_left = self.retries_of(key.index, retries);
        match retrying {
            None => {
                // TIMEWAIT is over.
                if ib == Some(IbCmState::Timewait) {
                    self.set_ib(key, IbCmState::Idle);
                    let ev = QueuedKind::Event(CmEventType::TimewaitExit);
                    self.queue_cm_event(key, ev, 0, Private::default());
                }
            }
            Some(kind) if retries_left > 0 => {
                self.set_retries(key, retries_left - 1);
                self.resend(key, kind);
                self.schedule(timeout, Action::Timer { id: key, gen });
            }
            Some(kind) => {
                if let Some(id) = self.id_mut(key) {
                    id.state.set_retrying(None);
                }
                match kind {
                    MsgKind::Req | MsgKind::Rep => {
                        // REQ_ERROR / REP_ERROR: the IB CM id goes back to IDLE (the
                        // kernel leaves a user-space QP alone).
                        self.set_ib(key, IbCmState::Idle);
                        let ev = QueuedKind::Event(CmEventType::Unreachable);
                        self.queue_cm_event(key, ev, -errno::ETIMEDOUT, Private::default());
                    }
                    _ => {
                        // DREQ_ERROR: TIMEWAIT, DISCONNECTED with -ETIMEDOUT.
                        self.enter_timewait(key);
                        self.disconnected(key, -errno::ETIMEDOUT);
                    }
                }
            }
        }
    }

    /// DREQ received / DREP received / DREQ timed out: one DISCONNECTED, moving the
    /// rdma_cm id from CONNECT to DISCONNECT (a second one finds DISCONNECT and is
    /// filtered).
    pub(super) fn disconnected(&mut self, key: SimIdKey, status: i32) {
        let Some(id) = self.id_mut(key) else { return };
        if id.state.cm() == CmIdState::Connect {
            id.state.set_cm(CmIdState::Disconnect);
            let ev = QueuedKind::Event(CmEventType::Disconnected);
            self.push_event(key, None, ev, status, Private::default());
        }
    }

    pub(super) fn ignore(&mut self, msg: &Message, reason: &'static str) {
        self.stats.ignored += 1;
        let (kind, conn) = (msg.kind, msg.conn);
        self.record(|| TraceEvent::Ignored { kind, conn, reason });
    }

    pub(super) fn deliver(&mut self, msg: Message) {
        self.stats.delivered[msg.kind.index()] += 1;
        let (kind, conn, to) = (msg.kind, msg.conn, msg.to);
        self.record(|| TraceEvent::Delivered { kind, conn, to });
        if msg.kind == MsgKind::Data {
            return self.deliver_data(msg);
        }
        if msg.kind == MsgKind::Req {
            return self.deliver_req(msg);
        }
        let Some(dst) = msg.dst.get().filter(|k| self.is_alive(*k)) else {
            return self.ignore(&msg, "no such id");
        };
        let state = self.id(dst).and_then(|id| id.state.ib());
        use IbCmState as S;
        match (msg.kind, state) {
            (MsgKind::Mra, Some(S::ReqSent)) if msg.value == MsgKind::Req.index() as i32 => {
                self.set_ib(dst, S::MraReqRcvd);
                self.extend_retry(dst);
            }
            (MsgKind::Mra, Some(S::RepSent)) if msg.value == MsgKind::Rep.index() as i32 => {
                self.set_ib(dst, S::MraRepRcvd);
                self.extend_retry(dst);
            }
            (MsgKind::Rep, Some(S::ReqSent | S::MraReqRcvd)) => self.rep_received(dst, msg),
            // A duplicate REP: the passive side did not get our RTU (resend it) or is
            // waiting for us (tell it so with the delayed MRA).
            (MsgKind::Rep, Some(S::Established)) if !self.on_iwarp(dst) => {
                self.send_to_peer(dst, MsgKind::Rtu, 0)
            }
            (MsgKind::Rep, Some(S::MraRepSent)) => {
                self.send_to_peer(dst, MsgKind::Mra, MsgKind::Rep.index() as i32)
            }
            (MsgKind::Rtu, Some(S::RepSent | S::MraRepRcvd)) => {
                self.cancel_timer(dst);
                self.set_ib(dst, S::Established);
                let ev = QueuedKind::Event(CmEventType::Established);
                self.queue_cm_event(dst, ev, 0, Private::default());
            }
            (MsgKind::Rtu, Some(S::Established)) => {
                self.stats.late_rtus += 1;
                self.ignore(&msg, "late RTU: already ESTABLISHED (counted as duplicate)");
            }
            (MsgKind::Dreq, Some(S::RepSent | S::MraRepRcvd | S::DreqSent | S::Established)) => {
                self.cancel_timer(dst);
                self.set_ib(dst, S::DreqRcvd);
                self.disconnected(dst, 0);
            }
            (MsgKind::Dreq, Some(S::Timewait)) => self.send_to_peer(dst, MsgKind::Drep, 0),
            (MsgKind::Drep, Some(S::DreqSent | S::DreqRcvd)) => {
                self.enter_timewait(dst);
                self.disconnected(dst, 0);
            }
            (MsgKind::Rej, Some(state)) => self.rej_received(dst, state, msg),
            _ => self.ignore(&msg, "the id's state does not take this message"),
        }
    }

    /// cm_rej_handler: back to IDLE while connecting (TIMEWAIT for a stale-connection
    /// REJ), TIMEWAIT once the REP was received or the connection established; the RDMA
    /// CM reports REJECTED (status = the reason) and librdmacm moves the QP to error.
    pub(super) fn rej_received(&mut self, key: SimIdKey, state: IbCmState, msg: Message) {
        use IbCmState as S;
        let lap = self.extras(key.index).lap;
        let timewait = match state {
            S::ReqSent
            | S::MraReqRcvd
            | S::RepSent
            | S::MraRepRcvd
            | S::ReqRcvd
            | S::MraReqSent => msg.value == REJ_STALE_CONN,
            S::DreqSent | S::RepRcvd | S::MraRepSent => true,
            S::Established if lap == LapState::Uninit => true,
            _ => return self.ignore(&msg, "the id's state does not take a REJ"),
        };
        self.cancel_timer(key);
        if timewait {
            self.enter_timewait(key);
        } else {
            self.set_ib(key, S::Idle);
        }
        let qp = self.id(key).and_then(|id| id.qp.get());
        self.set_qp_state(qp, QpState::Error);
        let ev = QueuedKind::Event(CmEventType::Rejected);
        // iWARP reports the peer's MPA reject as -ECONNRESET, not an IB CM reason.
        let status = if self.on_iwarp(key) {
            -errno::ECONNRESET
        } else {
            msg.value
        };
        self.queue_cm_event(key, ev, status, msg.private);
    }

    pub(super) fn deliver_req(&mut self, msg: Message) {
        let Some(src) = msg.src.get() else {
            return self.ignore(&msg, "REQ without sender");
        };
        if let Some(existing) = self.remote_reqs.get(msg.from, src) {
            // A retried REQ: answer with the delayed MRA if the application has not
            // accepted yet, else ignore it.
            match self.id(existing).and_then(|id| id.state.ib()) {
                Some(IbCmState::MraReqSent) => {
                    self.send_to_peer(existing, MsgKind::Mra, MsgKind::Req.index() as i32)
                }
                Some(IbCmState::Timewait) => {
                    self.send_to_peer(existing, MsgKind::Rej, REJ_STALE_CONN)
                }
                _ => self.ignore(&msg, "duplicate REQ"),
            }
            return;
        }
        // The REQ's service ID names its sender's port space: only a listener of that
        // space answers it.
        let space = self.port_space(src);
        let listener = self
            .listener((msg.to, msg.port), space)
            .filter(|l| self.id(*l).and_then(|id| id.state.ib()) == Some(IbCmState::Listen));
        let Some(listener) = listener else {
            let mut rej = Message::new(MsgKind::Rej, msg.conn, msg.to, msg.from);
            rej.dst = MaybeKey(src);
            rej.value = REJ_INVALID_SERVICE_ID;
            self.send(rej);
            return;
        };
        if !self.take_backlog(listener) {
            // cm_req_handler → ucma: -ENOMEM, which the IB CM answers with nothing at
            // all ("do not reject to allow future retries"): no id, no REJ. The active
            // side's REQ timer resends it.
            self.stats.reqs_dropped_backlog += 1;
            let (kind, conn) = (msg.kind, msg.conn);
            self.record(|| TraceEvent::Ignored {
                kind,
                conn,
                reason: "listen backlog full (dropped, the peer's REQ retry resends it)",
            });
            return;
        }
        let channel = self
            .id(listener)
            .map_or(0, |l| self.channel_of(listener.index, l.place));
        let key = self.create_id(channel);
        if let Some(id) = self.id_mut(key) {
            id.state.set(IdState::DEVICE, true);
            id.state.set_cm(CmIdState::Connect);
            id.conn = MaybeConn::new(msg.conn);
            id.set_remote(msg.from, src);
            id.remote_qp = MaybeQp::new(Some(msg.qp));
            id.state.set(IdState::FROM_REQ, true);
        }
        self.remote_reqs.insert(msg.from, src, key);
        self.set_ib(key, IbCmState::ReqRcvd);
        let ev = QueuedKind::Event(CmEventType::ConnectRequest);
        self.push_event(key, Some(listener), ev, 0, msg.private);
        if self.config.delayed_mra {
            self.set_ib(key, IbCmState::MraReqSent);
        }
    }

    pub(super) fn rep_received(&mut self, key: SimIdKey, msg: Message) {
        self.cancel_timer(key);
        if let Some(id) = self.id_mut(key) {
            id.set_remote(msg.from, msg.src.get().unwrap_or(key));
            id.remote_qp = MaybeQp::new(Some(msg.qp));
            self.update_extras(key.index, |extras| extras.peer_private = msg.private);
        }
        self.set_ib(key, IbCmState::RepRcvd);
        if self.config.delayed_mra {
            self.set_ib(key, IbCmState::MraRepSent);
        }
        // librdmacm turns this into QP transitions + RTU + ESTABLISHED when the
        // application reads it.
        self.queue_cm_event(key, QueuedKind::ConnectResponse, 0, Private::default());
    }

    pub(super) fn deliver_data(&mut self, msg: Message) {
        if msg.copy {
            // RC transport: the packet sequence number check discards the copy.
            return self.ignore(&msg, "duplicate packet (RC sequence check)");
        }
        let Some(qp) = self.qp(msg.qp) else {
            return self.ignore(&msg, "no such QP");
        };
        if !qp.alive || qp.state != QpState::Rts {
            return self.ignore(&msg, "QP not ready to receive");
        }
        let (node, owner, first) = (qp.node, qp.owner, !qp.got_first_packet);
        if let Some(qp) = self.qp_mut(msg.qp) {
            qp.got_first_packet = true;
        }
        let completion = RecvCompletion {
            qp: msg.qp,
            byte_len: msg.value.max(0) as u32,
        };
        self.nodes[node.0 as usize]
            .completions
            .push_back((completion, msg.payload));
        self.arrivals.bump_node(node);
        self.stats.recv_completions += 1;
        let qpn = msg.qp;
        self.record(|| TraceEvent::RecvCompletion { node, qp: qpn });
        // A live QP's owner is live: its slot holds it.
        let owner = self
            .ids
            .get(owner as usize)
            .and_then(|slot| slot.data.as_ref());
        let cm_waiting = matches!(
            owner.and_then(|id| id.state.ib()),
            Some(IbCmState::RepSent | IbCmState::MraRepRcvd)
        );
        if first && cm_waiting && self.config.comm_est {
            let event = AsyncEvent::qp(AsyncEventType::CommEst, msg.qp);
            self.nodes[node.0 as usize].async_events.push_back(event);
            self.arrivals.bump_node(node);
            self.stats.comm_est_raised += 1;
            self.record(|| TraceEvent::AsyncEvent { node, event });
        }
    }
}
