//! The drivers: a loop of passes and waits, on a thread or as a tokio task.
//!
//! On a transport in virtual time (the simulation) each side of a fabric has its own
//! driver, and the application's threads or tasks act between the fabric's steps: a
//! driver runs what is due now one action at a time ([`Transport::wait_step`]) and
//! gives the others their turn after each; only when nothing has happened anywhere on
//! the fabric ([`Transport::activity`]) for [`IDLE_TURNS`](crate::endpoint::IDLE_TURNS) of its turns, and no news it
//! routed or call it was told of is newer, does time jump to the next action or
//! deadline, or, with none, are the waiting calls told that nothing can happen. So
//! virtual time never runs ahead of an event another party has yet to act on (a REP
//! whose RTU the other side's reader sends, a message its application is about to
//! send).

use std::sync::{Arc, MutexGuard};
use std::time::Duration;

use cm_core::{CmError, Transport};

use super::core::Core;
use super::pacing::QuietTurn;
use super::Shared;
use crate::ConnError;

/// Ends the waiting calls if a driver ends before the handles are gone (its runtime
/// shut down, or it panicked): they answer [`ConnError::Endpoint`] (ESHUTDOWN) rather
/// than wait for a driver that will never come.
/// Held by the driver (from before it first runs: a task dropped unpolled counts too).
pub(super) struct Ended<T: Transport>(pub(super) Arc<Shared<T>>);

impl<T: Transport> Drop for Ended<T> {
    fn drop(&mut self) {
        let mut core = self.0.core.lock().unwrap_or_else(|e| e.into_inner());
        if !core.stopped() && !core.has_failed() {
            // ESHUTDOWN: the endpoint's driver is gone.
            core.fail(CmError::from_errno("the endpoint's driver", 108));
        }
    }
}

/// The thread driver's turn on a simulation: how long it lets the application's
/// threads act after a step of the fabric, unless one of their calls ends it first.
const TURN: Duration = Duration::from_millis(1);

/// What a driver on a simulation does after one step.
enum Turn {
    /// Something moved: the others' turn, then the next step.
    Moved,
    /// Nothing moved.
    Still,
    /// Nothing can happen until a call moves something.
    Idle,
    /// The endpoint failed.
    Failed,
}

/// One step of a driver on a simulation; when nothing happened anywhere for long
/// enough ([`quiet_turn`](super::pacing::Pacing::quiet_turn)), time jumps to the next deadline.
fn step<T: Transport>(core: &mut Core<T>, left: Option<Duration>) -> Turn {
    let moved = match core.endpoint_mut().wait_step(left) {
        Ok(moved) => moved,
        Err(ConnError::Endpoint(error)) => {
            core.fail(error);
            return Turn::Failed;
        }
        Err(error) => {
            tracing::warn!("endpoint wait: {error}");
            false
        }
    };
    let activity = core.endpoint().transport().activity();
    if moved {
        core.pacing().moved(activity);
        return Turn::Moved;
    }
    if core.pacing().quiet_turn(activity) == QuietTurn::Wait {
        return Turn::Still;
    }
    match core.endpoint_mut().wait_transport(left) {
        Ok(()) => Turn::Moved,
        Err(ConnError::Cm(CmError::Idle { .. })) => {
            core.set_idle();
            Turn::Idle
        }
        Err(ConnError::Endpoint(error)) => {
            core.fail(error);
            Turn::Failed
        }
        Err(error) => {
            tracing::warn!("endpoint wait: {error}");
            Turn::Still
        }
    }
}

/// The thread driver. On a real transport it holds the lock while it waits in the
/// transport (`poll(2)`), and lets go as soon as a call wants it: the call wakes the
/// wait first ([`Shared::lock`]).
pub(super) fn run_thread<T: Transport>(shared: &Shared<T>) {
    let relock = || shared.core.lock().unwrap_or_else(|e| e.into_inner());
    let mut core = relock();
    loop {
        if core.stopped() {
            return;
        }
        // A call waits for the lock: let it in before anything else.
        if shared.gate.wanted() {
            drop(core);
            std::thread::yield_now();
            core = relock();
            continue;
        }
        let more = core.pass();
        if core.has_failed() {
            return;
        }
        // On a simulation, a poke starts the quiet count again; a real transport's wait
        // below sees its changes through `begin_wait`.
        core.pacing().take_poke();
        if more {
            continue;
        }
        let left = core.begin_wait();
        if core.virtual_time() {
            // Idle too, the driver looks again after a turn: another party on the
            // fabric (the other side's driver, woken by its own calls) may bring this
            // side something without any call of this side's telling it.
            if let Turn::Failed = step(&mut core, left) {
                return;
            }
            // A call that moves something during the turn starts the quiet count again
            // (its poke is taken here).
            core = wait_for_call(shared, core, TURN);
            continue;
        }
        // A call that came since the check above has woken the wait (it saw the driver
        // blocked) or is seen here.
        let waited = if shared.gate.begin_blocking() {
            core.endpoint_mut().wait_transport(left)
        } else {
            Ok(())
        };
        shared.gate.end_blocking();
        match waited {
            Ok(()) => {}
            Err(ConnError::Endpoint(error)) => {
                core.fail(error);
                return;
            }
            Err(error) => tracing::warn!("endpoint wait: {error}"),
        }
    }
}

/// Sleeps until a call tells the driver something changed (or it is stopped), at most
/// `turn`; the poke is taken here.
fn wait_for_call<'a, T: Transport>(
    shared: &'a Shared<T>,
    core: MutexGuard<'a, Core<T>>,
    turn: Duration,
) -> MutexGuard<'a, Core<T>> {
    let nothing_new = |c: &mut Core<T>| !c.pacing().take_poke() && !c.stopped();
    shared
        .idle
        .wait_timeout_while(core, turn, nothing_new)
        .unwrap_or_else(|e| e.into_inner())
        .0
}

#[cfg(feature = "tokio")]
pub(super) use tokio_driver::run_tokio;

#[cfg(feature = "tokio")]
mod tokio_driver {
    use std::future::poll_fn;
    use std::task::Poll;

    use super::super::Shared;
    use super::{step, Turn};
    use crate::async_endpoint::{AsyncWait, WatchSet};

    /// What the tokio driver does after a pass.
    enum Next {
        Again,
        Yield,
        Park,
        Wait(Option<tokio::time::Instant>),
    }

    /// The tokio driver: passes under the lock, waits outside it (on the reactor for a
    /// transport with descriptors; on a simulation, one step of the fabric, then the
    /// other tasks' turn).
    pub(in crate::handle) async fn run_tokio<T: AsyncWait>(shared: &Shared<T>) {
        let mut watch = WatchSet::default();
        loop {
            let next = {
                let mut core = shared.lock();
                if core.stopped() {
                    return;
                }
                watch.hand_over(core.endpoint().transport());
                let more = core.pass();
                if core.has_failed() {
                    return;
                }
                let poked = core.pacing().take_poke();
                let left = core.begin_wait();
                let has_descriptors = watch.sync(core.endpoint());
                if more {
                    Next::Yield
                } else if !has_descriptors {
                    match step(&mut core, left) {
                        Turn::Moved | Turn::Still => Next::Yield,
                        Turn::Idle => Next::Park,
                        Turn::Failed => return,
                    }
                } else if poked {
                    Next::Again
                } else {
                    Next::Wait(watch.deadline(left))
                }
            };
            match next {
                Next::Again => {}
                Next::Yield => tokio::task::yield_now().await,
                Next::Park => {
                    // Until a call tells it, or a turn passed: another party on the
                    // fabric may bring this side something without any call of this
                    // side's telling it.
                    let turn = tokio::time::sleep(super::TURN);
                    tokio::pin!(turn);
                    poll_fn(|cx| {
                        let mut core = shared.lock();
                        if core.pacing().take_poke() || core.stopped() {
                            return Poll::Ready(());
                        }
                        core.pacing().park(cx.waker());
                        drop(core);
                        std::future::Future::poll(turn.as_mut(), cx)
                    })
                    .await;
                }
                Next::Wait(deadline) => {
                    let sleep = deadline.map(tokio::time::sleep_until);
                    tokio::pin!(sleep);
                    let result = poll_fn(|cx| {
                        {
                            let mut core = shared.lock();
                            if core.pacing().take_poke() || core.stopped() {
                                return Poll::Ready(Ok(()));
                            }
                            core.pacing().park(cx.waker());
                        }
                        if let Poll::Ready(result) = watch.poll_ready(cx) {
                            return Poll::Ready(result);
                        }
                        if let Some(sleep) = sleep.as_mut().as_pin_mut() {
                            if std::future::Future::poll(sleep, cx).is_ready() {
                                return Poll::Ready(Ok(()));
                            }
                        }
                        Poll::Pending
                    })
                    .await;
                    if let Err(error) = result {
                        shared.lock().fail(error);
                    }
                }
            }
        }
    }
}
