//! What the endpoint tells `tracing` of a connection's setup and close: debug events in
//! the connection's `conn` span, each naming the connection too (so that a `log` line,
//! through tracing's log bridge, says whose it is). Each asks
//! [`debug_wanted`](crate::tracing_gate::debug_wanted) first and writes out of line: a
//! tracing callsite is inline code the setup path would otherwise carry.

use cm_core::{CmEventType, QpNum};

use crate::tracing_gate::debug_wanted;

use super::{CloseReason, ConnectionId, EstablishedVia, ListenerId, Traffic};

/// The span of what the endpoint does for `conn`, at debug level; no span at all
/// unless debug is wanted (a disabled span is not free under the log bridge).
#[inline]
pub(super) fn conn_span(conn: ConnectionId) -> tracing::Span {
    if debug_wanted() {
        make_span(conn)
    } else {
        tracing::Span::none()
    }
}

#[cold]
#[inline(never)]
fn make_span(conn: ConnectionId) -> tracing::Span {
    tracing::debug_span!("conn", %conn)
}

/// A step of `conn`'s setup with nothing more to say than its name.
#[inline]
pub(super) fn step(conn: ConnectionId, step: &'static str) {
    if debug_wanted() {
        write_step(conn, step);
    }
}

#[cold]
#[inline(never)]
fn write_step(conn: ConnectionId, step: &'static str) {
    tracing::debug!(parent: &make_span(conn), %conn, "{step}");
}

/// A request for `listener` became `conn`.
#[inline]
pub(super) fn requested(conn: ConnectionId, listener: ListenerId) {
    if debug_wanted() {
        write_requested(conn, listener);
    }
}

#[cold]
#[inline(never)]
fn write_requested(conn: ConnectionId, listener: ListenerId) {
    tracing::debug!(parent: &make_span(conn), %conn, %listener, "requested");
}

/// The CM reported `event` (with `status`) for `conn`.
#[inline]
pub(super) fn cm_event(conn: ConnectionId, event: CmEventType, status: i32) {
    if debug_wanted() {
        write_cm_event(conn, event, status);
    }
}

#[cold]
#[inline(never)]
fn write_cm_event(conn: ConnectionId, event: CmEventType, status: i32) {
    tracing::debug!(parent: &make_span(conn), %conn, %event, status, "CM event");
}

/// `conn` is established.
#[inline]
pub(super) fn established(conn: ConnectionId, via: EstablishedVia) {
    if debug_wanted() {
        write_established(conn, via);
    }
}

#[cold]
#[inline(never)]
fn write_established(conn: ConnectionId, via: EstablishedVia) {
    tracing::debug!(parent: &make_span(conn), %conn, ?via, "established");
}

/// The notify path forced (or found) `conn`'s QP established.
#[inline]
pub(super) fn notified(conn: ConnectionId, qp: QpNum, via: EstablishedVia) {
    if debug_wanted() {
        write_notified(conn, qp, via);
    }
}

#[cold]
#[inline(never)]
fn write_notified(conn: ConnectionId, qp: QpNum, via: EstablishedVia) {
    tracing::debug!(parent: &make_span(conn), %conn, %qp, ?via, "notified");
}

/// A notify on `conn`'s QP failed.
#[inline]
pub(super) fn notify_failed(conn: ConnectionId, qp: QpNum, error: cm_core::NotifyError) {
    if debug_wanted() {
        write_notify_failed(conn, qp, error);
    }
}

#[cold]
#[inline(never)]
fn write_notify_failed(conn: ConnectionId, qp: QpNum, error: cm_core::NotifyError) {
    tracing::debug!(parent: &make_span(conn), %conn, %qp, %error, "notify failed");
}

/// `conn` ended: why (`None`: the application ended it) and what it carried.
#[inline]
pub(super) fn closed(conn: ConnectionId, reason: Option<&CloseReason>, traffic: Traffic) {
    if debug_wanted() {
        write_closed(conn, reason, traffic);
    }
}

#[cold]
#[inline(never)]
fn write_closed(conn: ConnectionId, reason: Option<&CloseReason>, traffic: Traffic) {
    tracing::debug!(parent: &make_span(conn), %conn, ?reason, ?traffic, "closed");
}
