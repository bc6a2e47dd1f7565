//! `cmnotify`: shows the RDMA CM notify path working, and measures it.

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use cm_tools::report::{emit, human, SimJson};
use cm_tools::sim_run::{run_with_progress, SimRun};

/// The exit statuses, printed by `--help` (and listed in the README).
const EXIT_CODES: &str = "\
Exit status:
  0  every connection was established
  1  some connection failed (or the output could not be written, or an invariant broke)
  2  usage error (bad flag or value, a flag the chosen backend would ignore, a backend
     this build lacks)";

/// Defaults of the flags that are options so that a flag given to a backend that would
/// ignore it can be refused.
const DEFAULT_RTU_LOSS: f64 = 1.0;
const DEFAULT_SEED: u64 = 1;

/// Which CM to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// The deterministic simulated fabric (no RDMA device or native library needed).
    Sim,
    /// Real devices through librdmacm/libibverbs (build with `--features rdma`).
    Rdma,
}

/// Shows the RDMA CM notify path at work: connections whose RTU is lost are rescued by
/// forwarding COMM_EST (or a receive completion) with rdma_notify.
#[derive(Debug, Parser)]
// Negative numbers are values (refused by their parser with a message naming the flag),
// not unknown short flags.
#[command(
    name = "cmnotify",
    version,
    about,
    long_about = None,
    after_help = EXIT_CODES,
    allow_negative_numbers = true
)]
struct Cli {
    /// Which CM to run on.
    #[arg(long, value_enum, default_value = "sim")]
    backend: Backend,

    /// Connections to open (1 to 1000000).
    #[arg(short = 'c', long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    connections: u32,

    /// (sim) Probability that an RTU is lost: a fraction (0.1) or a percentage (10%)
    /// [default: 100%].
    #[arg(long, value_parser = parse_probability)]
    rtu_loss: Option<f64>,

    /// (sim) Also drop every RTU of this connection (0-based; repeatable, a connection
    /// given twice counts once).
    #[arg(long, value_name = "CONN")]
    drop_rtu_of: Vec<u32>,

    /// (sim) The client sends no data: nothing can raise COMM_EST.
    #[arg(long)]
    no_data: bool,

    /// Run without the notify pump: shows what goes wrong (UNREACHABLE after REP retries).
    #[arg(long)]
    no_pump: bool,

    /// (sim) Model soft-RoCE: no COMM_EST is ever raised; the pump uses receive completions.
    #[arg(long)]
    soft_roce: bool,

    /// (sim) Seed of every random decision (same seed, same run) [default: 1].
    #[arg(long)]
    seed: Option<u64>,

    /// (sim) Print the timeline of one connection (messages, states, events); with
    /// --json, as the document's "trace" array.
    #[arg(long, value_name = "CONN")]
    trace: Option<u32>,

    /// (sim, with --trace) Draw the traced connection as a ladder diagram: an SVG file,
    /// or `-` for the text rendering on stdout (instead of the summary).
    #[arg(long, value_name = "FILE")]
    ladder: Option<std::path::PathBuf>,

    /// Draw the ladder of a connection captured on the real kernel (the file the VM's
    /// `ladder-capture` writes: tracefs events, the nftables counter, both endpoint
    /// timelines) to the --ladder target, and print its summary; nothing runs.
    #[arg(long, value_name = "FILE", requires = "ladder")]
    capture: Option<std::path::PathBuf>,

    /// With --capture (the passive host's): the active host's capture of the same
    /// connection, made on another host; its clock is aligned to the first's by the REQ
    /// and REP stamps, and the ladder draws the uncertainty.
    #[arg(long, value_name = "FILE", requires = "capture")]
    peer_capture: Option<std::path::PathBuf>,

    /// (rdma) Write the first connection's endpoint timeline to FILE, on CLOCK_MONOTONIC
    /// (the clock of tracefs' `mono` trace clock), for --capture.
    #[arg(long, value_name = "FILE")]
    timeline: Option<std::path::PathBuf>,

    /// Give each connection queues, buffers and posted receives of its own, instead of
    /// its device's shared receive queue, registered pool and completion queues (the
    /// default).
    #[arg(long)]
    own_queues: bool,

    /// (rdma) QPs kept made ahead of requests on each device's shared queues, so that an
    /// accept takes a ready one instead of creating it (0: each made on its request)
    /// [default: 8].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=1024))]
    ready_qps: Option<u32>,

    /// (rdma) Type of service of every connection (`rdma_set_option` TOS; on RoCE the
    /// IP traffic class: DSCP << 2 | ECN). The client's goes into its requests; a
    /// server's connections take each request's.
    #[arg(long, value_name = "TOS")]
    tos: Option<u8>,

    /// (rdma) Local ACK timeout of every connection's QP, 0 to 31 (4.096 µs × 2^N;
    /// `rdma_set_option` ACK_TIMEOUT) [default: the CM's, from the path].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(0..=31))]
    ack_timeout: Option<u8>,

    /// (rdma) Endpoints of this process, each driven by its own thread (one per core):
    /// endpoint i listens on (server) or connects to (client) port PORT + i, with its
    /// share of the connections; one report [default: 1].
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..=64))]
    endpoints: Option<u32>,

    /// Print one JSON document instead of the human summary.
    #[arg(long)]
    json: bool,

    /// At the end, print on stderr what the run cost this machine, as one line:
    /// `cmnotify: resources: wall_ns=N peak_rss_bytes=M` (wall time, peak resident
    /// memory).
    #[arg(long)]
    resources: bool,

    /// (rdma) Run as the server (passive side); without it, run as the client.
    #[arg(short = 's', long)]
    server: bool,

    /// (rdma) Local address to bind (server: listen address; client: source address).
    #[arg(short = 'b', long, value_name = "ADDR")]
    bind: Option<std::net::IpAddr>,

    /// (rdma) Server address to connect to (client).
    #[arg(short = 'a', long, value_name = "ADDR")]
    address: Option<std::net::IpAddr>,

    /// (rdma) Port [default: 7471].
    #[arg(short = 'p', long)]
    port: Option<u16>,

    /// (rdma) Messages per connection this side sends first (0 to 16). Client: sent once
    /// established, then it waits for as many and disconnects (default 1; 0 = connect,
    /// establish, disconnect). Server: 0 (default) echoes what clients send and lets them
    /// disconnect; N sends N once established, waits for N back and disconnects, as a
    /// ucmatose server does.
    #[arg(short = 'C', long, value_parser = clap::value_parser!(u32).range(0..=16))]
    messages: Option<u32>,

    /// (rdma) Bytes per message sent first (1 to 4096; ucmatose's default is 100)
    /// [default: 100].
    #[arg(short = 'S', long, value_parser = clap::value_parser!(u16).range(1..=4096))]
    size: Option<u16>,
}

fn parse_probability(text: &str) -> Result<f64, String> {
    let (number, scale) = match text.strip_suffix('%') {
        Some(n) => (n, 100.0),
        None => (text, 1.0),
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number"))?;
    // `+ 0.0` turns -0 into 0: "-0" and "-0%" are no loss, printed as "0%".
    let p = value / scale + 0.0;
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("`{text}` is outside 0..1 (0%..100%)"))
    }
}

fn main() -> ExitCode {
    let mut cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                e.exit();
            }
            // clap's whole message: its tips (e.g. "to pass '-5' as a value, use
            // '-- -5'") and the usage line are part of the answer.
            eprint!("{}", e.render());
            return ExitCode::from(2);
        }
    };
    cli.drop_rtu_of.sort_unstable();
    cli.drop_rtu_of.dedup();
    if let Err(message) = validate(&cli) {
        eprintln!("cmnotify: {message}");
        return ExitCode::from(2);
    }
    if let Some(capture) = &cli.capture {
        let target = cli.ladder.as_deref().unwrap_or(Path::new("-"));
        return draw_capture(capture, cli.peer_capture.as_deref(), target);
    }
    let started = std::time::Instant::now();
    let code = match cli.backend {
        Backend::Sim => run_sim(&cli),
        Backend::Rdma => run_rdma(&cli),
    };
    if cli.resources {
        eprintln!(
            "cmnotify: resources: wall_ns={} peak_rss_bytes={}",
            started.elapsed().as_nanos(),
            cm_tools::stats::peak_rss_bytes().unwrap_or(0)
        );
    }
    code
}

/// `--capture FILE [--peer-capture FILE] --ladder TARGET`: the real kernel's ladder, and
/// its summary on stdout (after the text rendering when that goes to stdout too).
fn draw_capture(capture: &Path, peer: Option<&Path>, target: &Path) -> ExitCode {
    let read = |path: &Path| {
        std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))
            .and_then(|text| cm_tools::ladder::kernel::Capture::parse(&text))
    };
    let drawn = read(capture)
        .and_then(|capture| match peer {
            None => cm_tools::ladder::Ladder::from_capture(&capture),
            Some(peer) => cm_tools::ladder::Ladder::from_two_hosts(&capture, &read(peer)?),
        })
        .and_then(|ladder| {
            cm_tools::ladder::draw(&ladder, target)?;
            Ok(ladder.title())
        });
    match drawn {
        Ok(title) => {
            println!("{title}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("cmnotify: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Refuses what the chosen backend cannot do or would silently ignore; a backend this
/// build lacks is said first.
fn validate(cli: &Cli) -> Result<(), String> {
    if cli.backend == Backend::Rdma && !cfg!(feature = "rdma") {
        return Err(
            "--backend rdma: this build has no real RDMA backend; rebuild with \
                    `--features rdma` (needs librdmacm and libibverbs)"
                .into(),
        );
    }
    flags_fit_backend(cli)
}

/// Refuses a flag the chosen backend would ignore, and values out of range.
fn flags_fit_backend(cli: &Cli) -> Result<(), String> {
    let sim_only = [
        (cli.trace.is_some(), "--trace"),
        (cli.ladder.is_some(), "--ladder"),
        (!cli.drop_rtu_of.is_empty(), "--drop-rtu-of"),
        (cli.soft_roce, "--soft-roce"),
        (cli.rtu_loss.is_some(), "--rtu-loss"),
        (cli.seed.is_some(), "--seed"),
        (cli.no_data, "--no-data"),
    ];
    let rdma_only = [
        (cli.timeline.is_some(), "--timeline"),
        (cli.server, "--server"),
        (cli.bind.is_some(), "--bind"),
        (cli.address.is_some(), "--address"),
        (cli.messages.is_some(), "--messages"),
        (cli.port.is_some(), "--port"),
        (cli.size.is_some(), "--size"),
        (cli.ready_qps.is_some(), "--ready-qps"),
        (cli.endpoints.is_some(), "--endpoints"),
    ];
    if let Some(k) = cli.endpoints.filter(|&k| k > cli.connections) {
        return Err(format!(
            "--endpoints {k}: fewer connections (-c {}) than endpoints: each needs one",
            cli.connections
        ));
    }
    if cli.own_queues && cli.ready_qps.is_some() {
        return Err("--ready-qps makes QPs on shared queues: not with --own-queues".into());
    }
    if cli.capture.is_some() {
        // Nothing runs: any flag of a run would be ignored.
        let ignored = sim_only
            .iter()
            .chain(&rdma_only)
            .find(|(set, flag)| *set && *flag != "--ladder")
            .map(|(_, flag)| *flag)
            .or(cli.json.then_some("--json"))
            .or((cli.backend != Backend::Sim).then_some("--backend"));
        return match ignored {
            Some(flag) => Err(format!("{flag} does not go with --capture: nothing runs")),
            None => Ok(()),
        };
    }
    match cli.backend {
        Backend::Sim => {
            if let Some((_, flag)) = rdma_only.iter().find(|(set, _)| *set) {
                return Err(format!("{flag} needs --backend rdma"));
            }
            if cli.ladder.is_some() && cli.trace.is_none() {
                return Err("--ladder needs --trace N: the connection to draw".into());
            }
            if cli.json && ladder_to_stdout(cli) {
                return Err("--ladder - prints text on stdout: it cannot go with --json".into());
            }
            if let Some(conn) = cli.trace.filter(|&c| c >= cli.connections) {
                return Err(format!(
                    "--trace {conn}: there are only {} connection(s) (0-based)",
                    cli.connections
                ));
            }
            if let Some(conn) = cli.drop_rtu_of.iter().find(|&&c| c >= cli.connections) {
                return Err(format!(
                    "--drop-rtu-of {conn}: there are only {} connection(s) (0-based)",
                    cli.connections
                ));
            }
        }
        Backend::Rdma => {
            if let Some((_, flag)) = sim_only.iter().find(|(set, _)| *set) {
                return Err(format!("{flag} works only with --backend sim"));
            }
            if !cli.server && cli.address.is_none() {
                return Err("the client needs --address (or run the server with -s)".into());
            }
        }
    }
    Ok(())
}

/// Whether `--ladder -` sends the text ladder to stdout.
fn ladder_to_stdout(cli: &Cli) -> bool {
    cli.ladder.as_deref() == Some(std::path::Path::new("-"))
}

fn run_sim(cli: &Cli) -> ExitCode {
    let seed = cli.seed.unwrap_or(DEFAULT_SEED);
    let config = SimRun {
        connections: cli.connections,
        rtu_loss: cli.rtu_loss.unwrap_or(DEFAULT_RTU_LOSS),
        drop_rtu_of: cli.drop_rtu_of.clone(),
        send_data: !cli.no_data,
        pump: !cli.no_pump,
        soft_roce: cli.soft_roce,
        seed,
        trace_conn: cli.trace,
        own_queues: cli.own_queues,
        ..SimRun::default()
    };
    let bar = (cli.connections >= 10_000 && std::io::stderr().is_terminal()).then(|| {
        let bar = indicatif::ProgressBar::new(u64::from(cli.connections));
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {pos}/{len} connections settled [{elapsed}]",
            )
            .expect("a valid template"),
        );
        bar
    });
    let report = run_with_progress(&config, &mut |settled| {
        if let Some(bar) = &bar {
            bar.set_position(settled as u64);
        }
    });
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    // A closed stdout (EPIPE) is not an error worth a line: `emit` is quiet about it.
    // `--ladder -` takes the summary's place on stdout.
    let shown = if ladder_to_stdout(cli) {
        Ok(())
    } else {
        emit(cli.json, &SimJson::from(&report), || human(&report))
    };
    let drawn = shown.and_then(|()| match &cli.ladder {
        Some(target) => cm_tools::ladder::write(&report, target),
        None => Ok(()),
    });
    if let Err(message) = drawn {
        eprintln!("cmnotify: {message}");
        return ExitCode::FAILURE;
    }
    if report.invariant_violations() > 0 || report.teardown_failures > 0 {
        eprintln!("cmnotify: exactly-once or teardown invariant broken (seed {seed})");
        return ExitCode::FAILURE;
    }
    if report.failed() > 0 {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

#[cfg(not(feature = "rdma"))]
fn run_rdma(_cli: &Cli) -> ExitCode {
    // `validate` refuses --backend rdma in this build before anything runs.
    eprintln!("cmnotify: this build has no real RDMA backend; rebuild with `--features rdma`");
    ExitCode::from(2)
}

#[cfg(feature = "rdma")]
fn run_rdma(cli: &Cli) -> ExitCode {
    const DEFAULT_PORT: u16 = 7471;
    const DEFAULT_SIZE: u16 = 100;
    cm_tools::rdma_run::main(&cm_tools::rdma_run::RealRun {
        server: cli.server,
        bind: cli.bind,
        address: cli.address,
        port: cli.port.unwrap_or(DEFAULT_PORT),
        connections: cli.connections,
        pump: !cli.no_pump,
        json: cli.json,
        messages: cli.messages,
        message_size: usize::from(cli.size.unwrap_or(DEFAULT_SIZE)),
        timeline: cli.timeline.clone(),
        own_queues: cli.own_queues,
        ready_qps: cli.ready_qps,
        id_options: cm_verbs::core::IdOptions {
            type_of_service: cli.tos,
            ack_timeout: cli.ack_timeout,
            ..Default::default()
        },
        endpoints: cli.endpoints.unwrap_or(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("cmnotify").chain(args.iter().copied()))
            .expect("valid syntax")
    }

    #[test]
    fn flags_a_backend_would_ignore_are_refused() {
        for (args, flag) in [
            (&["-p", "9000"][..], "--port"),
            (&["-S", "10"][..], "--size"),
            (&["--ready-qps", "4"][..], "--ready-qps"),
            (&["--endpoints", "2"][..], "--endpoints"),
            (
                &["--backend", "rdma", "-s", "-c", "1", "--endpoints", "2"][..],
                "--endpoints 2: fewer connections",
            ),
            (
                &[
                    "--backend",
                    "rdma",
                    "-s",
                    "--own-queues",
                    "--ready-qps",
                    "0",
                ][..],
                "--ready-qps makes QPs on shared queues",
            ),
            (
                &["--backend", "rdma", "-s", "--rtu-loss", "0"][..],
                "--rtu-loss",
            ),
            (&["--backend", "rdma", "-s", "--seed", "3"][..], "--seed"),
            (
                &["--backend", "rdma", "-a", "10.0.0.1", "--no-data"][..],
                "--no-data",
            ),
            (&["--ladder", "x.svg"][..], "--ladder needs --trace"),
            (
                &["--trace", "0", "--ladder", "-", "--json"][..],
                "--ladder - ",
            ),
            (
                &["--backend", "rdma", "-s", "--ladder", "x.svg"][..],
                "--ladder works only",
            ),
        ] {
            let refusal = flags_fit_backend(&parse(args)).expect_err(flag);
            assert!(refusal.starts_with(flag), "{args:?}: {refusal}");
        }
        assert_eq!(
            flags_fit_backend(&parse(&["--seed", "3", "--no-data"])),
            Ok(())
        );
        assert_eq!(
            flags_fit_backend(&parse(&["--backend", "rdma", "-s", "-p", "9"])),
            Ok(())
        );
    }

    #[test]
    fn minus_zero_is_no_loss() {
        for text in ["-0", "-0%", "-0.0", "0"] {
            let p = parse_probability(text).unwrap();
            assert!(p == 0.0 && p.is_sign_positive(), "{text}: {p}");
        }
    }
}
