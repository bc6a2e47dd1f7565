//! Stress test of the event loop on its own thread (cm-verbs' `EventLoop::run` over the
//! `poll(2)` waiter) while the application thread feeds it events and then stops it
//! with a `Shutdown` handle: no event is lost or handled twice, every registered QP is
//! forced exactly once, every CM event is acknowledged, and every run ends with
//! `Exit::Shutdown`. Many rounds, varied sizes, concurrent shutdown requests.
//!
//! Needs the `rdma` feature (the waiter lives in `cm_verbs::rdma`), but no device: the
//! sources are socket pairs. Run: `cargo test -p cm-tools --features rdma --test
//! event_loop_threads`. (A loom-free stress test; it also runs under ThreadSanitizer.)
#![cfg(feature = "rdma")]

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread;

use cm_core::{
    AsyncEvent, AsyncEventSource, AsyncEventType, CmError, CmEvent, CmEventSource, CmEventType,
    CmId, NotifyError, NotifyOutcome, QpNum,
};
use cm_verbs::rdma::PollWaiter;
use cm_verbs::{Control, EventLoop, Exit, LoopEvent, NotifyPump, PumpEvent, Role};

/// A source fed by another thread: the item goes into a queue, then one byte into a
/// socket so that `poll(2)` sees the source readable.
struct Fed<T> {
    items: Receiver<T>,
    readable: UnixStream,
}

/// The feeding end of a [`Fed`] source.
struct Feeder<T> {
    items: Sender<T>,
    wake: UnixStream,
}

fn fed<T>() -> (Feeder<T>, Fed<T>) {
    let (wake, readable) = UnixStream::pair().expect("a socket pair");
    readable.set_nonblocking(true).expect("O_NONBLOCK");
    let (items, queue) = channel();
    (
        Feeder { items, wake },
        Fed {
            items: queue,
            readable,
        },
    )
}

impl<T> Feeder<T> {
    fn feed(&mut self, item: T) {
        // The item first: a byte read by the loop always has its item queued already.
        self.items.send(item).expect("the loop's source is alive");
        self.wake.write_all(&[1]).expect("wake the loop");
    }
}

impl<T> Fed<T> {
    fn next(&mut self) -> Option<T> {
        // Bytes first, then the queue: every byte consumed has its item queued.
        let mut sink = [0u8; 64];
        loop {
            match self.readable.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => panic!("reading the wake socket: {e}"),
            }
        }
        self.items.try_recv().ok()
    }
}

impl<T> AsFd for Fed<T> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.readable.as_fd()
    }
}

/// A CM event that counts its acknowledgement.
#[derive(Debug)]
struct CountedEvent {
    acked: Arc<AtomicUsize>,
}

impl CmEvent for CountedEvent {
    fn event_type(&self) -> CmEventType {
        CmEventType::AddrResolved
    }
    fn status(&self) -> i32 {
        0
    }
    fn qp_num(&self) -> Option<QpNum> {
        None
    }
    fn private_data(&self) -> &[u8] {
        &[]
    }
    fn ack(self) -> Result<(), CmError> {
        self.acked.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl CmEventSource for Fed<CountedEvent> {
    type Event = CountedEvent;
    fn try_next_event(&mut self) -> Result<Option<CountedEvent>, CmError> {
        Ok(self.next())
    }
}

impl AsyncEventSource for Fed<AsyncEvent> {
    fn try_next_async_event(&mut self) -> Result<Option<AsyncEvent>, CmError> {
        Ok(self.next())
    }
}

/// An accepted id whose RTU is lost: the first notify forces it, later ones answer
/// EISCONN, as the kernel does.
struct AcceptedId {
    qp: QpNum,
    notifies: Arc<AtomicU32>,
}

impl CmId for AcceptedId {
    fn notify(&self, event: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
        assert_eq!(event, AsyncEventType::CommEst);
        Ok(match self.notifies.fetch_add(1, Ordering::AcqRel) {
            0 => NotifyOutcome::Established,
            _ => NotifyOutcome::AlreadyEstablished,
        })
    }
    fn qp_num(&self) -> Option<QpNum> {
        Some(self.qp)
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Seen {
    cm_events: usize,
    forced: usize,
    already_established: usize,
    other: usize,
}

/// One round: `events` COMM_ESTs over `qps` registered QPs and `events` CM events fed
/// from this thread, then `stoppers` threads request shutdown at once.
fn round(qps: u32, events: usize, stoppers: usize) {
    let (mut cm_feeder, cm_source) = fed::<CountedEvent>();
    let (mut async_feeder, async_source) = fed::<AsyncEvent>();
    let (mut waiter, shutdown) = PollWaiter::new(&cm_source).expect("a poll waiter");
    waiter
        .watch_async_events(&async_source)
        .expect("watch the async source");
    let mut pump = NotifyPump::new();
    let notifies: Vec<Arc<AtomicU32>> = (0..qps).map(|_| Arc::default()).collect();
    for (n, count) in notifies.iter().enumerate() {
        let id = AcceptedId {
            qp: QpNum(0x100 + n as u32),
            notifies: Arc::clone(count),
        };
        pump.register(id, Role::Passive).expect("distinct QPs");
    }
    let acked = Arc::new(AtomicUsize::new(0));
    let mut event_loop = EventLoop::new(cm_source, async_source, pump);

    let looper = thread::spawn(move || {
        let mut seen = Seen::default();
        let exit = event_loop.run(&mut waiter, |_pump, event| {
            match event {
                LoopEvent::Cm(event) => {
                    seen.cm_events += 1;
                    event.ack().expect("a counted ack");
                }
                LoopEvent::Pump(PumpEvent::Forced { .. }) => seen.forced += 1,
                LoopEvent::Pump(PumpEvent::AlreadyEstablished { .. }) => {
                    seen.already_established += 1
                }
                LoopEvent::Pump(_) => seen.other += 1,
            }
            Control::Continue
        });
        (exit, seen)
    });

    for i in 0..events {
        let qp = QpNum(0x100 + (i as u32 % qps));
        async_feeder.feed(AsyncEvent::qp(AsyncEventType::CommEst, qp));
        cm_feeder.feed(CountedEvent {
            acked: Arc::clone(&acked),
        });
        if i % 64 == 0 {
            thread::yield_now();
        }
    }
    let stoppers: Vec<_> = (0..stoppers)
        .map(|_| {
            let shutdown = shutdown.clone();
            thread::spawn(move || shutdown.request().expect("wake the loop"))
        })
        .collect();
    for stopper in stoppers {
        stopper.join().expect("a stopper thread");
    }
    let (exit, seen) = looper.join().expect("the loop thread does not panic");
    assert_eq!(exit, Ok(Exit::Shutdown));
    let forced_qps = (qps as usize).min(events);
    assert_eq!(
        seen,
        Seen {
            cm_events: events,
            forced: forced_qps,
            already_established: events - forced_qps,
            other: 0,
        },
        "round of {qps} QPs, {events} events"
    );
    assert_eq!(acked.load(Ordering::Relaxed), events);
    let total: u32 = notifies.iter().map(|n| n.load(Ordering::Acquire)).sum();
    assert_eq!(total as usize, events, "one notify per COMM_EST");
}

#[test]
fn loop_thread_handles_everything_fed_before_shutdown() {
    for r in 0..40usize {
        round(1 + (r as u32 % 7), (r * 37) % 500, 1 + r % 3);
    }
}

#[test]
fn shutdown_before_any_event_stops_an_idle_loop() {
    for _ in 0..50 {
        round(3, 0, 2);
    }
}
