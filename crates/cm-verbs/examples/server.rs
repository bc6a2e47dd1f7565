//! An echo server: each connection is reported established once, lost RTUs included.
use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{ConnError, Endpoint, ListenOptions};

/// Serves `connections` clients on `addr`, one after the other, echoing each message.
pub(crate) fn serve(addr: std::net::SocketAddr, connections: usize) -> Result<(), ConnError> {
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
    let mut args = std::env::args().skip(1); // [ADDR [CONNECTIONS]]
    let addr = args.next().unwrap_or("10.77.1.1:7471".into()).parse()?;
    Ok(serve(addr, args.next().map_or(Ok(1), |n| n.parse())?)?)
}
