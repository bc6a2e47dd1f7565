//! The data path against perftest, in one run on the same devices: a message round trip
//! (64 bytes, one at a time) and the throughput of 4 KiB messages, through the
//! `Endpoint` API (a client endpoint on B, an echoing server endpoint on A, each on its
//! own thread) against rdma-core's `ib_send_lat` and `ib_send_bw` (perftest, connected
//! with the RDMA CM, `-R`). Without perftest on `PATH` the perftest half is skipped with
//! the reason, and the Endpoint half still measured.
//!
//! What differs, by design. perftest posts work requests on memory it registered once;
//! the endpoint copies each message into one of its registered buffers (`send(&[u8])`)
//! and hands each received message over as a `Vec`. Waiting is compared with waiting
//! (the endpoint in `poll(2)` against `ib_send_lat -e` on its completion channel) and
//! spinning with spinning (the endpoint busy polling, which reads the shared completion
//! queues itself and leaves them unarmed meanwhile, against `ib_send_lat`). The
//! throughput keeps at most 64 messages (`WINDOW`) unacknowledged (the server acknowledges
//! every half window): on shared receive queues a peer that sends past the receiver's
//! depth is closed (`ReceiveOverrun`), so the sender needs credits, as any protocol over
//! SEND does; `ib_send_bw` posts 512 receives and lets RNR retries absorb the rest.

use std::net::SocketAddr;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{
    ConnError, ConnectOptions, ConnectionId, Endpoint, Event, ListenOptions, QueueCaps,
};

use super::fixture::{Setup, WAIT};
use super::stats::median;
use crate::results::{record, Figure};

/// Bytes of one round-trip message (perftest's `-s`).
const ROUND_TRIP_BYTES: usize = 64;
/// Bytes of one throughput message.
const STREAM_BYTES: usize = 4096;
/// Messages the sender may have unacknowledged; the receive depth of both sides.
const WINDOW: u32 = 64;
/// How long the busy-polling endpoint spins before it would sleep.
const BUSY_POLL: Duration = Duration::from_millis(20);
/// The port of perftest's bandwidth server (its default); the latency servers take the
/// next ones.
const PERFTEST_PORT: u16 = 18_515;

/// The first byte of a message to the server says what it wants.
const ECHO: u8 = b'E';
const STREAM: u8 = b'S';
/// The server's acknowledgement of half a window of stream messages.
const ACK: u8 = b'A';
/// Turns busy polling on in the server.
const BUSY: u8 = b'B';

/// Figures of the data path.
#[derive(Debug, Clone)]
pub struct DataFigures {
    /// Median round trip of a 64-byte message through the endpoints, waiting, ns.
    pub round_trip_ns: f64,
    /// The same with busy polling on both sides, ns.
    pub round_trip_busy_ns: f64,
    /// Throughput of 4 KiB messages through the endpoints, MB/s (10^6 bytes).
    pub stream_mb_s: f64,
    /// `ib_send_lat -R -s 64`: the median round trip (twice its typical one-way
    /// latency), ns; or why it is missing.
    pub perftest_round_trip_ns: Result<f64, String>,
    /// The same with `-e`: perftest waiting on its completion channel, as the endpoint
    /// does unless busy polling.
    pub perftest_round_trip_events_ns: Result<f64, String>,
    /// `ib_send_bw -R -s 4096`: the average bandwidth, MB/s; or why it is missing.
    pub perftest_mb_s: Result<f64, String>,
    /// Round trips and stream messages measured.
    pub round_trips: usize,
    /// Stream messages sent.
    pub messages: usize,
}

fn caps() -> QueueCaps {
    QueueCaps {
        recv_depth: WINDOW,
        send_depth: WINDOW,
        ..QueueCaps::default()
    }
}

/// `op: error` for the endpoint's errors.
fn conn_err(op: &str) -> impl Fn(ConnError) -> String + '_ {
    move |e| format!("{op}: {e}")
}

/// Measures `round_trips` round trips (waiting, then busy polling) and a stream of
/// `messages` through the endpoints, then perftest's two figures.
pub fn measure(setup: &Setup, round_trips: usize, messages: usize) -> Result<DataFigures, String> {
    let (addr_tx, addr_rx) = mpsc::channel();
    let listen = SocketAddr::new(setup.addrs.addr_a, 0);
    let server = std::thread::spawn(move || serve(listen, &addr_tx));
    let addr = addr_rx
        .recv_timeout(WAIT)
        .map_err(|_| "the data server did not listen".to_string())??;
    let client = run_client(setup, addr, round_trips, messages);
    let messages = client.as_ref().map_or(messages, |f| f.messages);
    let served = server
        .join()
        .map_err(|_| "the data server panicked".to_string())?;
    let mut figures = client?;
    served?;
    figures.perftest_round_trip_ns = perftest_round_trip(setup, round_trips, false);
    figures.perftest_round_trip_events_ns = perftest_round_trip(setup, round_trips, true);
    figures.perftest_mb_s = perftest_bandwidth(setup, messages);
    Ok(figures)
}

/// The server: one connection, echoing ECHO messages, acknowledging every half window
/// of STREAM messages, until the client leaves.
fn serve(
    listen: SocketAddr,
    addr: &mpsc::Sender<Result<SocketAddr, String>>,
) -> Result<(), String> {
    let started = (|| -> Result<_, String> {
        let transport = RdmaTransport::new().map_err(|e| format!("RdmaTransport::new: {e}"))?;
        let mut endpoint = Endpoint::new(transport);
        let options = ListenOptions {
            caps: caps(),
            ..ListenOptions::default()
        };
        let listener = endpoint
            .listen(listen, options)
            .map_err(conn_err("listen"))?;
        let bound = endpoint
            .listener_addr(listener)
            .map_err(conn_err("listener_addr"))?
            .ok_or("the listener has no address")?;
        Ok((endpoint, bound))
    })();
    let mut endpoint = match started {
        Ok((endpoint, bound)) => {
            let _ = addr.send(Ok(bound));
            endpoint
        }
        Err(error) => {
            let _ = addr.send(Err(error.clone()));
            return Err(error);
        }
    };
    let mut streamed = 0u32;
    loop {
        match endpoint
            .next_event(Some(WAIT))
            .map_err(conn_err("server next_event"))?
        {
            Event::Received { conn, data } => match data.first() {
                Some(&ECHO) => send_waiting(&mut endpoint, conn, &data)?,
                Some(&STREAM) => {
                    streamed += 1;
                    if streamed % (WINDOW / 2) == 0 {
                        send_waiting(&mut endpoint, conn, &[ACK])?;
                    }
                }
                Some(&BUSY) => {
                    endpoint.set_busy_poll(Some(BUSY_POLL));
                    send_waiting(&mut endpoint, conn, &[BUSY])?;
                }
                other => return Err(format!("the server got {other:?}")),
            },
            Event::Closed { .. } => return Ok(()),
            _ => {}
        }
    }
}

/// Sends `data` on `conn`, waiting for a free buffer when all are in flight.
fn send_waiting(
    endpoint: &mut Endpoint<RdmaTransport>,
    conn: ConnectionId,
    data: &[u8],
) -> Result<(), String> {
    loop {
        match endpoint.send(conn, data) {
            Ok(()) => return Ok(()),
            Err(ConnError::SendQueueFull(_)) => {
                // A send completion frees a buffer; what else comes is not expected here.
                match endpoint
                    .next_event(Some(WAIT))
                    .map_err(conn_err("next_event"))?
                {
                    Event::Sent { .. } => {}
                    other => return Err(format!("waiting for a send buffer: {other:?}")),
                }
            }
            Err(error) => return Err(conn_err("send")(error)),
        }
    }
}

/// The next message on the client's connection (other events skipped).
fn next_message(endpoint: &mut Endpoint<RdmaTransport>) -> Result<Vec<u8>, String> {
    loop {
        match endpoint
            .next_event(Some(WAIT))
            .map_err(conn_err("client next_event"))?
        {
            Event::Received { data, .. } => return Ok(data),
            Event::Closed { reason, .. } => return Err(format!("the client closed: {reason:?}")),
            _ => {}
        }
    }
}

fn run_client(
    setup: &Setup,
    addr: SocketAddr,
    round_trips: usize,
    messages: usize,
) -> Result<DataFigures, String> {
    // Whole acknowledgements: the server acknowledges every half window.
    let half = WINDOW as usize / 2;
    let messages = messages.div_ceil(half).max(1) * half;
    let transport = RdmaTransport::new().map_err(|e| format!("RdmaTransport::new: {e}"))?;
    let mut endpoint = Endpoint::new(transport);
    let options = ConnectOptions {
        source: Some(SocketAddr::new(setup.addrs.addr_b, 0)),
        caps: caps(),
        ..ConnectOptions::default()
    };
    let conn = endpoint
        .connect(addr, options)
        .map_err(conn_err("connect"))?;
    endpoint
        .established(conn, Some(WAIT))
        .map_err(conn_err("established"))?;
    let mut figures = DataFigures {
        round_trip_ns: 0.0,
        round_trip_busy_ns: 0.0,
        stream_mb_s: 0.0,
        perftest_round_trip_ns: Err("not run".into()),
        perftest_round_trip_events_ns: Err("not run".into()),
        perftest_mb_s: Err("not run".into()),
        round_trips,
        messages,
    };
    let mut message = vec![0u8; ROUND_TRIP_BYTES];
    message[0] = ECHO;
    let round_trip = |endpoint: &mut Endpoint<RdmaTransport>| -> Result<f64, String> {
        let mut samples = Vec::with_capacity(round_trips);
        for n in 0..round_trips + round_trips / 10 {
            let start = Instant::now();
            send_waiting(endpoint, conn, &message)?;
            let echo = next_message(endpoint)?;
            let took = start.elapsed();
            if echo.len() != ROUND_TRIP_BYTES {
                return Err(format!("an echo of {} bytes", echo.len()));
            }
            // The first tenth warms up.
            if n >= round_trips / 10 {
                samples.push(took);
            }
        }
        Ok(median(&mut samples).as_secs_f64() * 1e9)
    };
    figures.round_trip_ns = round_trip(&mut endpoint)?;
    send_waiting(&mut endpoint, conn, &[BUSY])?;
    if next_message(&mut endpoint)? != [BUSY] {
        return Err("the server did not turn busy polling on".into());
    }
    endpoint.set_busy_poll(Some(BUSY_POLL));
    figures.round_trip_busy_ns = round_trip(&mut endpoint)?;

    let mut chunk = vec![0u8; STREAM_BYTES];
    chunk[0] = STREAM;
    let start = Instant::now();
    let (mut sent, mut acked) = (0usize, 0usize);
    while acked < messages {
        if sent < messages && sent - acked < WINDOW as usize {
            match endpoint.send(conn, &chunk) {
                Ok(()) => {
                    sent += 1;
                    continue;
                }
                Err(ConnError::SendQueueFull(_)) => {}
                Err(error) => return Err(conn_err("stream send")(error)),
            }
        }
        match endpoint
            .next_event(Some(WAIT))
            .map_err(conn_err("stream next_event"))?
        {
            Event::Received { data, .. } if data == [ACK] => acked += half,
            Event::Received { data, .. } => return Err(format!("the stream got {data:?}")),
            Event::Closed { reason, .. } => return Err(format!("the stream closed: {reason:?}")),
            _ => {}
        }
    }
    let took = start.elapsed().as_secs_f64();
    figures.stream_mb_s = (messages * STREAM_BYTES) as f64 / took / 1e6;
    endpoint.disconnect(conn).map_err(conn_err("disconnect"))?;
    Ok(figures)
}

/// Records the data-path figures (or why they are missing); returns them.
pub fn record_figures(result: &Result<DataFigures, String>, machine: &str) -> Vec<Figure> {
    let key = cm_testkit::figure_keys::REAL_DATA_PATH;
    let mut out = Vec::new();
    match result {
        Err(reason) => out.push(Figure::skipped(key, reason)),
        Ok(f) => {
            let rounds = format!("{} round trips of {ROUND_TRIP_BYTES} B", f.round_trips);
            let stream = format!(
                "{} messages of {STREAM_BYTES} B, at most {WINDOW} unacknowledged",
                f.messages
            );
            against_perftest(
                &mut out,
                &format!("{key}/round_trip_busy"),
                (f.round_trip_busy_ns, "ns", &rounds),
                &f.perftest_round_trip_ns,
                machine,
                |perftest| {
                    format!(
                        "message round trip, medians: Endpoint busy polling {:.1} µs / \
                         ib_send_lat -R spinning {:.1} µs (twice its typical latency; \
                         {rounds}); {machine}",
                        f.round_trip_busy_ns / 1e3,
                        perftest / 1e3
                    )
                },
            );
            against_perftest(
                &mut out,
                &format!("{key}/round_trip"),
                (f.round_trip_ns, "ns", &rounds),
                &f.perftest_round_trip_events_ns,
                machine,
                |perftest| {
                    format!(
                        "message round trip, medians: Endpoint waiting in poll(2) {:.1} µs / \
                         ib_send_lat -R -e waiting on its completion channel {:.1} µs \
                         ({rounds}); {machine}",
                        f.round_trip_ns / 1e3,
                        perftest / 1e3
                    )
                },
            );
            against_perftest(
                &mut out,
                &format!("{key}/throughput"),
                (f.stream_mb_s, "MB/s", &stream),
                &f.perftest_mb_s,
                machine,
                |perftest| {
                    format!(
                        "4 KiB SEND throughput: Endpoint {:.0} MB/s / ib_send_bw -R {:.0} MB/s \
                         ({stream}); {machine}",
                        f.stream_mb_s, perftest
                    )
                },
            );
        }
    }
    for figure in &out {
        record(figure);
    }
    out
}

/// Figure `key`: ours / perftest's (`note` says both), or, when perftest gave no usable
/// figure, a skip saying why beside our own measure as `<key>/endpoint` (`ours`: the
/// value, its unit and what was measured).
fn against_perftest(
    out: &mut Vec<Figure>,
    key: &str,
    ours: (f64, &str, &str),
    perftest: &Result<f64, String>,
    machine: &str,
    note: impl FnOnce(f64) -> String,
) {
    let (value, unit, measured) = ours;
    match perftest {
        Ok(perftest) => out.push(Figure::measured(
            key,
            value / perftest,
            "ratio",
            &note(*perftest),
        )),
        Err(reason) => {
            out.push(Figure::skipped(key, reason));
            out.push(Figure::measured(
                &format!("{key}/endpoint"),
                value,
                unit,
                &format!("{measured}; {machine}"),
            ));
        }
    }
}

/// How long one perftest run may take before it is taken as hung and killed.
const PERFTEST_LIMIT: Duration = Duration::from_secs(60);

/// Waits for `child` at most `limit`; killed past it. Its exit status and output, or
/// why it was killed with what it had printed.
fn finish(mut child: Child, limit: Duration) -> Result<Output, String> {
    let deadline = Instant::now() + limit;
    while child.try_wait().map_err(|e| e.to_string())?.is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().map_err(|e| e.to_string())?;
            return Err(format!("killed after {limit:?}: {}", printed(&out)));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().map_err(|e| e.to_string())
}

/// What a process printed, both streams.
fn printed(out: &Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    text.trim().to_owned()
}

/// Runs perftest's `tool` as a server on A and a client from B, with `args` on both,
/// each bounded by [`PERFTEST_LIMIT`]; returns the client's standard output.
fn perftest(setup: &Setup, tool: &str, port: u16, args: &[&str]) -> Result<String, String> {
    let port = port.to_string();
    let side = |addr: std::net::IpAddr| {
        let mut command = Command::new(tool);
        command
            .args(["-R", "-p", &port, "--source_ip", &addr.to_string()])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    };
    let mut server = side(setup.addrs.addr_a)
        .spawn()
        .map_err(|e| format!("{tool} not run ({e}): perftest is not on PATH"))?;
    // The server listens within a moment; the client retries its connect meanwhile.
    let mut last = String::new();
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let client = side(setup.addrs.addr_b)
            .arg(setup.addrs.addr_a.to_string())
            .spawn()
            .map_err(|e| format!("{tool}: {e}"))?;
        match finish(client, PERFTEST_LIMIT) {
            Ok(out) if out.status.success() => {
                // Its report is the client's; the server ends on its own.
                let _ = finish(server, PERFTEST_LIMIT);
                return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
            }
            Ok(out) => last = printed(&out),
            Err(killed) => {
                last = killed;
                break;
            }
        }
        if server.try_wait().ok().flatten().is_some() {
            break;
        }
    }
    let _ = server.kill();
    let served = finish(server, PERFTEST_LIMIT).map_or_else(|e| e, |out| printed(&out));
    Err(format!("{tool} failed: client: {last}; server: {served}"))
}

/// The numbers of the result line of a perftest table: the line whose first field is
/// `bytes`.
fn result_line(output: &str, bytes: usize) -> Option<Vec<f64>> {
    output.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.first() == Some(&bytes.to_string().as_str()))
            .then(|| fields.iter().filter_map(|f| f.parse().ok()).collect())
    })
}

/// `ib_send_lat`'s median round trip, spinning or (`events`) waiting on its completion
/// channel (`-e`).
fn perftest_round_trip(setup: &Setup, round_trips: usize, events: bool) -> Result<f64, String> {
    let iterations = round_trips.to_string();
    let size = ROUND_TRIP_BYTES.to_string();
    let mut args = vec!["-s", &size, "-n", &iterations];
    if events {
        args.push("-e");
    }
    // Its own port: a server of the run before may still be going away.
    let port = PERFTEST_PORT + u16::from(events) + 2;
    let output = perftest(setup, "ib_send_lat", port, &args)?;
    // #bytes #iterations t_min t_max t_typical t_avg ...: the typical (median) one-way
    // latency in µs, half of its ping-pong's round trip.
    let numbers = result_line(&output, ROUND_TRIP_BYTES)
        .ok_or_else(|| format!("no result line in ib_send_lat's output: {output}"))?;
    let typical = numbers
        .get(4)
        .copied()
        .filter(|t| t.is_finite() && *t > 0.0)
        .ok_or_else(|| format!("no usable t_typical in {numbers:?}: {output}"))?;
    Ok(typical * 2.0 * 1e3)
}

fn perftest_bandwidth(setup: &Setup, messages: usize) -> Result<f64, String> {
    let iterations = messages.to_string();
    let size = STREAM_BYTES.to_string();
    let output = perftest(
        setup,
        "ib_send_bw",
        PERFTEST_PORT + 1,
        &["-s", &size, "-n", &iterations],
    )?;
    // #bytes #iterations BW_peak BW_average MsgRate: MB/s (10^6 bytes, perftest's
    // default unit).
    let numbers = result_line(&output, STREAM_BYTES)
        .ok_or_else(|| format!("no result line in ib_send_bw's output: {output}"))?;
    numbers
        .get(3)
        .copied()
        .filter(|bw| bw.is_finite() && *bw > 0.0)
        .ok_or_else(|| format!("no usable BW average in {numbers:?}: {output}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perftest_tables_are_read_by_their_size() {
        let lat =
            " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]\n \
                   64      1000          5.10           40.2         6.25             6.61\n";
        assert_eq!(
            result_line(lat, 64),
            Some(vec![64.0, 1000.0, 5.10, 40.2, 6.25, 6.61])
        );
        let bw =
            " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
                  4096       5000             1100.5             1050.25              0.268\n";
        assert_eq!(
            result_line(bw, 4096).and_then(|n| n.get(3).copied()),
            Some(1050.25)
        );
        assert_eq!(result_line(bw, 64), None);
    }

    #[test]
    fn a_figure_against_perftest_is_a_ratio_or_a_skip_beside_our_own_measure() {
        let mut out = Vec::new();
        let ours = (300.0, "ns", "10 round trips");
        against_perftest(&mut out, "k/rt", ours, &Ok(100.0), "m", |p| {
            format!("vs {p}")
        });
        against_perftest(
            &mut out,
            "k/bw",
            ours,
            &Err("no perftest".into()),
            "m",
            |_| unreachable!("no ratio without perftest's figure"),
        );
        let seen: Vec<(&str, Option<f64>, &str, &str)> = out
            .iter()
            .map(|f| (f.key.as_str(), f.value, f.unit.as_str(), f.note.as_str()))
            .collect();
        assert_eq!(seen[0], ("k/rt", Some(3.0), "ratio", "vs 100"));
        assert_eq!((seen[1].0, seen[1].1), ("k/bw", None));
        assert_eq!(
            seen[2],
            ("k/bw/endpoint", Some(300.0), "ns", "10 round trips; m")
        );
        assert_eq!(out.len(), 3);
    }
}
