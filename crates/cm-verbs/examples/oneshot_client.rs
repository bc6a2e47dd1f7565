//! A one-shot client: opens CONNECTIONS connections to ADDR from SOURCE, sends one
//! message on each as soon as it is established and disconnects as soon as that send
//! completed, without waiting for any answer. Its peers are often gone before the
//! server's `accept` returns: a server must still get each connection, its message and
//! its close.
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{ConnectOptions, Endpoint, Event};

/// What each connection sends, once.
const MESSAGE: &[u8] = b"one message, then gone";
/// How long a connection may take to get established before it counts as failed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1); // ADDR SOURCE [CONNECTIONS]
    let usage = "usage: oneshot_client ADDR SOURCE [CONNECTIONS]";
    let addr: SocketAddr = args.next().ok_or(usage)?.parse()?;
    let source: IpAddr = args.next().ok_or(usage)?.parse()?;
    let connections: usize = args.next().map_or(Ok(1), |n| n.parse())?;
    let mut client = Endpoint::new(RdmaTransport::new()?);
    let options = ConnectOptions {
        source: Some(SocketAddr::new(source, 0)),
        timeout: Some(CONNECT_TIMEOUT),
        ..ConnectOptions::default()
    };
    for _ in 0..connections {
        client.connect(addr, options.clone())?;
    }
    let (mut established, mut sent, mut failed) = (0, 0, 0);
    while sent + failed < connections {
        match client.next_event(None)? {
            Event::Established { conn, .. } => {
                established += 1;
                if let Err(error) = client.send(conn, MESSAGE) {
                    println!("{conn}: send failed: {error}");
                    client.disconnect(conn)?;
                    failed += 1;
                }
            }
            // The peer's queue pair has the message: leave at once.
            Event::Sent { conn, .. } => {
                client.disconnect(conn)?;
                sent += 1;
            }
            Event::Closed { conn, reason } => {
                println!("{conn}: closed before its message was sent: {reason:?}");
                failed += 1;
            }
            _ => {} // the server's echoes, device events: not waited for
        }
    }
    println!(
        "oneshot client: {connections} connections, {established} established, \
         {sent} messages sent, {failed} failed"
    );
    if sent < connections {
        return Err(format!("{failed} of {connections} connections failed").into());
    }
    Ok(())
}
