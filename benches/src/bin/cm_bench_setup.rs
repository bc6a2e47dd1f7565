//! `cm-bench-setup`: connection setup against the reference C server (see
//! `cm_benches::reference`): rdma-core's `cmtime` client opens N connections to
//! `cmtime`'s server, then to a `cmnotify` server, for each N given, then to a `cmnotify`
//! server of one endpoint and of two on their own threads at the first N; prints a table,
//! writes the figures to the results file (`CMNOTIFY_BENCH_OUT`) and echoes each on
//! stderr for the VM's console.
//!
//! Usage: `cm-bench-setup N...` (default 100). Exits 0 when every figure was measured or
//! skipped for want of a device, 1 when a run failed.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut points: Vec<u32> = std::env::args()
        .skip(1)
        .filter_map(|n| n.parse().ok())
        .collect();
    if points.is_empty() {
        points.push(100);
    }
    let machine = cm_benches::machine_label();
    let mut figures = cm_benches::reference::measure(&points);
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
