//! `cm-bench-setup`: connection setup against the reference C server (see
//! `cm_benches::reference`): rdma-core's `cmtime` client opens N connections to
//! `cmtime`'s server, then to a `cmnotify` server, for each N given, then to a `cmnotify`
//! server of one endpoint and of two on their own threads at the first N; prints a table,
//! writes the figures to the results file (`CMNOTIFY_BENCH_OUT`) and echoes each on
//! stderr for the VM's console.
//!
//! With `--instructions LOW,HIGH` it first counts both servers' user-space
//! instructions per connection under callgrind, from runs of LOW and HIGH connections
//! (`cm_benches::server_instructions`).
//!
//! Usage: `cm-bench-setup [--instructions LOW,HIGH] N...` (default 100). Exits 0 when
//! every figure was measured or skipped for want of a device or valgrind, 1 when a run
//! failed; 2 on an argument it cannot read.

use std::process::ExitCode;

/// Ports of the instruction counts (the timed runs take 7600 and 7700 up).
const INSTRUCTION_PORTS: u16 = 7800;

fn main() -> ExitCode {
    let mut points = Vec::new();
    let mut instructions = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let read = if arg == "--instructions" {
            let pair = args.next().unwrap_or_default();
            let counts = pair.split_once(',').and_then(|(low, high)| {
                Some((low.parse::<u32>().ok()?, high.parse::<u32>().ok()?))
            });
            counts.filter(|(low, high)| low < high).map(|counts| {
                instructions = Some(counts);
            })
        } else {
            arg.parse().ok().map(|n| points.push(n))
        };
        if read.is_none() {
            eprintln!(
                "cm-bench-setup: cannot read `{arg}` (usage: [--instructions LOW,HIGH] N...)"
            );
            return ExitCode::from(2);
        }
    }
    if points.is_empty() {
        points.push(100);
    }
    let machine = cm_benches::machine_label();
    let mut figures = Vec::new();
    if let Some((low, high)) = instructions {
        figures.extend(cm_benches::server_instructions::measure(
            low,
            high,
            INSTRUCTION_PORTS,
        ));
    }
    figures.extend(cm_benches::reference::measure(&points));
    // One endpoint and two on their own threads, at the first N.
    figures.extend(cm_benches::shards::measure(points[0]));
    for figure in &figures {
        cm_benches::results::record(figure);
    }
    cm_benches::results::print_table(&machine, &figures);
    let failed = figures
        .iter()
        .any(|f| f.value.is_none() && f.note.starts_with("failed"));
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
