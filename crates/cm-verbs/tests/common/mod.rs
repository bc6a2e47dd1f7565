//! What the real-device tests of the connection API share: endpoints on the real
//! backend and a client connection from the VM's second address.
#![allow(dead_code)] // each test binary uses its own part

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{ConnectOptions, ConnectionId, Endpoint};

/// How long a device test waits for any one step.
pub(crate) const WAIT: Option<Duration> = Some(Duration::from_secs(60));

/// An endpoint on the real backend.
pub(crate) fn endpoint() -> Endpoint<RdmaTransport> {
    Endpoint::new(RdmaTransport::new().expect("an RDMA transport"))
}

/// Connect options resolving from `src` (any port).
pub(crate) fn from(src: IpAddr) -> ConnectOptions<SocketAddr> {
    ConnectOptions {
        source: Some(SocketAddr::new(src, 0)),
        ..ConnectOptions::default()
    }
}

/// Connects `client` from `src` to `dst` and waits until it is established.
pub(crate) fn connected(
    client: &mut Endpoint<RdmaTransport>,
    src: IpAddr,
    dst: SocketAddr,
) -> ConnectionId {
    let conn = client.connect(dst, from(src)).expect("connect");
    client.established(conn, WAIT).expect("client established");
    conn
}
