//! The server written only against the public connection API: an
//! `Endpoint<RdmaTransport>` whose listener reports each request, which the server
//! accepts; [`Endpoint::accept`] then returns once the connection is ESTABLISHED. The
//! notify path is the endpoint's own: its reader sees the receive completion on the
//! device's completion channel and forwards it with `rdma_notify`, with no application
//! code.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cm_verbs::rdma::RdmaTransport;
use cm_verbs::Transport;
use cm_verbs::{
    ConnError, ConnectionId, Endpoint, EstablishedVia, Event, ListenOptions, PrivateData,
};

use super::fixture::{Setup, WAIT};
use super::Phases;

/// `op: error` for the endpoint's errors.
fn conn_err(op: &str) -> impl Fn(cm_verbs::ConnError) -> String + '_ {
    move |e| format!("{op}: {e}")
}

/// The `Endpoint` server.
pub(super) struct ApiServer {
    endpoint: Endpoint<RdmaTransport>,
    pub(super) addr: SocketAddr,
}

impl ApiServer {
    /// An endpoint listening on the setup's A address, reporting each request.
    pub(super) fn new(setup: &Setup) -> Result<ApiServer, String> {
        let transport = RdmaTransport::new().map_err(|e| format!("RdmaTransport::new: {e}"))?;
        let mut endpoint = Endpoint::new(transport);
        let options = ListenOptions {
            auto_accept: false,
            ..ListenOptions::default()
        };
        let listener = endpoint
            .listen(SocketAddr::new(setup.addrs.addr_a, 0), options)
            .map_err(conn_err("listen"))?;
        let addr = endpoint
            .listener_addr(listener)
            .map_err(conn_err("listener_addr"))?
            .ok_or("the listener has no address")?;
        Ok(ApiServer { endpoint, addr })
    }

    /// Busy polling on (`Some(budget)`) or off for the next waits.
    pub(super) fn set_busy_poll(&mut self, budget: Option<Duration>) {
        self.endpoint.set_busy_poll(budget);
    }

    /// Waits for the next request and accepts it (QP, receives posted and the REP, all
    /// the endpoint's); other events meanwhile are ignored.
    pub(super) fn accept_one(&mut self) -> Result<ConnectionId, String> {
        let conn = self.next_matching("no connection request", |event| match event {
            Event::Request { conn, .. } => Some(conn),
            _ => None,
        })?;
        self.endpoint
            .accept_request(conn, &PrivateData::empty())
            .map_err(conn_err("accept_request"))?;
        Ok(conn)
    }

    /// The client's send to [`Endpoint::accept`] returning the connection: everything
    /// in between (the wait, the completion event, re-arming and polling the queues,
    /// the notify, reading ESTABLISHED) is the endpoint's. The connection must have
    /// been established by the notify path. Returns the send to the notify's return (the
    /// endpoint's own record of it, on its clock) and the send to `accept` returning.
    pub(super) fn send_to_established(
        &mut self,
        conn: ConnectionId,
        sent: Instant,
    ) -> Result<Phases, String> {
        let accepted = self
            .endpoint
            .accept(Some(WAIT))
            .map_err(conn_err("accept"))?;
        let returned = Instant::now();
        let established = returned - sent;
        // The endpoint's clock, read right after ours: its record of the notify,
        // placed on ours.
        let clock_now = self.endpoint.transport().now();
        if accepted != conn {
            return Err(format!("accepted {accepted}, expected {conn}"));
        }
        let info = self.endpoint.info(conn).map_err(conn_err("info"))?;
        let Some(EstablishedVia::Notify(_)) = info.established else {
            return Err(format!(
                "established via {:?} with the RTU dropped",
                info.established
            ));
        };
        let forced = info.times.established.ok_or("no establish time")?;
        let notified = established.saturating_sub(clock_now.saturating_sub(forced));
        Ok(Phases {
            notified,
            established,
        })
    }

    /// Waits until the endpoint closed `conn` on the client's DISCONNECTED (it answers
    /// with its own DREP); the message it received meanwhile is dropped.
    pub(super) fn answer_disconnect(&mut self, conn: ConnectionId) -> Result<(), String> {
        self.next_matching(&format!("{conn} not closed"), |event| match event {
            Event::Closed { conn: closed, .. } if closed == conn => Some(()),
            _ => None,
        })
    }

    /// The first event `pick` takes within [`WAIT`] (others meanwhile are dropped), or
    /// `missing` as the error.
    fn next_matching<R>(
        &mut self,
        missing: &str,
        mut pick: impl FnMut(Event) -> Option<R>,
    ) -> Result<R, String> {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.endpoint.next_event(Some(left)) {
                Ok(event) => {
                    if let Some(found) = pick(event) {
                        return Ok(found);
                    }
                }
                Err(ConnError::Timeout) => return Err(missing.to_owned()),
                Err(error) => return Err(conn_err("next_event")(error)),
            }
        }
    }
}
