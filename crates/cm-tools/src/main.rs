//! `cmnotify`: shows the RDMA CM notify path working, and measures it.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use cm_tools::report::{emit, human, SimJson};
use cm_tools::sim_run::{run_with_progress, SimRun};

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
#[command(name = "cmnotify", version, about, long_about = None)]
struct Cli {
    /// Which CM to run on.
    #[arg(long, value_enum, default_value = "sim")]
    backend: Backend,

    /// Connections to open (1 to 1000000).
    #[arg(short = 'c', long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    connections: u32,

    /// (sim) Probability that an RTU is lost: a fraction (0.1) or a percentage (10%).
    #[arg(long, default_value = "100%", value_parser = parse_probability)]
    rtu_loss: f64,

    /// (sim) Also drop every RTU of this connection (0-based; repeatable).
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

    /// (sim) Seed of every random decision (same seed, same run).
    #[arg(long, default_value_t = 1)]
    seed: u64,

    /// (sim) Print the timeline of one connection (messages, states, events).
    #[arg(long, value_name = "CONN")]
    trace: Option<u32>,

    /// Print one JSON document instead of the human summary.
    #[arg(long)]
    json: bool,

    /// (rdma) Run as the server (passive side); without it, run as the client.
    #[arg(short = 's', long)]
    server: bool,

    /// (rdma) Local address to bind (server: listen address; client: source address).
    #[arg(short = 'b', long, value_name = "ADDR")]
    bind: Option<std::net::IpAddr>,

    /// (rdma) Server address to connect to (client).
    #[arg(short = 'a', long, value_name = "ADDR")]
    address: Option<std::net::IpAddr>,

    /// (rdma) Port.
    #[arg(short = 'p', long, default_value_t = 7471)]
    port: u16,

    /// (rdma) Messages per connection this side sends first (0 to 16). Client: sent once
    /// established, then it waits for as many and disconnects (default 1; 0 = connect,
    /// establish, disconnect). Server: 0 (default) echoes what clients send and lets them
    /// disconnect; N sends N once established, waits for N back and disconnects, as a
    /// ucmatose server does.
    #[arg(short = 'C', long, value_parser = clap::value_parser!(u32).range(0..=16))]
    messages: Option<u32>,

    /// (rdma) Bytes per message sent first (1 to 4096; ucmatose's default is 100).
    #[arg(short = 'S', long, default_value_t = 100, value_parser = clap::value_parser!(u16).range(1..=4096))]
    size: u16,
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
    let p = value / scale;
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("`{text}` is outside 0..1 (0%..100%)"))
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                e.exit();
            }
            let rendered = e.render().to_string();
            let line = rendered.lines().next().unwrap_or("invalid arguments");
            eprintln!("cmnotify: {}", line.trim_start_matches("error: "));
            return ExitCode::from(2);
        }
    };
    if let Err(message) = validate(&cli) {
        eprintln!("cmnotify: {message}");
        return ExitCode::from(2);
    }
    match cli.backend {
        Backend::Sim => run_sim(&cli),
        Backend::Rdma => run_rdma(&cli),
    }
}

fn validate(cli: &Cli) -> Result<(), String> {
    let sim_only = [
        (cli.trace.is_some(), "--trace"),
        (!cli.drop_rtu_of.is_empty(), "--drop-rtu-of"),
        (cli.soft_roce, "--soft-roce"),
    ];
    let rdma_only = [
        (cli.server, "--server"),
        (cli.bind.is_some(), "--bind"),
        (cli.address.is_some(), "--address"),
        (cli.messages.is_some(), "--messages"),
    ];
    match cli.backend {
        Backend::Sim => {
            if let Some((_, flag)) = rdma_only.iter().find(|(set, _)| *set) {
                return Err(format!("{flag} needs --backend rdma"));
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

fn run_sim(cli: &Cli) -> ExitCode {
    let config = SimRun {
        connections: cli.connections,
        rtu_loss: cli.rtu_loss,
        drop_rtu_of: cli.drop_rtu_of.clone(),
        send_data: !cli.no_data,
        pump: !cli.no_pump,
        soft_roce: cli.soft_roce,
        seed: cli.seed,
        trace_conn: cli.trace,
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
    if let Err(message) = emit(cli.json, &SimJson::from(&report), || human(&report)) {
        eprintln!("cmnotify: {message}");
        return ExitCode::FAILURE;
    }
    if report.invariant_violations() > 0 || report.teardown_failures > 0 {
        eprintln!(
            "cmnotify: exactly-once or teardown invariant broken (seed {})",
            cli.seed
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

#[cfg(not(feature = "rdma"))]
fn run_rdma(_cli: &Cli) -> ExitCode {
    eprintln!(
        "cmnotify: this build has no real RDMA backend; rebuild with `--features rdma` \
         (needs librdmacm and libibverbs)"
    );
    ExitCode::from(2)
}

#[cfg(feature = "rdma")]
fn run_rdma(cli: &Cli) -> ExitCode {
    cm_tools::rdma_run::main(&cm_tools::rdma_run::RealRun {
        server: cli.server,
        bind: cli.bind,
        address: cli.address,
        port: cli.port,
        connections: cli.connections,
        pump: !cli.no_pump,
        json: cli.json,
        messages: cli.messages,
        message_size: usize::from(cli.size),
    })
}
