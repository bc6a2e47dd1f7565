//! The loom models of the wake protocols: every interleaving of two or three threads
//! (within loom's preemption bound) is run, and a thread left blocked forever fails
//! the model (loom reports the deadlock). Run by `cargo xtask ci` with
//! `RUSTFLAGS="--cfg cm_loom" cargo test -p cm-verbs --lib --release wake::models`.

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex, Notify};
use loom::thread;

use super::{LockGate, WakeFlag};

/// Every interleaving with up to three preemptions: enough for the lost wake-ups these
/// protocols guard against (each needs two), and each model runs in seconds rather than
/// the tens of minutes an unbounded search of the driver's retry loop takes.
fn bounded() -> loom::model::Builder {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(3);
    model
}

/// The transport's wait as the thread driver makes it: blocks until a wake-up, which
/// a call sends (the wake-up socket, as one permit).
struct Transport {
    woken: Notify,
}

/// What the driver and the calls share: the lock (with what the calls did under it),
/// the gate, the transport, and whether every handle is gone.
struct Handles {
    lock: Mutex<usize>,
    gate: LockGate,
    transport: Transport,
    stopped: AtomicBool,
}

impl Handles {
    /// A call: wakes the driver's wait if it may be blocked holding the lock, locks,
    /// acts.
    fn call(&self) {
        if self.gate.want() {
            self.transport.woken.notify();
        }
        let mut done = self.lock.lock().unwrap();
        self.gate.got();
        *done += 1;
    }

    /// The thread driver: holds the lock, lets wanting calls in, and otherwise waits
    /// in the transport holding it, until stopped.
    fn drive(&self) {
        let mut guard = self.lock.lock().unwrap();
        loop {
            if self.stopped.load(Ordering::SeqCst) {
                return;
            }
            if self.gate.wanted() {
                drop(guard);
                thread::yield_now();
                guard = self.lock.lock().unwrap();
                continue;
            }
            if self.gate.begin_blocking() {
                self.transport.woken.wait();
            }
            self.gate.end_blocking();
        }
    }
}

/// Two calls against the thread driver that waits holding the lock: each call gets the
/// lock (no call waits forever behind a driver asleep in its wait), and the driver ends
/// when told.
#[test]
fn a_call_never_waits_forever_for_the_lock_the_driver_holds_while_it_waits() {
    bounded().check(|| {
        let handles = Arc::new(Handles {
            lock: Mutex::new(0),
            gate: LockGate::new(),
            transport: Transport {
                woken: Notify::new(),
            },
            stopped: AtomicBool::new(false),
        });
        let driver = {
            let handles = Arc::clone(&handles);
            thread::spawn(move || handles.drive())
        };
        let other = {
            let handles = Arc::clone(&handles);
            thread::spawn(move || handles.call())
        };
        handles.call();
        other.join().unwrap();
        // The last handle gone: stop, and wake the wait (as `Owner`'s drop does).
        handles.stopped.store(true, Ordering::SeqCst);
        handles.transport.woken.notify();
        driver.join().unwrap();
        assert_eq!(*handles.lock.lock().unwrap(), 2, "both calls ran");
    });
}

/// The wake-up socket (its bytes) and the readiness its `poll(2)` waits for.
struct Socket {
    bytes: AtomicUsize,
    readable: Notify,
}

impl Socket {
    fn write(&self) {
        self.bytes.fetch_add(1, Ordering::SeqCst);
        self.readable.notify();
    }

    /// `poll(2)`: blocks until a byte is there.
    fn poll(&self) {
        while self.bytes.load(Ordering::SeqCst) == 0 {
            self.readable.wait();
        }
    }

    /// Reads it empty; whether there was a byte.
    fn read_all(&self) -> bool {
        self.bytes.swap(0, Ordering::SeqCst) > 0
    }
}

/// Requesters that make changes, each followed by a wake-up request (one requester
/// twice, the other once: a request after a drain is what a stuck flag swallows), and
/// a waiter that waits on the socket, drains it (in `drain`'s order) and looks at the
/// changes, until it has seen them all. A lost wake-up leaves the waiter blocked in
/// `poll` with a change unseen: loom reports it.
fn requests_reach_the_waiter(drain: fn(&Socket, &WakeFlag) -> bool) {
    const CHANGES: usize = 3;
    bounded().check(move || {
        let flag = Arc::new(WakeFlag::new());
        let socket = Arc::new(Socket {
            bytes: AtomicUsize::new(0),
            readable: Notify::new(),
        });
        let changes = Arc::new(AtomicUsize::new(0));
        let requesters: Vec<_> = [2, 1]
            .into_iter()
            .map(|rounds| {
                let (flag, socket, changes) =
                    (Arc::clone(&flag), Arc::clone(&socket), Arc::clone(&changes));
                thread::spawn(move || {
                    for _ in 0..rounds {
                        changes.fetch_add(1, Ordering::SeqCst);
                        if flag.request() {
                            socket.write();
                        }
                    }
                })
            })
            .collect();
        // The waiter: a wait, a drain, a look, until every change is seen.
        while changes.load(Ordering::SeqCst) < CHANGES {
            socket.poll();
            drain(&socket, &flag);
        }
        for requester in requesters {
            requester.join().unwrap();
        }
    });
}

/// The crate's order: the socket emptied, then the flag settled.
#[test]
fn a_request_during_the_drain_is_never_lost() {
    requests_reach_the_waiter(|socket, flag| {
        let read = socket.read_all();
        flag.settle() || read
    });
}

/// The order that lost wake-ups (the flag settled before the socket is read): the model
/// finds the interleaving that leaves the waiter asleep, so the checker can see the bug
/// the crate's order avoids.
#[test]
#[should_panic]
fn settling_before_reading_loses_a_wake_up() {
    requests_reach_the_waiter(|socket, flag| {
        let requested = flag.settle();
        socket.read_all() || requested
    });
}

/// The wake-up of an endpoint's mailbox ([`crate::device_events`]) as the real backend
/// makes it: the waker of a subscriber requests a wake-up byte through its [`WakeFlag`].
struct MailWaker {
    flag: Arc<WakeFlag>,
    socket: Arc<Socket>,
}

impl std::task::Wake for MailWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        if self.flag.request() {
            self.socket.write();
        }
    }
}

/// Two other endpoints each read one COMM_EST of the owner's QPs from the device's
/// stream and route it (under the hub's lock, the real `Routes`); the owner waits on
/// its wake-up socket and takes its mail, until it has both. As the real backend does,
/// a wait that found the socket readable drains it (socket, then flag) before the pass
/// looks at the mailbox, and the pass takes the hub's lock only when the mailbox's flag
/// is raised. A COMM_EST posted while the owner looks at its mailbox, or while its
/// wake-up is pending, must still reach it: a lost one leaves the owner blocked in
/// `poll`, which loom reports.
#[test]
fn mail_routed_by_another_endpoint_is_never_missed() {
    use crate::device_events::{Object, Routes};
    use cm_core::{AsyncEvent, AsyncEventType, QpNum};

    const OWNER: u64 = 1;
    bounded().check(|| {
        let flag = Arc::new(WakeFlag::new());
        let socket = Arc::new(Socket {
            bytes: AtomicUsize::new(0),
            readable: Notify::new(),
        });
        let waker = std::task::Waker::from(std::sync::Arc::new(MailWaker {
            flag: Arc::clone(&flag),
            socket: Arc::clone(&socket),
        }));
        let noop = std::task::Waker::noop().clone();
        let mut routes = Routes::default();
        let mail = routes.subscribe(OWNER, waker);
        for (reader, qp) in [(2, 10), (3, 11)] {
            routes.subscribe(reader, noop.clone());
            routes.claim(OWNER, Object::Qp(qp));
        }
        let hub = Arc::new(Mutex::new(routes));
        let readers: Vec<_> = [(2, 10), (3, 11)]
            .into_iter()
            .map(|(reader, qp)| {
                let hub = Arc::clone(&hub);
                thread::spawn(move || {
                    let event = AsyncEvent::qp(AsyncEventType::CommEst, QpNum(qp));
                    let mine = hub.lock().unwrap().deliver(reader, event);
                    assert_eq!(mine, None, "the owner's, not the reader's");
                })
            })
            .collect();
        let mut seen = 0;
        loop {
            if mail.raised() {
                while hub.lock().unwrap().take_mail(OWNER).is_some() {
                    seen += 1;
                }
            }
            if seen == 2 {
                break;
            }
            socket.poll();
            socket.read_all();
            flag.settle();
        }
        for reader in readers {
            reader.join().unwrap();
        }
    });
}
