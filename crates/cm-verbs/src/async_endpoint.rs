//! The connection API on tokio: [`AsyncEndpoint`] drives the same [`Endpoint`] as the
//! blocking calls, with its descriptors (the CM channel, and per device context the
//! asynchronous event descriptor and the completion channel) registered with the
//! reactor instead of waited on in `poll(2)`.
//!
//! Cancellation-safe: every event lives in the endpoint until a call takes it, so a
//! future dropped at an `.await` loses no event, and the connections it was waiting on
//! stay owned by the endpoint (nothing leaks).
//!
//! ```no_run
//! use cm_verbs::async_endpoint::AsyncEndpoint;
//! use cm_verbs::rdma::RdmaTransport;
//! use cm_verbs::ListenOptions;
//!
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! let mut server = AsyncEndpoint::new(RdmaTransport::new()?)?;
//! server.endpoint().listen("10.77.1.1:7471".parse()?, ListenOptions::default())?;
//! loop {
//!     // Lost RTUs are rescued before `accept` returns: nothing to write for it.
//!     let conn = server.accept().await?;
//!     let message = server.recv(conn).await?;
//!     server.endpoint().send(conn, &message)?;
//! }
//! # }
//! ```

use std::future::poll_fn;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::task::Poll;

use cm_core::CmError;
use tokio::io::unix::AsyncFd;

use crate::rdma::RdmaTransport;
use crate::{ConnError, ConnectionId, Endpoint, EstablishedVia, Event};

/// An [`Endpoint`] over the real backend, driven by tokio.
#[derive(Debug)]
pub struct AsyncEndpoint {
    endpoint: Endpoint<RdmaTransport>,
    /// Duplicates of the endpoint's descriptors, registered with the reactor; rebuilt
    /// (and the duplicates closed) as soon as the endpoint's set changes, so that a
    /// removed device is not kept open by them.
    watched: Vec<AsyncFd<OwnedFd>>,
    fds: Vec<RawFd>,
}

fn readiness(error: std::io::Error) -> ConnError {
    ConnError::Cm(CmError::from_io("tokio readiness", &error))
}

impl AsyncEndpoint {
    /// An endpoint over `transport`; must be called within a tokio runtime with I/O
    /// enabled.
    pub fn new(transport: RdmaTransport) -> Result<Self, ConnError> {
        let mut endpoint = AsyncEndpoint {
            endpoint: Endpoint::new(transport),
            watched: Vec::new(),
            fds: Vec::new(),
        };
        endpoint.sync_fds()?;
        Ok(endpoint)
    }

    /// The endpoint, for the calls that never wait (`listen`, `connect`, `send`,
    /// `disconnect`, `info`, `counters`, …).
    pub fn endpoint(&mut self) -> &mut Endpoint<RdmaTransport> {
        &mut self.endpoint
    }

    /// The next event.
    pub async fn next_event(&mut self) -> Result<Event, ConnError> {
        self.wait_for(|ep| ep.try_next_event().map(Ok)).await
    }

    /// The next accepted connection, once established (see [`Endpoint::accept`]).
    pub async fn accept(&mut self) -> Result<ConnectionId, ConnError> {
        self.wait_for(Endpoint::try_accept).await
    }

    /// Waits for `conn` to be established (see [`Endpoint::established`]).
    pub async fn established(&mut self, conn: ConnectionId) -> Result<EstablishedVia, ConnError> {
        self.wait_for(|ep| ep.try_established(conn)).await
    }

    /// The next message on `conn` (see [`Endpoint::recv`]).
    pub async fn recv(&mut self, conn: ConnectionId) -> Result<Vec<u8>, ConnError> {
        self.wait_for(|ep| ep.try_recv(conn)).await
    }

    /// Registers the endpoint's current descriptors if they changed (a device context
    /// opened or removed).
    fn sync_fds(&mut self) -> Result<(), ConnError> {
        let (transport, devices) = (self.endpoint.transport(), self.endpoint.devices());
        let current = std::iter::once(transport.channel_fd()).chain(
            devices
                .iter()
                .flat_map(|device| [device.async_fd(), device.completion_fd()]),
        );
        // Compared before anything is allocated: this runs on every wait.
        if current
            .clone()
            .map(|fd| fd.as_raw_fd())
            .eq(self.fds.iter().copied())
        {
            return Ok(());
        }
        self.watched.clear();
        self.fds.clear();
        for fd in current {
            let owned = fd.as_fd().try_clone_to_owned().map_err(readiness)?;
            self.watched.push(cm_sys::async_owned_fd(owned)?);
            self.fds.push(fd.as_raw_fd());
        }
        Ok(())
    }

    async fn wait_for<R>(
        &mut self,
        mut take: impl FnMut(&mut Endpoint<RdmaTransport>) -> Option<Result<R, ConnError>>,
    ) -> Result<R, ConnError> {
        loop {
            // What is already there is answered before anything is read.
            if let Some(found) = take(&mut self.endpoint) {
                return found;
            }
            let more = self.endpoint.process_pass()?;
            self.sync_fds()?;
            if let Some(found) = take(&mut self.endpoint) {
                return found;
            }
            if more {
                // A source had more than one pass takes: read again without clearing
                // its readiness (no new edge would come), letting other tasks run.
                tokio::task::yield_now().await;
                continue;
            }
            // A deadline beyond what the clock can count is no deadline.
            let deadline = self.endpoint.next_deadline().and_then(|d| {
                let left = d.saturating_sub(cm_core::Transport::now(self.endpoint.transport()));
                tokio::time::Instant::now().checked_add(left)
            });
            let watched = &self.watched;
            // Readiness is cleared only here, just before the endpoint reads every
            // source again, so no wake-up is lost between a read and the wait.
            let ready = poll_fn(|cx| {
                for fd in watched {
                    match fd.poll_read_ready(cx) {
                        Poll::Ready(Ok(mut guard)) => {
                            guard.clear_ready();
                            return Poll::Ready(Ok(()));
                        }
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending => {}
                    }
                }
                Poll::Pending
            });
            match deadline {
                Some(deadline) => {
                    tokio::select! {
                        result = ready => result.map_err(readiness)?,
                        () = tokio::time::sleep_until(deadline) => {}
                    }
                }
                None => ready.await.map_err(readiness)?,
            }
        }
    }
}
