//! `cargo xtask ci`: every check CI runs, in order, with a summary.

use crate::counts::TestCounts;
use crate::deps;
use crate::run::{cargo, status, tee, workspace_root, Steps};

/// Environment variable naming the file where tests that need an RDMA device record
/// that they skipped (one line each: `test-name: reason`). See CONTRIBUTING.md.
pub(crate) const SKIP_LOG_VAR: &str = cm_testkit::env::SKIP_LOG;

/// Runs every step; fails if any failed.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let mut no_vm = false;
    for arg in args {
        match arg.as_str() {
            "--no-vm" => no_vm = true,
            other => return Err(format!("ci: unknown option `{other}`")),
        }
    }
    // A CI run builds once on a fresh clone: incremental caches would only take disk
    // (several GiB over the two dev-profile feature sets), never time.
    if std::env::var_os("CARGO_INCREMENTAL").is_none() {
        std::env::set_var("CARGO_INCREMENTAL", "0");
    }
    let mut steps = Steps::default();

    steps.run("deps", || deps::ensure(&deps::host_packages()));
    if steps.any_failed() {
        return steps.finish();
    }
    steps.run("fmt", || {
        status(&mut cargo(&["fmt", "--all", "--check"])).map(|_| String::new())
    });
    steps.run("clippy", || {
        status(&mut cargo(&[
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--",
            "-D",
            "warnings",
        ]))
        .map(|_| String::new())
    });
    let mut counts = TestCounts::default();
    steps.run("test", || {
        let skip_log = workspace_root().join("target/xtask/device-skips.log");
        std::fs::create_dir_all(skip_log.parent().expect("has a parent"))
            .map_err(|e| e.to_string())?;
        std::fs::write(&skip_log, "").map_err(|e| e.to_string())?;
        let (ok, output) =
            tee(cargo(&["test", "--workspace", "--all-features"]).env(SKIP_LOG_VAR, &skip_log))?;
        counts = TestCounts::parse(&output);
        counts.skipped = std::fs::read_to_string(&skip_log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect();
        for skip in &counts.skipped {
            println!("skipped: {skip}");
        }
        if ok && counts.failed == 0 && counts.passed > 0 {
            Ok(counts.line())
        } else if counts.passed == 0 {
            Err("no test ran".into())
        } else {
            Err(counts.line())
        }
    });
    // The model checker of cm-verbs' wake protocols: loom runs every interleaving of
    // each model (within its preemption bound); a lost wake-up is a deadlock it reports.
    steps.run("loom", || {
        let (ok, output) = tee(cargo(&[
            "test",
            "-p",
            "cm-verbs",
            "--lib",
            "--release",
            "wake::models",
        ])
        .env("RUSTFLAGS", "--cfg cm_loom")
        .env("CARGO_TARGET_DIR", workspace_root().join("target/loom")))?;
        let models = TestCounts::parse(&output);
        counts.passed += models.passed;
        counts.failed += models.failed;
        if ok && models.failed == 0 && models.passed > 0 {
            Ok(format!("{} loom models passed", models.passed))
        } else {
            Err(format!("loom models: {}", models.line()))
        }
    });
    steps.run("doc", || {
        status(
            cargo(&[
                "doc",
                "--workspace",
                "--all-features",
                "--no-deps",
                "--quiet",
            ])
            .env("RUSTDOCFLAGS", "-D warnings"),
        )?;
        crate::doc_examples::check()
    });
    steps.run("package", || {
        status(&mut cargo(&[
            "package",
            "--workspace",
            "--exclude",
            "xtask",
            "--exclude",
            "cm-benches",
            "--exclude",
            "cm-testkit",
            "--exclude",
            "cm-device-tests",
            "--no-verify",
            "--allow-dirty",
            "--quiet",
        ]))
        .map(|_| "every library crate packages".to_string())
    });
    steps.run("bench", crate::bench::ci_smoke);
    // Deterministic cost figures: instructions per operation of the simulated paths
    // against benches/instructions-baseline.txt (seconds: the bench step built most of it).
    steps.run("count", crate::bench::ci_count);
    if no_vm {
        println!("\n!!! --no-vm: the real-kernel (soft-RoCE VM) tests are NOT run. CI always runs them. !!!");
        steps.skip(
            "vm",
            "--no-vm given: the real-kernel tests did NOT run (CI always runs them)",
        );
    } else {
        // Every kernel boots its own VM and prints its own counts.
        for kernel in crate::vm::ci_kernels() {
            steps.run(&format!("vm {kernel}"), || crate::vm::ci_step(kernel));
        }
        // A client VM and a server VM on the two kernels, one virtual wire between them.
        steps.run("vm 2 hosts", crate::vm::ci_two_hosts);
    }
    let result = steps.finish();
    println!("tests: {}", counts.line());
    println!(
        "disk: target/ holds {:.1} GiB",
        crate::run::bytes_under(&workspace_root().join("target")) as f64 / (1u64 << 30) as f64
    );
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_every_result_line() {
        let out = "\
test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s
noise
test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s
";
        let counts = TestCounts::parse(out);
        assert_eq!((counts.passed, counts.failed, counts.ignored), (15, 2, 1));
    }

    #[test]
    fn skipped_device_tests_are_not_counted_as_passed() {
        let counts = TestCounts {
            passed: 10,
            failed: 0,
            ignored: 0,
            skipped: vec!["a: no RDMA device".into(), "b: no RDMA device".into()],
        };
        assert_eq!(counts.line(), "8 passed, 0 failed, 2 skipped");
    }
}
