//! `cargo xtask bench`: runs the criterion benches of the notify path (`cm-benches`) and
//! ends with one table (also written to `target/bench-report.md`), the scale curve as
//! an SVG next to it and criterion's HTML report under `target/criterion/`.
//!
//! The figures come from criterion's `new/estimates.json` files (median point estimate)
//! and from the results file the benches write for what criterion does not measure
//! (allocations, peak memory, outcomes, real-device figures, skips).
//!
//! The parts: `estimates` (criterion's files and the results file), `report` (the
//! table's rows and its markdown) and `svg` (the scale curve). `count` is
//! `cargo xtask bench --count`: instructions per operation under callgrind against a
//! checked-in baseline, instead of the criterion benches.

mod count;
mod estimates;
mod report;
mod svg;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use cm_testkit::{Figure, FIGURE_PREFIX};

use crate::run::{cargo, status, workspace_root};
use estimates::{parse_results, read_estimates};
use report::{render_markdown, Figures};
use svg::render_svg;

/// glibc keeps freed memory (no trimming; blocks up to 32 MiB from the heap, not fresh
/// mappings). Criterion repeats each scale run: with glibc's defaults the 1k run reuses
/// its already-mapped heap while the 100k run (75 MB) gets it mapped and faulted in
/// afresh every time (~0.3 µs per connection), which measures the allocator's trimming,
/// not the simulation. The report prints page faults per connection either way.
const WARM_HEAP_TUNABLES: &str =
    "glibc.malloc.trim_threshold=4294967295:glibc.malloc.mmap_threshold=33554432";

/// Runs the benches (`--smoke`: the short CI mode; `--vm`: also the real-device quick
/// mode inside the soft-RoCE VM, its figures folded into the table) and prints the report;
/// or, with `--count` (and `--update-baseline`), the instruction counts.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let (mut smoke, mut vm, mut count, mut update_baseline) = (false, false, false, false);
    for arg in args {
        match arg.as_str() {
            "--smoke" => smoke = true,
            "--vm" => vm = true,
            "--count" => count = true,
            "--update-baseline" => update_baseline = true,
            other => return Err(format!("bench: unknown option `{other}`")),
        }
    }
    if update_baseline && !count {
        return Err("bench: --update-baseline goes with --count".into());
    }
    if count {
        if smoke || vm {
            return Err("bench: --count runs alone (not with --smoke or --vm)".into());
        }
        println!("{}", count::run(&target_dir(), update_baseline)?);
        return Ok(());
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
cargo-bin cm-tools cmnotify rdma
cargo-bin cm-benches cm-bench-setup
exec bench-setup timeout=1800 CMNOTIFY_BENCH_OUT=/tmp/cm-benches cm-bench-setup --instructions 20,60 1000 5000 10000
";

/// How [`vm_figures`] builds the VM payload, as its figures say.
const VM_BENCH_BUILD: &str = "opt-level 3, fat LTO, 1 codegen unit";

/// Runs the real-device quick mode in the VM and returns the figures it printed (the
/// `cm-benches: ` lines of the console log), labelled with the VM as their machine.
///
/// The VM payload is a dev build; here it is built as a latency-bound server ships (in
/// its own target folder, so the usual dev build stays cached): optimised, with fat LTO
/// and one codegen unit. Both loops compared are built so. Unoptimised code shows in
/// the ratios (pump / hand loop measured 1.41 unoptimised against 0.98 optimised), and
/// so do calls across the crates' layers that only LTO inlines (API / waiting hand loop
/// measured 1.10–1.16 over runs without LTO, 1.07–1.09 with it).
fn vm_figures(target: &Path) -> Result<BTreeMap<String, Figure>, String> {
    let manifest = target.join("cm-benches/vm-payload.txt");
    std::fs::write(&manifest, VM_MANIFEST).map_err(|e| format!("{}: {e}", manifest.display()))?;
    let vm_target = target.join("bench-vm");
    let optimised = [
        ("CARGO_TARGET_DIR", vm_target.display().to_string()),
        ("CARGO_PROFILE_DEV_OPT_LEVEL", "3".to_string()),
        ("CARGO_PROFILE_DEV_DEBUG_ASSERTIONS", "false".to_string()),
        ("CARGO_PROFILE_DEV_OVERFLOW_CHECKS", "false".to_string()),
        ("CARGO_PROFILE_DEV_LTO", "fat".to_string()),
        ("CARGO_PROFILE_DEV_CODEGEN_UNITS", "1".to_string()),
        ("CARGO_PROFILE_DEV_INCREMENTAL", "false".to_string()),
        (cm_testkit::env::BENCH_BUILD, VM_BENCH_BUILD.to_string()),
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

/// The CI step: the instruction counts against the baseline (after the bench step, whose
/// release build the count binary shares). Fails on a regression.
pub(crate) fn ci_count() -> Result<String, String> {
    count::run(&target_dir(), false)
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
        .env(cm_testkit::env::BENCH_OUT, &out)
        .env("GLIBC_TUNABLES", WARM_HEAP_TUNABLES);
    if smoke {
        cmd.env(cm_testkit::env::BENCH_SMOKE, "1");
    } else {
        // The million run runs `cmnotify` itself, as a user does (release, as benches).
        status(
            cargo(&["build", "--release", "-p", "cm-tools", "--bin", "cmnotify"])
                .env("CARGO_TARGET_DIR", &target),
        )?;
        cmd.env(
            cm_testkit::env::CMNOTIFY_BIN,
            target.join("release").join("cmnotify"),
        );
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

/// The host, for the report's machine column.
fn host_machine() -> String {
    format!("host hardware ({})", cm_testkit::host_cpu())
}
