//! `cargo xtask fuzz --seconds N [target]`: runs every cargo-fuzz target in `fuzz/`
//! (or one) for N seconds each, one at a time, and prints executions and findings.
//!
//! New inputs go to `target/fuzz-corpus/<target>/`, so the small committed seed corpus
//! in `fuzz/corpus/<target>/` stays as it is; findings go to `fuzz/artifacts/<target>/`.
//! Needs the nightly toolchain and `cargo install cargo-fuzz`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::run::workspace_root;

const USAGE: &str = "usage: cargo xtask fuzz --seconds N [target]";

/// What one target's run gave.
struct FuzzRun {
    target: String,
    seconds: u64,
    executions: Option<u64>,
    corpus: usize,
    finding: Option<String>,
}

pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut seconds = None;
    let mut only = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => {
                let value = args.next().ok_or(USAGE)?;
                seconds = Some(
                    value
                        .parse::<u64>()
                        .map_err(|e| format!("--seconds {value}: {e}\n{USAGE}"))?,
                );
            }
            other if !other.starts_with('-') && only.is_none() => only = Some(other.to_string()),
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    let seconds = seconds.ok_or(USAGE)?;
    let root = workspace_root();
    let fuzz_dir = root.join("fuzz");
    let targets = targets(&fuzz_dir)?;
    let selected: Vec<String> = match only {
        Some(target) if targets.contains(&target) => vec![target],
        Some(target) => {
            return Err(format!(
                "no fuzz target `{target}`; targets: {}",
                targets.join(", ")
            ))
        }
        None => targets,
    };
    let probe = Command::new("cargo")
        .args(["+nightly", "fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        return Err("cargo-fuzz on the nightly toolchain is needed: \
                    `rustup toolchain install nightly && cargo install cargo-fuzz`"
            .into());
    }
    let mut runs = Vec::new();
    for target in &selected {
        runs.push(fuzz_one(&root, &fuzz_dir, target, seconds)?);
    }
    println!("\n| target | seconds | executions | exec/s | corpus | finding |");
    println!("|---|---:|---:|---:|---:|---|");
    for run in &runs {
        let executions = run
            .executions
            .map_or_else(|| "?".to_string(), |n| n.to_string());
        let rate = match run.executions {
            Some(n) if run.seconds > 0 => (n / run.seconds).to_string(),
            _ => "?".into(),
        };
        println!(
            "| {} | {} | {executions} | {rate} | {} | {} |",
            run.target,
            run.seconds,
            run.corpus,
            run.finding.as_deref().unwrap_or("none"),
        );
    }
    let findings = runs.iter().filter(|r| r.finding.is_some()).count();
    if findings > 0 {
        return Err(format!(
            "{findings} target(s) found a failing input (see fuzz/artifacts/); add it to \
             fuzz/corpus/<target>/ with the fix"
        ));
    }
    Ok(())
}

/// The `[[bin]]` names of fuzz/Cargo.toml.
fn targets(fuzz_dir: &Path) -> Result<Vec<String>, String> {
    let manifest = fuzz_dir.join("Cargo.toml");
    let text =
        std::fs::read_to_string(&manifest).map_err(|e| format!("{}: {e}", manifest.display()))?;
    let mut targets = Vec::new();
    let mut in_bin = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_bin = line == "[[bin]]";
        } else if in_bin {
            if let Some(name) = line
                .strip_prefix("name")
                .and_then(|rest| rest.trim_start().strip_prefix('='))
            {
                targets.push(name.trim().trim_matches('"').to_string());
            }
        }
    }
    if targets.is_empty() {
        return Err(format!("{}: no [[bin]] targets", manifest.display()));
    }
    Ok(targets)
}

fn fuzz_one(root: &Path, fuzz_dir: &Path, target: &str, seconds: u64) -> Result<FuzzRun, String> {
    let work = root.join("target/fuzz-corpus").join(target);
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let seeds = fuzz_dir.join("corpus").join(target);
    eprintln!("fuzz: {target} for {seconds} s");
    let started = Instant::now();
    let output = Command::new("cargo")
        .args(["+nightly", "fuzz", "run", target])
        .arg(&work)
        .arg(&seeds)
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .args(["-max_len=1024", "-print_final_stats=1"])
        .current_dir(fuzz_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("could not start cargo fuzz: {e}"))?;
    let log = String::from_utf8_lossy(&output.stderr);
    let finding = if output.status.success() {
        None
    } else {
        // The first panic or sanitizer line says what broke; the artifact line where.
        let what = log
            .lines()
            .find(|l| l.contains("panicked at") || l.contains("ERROR: libFuzzer"))
            .unwrap_or("the fuzzer failed");
        let artifact = log
            .lines()
            .find(|l| l.contains("Test unit written to"))
            .unwrap_or("");
        eprintln!("{log}");
        Some(format!("{} {}", what.trim(), artifact.trim()))
    };
    let executions = log
        .lines()
        .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
        .and_then(|n| n.trim().parse().ok());
    let corpus = std::fs::read_dir(&work).map_or(0, |d| d.count());
    Ok(FuzzRun {
        target: target.to_string(),
        seconds: started.elapsed().as_secs(),
        executions,
        corpus,
        finding,
    })
}
