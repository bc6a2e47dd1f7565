//! `cm-bench-real`: the real-device figures in quick mode (ratios only), printed as a
//! table; what `cargo xtask vm` runs inside the soft-RoCE VM. Also writes the figures
//! to the results file (`CMNOTIFY_BENCH_OUT`) and echoes each on stderr.
//!
//! Usage: `cm-bench-real [CONNECTIONS]` (lost-RTU connections per path, default 10; the VM
//! runs 100), then the data path against perftest: ten round trips and fifty 4 KiB
//! messages per connection.
//! Exits 0 when the figures were measured or skipped for want of a device, 1 when a
//! measurement failed.

use std::process::ExitCode;

fn main() -> ExitCode {
    let connections = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(10);
    let machine = cm_benches::machine_label();
    let result = cm_benches::real::setup().and_then(|setup| {
        cm_benches::real::measure(&setup, connections)
            .map_err(|e| format!("measurement failed: {e}"))
    });
    let mut failed = matches!(&result, Err(e) if e.starts_with("measurement failed"));
    let mut figures = cm_benches::real::record_figures(&result, &machine);
    // The data path against perftest, after the endpoints above are gone.
    let data = cm_benches::real::setup().and_then(|setup| {
        cm_benches::real::data::measure(&setup, connections * 10, connections * 50)
            .map_err(|e| format!("measurement failed: {e}"))
    });
    failed |= matches!(&data, Err(e) if e.starts_with("measurement failed"));
    figures.extend(cm_benches::real::data::record_figures(&data, &machine));
    cm_benches::results::print_table(&machine, &figures);
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
