//! `cargo xtask bench --count`: instructions per operation of the simulated paths,
//! counted by callgrind, against a checked-in baseline.
//!
//! Wall-clock ratios of small differences on a busy two-core machine measure noise; an
//! instruction count of a deterministic program is the same on every run, so a change
//! of a few percent is the code's. Each scenario of `cm-bench-count` (see
//! `cm_benches::count`) runs under `valgrind --tool=callgrind` twice, for [`K1`] and
//! [`K2`] operations, counting only inside the benches' `measured` function; the
//! difference of the totals over [`K2`] − [`K1`] is one operation's instructions, with
//! the fixture, warm-up and process start cancelled out.
//!
//! The figures depend on the compiler, glibc (malloc is on every path) and the build
//! (release profile, the bench's features, no `RUSTFLAGS`), so the baseline records
//! the compiler and glibc it was made with; under another, the changes are shown but
//! do not fail.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use crate::run::{cargo, status, workspace_root};

/// Operations of the first run of each scenario.
pub(crate) const K1: u32 = 200;
/// Operations of the second run; the difference of the two runs' totals over
/// `K2 - K1` operations is one operation's instructions.
pub(crate) const K2: u32 = 400;
/// A figure more than this many percent above its baseline is a regression.
pub(crate) const THRESHOLD_PERCENT: f64 = 2.0;
/// The checked-in baseline, relative to the workspace root.
pub(crate) const BASELINE: &str = "benches/instructions-baseline.txt";
/// The scenario binary of `cm-benches`.
const BIN: &str = "cm-bench-count";
/// The heading of the table in the reports (also how an earlier table is found and
/// replaced in `bench-report.md`).
const HEADING: &str = "## Instructions per operation (callgrind)";

/// Runs the scenarios, writes the table (`bench-count.md` in the target folder, and
/// into `bench-report.md` there if it exists) and fails on a regression;
/// `update_baseline` writes the figures as the new baseline instead of failing.
/// Returns a one-line summary.
pub(crate) fn run(target: &Path, update_baseline: bool) -> Result<String, String> {
    let valgrind = valgrind_version()?;
    let bin = build(target)?;
    let (scenarios, pattern) = list_scenarios(&bin)?;
    let out_dir = target.join("bench-count");
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let figures = count_all(&bin, &pattern, &scenarios, &out_dir)?;
    let toolchain = Toolchain::current()?;
    let baseline_path = workspace_root().join(BASELINE);

    if update_baseline {
        let text = render_baseline(&figures, &toolchain);
        std::fs::write(&baseline_path, text)
            .map_err(|e| format!("{}: {e}", baseline_path.display()))?;
    }
    let baseline = match std::fs::read_to_string(&baseline_path) {
        Ok(text) => parse_baseline(&text)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Baseline::default(),
        Err(e) => return Err(format!("{}: {e}", baseline_path.display())),
    };
    let comparison = compare(&figures, &baseline, &toolchain);
    let markdown = render_table(&comparison, &toolchain, &valgrind);
    println!("\n{markdown}");

    let path = target.join("bench-count.md");
    std::fs::write(&path, &markdown).map_err(|e| format!("{}: {e}", path.display()))?;
    let report = target.join("bench-report.md");
    if let Ok(existing) = std::fs::read_to_string(&report) {
        std::fs::write(&report, splice_section(&existing, &markdown))
            .map_err(|e| format!("{}: {e}", report.display()))?;
    }

    let regressed: Vec<String> = comparison
        .rows
        .iter()
        .filter(|r| r.regressed())
        .map(|r| format!("{} {:+.1}%", r.scenario, r.change.unwrap_or(0.0)))
        .collect();
    let mut summary = format!(
        "{} scenarios counted; {}",
        comparison.rows.len(),
        path.display()
    );
    if comparison.toolchain_differs.is_some() && !update_baseline {
        summary.push_str("; not judged: the baseline is from another toolchain");
    }
    if update_baseline {
        Ok(format!("{summary}; baseline written to {BASELINE}"))
    } else if regressed.is_empty() || comparison.toolchain_differs.is_some() {
        Ok(summary)
    } else {
        Err(format!(
            "more than {THRESHOLD_PERCENT}% more instructions than {BASELINE}: {} \
             (if intended, refresh it: cargo xtask bench --count --update-baseline)",
            regressed.join(", ")
        ))
    }
}

/// `valgrind --version`, or an error naming the package to install.
fn valgrind_version() -> Result<String, String> {
    let missing = "valgrind is not installed: the instruction counts run under callgrind \
                   (Debian package `valgrind`, listed in ci/apt-packages.txt: \
                   apt-get install valgrind, or `cargo xtask deps` as root)";
    let out = Command::new("valgrind")
        .arg("--version")
        .output()
        .map_err(|_| missing.to_string())?;
    if !out.status.success() {
        return Err(missing.to_string());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Builds `cm-bench-count` in release and returns its path.
///
/// With the features `cargo bench -p cm-benches` resolves (its dev-dependencies turn on
/// cm-mock's `mocks`), so that after the bench build only the binary is linked; and
/// without `RUSTFLAGS` or profile overrides from the environment, which would change
/// the code counted.
fn build(target: &Path) -> Result<PathBuf, String> {
    let mut cmd = cargo(&[
        "build",
        "--release",
        "--quiet",
        "-p",
        "cm-benches",
        "--bin",
        BIN,
        "--features",
        "cm-mock/mocks",
    ]);
    cmd.env("CARGO_TARGET_DIR", target);
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.ends_with("RUSTFLAGS") || name.starts_with("CARGO_PROFILE_RELEASE_") {
            cmd.env_remove(&*name);
        }
    }
    status(&mut cmd)?;
    Ok(target.join("release").join(BIN))
}

/// The binary's scenarios and the symbol pattern callgrind counts inside.
fn list_scenarios(bin: &Path) -> Result<(Vec<String>, String), String> {
    let out = Command::new(bin)
        .arg("--list")
        .output()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    if !out.status.success() {
        return Err(format!("{} --list failed ({})", bin.display(), out.status));
    }
    parse_list(&String::from_utf8_lossy(&out.stdout))
}

/// Parses `cm-bench-count --list`: scenario names, then `measured: PATTERN`.
fn parse_list(text: &str) -> Result<(Vec<String>, String), String> {
    let mut names = Vec::new();
    let mut pattern = None;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match line.strip_prefix("measured:") {
            Some(p) => pattern = Some(p.trim().to_string()),
            None => names.push(line.to_string()),
        }
    }
    match pattern {
        Some(p) if !names.is_empty() => Ok((names, p)),
        _ => Err(format!(
            "{BIN} --list gave no scenarios or no `measured:` line"
        )),
    }
}

/// Instructions per operation by scenario, in the binary's order.
pub(crate) type Figures = Vec<(String, f64)>;

/// Counts every scenario ([`K1`] and [`K2`] runs, as many at once as there are CPUs:
/// the counts do not depend on the load).
fn count_all(
    bin: &Path,
    pattern: &str,
    scenarios: &[String],
    out_dir: &Path,
) -> Result<Figures, String> {
    let jobs: Vec<(&str, u32)> = scenarios
        .iter()
        .flat_map(|s| [(s.as_str(), K1), (s.as_str(), K2)])
        .collect();
    let next = Mutex::new(jobs.into_iter());
    let totals: Mutex<BTreeMap<(String, u32), Result<u64, String>>> = Mutex::default();
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                let Some((scenario, k)) = next.lock().expect("no worker panics").next() else {
                    break;
                };
                let total = callgrind_total(bin, pattern, scenario, k, out_dir);
                totals
                    .lock()
                    .expect("no worker panics")
                    .insert((scenario.to_string(), k), total);
            });
        }
    });
    let mut totals = totals.into_inner().expect("no worker panics");
    let mut figures = Vec::new();
    for scenario in scenarios {
        let mut take = |k: u32| {
            totals
                .remove(&(scenario.clone(), k))
                .unwrap_or_else(|| Err(format!("{scenario}: not run")))
        };
        let (first, second) = (take(K1)?, take(K2)?);
        figures.push((scenario.clone(), per_op(scenario, first, second)?));
    }
    Ok(figures)
}

/// One callgrind run of `scenario` for `k` operations: the instructions counted inside
/// the `measured` function (the output file's `totals:` line).
fn callgrind_total(
    bin: &Path,
    pattern: &str,
    scenario: &str,
    k: u32,
    out_dir: &Path,
) -> Result<u64, String> {
    let file = out_dir.join(format!("{scenario}-{k}.callgrind"));
    let out = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", file.display()))
        .arg(format!("--toggle-collect={pattern}"))
        .arg(bin)
        .arg(scenario)
        .arg(k.to_string())
        .output()
        .map_err(|e| format!("could not start valgrind: {e}"))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(15).collect();
        return Err(format!(
            "{scenario} ({k} operations) under callgrind failed ({}):\n{}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    let total = parse_totals(&text)
        .ok_or_else(|| format!("{}: no `totals:` or `summary:` line", file.display()))?;
    if total == 0 {
        return Err(format!(
            "{scenario}: callgrind counted nothing inside `{pattern}`: the function was \
             renamed or its symbol is gone"
        ));
    }
    Ok(total)
}

/// The total of the first event (Ir) in a callgrind output file: its `totals:` line,
/// else its `summary:` line.
pub(crate) fn parse_totals(text: &str) -> Option<u64> {
    let field = |prefix: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
    };
    field("totals:").or_else(|| field("summary:"))
}

/// Instructions of one operation from the totals of the [`K1`] and [`K2`] runs.
pub(crate) fn per_op(scenario: &str, first: u64, second: u64) -> Result<f64, String> {
    if second < first {
        return Err(format!(
            "{scenario}: {K2} operations counted fewer instructions ({second}) than {K1} \
             ({first})"
        ));
    }
    Ok((second - first) as f64 / f64::from(K2 - K1))
}

/// What the figures depend on besides the code: the compiler and the C library.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Toolchain {
    /// `rustc --version`.
    pub(crate) rustc: String,
    /// `getconf GNU_LIBC_VERSION`.
    pub(crate) glibc: String,
}

impl Toolchain {
    /// The toolchain here (the compiler cargo uses in the workspace root).
    fn current() -> Result<Toolchain, String> {
        let read = |program: &str, args: &[&str]| -> Result<String, String> {
            let out = Command::new(program)
                .args(args)
                .current_dir(workspace_root())
                .output()
                .map_err(|e| format!("{program}: {e}"))?;
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        };
        let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
        Ok(Toolchain {
            rustc: read(&rustc, &["--version"])?,
            glibc: read("getconf", &["GNU_LIBC_VERSION"])?,
        })
    }
}

/// The checked-in baseline: figures by scenario and the toolchain they came from.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Baseline {
    /// Instructions per operation by scenario.
    pub(crate) figures: BTreeMap<String, f64>,
    /// The toolchain recorded in its header (`# rustc: …`, `# glibc: …`).
    pub(crate) toolchain: Toolchain,
}

/// Parses the baseline: `scenario value` lines; `#` starts a comment, and the comment
/// lines `# rustc: …` and `# glibc: …` name the toolchain.
pub(crate) fn parse_baseline(text: &str) -> Result<Baseline, String> {
    let mut baseline = Baseline::default();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if let Some(comment) = line.strip_prefix('#') {
            let comment = comment.trim();
            if let Some(v) = comment.strip_prefix("rustc:") {
                baseline.toolchain.rustc = v.trim().to_string();
            } else if let Some(v) = comment.strip_prefix("glibc:") {
                baseline.toolchain.glibc = v.trim().to_string();
            }
            continue;
        }
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [name, value] = fields[..] else {
            return Err(format!(
                "{BASELINE}:{}: expected `scenario value`, got `{line}`",
                n + 1
            ));
        };
        let value: f64 = value
            .parse()
            .map_err(|_| format!("{BASELINE}:{}: `{value}` is not a number", n + 1))?;
        baseline.figures.insert(name.to_string(), value);
    }
    Ok(baseline)
}

/// The baseline file for `figures`, with its header.
pub(crate) fn render_baseline(figures: &[(String, f64)], toolchain: &Toolchain) -> String {
    let mut text = format!(
        "\
# Instructions per operation of the simulated paths, counted by callgrind
# (`cargo xtask bench --count`; the scenarios are in benches/src/count.rs). A figure
# more than {THRESHOLD_PERCENT}% above its line here fails the count (and CI).
# Refresh after an intended change: cargo xtask bench --count --update-baseline
# The counts depend on the build: release profile, cm-bench-count built with the
# bench's features and no RUSTFLAGS (xtask builds it so), and on the compiler and
# glibc below; under another toolchain the changes are shown but do not fail.
# rustc: {}
# glibc: {}
",
        toolchain.rustc, toolchain.glibc
    );
    for (name, value) in figures {
        let _ = writeln!(text, "{name} {value:.1}");
    }
    text
}

/// One scenario's figure against its baseline.
#[derive(Debug, PartialEq)]
pub(crate) struct Row {
    /// The scenario.
    pub(crate) scenario: String,
    /// Instructions per operation now.
    pub(crate) value: f64,
    /// The baseline's figure, if it has one.
    pub(crate) baseline: Option<f64>,
    /// The change over the baseline, percent.
    pub(crate) change: Option<f64>,
}

impl Row {
    /// More than [`THRESHOLD_PERCENT`] above the baseline.
    pub(crate) fn regressed(&self) -> bool {
        self.change.is_some_and(|c| c > THRESHOLD_PERCENT)
    }
}

/// Every scenario's row, and why they are not judged when the toolchain differs.
#[derive(Debug, PartialEq)]
pub(crate) struct Comparison {
    /// One per scenario counted, in the binary's order.
    pub(crate) rows: Vec<Row>,
    /// Set when the baseline names another compiler or glibc: the note to print.
    pub(crate) toolchain_differs: Option<String>,
}

/// The figures against the baseline.
pub(crate) fn compare(
    figures: &[(String, f64)],
    baseline: &Baseline,
    toolchain: &Toolchain,
) -> Comparison {
    let rows = figures
        .iter()
        .map(|&(ref scenario, value)| {
            let base = baseline.figures.get(scenario).copied();
            Row {
                scenario: scenario.clone(),
                value,
                baseline: base,
                change: base.filter(|b| *b > 0.0).map(|b| (value - b) / b * 100.0),
            }
        })
        .collect();
    let mut differs = Vec::new();
    for (what, then, now) in [
        ("rustc", &baseline.toolchain.rustc, &toolchain.rustc),
        ("glibc", &baseline.toolchain.glibc, &toolchain.glibc),
    ] {
        // No baseline at all: nothing is judged, and nothing to say of its toolchain.
        if then != now && !baseline.figures.is_empty() {
            differs.push(format!("{what} `{then}`, here `{now}`"));
        }
    }
    Comparison {
        rows,
        toolchain_differs: (!differs.is_empty()).then(|| {
            format!(
                "the baseline was counted with {}: changes are shown, not judged; \
                 refresh it with `cargo xtask bench --count --update-baseline`",
                differs.join("; ")
            )
        }),
    }
}

/// The markdown table: scenario, instructions per operation, baseline, change.
pub(crate) fn render_table(
    comparison: &Comparison,
    toolchain: &Toolchain,
    valgrind: &str,
) -> String {
    let mut md = format!(
        "{HEADING}\n\n\
         Instructions (callgrind Ir) per operation: ({K2}-operation run − {K1}-operation \
         run) / {}, counted inside the operation only. Deterministic: the same build gives \
         the same figure on every run. Regression: more than {THRESHOLD_PERCENT}% above \
         `{BASELINE}`. {}; {}; {valgrind}.\n\n\
         | scenario | instructions / op | baseline | change |\n\
         |---|---:|---:|---:|\n",
        K2 - K1,
        toolchain.rustc,
        toolchain.glibc
    );
    for row in &comparison.rows {
        let baseline = row
            .baseline
            .map_or_else(|| "none".to_string(), |b| format!("{b:.1}"));
        let change = match row.change {
            None => "–".to_string(),
            Some(c) if row.regressed() => format!("**{c:+.2}%** (regression)"),
            Some(c) => format!("{c:+.2}%"),
        };
        let _ = writeln!(
            md,
            "| {} | {:.1} | {baseline} | {change} |",
            row.scenario, row.value
        );
    }
    if let Some(note) = &comparison.toolchain_differs {
        let _ = writeln!(md, "\nNote: {note}.");
    }
    md
}

/// `report` with the instruction-count section replaced by `section` (appended when it
/// has none), so that counting again does not repeat the table.
pub(crate) fn splice_section(report: &str, section: &str) -> String {
    let (before, after) = match report.find(HEADING) {
        Some(start) => {
            let rest = &report[start + HEADING.len()..];
            let end = rest.find("\n## ").map_or("", |i| &rest[i + 1..]);
            (&report[..start], end)
        }
        None => (report, ""),
    };
    let mut out = before.trim_end().to_string();
    if !out.is_empty() {
        out.push_str("\n\n");
    }
    out.push_str(section.trim_end());
    out.push('\n');
    if !after.is_empty() {
        out.push('\n');
        out.push_str(after);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toolchain() -> Toolchain {
        Toolchain {
            rustc: "rustc 1.95.0".into(),
            glibc: "glibc 2.36".into(),
        }
    }

    fn figures(pairs: &[(&str, f64)]) -> Figures {
        pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
    }

    #[test]
    fn totals_come_from_the_totals_line_else_the_summary() {
        let file = "\
version: 1
creator: callgrind-3.19.0
events: Ir
summary: 10600987

fn=(1) main
12 5
totals: 10600990
";
        assert_eq!(parse_totals(file), Some(10_600_990));
        assert_eq!(parse_totals("events: Ir\nsummary: 48500\n"), Some(48_500));
        // Several events: the first (Ir) is taken.
        assert_eq!(parse_totals("events: Ir Dr\ntotals: 7 3\n"), Some(7));
        assert_eq!(parse_totals("events: Ir\n"), None);
        assert_eq!(parse_totals("totals: many\n"), None);
    }

    #[test]
    fn one_operation_is_the_difference_over_the_extra_operations() {
        assert_eq!(per_op("s", 29_100, 48_500), Ok(97.0));
        assert_eq!(
            per_op("s", 10_600_987, 17_659_787),
            Ok(7_058_800.0 / f64::from(K2 - K1))
        );
        assert!(per_op("s", 2, 1).is_err());
    }

    #[test]
    fn the_list_gives_scenarios_and_the_pattern() {
        let (names, pattern) =
            parse_list("pump_comm_est\nendpoint_echo\nmeasured: a::b::measured*\n").unwrap();
        assert_eq!(names, ["pump_comm_est", "endpoint_echo"]);
        assert_eq!(pattern, "a::b::measured*");
        assert!(parse_list("pump_comm_est\n").is_err());
        assert!(parse_list("measured: x\n").is_err());
    }

    #[test]
    fn the_baseline_reads_back_what_it_wrote() {
        let written = render_baseline(&figures(&[("echo", 16353.0), ("pump", 97.5)]), &toolchain());
        assert!(written.contains("--update-baseline"), "{written}");
        let read = parse_baseline(&written).unwrap();
        let expected: BTreeMap<String, f64> = figures(&[("echo", 16353.0), ("pump", 97.5)])
            .into_iter()
            .collect();
        assert_eq!(read.figures, expected);
        assert_eq!(read.toolchain, toolchain());
        assert!(parse_baseline("pump\n").is_err());
        assert!(parse_baseline("pump 1 2\n").is_err());
        assert!(parse_baseline("pump lots\n").is_err());
    }

    #[test]
    fn only_more_than_the_threshold_above_the_baseline_regresses() {
        let baseline = Baseline {
            figures: figures(&[("a", 1000.0), ("b", 1000.0), ("c", 1000.0)])
                .into_iter()
                .collect(),
            toolchain: toolchain(),
        };
        let now = figures(&[("a", 1020.0), ("b", 1020.5), ("c", 900.0), ("new", 5.0)]);
        let comparison = compare(&now, &baseline, &toolchain());
        let judged: Vec<(&str, bool)> = comparison
            .rows
            .iter()
            .map(|r| (r.scenario.as_str(), r.regressed()))
            .collect();
        assert_eq!(
            judged,
            [("a", false), ("b", true), ("c", false), ("new", false)]
        );
        assert_eq!(comparison.rows[3].baseline, None);
        assert_eq!(comparison.toolchain_differs, None);
        let table = render_table(&comparison, &toolchain(), "valgrind-3.19.0");
        assert!(
            table.contains("| b | 1020.5 | 1000.0 | **+2.05%** (regression) |"),
            "{table}"
        );
        assert!(
            table.contains("| c | 900.0 | 1000.0 | -10.00% |"),
            "{table}"
        );
        assert!(table.contains("| new | 5.0 | none | – |"), "{table}");
    }

    #[test]
    fn another_compiler_is_named_and_not_judged() {
        let baseline = Baseline {
            figures: figures(&[("a", 1000.0)]).into_iter().collect(),
            toolchain: Toolchain {
                rustc: "rustc 1.94.0".into(),
                ..toolchain()
            },
        };
        let comparison = compare(&figures(&[("a", 1100.0)]), &baseline, &toolchain());
        let note = comparison.toolchain_differs.expect("rustc differs");
        assert!(
            note.contains("rustc 1.94.0") && note.contains("--update-baseline"),
            "{note}"
        );
        assert!(comparison.rows[0].regressed());
    }

    #[test]
    fn the_checked_in_baseline_parses_and_names_its_toolchain() {
        let text = std::fs::read_to_string(workspace_root().join(BASELINE)).unwrap();
        let baseline = parse_baseline(&text).unwrap();
        assert!(baseline.figures.len() >= 3, "{baseline:?}");
        assert!(
            baseline.toolchain.rustc.starts_with("rustc "),
            "{baseline:?}"
        );
        assert!(
            baseline.toolchain.glibc.starts_with("glibc "),
            "{baseline:?}"
        );
        assert!(text.contains("--update-baseline"));
    }

    #[test]
    fn the_section_replaces_an_earlier_one_in_the_report() {
        let section = format!("{HEADING}\n\n| t |\n");
        let fresh = splice_section("# Report\n\n| x |\n", &section);
        assert_eq!(fresh, format!("# Report\n\n| x |\n\n{HEADING}\n\n| t |\n"));
        let again = splice_section(&fresh, &format!("{HEADING}\n\n| u |\n"));
        assert_eq!(again, format!("# Report\n\n| x |\n\n{HEADING}\n\n| u |\n"));
        // A section after it stays.
        let middle = format!("# R\n\n{HEADING}\n\nold\n\n## Later\n\nkept\n");
        assert_eq!(
            splice_section(&middle, &section),
            format!("# R\n\n{HEADING}\n\n| t |\n\n## Later\n\nkept\n")
        );
        assert_eq!(splice_section("", &section), section);
    }
}
