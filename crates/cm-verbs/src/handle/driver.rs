//! The drivers: a loop of passes and waits, on a thread or as a tokio task.

use std::sync::atomic::Ordering;
use std::time::Duration;

use cm_core::{CmError, Transport};

use super::Shared;
use crate::ConnError;

/// How long the thread driver of an idle simulation waits for a call to move something
/// before it tells the waiting calls that nothing can happen.
const IDLE_GRACE: Duration = Duration::from_millis(200);

/// The thread driver. It holds the lock while it waits in the transport (the real one
/// blocks in `poll(2)`), and lets go as soon as a call wants it: the call wakes the
/// wait first ([`Shared::lock`]).
pub(super) fn run_thread<T: Transport>(shared: &Shared<T>) {
    let mut core = shared.core.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if core.stopped() {
            return;
        }
        // A call waits for the lock: let it in before waiting.
        if shared.wanting.load(Ordering::SeqCst) > 0 {
            drop(core);
            std::thread::yield_now();
            core = shared.core.lock().unwrap_or_else(|e| e.into_inner());
            continue;
        }
        let more = core.pass();
        if core.stop_reason().is_some() && !core.virtual_time() {
            return;
        }
        core.take_poke();
        if more {
            continue;
        }
        let left = core.begin_wait();
        shared.blocked.store(true, Ordering::SeqCst);
        // A call that came between the check above and now has woken the wait (it saw
        // `blocked`) or is seen here.
        let waited = if shared.wanting.load(Ordering::SeqCst) > 0 {
            Ok(())
        } else {
            core.endpoint_mut().wait_transport(left)
        };
        shared.blocked.store(false, Ordering::SeqCst);
        match waited {
            Ok(()) => {}
            Err(ConnError::Cm(CmError::Idle { .. })) => {
                // Nothing pending anywhere: wait for a call to move something; if none
                // does, the waiting calls are told.
                if !core.take_poke() {
                    let (guard, timeout) = shared
                        .idle
                        .wait_timeout_while(core, IDLE_GRACE, |c| !c.take_poke() && !c.stopped())
                        .unwrap_or_else(|e| e.into_inner());
                    core = guard;
                    if timeout.timed_out() {
                        core.set_idle();
                        core = shared
                            .idle
                            .wait_while(core, |c| !c.take_poke() && !c.stopped())
                            .unwrap_or_else(|e| e.into_inner());
                    }
                }
            }
            Err(ConnError::Endpoint(error)) => {
                core.fail(error);
                return;
            }
            Err(error) => {
                log::warn!("endpoint wait: {error}");
            }
        }
    }
}

#[cfg(feature = "tokio")]
pub(super) use tokio_driver::run_tokio;

#[cfg(feature = "tokio")]
mod tokio_driver {
    use std::future::poll_fn;
    use std::task::Poll;

    use cm_core::CmError;

    use super::super::Shared;
    use crate::async_endpoint::{AsyncWait, WatchSet, IDLE_TURNS};
    use crate::ConnError;

    /// The tokio driver: passes under the lock, waits outside it (on the reactor for a
    /// transport with descriptors; for a simulation, the transport's own wait, then
    /// the other tasks' turn).
    pub(in crate::handle) async fn run_tokio<T: AsyncWait>(shared: &Shared<T>) {
        let mut watch = WatchSet::default();
        let mut idle_turns = 0;
        loop {
            enum Next {
                Again,
                Yield,
                Park,
                Wait(Option<tokio::time::Instant>),
            }
            let next = {
                let mut core = shared.lock();
                if core.stopped() {
                    return;
                }
                let more = core.pass();
                if core.stop_reason().is_some() && !core.virtual_time() {
                    return;
                }
                let poked = core.take_poke();
                let left = core.begin_wait();
                let has_descriptors = watch.sync(core.endpoint());
                if more {
                    Next::Yield
                } else if !has_descriptors {
                    match core.endpoint_mut().wait_transport(left) {
                        Ok(()) => {
                            idle_turns = 0;
                            Next::Yield
                        }
                        Err(ConnError::Cm(CmError::Idle { .. })) => {
                            if poked {
                                idle_turns = 0;
                            }
                            idle_turns += 1;
                            if idle_turns <= IDLE_TURNS {
                                Next::Yield
                            } else {
                                core.set_idle();
                                Next::Park
                            }
                        }
                        Err(ConnError::Endpoint(error)) => {
                            core.fail(error);
                            Next::Park
                        }
                        Err(error) => {
                            log::warn!("endpoint wait: {error}");
                            Next::Yield
                        }
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
                    poll_fn(|cx| {
                        let mut core = shared.lock();
                        if core.take_poke() || core.stopped() {
                            return Poll::Ready(());
                        }
                        core.park_driver(cx.waker());
                        Poll::Pending
                    })
                    .await;
                    idle_turns = 0;
                }
                Next::Wait(deadline) => {
                    let sleep = deadline.map(tokio::time::sleep_until);
                    tokio::pin!(sleep);
                    let result = poll_fn(|cx| {
                        {
                            let mut core = shared.lock();
                            if core.take_poke() || core.stopped() {
                                return Poll::Ready(Ok(()));
                            }
                            core.park_driver(cx.waker());
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
