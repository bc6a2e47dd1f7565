//! QPs made ahead of requests on a device context's shared queues
//! ([`SharedCaps::ready_qps`]): creating a QP (`ibv_create_qp`) is a part of an accept
//! that depends on nothing in the request (measured in the soft-RoCE VM under TCG: about
//! 0.22 ms of the 1.6 ms from reading a request to `rdma_accept` returning). So a thread
//! of the queues' own keeps a few QPs made, and
//! an accept (or a connect) takes one ([`CmId::create_qp_shared`](crate::CmId::create_qp_shared)),
//! moves it to INIT for its id as librdmacm would, and answers the REQ sooner.
//!
//! The pool starts when told the connections' send depth
//! ([`SharedQueues::prepare_ready`](crate::SharedQueues::prepare_ready), which a
//! listener calls as it starts listening), or else with the first QP asked of the
//! queues (its depth learned then); only QPs of that depth are made ahead, others are
//! made on the request. It refills as QPs are taken. It switches itself off, for good,
//! where a QP made ahead would differ from one librdmacm makes on the request: on a
//! device that negotiates ECE (librdmacm sets the peer's ECE options on a QP it makes
//! for a request, through state an application cannot reach), or when the device
//! refuses a QP.
//!
//! Lifetimes: the thread holds the queues' core until it has destroyed every QP it
//! still has; dropping the pool (with its [`SharedQueues`](crate::SharedQueues)) stops
//! the thread and waits for it, at most one QP creation.

use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use cm_core::CmError;

use crate::cq::CqKind;
use crate::ffi;
use crate::shared::SharedCore;

/// A QP made ahead, in RESET state, on the shared queues; destroyed on drop unless
/// handed to an id ([`ReadyQp::into_raw`]).
pub(crate) struct ReadyQp(NonNull<ffi::ibv_qp>);

// SAFETY: a QP is used from one thread at a time (the pool's lock, then its new owner),
// and libibverbs calls on a QP are thread safe.
unsafe impl Send for ReadyQp {}

impl ReadyQp {
    /// Makes an RC QP on `core` with `max_send_wr` send work requests, its receives from
    /// the SRQ, every send signalled: the QP `CmId::create_qp_shared` asks librdmacm for.
    fn create(core: &SharedCore, max_send_wr: u32) -> Result<ReadyQp, CmError> {
        // SAFETY: ibv_qp_init_attr is integers and pointers; all zeroes is valid.
        let mut attr: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = core.cq(CqKind::Send);
        attr.recv_cq = core.cq(CqKind::Recv);
        attr.srq = core.srq();
        attr.cap.max_send_wr = max_send_wr;
        attr.cap.max_send_sge = 1;
        attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 1;
        // SAFETY: the PD, CQs and SRQ are the core's, live while the caller holds it;
        // `attr` is valid for the call.
        let qp = unsafe { ffi::ibv_create_qp(core.pd(), &mut attr) };
        NonNull::new(qp)
            .map(ReadyQp)
            .ok_or_else(|| CmError::from_errno("ibv_create_qp", ffi::last_errno()))
    }

    /// Whether the device negotiates ECE on this QP (`ibv_query_ece` answers).
    fn negotiates_ece(&self) -> bool {
        // SAFETY: ibv_ece is three integers; all zeroes is valid.
        let mut ece: ffi::ibv_ece = unsafe { std::mem::zeroed() };
        // SAFETY: live QP; `ece` valid for the call.
        unsafe { ffi::ibv_query_ece(self.0.as_ptr(), &mut ece) == 0 }
    }

    /// The QP, still the pool's to destroy.
    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_qp {
        self.0.as_ptr()
    }

    /// The QP, for an owner that destroys it (an id, through `rdma_destroy_qp`).
    pub(crate) fn into_raw(self) -> NonNull<ffi::ibv_qp> {
        let qp = self.0;
        std::mem::forget(self);
        qp
    }
}

impl Drop for ReadyQp {
    fn drop(&mut self) {
        // SAFETY: a live QP nobody else holds. A failure leaves the QP to the device
        // context's close; a drop has nobody to report it to.
        let _ = unsafe { ffi::ibv_destroy_qp(self.0.as_ptr()) };
    }
}

/// What the pool holds and has done, under its lock.
#[derive(Default)]
struct Stock {
    ready: Vec<ReadyQp>,
    /// The send depth of the QPs made ahead, once a first QP was asked for.
    max_send_wr: Option<u32>,
    /// Why the pool is off for good, if it is.
    off: Option<&'static str>,
    /// The device's answer that switched it off, if one did.
    refused: Option<CmError>,
    stop: bool,
    taken: u64,
}

/// The pool's state, shared with its thread. Fields drop in declaration order: the
/// QPs left go before the core they are on.
struct State {
    stock: Mutex<Stock>,
    refill: Condvar,
    target: usize,
    core: Arc<SharedCore>,
}

impl State {
    fn stock(&self) -> MutexGuard<'_, Stock> {
        self.stock.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The thread: makes QPs while fewer than `target` are ready, waits otherwise;
    /// returns on stop or when the pool goes off, destroying what it holds.
    fn run(&self) {
        let mut first = true;
        loop {
            let max_send_wr = {
                let mut stock = self.stock();
                loop {
                    if stock.stop || stock.off.is_some() {
                        drop(std::mem::take(&mut stock.ready));
                        return;
                    }
                    if let Some(depth) = stock
                        .max_send_wr
                        .filter(|_| stock.ready.len() < self.target)
                    {
                        break depth;
                    }
                    stock = self
                        .refill
                        .wait(stock)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            };
            // Made outside the lock: an accept taking a ready QP never waits for one.
            let made = ReadyQp::create(&self.core, max_send_wr);
            let mut stock = self.stock();
            match made {
                Ok(qp) if first && qp.negotiates_ece() => {
                    stock.off = Some("the device negotiates ECE on the request's QP");
                }
                Ok(qp) => stock.ready.push(qp),
                Err(error) => {
                    stock.off = Some("the device refused a QP made ahead");
                    stock.refused = Some(error);
                }
            }
            first = false;
        }
    }
}

/// The QPs made ahead of requests on one set of shared queues (see the module docs).
pub(crate) struct ReadyQps {
    state: Arc<State>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What a pool of QPs made ahead did, for tests and reports.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadyQpStats {
    /// QPs ready now.
    pub ready: usize,
    /// QPs connections took from the pool so far (accepted or connecting).
    pub taken: u64,
    /// Why the pool is off for good, if it is.
    pub off: Option<&'static str>,
    /// The error that switched it off, if one did.
    pub refused: Option<CmError>,
}

impl ReadyQps {
    /// A pool of `target` QPs on `core`, not started (0: never starts).
    pub(crate) fn new(core: &Arc<SharedCore>, target: u32) -> ReadyQps {
        ReadyQps {
            state: Arc::new(State {
                stock: Mutex::new(Stock::default()),
                refill: Condvar::new(),
                target: target as usize,
                core: Arc::clone(core),
            }),
            thread: Mutex::new(None),
        }
    }

    /// A ready QP of `max_send_wr` send work requests, if one is made; the first call
    /// starts the pool with that depth.
    pub(crate) fn take(&self, max_send_wr: u32) -> Option<ReadyQp> {
        if self.state.target == 0 {
            return None;
        }
        let mut stock = self.state.stock();
        if stock.off.is_some() {
            return None;
        }
        match stock.max_send_wr {
            Some(depth) if depth == max_send_wr => {}
            Some(_) => return None,
            None => {
                drop(stock);
                self.begin(max_send_wr);
                return None;
            }
        }
        let qp = stock.ready.pop()?;
        stock.taken += 1;
        // Woken after the lock is released: woken under it, the thread would spin on
        // the lock this accept still holds.
        drop(stock);
        self.state.refill.notify_one();
        Some(qp)
    }

    /// Starts the pool at `max_send_wr` if it has not started (nor been switched off).
    pub(crate) fn begin(&self, max_send_wr: u32) {
        if self.state.target == 0 {
            return;
        }
        let mut stock = self.state.stock();
        if stock.off.is_some() || stock.max_send_wr.is_some() {
            return;
        }
        stock.max_send_wr = Some(max_send_wr);
        drop(stock);
        self.start();
    }

    fn start(&self) {
        let state = Arc::clone(&self.state);
        let spawned = std::thread::Builder::new()
            .name("cm-ready-qps".into())
            .spawn(move || state.run());
        match spawned {
            Ok(thread) => {
                *self.thread.lock().unwrap_or_else(PoisonError::into_inner) = Some(thread);
            }
            Err(error) => {
                let mut stock = self.state.stock();
                stock.off = Some("no thread to make QPs ahead");
                stock.refused = Some(CmError::from_errno(
                    "pthread_create",
                    error.raw_os_error().unwrap_or(libc::EAGAIN),
                ));
            }
        }
    }

    /// What the pool did so far.
    pub(crate) fn stats(&self) -> ReadyQpStats {
        let stock = self.state.stock();
        ReadyQpStats {
            ready: stock.ready.len(),
            taken: stock.taken,
            off: stock.off,
            refused: stock.refused.clone(),
        }
    }
}

impl Drop for ReadyQps {
    fn drop(&mut self) {
        self.state.stock().stop = true;
        self.state.refill.notify_all();
        let thread = self
            .thread
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = thread {
            // The thread only makes and destroys QPs: it ends within one creation.
            let _ = thread.join();
        }
    }
}
