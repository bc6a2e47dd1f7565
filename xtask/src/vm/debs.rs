//! The VM's Debian packages: the userspace pinned in `ci/vm/debian-packages.txt` and the
//! kernel image pinned in `ci/vm/kernels/<kernel>.txt`, downloaded with `apt-get
//! download` and unpacked with `dpkg -x` into a cache folder (never installed).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::deps;
use crate::vm::kernel::{Apt, Kernel};

/// The pin list, relative to the workspace root.
pub(crate) const PINS: &str = "ci/vm/debian-packages.txt";

/// Package whose dependency names the current kernel ABI package.
const KERNEL_META: &str = "linux-image-amd64";

/// The unpacked packages, ready to build an image from.
pub(crate) struct Unpacked {
    /// The merged root of every unpacked package.
    pub(crate) root: PathBuf,
    /// Warnings about pins that could not be honoured (repeated on every run).
    pub(crate) fallbacks: Vec<String>,
}

/// One `package=version` pin.
#[derive(Debug, PartialEq, Eq)]
struct Pin {
    package: String,
    version: String,
}

fn parse_pin(line: &str) -> Result<Pin, String> {
    match line.split_once('=') {
        Some((package, version)) if !package.is_empty() && !version.is_empty() => Ok(Pin {
            package: package.trim().to_string(),
            version: version.trim().to_string(),
        }),
        _ => Err(format!("{PINS}: `{line}` is not `package=version`")),
    }
}

/// Returns the unpacked packages (userspace and `kernel`'s image) under `cache`,
/// downloading and unpacking them unless the cache was made from the same pins.
pub(crate) fn fetch(cache: &Path, kernel: &Kernel) -> Result<Unpacked, String> {
    let mut lines = deps::read_list(PINS);
    // A kernel from the host's lists goes with the userspace (and its fallback); one from
    // its own source is downloaded apart.
    let own_source = kernel.apt_source.is_some();
    if !own_source {
        lines.push(kernel.image.clone());
    }
    let pins = lines
        .iter()
        .map(|l| parse_pin(l))
        .collect::<Result<Vec<_>, _>>()?;
    let stamp_text = format!(
        "{}\n{:?}\n{}",
        lines.join("\n"),
        kernel.apt_source,
        kernel.image
    );
    let stamp = cache.join("stamp");
    let fallback_file = cache.join("fallbacks.txt");
    let root = cache.join("root");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(stamp_text.as_str()) && root.is_dir()
    {
        let fallbacks: Vec<String> = std::fs::read_to_string(&fallback_file)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect();
        for warning in &fallbacks {
            warn(warning);
        }
        println!(
            "vm: packages cached in {} (pins unchanged)",
            cache.display()
        );
        return Ok(Unpacked { root, fallbacks });
    }

    let debs = cache.join("debs");
    for dir in [&debs, &root] {
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let _ = std::fs::remove_file(&stamp);

    let fallbacks = download(&debs, &pins)?;
    if own_source {
        println!("vm: downloading {} from its own source", kernel.image);
        kernel
            .apt(&cache.join("apt"))?
            .download(&debs, std::slice::from_ref(&kernel.image))
            .map_err(|e| format!("cannot download {}: {e}", kernel.image))?;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&debs)
        .map_err(|e| format!("{}: {e}", debs.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "deb"))
        .collect();
    files.sort();
    println!("vm: unpacking {} packages", files.len());
    for deb in &files {
        run_quiet(Command::new("dpkg").arg("-x").arg(deb).arg(&root))?;
    }
    std::fs::write(&fallback_file, fallbacks.join("\n")).map_err(|e| e.to_string())?;
    std::fs::write(&stamp, stamp_text).map_err(|e| e.to_string())?;
    Ok(Unpacked { root, fallbacks })
}

/// Downloads every pin into `dir`; returns the warnings for pins replaced by the current
/// candidate.
fn download(dir: &Path, pins: &[Pin]) -> Result<Vec<String>, String> {
    let all: Vec<String> = pins
        .iter()
        .map(|p| format!("{}={}", p.package, p.version))
        .collect();
    println!("vm: downloading {} pinned packages", all.len());
    if apt_download(dir, &all).is_ok() {
        return Ok(Vec::new());
    }
    // Stale package lists are the common cause: refresh once, then go pin by pin.
    println!("vm: download failed; refreshing the package lists");
    if let Err(e) = run_quiet(Command::new("apt-get").args(["update", "-qq"])) {
        println!("vm: apt-get update failed: {e}");
    }
    let mut fallbacks = Vec::new();
    for (pin, spec) in pins.iter().zip(&all) {
        let Err(pinned_error) = apt_download(dir, std::slice::from_ref(spec)) else {
            continue;
        };
        let mut candidates = vec![pin.package.clone()];
        if pin.package.starts_with("linux-image-") {
            if let Some(current) = current_kernel_package() {
                if current != pin.package {
                    candidates.push(current);
                }
            }
        }
        let mut replaced = None;
        for candidate in &candidates {
            if apt_download(dir, std::slice::from_ref(candidate)).is_ok() {
                replaced = Some(candidate.clone());
                break;
            }
        }
        let Some(candidate) = replaced else {
            return Err(format!(
                "download failure: cannot download {spec} ({pinned_error}) nor the current \
                 candidate of {}",
                candidates.join(" / ")
            ));
        };
        let version = candidate_version(&candidate).unwrap_or_else(|| "?".into());
        let warning = format!(
            "pinned {spec} is no longer downloadable: using the current {candidate}={version} \
             instead; update {PINS}"
        );
        warn(&warning);
        fallbacks.push(warning);
    }
    Ok(fallbacks)
}

fn warn(message: &str) {
    println!("vm: !!!!!!!! WARNING !!!!!!!! {message}");
    eprintln!("vm: WARNING: {message}");
}

/// `apt-get download` of `specs` into `dir` with the host's package lists.
fn apt_download(dir: &Path, specs: &[String]) -> Result<(), String> {
    Apt::host().download(dir, specs)
}

/// The kernel ABI package `linux-image-amd64` depends on now.
fn current_kernel_package() -> Option<String> {
    let out = Command::new("apt-cache")
        .args(["depends", KERNEL_META])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        l.trim()
            .strip_prefix("Depends: ")
            .filter(|p| p.starts_with("linux-image-"))
            .map(str::to_string)
    })
}

fn candidate_version(package: &str) -> Option<String> {
    let out = Command::new("apt-cache")
        .args(["policy", package])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Candidate: ").map(str::to_string))
}

/// Runs a command with captured output; `Err` carries the end of its stderr.
pub(crate) fn run_quiet(cmd: &mut Command) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    let out = cmd
        .output()
        .map_err(|e| format!("could not start {shown}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    Err(format!(
        "{shown} failed ({}): {}",
        out.status,
        tail.join(" | ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_are_package_equals_version() {
        assert_eq!(
            parse_pin("libbpf1=1:1.1.2-0+deb12u1"),
            Ok(Pin {
                package: "libbpf1".into(),
                version: "1:1.1.2-0+deb12u1".into()
            })
        );
        assert!(parse_pin("librdmacm1").is_err());
    }

    #[test]
    fn the_pin_list_names_a_kernel_and_the_rdma_userspace() {
        let pins: Vec<Pin> = deps::read_list(PINS)
            .iter()
            .map(|l| parse_pin(l).expect("valid pin"))
            .collect();
        for needed in [
            "librdmacm1",
            "ibverbs-providers",
            "rdmacm-utils",
            "nftables",
            "iproute2",
        ] {
            assert!(pins.iter().any(|p| p.package == needed), "{needed}");
        }
        // The kernels are pinned apart, one file each.
        assert!(!pins.iter().any(|p| p.package.starts_with("linux-image-")));
        let default = Kernel::load(crate::vm::kernel::DEFAULT).expect("default kernel");
        let image = parse_pin(&default.image).expect("kernel pin");
        assert!(image.package.starts_with("linux-image-6.1.0-"));
    }
}
