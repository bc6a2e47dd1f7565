//! The test devices the VM's kernel does not ship, built for its exact kernel from that
//! kernel's Debian sources:
//! - the COMM_EST-raising soft-RoCE: `rdma_rxe` with the patch
//!   `ci/vm/rxe-comm-est/<kernel>.patch` (a module parameter, `comm_est`, off by default,
//!   that makes the responder raise `IB_EVENT_COMM_EST` on the first packet an RC QP
//!   executes, as InfiniBand hardware does); inside the VM `rxe-reload comm-est` swaps it in;
//! - soft-iWARP: `siw`, unpatched (Debian builds its kernels without `CONFIG_RDMA_SIW`);
//!   inside the VM `rdma-devices siw` puts it on the two netdevs in rxe's place.
//!
//! The build pins of `ci/vm/kernels/<kernel>.txt` are downloaded with `apt-get download`
//! and unpacked with `dpkg -x` (never installed), only the drivers' folders are extracted
//! from the source tarball, and each is built out of tree against the unpacked
//! `linux-headers-<release>` with the host's gcc-12. The stripped modules are cached under
//! `<cache>/rxe-comm-est`, keyed by the kernel pins and the patch.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::vm::debs::run_quiet;
use crate::vm::kernel::{Kernel, KERNELS};
/// The script that swaps the module inside the VM (put on PATH there).
pub(crate) const RELOAD_SCRIPT: &str = "ci/vm/rxe-comm-est/rxe-reload";
/// The script that moves the VM's two devices between soft-RoCE and soft-iWARP.
pub(crate) const DEVICES_SCRIPT: &str = "ci/vm/siw/rdma-devices";
/// Where the source tarball keeps the soft-RoCE driver.
const RXE_IN_TREE: &str = "drivers/infiniband/sw/rxe";
/// Where the source tarball keeps the soft-iWARP driver.
const SIW_IN_TREE: &str = "drivers/infiniband/sw/siw";

/// The modules built for one kernel.
#[derive(Debug)]
pub(crate) struct TestModules {
    /// The COMM_EST-raising `rdma_rxe.ko`.
    pub(crate) rxe_comm_est: PathBuf,
    /// The stock `siw.ko`.
    pub(crate) siw: PathBuf,
}

/// What to build from the pins.
#[derive(Debug, PartialEq, Eq)]
struct BuildPlan {
    /// `linux-source-X` (its tarball is `usr/src/linux-source-X.tar.xz`).
    source_package: String,
    /// The kernel release the module is for (`6.1.0-57-amd64`).
    release: String,
}

fn plan(pins: &[String]) -> Result<BuildPlan, String> {
    let names: Vec<&str> = pins
        .iter()
        .map(|l| l.split('=').next().unwrap_or("").trim())
        .collect();
    let source_package = names
        .iter()
        .find(|n| n.starts_with("linux-source-"))
        .ok_or(format!("{KERNELS}: the build pins name no linux-source-*"))?
        .to_string();
    let release = names
        .iter()
        .filter_map(|n| n.strip_prefix("linux-headers-"))
        .find(|r| !r.ends_with("-common"))
        .ok_or(format!(
            "{KERNELS}: the build pins name no linux-headers-<release>"
        ))?
        .to_string();
    Ok(BuildPlan {
        source_package,
        release,
    })
}

/// Returns the patched `rdma_rxe.ko` and the stock `siw.ko` (stripped) for `kernel`,
/// whose image unpacks as `kernel_release`, building them unless the cache under `cache`
/// was made from the same kernel pins and patch.
pub(crate) fn build(
    cache: &Path,
    kernel: &Kernel,
    kernel_release: &str,
) -> Result<TestModules, String> {
    let pins = &kernel.build;
    let plan = plan(pins)?;
    if plan.release != kernel_release {
        return Err(format!(
            "{KERNELS}/{}.txt builds rdma_rxe for {} but the VM boots {kernel_release}: \
             pin the image and the build packages at the same version",
            kernel.name, plan.release
        ));
    }
    let patch = kernel.patch();
    let patch_text =
        std::fs::read_to_string(&patch).map_err(|e| format!("{}: {e}", patch.display()))?;
    let stamp_text = format!(
        "{}\n{:?}\n{}\n{SIW_IN_TREE}\n{patch_text}",
        kernel.image,
        kernel.apt_source,
        pins.join("\n")
    );
    let dir = cache.join("rxe-comm-est");
    let stamp = dir.join("stamp");
    let modules = TestModules {
        rxe_comm_est: dir.join("rdma_rxe.ko"),
        siw: dir.join("siw.ko"),
    };
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(stamp_text.as_str())
        && modules.rxe_comm_est.is_file()
        && modules.siw.is_file()
    {
        println!("vm: COMM_EST rdma_rxe and siw cached in {}", dir.display());
        return Ok(modules);
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let started = std::time::Instant::now();
    let debs = dir.join("debs");
    let root = dir.join("root");
    let build = dir.join("build");
    for d in [&debs, &root] {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    println!("vm: test modules: downloading {} packages", pins.len());
    let apt = kernel.apt(&cache.join("apt"))?;
    if apt.download(&debs, pins).is_err() {
        if apt.is_host() {
            println!("vm: download failed; refreshing the package lists");
            run_quiet(Command::new("apt-get").args(["update", "-qq"]))?;
        }
        apt.download(&debs, pins).map_err(|e| {
            format!(
                "cannot download the pinned rxe build packages ({KERNELS}/{}.txt): {e}",
                kernel.name
            )
        })?;
    }
    for entry in std::fs::read_dir(&debs).map_err(|e| e.to_string())? {
        let deb = entry.map_err(|e| e.to_string())?.path();
        run_quiet(Command::new("dpkg").arg("-x").arg(&deb).arg(&root))?;
        std::fs::remove_file(&deb).map_err(|e| e.to_string())?;
    }

    // Only the drivers' folders of the source tarball.
    let tarball = root.join(format!("usr/src/{}.tar.xz", plan.source_package));
    let rxe_member = format!("{}/{RXE_IN_TREE}", plan.source_package);
    let siw_member = format!("{}/{SIW_IN_TREE}", plan.source_package);
    run_quiet(
        Command::new("tar")
            .arg("-xJf")
            .arg(&tarball)
            .arg("-C")
            .arg(&dir)
            .arg(&rxe_member)
            .arg(&siw_member),
    )?;
    std::fs::remove_file(&tarball).map_err(|e| e.to_string())?;
    let siw_build = dir.join("build-siw");
    std::fs::rename(dir.join(&rxe_member), &build).map_err(|e| e.to_string())?;
    std::fs::rename(dir.join(&siw_member), &siw_build).map_err(|e| e.to_string())?;
    run_quiet(
        Command::new("patch")
            .args(["-p1", "--quiet", "-d"])
            .arg(&build)
            .arg("-i")
            .arg(&patch),
    )?;

    // Debian's per-flavour Makefile includes the common tree by its installed path.
    let headers = root.join(format!("usr/src/linux-headers-{}", plan.release));
    let makefile = headers.join("Makefile");
    let text =
        std::fs::read_to_string(&makefile).map_err(|e| format!("{}: {e}", makefile.display()))?;
    let rooted: String = text
        .lines()
        .map(|line| match line.strip_prefix("include /") {
            Some(path) => format!("include {}\n", root.join(path).display()),
            None => format!("{line}\n"),
        })
        .collect();
    std::fs::write(&makefile, rooted).map_err(|e| e.to_string())?;

    build_module(
        &headers,
        &build,
        "CONFIG_RDMA_RXE=m",
        &modules.rxe_comm_est,
        &plan,
    )?;
    build_module(
        &headers,
        &siw_build,
        "CONFIG_RDMA_SIW=m",
        &modules.siw,
        &plan,
    )?;
    for d in [&root, &build, &siw_build, &debs] {
        let _ = std::fs::remove_dir_all(d);
    }
    std::fs::write(&stamp, stamp_text).map_err(|e| e.to_string())?;
    println!(
        "vm: COMM_EST rdma_rxe and siw built in {:.0} s",
        started.elapsed().as_secs_f64(),
    );
    Ok(modules)
}

/// Builds the module of the driver folder `source` out of tree against `headers` with
/// `config` set, and writes it stripped to `module`, checking it is for the plan's kernel.
fn build_module(
    headers: &Path,
    source: &Path,
    config: &str,
    module: &Path,
    plan: &BuildPlan,
) -> Result<(), String> {
    println!("vm: building {} for {}", source.display(), plan.release);
    run_quiet(
        Command::new("nice")
            .arg("make")
            .arg("-C")
            .arg(headers)
            .arg(format!("M={}", source.display()))
            // No BTF for the module: it needs pahole and the kernel's vmlinux, and
            // loading does not need it.
            .args([config, "CONFIG_DEBUG_INFO_BTF_MODULES=", "-j2", "modules"]),
    )?;
    let name = module.file_name().expect("a file name");
    run_quiet(
        Command::new("strip")
            .arg("--strip-debug")
            .arg(source.join(name))
            .arg("-o")
            .arg(module),
    )?;
    let bytes = std::fs::read(module).map_err(|e| e.to_string())?;
    let vermagic = format!("vermagic={} ", plan.release);
    if !bytes
        .windows(vermagic.len())
        .any(|w| w == vermagic.as_bytes())
    {
        return Err(format!(
            "{} has no `{vermagic}`: not built for the VM's kernel",
            module.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pins_name_the_sources_and_the_release() {
        let pins: Vec<String> = [
            "linux-source-6.1=6.1.192-3",
            "linux-headers-6.1.0-57-amd64=6.1.192-3",
            "linux-headers-6.1.0-57-common=6.1.192-3",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            plan(&pins),
            Ok(BuildPlan {
                source_package: "linux-source-6.1".into(),
                release: "6.1.0-57-amd64".into()
            })
        );
        assert!(plan(&pins[1..]).is_err());
    }

    #[test]
    fn every_kernel_builds_rxe_for_its_own_image() {
        for name in crate::vm::kernel::known() {
            let kernel = Kernel::load(&name).expect("pin file");
            let plan = plan(&kernel.build).expect("valid build pins");
            let version = |pin: &str| pin.split_once('=').map(|(_, v)| v.to_string());
            assert!(
                kernel
                    .image
                    .starts_with(&format!("linux-image-{}=", plan.release)),
                "{name}: {} vs {}",
                kernel.image,
                plan.release
            );
            for pin in &kernel.build {
                assert_eq!(version(pin), version(&kernel.image), "{name}: {pin}");
            }
        }
    }
}
