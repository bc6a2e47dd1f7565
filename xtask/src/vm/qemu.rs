//! Booting the VM: qemu-system-x86_64 with no network device (or, for two hosts, one
//! virtio NIC on qemu's socket network over the loopback address), the payload shared
//! read-only over virtio 9p, the console on ttyS0 saved in full, the verdict on the
//! isa-debug-exit port and hard timeouts that kill qemu.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The qemu binary.
pub(crate) const QEMU: &str = "qemu-system-x86_64";
/// What `/init` prints first; seeing it ends the boot timeout.
const INIT_MARKER: &[u8] = b"=== vm-init start";

/// How the guest CPU is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Accel {
    /// Hardware virtualisation through /dev/kvm.
    Kvm,
    /// Software emulation (always works, slower).
    Tcg,
}

/// One VM run.
pub(crate) struct VmConfig {
    /// Kernel image.
    pub(crate) kernel: PathBuf,
    /// Initramfs.
    pub(crate) initramfs: PathBuf,
    /// Host folder shared read-only as `host0`.
    pub(crate) share: PathBuf,
    /// Where the whole console goes.
    pub(crate) console_log: PathBuf,
    /// CPU mode.
    pub(crate) accel: Accel,
    /// Time allowed from start until `/init` prints its first line.
    pub(crate) boot_timeout: Duration,
    /// Time allowed for the whole run.
    pub(crate) overall_timeout: Duration,
    /// Guest memory.
    pub(crate) memory_mib: u32,
    /// Guest CPUs.
    pub(crate) cpus: u32,
    /// The one NIC of a VM that talks to another VM; `None`: no network device.
    pub(crate) nic: Option<Nic>,
    /// Added to the kernel command line (read by `/init`).
    pub(crate) cmdline: String,
}

/// A virtio NIC on qemu's socket network: two VMs joined by one TCP connection over
/// the loopback address, nothing else reachable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Nic {
    /// `listen=127.0.0.1:PORT` (start this VM first) or `connect=127.0.0.1:PORT`.
    pub(crate) socket: String,
    /// The NIC's MAC address: the two must differ (soft-RoCE derives its GID from it).
    pub(crate) mac: String,
}

/// How the run ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// qemu exited by itself with this code (isa-debug-exit: 1 = pass).
    Exited(Option<i32>),
    /// `/init` never started in time; qemu was killed.
    BootTimeout,
    /// The overall time ran out; qemu was killed.
    Timeout,
}

/// The qemu command line for `config`.
pub(crate) fn command(config: &VmConfig) -> Command {
    let mut cmd = Command::new(QEMU);
    match config.accel {
        Accel::Kvm => cmd.args(["-accel", "kvm"]),
        Accel::Tcg => cmd.args(["-accel", "tcg,thread=multi"]),
    };
    // Every CPU feature the accelerator can give: the ThreadSanitizer runtime uses
    // SSE4.1, which qemu's default CPU model lacks.
    cmd.args(["-cpu", "max"])
        .args(["-m", &config.memory_mib.to_string()])
        .args(["-smp", &config.cpus.to_string()])
        .args(["-nodefaults", "-no-reboot", "-display", "none"])
        .args(["-monitor", "none", "-serial", "stdio"]);
    match &config.nic {
        // No network device at all: nothing leaves the VM.
        None => cmd.args(["-nic", "none"]),
        // The other VM, over one loopback TCP connection, and nothing else.
        Some(nic) => cmd
            .args(["-nic", "none", "-netdev"])
            .arg(format!("socket,id=n0,{}", nic.socket))
            .arg("-device")
            .arg(format!("virtio-net-pci,netdev=n0,mac={}", nic.mac)),
    };
    cmd.args(["-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"])
        .arg("-kernel")
        .arg(&config.kernel)
        .arg("-initrd")
        .arg(&config.initramfs)
        // no_timer_check: on a loaded host the emulated CPU can be too slow for the
        // kernel's IO-APIC timer check, which then panics at boot (seen once on 6.1).
        .arg("-append")
        .arg(
            format!(
                "console=ttyS0 panic=-1 quiet loglevel=4 no_timer_check rdinit=/init {}",
                config.cmdline
            )
            .trim_end(),
        )
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=host0,security_model=none,readonly=on",
            config.share.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Whether /dev/kvm can be opened for use.
pub(crate) fn kvm_usable() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

/// Boots the VM and waits until qemu exits or a timeout kills it. The console is echoed
/// and written to `config.console_log`.
pub(crate) fn boot(config: &VmConfig) -> Result<Ended, String> {
    let mut child = command(config)
        .spawn()
        .map_err(|e| format!("could not start {QEMU}: {e}"))?;
    let console = std::fs::File::create(&config.console_log)
        .map_err(|e| format!("{}: {e}", config.console_log.display()))?;
    let init_seen = Arc::new(AtomicBool::new(false));
    let reader = {
        let stdout = child.stdout.take().expect("piped");
        let init_seen = Arc::clone(&init_seen);
        std::thread::spawn(move || copy_console(stdout, console, &init_seen))
    };
    let errors = {
        let mut stderr = child.stderr.take().expect("piped");
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        })
    };
    let ended = wait(&mut child, config, &init_seen)?;
    let _ = reader.join();
    let qemu_errors = errors.join().unwrap_or_default();
    if !qemu_errors.trim().is_empty() {
        eprintln!("{}", qemu_errors.trim());
    }
    // A qemu that could not start the guest at all says why on stderr.
    if let Ended::Exited(code) = &ended {
        if !init_seen.load(Ordering::SeqCst) && !qemu_errors.trim().is_empty() {
            return Err(format!(
                "{QEMU} exited ({code:?}) before /init: {}",
                qemu_errors.trim()
            ));
        }
    }
    Ok(ended)
}

fn wait(child: &mut Child, config: &VmConfig, init_seen: &AtomicBool) -> Result<Ended, String> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("{QEMU}: {e}"))? {
            return Ok(Ended::Exited(status.code()));
        }
        let elapsed = start.elapsed();
        let ended = if !init_seen.load(Ordering::SeqCst) && elapsed > config.boot_timeout {
            Some(Ended::BootTimeout)
        } else if elapsed > config.overall_timeout {
            Some(Ended::Timeout)
        } else {
            None
        };
        if let Some(ended) = ended {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(ended);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Copies qemu's serial output to the log file and our stdout, watching for `/init`.
fn copy_console(mut from: impl Read, mut log: std::fs::File, init_seen: &AtomicBool) {
    let mut buffer = [0u8; 8192];
    // The tail of what came before, so a marker split across reads is still found.
    let mut window: Vec<u8> = Vec::new();
    let stdout = std::io::stdout();
    loop {
        let n = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &buffer[..n];
        let _ = log.write_all(chunk);
        let _ = stdout.lock().write_all(chunk);
        if !init_seen.load(Ordering::SeqCst) {
            window.extend_from_slice(chunk);
            if window.windows(INIT_MARKER.len()).any(|w| w == INIT_MARKER) {
                init_seen.store(true, Ordering::SeqCst);
            }
            let keep = window.len().saturating_sub(INIT_MARKER.len());
            window.drain(..keep);
        }
    }
    let _ = log.flush();
}

/// Whether qemu can be run.
pub(crate) fn available() -> bool {
    Command::new(QEMU)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A short description of the VM, for messages.
pub(crate) fn describe(config: &VmConfig) -> String {
    format!(
        "{QEMU} ({:?}, {} MiB, {} CPUs, kernel {})",
        config.accel,
        config.memory_mib,
        config.cpus,
        Path::new(&config.kernel)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    )
}
