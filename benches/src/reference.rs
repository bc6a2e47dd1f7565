//! Connection setup against the reference C server: rdma-core's `cmtime` client opens N
//! connections at once, first to rdma-core's own `cmtime` server, then to a `cmnotify`
//! server (the connection API, as a user's server runs it), in one run on one machine.
//! The figures are cmtime's own step times (per connection, as the client measured them)
//! and each server's peak memory from `/proc/PID/status`: resident (`VmHWM`) and pinned
//! (`VmPin` + `VmLck`, sampled every 50 ms), divided by N; and its CPU time from
//! `/proc/PID/stat` (user + system, every thread), divided by N: whether a slower server
//! works more per connection or waits more; and its system calls of the read and write
//! kinds from `/proc/PID/io` (`syscr` + `syscw`), divided by N: each librdmacm command
//! is one `write(2)` to the CM device and each event or wake-up read one `read(2)`, so
//! this counts the CM work a server asks for per connection, the same on every run
//! where time is not (libibverbs' commands go through `ioctl(2)` and are not in it);
//! and the REQs the client's device resent during the run, divided by N
//! ([`crate::cm_retries`]): a connect step made of CM timeouts is not the server's work.
//! cmtime's server and the default cmnotify server then run [`PAIRED_ROUNDS`] times
//! back to back in all, and the median of the rounds' ratios is reported beside the
//! first round's.
//!
//! Needs `cmtime` and `cmnotify` on `PATH`, `/usr/bin/rdma` (to see the listener), and
//! `CMNOTIFY_ADDR_A` / `CMNOTIFY_ADDR_B` on RDMA devices: the VM has them. Elsewhere every
//! figure is recorded as skipped, with the reason.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::results::Figure;

/// The key every figure of this bench starts with.
pub const KEY: &str = cm_testkit::figure_keys::REAL_SETUP_VS_CMTIME;

/// How long a server may take to start listening, and a client or server to finish.
const LISTEN_WAIT: Duration = Duration::from_secs(10);
const RUN_WAIT: Duration = Duration::from_secs(300);

/// One row of cmtime's step table (`total ms`, `max ms`, `min us`, `us / conn`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepRow {
    /// The whole step, all connections, ms.
    pub total_ms: f64,
    /// The slowest connection's step, ms.
    pub max_ms: f64,
    /// The fastest connection's step, µs.
    pub min_us: f64,
    /// The whole step divided by the connections, µs.
    pub us_per_conn: f64,
}

/// Reads cmtime's step table: one `name : total max min per-conn` line per step, each
/// value printed `%11.2f` (values too wide for their column run into the next one, so
/// such a line is cut into 11-character columns).
pub fn parse_cmtime(output: &str) -> BTreeMap<String, StepRow> {
    output
        .lines()
        .filter_map(|line| {
            let (name, values) = line.split_once(':')?;
            let [total_ms, max_ms, min_us, us_per_conn] = four_values(values)?;
            Some((
                name.trim().to_string(),
                StepRow {
                    total_ms,
                    max_ms,
                    min_us,
                    us_per_conn,
                },
            ))
        })
        .collect()
}

fn four_values(values: &str) -> Option<[f64; 4]> {
    let parse = |parts: Vec<&str>| -> Option<[f64; 4]> {
        let numbers: Vec<f64> = parts
            .iter()
            .map(|p| p.trim().parse().ok())
            .collect::<Option<_>>()?;
        numbers.try_into().ok()
    };
    parse(values.split_whitespace().collect()).or_else(|| {
        let values = values.strip_prefix(' ')?.trim_end();
        (values.len() == 44 && values.is_ascii())
            .then(|| (0..4).map(|i| &values[11 * i..11 * (i + 1)]).collect())
            .and_then(parse)
    })
}

/// What a server used: its peak memory, KiB, and its CPU time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerUsage {
    /// Peak resident set (`VmHWM`).
    pub rss_kib: u64,
    /// Peak pinned and locked memory (`VmPin` + `VmLck`), registered memory among it.
    pub pinned_kib: u64,
    /// CPU time, user and system, of all its threads at the last reading, in clock
    /// ticks (`/proc/PID/stat` fields 14 and 15; USER_HZ, 100 a second on Linux).
    pub cpu_ticks: u64,
    /// System calls of the read and write kinds, all its threads, at the last reading
    /// (`/proc/PID/io`: `syscr` + `syscw`).
    pub syscalls: u64,
}

/// Clock ticks a second in `/proc/PID/stat` (USER_HZ: 100 on every Linux ABI).
const TICKS_PER_SECOND: f64 = 100.0;

impl ServerUsage {
    /// Folds one reading of `/proc/PID/status` in.
    pub fn add_status(&mut self, status: &str) {
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        self.rss_kib = self.rss_kib.max(field("VmHWM"));
        self.pinned_kib = self.pinned_kib.max(field("VmPin") + field("VmLck"));
    }

    /// Folds one reading of `/proc/PID/io` in: its read and write system calls so far.
    pub fn add_io(&mut self, io: &str) {
        let count = |name: &str| -> Option<u64> {
            io.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.trim().parse().ok())
        };
        if let (Some(reads), Some(writes)) = (count("syscr"), count("syscw")) {
            self.syscalls = self.syscalls.max(reads + writes);
        }
    }

    /// Folds one reading of `/proc/PID/stat` in: its CPU time so far (`utime` +
    /// `stime`, the 14th and 15th fields; the command name before them may hold spaces,
    /// so fields are counted after its closing parenthesis).
    pub fn add_stat(&mut self, stat: &str) {
        let Some((_, after_name)) = stat.rsplit_once(')') else {
            return;
        };
        // After the name: field 3 (state) is the first.
        let mut fields = after_name.split_whitespace().skip(11);
        let mut tick = || fields.next().and_then(|f| f.parse::<u64>().ok());
        if let (Some(user), Some(system)) = (tick(), tick()) {
            self.cpu_ticks = self.cpu_ticks.max(user + system);
        }
    }
}

/// Samples a process's memory and CPU time every 50 ms until stopped or the process is
/// gone.
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<ServerUsage>,
}

impl Sampler {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let mut peak = ServerUsage::default();
            let path = format!("/proc/{pid}/status");
            let stat = format!("/proc/{pid}/stat");
            let io = format!("/proc/{pid}/io");
            while !stopped.load(Ordering::Relaxed) {
                match std::fs::read_to_string(&path) {
                    Ok(status) => peak.add_status(&status),
                    Err(_) => break,
                }
                if let Ok(text) = std::fs::read_to_string(&stat) {
                    peak.add_stat(&text);
                }
                if let Ok(text) = std::fs::read_to_string(&io) {
                    peak.add_io(&text);
                }
                thread::sleep(Duration::from_millis(50));
            }
            peak
        });
        Sampler { stop, thread }
    }

    fn finish(self) -> ServerUsage {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The servers compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// rdma-core's `cmtime` server (a QP per request, librdmacm's CQs, no memory).
    Cmtime,
    /// `cmnotify --backend rdma -s` (the connection API with its notify path; every
    /// connection on one shared receive queue, one registered pool and one pair of
    /// completion queues).
    Cmnotify,
    /// The same with `--own-queues`: each connection with queues, buffers and posted
    /// receives of its own.
    CmnotifyOwnQueues,
    /// The default server with `--ready-qps 0`: every QP made on its request, none
    /// ahead (what the QPs made ahead buy, measured beside them).
    CmnotifyOnRequest,
}

impl Server {
    /// The name in figure keys.
    pub const fn name(self) -> &'static str {
        match self {
            Server::Cmtime => "cmtime",
            Server::Cmnotify => "cmnotify",
            Server::CmnotifyOwnQueues => "cmnotify-own",
            Server::CmnotifyOnRequest => "cmnotify-on-request",
        }
    }

    /// The command that starts this server on `addr` and `port` for `connections`.
    pub(crate) fn command(self, addr: IpAddr, port: u16, connections: u32) -> Command {
        let (addr, port, n) = (addr.to_string(), port.to_string(), connections.to_string());
        match self {
            Server::Cmtime => {
                let mut c = Command::new("cmtime");
                c.args(["-b", &addr, "-p", &port]);
                c
            }
            Server::Cmnotify | Server::CmnotifyOwnQueues | Server::CmnotifyOnRequest => {
                let mut c = cmnotify_server(&addr, &port, &n);
                match self {
                    Server::CmnotifyOwnQueues => {
                        c.arg("--own-queues");
                    }
                    Server::CmnotifyOnRequest => {
                        c.args(["--ready-qps", "0"]);
                    }
                    _ => {}
                }
                c
            }
        }
    }

    fn spawn(self, addr: IpAddr, port: u16, connections: u32) -> Result<Child, String> {
        self.command(addr, port, connections)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e}", self.name()))
    }
}

/// `cmnotify --backend rdma -s` on `addr` and `port`, accepting `n` connections.
pub(crate) fn cmnotify_server(addr: &str, port: &str, n: &str) -> Command {
    let mut command = Command::new("cmnotify");
    command.args(["--backend", "rdma", "-s", "-b", addr, "-p", port, "-c", n]);
    command
}

/// What one server did with N connections of one client.
#[derive(Debug, Clone)]
pub struct ServerRun {
    /// cmtime's steps as its client measured them.
    pub steps: BTreeMap<String, StepRow>,
    /// The server's peak memory.
    pub memory: ServerUsage,
    /// The REQs and DREQs the client's device resent during the run, where its
    /// counters can be read.
    pub client_retries: Option<crate::cm_retries::CmRetries>,
}

/// Waits until `rdma resource show cm_id` lists a listener on `port`.
pub(crate) fn wait_listening(port: u16) -> Result<(), String> {
    wait_listening_within(port, LISTEN_WAIT)
}

/// [`wait_listening`] for at most `wait`.
pub(crate) fn wait_listening_within(port: u16, wait: Duration) -> Result<(), String> {
    let until = Instant::now() + wait;
    let suffix = format!(":{port}");
    while Instant::now() < until {
        let out = Command::new("/usr/bin/rdma")
            .args(["resource", "show", "cm_id"])
            .output()
            .map_err(|e| format!("rdma resource show: {e}"))?;
        let listing = String::from_utf8_lossy(&out.stdout);
        if listing
            .lines()
            .any(|l| l.contains("LISTEN") && l.contains(&suffix))
        {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(100));
    }
    Err(format!("nothing listened on port {port} within {wait:?}"))
}

/// Waits for `child` at most [`RUN_WAIT`], killing it past that.
pub(crate) fn wait_bounded(mut child: Child, what: &str) -> Result<Output, String> {
    let until = Instant::now() + RUN_WAIT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().map_err(|e| format!("{what}: {e}")),
            Ok(None) if Instant::now() < until => thread::sleep(Duration::from_millis(50)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{what} did not finish within {RUN_WAIT:?}"));
            }
            Err(e) => return Err(format!("{what}: {e}")),
        }
    }
}

/// rdma-core's `cmtime` client opening `connections` from `client_addr` to `server`
/// (listening on `server_addr` and `port`): its step rows.
pub(crate) fn run_client(
    server: Server,
    server_addr: IpAddr,
    client_addr: IpAddr,
    port: u16,
    connections: u32,
) -> Result<BTreeMap<String, StepRow>, String> {
    let client = Command::new("cmtime")
        .args([
            "-s",
            &server_addr.to_string(),
            "-b",
            &client_addr.to_string(),
        ])
        .args(["-p", &port.to_string(), "-c", &connections.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cmtime client: {e}"))?;
    let out = wait_bounded(client, "the cmtime client")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "the cmtime client against {} exited {}: {}{}",
            server.name(),
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let steps = parse_cmtime(&text);
    if !steps.contains_key("connect") || !steps.contains_key("disconnect") {
        return Err(format!("no connect and disconnect rows in: {text}"));
    }
    Ok(steps)
}

/// One server, one cmtime client opening `connections` from `client_addr`.
pub fn run_server(
    server: Server,
    server_addr: IpAddr,
    client_addr: IpAddr,
    port: u16,
    connections: u32,
) -> Result<ServerRun, String> {
    let child = server.spawn(server_addr, port, connections)?;
    let sampler = Sampler::start(child.id());
    let mut child = Some(child);
    let mut client_retries = None;
    let result = (|| {
        wait_listening(port)?;
        let before = crate::cm_retries::client_device();
        let steps = run_client(server, server_addr, client_addr, port, connections)?;
        client_retries = before
            .zip(crate::cm_retries::client_device())
            .map(|(before, after)| after.since(before));
        if server != Server::Cmtime {
            // It exits by itself once every connection it counted has closed.
            let out = wait_bounded(child.take().expect("spawned"), "the cmnotify server")?;
            if !out.status.success() {
                return Err(format!(
                    "the cmnotify server exited {}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
        Ok(steps)
    })();
    let memory = sampler.finish();
    if let Some(mut child) = child {
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(ServerRun {
        steps: result?,
        memory,
        client_retries,
    })
}

/// The figures of cmtime's server and of each of ours at `connections`, with the
/// ratios ours / cmtime's (keys `…_ratio` for the default shared queues, `…_ratio_own`
/// for queues of each connection's own, `…_ratio_on_request` for no QP made ahead), and
/// the connect step with QPs made ahead over the same server without
/// (`connect_ready_over_on_request`).
pub fn figures(connections: u32, cmtime: &ServerRun, ours: &[(Server, &ServerRun)]) -> Vec<Figure> {
    let n = f64::from(connections);
    let mut figures = Vec::new();
    let runs = std::iter::once((Server::Cmtime, cmtime)).chain(ours.iter().copied());
    for (server, run) in runs {
        let name = server.name();
        for step in ["connect", "disconnect"] {
            if let Some(row) = run.steps.get(step) {
                figures.push(Figure::measured(
                    &format!("{KEY}/{connections}/{step}/{name}"),
                    row.us_per_conn,
                    "us",
                    &format!(
                        "{step} step per connection, cmtime client, {name} server; slowest {:.1} ms",
                        row.max_ms
                    ),
                ));
            }
        }
        figures.push(Figure::measured(
            &format!("{KEY}/{connections}/rss_per_conn/{name}"),
            (run.memory.rss_kib as f64 * 1024.0 / n).round(),
            "bytes",
            &format!(
                "{name} server peak VmHWM {} KiB / {connections}",
                run.memory.rss_kib
            ),
        ));
        figures.push(Figure::measured(
            &format!("{KEY}/{connections}/cpu_per_conn/{name}"),
            cpu_us(run) / n,
            "us",
            &format!(
                "{name} server CPU time (user + system, every thread) {:.2} s / {connections}",
                cpu_us(run) / 1e6
            ),
        ));
        figures.push(Figure::measured(
            &format!("{KEY}/{connections}/syscalls_per_conn/{name}"),
            run.memory.syscalls as f64 / n,
            "calls",
            &format!(
                "{name} server read and write system calls (every thread) {} / {connections}",
                run.memory.syscalls
            ),
        ));
        if let Some(retries) = run.client_retries {
            figures.push(Figure::measured(
                &format!("{KEY}/{connections}/req_retries_per_conn/{name}"),
                retries.req as f64 / n,
                "REQs",
                &format!(
                    "REQs the client resent (no answer within the CM timeout), {name} \
                     server: {} / {connections}; DREQs resent: {}",
                    retries.req, retries.dreq
                ),
            ));
        }
        figures.push(Figure::measured(
            &format!("{KEY}/{connections}/pinned_per_conn/{name}"),
            (run.memory.pinned_kib as f64 * 1024.0 / n).round(),
            "bytes",
            &format!(
                "{name} server peak VmPin + VmLck {} KiB / {connections}",
                run.memory.pinned_kib
            ),
        ));
    }
    for &(server, run) in ours {
        let (suffix, name) = match server {
            Server::CmnotifyOwnQueues => ("_own", server.name()),
            Server::CmnotifyOnRequest => ("_on_request", server.name()),
            _ => ("", server.name()),
        };
        for step in ["connect", "disconnect"] {
            if let (Some(ours), Some(theirs)) = (run.steps.get(step), cmtime.steps.get(step)) {
                figures.push(Figure::measured(
                    &format!("{KEY}/{connections}/{step}_ratio{suffix}"),
                    ours.us_per_conn / theirs.us_per_conn,
                    "ratio",
                    &format!("{step} step per connection, {name} server / cmtime server"),
                ));
            }
        }
        if cpu_us(cmtime) > 0.0 {
            figures.push(Figure::measured(
                &format!("{KEY}/{connections}/cpu_ratio{suffix}"),
                cpu_us(run) / cpu_us(cmtime),
                "ratio",
                &format!("server CPU time, {name} / cmtime"),
            ));
        }
        if cmtime.memory.syscalls > 0 {
            figures.push(Figure::measured(
                &format!("{KEY}/{connections}/syscalls_ratio{suffix}"),
                run.memory.syscalls as f64 / cmtime.memory.syscalls as f64,
                "ratio",
                &format!("server read and write system calls, {name} / cmtime"),
            ));
        }
        let rss = |run: &ServerRun| run.memory.rss_kib as f64;
        if rss(cmtime) > 0.0 {
            figures.push(Figure::measured(
                &format!("{KEY}/{connections}/rss_ratio{suffix}"),
                rss(run) / rss(cmtime),
                "ratio",
                &format!("server peak resident memory, {name} / cmtime"),
            ));
        }
    }
    let connect = |wanted: Server| {
        let run = ours.iter().find(|(server, _)| *server == wanted)?.1;
        Some(run.steps.get("connect")?.us_per_conn)
    };
    if let (Some(ahead), Some(on_request)) = (
        connect(Server::Cmnotify),
        connect(Server::CmnotifyOnRequest),
    ) {
        figures.push(Figure::measured(
            &format!("{KEY}/{connections}/connect_ready_over_on_request"),
            ahead / on_request,
            "ratio",
            "connect step per connection, cmnotify server with QPs made ahead / every QP made on its request",
        ));
    }
    figures
}

/// Rounds of cmtime's server and the default cmnotify server run back to back at each N
/// (the first is the runs of [`figures`]). The VM's speed drifts from one run to the
/// next by more than the servers differ (cmtime's own connect step measured 2.0 to
/// 2.7 ms per connection at 1000 over three runs of one build), so a ratio of one pair
/// says little; the median of the pairs' ratios is reported beside it.
pub const PAIRED_ROUNDS: usize = 3;

/// The median over paired rounds (cmtime's run, then ours, back to back) of the
/// connect and disconnect ratios, ours / cmtime's: keys `…_ratio_median`, each round's
/// ratio in the note.
pub fn paired_figures(connections: u32, pairs: &[(ServerRun, ServerRun)]) -> Vec<Figure> {
    let mut figures = Vec::new();
    for step in ["connect", "disconnect"] {
        let mut ratios: Vec<f64> = pairs
            .iter()
            .filter_map(|(cmtime, ours)| {
                Some(ours.steps.get(step)?.us_per_conn / cmtime.steps.get(step)?.us_per_conn)
            })
            .collect();
        if ratios.is_empty() {
            continue;
        }
        let listed: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        ratios.sort_by(f64::total_cmp);
        let mid = ratios.len() / 2;
        let median = if ratios.len() % 2 == 1 {
            ratios[mid]
        } else {
            (ratios[mid - 1] + ratios[mid]) / 2.0
        };
        figures.push(Figure::measured(
            &format!("{KEY}/{connections}/{step}_ratio_median"),
            median,
            "ratio",
            &format!(
                "{step} step per connection, cmnotify server / cmtime server, median of {} rounds back to back ({})",
                listed.len(),
                listed.join(", ")
            ),
        ));
    }
    figures
}

/// A run's server CPU time, µs.
fn cpu_us(run: &ServerRun) -> f64 {
    run.memory.cpu_ticks as f64 * 1e6 / TICKS_PER_SECOND
}

/// The most connections the server with queues of each connection's own is measured
/// at: it holds about 55 KB a connection (CQs, buffers and posted receives of its own:
/// 271 MB at 5000 in the VM), so at 10000 the VM's 1 GiB, a third of it the kernel's
/// own per-connection state, runs out and the kernel's OOM killer ends it.
pub const OWN_QUEUES_MAX: u32 = 5000;

/// Why the own-queues server is not measured above [`OWN_QUEUES_MAX`].
const OWN_QUEUES_SKIPPED: &str = "not run above 5000 connections: about 55 KB a connection \
    (queues of its own) outgrows the VM's 1 GiB, where the shared queues' server holds 15 KB";

/// Runs the servers for each N (the own-queues one up to [`OWN_QUEUES_MAX`]; ports from
/// 7600 up) and returns every figure; without
/// the VM's addresses, one skipped figure saying why.
pub fn measure(points: &[u32]) -> Vec<Figure> {
    let Some(addrs) = cm_testkit::addresses("setup_vs_cmtime") else {
        return vec![Figure::skipped(
            KEY,
            "no RDMA device (CMNOTIFY_ADDR_A/B unset)",
        )];
    };
    let mut out = Vec::new();
    let mut port = 7600;
    for &n in points {
        let mut run = |server| {
            port += 1;
            run_server(server, addrs.addr_a, addrs.addr_b, port, n)
        };
        let (cmtime, shared) = (run(Server::Cmtime), run(Server::Cmnotify));
        let own = (n <= OWN_QUEUES_MAX).then(|| run(Server::CmnotifyOwnQueues));
        match (cmtime, shared, run(Server::CmnotifyOnRequest)) {
            (Ok(cmtime), Ok(shared), Ok(on_request)) => {
                let mut ours = vec![(Server::Cmnotify, &shared)];
                let own_key = format!("{KEY}/{n}/{}", Server::CmnotifyOwnQueues.name());
                match &own {
                    Some(Ok(own)) => ours.push((Server::CmnotifyOwnQueues, own)),
                    Some(Err(e)) => out.push(Figure::skipped(&own_key, &format!("failed: {e}"))),
                    None => out.push(Figure::skipped(&own_key, OWN_QUEUES_SKIPPED)),
                }
                ours.push((Server::CmnotifyOnRequest, &on_request));
                out.extend(figures(n, &cmtime, &ours));
                let mut pairs = vec![(cmtime, shared)];
                for _ in 1..PAIRED_ROUNDS {
                    match (run(Server::Cmtime), run(Server::Cmnotify)) {
                        (Ok(cmtime), Ok(ours)) => pairs.push((cmtime, ours)),
                        (Err(e), _) | (_, Err(e)) => {
                            out.push(Figure::skipped(
                                &format!("{KEY}/{n}/paired"),
                                &format!("failed: {e}"),
                            ));
                            break;
                        }
                    }
                }
                out.extend(paired_figures(n, &pairs));
            }
            (Err(e), ..) | (_, Err(e), _) | (.., Err(e)) => {
                out.push(Figure::skipped(
                    &format!("{KEY}/{n}"),
                    &format!("failed: {e}"),
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CMTIME: &str = "\
step              total ms     max ms     min us  us / conn
create id    :       1.25       0.01       1.00       1.25
resolve addr :     210.50     200.10     150.00     210.50
create qp    :      30.00       0.20      20.00      30.00
connect      :    1234.56     900.00     400.00    1234.56
disconnect   :   123456.78   12345.6712345678.90     123.45
destroy      :       2.00       0.10       1.00       2.00
";

    #[test]
    fn cmtime_rows_are_read_with_their_columns_run_together_or_not() {
        let steps = parse_cmtime(CMTIME);
        assert_eq!(steps.len(), 6, "{steps:?}");
        assert_eq!(
            steps["connect"],
            StepRow {
                total_ms: 1234.56,
                max_ms: 900.0,
                min_us: 400.0,
                us_per_conn: 1234.56
            }
        );
        let disconnect = steps["disconnect"];
        assert_eq!(disconnect.max_ms, 12345.67);
        assert_eq!(disconnect.min_us, 12345678.90);
        assert_eq!(disconnect.us_per_conn, 123.45);
        assert!(!steps.contains_key("step"), "the header is no row");
    }

    #[test]
    fn usage_keeps_the_highest_reading() {
        let mut peak = ServerUsage::default();
        peak.add_status("VmHWM:\t    2048 kB\nVmPin:\t     100 kB\nVmLck:\t      28 kB\n");
        peak.add_status("VmHWM:\t    1024 kB\nVmPin:\t       0 kB\nVmLck:\t       0 kB\n");
        assert_eq!(
            peak,
            ServerUsage {
                rss_kib: 2048,
                pinned_kib: 128,
                cpu_ticks: 0,
                syscalls: 0,
            }
        );
        peak.add_io("rchar: 10\nwchar: 20\nsyscr: 7\nsyscw: 35\nread_bytes: 0\n");
        peak.add_io("rchar: 1\nsyscr: 1\nsyscw: 2\n");
        assert_eq!(peak.syscalls, 42, "the highest reading: syscr + syscw");
        // A command name with a space and a parenthesis: fields count after the last `)`.
        let stat = "42 (cm (x) y) S 1 42 42 0 -1 4194304 10 0 0 0 150 25 0 0 20 0 3 0";
        peak.add_stat(stat);
        peak.add_stat("42 (cm) S 1 42 42 0 -1 4194304 10 0 0 0 100 20 0 0 20 0 3 0");
        assert_eq!(peak.cpu_ticks, 175, "the highest reading: utime + stime");
    }

    #[test]
    fn the_ratios_put_cmnotify_over_cmtime() {
        let run = |connect: f64, rss_kib| ServerRun {
            steps: [
                ("connect".to_string(), row(connect)),
                ("disconnect".to_string(), row(connect / 2.0)),
            ]
            .into_iter()
            .collect(),
            memory: ServerUsage {
                rss_kib,
                pinned_kib: 0,
                cpu_ticks: rss_kib / 10,
                syscalls: rss_kib * 2,
            },
            client_retries: (rss_kib == 1000)
                .then_some(crate::cm_retries::CmRetries { req: 50, dreq: 1 }),
        };
        let (shared, own, on_request) = (run(750.0, 3000), run(400.0, 1500), run(1000.0, 3000));
        let figures = figures(
            100,
            &run(500.0, 1000),
            &[
                (Server::Cmnotify, &shared),
                (Server::CmnotifyOwnQueues, &own),
                (Server::CmnotifyOnRequest, &on_request),
            ],
        );
        let value = |key: &str| {
            figures
                .iter()
                .find(|f| f.key == format!("{KEY}/100/{key}"))
                .and_then(|f| f.value)
        };
        assert_eq!(value("connect_ratio"), Some(1.5));
        assert_eq!(value("disconnect_ratio"), Some(1.5));
        assert_eq!(value("rss_ratio"), Some(3.0));
        assert_eq!(value("rss_per_conn/cmtime"), Some(10240.0));
        assert_eq!(value("connect/cmnotify"), Some(750.0));
        assert_eq!(value("connect_ratio_own"), Some(0.8));
        assert_eq!(value("rss_ratio_own"), Some(1.5));
        assert_eq!(value("connect/cmnotify-own"), Some(400.0));
        assert_eq!(value("connect_ratio_on_request"), Some(2.0));
        assert_eq!(value("connect/cmnotify-on-request"), Some(1000.0));
        assert_eq!(value("connect_ready_over_on_request"), Some(0.75));
        assert_eq!(
            value("cpu_per_conn/cmtime"),
            Some(10_000.0),
            "100 ticks / 100"
        );
        assert_eq!(value("cpu_ratio"), Some(3.0));
        assert_eq!(value("syscalls_per_conn/cmtime"), Some(20.0));
        assert_eq!(value("syscalls_ratio_own"), Some(1.5));
        assert_eq!(
            value("req_retries_per_conn/cmtime"),
            Some(0.5),
            "50 REQs / 100"
        );
        assert_eq!(
            value("req_retries_per_conn/cmnotify"),
            None,
            "no counters, no figure"
        );
    }

    #[test]
    fn the_paired_ratio_is_the_median_of_the_rounds() {
        let run = |connect: f64| ServerRun {
            steps: [("connect".to_string(), row(connect))]
                .into_iter()
                .collect(),
            memory: ServerUsage::default(),
            client_retries: None,
        };
        let pairs = [
            (run(100.0), run(150.0)),
            (run(200.0), run(180.0)),
            (run(100.0), run(80.0)),
        ];
        let figures = paired_figures(7, &pairs);
        assert_eq!(figures.len(), 1, "no disconnect rows, no disconnect figure");
        assert_eq!(figures[0].key, format!("{KEY}/7/connect_ratio_median"));
        assert_eq!(figures[0].value, Some(0.9));
        assert!(
            figures[0].note.contains("1.50, 0.90, 0.80"),
            "{}",
            figures[0].note
        );
        let even = paired_figures(7, &pairs[..2]);
        assert_eq!(even[0].value, Some(1.2), "two rounds: the mean of both");
    }

    fn row(us_per_conn: f64) -> StepRow {
        StepRow {
            total_ms: us_per_conn / 10.0,
            max_ms: 1.0,
            min_us: 1.0,
            us_per_conn,
        }
    }
}
