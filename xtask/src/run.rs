//! Running tools and timing steps.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The workspace root (the parent of `xtask/`).
pub(crate) fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// A `cargo` command run from the workspace root.
pub(crate) fn cargo(args: &[&str]) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(args).current_dir(workspace_root());
    cmd
}

/// The disk every file under `dir` takes (hard links counted once, links not followed);
/// 0 where it is missing.
pub(crate) fn bytes_under(dir: &std::path::Path) -> u64 {
    fn walk(dir: &std::path::Path, seen: &mut std::collections::HashSet<(u64, u64)>) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let Ok(entries) = std::fs::read_dir(dir) else {
            return 0;
        };
        let mut total = 0;
        for entry in entries.map_while(Result::ok) {
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                total += walk(&entry.path(), seen);
            } else if meta.is_file() && seen.insert((meta.dev(), meta.ino())) {
                total += meta.blocks() * 512;
            }
        }
        total
    }
    walk(dir, &mut std::collections::HashSet::new())
}

/// Runs `cmd` with inherited output; `Err` names the command when it fails.
pub(crate) fn status(cmd: &mut Command) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    let status = cmd
        .status()
        .map_err(|e| format!("could not start {shown}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed ({status})"))
    }
}

/// Runs `cmd`, echoing its stdout and stderr as they come, and returns both joined.
pub(crate) fn tee(cmd: &mut Command) -> Result<(bool, String), String> {
    use std::io::{BufRead, BufReader};
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start {shown}: {e}"))?;
    let stderr = child.stderr.take().expect("piped");
    let err_thread = std::thread::spawn(move || {
        let mut seen = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            seen.push_str(&line);
            seen.push('\n');
        }
        seen
    });
    let mut seen = String::new();
    for line in BufReader::new(child.stdout.take().expect("piped"))
        .lines()
        .map_while(Result::ok)
    {
        println!("{line}");
        seen.push_str(&line);
        seen.push('\n');
    }
    seen.push_str(&err_thread.join().unwrap_or_default());
    let status = child.wait().map_err(|e| format!("{shown}: {e}"))?;
    Ok((status.success(), seen))
}

/// The outcome of one named step.
pub(crate) struct StepResult {
    pub(crate) name: String,
    pub(crate) outcome: Outcome,
    pub(crate) took: Duration,
}

/// How a step ended.
pub(crate) enum Outcome {
    Passed(String),
    Failed(String),
    Skipped(String),
}

/// Runs steps in order, printing a header and time for each, and a summary at the end.
#[derive(Default)]
pub(crate) struct Steps {
    results: Vec<StepResult>,
}

impl Steps {
    /// Runs `f` as step `name`. `Ok(note)` passes with a note, `Err(msg)` fails.
    pub(crate) fn run(&mut self, name: &str, f: impl FnOnce() -> Result<String, String>) {
        println!("\n==> {name}");
        let start = Instant::now();
        let outcome = match f() {
            Ok(note) => Outcome::Passed(note),
            Err(message) => Outcome::Failed(message),
        };
        let took = start.elapsed();
        match &outcome {
            Outcome::Passed(_) => println!("==> {name}: ok ({:.1}s)", took.as_secs_f64()),
            Outcome::Failed(m) => println!("==> {name}: FAILED ({:.1}s): {m}", took.as_secs_f64()),
            Outcome::Skipped(_) => {}
        }
        self.results.push(StepResult {
            name: name.to_string(),
            outcome,
            took,
        });
    }

    /// Records a step that was not run, with the reason.
    pub(crate) fn skip(&mut self, name: &str, reason: &str) {
        println!("\n==> {name}: SKIPPED: {reason}");
        self.results.push(StepResult {
            name: name.to_string(),
            outcome: Outcome::Skipped(reason.to_string()),
            took: Duration::ZERO,
        });
    }

    /// Whether any step failed so far.
    pub(crate) fn any_failed(&self) -> bool {
        self.results
            .iter()
            .any(|r| matches!(r.outcome, Outcome::Failed(_)))
    }

    /// Prints the summary table; `Err` when a step failed.
    pub(crate) fn finish(self) -> Result<(), String> {
        println!("\n==================== summary ====================");
        for r in &self.results {
            let (word, note) = match &r.outcome {
                Outcome::Passed(n) => ("ok", n.as_str()),
                Outcome::Failed(n) => ("FAILED", n.as_str()),
                Outcome::Skipped(n) => ("skipped", n.as_str()),
            };
            println!(
                "{:<10} {:<8} {:>7.1}s  {}",
                r.name,
                word,
                r.took.as_secs_f64(),
                note.lines().next().unwrap_or("")
            );
        }
        // A failure's further lines (a VM entry's last output) come after the table, where
        // they are still in the end of the output that CI keeps.
        for r in &self.results {
            if let Outcome::Failed(note) = &r.outcome {
                for line in note.lines().skip(1) {
                    println!("{}: {line}", r.name);
                }
            }
        }
        let failed: Vec<&str> = self
            .results
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Failed(_)))
            .map(|r| r.name.as_str())
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(format!("failed steps: {}", failed.join(", ")))
        }
    }
}
