//! A concurrent echo server on one thread: every connection at once, through
//! `next_event`; lost RTUs are rescued before their `Established` is reported.
use std::collections::{HashMap, VecDeque};

use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{ConnError, ConnectionId, Endpoint, Event, ListenOptions};

/// Echoes waiting for a free send buffer, per connection.
type Backlog = HashMap<ConnectionId, VecDeque<Vec<u8>>>;

/// Sends what `conn` has waiting, until its send buffers are all in flight.
fn flush(server: &mut Endpoint<RdmaTransport>, backlog: &mut Backlog, conn: ConnectionId) {
    let Some(waiting) = backlog.get_mut(&conn) else {
        return;
    };
    while let Some(message) = waiting.front() {
        match server.send(conn, message) {
            Ok(()) => drop(waiting.pop_front()),
            Err(ConnError::SendQueueFull(_)) => return, // a later Event::Sent frees one
            Err(_) => return drop(backlog.remove(&conn)), // the connection is gone
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1); // [ADDR [CONNECTIONS]]: ends after that many
    let addr = args.next().unwrap_or("10.77.1.1:7471".into()).parse()?;
    let mut left: usize = args.next().map_or(Ok(usize::MAX), |n| n.parse())?;
    let mut server = Endpoint::new(RdmaTransport::new()?);
    server.listen(addr, ListenOptions::default())?;
    let mut backlog = Backlog::new();
    while left > 0 {
        let event = server.next_event(None)?;
        match event {
            Event::Established { conn, via, .. } => println!("{conn}: established via {via:?}"),
            Event::Received { conn, data } => {
                backlog.entry(conn).or_default().push_back(data);
                flush(&mut server, &mut backlog, conn);
            }
            Event::Sent { conn, .. } => flush(&mut server, &mut backlog, conn),
            Event::Closed { conn, reason } => {
                println!("{conn}: closed ({reason:?})");
                backlog.remove(&conn);
                left -= 1;
            }
            _ => {} // requests, device events: nothing to answer here
        }
    }
    Ok(())
}
