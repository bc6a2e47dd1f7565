//! A QP flushed with no error of its own. Its work requests complete with
//! `IBV_WC_WR_FLUSH_ERR` because something moved it to the error state from outside: the
//! peer's orderly close (iWARP flushes the receive queue when the TCP connection closes,
//! while the CM's DISCONNECTED is still on its way through the kernel's work queue), a
//! DREQ, a device going away. The CM's event names the cause, so the close waits for it,
//! up to [`FLUSH_GRACE`]; only then is the flush itself the reason.

use std::cmp::Reverse;
use std::time::Duration;

use cm_core::{Transport, WcStatus};

use super::compact::Nanos;
use super::{CloseReason, ConnectionId, Endpoint, QpErrorDetail};

/// How long a connection whose QP flushed with no error of its own waits for the CM's
/// event that explains it before the flush is reported as the close reason. The kernel
/// queues that event at the same moment (it is milliseconds away); this bounds the wait
/// where no event comes.
pub const FLUSH_GRACE: Duration = Duration::from_secs(2);

impl<T: Transport> Endpoint<T> {
    /// A flush completion on `conn`, no error completion before it on either queue: the
    /// close waits for the CM's event (or [`FLUSH_GRACE`]). Later flushes change nothing.
    pub(super) fn on_flushed(&mut self, conn: ConnectionId) {
        let now = self.transport.now();
        let Some(entry) = self.live_mut(conn) else {
            return;
        };
        if entry.flushed {
            return;
        }
        entry.flushed = true;
        let due = now.saturating_add(FLUSH_GRACE);
        entry.deadline = Nanos::new(Some(due));
        self.deadlines.push(Reverse((due, conn)));
        tracing::debug!("{conn}: the QP flushed; waiting for the CM's event");
    }

    /// Closes `conn`, whose deadline passed: a flushed QP that no CM event explained
    /// (its flush is the reason), or a setup that took too long.
    pub(super) fn close_expired(&mut self, conn: ConnectionId) {
        let flushed = self.live(conn).is_some_and(|c| c.flushed);
        let reason = if flushed {
            CloseReason::QpError {
                detail: QpErrorDetail::Completion(WcStatus::WrFlushErr),
            }
        } else {
            CloseReason::TimedOut
        };
        self.close(conn, reason, false);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::time::Duration;

    use cm_core::{CqKind, WcStatus, WorkCompletion};
    use cm_mock::sim::{SimAddr, SimConfig, SimFabric, SimTransport, SimTransports};

    use super::FLUSH_GRACE;
    use crate::endpoint::inputs::Reading;
    use crate::{
        CloseReason, ConnError, ConnectOptions, ConnectionId, Endpoint, Event, ListenOptions,
        QpErrorDetail,
    };

    /// A server and a client endpoint on a simulated fabric (seed `seed`), the client's
    /// connection with `options` established on both sides: the fabric, the server, its
    /// side of the connection, the client and its side.
    pub(in crate::endpoint) fn established(
        seed: u64,
        options: ConnectOptions<SimAddr>,
    ) -> (
        SimFabric,
        Endpoint<SimTransport>,
        Option<ConnectionId>,
        Endpoint<SimTransport>,
        ConnectionId,
    ) {
        let SimTransports {
            fabric,
            server,
            client,
        } = SimTransports::new(SimConfig::default(), seed);
        let mut server = Endpoint::new(server);
        let mut client = Endpoint::new(client);
        let addr = server.transport().addr(7481);
        server.listen(addr, ListenOptions::default()).unwrap();
        let out = client.connect(addr, options).unwrap();
        let mut inbound = None;
        loop {
            while let Some(event) = server.poll().unwrap() {
                if let Event::Established { conn, .. } = event {
                    inbound = Some(conn);
                }
            }
            while let Some(event) = client.poll().unwrap() {
                assert!(!matches!(event, Event::Closed { .. }), "{event:?}");
            }
            if !fabric.step() {
                break;
            }
        }
        (fabric, server, inbound, client, out)
    }

    /// One of the client's posted receives, flushed.
    fn flushed(client: &Endpoint<SimTransport>, out: ConnectionId) -> WorkCompletion {
        WorkCompletion {
            wr_id: 0,
            qp: client.info(out).unwrap().qp.expect("a QP"),
            kind: CqKind::Recv,
            status: WcStatus::WrFlushErr,
            byte_len: 0,
        }
    }

    /// The close reason `client` reports for `out` once the fabric is idle.
    fn close_reason(
        fabric: &SimFabric,
        client: &mut Endpoint<SimTransport>,
        out: ConnectionId,
    ) -> Option<CloseReason> {
        fabric.run_until_idle();
        while let Some(event) = client.poll().unwrap() {
            if let Event::Closed { conn, reason } = event {
                assert_eq!(conn, out);
                return Some(reason);
            }
        }
        None
    }

    /// The peer's orderly close flushes the receives (iWARP, on the TCP close) before the
    /// CM's DISCONNECTED is read: the close is the peer's, not a QP error.
    #[test]
    fn a_flush_before_the_peers_disconnect_is_the_peers_close() {
        let (fabric, mut server, inbound, mut client, out) =
            established(83, ConnectOptions::default());
        client.on_completion(out, flushed(&client, out), Reading::Event);
        client.on_completion(out, flushed(&client, out), Reading::Event);
        assert_eq!(close_reason(&fabric, &mut client, out), None, "not yet");
        server
            .disconnect(inbound.expect("the server's side"))
            .unwrap();
        while server.poll().unwrap().is_some() {}
        assert_eq!(
            close_reason(&fabric, &mut client, out),
            Some(CloseReason::Disconnected)
        );
    }

    /// A flush that no CM event explains within FLUSH_GRACE is the close reason: no
    /// connection waits forever.
    #[test]
    fn a_flush_no_event_explains_closes_after_the_grace() {
        let (fabric, _server, _, mut client, out) = established(84, ConnectOptions::default());
        client.on_completion(out, flushed(&client, out), Reading::Event);
        fabric.advance(FLUSH_GRACE / 2);
        assert_eq!(
            close_reason(&fabric, &mut client, out),
            None,
            "within the grace"
        );
        fabric.advance(FLUSH_GRACE);
        assert_eq!(
            close_reason(&fabric, &mut client, out),
            Some(CloseReason::QpError {
                detail: QpErrorDetail::Completion(WcStatus::WrFlushErr)
            })
        );
        assert!(matches!(
            client.recv(out, Some(Duration::ZERO)),
            Err(ConnError::Closed { .. }) | Err(ConnError::UnknownConnection(_))
        ));
    }
}
