//! Cancellation in tests: a future polled once, then dropped, as a `select!` or a
//! timeout drops the branch that lost.

use std::task::{Context, Poll, Waker};

/// Polls `future` once with a waker that does nothing, then drops it.
pub(crate) fn poll_once_and_drop<F: std::future::Future>(future: F) -> Poll<F::Output> {
    let mut future = std::pin::pin!(future);
    future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
}
