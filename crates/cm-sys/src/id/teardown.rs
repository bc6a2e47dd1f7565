//! Tearing an id down: its QP, CQs, memory and the id itself. A connection's id goes on
//! the reaper's thread, all of it (see `crate::reaper`: the kernel may hold the id's
//! destroy for up to a minute, and destroying its QP is work a disconnect's reply need
//! not wait for); any other id goes at once.

use std::ptr::NonNull;
use std::sync::{Arc, OnceLock, PoisonError, Weak};

use super::IdInner;
use crate::channel::ChannelInner;
use crate::cq::OwnedCq;
use crate::ffi;
use crate::shared::SharedCore;
use crate::verbs::RegisteredMemory;

impl Drop for IdInner {
    fn drop(&mut self) {
        let channel = Arc::clone(self.ops.get_mut().unwrap_or_else(PoisonError::into_inner));
        // SAFETY: reading our own context pointer of the live id.
        let context = unsafe { (*self.raw.as_ptr()).context }
            .cast_const()
            .cast::<IdInner>();
        let teardown = Teardown {
            raw: self.raw,
            context,
            cqs: std::mem::take(self.cqs.get_mut().unwrap_or_else(PoisonError::into_inner)),
            regions: std::mem::take(
                self.regions
                    .get_mut()
                    .unwrap_or_else(PoisonError::into_inner),
            ),
            shared: OnceLock::take(&mut self.shared),
        };
        if *self.sent_cm_messages.get_mut() {
            // Off this thread: the kernel may hold the id's destroy for up to a minute
            // (see `reaper`), and the thread that dropped a connection is usually the one
            // reading the channel's events, the next DREQ's reply among them. Events of
            // the id read meanwhile find no owner and are acked at once; librdmacm's
            // destroy waits for those acks, not for our lock.
            crate::reaper::run_later(DestroyJob { teardown, channel });
        } else {
            teardown.run(channel);
        }
    }
}

/// A connection's id to destroy on the reaper's thread, with the channel it lived on
/// (kept open until the id is gone).
pub(crate) struct DestroyJob {
    teardown: Teardown,
    channel: Arc<ChannelInner>,
}

impl crate::reaper::Job for DestroyJob {
    fn run(self) {
        self.teardown.run(self.channel);
    }
}

/// What an id owned, its owner gone: the id with its leaked context, the CQs and memory
/// of its QP, and the shared queues its QP is on.
struct Teardown {
    raw: NonNull<ffi::rdma_cm_id>,
    context: *const IdInner,
    cqs: Vec<OwnedCq>,
    regions: Vec<RegisteredMemory>,
    shared: Option<Arc<SharedCore>>,
}

// SAFETY: the id has no owner left (its `IdInner` is being dropped), so nothing else
// touches it, its QP, CQs or memory; librdmacm's and libibverbs' destroy calls may run on
// any thread, and the context pointer is only reclaimed, never read through.
unsafe impl Send for Teardown {}

impl Teardown {
    /// Destroys it all, in the order the objects reference each other: the QP (it
    /// references the memory regions and the CQs), its CQs, its memory (on the id's PD,
    /// or the shared queues' PD), the id, then the shared queues. `channel` is the
    /// id's: kept open until its id is gone.
    fn run(mut self, channel: Arc<ChannelInner>) {
        self.destroy_qp(&channel);
        // The CQs of create_qp_on, their QP gone: each acknowledges its outstanding
        // completion events and is destroyed.
        self.cqs.clear();
        for region in self.regions.drain(..) {
            // SAFETY: the QP that could use the region is destroyed; nothing else holds it.
            // A failed deregistration leaks the buffer (the device may still reach it);
            // a teardown has nobody to report it to.
            let _ = unsafe { region.deregister() };
        }
        // SAFETY: every event of this id is acknowledged (each holds an owner, and there
        // is none left), so rdma_destroy_id cannot wait on one of ours; an event read
        // concurrently by another thread fails to upgrade and is acked at once.
        let ret = unsafe { ffi::rdma_destroy_id(self.raw.as_ptr()) };
        if ret == 0 && !self.context.is_null() {
            // SAFETY: the id is gone, so no event can name it any more: reclaim the Weak
            // leaked in IdInner::new.
            drop(unsafe { Weak::from_raw(self.context) });
        }
        drop(self.shared);
        drop(channel);
    }

    /// `rdma_destroy_qp`, if the id has a QP, under the channel's `fields` lock: no event
    /// read on the channel may write into the id (librdmacm works on `id->qp` for a
    /// reply or a reject) while its QP is torn down.
    fn destroy_qp(&self, channel: &ChannelInner) {
        let raw = self.raw.as_ptr();
        let _fields = channel.fields_shared();
        // SAFETY: no owner is left, so no other thread calls on the id; an event read
        // that could touch `qp` waits for the lock held above.
        unsafe {
            if !(*raw).qp.is_null() {
                ffi::rdma_destroy_qp(raw);
            }
        }
    }
}
