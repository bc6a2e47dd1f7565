//! Project automation, run as `cargo xtask <command>`.
//!
//! Every command is a plain Rust module; shell only runs the tools.

mod bench;
mod ci;
mod counts;
mod deps;
mod doc_examples;
mod fuzz;
mod run;
mod tidy;
mod vm;

use std::process::ExitCode;

const HELP: &str = "\
cargo xtask <command> [options]

Commands:
  ci [--no-vm]    everything CI checks: native prerequisites, fmt, clippy, tests,
                  docs, packaging; prints each step's time and a summary.
                  --no-vm skips the soft-RoCE VM run (quick local loops only).
  bench [--smoke] [--vm]
                  the criterion benches of the notify path (cm-benches); ends with one
                  table in target/bench-report.md, the scale curve in
                  target/bench-scale.svg and criterion's HTML report.
                  --smoke: the short CI mode (no 100k scale point);
                  --vm: also the real-device figures inside the soft-RoCE VM
  bench --count [--update-baseline]
                  instructions per operation of the simulated paths (pump event, echo,
                  connection setup) counted by callgrind (needs valgrind); table in
                  target/bench-count.md (and in target/bench-report.md if present);
                  fails when one is over 2% above benches/instructions-baseline.txt.
                  --update-baseline: write the figures as the new baseline
  fuzz --seconds N [target]
                  runs every cargo-fuzz target in fuzz/ (or one) for N seconds each and
                  prints executions and findings (needs nightly and cargo-fuzz)
  deps            check (and, as root, install) the Debian packages in ci/apt-packages.txt
  doc-examples    builds cm-verbs' doc examples and example programs in a scratch crate
                  whose one dependency is cm-verbs (part of `ci`'s doc step)
  vm [--kernel 6.1|6.12] [--accel kvm|tcg|auto] [--timeout SECS] [--manifest FILE]
                  the real-device tests and RDMA CM smoke on the real Linux kernel:
                  soft-RoCE in a qemu VM (ci/vm/, kernels in ci/vm/kernels/); console in
                  target/vm/console.log (another kernel's: target/vm/kernel-NAME/)
  help            this text
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (command, rest) = match args.split_first() {
        Some((c, rest)) => (c.as_str(), rest),
        None => ("help", &[][..]),
    };
    let result = match command {
        "bench" => bench::run(rest),
        "ci" => ci::run(rest),
        "fuzz" => fuzz::run(rest),
        "deps" => deps::ensure(&deps::host_packages()).map(|_| ()),
        "doc-examples" => doc_examples::check().map(|summary| println!("{summary}")),
        "vm" => vm::run(rest),
        "help" | "--help" | "-h" => {
            print!("{HELP}");
            Ok(())
        }
        other => Err(format!("unknown command `{other}`\n\n{HELP}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}
