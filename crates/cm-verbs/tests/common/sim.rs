//! What the simulated-fabric tests of the connection API share: two endpoints on a
//! fresh fabric with the server listening, and the loop that brings connections up on
//! both sides. A test binary includes it by path (`#[path = "common/sim.rs"]`), not
//! through `mod common`: that module is the real-device tests' and needs `rdma`, where
//! these tests build with no feature.
#![allow(dead_code)] // each test binary uses its own part

use cm_mock::sim::{SimAddr, SimConfig, SimFabric, SimTransport, SimTransports};
use cm_verbs::{ConnectionId, Endpoint, EndpointOptions, Event, ListenOptions};

/// Two endpoints on one simulated fabric, the server listening; nothing connects yet,
/// so that each test asks for its own connections and sees them from the start.
pub(crate) struct SimEndpoints {
    /// The fabric: the tests step it themselves.
    pub(crate) fabric: SimFabric,
    /// Node 0's endpoint, listening on `addr`.
    pub(crate) server: Endpoint<SimTransport>,
    /// Node 1's endpoint.
    pub(crate) client: Endpoint<SimTransport>,
    /// Where the server listens.
    pub(crate) addr: SimAddr,
}

/// A fresh fabric (default config, `seed`), both endpoints made with `options`, the
/// server listening on `port` with the default listen options.
pub(crate) fn listening(seed: u64, port: u16, options: EndpointOptions) -> SimEndpoints {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), seed);
    let mut server = Endpoint::with_options(server, options);
    let client = Endpoint::with_options(client, options);
    let addr = server.transport().addr(port);
    server.listen(addr, ListenOptions::default()).unwrap();
    SimEndpoints {
        fabric,
        server,
        client,
        addr,
    }
}

/// Reads every event of the server, then of the client, and steps the fabric, until
/// each side has reported `n` connections established; the server's, in that order.
/// Other events are dropped: the callers look at nothing else until then.
///
/// # Panics
///
/// When the fabric runs out of work first.
pub(crate) fn establish(
    fabric: &SimFabric,
    server: &mut Endpoint<SimTransport>,
    client: &mut Endpoint<SimTransport>,
    n: usize,
) -> Vec<ConnectionId> {
    let mut accepted = Vec::with_capacity(n);
    let mut client_established = 0;
    loop {
        while let Some(event) = server.poll().expect("server poll") {
            if let Event::Established { conn, .. } = event {
                accepted.push(conn);
            }
        }
        while let Some(event) = client.poll().expect("client poll") {
            client_established += usize::from(matches!(event, Event::Established { .. }));
        }
        if accepted.len() >= n && client_established >= n {
            return accepted;
        }
        assert!(
            fabric.step(),
            "{} of {n} established on the server, {client_established} on the client",
            accepted.len()
        );
    }
}
