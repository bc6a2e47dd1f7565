//! An echo server. Every connection is reported established exactly once, lost RTUs
//! included: the endpoint forwards COMM_EST or the first receive with rdma_notify.
use std::net::SocketAddr;

use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{ConnError, Endpoint, ListenOptions};

/// Accepts `connections` connections on `addr` and echoes one message on each.
pub(crate) fn serve(addr: SocketAddr, connections: usize) -> Result<(), ConnError> {
    let mut server = Endpoint::new(RdmaTransport::new()?);
    server.listen(addr, ListenOptions::default())?;
    for _ in 0..connections {
        let conn = server.accept(None)?; // a late RTU is rescued before this returns
        let via = server.info(conn)?.established;
        println!("{conn}: established via {via:?}");
        let message = server.recv(conn, None)?;
        server.send(conn, &message)?;
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args().nth(1).unwrap_or("10.77.1.1:7471".into());
    Ok(serve(addr.parse()?, 1)?)
}
