//! The fabric's count of registered memory: bytes of per-connection buffers
//! ([`SimBuffers`](super::SimBuffers)) and of shared pools ([`SimShared`](super::SimShared))
//! registered now and at peak, for a test that compares memory per connection of the
//! two modes. Atomics beside the fabric's lock: a buffer area given back when its owner
//! drops it takes no lock.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::sim::SimStats;

/// Bytes registered now and the most ever at once, of one kind of memory.
#[derive(Debug, Default)]
struct Gauge {
    now: AtomicU64,
    peak: AtomicU64,
}

impl Gauge {
    fn add(&self, bytes: u64) {
        let now = self.now.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, bytes: u64) {
        self.now.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn read(&self) -> (u64, u64) {
        (
            self.now.load(Ordering::Relaxed),
            self.peak.load(Ordering::Relaxed),
        )
    }
}

/// Registered memory of one fabric, per kind (summed over its nodes).
#[derive(Debug, Default)]
pub(crate) struct Registered {
    buffers: Gauge,
    pools: Gauge,
}

impl Registered {
    /// A connection's buffer area of `bytes` was registered.
    pub(super) fn add_buffers(&self, bytes: u64) {
        self.buffers.add(bytes);
    }

    /// A connection's buffer area of `bytes` was given back.
    pub(super) fn sub_buffers(&self, bytes: u64) {
        self.buffers.sub(bytes);
    }

    /// A shared pool of `bytes` was registered.
    pub(super) fn add_pool(&self, bytes: u64) {
        self.pools.add(bytes);
    }

    /// A shared pool of `bytes` was given back.
    pub(super) fn sub_pool(&self, bytes: u64) {
        self.pools.sub(bytes);
    }

    /// Copies the figures into `stats`.
    pub(crate) fn fill(&self, stats: &mut SimStats) {
        (stats.registered_buffers, stats.registered_buffers_peak) = self.buffers.read();
        (stats.registered_pools, stats.registered_pools_peak) = self.pools.read();
    }
}
