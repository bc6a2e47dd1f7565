//! The one wait path: a waiting call, async or blocking, is a [`Call`] polled until it
//! answers. The async call polls it from its future; the blocking call polls it from a
//! loop that parks the thread between polls, with a waker that unparks it. Both take
//! the same steps in the same order, so they cannot drift apart:
//!
//! 1. `take` asks the endpoint for the answer (a message, an accepted connection, …);
//! 2. else the endpoint's failure, or (on a simulation) a finding since the call began
//!    that nothing can happen any more, answers;
//! 3. else a deadline that passed answers [`ConnError::Timeout`];
//! 4. else the call registers its waker under its own number and waits.
//!
//! Steps 1 to 4 run under the lock the driver routes news under, so news that lands
//! between 1 and 4 finds the registration (no lost wake-up). The registration and the
//! deadline's timer go when the call answers or is dropped (a cancelled future, a
//! blocking call's return): waiting calls are bounded by live calls.

use std::sync::Arc;
use std::task::{Poll, Wake, Waker};
use std::thread::Thread;
use std::time::Duration;

use cm_core::{CmError, Transport};

use super::core::{Core, WaitOn};
use super::Shared;
use crate::ConnError;

/// What a started call keeps: its number, the idle epoch it began in, its deadline and
/// the deadline's timer.
#[derive(Clone, Copy)]
struct Started {
    call: u64,
    since: u64,
    deadline: Option<Duration>,
    timer: Option<u64>,
}

/// One waiting call on the shared endpoint.
pub(super) struct Call<'a, T: Transport> {
    shared: &'a Shared<T>,
    on: WaitOn,
    timeout: Option<Duration>,
    started: Option<Started>,
    /// Answered: nothing of it is left in the core.
    done: bool,
    /// How long a blocked thread may park before it must look again (`None`: until
    /// woken): the time left to the deadline on a real clock. On virtual time the
    /// driver wakes the call through its timer.
    park_for: Option<Duration>,
}

impl<'a, T: Transport> Call<'a, T> {
    /// A call that waits on `on`, at most `timeout` (the transport's clock).
    pub(super) fn new(shared: &'a Shared<T>, on: WaitOn, timeout: Option<Duration>) -> Self {
        Call {
            shared,
            on,
            timeout,
            started: None,
            done: false,
            park_for: None,
        }
    }

    /// One look: the answer, or the waker registered to be woken when it may be there.
    pub(super) fn poll<R>(
        &mut self,
        waker: &Waker,
        take: &mut impl FnMut(&mut Core<T>) -> Option<Result<R, ConnError>>,
    ) -> Poll<Result<R, ConnError>> {
        let mut core = self.shared.lock();
        let started = match self.started {
            Some(started) => started,
            None => {
                let deadline = self.timeout.map(|t| core.now().saturating_add(t));
                let started = Started {
                    call: core.new_call(),
                    since: core.idle_epoch(),
                    deadline,
                    timer: deadline.map(|due| core.add_timer(due, waker.clone())),
                };
                if started.timer.is_some() {
                    // A new deadline the driver's wait must cover.
                    self.shared.poke(&mut core);
                }
                *self.started.insert(started)
            }
        };
        if let Some(answer) = answer(&mut core, started, take) {
            core.end_call(self.on, started.call, started.timer);
            self.done = true;
            if core.virtual_time() {
                // Taking may have moved something (a receive posted again).
                self.shared.poke(&mut core);
            }
            return Poll::Ready(answer);
        }
        core.register(self.on, started.call, waker);
        if core.virtual_time() {
            self.shared.poke(&mut core);
        }
        self.park_for = started
            .deadline
            .filter(|_| !core.virtual_time())
            .map(|due| due.saturating_sub(core.now()));
        Poll::Pending
    }

    /// Polls on the calling thread, parking it in between, until the call answers.
    pub(super) fn block_on<R>(
        mut self,
        mut take: impl FnMut(&mut Core<T>) -> Option<Result<R, ConnError>>,
    ) -> Result<R, ConnError> {
        let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
        loop {
            if let Poll::Ready(answer) = self.poll(&waker, &mut take) {
                return answer;
            }
            match self.park_for {
                Some(left) => std::thread::park_timeout(left),
                None => std::thread::park(),
            }
        }
    }
}

/// Steps 1 to 3 of the module's list: the answer, if there is one now.
fn answer<T: Transport, R>(
    core: &mut Core<T>,
    started: Started,
    take: &mut impl FnMut(&mut Core<T>) -> Option<Result<R, ConnError>>,
) -> Option<Result<R, ConnError>> {
    if let Some(answer) = take(core) {
        return Some(answer);
    }
    if let Some(error) = core.stop_reason(started.since) {
        // Nothing can happen on an idle simulation: a wait with a deadline times out,
        // as the endpoint's own waits do.
        if started.deadline.is_some() && matches!(error, ConnError::Cm(CmError::Idle { .. })) {
            return Some(Err(ConnError::Timeout));
        }
        return Some(Err(error));
    }
    if started.deadline.is_some_and(|due| core.now() >= due) {
        return Some(Err(ConnError::Timeout));
    }
    None
}

impl<T: Transport> Drop for Call<'_, T> {
    fn drop(&mut self) {
        // A call dropped before it answered (a cancelled future) leaves nothing behind.
        if let (Some(started), false) = (self.started, self.done) {
            let mut core = self.shared.lock();
            core.end_call(self.on, started.call, started.timer);
        }
    }
}

/// Unparks the thread that waits.
struct ThreadWaker(Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}
