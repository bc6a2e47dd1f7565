//! User-space instructions per connection of each server of [`mod@crate::reference`],
//! counted by callgrind inside the VM on the same binaries the wall-clock figures time:
//! rdma-core's `cmtime` server (librdmacm's own loop, written by hand in C) and the
//! default `cmnotify` server (the connection API).
//!
//! Wall clock under TCG measures the emulator as much as the code: two servers a few
//! percent apart in work swap places from run to run (single pairs of the connect step
//! range from 0.8 to 1.8 within one run). An instruction count does not depend on the
//! emulator's speed. Each server runs under `valgrind --tool=callgrind` twice, for a
//! small and a larger number of connections of the same `cmtime` client (outside
//! valgrind); the difference of the two totals over the difference of the connections
//! is what one more connection costs the server, every thread counted, without the
//! process's start, its listener and its exit. What stays uneven is the number of
//! wake-ups (how many events one read finds): two runs of the same build counted the
//! default cmnotify server at 23,409 and 24,792 instructions a connection.
//!
//! `cmnotify` exits by itself once its connections have closed; `cmtime`'s server runs
//! until killed, so it gets SIGTERM after its client finished (valgrind writes its
//! totals on a fatal signal too). Needs `valgrind` (with callgrind) on `PATH`, besides
//! what [`crate::reference::measure`] needs; without it the figures are recorded as
//! skipped with the reason.

use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::reference::{run_client, wait_bounded, wait_listening_within, Server};
use crate::results::Figure;

/// How long a server under valgrind may take to start listening (valgrind reads every
/// library's symbols first, which takes seconds under TCG).
const VALGRIND_LISTEN_WAIT: Duration = Duration::from_secs(120);

/// The servers counted, the reference first, each of ours with the suffix of its ratio's
/// key: the default one and the one that makes every QP on its request (what the QPs
/// made ahead cost in work, where wall clock could not tell).
const SERVERS: [(Server, &str); 3] = [
    (Server::Cmtime, ""),
    (Server::Cmnotify, ""),
    (Server::CmnotifyOnRequest, "_on_request"),
];

/// Reads callgrind's total (`==PID== Collected : N`) from valgrind's stderr.
pub fn parse_collected(stderr: &str) -> Option<u64> {
    stderr.lines().find_map(|line| {
        let (_, after) = line.split_once("Collected :")?;
        after.trim().parse().ok()
    })
}

/// Instructions per connection: the difference of two runs' totals over the difference
/// of their connections, or `None` when the larger run counted no more than the smaller.
pub fn per_connection(low: (u32, u64), high: (u32, u64)) -> Option<f64> {
    let connections = high.0.checked_sub(low.0).filter(|&n| n > 0)?;
    let instructions = high.1.checked_sub(low.1)?;
    Some(instructions as f64 / f64::from(connections))
}

/// One server under callgrind with `connections` from one `cmtime` client: its total
/// user-space instructions.
fn count_run(
    server: Server,
    server_addr: IpAddr,
    client_addr: IpAddr,
    port: u16,
    connections: u32,
) -> Result<u64, String> {
    let inner = server.command(server_addr, port, connections);
    let child = Command::new("valgrind")
        .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
        .arg(inner.get_program())
        .args(inner.get_args())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("valgrind {}: {e}", server.name()))?;
    let pid = child.id();
    let client = wait_listening_within(port, VALGRIND_LISTEN_WAIT)
        .and_then(|()| run_client(server, server_addr, client_addr, port, connections));
    if server == Server::Cmtime || client.is_err() {
        // cmtime's server never exits by itself; a failed run's server neither.
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
    let out = wait_bounded(child, &format!("{} under valgrind", server.name()))?;
    client?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    parse_collected(&stderr).ok_or_else(|| {
        format!(
            "no callgrind total from {} (exit {}): {}",
            server.name(),
            out.status,
            stderr.lines().rev().take(5).collect::<Vec<_>>().join(" / ")
        )
    })
}

/// Counts each server at `low` and `high` connections (ports from `first_port` up) and
/// returns the per-connection figures and the ratio `cmnotify / cmtime`; without the
/// VM's addresses or without valgrind, one skipped figure saying why.
pub fn measure(low: u32, high: u32, first_port: u16) -> Vec<Figure> {
    let key = cm_testkit::figure_keys::REAL_SETUP_INSTRUCTIONS;
    let Some(addrs) = cm_testkit::addresses("setup_vs_cmtime instructions") else {
        return vec![Figure::skipped(
            key,
            "no RDMA device (CMNOTIFY_ADDR_A/B unset)",
        )];
    };
    let valgrind = match Command::new("valgrind")
        .args(["--tool=callgrind", "--version"])
        .output()
    {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "valgrind --tool=callgrind --version exited {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("no valgrind on PATH: {e}")),
    };
    if let Err(reason) = valgrind {
        return vec![Figure::skipped(key, &reason)];
    }
    let mut port = first_port;
    let mut per_conn = Vec::new();
    for (server, _) in SERVERS {
        let mut count = |connections| {
            port += 1;
            count_run(server, addrs.addr_a, addrs.addr_b, port, connections)
                .map(|total| (connections, total))
        };
        let counted = count(low).and_then(|low| Ok((low, count(high)?)));
        match counted {
            Ok((low_run, high_run)) => match per_connection(low_run, high_run) {
                Some(value) => per_conn.push((server, value, low_run.1, high_run.1)),
                None => {
                    return vec![Figure::skipped(
                        key,
                        &format!(
                            "failed: {} counted {} at {low} and {} at {high} connections",
                            server.name(),
                            low_run.1,
                            high_run.1
                        ),
                    )]
                }
            },
            Err(e) => return vec![Figure::skipped(key, &format!("failed: {e}"))],
        }
    }
    let mut figures: Vec<Figure> = per_conn
        .iter()
        .map(|&(server, value, at_low, at_high)| {
            Figure::measured(
                &format!("{key}/{}", server.name()),
                value.round(),
                "instructions",
                &format!(
                    "user-space instructions per connection, {} server, callgrind \
                     (every thread): ({at_high} at {high} − {at_low} at {low} connections) \
                     / {}",
                    server.name(),
                    high - low
                ),
            )
        })
        .collect();
    let reference = per_conn[0].1;
    for ((server, suffix), &(_, ours, ..)) in SERVERS.iter().zip(&per_conn).skip(1) {
        figures.push(Figure::measured(
            &format!("{key}/ratio{suffix}"),
            ours / reference,
            "ratio",
            &format!(
                "user-space instructions per connection, {} server / cmtime server \
                 (repeatable within a few percent: the wake-ups vary)",
                server.name()
            ),
        ));
    }
    figures
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callgrinds_total_is_read_from_its_summary() {
        let stderr = "==24018== Events    : Ir\n==24018== Collected : 300287\n==24018== \n\
                      ==24018== I   refs:      300,287\n";
        assert_eq!(parse_collected(stderr), Some(300_287));
        assert_eq!(parse_collected("==1== Command: cmtime\n"), None);
    }

    #[test]
    fn a_connection_costs_the_difference_over_the_difference() {
        assert_eq!(
            per_connection((20, 1_000_000), (60, 3_000_000)),
            Some(50_000.0)
        );
        assert_eq!(
            per_connection((20, 3_000_000), (60, 1_000_000)),
            None,
            "fewer"
        );
        assert_eq!(
            per_connection((20, 1), (20, 2)),
            None,
            "no more connections"
        );
    }
}
