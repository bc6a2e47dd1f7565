//! The kernels the VM can boot: one pin file each in `ci/vm/kernels/<name>.txt` (the
//! image, and the packages that build its COMM_EST `rdma_rxe`), an optional private apt
//! source for them, and the rxe patch `ci/vm/rxe-comm-est/<name>.patch`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::deps;
use crate::run::workspace_root;
use crate::vm::debs::run_quiet;

/// The folder of the kernel pin files, relative to the workspace root.
pub(crate) const KERNELS: &str = "ci/vm/kernels";
/// The kernel `cargo xtask vm` boots without `--kernel`.
pub(crate) const DEFAULT: &str = "6.1";
/// Every kernel `cargo xtask ci` boots, in order.
pub(crate) const CI_KERNELS: &[&str] = &["6.1", "6.12"];
/// The line prefix naming a kernel's own apt source.
const APT_SOURCE: &str = "apt-source:";

/// One kernel's pins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Kernel {
    /// Its name (`6.1`, `6.12`): the pin file's and the patch's stem.
    pub(crate) name: String,
    /// The one-line apt source its pins come from; `None`: the host's package lists.
    pub(crate) apt_source: Option<String>,
    /// The `linux-image-*` pin.
    pub(crate) image: String,
    /// The pins that build its COMM_EST `rdma_rxe`.
    pub(crate) build: Vec<String>,
}

impl Kernel {
    /// Reads `ci/vm/kernels/<name>.txt`.
    pub(crate) fn load(name: &str) -> Result<Kernel, String> {
        let relative = format!("{KERNELS}/{name}.txt");
        if !workspace_root().join(&relative).is_file() {
            return Err(format!(
                "no kernel `{name}`: {relative} does not exist (known: {})",
                known().join(", ")
            ));
        }
        Kernel::parse(name, &deps::read_list(&relative))
    }

    fn parse(name: &str, lines: &[String]) -> Result<Kernel, String> {
        let mut apt_source = None;
        let mut image = None;
        let mut build = Vec::new();
        for line in lines {
            if let Some(source) = line.strip_prefix(APT_SOURCE) {
                apt_source = Some(source.trim().to_string());
            } else if line.starts_with("linux-image-") {
                image = Some(line.clone());
            } else if line.contains('=') {
                build.push(line.clone());
            } else {
                return Err(format!("{KERNELS}/{name}.txt: cannot read `{line}`"));
            }
        }
        Ok(Kernel {
            name: name.to_string(),
            apt_source,
            image: image.ok_or(format!("{KERNELS}/{name}.txt pins no linux-image-*"))?,
            build,
        })
    }

    /// The rxe patch for this kernel.
    pub(crate) fn patch(&self) -> PathBuf {
        workspace_root().join(format!("ci/vm/rxe-comm-est/{}.patch", self.name))
    }

    /// How `apt-get` reaches this kernel's packages, with private state under `state`
    /// when it has its own source.
    pub(crate) fn apt(&self, state: &Path) -> Result<Apt, String> {
        match &self.apt_source {
            None => Ok(Apt::host()),
            Some(source) => Apt::private(state, source),
        }
    }
}

/// The kernels with a pin file.
pub(crate) fn known() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(workspace_root().join(KERNELS))
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| {
                    e.file_name()
                        .to_str()?
                        .strip_suffix(".txt")
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// `apt-get` with the host's package lists, or with a private sources list and state.
#[derive(Debug, Clone, Default)]
pub(crate) struct Apt {
    options: Vec<String>,
}

impl Apt {
    /// The host's apt as configured.
    pub(crate) fn host() -> Apt {
        Apt::default()
    }

    /// apt with only `source` (one `deb ...` line) and its lists under `state`, refreshed
    /// now; the host's sources, lists and installs are not touched.
    fn private(state: &Path, source: &str) -> Result<Apt, String> {
        let lists = state.join("lists");
        let parts = state.join("sources.list.d");
        let preferences = state.join("preferences.d");
        for dir in [
            &lists.join("partial"),
            &state.join("archives/partial"),
            &parts,
            &preferences,
        ] {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let sources = state.join("sources.list");
        std::fs::write(&sources, format!("{source}\n")).map_err(|e| e.to_string())?;
        let set =
            |key: &str, path: &Path| vec!["-o".to_string(), format!("{key}={}", path.display())];
        let mut options = Vec::new();
        options.extend(set("Dir::Etc::SourceList", &sources));
        options.extend(set("Dir::Etc::SourceParts", &parts));
        options.extend(set("Dir::Etc::PreferencesParts", &preferences));
        options.extend(set("Dir::Etc::Preferences", &state.join("preferences")));
        options.extend(set("Dir::State::Lists", &lists));
        options.extend(set("Dir::Cache", state));
        let apt = Apt { options };
        println!("vm: apt-get update of {source} (private lists)");
        run_quiet(Command::new("apt-get").args(&apt.options).args([
            "-o",
            "APT::Sandbox::User=root",
            "update",
            "-qq",
        ]))?;
        Ok(apt)
    }

    /// `apt-get download` of `specs` into `dir`.
    pub(crate) fn download(&self, dir: &Path, specs: &[String]) -> Result<(), String> {
        run_quiet(
            Command::new("apt-get")
                .args(&self.options)
                // Downloading into a root-owned folder: apt's `_apt` sandbox user cannot
                // write it.
                .args(["download", "-qq", "-o", "APT::Sandbox::User=root"])
                .args(specs)
                .current_dir(dir),
        )
    }

    /// Whether this is the host's apt (where `apt-get update` may refresh stale lists).
    pub(crate) fn is_host(&self) -> bool {
        self.options.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_file_is_read() {
        let lines: Vec<String> = [
            "apt-source: deb http://deb.debian.org/debian bookworm-backports main",
            "linux-image-6.12.95+deb12-amd64=6.12.95-1~bpo12+1",
            "linux-source-6.12=6.12.95-1~bpo12+1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let kernel = Kernel::parse("6.12", &lines).expect("valid");
        assert_eq!(
            kernel.apt_source.as_deref(),
            Some("deb http://deb.debian.org/debian bookworm-backports main")
        );
        assert_eq!(kernel.image, lines[1]);
        assert_eq!(kernel.build, [lines[2].clone()]);
        assert!(Kernel::parse("x", &lines[2..]).is_err());
        assert!(Kernel::parse("x", &["nonsense".to_string()]).is_err());
    }

    #[test]
    fn every_ci_kernel_has_pins_and_a_patch() {
        for name in CI_KERNELS {
            let kernel = Kernel::load(name).expect("pin file");
            assert!(kernel.patch().is_file(), "{}", kernel.patch().display());
        }
        assert!(known().iter().any(|k| k == DEFAULT));
    }
}
