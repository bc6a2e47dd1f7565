//! One-sided work (RDMA READ and WRITE) on the simulated fabric: sim-only calls that post
//! it on an id's QP and complete it on the QP's send queue, as the real device would,
//! so that a connection API that hands the application its ids (cm-verbs'
//! `Endpoint::cm_id`) and tells its completions apart by work request id can be driven
//! on the simulation.
//!
//! The calls take the transport by shared reference (a connection API owns its
//! transport and lends it out only so): the work waits here, behind a lock of its own,
//! until the transport's next call that touches the queues (reading completion events,
//! polling a queue, posting a send) moves it onto its QP's send queue, in posting order
//! and ahead of anything posted after it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use cm_core::{errno, CmError, CqKind, Errno, QpNum, WcStatus, WorkCompletion};

use super::{shared_slot, SimTransport, NO_SLOT};
use crate::sim::fabric::QpState;
use crate::sim::SimCmId;

/// The call one-sided work stands for, in errors.
const OP: &str = "ibv_post_send";

/// The longest one-sided transfer: an RDMA message carries at most 2 GiB.
const MAX_LEN: u32 = 1 << 31;

/// One-sided work posted through a shared reference, and the QPs a refused piece moved
/// to the error state.
#[derive(Debug, Default)]
pub(super) struct OneSided {
    /// Whether `state` holds anything: read without the lock on every pass.
    any: AtomicBool,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Completions of work posted since the queues were last touched, oldest first.
    posted: Vec<WorkCompletion>,
    /// QPs whose one-sided work a peer refused: in the error state for this transport
    /// (the fabric's own state of the QP stays as it was), so their later work flushes.
    errored: Vec<QpNum>,
}

impl OneSided {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether work waits to join its QP's send queue.
    pub(super) fn waiting(&self) -> bool {
        self.any.load(Ordering::Acquire) && !self.state().posted.is_empty()
    }

    /// Whether a refused piece put any QP in the error state, once the waiting work was
    /// taken ([`SimTransport::take_one_sided`]): one load, no lock.
    pub(super) fn any_errored(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// Whether a refused piece put `qp` in the error state.
    pub(super) fn errored(&self, qp: QpNum) -> bool {
        self.any.load(Ordering::Acquire) && self.state().errored.contains(&qp)
    }

    /// Forgets the QPs in `destroyed` (their numbers may serve new QPs).
    pub(super) fn forget(&mut self, destroyed: &[QpNum]) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        state.errored.retain(|qp| !destroyed.contains(qp));
        self.any.store(
            !state.posted.is_empty() || !state.errored.is_empty(),
            Ordering::Release,
        );
    }

    /// Takes the waiting completions, oldest first, into `out`.
    fn take(&mut self, out: &mut Vec<WorkCompletion>) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        out.append(&mut state.posted);
        self.any.store(!state.errored.is_empty(), Ordering::Release);
    }

    fn push(&self, completion: WorkCompletion, errors_qp: bool) {
        let mut state = self.state();
        state.posted.push(completion);
        if errors_qp && !state.errored.contains(&completion.qp) {
            state.errored.push(completion.qp);
        }
        self.any.store(true, Ordering::Release);
    }
}

impl SimTransport {
    /// Posts one piece of one-sided work (an RDMA READ or WRITE of `len` bytes, which
    /// the peer grants) on `id`'s QP with the work request id `wr_id`. Sim-only: the
    /// real device takes such work through the QP itself.
    ///
    /// It completes on the QP's send queue with `wr_id`, after everything posted there
    /// before it, and raises the QP's completion event as a send does: success while
    /// the QP can send; `IBV_WC_WR_FLUSH_ERR` when it is in the error state (the id
    /// disconnected, its request was rejected, or a refused piece came before,
    /// [`SimTransport::post_one_sided_refused`]). `byte_len` is `len` on success, 0
    /// otherwise. As [`post_send`](cm_core::Transport::post_send), it does not bound
    /// what is outstanding: room for the work is the caller's to keep.
    ///
    /// Errors: [`CmError::InvalidArgument`] for an id of another fabric, one with no QP
    /// (or whose id is gone), a QP another transport created, or `len` over 2 GiB;
    /// `EINVAL` ([`CmError::Os`]) while the QP is not connected yet (not ready to send).
    pub fn post_one_sided(&self, id: &SimCmId, len: u32, wr_id: u64) -> Result<(), CmError> {
        self.post_work(id, len, wr_id, true)
    }

    /// As [`SimTransport::post_one_sided`], for work the peer refuses (a remote key it
    /// does not know, an access it does not grant): on a QP that can send it completes
    /// with `IBV_WC_REM_ACCESS_ERR` and puts the QP in the error state for this
    /// transport, so that the work and sends posted after it flush
    /// (`IBV_WC_WR_FLUSH_ERR`, and a send carries nothing). The fabric's state of the
    /// QP and the peer's QP are left as they are.
    pub fn post_one_sided_refused(
        &self,
        id: &SimCmId,
        len: u32,
        wr_id: u64,
    ) -> Result<(), CmError> {
        self.post_work(id, len, wr_id, false)
    }

    fn post_work(&self, id: &SimCmId, len: u32, wr_id: u64, granted: bool) -> Result<(), CmError> {
        let invalid = |reason| CmError::InvalidArgument { op: OP, reason };
        if len > MAX_LEN {
            return Err(invalid("longer than a message can be (2 GiB)"));
        }
        if !id.fabric.same(self.node.fabric()) {
            return Err(invalid("the id is of another fabric"));
        }
        let (qp, state) = id.with(|f| (f.id_qp(id.key), f.qp_state(id.key)));
        let qp = qp.ok_or(invalid("the id has no QP"))?;
        // The table names this transport's live QPs only.
        if self.by_qp.get(qp) == NO_SLOT {
            return Err(invalid("the QP was not created by this transport"));
        }
        let status = match state {
            Some(QpState::Init) => {
                return Err(CmError::Os {
                    op: OP,
                    errno: Errno(errno::EINVAL),
                })
            }
            Some(QpState::Rts) if !self.one_sided.errored(qp) => {
                if granted {
                    WcStatus::Success
                } else {
                    WcStatus::RemAccessErr
                }
            }
            // In the error state, for the fabric or for this transport.
            _ => WcStatus::WrFlushErr,
        };
        let completion = WorkCompletion {
            wr_id,
            qp,
            kind: CqKind::Send,
            status,
            byte_len: if status == WcStatus::Success { len } else { 0 },
        };
        self.one_sided
            .push(completion, status == WcStatus::RemAccessErr);
        Ok(())
    }

    /// Moves the waiting one-sided work onto its QPs' send queues, in posting order, a
    /// completion event for each (work of a QP destroyed since is dropped, as the QP's
    /// queues went with it).
    pub(super) fn take_one_sided(&mut self) {
        if !self.one_sided.any.load(Ordering::Acquire) {
            return;
        }
        let mut posted = Vec::new();
        self.one_sided.take(&mut posted);
        for completion in posted {
            let slot = self.by_qp.get(completion.qp);
            if let Some(set) = shared_slot(slot) {
                // A QP on shared queues completes on their send queue.
                if let Some(set) = self.shared.get_mut(set) {
                    set.complete(completion, &mut self.tokens);
                }
                continue;
            }
            let Some(queues) = self.queues.get_mut(slot) else {
                continue;
            };
            queues.busy(&mut self.pool).send.push_back(completion);
            self.tokens.push_back(queues.token);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use cm_core::{CmError, CqKind, QueueCaps, Transport, WcStatus, WorkCompletion};

    use super::super::tests::connected;
    use super::super::{SimDeviceReader, SimTransport};
    use crate::sim::{SimCmId, SimConfig, SimPair};

    /// Every completion on `id`'s send queue, oldest first.
    fn sent(transport: &mut SimTransport, id: &SimCmId) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        transport.poll_cq(id, CqKind::Send, &mut out, 64).unwrap();
        out
    }

    fn statuses(completions: &[WorkCompletion]) -> Vec<(u64, WcStatus)> {
        completions.iter().map(|c| (c.wr_id, c.status)).collect()
    }

    /// One-sided work completes on the send queue with its id, in posting order with
    /// the sends around it, and raises the QP's completion event each time.
    #[test]
    fn one_sided_work_completes_in_order_with_the_sends() {
        let caps = QueueCaps {
            work_depth: 4,
            ..QueueCaps::default()
        };
        let (pair, _server, mut client, _passive, active) = connected(&caps);
        let buffers = client.register_buffers(&active, &caps).unwrap();
        client.post_one_sided(&active, 4096, 1 << 63 | 1).unwrap();
        client.post_send(&active, &buffers, 0, b"x", 7).unwrap();
        client.post_one_sided(&active, 8, 1 << 63 | 2).unwrap();
        let mut device = SimDeviceReader {
            node: pair.client.node.id(),
        };
        let mut tokens = Vec::new();
        while let Some(token) = client.next_cq_event(&mut device).unwrap() {
            tokens.push(token);
        }
        assert_eq!(
            tokens,
            [1, 1, 1],
            "one event per completion, the QP's token"
        );
        let done = sent(&mut client, &active);
        assert_eq!(
            statuses(&done),
            [
                (1 << 63 | 1, WcStatus::Success),
                (7, WcStatus::Success),
                (1 << 63 | 2, WcStatus::Success)
            ]
        );
        assert_eq!(done[0].byte_len, 4096);
        assert!(sent(&mut client, &active).is_empty(), "each completes once");
        assert!(!client.one_sided.waiting());
    }

    /// Work waiting to join its queue makes a wait return at once.
    #[test]
    fn waiting_work_ends_a_wait() {
        let caps = QueueCaps::default();
        let (pair, _server, mut client, _passive, active) = connected(&caps);
        pair.fabric.run_until_idle();
        let mut device = SimDeviceReader {
            node: pair.client.node.id(),
        };
        while client.next_cq_event(&mut device).unwrap().is_some() {}
        let before = pair.fabric.now();
        client.post_one_sided(&active, 1, 3).unwrap();
        assert_eq!(
            client.wait(std::slice::from_ref(&device), Some(Duration::from_secs(1))),
            Ok(true)
        );
        assert_eq!(pair.fabric.now(), before, "no virtual time went by");
        assert_eq!(client.next_cq_event(&mut device).unwrap(), Some(1));
    }

    /// A refused piece fails with a remote access error and puts the QP in the error
    /// state: the work and sends after it flush, and the send carries nothing.
    #[test]
    fn refused_work_fails_and_flushes_what_follows() {
        let caps = QueueCaps::default();
        let (pair, mut server, mut client, passive, active) = connected(&caps);
        let (server_buffers, client_buffers) = (
            server.register_buffers(&passive, &caps).unwrap(),
            client.register_buffers(&active, &caps).unwrap(),
        );
        server.post_recv(&passive, &server_buffers, 0, 0).unwrap();
        client.post_one_sided(&active, 16, 1).unwrap();
        client.post_one_sided_refused(&active, 16, 2).unwrap();
        client.post_one_sided(&active, 16, 3).unwrap();
        client
            .post_send(&active, &client_buffers, 0, b"x", 4)
            .unwrap();
        assert_eq!(
            statuses(&sent(&mut client, &active)),
            [
                (1, WcStatus::Success),
                (2, WcStatus::RemAccessErr),
                (3, WcStatus::WrFlushErr),
                (4, WcStatus::WrFlushErr)
            ]
        );
        pair.fabric.run_until_idle();
        let mut received = Vec::new();
        server
            .poll_cq(&passive, CqKind::Recv, &mut received, 8)
            .unwrap();
        assert!(received.is_empty(), "a flushed send carries nothing");
    }

    /// Work on a disconnected id's QP (in the error state) flushes.
    #[test]
    fn work_after_a_disconnect_flushes() {
        let caps = QueueCaps::default();
        let (_pair, _server, mut client, _passive, active) = connected(&caps);
        client.disconnect(&active).unwrap();
        client.post_one_sided(&active, 16, 9).unwrap();
        assert_eq!(
            statuses(&sent(&mut client, &active)),
            [(9, WcStatus::WrFlushErr)]
        );
    }

    /// Bad input is a typed error, and nothing completes for it.
    #[test]
    fn work_the_qp_cannot_take_is_refused() {
        let caps = QueueCaps::default();
        let (pair, mut server, mut client, passive, active) = connected(&caps);
        let no_qp = client.create_id().unwrap();
        assert!(matches!(
            client.post_one_sided(&no_qp, 1, 1),
            Err(CmError::InvalidArgument { reason, .. }) if reason == "the id has no QP"
        ));
        assert!(matches!(
            client.post_one_sided(&passive, 1, 1),
            Err(CmError::InvalidArgument { reason, .. })
                if reason == "the QP was not created by this transport"
        ));
        assert!(matches!(
            client.post_one_sided(&active, u32::MAX, 1),
            Err(CmError::InvalidArgument { .. })
        ));
        // A QP not connected yet.
        let device = server.open_device(&passive).unwrap();
        let idle = server.create_id().unwrap();
        server.bind(&idle, server.addr(100)).unwrap();
        server.create_qp(&idle, &device, 5, &caps).unwrap();
        assert!(matches!(
            server.post_one_sided(&idle, 1, 1),
            Err(CmError::Os { errno, .. }) if errno.0 == cm_core::errno::EINVAL
        ));
        // Another fabric's id.
        let other = SimPair::new(SimConfig::default(), 4);
        let foreign = SimTransport::on_side(other.client).create_id().unwrap();
        assert!(client.post_one_sided(&foreign, 1, 1).is_err());
        assert!(sent(&mut client, &active).is_empty());
        assert!(!client.one_sided.waiting());
        drop(pair);
    }

    /// Work of a QP destroyed before it joined the queue goes with the QP, and the
    /// QP's error state is forgotten.
    #[test]
    fn work_of_a_destroyed_qp_is_dropped() {
        let caps = QueueCaps::default();
        let (_pair, mut server, _client, passive, _active) = connected(&caps);
        let device = server.open_device(&passive).unwrap();
        server.post_one_sided_refused(&passive, 1, 1).unwrap();
        let qp = cm_core::CmId::qp_num(&passive).unwrap();
        assert!(server.one_sided.errored(qp));
        passive.destroy().unwrap();
        // The next QP created sweeps the destroyed ones.
        let again = server.create_id().unwrap();
        server.bind(&again, server.addr(101)).unwrap();
        server.create_qp(&again, &device, 6, &caps).unwrap();
        assert!(!server.one_sided.errored(qp));
        let mut device = SimDeviceReader {
            node: server.node.id(),
        };
        assert_eq!(server.next_cq_event(&mut device).unwrap(), None);
        assert!(!server.one_sided.waiting());
    }
}
