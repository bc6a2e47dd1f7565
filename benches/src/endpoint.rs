//! The connection API at scale on the simulated fabric: one echo round trip on one
//! connection while N others sit idle, written as a user writes it (`send`, `recv`).
//! The cost must not grow with N.

use std::time::Duration;

use cm_mock::sim::{SimConfig, SimFabric, SimPair, SimTransport};
use cm_verbs::{ConnectOptions, ConnectionId, Endpoint, Event, ListenOptions};

/// Idle connection counts of the echo bench (the first is the baseline).
pub const ECHO_IDLE_POINTS: [usize; 4] = [0, 1_000, 10_000, 100_000];

/// A server and a client endpoint with one working connection and `idle` others.
pub struct EchoFixture {
    fabric: SimFabric,
    server: Endpoint<SimTransport>,
    client: Endpoint<SimTransport>,
    server_conn: ConnectionId,
    client_conn: ConnectionId,
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
        const PORT: u16 = 7471;
        let SimPair {
            fabric,
            server,
            client,
        } = SimPair::new(SimConfig::default(), 1);
        let mut server = Endpoint::new(SimTransport::on_side(server));
        let mut client = Endpoint::new(SimTransport::on_side(client));
        let to = server.transport().addr(PORT);
        server
            .listen(to, ListenOptions::default())
            .expect("a fresh node listens");
        let mut client_conn = None;
        for _ in 0..=idle {
            client_conn = Some(
                client
                    .connect(to, ConnectOptions::default())
                    .expect("connect"),
            );
        }
        let client_conn = client_conn.expect("at least one connection");
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
}
