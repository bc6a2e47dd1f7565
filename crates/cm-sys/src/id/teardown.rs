//! Tearing an id down: its QP, CQs and memory at once, under the channel's lock; the
//! id itself at once too, or, for a connection's id, on the reaper's thread (see
//! `crate::reaper`: the kernel may hold that destroy for up to a minute).

use std::ptr::NonNull;
use std::sync::{Arc, PoisonError, Weak};

use super::IdInner;
use crate::channel::ChannelInner;
use crate::ffi;

impl Drop for IdInner {
    fn drop(&mut self) {
        let raw = self.raw.as_ptr();
        // No event read on the channel may write into the id while its QP is torn down.
        // Never dropped under that lock: an event read drops what it cannot hand out only
        // after releasing it.
        let channel = Arc::clone(self.ops.get_mut().unwrap_or_else(PoisonError::into_inner));
        let fields = channel.fields_shared();
        // SAFETY: last owner: no other thread uses the id. Order matters: the QP first
        // (it references the memory regions and the CQs), then the regions (they
        // reference the device's PD, which the id keeps, or the shared queues' PD,
        // which `shared` keeps until after this body), then the id.
        unsafe {
            if !(*raw).qp.is_null() {
                ffi::rdma_destroy_qp(raw);
            }
        }
        // The CQs of create_qp_on, their QP gone: each acknowledges its outstanding
        // completion events and is destroyed.
        self.cqs
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let regions = self
            .regions
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for region in regions.drain(..) {
            // SAFETY: the QP that could use the region is destroyed; nothing else holds it.
            // A failed deregistration leaks the buffer (the device may still reach it);
            // a drop has nobody to report it to.
            let _ = unsafe { region.deregister() };
        }
        // SAFETY: reading our own context pointer of the live id.
        let context = unsafe { (*raw).context }.cast_const().cast::<IdInner>();
        let doomed = Doomed {
            raw: self.raw,
            context,
        };
        if *self.sent_cm_messages.get_mut() {
            // The kernel may hold this destroy for up to a minute (see `reaper`): not on
            // this thread. Events of the id read meanwhile find no owner and are acked at
            // once; librdmacm's destroy waits for those acks, not for our lock.
            drop(fields);
            crate::reaper::run_later(DestroyJob { doomed, channel });
        } else {
            doomed.destroy(Arc::clone(&channel));
            drop(fields);
        }
    }
}

/// A connection's id to destroy on the reaper's thread, with the channel it lived on
/// (kept open until the id is gone).
pub(crate) struct DestroyJob {
    doomed: Doomed,
    channel: Arc<ChannelInner>,
}

impl crate::reaper::Job for DestroyJob {
    fn run(self) {
        self.doomed.destroy(self.channel);
    }
}

/// An id whose QP and memory are gone, with its leaked context, to destroy.
struct Doomed {
    raw: NonNull<ffi::rdma_cm_id>,
    context: *const IdInner,
}

// SAFETY: the id has no owner left (its `IdInner` is being dropped); librdmacm's id calls
// may run on any thread, and the context pointer is only reclaimed, never read through.
unsafe impl Send for Doomed {}

impl Doomed {
    /// `rdma_destroy_id`, then the context reclaimed. `channel` is the id's: kept open
    /// until its id is gone.
    fn destroy(self, channel: Arc<ChannelInner>) {
        // SAFETY: every event of this id is acknowledged (each holds an owner, and there
        // is none left), so rdma_destroy_id cannot wait on one of ours; an event read
        // concurrently by another thread fails to upgrade and is acked at once.
        let ret = unsafe { ffi::rdma_destroy_id(self.raw.as_ptr()) };
        if ret == 0 && !self.context.is_null() {
            // SAFETY: the id is gone, so no event can name it any more: reclaim the Weak
            // leaked in IdInner::new.
            drop(unsafe { Weak::from_raw(self.context) });
        }
        drop(channel);
    }
}
