//! `cargo xtask vm`: the project's real-device tests on the real Linux kernel RDMA CM,
//! in a throwaway qemu VM with two soft-RoCE devices (see `ci/vm/`), or in two VMs on two
//! kernels joined by one virtual wire (`--two-hosts`, `two_hosts.rs`).
//!
//! Steps: host packages (`ci/vm/host-packages.txt`), the pinned Debian packages (`debs`)
//! of the chosen kernel (`kernel`, `ci/vm/kernels/`), the COMM_EST-raising `rdma_rxe` and
//! `siw` built for that kernel (`test_modules`), the
//! payload (`payload`, from `ci/vm/payload.txt`), the initramfs (`image`), the boot
//! (`qemu`) and the verdict read from the console log (`console`).

mod console;
mod debs;
mod image;
mod kernel;
pub(crate) mod payload;
mod qemu;
mod test_modules;
mod two_hosts;

use std::path::PathBuf;
use std::time::Duration;

use crate::deps;
use crate::run::workspace_root;
use console::ConsoleReport;
use kernel::Kernel;
use qemu::{Accel, Ended, VmConfig};

/// The script that records and draws a real lost-RTU ladder inside the VM (on PATH
/// there as `ladder-capture`), relative to the workspace root.
const LADDER_SCRIPT: &str = "ci/vm/ladder-capture";
/// rping as a client, its own shutdown race told from a failure (on PATH in the VM as
/// `rping-client`), relative to the workspace root.
const RPING_CLIENT_SCRIPT: &str = "ci/vm/rping-client";
/// Host packages this step needs, relative to the workspace root.
const HOST_PACKAGES: &str = "ci/vm/host-packages.txt";
/// Time from qemu's start until `/init` must have printed its first line. Boot takes
/// ~10 s under TCG on 2 cores.
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// Time for KVM to reach `/init` before falling back to TCG: a working KVM gets there in
/// about 2 s, a broken one (nested, as on this project's machines) hangs in the BIOS.
const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// Slack added to the entries' own timeouts for the overall timeout.
const OVERALL_SLACK: Duration = Duration::from_secs(60);

/// How to run the VM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Options {
    /// `None`: KVM if it boots quickly, else TCG.
    accel: Option<Accel>,
    /// Overrides the overall timeout computed from the payload.
    timeout: Option<Duration>,
    /// Another payload manifest instead of `ci/vm/payload.txt`.
    manifest: Option<PathBuf>,
    /// The kernel to boot (`ci/vm/kernels/<name>.txt`); `None`: [`kernel::DEFAULT`].
    kernel: Option<String>,
    /// Where the run goes; `None`: the kernel's own folder ([`run_dir`]).
    run_dir: Option<PathBuf>,
    /// Two VMs on two kernels instead of one (`--two-hosts`, see `two_hosts.rs`).
    two_hosts: bool,
}

impl Options {
    fn parse(args: &[String]) -> Result<Options, String> {
        let mut options = Options::default();
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--accel" => {
                    options.accel = match args.next().map(String::as_str) {
                        Some("kvm") => Some(Accel::Kvm),
                        Some("tcg") => Some(Accel::Tcg),
                        Some("auto") => None,
                        other => {
                            return Err(format!(
                                "vm: --accel wants kvm, tcg or auto, not {other:?}"
                            ))
                        }
                    }
                }
                "--timeout" => {
                    let secs = args
                        .next()
                        .and_then(|s| s.parse::<u64>().ok())
                        .ok_or("vm: --timeout wants a number of seconds")?;
                    options.timeout = Some(Duration::from_secs(secs));
                }
                "--manifest" => {
                    let path = args.next().ok_or("vm: --manifest wants a file")?;
                    options.manifest = Some(PathBuf::from(path));
                }
                "--two-hosts" => options.two_hosts = true,
                "--kernel" => {
                    let name = args.next().ok_or("vm: --kernel wants a name (6.1, 6.12)")?;
                    options.kernel = Some(name.clone());
                }
                other => return Err(format!("vm: unknown option `{other}`")),
            }
        }
        Ok(options)
    }
}

/// `cargo xtask vm [--kernel NAME | --two-hosts] [--accel kvm|tcg|auto] [--timeout SECS]
/// [--manifest FILE]`.
pub(crate) fn run(args: &[String]) -> Result<(), String> {
    let options = Options::parse(args)?;
    if options.two_hosts {
        return two_hosts::run(&options).map(|_| ());
    }
    run_vm(&options).map(|_| ())
}

/// The kernels `cargo xtask ci` boots, one VM step each.
pub(crate) fn ci_kernels() -> &'static [&'static str] {
    kernel::CI_KERNELS
}

/// The VM step for `cargo xtask ci` on `kernel`: runs the whole payload and returns the
/// one-line note, e.g. `kernel 6.1.0-57-amd64: real kernel: 23 passed, 0 failed, 0
/// skipped; smoke: 4/4 passed`.
pub(crate) fn ci_step(kernel: &str) -> Result<String, String> {
    run_vm(&Options {
        kernel: Some(kernel.to_string()),
        ..Options::default()
    })
}

/// The two-host step of `cargo xtask ci`: a server VM and a client VM on two kernels
/// (`two_hosts.rs`); the note names both verdicts.
pub(crate) fn ci_two_hosts() -> Result<String, String> {
    two_hosts::run(&Options::default())
}

/// Prints the real-kernel fault rows the payload reported and adds them to
/// `target/fault-matrix.md` (whose simulated rows the host tests wrote), one section per
/// kernel.
fn record_fault_rows(release: &str, log: &str) {
    let rows = fault_rows(log);
    if rows.is_empty() {
        return;
    }
    let mut section = format!(
        "\n## Real kernel {release} (soft-RoCE VM)\n\n{}\n",
        cm_testkit::FaultRow::TABLE_HEADER
    );
    for row in &rows {
        println!(
            "vm: fault {}: {} connections, {} established, {} rescued, {} failed, {} leaked ids",
            row.fault, row.connections, row.established, row.rescued, row.failed, row.leaked_ids
        );
        section.push_str(&row.table_row());
        section.push('\n');
    }
    let path = target_dir().join("fault-matrix.md");
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut file| std::io::Write::write_all(&mut file, section.as_bytes()));
    if let Err(e) = written {
        println!(
            "vm: could not add the fault rows to {}: {e}",
            path.display()
        );
    }
}

/// The fault rows in a console log (a test's stderr may share the line with libtest's
/// `test … ` prefix).
fn fault_rows(log: &str) -> Vec<cm_testkit::FaultRow> {
    log.lines()
        .filter_map(|line| line.split_once(cm_testkit::FAULT_PREFIX))
        .filter_map(|(_, row)| cm_testkit::FaultRow::from_line(row.trim_end()))
        .collect()
}

/// The workspace's target directory (`CARGO_TARGET_DIR`, or `target`).
pub(crate) fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

/// Where the VM's files go: `<target dir>/vm`.
fn vm_dir() -> PathBuf {
    target_dir().join("vm")
}

/// Where one kernel's run goes (share, image, console log): `<target dir>/vm` for the
/// default kernel, `<target dir>/vm/kernel-<name>` for the others.
fn run_dir(kernel: &Kernel) -> PathBuf {
    if kernel.name == kernel::DEFAULT {
        vm_dir()
    } else {
        vm_dir().join(format!("kernel-{}", kernel.name))
    }
}

fn run_vm(options: &Options) -> Result<String, String> {
    let mut prepared = prepare(options)?;
    let ended = boot_vm(&mut prepared.config, options.accel)?;
    conclude(&prepared, ended)
}

/// One VM ready to boot: its payload built, its image made.
struct Prepared {
    /// The kernel's pin name (`6.1`), which names the files the VM prints.
    kernel_name: String,
    /// The kernel release the image boots.
    release: String,
    /// How many Debian pins were replaced by newer versions.
    fallbacks: usize,
    /// The payload it runs.
    payload: payload::Payload,
    /// How qemu runs it.
    config: VmConfig,
}

/// Everything before the boot: host packages, the kernel's pinned packages, the payload
/// of `options.manifest` (or the default), the test modules and the image, laid out in
/// `options.run_dir` (or the kernel's own run folder).
fn prepare(options: &Options) -> Result<Prepared, String> {
    deps::ensure(&deps::read_list(HOST_PACKAGES))?;
    if !qemu::available() {
        return Err(format!(
            "missing qemu: `{} --version` does not run (Debian package qemu-system-x86)",
            qemu::QEMU
        ));
    }
    let kernel = Kernel::load(options.kernel.as_deref().unwrap_or(kernel::DEFAULT))?;
    println!("vm: kernel {}", kernel.name);
    let dir = options.run_dir.clone().unwrap_or_else(|| run_dir(&kernel));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let cache = vm_dir().join("cache").join(&kernel.name);
    let unpacked = debs::fetch(&cache, &kernel)?;
    let share = dir.join("share");
    let manifest = options
        .manifest
        .clone()
        .unwrap_or_else(|| workspace_root().join(payload::MANIFEST));
    let payload = payload::build(&manifest, &share)?;
    let release = image::kernel_release(&unpacked.root)?;
    add_test_modules(&cache, &kernel, &release, &share)?;
    let boot_files = image::build(&unpacked.root, &dir, &payload.executables)?;

    let overall = options
        .timeout
        .unwrap_or(BOOT_TIMEOUT + Duration::from_secs(payload.total_timeout_secs) + OVERALL_SLACK);
    let config = VmConfig {
        kernel: boot_files.kernel,
        initramfs: boot_files.initramfs,
        share,
        console_log: dir.join("console.log"),
        accel: Accel::Tcg,
        boot_timeout: BOOT_TIMEOUT,
        overall_timeout: overall,
        memory_mib: 1024,
        cpus: 2,
        nic: None,
        cmdline: String::new(),
    };
    Ok(Prepared {
        kernel_name: kernel.name,
        release,
        fallbacks: unpacked.fallbacks.len(),
        payload,
        config,
    })
}

/// Everything after the boot: the entries, the verdict, the fault rows and files.
fn conclude(prepared: &Prepared, ended: Ended) -> Result<String, String> {
    let Prepared {
        kernel_name,
        release,
        fallbacks,
        payload,
        config,
    } = prepared;
    // Lossy: a program may print binary data (rping's -v prints its buffer).
    let log = std::fs::read(&config.console_log)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .map_err(|e| format!("{}: {e}", config.console_log.display()))?;
    let report = ConsoleReport::parse(&log);
    print_entries(&report);
    let mut problems = report.problems(&payload.entries, &payload.test_packages);
    match ended {
        Ended::BootTimeout => problems.insert(
            0,
            format!(
                "boot timeout: /init did not start within {} s (qemu killed)",
                config.boot_timeout.as_secs()
            ),
        ),
        Ended::Timeout => problems.insert(
            0,
            format!(
                "overall timeout of {} s: qemu killed",
                config.overall_timeout.as_secs()
            ),
        ),
        Ended::Exited(Some(1)) => {}
        Ended::Exited(code) if problems.is_empty() => problems.push(format!(
            "qemu exited with {code:?} instead of the pass verdict"
        )),
        Ended::Exited(_) => {}
    }
    let summary = match fallbacks {
        0 => format!("kernel {release}: {}", report.summary_line()),
        n => format!(
            "kernel {release}: {} (WARNING: {n} Debian pins replaced by newer versions, see {})",
            report.summary_line(),
            debs::PINS
        ),
    };
    println!("vm: {summary}");
    record_fault_rows(release, &log);
    if let Err(e) = save_files(&report, kernel_name) {
        problems.push(e);
    }
    println!("vm: console log: {}", config.console_log.display());
    if !problems.is_empty() {
        // The first line is the summary's; the failed entries' output follows it.
        return Err(format!(
            "{summary}: {} (console log: {})\n{}",
            problems.join("; "),
            config.console_log.display(),
            report.failed_entries_output()
        ));
    }
    Ok(summary)
}

/// Saves the files entries printed (the real kernel's ladders, see
/// `ci/vm/ladder-capture`) under `<target dir>/vm/`, `{kernel}` in their names replaced
/// by the kernel's name, so that every kernel's ladder lies in one folder.
fn save_files(report: &ConsoleReport, kernel: &str) -> Result<(), String> {
    for (name, text) in &report.files {
        let name = name.replace("{kernel}", kernel);
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            return Err(format!("the VM printed a file named `{name}`: not saved"));
        }
        let path = vm_dir().join(&name);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        println!("vm: saved {}", path.display());
    }
    Ok(())
}

/// Builds (or takes from the cache) the COMM_EST-raising `rdma_rxe` and `siw` for
/// `kernel` (its image unpacked as `release`) and puts them into the share as
/// `rxe/rdma_rxe.ko` and `siw/siw.ko`, with `bin/rxe-reload` and `bin/rdma-devices`, the
/// scripts that swap them in inside the VM, and the VM's other scripts (`ladder-capture`,
/// `rping-client`).
fn add_test_modules(
    cache: &std::path::Path,
    kernel: &Kernel,
    release: &str,
    share: &std::path::Path,
) -> Result<(), String> {
    let modules = test_modules::build(cache, kernel, release)?;
    for (module, folder) in [(&modules.rxe_comm_est, "rxe"), (&modules.siw, "siw")] {
        let dir = share.join(folder);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let name = module.file_name().expect("a file name");
        std::fs::copy(module, dir.join(name)).map_err(|e| format!("{}: {e}", module.display()))?;
    }
    for (script, name) in [
        (test_modules::RELOAD_SCRIPT, "rxe-reload"),
        (test_modules::DEVICES_SCRIPT, "rdma-devices"),
    ] {
        let script = workspace_root().join(script);
        std::fs::copy(&script, share.join("bin").join(name))
            .map_err(|e| format!("{}: {e}", script.display()))?;
    }
    for (script, name) in [
        (LADDER_SCRIPT, "ladder-capture"),
        (RPING_CLIENT_SCRIPT, "rping-client"),
    ] {
        let script = workspace_root().join(script);
        std::fs::copy(&script, share.join("bin").join(name))
            .map_err(|e| format!("{}: {e}", script.display()))?;
    }
    Ok(())
}

/// Boots with `accel`, or when `None` with KVM if it reaches `/init` quickly, else TCG.
fn boot_vm(config: &mut VmConfig, accel: Option<Accel>) -> Result<Ended, String> {
    if let Some(accel) = accel {
        config.accel = accel;
        return start_twice(config);
    }
    if qemu::kvm_usable() {
        config.accel = Accel::Kvm;
        config.boot_timeout = KVM_PROBE_TIMEOUT;
        let kvm = start(config);
        let why = match kvm {
            Ok(ended) if reached_init(config) => return Ok(ended),
            Ok(Ended::BootTimeout) => {
                format!("did not reach /init in {} s", KVM_PROBE_TIMEOUT.as_secs())
            }
            Ok(ended) => format!("ended before /init ({ended:?})"),
            Err(e) => e,
        };
        println!("vm: KVM {why}: using TCG");
    }
    config.accel = Accel::Tcg;
    config.boot_timeout = BOOT_TIMEOUT;
    start_twice(config)
}

/// Whether the last boot's console shows `/init` started.
fn reached_init(config: &VmConfig) -> bool {
    std::fs::read_to_string(&config.console_log)
        .is_ok_and(|log| ConsoleReport::parse(&log).init_started)
}

/// Boots, and once more if the kernel never reached `/init`: under TCG the guest kernel
/// was seen to oops in its early boot (an int3 left by text patching, in
/// `sched_clock_cpu`), before any entry ran; a second boot is a new chance, not a
/// second run of anything.
fn start_twice(config: &VmConfig) -> Result<Ended, String> {
    let first = start(config)?;
    if reached_init(config) {
        return Ok(first);
    }
    println!("vm: the guest never reached /init ({first:?}): booting once more");
    start(config)
}

fn start(config: &VmConfig) -> Result<Ended, String> {
    println!(
        "vm: booting {} (boot timeout {} s, overall {} s)",
        qemu::describe(config),
        config.boot_timeout.as_secs(),
        config.overall_timeout.as_secs()
    );
    let ended = qemu::boot(config)?;
    println!();
    Ok(ended)
}

fn print_entries(report: &ConsoleReport) {
    println!("vm: entries:");
    for entry in &report.entries {
        let word = if entry.passed() { "ok" } else { "FAILED" };
        let exit = entry
            .exit
            .map_or("did not finish".to_string(), |c| format!("exit {c}"));
        let tests = if entry.is_test() {
            format!(", {}", entry.tests.line())
        } else {
            String::new()
        };
        println!("  {word:<7}{} ({exit}{tests})", entry.name);
        for skip in &entry.tests.skipped {
            println!("           skipped: {skip}");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn fault_rows_are_read_from_the_console() {
        let log = "boot\ntest random ... cm-fault: RTUs dropped\t200\t200\t53\t0\t0\nok\ncm-fault: broken line\n";
        let rows = super::fault_rows(log);
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].connections, rows[0].rescued), (200, 53));
    }

    use super::*;

    #[test]
    fn options_are_read() {
        let args: Vec<String> = ["--accel", "tcg", "--timeout", "300", "--kernel", "6.12"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            Options::parse(&args),
            Ok(Options {
                accel: Some(Accel::Tcg),
                timeout: Some(Duration::from_secs(300)),
                manifest: None,
                kernel: Some("6.12".into()),
                ..Options::default()
            })
        );
        assert!(Options::parse(&["--accel".to_string(), "xen".to_string()]).is_err());
        assert!(Options::parse(&["--fast".to_string()]).is_err());
    }
}
