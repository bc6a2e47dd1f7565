//! An echo server: each connection is reported established once, lost RTUs included.
use std::net::SocketAddr;

use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{ConnError, Endpoint, ListenOptions};

/// Serves `connections` clients on `addr`, one after the other, echoing each message.
pub(crate) fn serve(addr: SocketAddr, connections: usize) -> Result<(), ConnError> {
    let mut server = Endpoint::new(RdmaTransport::new()?);
    server.listen(addr, ListenOptions::default())?;
    for _ in 0..connections {
        let conn = server.accept(None)?; // a late RTU is rescued before this returns
        let via = server.established(conn, None)?;
        println!("{conn}: established via {via:?}");
        while let Ok(message) = server.recv(conn, None) {
            server.send(conn, &message).ok(); // until the client leaves, before sending or not
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args().nth(1).unwrap_or("10.77.1.1:7471".into());
    Ok(serve(addr.parse()?, 1)?)
}
