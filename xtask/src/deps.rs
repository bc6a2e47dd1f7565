//! Native prerequisites: Debian packages listed in `ci/`.

use std::process::Command;

use crate::run::{status, workspace_root};

/// The packages the host build and tests need (`ci/apt-packages.txt`).
pub(crate) fn host_packages() -> Vec<String> {
    read_list("ci/apt-packages.txt")
}

/// Reads a package list: one name per line, `#` comments and blank lines ignored.
pub(crate) fn read_list(relative: &str) -> Vec<String> {
    let path = workspace_root().join(relative);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    parse_list(&text)
}

fn parse_list(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Makes sure every package is installed: installs the missing ones when root, else
/// fails with the exact command to run. Returns a note of what it did.
pub(crate) fn ensure(packages: &[String]) -> Result<String, String> {
    let missing: Vec<&str> = packages
        .iter()
        .map(String::as_str)
        .filter(|p| !installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(format!("{} packages present", packages.len()));
    }
    let command = format!("apt-get install -y {}", missing.join(" "));
    if !is_root() {
        return Err(format!(
            "missing Debian packages; run as root: apt-get update && {command}"
        ));
    }
    println!("installing: {}", missing.join(" "));
    status(Command::new("apt-get").arg("update").arg("-qq"))?;
    status(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    Ok(format!("installed {}", missing.join(" ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_ignores_comments_and_blanks() {
        let text = "# header\n\npkg-config # for bindgen\n  libclang-dev\n";
        assert_eq!(parse_list(text), ["pkg-config", "libclang-dev"]);
    }

    #[test]
    fn host_list_names_the_rdma_dev_packages() {
        let list = host_packages();
        for needed in [
            "librdmacm-dev",
            "libibverbs-dev",
            "libclang-dev",
            "pkg-config",
        ] {
            assert!(
                list.iter().any(|p| p == needed),
                "{needed} missing from ci/apt-packages.txt"
            );
        }
    }
}
