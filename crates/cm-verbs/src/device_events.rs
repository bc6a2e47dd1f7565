//! A device context's asynchronous events, shared by every endpoint of the process on
//! the device: what lets a server run one endpoint per core on one device.
//!
//! librdmacm opens one verbs context per device and every id on the device uses it; the
//! kernel queues the context's asynchronous events in one stream, and one read takes one
//! event, whoever reads. Two endpoints reading the stream each would each get part of
//! the other's events, and a COMM_EST read by the wrong one would never reach its
//! connection's CM. So the stream has one [`DeviceHub`] per device context in the
//! process, and each endpoint subscribes to it. Whichever subscriber reads the stream
//! routes every event it reads:
//!
//! - an event about an object (QP by number, CQ or SRQ by handle) goes to the
//!   subscriber that claimed it: an endpoint claims a QP when it makes or adopts it,
//!   before the QP takes part in a connection, and its shared queues when it makes
//!   them, so no event of an object can come before its claim. An object nobody
//!   claimed (a QP the application made and never handed to an endpoint, a
//!   connection's own CQ) goes to the oldest subscriber: what a lone endpoint sees;
//! - an event about the device or a port (device fatal, port down, GID change) goes to
//!   every subscriber.
//!
//! An event for another subscriber lands in its mailbox, raises its [`MailFlag`] and
//! wakes its wait (the waker it subscribed with). A subscriber takes its mailbox before
//! it reads the stream, and the stream is read under the hub's lock, so the events of
//! one object reach their owner in the kernel's order; a pass that does not read the
//! stream looks at the flag alone, without the lock. Events are acknowledged as they
//! are read (cm-sys), so a QP's destruction never waits for a subscriber to take its
//! mail.
//!
//! A mailbox holds at most [`MAILBOX_MAX`] events: its owner empties it on every pass,
//! and it only fills while its owner's thread is not driving it. Past the bound an
//! event is dropped and logged (a warning): the owner's connections are not
//! being driven then, a COMM_EST among them has the receive completion as a second
//! trigger, and the kernel's own event queue of a context has no bound either.

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::Waker;

use cm_core::{AsyncEvent, EventElement};
use rustc_hash::FxHashMap;

/// The most events one subscriber's mailbox holds.
pub(crate) const MAILBOX_MAX: usize = 1 << 16;

/// What an event is about, as a claim names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Object {
    /// A QP, by number.
    Qp(u32),
    /// A completion queue, by handle.
    Cq(u32),
    /// A shared receive queue, by handle.
    Srq(u32),
}

/// Where an event goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// One subscriber.
    To(u64),
    /// Every subscriber.
    Everyone,
}

/// Whether a subscriber's mailbox may hold mail: raised with each event posted and
/// lowered when the mailbox is emptied, both under the hub's lock; read without it, so
/// that a pass with nothing posted takes no lock. A post raises it before it wakes the
/// owner, so the pass after the wake-up sees it raised.
#[derive(Debug, Clone)]
pub(crate) struct MailFlag(Arc<crate::wake::sync::AtomicBool>);

impl MailFlag {
    fn new() -> Self {
        MailFlag(Arc::new(crate::wake::sync::AtomicBool::new(false)))
    }

    fn set(&self, raised: bool) {
        self.0.store(raised, crate::wake::sync::Ordering::Release);
    }

    /// Whether mail may be waiting.
    pub(crate) fn raised(&self) -> bool {
        self.0.load(crate::wake::sync::Ordering::Acquire)
    }
}

/// One subscriber: its number, its mailbox, its flag and how to wake it.
#[derive(Debug)]
struct Subscriber {
    id: u64,
    mailbox: VecDeque<AsyncEvent>,
    mail: MailFlag,
    waker: Waker,
}

/// The routing state of one device's events: the subscribers in the order they came,
/// and who claimed which object. Kept under the hub's lock.
#[derive(Debug, Default)]
pub(crate) struct Routes {
    subscribers: Vec<Subscriber>,
    /// Claimed objects (one per connection's QP): FxHash, as the endpoint's own tables,
    /// since a claim and a release come with every connection and the keys are the
    /// device's, not a peer's.
    owners: FxHashMap<Object, u64>,
    /// Events dropped at a full mailbox.
    dropped: u64,
}

impl Routes {
    /// Adds subscriber `id`, woken with `waker` when an event lands in its mailbox;
    /// the flag raised then.
    pub(crate) fn subscribe(&mut self, id: u64, waker: Waker) -> MailFlag {
        debug_assert!(self.subscribers.iter().all(|s| s.id != id));
        let mail = MailFlag::new();
        self.subscribers.push(Subscriber {
            id,
            mailbox: VecDeque::new(),
            mail: mail.clone(),
            waker,
        });
        mail
    }

    /// Removes subscriber `id`, its claims and its mail; how many subscribers are left.
    pub(crate) fn unsubscribe(&mut self, id: u64) -> usize {
        self.subscribers.retain(|s| s.id != id);
        self.owners.retain(|_, owner| *owner != id);
        self.subscribers.len()
    }

    /// Events about `object` go to `id` from now on (a claim replaces an older one: the
    /// kernel reuses a destroyed object's number).
    pub(crate) fn claim(&mut self, id: u64, object: Object) {
        self.owners.insert(object, id);
    }

    /// `id` is done with `object`; nothing if another subscriber claimed it since.
    pub(crate) fn release(&mut self, id: u64, object: Object) {
        if self.owners.get(&object) == Some(&id) {
            self.owners.remove(&object);
        }
    }

    /// The oldest event in `id`'s mailbox (its flag lowered once it is empty).
    pub(crate) fn take_mail(&mut self, id: u64) -> Option<AsyncEvent> {
        let subscriber = self.subscribers.iter_mut().find(|s| s.id == id)?;
        let event = subscriber.mailbox.pop_front();
        if subscriber.mailbox.is_empty() {
            subscriber.mail.set(false);
        }
        event
    }

    /// How many events were dropped at a full mailbox.
    #[cfg(test)]
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Routes `event`, read from the stream by subscriber `reader`: the event back when
    /// it is (also) the reader's, else `None` (it went to another's mailbox).
    pub(crate) fn deliver(&mut self, reader: u64, event: AsyncEvent) -> Option<AsyncEvent> {
        match self.route(&event) {
            Route::To(owner) if owner == reader => Some(event),
            Route::To(owner) => {
                self.post(owner, event);
                None
            }
            Route::Everyone => {
                for subscriber in self.subscribers.iter_mut().filter(|s| s.id != reader) {
                    Self::post_to(subscriber, &mut self.dropped, event);
                }
                Some(event)
            }
        }
    }

    fn route(&self, event: &AsyncEvent) -> Route {
        let object = match event.element {
            EventElement::Qp(qp) => Object::Qp(qp.0),
            EventElement::Cq(handle) => Object::Cq(handle),
            EventElement::Srq(handle) => Object::Srq(handle),
            // Work queues are never made here: the application's, like its own QPs.
            EventElement::Wq(_) => return self.oldest(),
            EventElement::Port(_) | EventElement::Unknown => return Route::Everyone,
        };
        match self.owners.get(&object) {
            Some(&owner) => Route::To(owner),
            None => self.oldest(),
        }
    }

    fn oldest(&self) -> Route {
        match self.subscribers.first() {
            Some(first) => Route::To(first.id),
            // Unreachable (the reader is a subscriber); everyone is no one.
            None => Route::Everyone,
        }
    }

    /// Puts `event` in `id`'s mailbox and wakes it.
    fn post(&mut self, id: u64, event: AsyncEvent) {
        if let Some(subscriber) = self.subscribers.iter_mut().find(|s| s.id == id) {
            Self::post_to(subscriber, &mut self.dropped, event);
        }
    }

    /// Puts `event` in `subscriber`'s mailbox and wakes it; past the bound, counts it
    /// in `dropped` instead.
    fn post_to(subscriber: &mut Subscriber, dropped: &mut u64, event: AsyncEvent) {
        if subscriber.mailbox.len() >= MAILBOX_MAX {
            *dropped += 1;
            let id = subscriber.id;
            tracing::warn!("{event}: dropped, the mailbox of endpoint {id} is full");
            return;
        }
        subscriber.mailbox.push_back(event);
        subscriber.mail.set(true);
        subscriber.waker.wake_by_ref();
    }
}

#[cfg(feature = "rdma")]
pub(crate) use hub::{hub_of, DeviceHub};

/// The hubs of the real backend, one per device context in the process.
#[cfg(feature = "rdma")]
mod hub {
    use std::os::fd::{AsFd, BorrowedFd};
    use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

    use cm_core::{AsyncEvent, CmError};
    use cm_sys::AsyncEvents;

    use super::{MailFlag, Object, Routes};

    /// One device context's event stream and its routes.
    #[derive(Debug)]
    pub(crate) struct DeviceHub {
        /// Read only under `routes`' lock (so one object's events keep their order);
        /// its descriptor is waited on without it.
        events: AsyncEvents,
        routes: Mutex<Routes>,
    }

    /// The hubs alive in the process.
    static HUBS: Mutex<Vec<Weak<DeviceHub>>> = Mutex::new(Vec::new());

    /// The hub of `events`' device context: the one alive in the process, or a new one
    /// reading `events` (made non-blocking).
    pub(crate) fn hub_of(events: AsyncEvents) -> Result<Arc<DeviceHub>, CmError> {
        let key = events.device_key();
        let mut hubs = HUBS.lock().unwrap_or_else(PoisonError::into_inner);
        hubs.retain(|hub| hub.strong_count() > 0);
        let mut alive = hubs.iter().filter_map(Weak::upgrade);
        if let Some(hub) = alive.find(|h| h.events.device_key() == key) {
            return Ok(hub);
        }
        events.set_nonblocking(true)?;
        let hub = Arc::new(DeviceHub {
            events,
            routes: Mutex::new(Routes::default()),
        });
        hubs.push(Arc::downgrade(&hub));
        Ok(hub)
    }

    impl DeviceHub {
        fn routes(&self) -> MutexGuard<'_, Routes> {
            self.routes.lock().unwrap_or_else(PoisonError::into_inner)
        }

        /// The stream's descriptor: readable when the kernel has an event queued.
        pub(crate) fn fd(&self) -> BorrowedFd<'_> {
            self.events.as_fd()
        }

        /// The device's serial number in the process (`AsyncEvents::device_serial`).
        pub(crate) fn serial(&self) -> u64 {
            self.events.device_serial()
        }

        /// The device's name.
        pub(crate) fn name(&self) -> String {
            self.events.device_name()
        }

        /// Adds subscriber `id` (see [`Routes::subscribe`]).
        pub(crate) fn subscribe(&self, id: u64, waker: std::task::Waker) -> MailFlag {
            self.routes().subscribe(id, waker)
        }

        /// Removes subscriber `id` with its claims and mail.
        pub(crate) fn unsubscribe(&self, id: u64) {
            self.routes().unsubscribe(id);
        }

        /// See [`Routes::claim`].
        pub(crate) fn claim(&self, id: u64, object: Object) {
            self.routes().claim(id, object);
        }

        /// See [`Routes::release`].
        pub(crate) fn release(&self, id: u64, object: Object) {
            self.routes().release(id, object);
        }

        /// Subscriber `id`'s next event: from its mailbox (`mail`, its flag), else
        /// from the stream when `read_stream` (the last wait did not find the stream
        /// idle), routing what belongs to others on the way. Never waits; takes the
        /// lock only when the flag is raised or the stream is to be read.
        pub(crate) fn next_for(
            &self,
            id: u64,
            mail: &MailFlag,
            read_stream: bool,
        ) -> Result<Option<AsyncEvent>, CmError> {
            if !read_stream && !mail.raised() {
                return Ok(None);
            }
            let mut routes = self.routes();
            if let Some(event) = routes.take_mail(id) {
                return Ok(Some(event));
            }
            if !read_stream {
                return Ok(None);
            }
            while let Some(event) = self.events.try_next_event()? {
                if let Some(mine) = routes.deliver(id, event) {
                    return Ok(Some(mine));
                }
            }
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    use cm_core::{AsyncEventType, QpNum};

    use super::*;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn two() -> (Routes, Arc<Count>, Arc<Count>) {
        let (a, b) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let mut routes = Routes::default();
        routes.subscribe(1, Waker::from(Arc::clone(&a)));
        routes.subscribe(2, Waker::from(Arc::clone(&b)));
        (routes, a, b)
    }

    fn comm_est(qp: u32) -> AsyncEvent {
        AsyncEvent::qp(AsyncEventType::CommEst, QpNum(qp))
    }

    #[test]
    fn a_qp_event_reaches_its_owner_whoever_reads_it() {
        let (mut routes, a, b) = two();
        routes.claim(2, Object::Qp(7));
        assert_eq!(routes.deliver(1, comm_est(7)), None, "not the reader's");
        assert_eq!(b.0.load(Ordering::SeqCst), 1, "the owner is woken");
        assert_eq!(a.0.load(Ordering::SeqCst), 0);
        assert_eq!(routes.take_mail(1), None);
        assert_eq!(routes.take_mail(2), Some(comm_est(7)));
        assert_eq!(routes.deliver(2, comm_est(7)), Some(comm_est(7)), "its own");
        assert_eq!(routes.take_mail(2), None);
    }

    #[test]
    fn the_mail_flag_is_raised_by_a_post_and_lowered_once_the_mailbox_is_empty() {
        let mut routes = Routes::default();
        routes.subscribe(1, Waker::noop().clone());
        let mail = routes.subscribe(2, Waker::noop().clone());
        routes.claim(2, Object::Qp(7));
        assert!(!mail.raised());
        routes.deliver(1, comm_est(7));
        routes.deliver(1, comm_est(7));
        assert!(mail.raised());
        assert_eq!(routes.take_mail(2), Some(comm_est(7)));
        assert!(mail.raised(), "one left");
        assert_eq!(routes.take_mail(2), Some(comm_est(7)));
        assert!(!mail.raised(), "emptied");
        assert_eq!(routes.deliver(2, comm_est(7)), Some(comm_est(7)));
        assert!(!mail.raised(), "its own read: nothing posted");
    }

    #[test]
    fn events_of_one_qp_keep_their_order_in_the_mailbox() {
        let (mut routes, _, _) = two();
        routes.claim(2, Object::Qp(7));
        let fatal = AsyncEvent::qp(AsyncEventType::QpFatal, QpNum(7));
        routes.deliver(1, comm_est(7));
        routes.deliver(1, fatal);
        assert_eq!(routes.take_mail(2), Some(comm_est(7)));
        assert_eq!(routes.take_mail(2), Some(fatal));
    }

    #[test]
    fn device_events_reach_everyone_once() {
        let (mut routes, a, b) = two();
        let port_down = AsyncEvent {
            event_type: AsyncEventType::PortErr,
            element: EventElement::Port(1),
        };
        assert_eq!(routes.deliver(1, port_down), Some(port_down));
        assert_eq!(routes.take_mail(1), None, "the reader has it already");
        assert_eq!(routes.take_mail(2), Some(port_down));
        assert_eq!(
            (a.0.load(Ordering::SeqCst), b.0.load(Ordering::SeqCst)),
            (0, 1)
        );
    }

    #[test]
    fn unclaimed_objects_go_to_the_oldest_and_claims_end_with_their_subscriber() {
        let (mut routes, _, _) = two();
        assert_eq!(routes.deliver(2, comm_est(9)), None);
        assert_eq!(
            routes.take_mail(1),
            Some(comm_est(9)),
            "nobody's: the oldest"
        );
        routes.claim(1, Object::Srq(3));
        let limit = AsyncEvent {
            event_type: AsyncEventType::SrqLimitReached,
            element: EventElement::Srq(3),
        };
        assert_eq!(routes.deliver(2, limit), None);
        assert_eq!(routes.take_mail(1), Some(limit));
        // The oldest leaves: its claims and mail go with it, the next is the oldest.
        routes.deliver(2, limit);
        assert_eq!(routes.unsubscribe(1), 1);
        assert_eq!(routes.deliver(2, limit), Some(limit));
        assert_eq!(routes.take_mail(1), None);
    }

    #[test]
    fn a_release_leaves_a_newer_claim_alone() {
        let (mut routes, _, _) = two();
        routes.claim(1, Object::Qp(5));
        routes.claim(2, Object::Qp(5)); // the number reused by the other endpoint
        routes.release(1, Object::Qp(5));
        assert_eq!(routes.deliver(1, comm_est(5)), None);
        assert_eq!(routes.take_mail(2), Some(comm_est(5)));
        routes.release(2, Object::Qp(5));
        assert_eq!(
            routes.deliver(2, comm_est(5)),
            None,
            "unclaimed: the oldest's"
        );
    }

    #[test]
    fn a_full_mailbox_drops_and_counts() {
        let (mut routes, _, b) = two();
        routes.claim(2, Object::Qp(7));
        for _ in 0..MAILBOX_MAX + 3 {
            routes.deliver(1, comm_est(7));
        }
        assert_eq!(routes.dropped(), 3);
        assert_eq!(b.0.load(Ordering::SeqCst), MAILBOX_MAX);
        let mut n = 0;
        while routes.take_mail(2).is_some() {
            n += 1;
        }
        assert_eq!(n, MAILBOX_MAX);
    }
}
