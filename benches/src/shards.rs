//! Accepts per second of a `cmnotify` server with one endpoint and with two, each
//! driven by its own thread (`--endpoints 2`: ports P and P + 1), in one run on one
//! machine: two of rdma-core's `cmtime` clients at once open N connections in all, both
//! to the one endpoint's port, or one to each endpoint's, so the clients are the same
//! in both runs; the rate is N over the longest client's connect step (cmtime's own
//! figure).
//! What a second core buys a server on one device, and what bounds it: in the VM both
//! the clients and the server share its two vCPUs, and the kernel's CM serves both
//! endpoints' requests on its own work queue.
//!
//! Needs what [`crate::reference`] needs; elsewhere the figure is skipped, with the
//! reason.

use std::net::IpAddr;
use std::process::{Command, Stdio};

use crate::reference::{cmnotify_server, parse_cmtime, wait_bounded, wait_listening};
use crate::results::Figure;

/// The key every figure of this bench starts with.
pub const KEY: &str = cm_testkit::figure_keys::REAL_SETUP_ENDPOINTS;

/// Ports from here up (the reference bench's are below).
const FIRST_PORT: u16 = 7700;
/// cmtime clients at once, whatever the endpoints.
const CLIENTS: u32 = 2;

/// Measures one endpoint, then two, at `n` connections.
pub fn measure(n: u32) -> Vec<Figure> {
    let Some(addrs) = cm_testkit::addresses("setup_endpoints") else {
        return vec![Figure::skipped(
            KEY,
            "no RDMA device (CMNOTIFY_ADDR_A/B unset)",
        )];
    };
    let one = accepts_per_second(addrs.addr_a, addrs.addr_b, FIRST_PORT, n, 1);
    let two = accepts_per_second(addrs.addr_a, addrs.addr_b, FIRST_PORT + 10, n, 2);
    match (one, two) {
        (Ok(one), Ok(two)) => {
            let note = format!("{n} connections from {CLIENTS} cmtime clients at once");
            vec![
                Figure::measured(&format!("{KEY}/one"), one, "accepts/s", &note),
                Figure::measured(&format!("{KEY}/two"), two, "accepts/s", &note),
                Figure::measured(
                    &format!("{KEY}/two_over_one"),
                    two / one,
                    "ratio",
                    &format!("{note}; 2 endpoints {two:.0}/s, 1 endpoint {one:.0}/s"),
                ),
            ]
        }
        (Err(e), _) | (_, Err(e)) => vec![Figure::skipped(KEY, &format!("failed: {e}"))],
    }
}

/// A `cmnotify` server of `endpoints` endpoints (ports `port..`) and [`CLIENTS`] cmtime
/// clients at once, spread over the ports, `n` connections in all: `n` over the slowest
/// client's connect step.
fn accepts_per_second(
    server_addr: IpAddr,
    client_addr: IpAddr,
    port: u16,
    n: u32,
    endpoints: u32,
) -> Result<f64, String> {
    let (addr, first, total) = (server_addr.to_string(), port.to_string(), n.to_string());
    let mut server = cmnotify_server(&addr, &first, &total);
    if endpoints > 1 {
        server.args(["--endpoints", &endpoints.to_string()]);
    }
    let server = server
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cmnotify: {e}"))?;
    let clients = (|| {
        for i in 0..endpoints {
            wait_listening(port + i as u16)?;
        }
        client_shares(n, endpoints)
            .into_iter()
            .map(|(endpoint, share)| {
                Command::new("cmtime")
                    .args(["-s", &addr, "-b", &client_addr.to_string()])
                    .args([
                        "-p",
                        &(port + endpoint as u16).to_string(),
                        "-c",
                        &share.to_string(),
                    ])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .map_err(|e| format!("cmtime client: {e}"))
            })
            .collect::<Result<Vec<_>, String>>()
    })();
    let clients = match clients {
        Ok(clients) => clients,
        Err(e) => {
            let _ = wait_bounded(server, "the cmnotify server");
            return Err(e);
        }
    };
    let mut slowest_ms: f64 = 0.0;
    let mut failure = None;
    for client in clients {
        match wait_bounded(client, "a cmtime client") {
            Ok(out) if out.status.success() => {
                match parse_cmtime(&String::from_utf8_lossy(&out.stdout)).get("connect") {
                    Some(row) => slowest_ms = slowest_ms.max(row.total_ms),
                    None => failure = Some("no connect row from a cmtime client".to_string()),
                }
            }
            Ok(out) => {
                failure = Some(format!(
                    "a cmtime client exited {}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
            Err(e) => failure = Some(e),
        }
    }
    let out = wait_bounded(server, "the cmnotify server")?;
    if let Some(failure) = failure {
        return Err(failure);
    }
    if !out.status.success() {
        return Err(format!(
            "the cmnotify server ({endpoints} endpoints) exited {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    if slowest_ms <= 0.0 {
        return Err("a connect step of no time".to_string());
    }
    Ok(f64::from(n) * 1000.0 / slowest_ms)
}

/// Each client's endpoint (client `i` connects to endpoint `i % endpoints`) and
/// connections: each endpoint's share as the server counts it (the first endpoints
/// take one more), split among its clients the same way.
fn client_shares(n: u32, endpoints: u32) -> Vec<(u32, u32)> {
    let share = |total: u32, parts: u32, i: u32| total / parts + u32::from(i < total % parts);
    (0..CLIENTS)
        .map(|i| {
            let endpoint = i % endpoints;
            let clients = (endpoint..CLIENTS).step_by(endpoints as usize).count() as u32;
            let of_endpoint = share(n, endpoints, endpoint);
            (endpoint, share(of_endpoint, clients, i / endpoints))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clients_share_out_each_endpoints_connections() {
        assert_eq!(client_shares(201, 1), [(0, 101), (0, 100)]);
        assert_eq!(client_shares(201, 2), [(0, 101), (1, 100)]);
        assert_eq!(client_shares(200, 2), [(0, 100), (1, 100)]);
    }
}
