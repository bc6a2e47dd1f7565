//! `cm-bench-count`: runs one instruction-count scenario (see `cm_benches::count`) for
//! `cargo xtask bench --count`, which runs it under callgrind.
//!
//! Usage: `cm-bench-count SCENARIO ITERATIONS` (runs the warm-up, then ITERATIONS
//! operations), or `cm-bench-count --list` (prints every scenario's name, one a line,
//! then the pattern callgrind is to count inside, prefixed `measured: `).

use std::process::ExitCode;

use cm_benches::count::{Scenario, MEASURED_SYMBOL};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [list] if list == "--list" => {
            for scenario in Scenario::ALL {
                println!("{}", scenario.name());
            }
            println!("measured: {MEASURED_SYMBOL}");
            ExitCode::SUCCESS
        }
        [name, iterations] => {
            let Some(scenario) = Scenario::from_name(name) else {
                eprintln!("cm-bench-count: unknown scenario `{name}` (see --list)");
                return ExitCode::FAILURE;
            };
            let Ok(iterations) = iterations.parse() else {
                eprintln!("cm-bench-count: ITERATIONS must be a count, not `{iterations}`");
                return ExitCode::FAILURE;
            };
            scenario.run(iterations);
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("usage: cm-bench-count SCENARIO ITERATIONS | cm-bench-count --list");
            ExitCode::FAILURE
        }
    }
}
