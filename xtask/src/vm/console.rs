//! Reading the VM's console log: the `=== vm-` markers written by `ci/vm/init`, libtest
//! `test result:` lines and skip lines, into a verdict.

use crate::counts::TestCounts;

/// Name prefix of entries that run a test executable (see `payload`).
pub(crate) const TEST_ENTRY_PREFIX: &str = "cargo-test ";

/// What one payload entry did inside the VM.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct EntryResult {
    /// The entry's name as given in the manifest (test entries: `cargo-test <pkg> <exe>`).
    pub(crate) name: String,
    /// Exit code from the end marker; `None` when the entry never finished.
    pub(crate) exit: Option<i32>,
    /// libtest counts, summed over its `test result:` lines.
    pub(crate) tests: TestCounts,
    /// Its last output lines, kernel messages left out: what a failure report shows, as
    /// CI keeps only the end of a run's output.
    pub(crate) last_lines: Vec<String>,
}

impl EntryResult {
    /// Whether this entry runs a test executable (its tests count as real-device tests).
    pub(crate) fn is_test(&self) -> bool {
        self.name.starts_with(TEST_ENTRY_PREFIX)
    }

    /// The package a test entry belongs to.
    pub(crate) fn package(&self) -> Option<&str> {
        self.name
            .strip_prefix(TEST_ENTRY_PREFIX)?
            .split_whitespace()
            .next()
    }

    /// Passed when it finished with exit code 0 and no libtest failure.
    pub(crate) fn passed(&self) -> bool {
        self.exit == Some(0) && self.tests.failed == 0
    }

    /// Tests that really ran and passed: libtest's passed minus the ones that skipped.
    pub(crate) fn real_passed(&self) -> u64 {
        self.tests
            .passed
            .saturating_sub(self.tests.skipped.len() as u64)
    }
}

/// Everything read from one console log.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ConsoleReport {
    /// `/init` started (the kernel booted and ran it).
    pub(crate) init_started: bool,
    /// Setup (modules, 9p share, veth, rxe) failed with this reason.
    pub(crate) setup_failure: Option<String>,
    /// Setup finished.
    pub(crate) setup_ok: bool,
    /// Entries in the order they ran.
    pub(crate) entries: Vec<EntryResult>,
    /// `/init` reached its end (`=== vm-done`).
    pub(crate) done: bool,
    /// Files an entry printed between `=== vm-file begin NAME` and `=== vm-file end
    /// NAME` (see `ci/vm/ladder-capture`): (name, text with `\n` line ends).
    pub(crate) files: Vec<(String, String)>,
    /// Files begun and never ended (the entry was cut off).
    pub(crate) cut_files: Vec<String>,
}

impl ConsoleReport {
    /// Parses a whole console log. Serial consoles end lines with `\r\n`; kernel messages
    /// may interleave anywhere.
    pub(crate) fn parse(log: &str) -> ConsoleReport {
        let mut report = ConsoleReport::default();
        let mut current: Option<(EntryResult, String)> = None;
        let mut file: Option<(String, String)> = None;
        for raw in log.lines() {
            let line = raw.trim_end_matches('\r');
            if let Some((name, text)) = file.as_mut() {
                if line.strip_prefix("=== vm-file end ").map(str::trim) == Some(name.as_str()) {
                    report.files.extend(file.take());
                    continue;
                }
                if !line.starts_with("=== vm-") {
                    if !is_kernel_message(line) {
                        text.push_str(line);
                        text.push('\n');
                    }
                    continue;
                }
                // Another marker: the entry (or the VM) ended before the file did.
                report.cut_files.push(std::mem::take(name));
                file = None;
            }
            if let Some(name) = line.strip_prefix("=== vm-file begin ") {
                file = Some((name.trim().to_string(), String::new()));
            } else if line.starts_with("=== vm-init start") {
                report.init_started = true;
            } else if let Some(reason) = line.strip_prefix("=== vm-setup FAILED: ") {
                report.setup_failure = Some(reason.to_string());
            } else if line.starts_with("=== vm-setup ok") {
                report.setup_ok = true;
            } else if let Some(name) = line.strip_prefix("=== vm-entry begin ") {
                if let Some((entry, output)) = current.take() {
                    report.entries.push(finish(entry, &output));
                }
                let entry = EntryResult {
                    name: name.trim().to_string(),
                    ..EntryResult::default()
                };
                current = Some((entry, String::new()));
            } else if let Some(rest) = line.strip_prefix("=== vm-entry end ") {
                if let Some((mut entry, output)) = current.take() {
                    entry.exit = exit_code(rest);
                    report.entries.push(finish(entry, &output));
                }
            } else if line.starts_with("=== vm-done") {
                report.done = true;
            } else if let Some((_, output)) = current.as_mut() {
                output.push_str(line);
                output.push('\n');
            }
        }
        if let Some((entry, output)) = current.take() {
            report.entries.push(finish(entry, &output));
        }
        report.cut_files.extend(file.map(|(name, _)| name));
        report
    }

    /// Real-device tests summed over every test entry.
    pub(crate) fn test_totals(&self) -> TestCounts {
        let mut total = TestCounts::default();
        for entry in self.entries.iter().filter(|e| e.is_test()) {
            total.passed += entry.tests.passed;
            total.failed += entry.tests.failed;
            total.ignored += entry.tests.ignored;
            total.skipped.extend(entry.tests.skipped.iter().cloned());
        }
        total
    }

    /// The one-line result, e.g. `real kernel: 23 passed, 0 failed, 1 skipped; smoke: 4/4`.
    pub(crate) fn summary_line(&self) -> String {
        let tests = self.test_totals();
        let smoke: Vec<&EntryResult> = self.entries.iter().filter(|e| !e.is_test()).collect();
        let smoke_passed = smoke.iter().filter(|e| e.passed()).count();
        format!(
            "real kernel: {}; smoke: {}/{} passed",
            tests.line(),
            smoke_passed,
            smoke.len()
        )
    }

    /// The last output lines of every entry that failed or did not finish, one block per
    /// entry; empty when every entry passed.
    pub(crate) fn failed_entries_output(&self) -> String {
        let mut text = String::new();
        for entry in self.entries.iter().filter(|e| !e.passed()) {
            text.push_str(&format!("`{}`, its last lines:\n", entry.name));
            for line in &entry.last_lines {
                text.push_str(&format!("    {line}\n"));
            }
        }
        text
    }

    /// Every reason the run does not pass; empty when it passed. `expected` lists the
    /// entries the payload asked for, `packages` the packages whose tests must run.
    pub(crate) fn problems(&self, expected: &[String], packages: &[String]) -> Vec<String> {
        let mut problems = Vec::new();
        if !self.init_started {
            problems.push("the VM never reached /init (boot failed or timed out)".to_string());
            return problems;
        }
        if let Some(reason) = &self.setup_failure {
            problems.push(format!("VM setup failed: {reason}"));
            return problems;
        }
        if !self.setup_ok {
            problems.push("VM setup did not finish".to_string());
            return problems;
        }
        for entry in &self.entries {
            match entry.exit {
                None => problems.push(format!("`{}` did not finish", entry.name)),
                Some(code) if !entry.passed() => problems.push(format!(
                    "`{}` failed (exit {code}, {} tests failed)",
                    entry.name, entry.tests.failed
                )),
                Some(_) => {}
            }
        }
        for name in expected {
            if !self.entries.iter().any(|e| &e.name == name) {
                problems.push(format!("`{name}` never started"));
            }
        }
        for package in packages {
            let ran: u64 = self
                .entries
                .iter()
                .filter(|e| e.package() == Some(package.as_str()))
                .map(|e| e.real_passed() + e.tests.failed)
                .sum();
            if ran == 0 {
                problems.push(format!(
                    "no real-device test of `{package}` ran in the VM (all skipped or none exist)"
                ));
            }
        }
        // Inside the VM both soft-RoCE devices exist: a test that skips there hides a bug.
        for entry in &self.entries {
            for skip in &entry.tests.skipped {
                problems.push(format!(
                    "`{}` skipped a test inside the VM, where the devices exist: {skip}",
                    entry.name
                ));
            }
        }
        let tests = self.test_totals();
        let ran = tests.passed.saturating_sub(tests.skipped.len() as u64) + tests.failed;
        let smoke_ran = self.entries.iter().filter(|e| !e.is_test()).count() as u64;
        if ran + smoke_ran == 0 {
            problems.push("0 tests ran in the VM".to_string());
        }
        for name in &self.cut_files {
            problems.push(format!("the VM's file `{name}` was cut off"));
        }
        if !self.done && problems.is_empty() {
            problems.push("/init did not reach its end".to_string());
        }
        problems
    }
}

/// A kernel message on the serial console (`[   12.345678] text`), which may land in
/// the middle of a file an entry prints.
fn is_kernel_message(line: &str) -> bool {
    line.strip_prefix('[')
        .and_then(|rest| rest.split_once(']'))
        .is_some_and(|(stamp, _)| {
            let stamp = stamp.trim();
            !stamp.is_empty() && stamp.chars().all(|c| c.is_ascii_digit() || c == '.')
        })
}

/// A line of a Rust backtrace: `  12: function` or `             at file:line`, and
/// the note that ends one.
fn is_backtrace_frame(line: &str) -> bool {
    let trimmed = line.trim_start();
    trimmed.starts_with("at ")
        || trimmed.starts_with("note: Some details are omitted")
        || trimmed == "stack backtrace:"
        || trimmed
            .split_once(": ")
            .is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
}

/// The `exit=N` field of an end marker.
fn exit_code(rest: &str) -> Option<i32> {
    rest.split_whitespace()
        .find_map(|field| field.strip_prefix("exit="))
        .and_then(|code| code.parse().ok())
}

/// How many of an entry's last output lines a failure report shows.
const LAST_LINES: usize = 15;

fn finish(mut entry: EntryResult, output: &str) -> EntryResult {
    entry.tests = TestCounts::parse(output);
    entry.tests.skipped = skip_lines(output);
    // Backtrace frames left out: the panic's message and libtest's verdict are the news.
    let own: Vec<&str> = output
        .lines()
        .filter(|l| !is_kernel_message(l) && !is_backtrace_frame(l))
        .collect();
    entry.last_lines = own[own.len().saturating_sub(LAST_LINES)..]
        .iter()
        .map(|l| l.to_string())
        .collect();
    entry
}

/// Lines of the skip protocol, `<test name>: skipped: <reason>`. libtest's own
/// `test <name> ... ` may precede one on the same console line, so the name is the last
/// word before the marker.
fn skip_lines(output: &str) -> Vec<String> {
    output
        .lines()
        .filter_map(|line| {
            let at = line.find(": skipped: ")?;
            let name = line[..at].split_whitespace().last()?;
            Some(format!("{name}{}", &line[at..]))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
[    0.000000] Linux version 6.1.0\r
=== vm-init start uptime=9.10\r
rxeA state ACTIVE\r
=== vm-setup ok uptime=10.31\r
=== vm-entry begin ibv-devices\r
    device                 node GUID\r
=== vm-entry end ibv-devices exit=0 uptime=10.40\r
=== vm-entry begin cargo-test cm-sys cm_sys-0123\r
running 3 tests\r
test notify_forces_established ... ok\r
test lost_rtu ... lost_rtu: skipped: no RDMA device (rdma_cm missing)\r
ok\r
test reject ... FAILED\r
test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\r
=== vm-entry end cargo-test cm-sys cm_sys-0123 exit=101 uptime=12.00\r
=== vm-entry begin rping-veth\r
=== vm-entry end rping-veth exit=0 uptime=13.00\r
=== vm-done entries=3 failed=1\r
";

    #[test]
    fn entries_exit_codes_counts_and_skips_are_read() {
        let report = ConsoleReport::parse(LOG);
        assert!(report.init_started && report.setup_ok && report.done);
        let names: Vec<&str> = report.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            ["ibv-devices", "cargo-test cm-sys cm_sys-0123", "rping-veth"]
        );
        let test = &report.entries[1];
        assert_eq!(test.exit, Some(101));
        assert_eq!((test.tests.passed, test.tests.failed), (2, 1));
        assert_eq!(
            test.tests.skipped,
            ["lost_rtu: skipped: no RDMA device (rdma_cm missing)"]
        );
        assert_eq!(test.package(), Some("cm-sys"));
        assert_eq!(test.real_passed(), 1);
        assert_eq!(
            report.summary_line(),
            "real kernel: 1 passed, 1 failed, 1 skipped; smoke: 2/2 passed"
        );
        let problems = report.problems(&[], &["cm-sys".to_string()]);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("cm_sys-0123") && problems[0].contains("failed"));
        assert!(
            problems[1].contains("skipped a test inside the VM"),
            "{problems:?}"
        );
        assert_eq!(
            report.failed_entries_output(),
            "`cargo-test cm-sys cm_sys-0123`, its last lines:\n    running 3 tests\n    \
             test notify_forces_established ... ok\n    test lost_rtu ... lost_rtu: skipped: \
             no RDMA device (rdma_cm missing)\n    ok\n    test reject ... FAILED\n    \
             test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n"
        );
    }

    #[test]
    fn a_failure_report_leaves_backtrace_frames_out() {
        let log = "\
=== vm-init start\r
=== vm-setup ok\r
=== vm-entry begin cargo-test cm-verbs handles\r
thread 'x' panicked at tests/handles.rs:365:5:\r
assertion `left == right` failed\r
stack backtrace:\r
   0: __rustc::rust_begin_unwind\r
             at /rustc/library/std/src/panicking.rs:689:5\r
note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace.\r
test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\r
=== vm-entry end cargo-test cm-verbs handles exit=101 uptime=2.0\r
=== vm-done entries=1 failed=1\r
";
        let report = ConsoleReport::parse(log);
        assert_eq!(
            report.entries[0].last_lines,
            [
                "thread 'x' panicked at tests/handles.rs:365:5:",
                "assertion `left == right` failed",
                "test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out"
            ]
        );
    }

    #[test]
    fn files_between_markers_are_kept_without_kernel_messages() {
        let log = "\
=== vm-init start\r
=== vm-setup ok\r
=== vm-entry begin ladder\r
=== vm-file begin ladder-{kernel}.svg\r
<svg>\r
[   12.345678] rdma_rxe: loaded\r
</svg>\r
=== vm-file end ladder-{kernel}.svg\r
=== vm-file begin cut.txt\r
half\r
=== vm-entry end ladder exit=0 uptime=2.0\r
=== vm-done entries=1 failed=0\r
";
        let report = ConsoleReport::parse(log);
        assert_eq!(
            report.files,
            [(
                "ladder-{kernel}.svg".to_string(),
                "<svg>\n</svg>\n".to_string()
            )]
        );
        assert_eq!(report.cut_files, ["cut.txt"]);
        assert_eq!(
            report.entries[0].exit,
            Some(0),
            "the end marker still counts"
        );
        assert_eq!(
            report.problems(&["ladder".into()], &[]),
            ["the VM's file `cut.txt` was cut off"]
        );
    }

    #[test]
    fn zero_tests_never_pass() {
        let log = "=== vm-init start\n=== vm-setup ok\n=== vm-done entries=0 failed=0\n";
        let report = ConsoleReport::parse(log);
        assert_eq!(report.problems(&[], &[]), ["0 tests ran in the VM"]);
    }

    #[test]
    fn a_package_whose_tests_all_skipped_fails() {
        let log = "\
=== vm-init start
=== vm-setup ok
=== vm-entry begin cargo-test cm-sys t-1
a: skipped: no RDMA device (x)
test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out
=== vm-entry end cargo-test cm-sys t-1 exit=0
=== vm-done entries=1 failed=0
";
        let report = ConsoleReport::parse(log);
        let problems = report.problems(&["cargo-test cm-sys t-1".into()], &["cm-sys".into()]);
        assert_eq!(
            problems,
            [
                "no real-device test of `cm-sys` ran in the VM (all skipped or none exist)",
                "`cargo-test cm-sys t-1` skipped a test inside the VM, where the devices exist: \
                 a: skipped: no RDMA device (x)",
                "0 tests ran in the VM"
            ]
        );
    }

    #[test]
    fn an_entry_cut_off_by_the_timeout_fails() {
        let log =
            "=== vm-init start\n=== vm-setup ok\n=== vm-entry begin rping-veth\nrping: waiting\n";
        let report = ConsoleReport::parse(log);
        assert_eq!(report.entries[0].exit, None);
        let problems = report.problems(&["rping-veth".into(), "ucmatose-veth".into()], &[]);
        assert_eq!(
            problems,
            [
                "`rping-veth` did not finish",
                "`ucmatose-veth` never started"
            ]
        );
    }

    #[test]
    fn a_boot_that_never_reached_init_says_so() {
        let report = ConsoleReport::parse("SeaBIOS\nBooting from ROM..\n");
        assert_eq!(
            report.problems(&[], &[]),
            ["the VM never reached /init (boot failed or timed out)"]
        );
    }

    #[test]
    fn setup_failure_is_reported_with_its_reason() {
        let log = "=== vm-init start\n=== vm-setup FAILED: rdma link add rxeA\n";
        let report = ConsoleReport::parse(log);
        assert_eq!(
            report.problems(&[], &[]),
            ["VM setup failed: rdma link add rxeA"]
        );
    }
}
