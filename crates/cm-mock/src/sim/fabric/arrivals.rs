//! The arrival counters that let a handle see, without the fabric's lock, whether its
//! channel or device may have something new.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::sim::types::NodeId;

/// Arrival counters: each counts what came to a channel (CM events, its close) or to
/// a node's device (asynchronous events, receive completions), bumped under the lock and
/// read without it, so that a reader that found its queue empty looks again only once
/// something came. Channels and nodes share the counters by index (modulo their half):
/// two that share one only look more often.
///
/// Beside them, the fabric's activity: a count moved by every arrival, every event or
/// completion taken and every action scheduled, read by the parties that share the
/// fabric in turn (connection handles' drivers) to tell whether anything happened
/// anywhere since they last looked. Virtual time charged for an application's setup
/// work moves it too: the clock jumped, and deadlines may have passed.
#[derive(Debug)]
pub(crate) struct Arrivals([AtomicU64; 2 * Arrivals::HALF], AtomicU64);

impl Default for Arrivals {
    fn default() -> Self {
        Arrivals(
            std::array::from_fn(|_| AtomicU64::new(0)),
            AtomicU64::new(0),
        )
    }
}

impl Arrivals {
    const HALF: usize = 32;

    /// The counter of `channel`.
    pub(crate) fn channel(&self, channel: usize) -> u64 {
        self.0[channel % Self::HALF].load(Ordering::Acquire)
    }

    /// The counter of `node`'s device.
    pub(crate) fn node(&self, node: NodeId) -> u64 {
        self.0[Self::HALF + node.0 as usize % Self::HALF].load(Ordering::Acquire)
    }

    /// The fabric's activity so far.
    pub(crate) fn activity(&self) -> u64 {
        self.1.load(Ordering::Acquire)
    }

    /// Something happened: called under the fabric's lock (no two bumps race).
    pub(super) fn bump_activity(&self) {
        self.1
            .store(self.1.load(Ordering::Relaxed) + 1, Ordering::Release);
    }

    /// Called under the fabric's lock (no two bumps race).
    pub(super) fn bump(&self, index: usize) {
        let counter = &self.0[index];
        counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Release);
        self.bump_activity();
    }

    pub(super) fn bump_channel(&self, channel: usize) {
        self.bump(channel % Self::HALF);
    }

    pub(super) fn bump_node(&self, node: NodeId) {
        self.bump(Self::HALF + node.0 as usize % Self::HALF);
    }
}
