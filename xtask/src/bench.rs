//! `cargo xtask bench`: runs the criterion benches of the notify path (`cm-benches`) and
//! ends with one table (also written to `target/bench-report.md`), the scale curve as
//! an SVG next to it and criterion's HTML report under `target/criterion/`.
//!
//! The figures come from criterion's `new/estimates.json` files (median point estimate)
//! and from the results file the benches write for what criterion does not measure
//! (allocations, peak memory, outcomes, real-device figures, skips).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use cm_testkit::{Figure, FIGURE_PREFIX};

use crate::run::{cargo, status, workspace_root};

/// The scale points the benches run, in connections.
const SCALE_POINTS: [u64; 3] = [1_000, 10_000, 100_000];
/// The largest growth of the time per connection over the 1k point that the report
/// still calls flat.
const FLAT_RATIO: f64 = 1.25;
/// How far the simulated work per connection may differ from the 1k point's and still
/// count as the same work (10% RTU loss draws a slightly different share at each N).
const WORK_TOLERANCE: f64 = 0.02;

/// glibc keeps freed memory (no trimming; blocks up to 32 MiB from the heap, not fresh
/// mappings). Criterion repeats each scale run: with glibc's defaults the 1k run reuses
/// its already-mapped heap while the 100k run (75 MB) gets it mapped and faulted in
/// afresh every time (~0.3 µs per connection), which measures the allocator's trimming,
/// not the simulation. The report prints page faults per connection either way.
const WARM_HEAP_TUNABLES: &str =
    "glibc.malloc.trim_threshold=4294967295:glibc.malloc.mmap_threshold=33554432";

/// Runs the benches (`--smoke`: the short CI mode; `--vm`: also the real-device quick
/// mode inside the soft-RoCE VM, its figures folded into the table) and prints the report.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let (mut smoke, mut vm) = (false, false);
    for arg in args {
        match arg.as_str() {
            "--smoke" => smoke = true,
            "--vm" => vm = true,
            other => return Err(format!("bench: unknown option `{other}`")),
        }
    }
    if smoke && !vm {
        let summary = ci_smoke()?;
        println!("{summary}");
        return Ok(());
    }
    let report = bench(smoke, vm)?;
    println!("\n{}", report.markdown);
    println!("report: {}", report.path.display());
    println!("scale curve: {}", report.svg.display());
    println!("criterion HTML report: {}", report.html.display());
    Ok(())
}

/// The VM manifest of the real-device quick mode (see `ci/vm/payload.txt`).
const VM_MANIFEST: &str = "\
cargo-bin cm-benches cm-bench-real rdma
exec bench-real timeout=240 CMNOTIFY_BENCH_OUT=/tmp/cm-benches cm-bench-real 300
cargo-test cm-sys test=notify_overhead timeout=120
";

/// Runs the real-device quick mode in the VM and returns the figures it printed (the
/// `cm-benches: ` lines of the console log), labelled with the VM as their machine.
///
/// The VM payload is a dev build; here it is optimised (in its own target folder, so
/// the usual dev build stays cached), or unoptimised code shows in the ratios: measured,
/// pump / hand loop 1.41 unoptimised against 0.98 optimised.
fn vm_figures(target: &Path) -> Result<BTreeMap<String, Figure>, String> {
    let manifest = target.join("cm-benches/vm-payload.txt");
    std::fs::write(&manifest, VM_MANIFEST).map_err(|e| format!("{}: {e}", manifest.display()))?;
    let vm_target = target.join("bench-vm");
    let optimised = [
        ("CARGO_TARGET_DIR", vm_target.display().to_string()),
        ("CARGO_PROFILE_DEV_OPT_LEVEL", "3".to_string()),
        ("CARGO_PROFILE_DEV_DEBUG_ASSERTIONS", "false".to_string()),
        ("CARGO_PROFILE_DEV_OVERFLOW_CHECKS", "false".to_string()),
    ];
    let saved: Vec<_> = optimised
        .iter()
        .map(|(name, _)| (*name, std::env::var_os(name)))
        .collect();
    // xtask is single-threaded here: the VM runner's cargo builds inherit these.
    for (name, value) in &optimised {
        std::env::set_var(name, value);
    }
    let ran = crate::vm::run(&["--manifest".to_string(), manifest.display().to_string()]);
    for (name, value) in saved {
        match value {
            Some(value) => std::env::set_var(name, value),
            None => std::env::remove_var(name),
        }
    }
    let console = vm_target.join("vm/console.log");
    let log =
        std::fs::read_to_string(&console).map_err(|e| format!("{}: {e}", console.display()))?;
    let lines: String = log
        .lines()
        .filter_map(|l| {
            l.split_once(FIGURE_PREFIX)
                .map(|(_, figure)| format!("{figure}\n"))
        })
        .collect();
    let figures = parse_results(&lines);
    match (ran, figures.is_empty()) {
        (Err(e), true) => Err(format!("the VM run gave no figures: {e}")),
        _ => Ok(figures),
    }
}

/// The CI step: compiles the benches, runs them in smoke mode (short samples, no 100k
/// scale point) and returns a one-line summary.
pub(crate) fn ci_smoke() -> Result<String, String> {
    status(
        cargo(&["bench", "--no-run", "-p", "cm-benches"]).env("CARGO_TARGET_DIR", target_dir()),
    )?;
    let report = bench(true, false)?;
    println!("\n{}", report.markdown);
    Ok(format!(
        "{} figures, smoke mode (100k scale point skipped); {}",
        report.rows,
        report.path.display()
    ))
}

/// Where a report went.
struct Written {
    markdown: String,
    rows: usize,
    path: PathBuf,
    svg: PathBuf,
    html: PathBuf,
}

/// `--features rdma` where librdmacm's headers are installed (the real-device benches
/// then run, or report the missing device), nothing elsewhere.
fn features() -> Vec<&'static str> {
    if Path::new("/usr/include/rdma/rdma_cma.h").exists() {
        vec!["--features", "rdma"]
    } else {
        Vec::new()
    }
}

/// The cargo target folder (`CARGO_TARGET_DIR`, else `target/`).
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| {
            if p.is_relative() {
                workspace_root().join(p)
            } else {
                p
            }
        })
        .unwrap_or_else(|| workspace_root().join("target"))
}

fn bench(smoke: bool, vm: bool) -> Result<Written, String> {
    let target = target_dir();
    let criterion_home = target.join("criterion");
    let out = target.join("cm-benches");
    let results = out.join("results.tsv");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    if results.exists() {
        std::fs::remove_file(&results).map_err(|e| format!("{}: {e}", results.display()))?;
    }
    let started = SystemTime::now();
    let mut args = vec!["bench", "-p", "cm-benches"];
    args.extend(features());
    let mut cmd = cargo(&args);
    cmd.env("CARGO_TARGET_DIR", &target)
        .env("CRITERION_HOME", &criterion_home)
        .env("CMNOTIFY_BENCH_OUT", &out)
        .env("GLIBC_TUNABLES", WARM_HEAP_TUNABLES);
    if smoke {
        cmd.env("CMNOTIFY_BENCH_SMOKE", "1");
    }
    status(&mut cmd)?;

    let extra = std::fs::read_to_string(&results)
        .map_err(|e| format!("the benches wrote no {}: {e}", results.display()))?;
    let mut figures = Figures {
        estimates: read_estimates(&criterion_home, started),
        extra: parse_results(&extra),
        vm: BTreeMap::new(),
    };
    if vm {
        match vm_figures(&target) {
            Ok(found) => figures.vm = found,
            Err(e) => eprintln!("bench: {e}"),
        }
    }
    let machine = host_machine();
    let rows = figures.rows(&machine);
    let scale = figures.scale_points();
    let markdown = render_markdown(&rows, &machine, smoke);
    let path = target.join("bench-report.md");
    let svg = target.join("bench-scale.svg");
    std::fs::write(&path, &markdown).map_err(|e| format!("{}: {e}", path.display()))?;
    std::fs::write(&svg, render_svg(&scale)).map_err(|e| format!("{}: {e}", svg.display()))?;
    Ok(Written {
        markdown,
        rows: rows.len(),
        path,
        svg,
        html: criterion_home.join("report/index.html"),
    })
}

/// Criterion's median estimates (ns per iteration) by benchmark id (`group/name`), from
/// `estimates.json` files written after `since` (older ones are from another run).
fn read_estimates(criterion_home: &Path, since: SystemTime) -> BTreeMap<String, f64> {
    let mut estimates = BTreeMap::new();
    let mut stack = vec![criterion_home.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let is_new_estimate = path.file_name().is_some_and(|n| n == "estimates.json")
                && path
                    .parent()
                    .and_then(Path::file_name)
                    .is_some_and(|n| n == "new");
            if !is_new_estimate {
                continue;
            }
            let fresh = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|modified| modified >= since);
            let Some(id) = path
                .parent()
                .and_then(Path::parent)
                .and_then(|bench| bench.strip_prefix(criterion_home).ok())
                .map(|id| id.to_string_lossy().replace('\\', "/"))
            else {
                continue;
            };
            let median = std::fs::read_to_string(&path)
                .ok()
                .and_then(|json| json_point_estimate(&json, "median"));
            if let (true, Some(median)) = (fresh, median) {
                estimates.insert(id, median);
            }
        }
    }
    estimates
}

/// The `point_estimate` of the statistic `name` in criterion's estimates.json, found
/// with plain string search (xtask has no dependencies).
fn json_point_estimate(json: &str, name: &str) -> Option<f64> {
    let start = json.find(&format!("\"{name}\""))?;
    let rest = &json[start..];
    let value = &rest[rest.find("\"point_estimate\"")? + "\"point_estimate\"".len()..];
    let value = value.trim_start().strip_prefix(':')?.trim_start();
    let end = value
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(value.len());
    value[..end].parse().ok()
}

/// Parses the results file (lines of [`Figure::to_line`]) into figures by key; lines
/// that do not parse are dropped.
fn parse_results(text: &str) -> BTreeMap<String, Figure> {
    let mut map = BTreeMap::new();
    for figure in text.lines().filter_map(Figure::from_line) {
        // A measured figure wins over a skipped one of the same key (the bench binary
        // skips `real/notify`, which cm-sys's own test measures in the same VM run).
        if figure.value.is_none()
            && map
                .get(&figure.key)
                .is_some_and(|f: &Figure| f.value.is_some())
        {
            continue;
        }
        map.insert(figure.key.clone(), figure);
    }
    map
}

/// Everything measured in one run.
struct Figures {
    estimates: BTreeMap<String, f64>,
    extra: BTreeMap<String, Figure>,
    /// The real-device figures measured inside the VM (`--vm`).
    vm: BTreeMap<String, Figure>,
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    figure: String,
    value: String,
    baseline: String,
    ratio: String,
    target: String,
    machine: String,
    note: String,
}

fn ns(value: f64) -> String {
    if value >= 1e6 {
        format!("{:.2} ms", value / 1e6)
    } else if value >= 1e3 {
        format!("{:.2} µs", value / 1e3)
    } else {
        format!("{value:.1} ns")
    }
}

/// `value / baseline`, or "-".
fn ratio(value: Option<f64>, baseline: Option<f64>) -> String {
    match (value, baseline) {
        (Some(v), Some(b)) if b > 0.0 => format!("{:.2}", v / b),
        _ => "-".to_string(),
    }
}

/// One point of the scale curve.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ScalePoint {
    connections: u64,
    ns_per_conn: Option<f64>,
    bytes_per_conn: Option<f64>,
}

impl Figures {
    fn estimate(&self, id: &str) -> Option<f64> {
        self.estimates.get(id).copied()
    }

    fn extra(&self, key: &str) -> Option<&Figure> {
        self.extra.get(key)
    }

    fn scale_points(&self) -> Vec<ScalePoint> {
        SCALE_POINTS
            .iter()
            .map(|&n| ScalePoint {
                connections: n,
                ns_per_conn: self.estimate(&format!("scale/{n}")).map(|t| t / n as f64),
                bytes_per_conn: self
                    .extra(&format!("scale/{n}/peak_bytes_per_conn"))
                    .and_then(|e| e.value),
            })
            .collect()
    }

    /// A timed criterion figure against a timed baseline.
    fn timed(
        &self,
        figure: &str,
        id: &str,
        baseline: Option<(&str, &str)>,
        target: &str,
        machine: &str,
        note: &str,
    ) -> Row {
        let value = self.estimate(id);
        let base = baseline.and_then(|(base_id, _)| self.estimate(base_id));
        Row {
            figure: figure.to_string(),
            value: value.map_or_else(|| "not run".to_string(), ns),
            baseline: match baseline {
                Some((_, name)) => base.map_or_else(
                    || format!("{name}: not run"),
                    |b| format!("{name}: {}", ns(b)),
                ),
                None => "-".to_string(),
            },
            ratio: ratio(value, base),
            target: target.to_string(),
            machine: machine.to_string(),
            note: note.to_string(),
        }
    }

    fn rows(&self, machine: &str) -> Vec<Row> {
        let mut rows = vec![
            self.timed(
                "notify through the trait: mockall mock",
                "notify/mock",
                Some(("notify/direct", "free id")),
                "-",
                machine,
                "EISCONN answer; mockall's matching dominates",
            ),
            self.timed(
                "notify through the trait: SimFabric",
                "notify/sim",
                Some(("notify/direct", "free id")),
                "-",
                machine,
                "established simulated connection (EISCONN)",
            ),
            self.timed(
                "pumped COMM_EST (lookup, notify, counters)",
                "pump/comm_est",
                Some(("notify/direct", "free id")),
                "≤ 50 ns",
                machine,
                "1024 registered connections, steady state (EISCONN)",
            ),
            self.timed(
                "pumped COMM_EST, forced establish",
                "pump/comm_est_forced",
                Some(("notify/direct", "free id")),
                "≤ 50 ns",
                machine,
                "first notify of a pending connection",
            ),
            self.timed(
                "pumped receive completion (established conn)",
                "pump/receive_completion",
                None,
                "-",
                machine,
                "one lookup, no notify",
            ),
            self.timed(
                "pumped COMM_EST on SimFabric ids",
                "pump/comm_est_sim",
                Some(("notify/sim", "SimFabric notify")),
                "-",
                machine,
                "pump in front of the simulated kernel",
            ),
        ];
        rows.push(self.timed(
            "QP lookup, std SipHash",
            "lookup/siphash",
            Some(("lookup/fxhash", "FxHash (the pump's)")),
            "-",
            machine,
            "1024 entries; the pump pays one FxHash lookup per event",
        ));
        let allocations = self.extra("pump/allocations_per_event");
        rows.push(Row {
            figure: "allocations per pumped event".to_string(),
            value: allocations
                .and_then(|e| e.value)
                .map_or_else(|| "not run".to_string(), |v| format!("{v}")),
            baseline: "-".to_string(),
            ratio: "-".to_string(),
            target: "0".to_string(),
            machine: machine.to_string(),
            note: allocations.map_or_else(String::new, |e| e.note.clone()),
        });

        let points = self.scale_points();
        let base = points.first().copied();
        for point in &points {
            let n = point.connections;
            let skipped = self
                .extra(&format!("scale/{n}"))
                .filter(|e| e.value.is_none());
            let outcome = self.extra(&format!("scale/{n}/established"));
            let label = format!("{}k", n / 1000);
            let note = match (skipped, outcome) {
                (Some(skip), _) => format!("skipped: {}", skip.note),
                (None, Some(o)) => {
                    let faults = self
                        .extra(&format!("scale/{n}/page_faults_per_conn"))
                        .and_then(|f| {
                            f.value
                                .map(|v| format!("; {v:.2} page faults per conn ({})", f.note))
                        })
                        .unwrap_or_default();
                    format!("{} established {}{faults}", o.value.unwrap_or(0.0), o.note)
                }
                (None, None) => "not run".to_string(),
            };
            // A figure of this point over the 1k point's (none for the 1k point itself).
            let over_1k = |value: Option<f64>, base: Option<f64>| {
                value
                    .zip(base)
                    .filter(|_| n != SCALE_POINTS[0])
                    .map(|(v, b)| v / b)
            };
            let work = |n: u64| {
                self.extra(&format!("scale/{n}/work_per_conn"))
                    .and_then(|e| e.value)
            };
            let growth = over_1k(point.ns_per_conn, base.and_then(|b| b.ns_per_conn));
            let work_growth = over_1k(work(n), work(SCALE_POINTS[0]));
            let verdict = match (growth, work_growth) {
                (Some(g), _) if g <= FLAT_RATIO => format!("flat ({g:.3}x the 1k cost); "),
                (Some(g), Some(w)) if (w - 1.0).abs() <= WORK_TOLERANCE => format!(
                    "not flat: {g:.3}x the 1k cost, for the same work per connection \
                     ({w:.3}x): linear in work, the time grows as the working set \
                     (peak heap per conn × N) outgrows the caches; "
                ),
                (Some(g), _) => format!("not flat: {g:.3}x the 1k cost; "),
                (None, _) => String::new(),
            };
            rows.push(Row {
                figure: format!("SimFabric {label} conns, 10% RTU loss: time per conn"),
                value: point.ns_per_conn.map_or_else(|| "not run".to_string(), ns),
                baseline: base
                    .and_then(|b| b.ns_per_conn)
                    .map_or_else(|| "-".to_string(), |b| format!("1k: {}", ns(b))),
                ratio: ratio(point.ns_per_conn, base.and_then(|b| b.ns_per_conn)),
                target: format!("flat (ratio ≤ {FLAT_RATIO})"),
                machine: machine.to_string(),
                note: format!("{verdict}{note}"),
            });
            rows.push(Row {
                figure: format!("SimFabric {label} conns: peak heap per conn"),
                value: point
                    .bytes_per_conn
                    .map_or_else(|| "not run".to_string(), |b| format!("{b:.0} B")),
                baseline: base
                    .and_then(|b| b.bytes_per_conn)
                    .map_or_else(|| "-".to_string(), |b| format!("1k: {b:.0} B")),
                ratio: ratio(point.bytes_per_conn, base.and_then(|b| b.bytes_per_conn)),
                target: "flat (ratio ≈ 1)".to_string(),
                machine: machine.to_string(),
                note: "peak heap of one whole run / connections".to_string(),
            });
        }

        // Real-device figures: criterion estimates on a device, or the benches' skip.
        for (key, figure, target) in [
            ("real/notify", "cm-sys notify / raw rdma_notify", "≤ 1.02"),
            (
                "real/trigger_to_established",
                "trigger→ESTABLISHED: pump / raw loop",
                "≤ 1.05",
            ),
            ("real/setup", "connection setup per step (cmtime-like)", "-"),
        ] {
            let vm_machine = "VM (qemu TCG, soft-RoCE; absolute times are emulation)";
            let is_part = |k: &str| k == key || k.starts_with(&format!("{key}/"));
            let matching: Vec<(&String, &Figure, &str)> = self
                .extra
                .iter()
                .map(|(k, e)| (k, e, machine))
                .chain(self.vm.iter().map(|(k, e)| (k, e, vm_machine)))
                .filter(|(k, _, _)| is_part(k))
                .collect();
            // The host's "no device" skip says nothing once the VM measured the figure.
            let measured_in_vm = self.vm.iter().any(|(k, e)| is_part(k) && e.value.is_some());
            let matching: Vec<_> = matching
                .into_iter()
                .filter(|(_, e, m)| !(measured_in_vm && e.value.is_none() && *m != vm_machine))
                .collect();
            if matching.is_empty() {
                rows.push(Row {
                    figure: figure.to_string(),
                    value: "not run".to_string(),
                    baseline: "-".to_string(),
                    ratio: "-".to_string(),
                    target: target.to_string(),
                    machine: machine.to_string(),
                    note: "no figure from the benches".to_string(),
                });
            }
            for (k, e, machine) in matching {
                let is_ratio = e.unit == "ratio";
                rows.push(Row {
                    figure: if k == key {
                        figure.to_string()
                    } else {
                        format!("{figure}: {}", &k[key.len() + 1..])
                    },
                    value: match (e.value, is_ratio) {
                        (None, _) => "skipped".to_string(),
                        (Some(_), true) => "-".to_string(),
                        (Some(v), false) if e.unit == "ns" => ns(v),
                        (Some(v), false) => format!("{v} {}", e.unit),
                    },
                    baseline: "-".to_string(),
                    ratio: match (e.value, is_ratio) {
                        (Some(v), true) => format!("{v:.3}"),
                        _ => "-".to_string(),
                    },
                    target: if is_ratio || e.value.is_none() {
                        target.to_string()
                    } else {
                        "-".to_string()
                    },
                    machine: machine.to_string(),
                    note: e.note.clone(),
                });
            }
        }
        rows
    }
}

fn render_markdown(rows: &[Row], machine: &str, smoke: bool) -> String {
    let mut text = String::from("# Notify path benchmarks\n\n");
    text.push_str(&format!(
        "Machine: {machine}. Times are criterion medians{}. Ratio = figure / baseline.\n\n",
        if smoke {
            " in smoke mode (short samples: indicative only)"
        } else {
            ""
        }
    ));
    text.push_str("| figure | value | baseline | ratio | target | machine | note |\n");
    text.push_str("|---|---|---|---|---|---|---|\n");
    for r in rows {
        text.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.figure,
            r.value,
            r.baseline,
            r.ratio,
            r.target,
            r.machine,
            r.note.replace('|', "/")
        ));
    }
    text.push_str(
        "\nScale curve: bench-scale.svg. Criterion's HTML report: criterion/report/index.html.\n",
    );
    text
}

/// What one panel of the scale curve plots.
type PanelValue = fn(&ScalePoint) -> Option<f64>;

/// The scale curve: time and peak heap per connection against connections (log scale),
/// two panels of hand-written SVG.
fn render_svg(points: &[ScalePoint]) -> String {
    const W: f64 = 360.0;
    const H: f64 = 240.0;
    const PAD: f64 = 50.0;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n",
        2.0 * W,
        H + 30.0
    );
    svg.push_str("<text x=\"10\" y=\"16\" font-size=\"13\">SimFabric, 10% RTU loss: cost per connection vs connections</text>\n");
    let panels: [(&str, &str, PanelValue); 2] = [
        ("time per connection", "µs", |p| {
            p.ns_per_conn.map(|v| v / 1e3)
        }),
        ("peak heap per connection", "bytes", |p| p.bytes_per_conn),
    ];
    let (min_n, max_n) = (
        points
            .iter()
            .map(|p| p.connections)
            .min()
            .unwrap_or(1)
            .max(1) as f64,
        points
            .iter()
            .map(|p| p.connections)
            .max()
            .unwrap_or(1)
            .max(1) as f64,
    );
    for (i, (title, unit, value)) in panels.iter().enumerate() {
        let x0 = i as f64 * W + PAD;
        let (plot_w, plot_h, top) = (W - PAD - 20.0, H - PAD - 20.0, 40.0);
        let max_v = points
            .iter()
            .filter_map(value)
            .fold(0.0_f64, f64::max)
            .max(1e-9)
            * 1.15;
        svg.push_str(&format!(
            "<text x=\"{x0}\" y=\"{}\">{title} ({unit})</text>\n<rect x=\"{x0}\" y=\"{top}\" width=\"{plot_w}\" height=\"{plot_h}\" fill=\"none\" stroke=\"#888\"/>\n",
            top - 6.0
        ));
        svg.push_str(&format!("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{max_v:.1}</text>\n<text x=\"{}\" y=\"{}\" text-anchor=\"end\">0</text>\n", x0 - 4.0, top + 10.0, x0 - 4.0, top + plot_h));
        let span = (max_n / min_n).log10().max(1e-9);
        let mut line = Vec::new();
        for p in points {
            let x = x0 + plot_w * ((p.connections as f64 / min_n).log10() / span);
            svg.push_str(&format!(
                "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{}k</text>\n",
                top + plot_h + 14.0,
                p.connections / 1000
            ));
            if let Some(v) = value(p) {
                let y = top + plot_h * (1.0 - v / max_v);
                line.push(format!("{x:.1},{y:.1}"));
                svg.push_str(&format!(
                    "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"#1f77b4\"/>\n<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{v:.1}</text>\n",
                    y - 6.0
                ));
            } else {
                svg.push_str(&format!("<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#999\">not run</text>\n", top + plot_h / 2.0));
            }
        }
        if line.len() > 1 {
            svg.push_str(&format!(
                "<polyline points=\"{}\" fill=\"none\" stroke=\"#1f77b4\"/>\n",
                line.join(" ")
            ));
        }
    }
    svg.push_str("</svg>\n");
    svg
}

/// The host, for the report's machine column.
fn host_machine() -> String {
    format!("host hardware ({})", cm_testkit::host_cpu())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ESTIMATES: &str = r#"{"mean":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.5,"standard_error":0.1},"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":2.0},"point_estimate":1.75e2,"standard_error":0.1}}"#;

    #[test]
    fn point_estimates_come_from_the_named_statistic() {
        assert_eq!(json_point_estimate(ESTIMATES, "median"), Some(175.0));
        assert_eq!(json_point_estimate(ESTIMATES, "mean"), Some(2.5));
        assert_eq!(json_point_estimate(ESTIMATES, "slope"), None);
    }

    #[test]
    fn results_lines_parse_and_bad_ones_are_dropped() {
        let map = parse_results(
            "scale/1000/peak_bytes_per_conn\t1182.3\tbytes\tpeak heap\nreal/notify\tskipped\t\tno RDMA device\nbroken\nx\tnan-ish\tns\t\n",
        );
        assert_eq!(map.len(), 2);
        assert_eq!(map["scale/1000/peak_bytes_per_conn"].value, Some(1182.3));
        assert_eq!(map["real/notify"].value, None);
        assert_eq!(map["real/notify"].note, "no RDMA device");
        // Measured beats skipped, whichever comes first.
        for lines in [
            "real/notify\t1.01\tratio\tmeasured\nreal/notify\tskipped\t\telsewhere\n",
            "real/notify\tskipped\t\telsewhere\nreal/notify\t1.01\tratio\tmeasured\n",
        ] {
            assert_eq!(parse_results(lines)["real/notify"].value, Some(1.01));
        }
    }

    #[test]
    fn scale_growth_past_the_flat_ratio_is_called_so() {
        let mut estimates = BTreeMap::new();
        estimates.insert("scale/1000".to_string(), 10e6);
        estimates.insert("scale/100000".to_string(), 1_440e6);
        let figures = Figures {
            estimates,
            extra: BTreeMap::new(),
            vm: BTreeMap::new(),
        };
        let rows = figures.rows("test machine");
        let time_row = |label: &str| {
            rows.iter()
                .find(|r| r.figure.contains(&format!("{label} conns, 10% RTU loss")))
                .unwrap()
        };
        assert!(time_row("100k").note.starts_with("not flat: 1.440x"));
        assert!(!time_row("100k").note.contains("same work"));
        assert!(!time_row("1k").note.contains("flat"));
    }

    #[test]
    fn scale_growth_with_constant_work_is_called_linear_and_still_not_flat() {
        let mut estimates = BTreeMap::new();
        estimates.insert("scale/1000".to_string(), 10e6);
        estimates.insert("scale/100000".to_string(), 1_400e6);
        let work = |w: f64| {
            parse_results(&format!(
                "scale/1000/work_per_conn\t20\tcount\t\nscale/100000/work_per_conn\t{w}\tcount\t\n"
            ))
        };
        let note_at_100k = |extra| {
            let figures = Figures {
                estimates: estimates.clone(),
                extra,
                vm: BTreeMap::new(),
            };
            let rows = figures.rows("test machine");
            rows.iter()
                .find(|r| r.figure.contains("100k conns, 10% RTU loss"))
                .unwrap()
                .note
                .clone()
        };
        let same = note_at_100k(work(20.1));
        assert!(same.starts_with("not flat: 1.400x"), "{same}");
        assert!(same.contains("same work per connection (1.005x)"), "{same}");
        let more = note_at_100k(work(25.0));
        assert!(!more.contains("same work"), "{more}");
    }

    #[test]
    fn the_table_has_ratios_and_scale_rows() {
        let mut estimates = BTreeMap::new();
        estimates.insert("notify/direct".to_string(), 5.0);
        estimates.insert("pump/comm_est".to_string(), 40.0);
        estimates.insert("scale/1000".to_string(), 10e6);
        estimates.insert("scale/10000".to_string(), 120e6);
        let extra = parse_results(
            "scale/1000/peak_bytes_per_conn\t1000\tbytes\t\nscale/100000\tskipped\t\tsmoke mode\n\
             real/trigger_to_established\tskipped\t\tno RDMA device\n\
             real/setup\tskipped\t\tno RDMA device\n",
        );
        let figures = Figures {
            estimates,
            extra,
            vm: parse_results("real/trigger_to_established\t1.01\tratio\tpump / hand\n"),
        };
        let rows = figures.rows("test machine");
        let pump = rows
            .iter()
            .find(|r| r.figure.starts_with("pumped COMM_EST ("))
            .unwrap();
        assert_eq!(pump.ratio, "8.00");
        assert_eq!(pump.value, "40.0 ns");
        let ten_k = rows
            .iter()
            .find(|r| r.figure.contains("10k conns, 10% RTU loss"))
            .unwrap();
        assert_eq!(ten_k.ratio, "1.20");
        assert!(ten_k.note.starts_with("flat (1.200x"), "{}", ten_k.note);
        let hundred_k = rows
            .iter()
            .find(|r| r.figure.contains("100k conns, 10% RTU loss"))
            .unwrap();
        assert_eq!(hundred_k.value, "not run");
        assert!(hundred_k.note.contains("smoke mode"));
        let vm_row = rows.iter().find(|r| r.machine.starts_with("VM")).unwrap();
        assert_eq!(vm_row.ratio, "1.010");
        // The host's skip goes where the VM measured the figure, stays where it did not.
        let trigger_rows = rows
            .iter()
            .filter(|r| r.figure.starts_with("trigger→ESTABLISHED"))
            .count();
        assert_eq!(trigger_rows, 1);
        assert!(rows
            .iter()
            .any(|r| r.figure.starts_with("connection setup") && r.value == "skipped"));
        let markdown = render_markdown(&rows, "test machine", true);
        assert!(markdown.contains("| figure | value | baseline | ratio |"));
        let svg = render_svg(&figures.scale_points());
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("polyline"));
    }
}
