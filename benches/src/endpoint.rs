//! The connection API at scale on the simulated fabric: one echo round trip on one
//! connection while N others sit idle, written as a user writes it (`send`, `recv`).
//! The cost must not grow with N.

use std::time::Duration;

use cm_mock::sim::{SimAddr, SimConfig, SimFabric, SimTransport, SimTransports};
use cm_verbs::{ConnError, ConnectOptions, ConnectionId, Endpoint, Event, ListenOptions};

/// Figure key: the soak's resident memory at its end over its middle.
pub const SOAK_RSS_END_OVER_MIDDLE: &str = "soak/rss_end_over_middle";
/// Figure key: echo round trips per second with two endpoints on two threads over one
/// endpoint on one (simulated fabric).
pub const ECHO_THREADS_TWO_OVER_ONE: &str = "echo_threads/two_over_one";
/// Figure key: what the soak's server still holds at its end (queued + held).
pub const SOAK_QUEUED_END: &str = "soak/queued_end";

/// Idle connection counts of the echo bench (the first is the baseline).
pub const ECHO_IDLE_POINTS: [usize; 4] = [0, 1_000, 10_000, 100_000];

/// A server endpoint listening with `options` and a client endpoint, both on one fresh
/// simulated fabric (seed 1): where the endpoint benches start.
pub struct ListeningPair {
    /// The fabric both endpoints run on.
    pub fabric: SimFabric,
    /// The listening side.
    pub server: Endpoint<SimTransport>,
    /// The connecting side.
    pub client: Endpoint<SimTransport>,
    /// The listener's address.
    pub to: SimAddr,
}

impl ListeningPair {
    /// The listener's port.
    pub const PORT: u16 = 7471;

    /// Both endpoints, the server listening on [`ListeningPair::PORT`] with `options`.
    pub fn new(options: ListenOptions) -> Self {
        let SimTransports {
            fabric,
            server,
            client,
        } = SimTransports::new(SimConfig::default(), 1);
        let mut server = Endpoint::new(server);
        let client = Endpoint::new(client);
        let to = server.transport().addr(Self::PORT);
        server.listen(to, options).expect("a fresh node listens");
        ListeningPair {
            fabric,
            server,
            client,
            to,
        }
    }
}

/// A server and a client endpoint with one working connection and `idle` others.
pub struct EchoFixture {
    fabric: SimFabric,
    server: Endpoint<SimTransport>,
    client: Endpoint<SimTransport>,
    server_conn: ConnectionId,
    client_conn: ConnectionId,
    /// The client's idle connections.
    client_conns: Vec<ConnectionId>,
}

impl std::fmt::Debug for EchoFixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EchoFixture")
            .field("server", &self.server)
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

impl EchoFixture {
    /// Opens `idle + 1` connections and runs the fabric until all are established on
    /// both sides; the last one is the working connection.
    pub fn new(idle: usize) -> Self {
        // Every connection is opened at once: all of them in setup together.
        let ListeningPair {
            fabric,
            mut server,
            mut client,
            to,
        } = ListeningPair::new(ListenOptions {
            max_in_setup: u32::MAX,
            ..ListenOptions::default()
        });
        let mut client_conns: Vec<ConnectionId> = (0..=idle)
            .map(|_| {
                client
                    .connect(to, ConnectOptions::default())
                    .expect("connect")
            })
            .collect();
        let client_conn = client_conns.pop().expect("at least one connection");
        let mut established = 0;
        while established < 2 * (idle + 1) {
            for endpoint in [&mut server, &mut client] {
                while let Some(event) = endpoint.poll().expect("simulated endpoint") {
                    match event {
                        Event::Established { .. } => established += 1,
                        other => panic!("setting up: unexpected {other:?}"),
                    }
                }
            }
            if established < 2 * (idle + 1) && !fabric.step() {
                panic!(
                    "the fabric went idle with {established} of {} established",
                    2 * (idle + 1)
                );
            }
        }
        // The server's side of the working connection: the one its first message
        // arrives on.
        client.send(client_conn, b"which").expect("established");
        let server_conn = loop {
            fabric.step();
            if let Some(Event::Received { conn, .. }) = server.poll().expect("server") {
                break conn;
            }
        };
        EchoFixture {
            fabric,
            server,
            client,
            server_conn,
            client_conn,
            client_conns,
        }
    }

    /// One round trip: the client sends, the server receives and echoes, the client
    /// receives. Returns the echoed length.
    pub fn echo(&mut self, message: &[u8]) -> usize {
        self.client.send(self.client_conn, message).expect("send");
        let got = next_message(&self.fabric, &mut self.server, self.server_conn);
        self.server.send(self.server_conn, &got).expect("echo");
        next_message(&self.fabric, &mut self.client, self.client_conn).len()
    }

    /// Every connection of the client, the working one last.
    fn client_connections(&self) -> Vec<ConnectionId> {
        let mut conns = self.client_conns.clone();
        conns.push(self.client_conn);
        conns
    }

    /// Connections open on the server.
    pub fn server_connections(&self) -> usize {
        self.server.connection_count()
    }
}

/// Steps the fabric until `endpoint` has a message on `conn`.
fn next_message(
    fabric: &SimFabric,
    endpoint: &mut Endpoint<SimTransport>,
    conn: ConnectionId,
) -> Vec<u8> {
    loop {
        if let Ok(message) = endpoint.recv(conn, Some(Duration::ZERO)) {
            return message;
        }
        fabric.step();
    }
}

/// What a long-running server holds at one point of a soak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SoakSample {
    /// Messages echoed so far.
    pub messages: u64,
    /// Everything still to be reported or taken on the server
    /// ([`cm_verbs::EndpointStats::queued`]) plus its ready-queue entries.
    pub queued: usize,
    /// Messages received and not yet taken, on the server.
    pub held: usize,
    /// The process's resident memory, in bytes (0 where `/proc` is missing).
    pub rss: u64,
}

/// A soak: `messages` echoed over `connections` connections by an event-loop server
/// (`next_event`, echo every message) and client; samples at the start (after set-up),
/// the middle and the end.
pub fn soak(connections: usize, messages: u64) -> [SoakSample; 3] {
    assert!(connections > 0, "a soak needs a connection");
    let mut fixture = EchoFixture::new(connections - 1);
    let conns: Vec<ConnectionId> = fixture.client_connections();
    let sample = |fixture: &EchoFixture, messages| SoakSample {
        messages,
        queued: fixture.server.stats().queued() + fixture.server.stats().ready_entries,
        held: fixture.server.stats().held_messages,
        rss: resident_bytes(),
    };
    let start = sample(&fixture, 0);
    let mut middle = start;
    let (mut sent, mut echoed) = (0u64, 0u64);
    // Echoes the server's send pool had no buffer for yet, sent as buffers come free.
    let mut unsent: std::collections::VecDeque<(ConnectionId, Vec<u8>)> = Default::default();
    while echoed < messages {
        // Every connection sends one message; the server echoes what it gets; the
        // client takes the echoes. A send the shared send pool refuses waits for the
        // next round.
        for &conn in &conns {
            if sent < messages {
                // One payload throughout: the simulated wire stores each distinct
                // payload once, for the length of the run.
                match fixture.client.send(conn, b"soak") {
                    Ok(()) => sent += 1,
                    Err(ConnError::SendQueueFull(_)) => break,
                    Err(error) => panic!("send: {error}"),
                }
            }
        }
        while echoed < sent {
            fixture.fabric.step();
            while let Some(event) = fixture.server.poll().expect("server") {
                if let Event::Received { conn, data } = event {
                    unsent.push_back((conn, data));
                }
            }
            while let Some((conn, data)) = unsent.front() {
                match fixture.server.send(*conn, data) {
                    Ok(()) => drop(unsent.pop_front()),
                    Err(ConnError::SendQueueFull(_)) => break,
                    Err(error) => panic!("echo: {error}"),
                }
            }
            while let Some(event) = fixture.client.poll().expect("client") {
                if let Event::Received { .. } = event {
                    echoed += 1;
                    if echoed == messages / 2 {
                        middle = sample(&fixture, echoed);
                    }
                }
            }
        }
    }
    let end = sample(&fixture, echoed);
    [start, middle, end]
}

/// The process's resident set, from `/proc/self/statm` (0 where it cannot be read).
fn resident_bytes() -> u64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0);
    pages * 4096
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_echo_beside_idle_connections_comes_back_whole() {
        let mut fixture = EchoFixture::new(50);
        assert_eq!(fixture.server_connections(), 51);
        for _ in 0..100 {
            assert_eq!(fixture.echo(b"ping"), 4);
        }
        assert_eq!(fixture.server.stats().queued(), 0);
    }

    #[test]
    fn a_short_soak_holds_nothing_at_its_end() {
        let [start, middle, end] = soak(20, 2_000);
        assert_eq!(
            (start.messages, middle.messages, end.messages),
            (0, 1_000, 2_000)
        );
        assert!(end.queued <= 64 && end.held == 0, "{end:?}");
    }

    /// More connections than the shared send pool has buffers (256), each sending at
    /// once: refused sends wait for a buffer, and every message is still echoed.
    #[test]
    fn a_soak_wider_than_the_send_pool_echoes_everything() {
        let [_, _, end] = soak(400, 2_000);
        assert_eq!(end.messages, 2_000);
        assert!(end.queued <= 64 && end.held == 0, "{end:?}");
    }
}
