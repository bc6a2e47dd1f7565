//! A connection request as a value: what [`super::Listener::next_request`] hands out on
//! a listener that does not accept by itself, answered exactly once (accepted,
//! rejected, or rejected when dropped).

use std::fmt;
use std::sync::Arc;

use cm_core::Transport;

use super::core::TakenRequest;
use super::{Connection, Owner};
use crate::{ConnError, ConnectionId, ListenerId, PrivateData};

/// A connection request waiting for the application's answer: the peer's private data
/// (the REQ's) and address, to [`Request::accept`] or [`Request::reject`], each with
/// private data of the application's own (where RDMA services exchange rkeys and
/// credits). Both take the request by value: it is answered once, by construction.
///
/// Dropped unanswered, it is rejected with no private data (the peer sees
/// [`RejectReason::Consumer`](crate::RejectReason::Consumer)) and freed: nothing is
/// leaked or left unanswered. Unanswered for [`ListenOptions::request_timeout`]
/// (counted from its arrival), the endpoint rejects it itself; an answer after that
/// answers [`ConnError::Closed`] with [`CloseReason::TimedOut`].
///
/// [`Send`] when `Endpoint<T>` and `T::Addr` are.
///
/// [`ListenOptions::request_timeout`]: crate::ListenOptions::request_timeout
/// [`CloseReason::TimedOut`]: crate::CloseReason::TimedOut
pub struct Request<T: Transport> {
    conn: ConnectionId,
    listener: ListenerId,
    private_data: PrivateData,
    peer_addr: Option<T::Addr>,
    owner: Arc<Owner<T>>,
    /// Accepted or rejected: nothing is left for the drop to do.
    answered: bool,
}

impl<T: Transport> fmt::Debug for Request<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("conn", &self.conn)
            .field("listener", &self.listener)
            .field("private_data", &self.private_data)
            .field("peer_addr", &self.peer_addr)
            .finish()
    }
}

impl<T: Transport> Request<T> {
    pub(super) fn new(
        taken: TakenRequest<T::Addr>,
        listener: ListenerId,
        owner: &Arc<Owner<T>>,
    ) -> Self {
        Request {
            conn: taken.conn,
            listener,
            private_data: taken.private_data,
            peer_addr: taken.peer_addr,
            owner: Arc::clone(owner),
            answered: false,
        }
    }

    /// The endpoint's name for the connection it would become.
    pub fn id(&self) -> ConnectionId {
        self.conn
    }

    /// The listener it came to.
    pub fn listener(&self) -> ListenerId {
        self.listener
    }

    /// The peer's private data (the REQ's). On the real kernel it comes padded with
    /// zeros to [`PrivateData::MAX_REQ`] bytes: compare a prefix.
    pub fn private_data(&self) -> &PrivateData {
        &self.private_data
    }

    /// The peer's address, as the CM reports it.
    pub fn peer_addr(&self) -> Option<T::Addr> {
        self.peer_addr
    }

    /// Calls `f` with the CM id the request came on, before it is answered: where the
    /// application makes a QP of its own (its completion queues, protection domain and
    /// memory; on the real transport `CmId::create_qp` or `CmId::create_qp_on`), which
    /// [`Request::accept`] then accepts with (the endpoint makes nothing for it, and
    /// learns of its receives through [`Connection::received`]). O(1).
    pub fn with_id<R>(&self, f: impl FnOnce(&T::Id) -> R) -> Result<R, ConnError> {
        let conn = self.conn;
        self.owner
            .shared
            .with(|core| Ok(f(core.endpoint().cm_id(conn)?)))
    }

    /// Accepts it: the REP goes with `private_data` (at most [`PrivateData::MAX_REP`]
    /// bytes), and the connection comes back, to wait for with
    /// [`Connection::established`] (a lost RTU is rescued as for any accepted
    /// connection); its [`Connection::peer_private_data`] is this request's. It never
    /// comes out of [`super::Listener::accept`] too.
    ///
    /// Answered whatever happens: if the REP cannot go ([`ConnError::PrivateDataTooLong`],
    /// its queues cannot be set up), the request is rejected with no private data and
    /// the error returned; one that timed out or whose peer left answers
    /// [`ConnError::Closed`].
    pub fn accept(mut self, private_data: &PrivateData) -> Result<Connection<T>, ConnError> {
        self.answered = true;
        let conn = self.conn;
        self.owner
            .shared
            .with(|core| core.accept_request(conn, private_data))?;
        let peer = std::mem::take(&mut self.private_data);
        Ok(Connection::accepted(conn, None, Some(peer), &self.owner))
    }

    /// Rejects it: the REJ goes with `private_data` (at most [`PrivateData::MAX_REJ`]
    /// bytes), and the peer's connect ends in [`ConnError::Closed`] with
    /// [`CloseReason::Rejected`](crate::CloseReason::Rejected)
    /// ([`RejectReason::Consumer`](crate::RejectReason::Consumer), this data). Answered
    /// whatever happens: with data too long ([`ConnError::PrivateDataTooLong`]) the REJ
    /// goes with none; a request that timed out or whose peer left answers
    /// [`ConnError::Closed`].
    pub fn reject(mut self, private_data: &PrivateData) -> Result<(), ConnError> {
        self.answered = true;
        let conn = self.conn;
        self.owner
            .shared
            .with(|core| core.reject_request(conn, private_data))
    }
}

impl<T: Transport> Drop for Request<T> {
    fn drop(&mut self) {
        if !self.answered {
            let conn = self.conn;
            self.owner.shared.with(|core| core.drop_request(conn));
        }
    }
}
