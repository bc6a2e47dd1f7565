//! Safe RAII owners over librdmacm and libibverbs (through `rdma-sys`) implementing the
//! `cm-core` traits: the real backend of the notify path.
//!
//! - [`EventChannel`]: an `rdma_event_channel`; blocking or not, pollable ([`AsFd`]),
//!   creates [`CmId`]s, yields [`CmEvent`]s. No RDMA device: [`EventChannel::new`] is
//!   [`CmError::NoDevice`], never a panic.
//! - [`CmId`]: an `rdma_cm_id`; cheap clones share it (the notify pump holds one), it is
//!   destroyed with the last clone and the last event about it. [`CmId::notify`] is
//!   `rdma_notify` mapped to the cm-core contract (EISCONN is success).
//! - [`CmEvent`]: acknowledged exactly once, explicitly or on drop; holds its id, so no
//!   `rdma_destroy_id` ever waits on an unacknowledged event of ours.
//! - [`AsyncEvents`]: the device's verbs asynchronous events, copied and acknowledged at
//!   once, decoded from the raw integer (values newer than the headers, such as
//!   DEVICE_SPEED_CHANGE, are not undefined behaviour).
//! - A minimal data path ([`CmId::create_qp`], [`CmId::register_memory`],
//!   [`CmId::post_send`], [`CmId::post_recv`], [`CmId::poll_recv_cq`]) for tests and
//!   benches.
//! - [`CompletionChannel`]: a device's completion channel (non-blocking, pollable);
//!   [`CmId::create_qp_on`] puts a QP's CQs on it with a token, [`CmId::arm_cq`] and
//!   [`CmId::poll_cq`] complete the wait → re-arm → poll pattern; [`DeviceKey`] tells
//!   devices apart.
//! - [`SharedQueues`]: queues every connection on a device context may share (a PD of
//!   their own, an SRQ, one registered buffer pool, a send and a receive CQ on a
//!   completion channel); [`CmId::create_qp_shared`] puts an id's QP on them,
//!   [`CmId::post_shared_send`] sends from the pool. Each such id keeps them alive.
//! - Thread safety: reading a CM event (which makes librdmacm write into the event's
//!   id) holds its channel's lock exclusively; every id call holds it shared;
//!   [`CmId::notify`] takes no lock.
//! - Destroying: a connection's id (one that sent a REQ or a REP) is destroyed on a
//!   thread of its own, since the kernel may hold `rdma_destroy_id` for up to a minute
//!   while a CM message of the id is outstanding; [`pending_destroys`] counts those not
//!   done yet.
//! - [`DeviceMonitor`]: the kernel's announcements of an RDMA device's removal, for a
//!   process that holds no id on the device (librdmacm still holds its context open).
//! - [`poll_readable`]: waits on several descriptors at once (a channel, a device's
//!   asynchronous events, a wake-up descriptor) for event loops.
//! - [`RdmaBackend`] ties the types to [`cm_core::CmBackend`].
//!
//! Errors are cm-core's [`CmError`] and [`NotifyError`], errno kept.
//!
//! # Example: a passive server forwarding COMM_EST by hand
//!
//! ```no_run
//! use std::time::Duration;
//! use cm_core::{AsyncEventType, CmEventType, NotifyOutcome};
//! use cm_sys::{CmId, ConnParams, EventChannel, QpCaps};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let channel = EventChannel::new()?;
//! let listener = channel.create_id()?;
//! listener.bind_addr("10.77.1.1:7471".parse()?)?;
//! listener.listen(8)?;
//!
//! // Wait for a connection request and accept it on a fresh QP.
//! let conn: CmId = loop {
//!     let event = channel.next_event()?;
//!     if event.event_type() == CmEventType::ConnectRequest {
//!         let id = event.id().expect("a request carries its new id").clone();
//!         event.ack()?;
//!         id.create_qp(&QpCaps::default())?;
//!         id.accept(&ConnParams::default())?;
//!         break id;
//!     }
//! };
//!
//! // The REP is sent. If data arrives before the RTU, the device raises COMM_EST:
//! // forward it to the CM, which then reports ESTABLISHED exactly once.
//! let device = conn.async_events()?;
//! device.set_nonblocking(true)?;
//! loop {
//!     while let Some(async_event) = device.try_next_event()? {
//!         if async_event.event_type == AsyncEventType::CommEst
//!             && async_event.qp_num() == conn.qp_num()
//!         {
//!             match conn.notify(AsyncEventType::CommEst)? {
//!                 NotifyOutcome::Established => println!("forced to ESTABLISHED"),
//!                 NotifyOutcome::AlreadyEstablished => println!("the RTU won the race"),
//!             }
//!         }
//!     }
//!     if let Some(event) = channel.next_event_timeout(Duration::from_millis(10))? {
//!         if event.event_type() == CmEventType::Established {
//!             break;
//!         }
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! [`AsFd`]: std::os::fd::AsFd
//! [`CmError`]: cm_core::CmError
//! [`CmError::NoDevice`]: cm_core::CmError::NoDevice
//! [`NotifyError`]: cm_core::NotifyError

mod channel;
mod clock;
mod counters;
mod cq;
mod device;
mod event;
mod ffi;
mod id;
mod monitor;
mod poll;
mod ready_qps;
mod reaper;
mod shared;
#[cfg(feature = "tokio")]
mod tokio_fd;
mod verbs;

pub use channel::EventChannel;
pub use clock::monotonic_now;
pub use counters::PortCounters;
pub use cq::{CompletionChannel, CqKind, DeviceKey};
pub use device::{refresh_devices, AsyncEvents};
pub use event::CmEvent;
pub use ffi::{libibverbs_event_str, librdmacm_event_str};
pub use id::{BorrowedRegion, CmId, ConnParams, QpAttributes, QpState};
pub use monitor::DeviceMonitor;
pub use poll::{poll_readable, ReadySet};
pub use ready_qps::ReadyQpStats;
pub use reaper::pending_destroys;
pub use shared::SharedQueues;
#[cfg(feature = "tokio")]
pub use tokio_fd::{async_device_events, async_event_channel, async_owned_fd};
pub use verbs::{Completion, MemoryRegion, QpCaps, RemoteMemory};

/// The real librdmacm/libibverbs backend, for code generic over [`cm_core::CmBackend`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RdmaBackend;

impl cm_core::CmBackend for RdmaBackend {
    type Id = CmId;
    type Event = CmEvent;
    type Events = EventChannel;
    type AsyncEvents = AsyncEvents;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}

    #[test]
    fn handles_can_cross_to_an_event_loop_thread() {
        assert_send_sync::<CmId>();
        assert_send_sync::<EventChannel>();
        assert_send::<CmEvent>();
        assert_send::<AsyncEvents>();
        assert_send_sync::<CompletionChannel>();
        assert_send_sync::<SharedQueues>();
    }
}
