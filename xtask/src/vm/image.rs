//! The VM's boot files: the kernel from the unpacked packages and an initramfs holding
//! busybox, `ci/vm/init`, the Debian userspace, the shared-library closure of every ELF
//! file in it (and of the payload) and the kernel modules of `ci/vm/modules.txt`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::deps;
use crate::run::workspace_root;

/// Module list, relative to the workspace root.
const MODULES: &str = "ci/vm/modules.txt";
/// The VM's `/init`, relative to the workspace root.
const INIT: &str = "ci/vm/init";
/// Host busybox (package busybox-static).
const BUSYBOX: &str = "/bin/busybox";
/// Library folder inside the image (and of the Debian packages).
const LIB_DIR: &str = "usr/lib/x86_64-linux-gnu";

/// Host libraries that glibc loads with dlopen, so ldd never names them
/// (libgcc_s: pthread_exit and pthread_cancel unwind through it).
const DLOPENED: &[&str] = &["libgcc_s.so.1"];
/// Host folders searched for [`DLOPENED`].
const HOST_LIB_DIRS: &[&str] = &["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"];

/// Paths of the unpacked packages that the VM does not need.
const SKIPPED: &[&str] = &[
    "boot",
    "lib/modules",
    "lib/systemd",
    "lib/udev",
    "usr/lib/systemd",
    "usr/lib/udev",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bash-completion",
    "usr/share/zsh",
    // valgrind's static libraries, for building tools.
    "usr/lib/x86_64-linux-gnu/valgrind",
];

/// Folders of which the image keeps only the files named: of valgrind's 80 MB, what
/// `valgrind --tool=callgrind` needs on x86-64 (the bench counts instructions with it).
const KEPT_ONLY: &[(&str, &[&str])] = &[(
    "usr/libexec/valgrind",
    &[
        "callgrind-amd64-linux",
        "vgpreload_core-amd64-linux.so",
        "default.supp",
    ],
)];

/// Whether the image leaves out `rel` (a path relative to the unpacked packages).
fn left_out(rel: &Path) -> bool {
    SKIPPED.iter().any(|s| rel == Path::new(s))
        || KEPT_ONLY.iter().any(|(dir, kept)| {
            rel.parent() == Some(Path::new(dir))
                && !kept
                    .iter()
                    .any(|name| rel.file_name() == Some(name.as_ref()))
        })
}

/// Kernel and initramfs of one build.
pub(crate) struct BootFiles {
    /// The kernel image (`vmlinuz-*`).
    pub(crate) kernel: PathBuf,
    /// The gzip'd cpio initramfs.
    pub(crate) initramfs: PathBuf,
}

/// Builds the initramfs in `work` from the unpacked `root`; `payload` lists host
/// executables whose libraries the image must also hold.
pub(crate) fn build(root: &Path, work: &Path, payload: &[PathBuf]) -> Result<BootFiles, String> {
    let release = kernel_release(root)?;
    let kernel = root.join(format!("boot/vmlinuz-{release}"));
    if !kernel.is_file() {
        return Err(format!("no kernel at {}", kernel.display()));
    }
    let stage = work.join("initramfs-root");
    if stage.exists() {
        std::fs::remove_dir_all(&stage).map_err(|e| format!("{}: {e}", stage.display()))?;
    }
    for dir in [
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        LIB_DIR,
        "usr/lib64",
        "etc/vm",
    ] {
        mkdir(&stage.join(dir))?;
    }
    // Merged /usr: the Debian files under /lib land in /usr/lib; /bin and /sbin stay
    // busybox's so its applets never shadow the real tools in /usr.
    symlink("usr/lib", stage.join("lib")).map_err(|e| e.to_string())?;
    symlink("usr/lib64", stage.join("lib64")).map_err(|e| e.to_string())?;

    if !is_static(Path::new(BUSYBOX)) {
        return Err(format!(
            "{BUSYBOX} is not statically linked: install the Debian package busybox-static"
        ));
    }
    copy_file(Path::new(BUSYBOX), &stage.join("bin/busybox"))?;
    copy_file(&workspace_root().join(INIT), &stage.join("init"))?;
    set_mode(&stage.join("init"), 0o755)?;
    copy_tree(root, Path::new(""), &stage)?;
    let added = add_library_closure(&stage, payload)?;
    let modules = add_modules(root, &release, &stage)?;
    println!(
        "vm: image: kernel {release}, {} modules, {} host libraries",
        modules,
        added.len()
    );

    let initramfs = work.join("initramfs.cpio.gz");
    pack(&stage, &initramfs)?;
    Ok(BootFiles { kernel, initramfs })
}

/// The release of the one kernel in the unpacked packages (`6.1.0-57-amd64`).
pub(crate) fn kernel_release(root: &Path) -> Result<String, String> {
    let dir = root.join("lib/modules");
    let mut releases: Vec<String> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    releases.sort();
    match releases.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(format!(
            "expected one kernel in {}, found {releases:?}",
            dir.display()
        )),
    }
}

fn mkdir(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))
}

fn copy_file(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| format!("copy {} -> {}: {e}", from.display(), to.display()))
}

fn set_mode(path: &Path, mode: u32) -> Result<(), String> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Where a path of the unpacked packages goes in the image (merged /usr).
fn image_path(relative: &Path) -> PathBuf {
    let mut parts = relative.components();
    match parts.next().and_then(|c| c.as_os_str().to_str()) {
        Some(top @ ("bin" | "sbin" | "lib" | "lib64")) => {
            Path::new("usr").join(top).join(parts.as_path())
        }
        _ => relative.to_path_buf(),
    }
}

/// Copies the unpacked packages (minus what [`left_out`] names) into the image, keeping
/// symlinks.
fn copy_tree(root: &Path, relative: &Path, stage: &Path) -> Result<(), String> {
    let dir = root.join(relative);
    for entry in std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let entry = entry.map_err(|e| e.to_string())?;
        let rel = relative.join(entry.file_name());
        if left_out(&rel) {
            continue;
        }
        let from = entry.path();
        let to = stage.join(image_path(&rel));
        let kind = entry.file_type().map_err(|e| e.to_string())?;
        if kind.is_dir() {
            mkdir(&to)?;
            copy_tree(root, &rel, stage)?;
        } else if kind.is_symlink() {
            let target = std::fs::read_link(&from).map_err(|e| e.to_string())?;
            let target = match target.strip_prefix("/") {
                Ok(absolute) => Path::new("/").join(image_path(absolute)),
                Err(_) => target,
            };
            let _ = std::fs::remove_file(&to);
            symlink(&target, &to).map_err(|e| format!("{}: {e}", to.display()))?;
        } else {
            copy_file(&from, &to)?;
        }
    }
    Ok(())
}

fn is_elf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == *b"\x7fELF"
}

fn elf_files(dir: &Path, found: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let path = entry.path();
        if kind.is_dir() {
            elf_files(&path, found);
        } else if kind.is_file() && is_elf(&path) {
            found.push(path);
        }
    }
}

/// Whether `path` needs no shared library (ldd: "not a dynamic executable").
fn is_static(path: &Path) -> bool {
    Command::new("ldd").arg(path).output().is_ok_and(|out| {
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        text.contains("not a dynamic executable") || text.contains("statically linked")
    })
}

/// One library line of `ldd` output.
#[derive(Debug, PartialEq, Eq)]
enum LddLine {
    /// Resolved to this file.
    Found(PathBuf),
    /// Not found anywhere.
    Missing(String),
}

fn parse_ldd(output: &str) -> Vec<LddLine> {
    output
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            if let Some((name, rest)) = line.split_once(" => ") {
                if rest.starts_with("not found") {
                    return Some(LddLine::Missing(name.trim().to_string()));
                }
                let path = rest.split(" (").next()?.trim();
                return path
                    .starts_with('/')
                    .then(|| LddLine::Found(PathBuf::from(path)));
            }
            // The loader itself: `/lib64/ld-linux-x86-64.so.2 (0x...)`.
            let path = line.split(" (").next()?.trim();
            path.starts_with('/')
                .then(|| LddLine::Found(PathBuf::from(path)))
        })
        .collect()
}

/// Adds to the image every library that an ELF file of the image or of the payload needs
/// and the image does not have yet (glibc, libgcc_s, ... from the host). Libraries are
/// resolved against the image first, so the pinned Debian versions win.
fn add_library_closure(stage: &Path, payload: &[PathBuf]) -> Result<BTreeSet<PathBuf>, String> {
    let mut elves = Vec::new();
    for dir in ["usr/bin", "usr/sbin", "usr/lib"] {
        elf_files(&stage.join(dir), &mut elves);
    }
    elves.extend(payload.iter().cloned());
    let lib_dir = stage.join(LIB_DIR);
    let search = format!(
        "{}:{}",
        lib_dir.display(),
        lib_dir.join("libibverbs").display()
    );
    let mut added = BTreeSet::new();
    for name in DLOPENED {
        let host = HOST_LIB_DIRS
            .iter()
            .map(|dir| Path::new(dir).join(name))
            .find(|p| p.exists())
            .ok_or_else(|| format!("host library {name} not found in {HOST_LIB_DIRS:?}"))?;
        let to = lib_dir.join(name);
        if !to.exists() {
            let real = std::fs::canonicalize(&host).map_err(|e| e.to_string())?;
            copy_file(&real, &to)?;
            added.insert(host);
        }
    }
    for elf in &elves {
        let out = Command::new("ldd")
            .arg(elf)
            .env("LD_LIBRARY_PATH", &search)
            .output()
            .map_err(|e| format!("could not run ldd: {e}"))?;
        for line in parse_ldd(&String::from_utf8_lossy(&out.stdout)) {
            let host = match line {
                LddLine::Missing(name) => {
                    return Err(format!("{name}, needed by {}, is not found", elf.display()))
                }
                LddLine::Found(path) if path.starts_with(stage) => continue,
                LddLine::Found(path) => path,
            };
            if !added.insert(host.clone()) {
                continue;
            }
            let file_name = host.file_name().ok_or("library without a name")?;
            let to = if host.starts_with("/lib64") {
                stage.join("usr/lib64").join(file_name)
            } else {
                lib_dir.join(file_name)
            };
            if !to.exists() {
                let real = std::fs::canonicalize(&host).map_err(|e| e.to_string())?;
                copy_file(&real, &to)?;
            }
        }
    }
    Ok(added)
}

/// Module name as the kernel knows it (`-` and `_` are the same), from a plain
/// (`x.ko`) or xz-compressed (`x.ko.xz`, as Debian ships 6.12) module file.
fn module_name(file_name: &str) -> Option<String> {
    let stem = file_name
        .strip_suffix(".ko")
        .or_else(|| file_name.strip_suffix(".ko.xz"))?;
    Some(stem.replace('-', "_"))
}

/// A module file's contents, decompressed: busybox `insmod` hands the file to the kernel
/// as it is, and only plain modules load that way.
fn read_module(path: &Path) -> Result<Vec<u8>, String> {
    if path.extension().is_some_and(|x| x == "xz") {
        let out = Command::new("xz")
            .arg("-dc")
            .arg(path)
            .output()
            .map_err(|e| format!("could not run xz: {e}"))?;
        if !out.status.success() {
            return Err(format!("xz -dc {} failed ({})", path.display(), out.status));
        }
        return Ok(out.stdout);
    }
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The `depends=` field of a module's `.modinfo` section.
fn module_depends(bytes: &[u8]) -> Vec<String> {
    const KEY: &[u8] = b"\0depends=";
    let Some(at) = bytes.windows(KEY.len()).position(|w| w == KEY) else {
        return Vec::new();
    };
    let value = &bytes[at + KEY.len()..];
    let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end])
        .split(',')
        .filter(|d| !d.is_empty())
        .map(|d| d.replace('-', "_"))
        .collect()
}

fn index_modules(dir: &Path, index: &mut BTreeMap<String, PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            index_modules(&path, index);
        } else if let Some(name) = entry.file_name().to_str().and_then(module_name) {
            index.insert(name, path);
        }
    }
}

/// Puts each wanted module and what it depends on into `/modules`, and the load order
/// with parameters into `/etc/vm/modules`. Returns how many modules the VM loads.
fn add_modules(root: &Path, release: &str, stage: &Path) -> Result<usize, String> {
    let modules_dir = root.join("lib/modules").join(release);
    let mut index = BTreeMap::new();
    index_modules(&modules_dir.join("kernel"), &mut index);
    let builtin: BTreeSet<String> = std::fs::read_to_string(modules_dir.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| module_name(l.rsplit('/').next()?))
        .collect();

    let mut order: Vec<(String, String)> = Vec::new();
    for line in deps::read_list(MODULES) {
        let (name, params) = line.split_once(' ').unwrap_or((line.as_str(), ""));
        let name = name.replace('-', "_");
        if builtin.contains(&name) {
            println!("vm: module {name} is built into {release}");
            continue;
        }
        add_with_depends(&name, params.trim(), &index, &mut order, &mut Vec::new())?;
    }
    mkdir(&stage.join("modules"))?;
    let mut list = String::new();
    for (name, params) in &order {
        let file = format!("{name}.ko");
        let to = stage.join("modules").join(&file);
        std::fs::write(&to, read_module(&index[name])?)
            .map_err(|e| format!("{}: {e}", to.display()))?;
        list.push_str(&format!("{file} {params}\n"));
    }
    std::fs::write(stage.join("etc/vm/modules"), list).map_err(|e| e.to_string())?;
    Ok(order.len())
}

fn add_with_depends(
    name: &str,
    params: &str,
    index: &BTreeMap<String, PathBuf>,
    order: &mut Vec<(String, String)>,
    visiting: &mut Vec<String>,
) -> Result<(), String> {
    if order.iter().any(|(n, _)| n == name) {
        return Ok(());
    }
    if visiting.iter().any(|n| n == name) {
        return Err(format!("module dependency cycle: {visiting:?} -> {name}"));
    }
    let path = index
        .get(name)
        .ok_or_else(|| format!("module {name} ({MODULES}) is not in the kernel package"))?;
    let bytes = read_module(path)?;
    visiting.push(name.to_string());
    for dependency in module_depends(&bytes) {
        add_with_depends(&dependency, "", index, order, visiting)?;
    }
    visiting.pop();
    order.push((name.to_string(), params.to_string()));
    Ok(())
}

/// Every path below `stage`, relative, parents first (the order cpio wants).
fn list_paths(stage: &Path, relative: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let dir = stage.join(relative);
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .flatten()
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let rel = relative.join(entry.file_name());
        out.push(rel.clone());
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            list_paths(stage, &rel, out)?;
        }
    }
    Ok(())
}

/// `cpio -o -H newc | gzip` of the staged tree.
fn pack(stage: &Path, output: &Path) -> Result<(), String> {
    use std::io::Write;
    let mut paths = Vec::new();
    list_paths(stage, Path::new(""), &mut paths)?;
    let mut list = Vec::new();
    for path in &paths {
        list.extend_from_slice(path.as_os_str().as_encoded_bytes());
        list.push(b'\n');
    }
    let file = File::create(output).map_err(|e| format!("{}: {e}", output.display()))?;
    let mut gzip = Command::new("gzip")
        .arg("-6")
        .stdin(Stdio::piped())
        .stdout(file)
        .spawn()
        .map_err(|e| format!("could not start gzip: {e}"))?;
    let gzip_in = gzip.stdin.take().expect("piped");
    let mut cpio = Command::new("cpio")
        .args(["--quiet", "-o", "-H", "newc", "-R", "0:0"])
        .current_dir(stage)
        .stdin(Stdio::piped())
        .stdout(gzip_in)
        .spawn()
        .map_err(|e| format!("could not start cpio: {e}"))?;
    cpio.stdin
        .take()
        .expect("piped")
        .write_all(&list)
        .map_err(|e| format!("cpio: {e}"))?;
    let cpio_status = cpio.wait().map_err(|e| e.to_string())?;
    let gzip_status = gzip.wait().map_err(|e| e.to_string())?;
    if !cpio_status.success() || !gzip_status.success() {
        return Err(format!(
            "packing the initramfs failed (cpio {cpio_status}, gzip {gzip_status})"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_names_come_from_plain_and_compressed_files() {
        assert_eq!(module_name("rdma_rxe.ko"), Some("rdma_rxe".into()));
        assert_eq!(
            module_name("9pnet-virtio.ko.xz"),
            Some("9pnet_virtio".into())
        );
        assert_eq!(module_name("modules.builtin"), None);
    }

    #[test]
    fn ldd_lines_are_read() {
        let out = "\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibrdmacm.so.1 => /stage/usr/lib/x86_64-linux-gnu/librdmacm.so.1 (0x00007f)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)
\tlibfoo.so.2 => not found
\t/lib64/ld-linux-x86-64.so.2 (0x00007f)
";
        assert_eq!(
            parse_ldd(out),
            [
                LddLine::Found("/stage/usr/lib/x86_64-linux-gnu/librdmacm.so.1".into()),
                LddLine::Found("/lib/x86_64-linux-gnu/libc.so.6".into()),
                LddLine::Missing("libfoo.so.2".into()),
                LddLine::Found("/lib64/ld-linux-x86-64.so.2".into()),
            ]
        );
    }

    #[test]
    fn module_depends_come_from_modinfo() {
        let bytes =
            b"\x7fELF junk\0license=GPL\0depends=ib_uverbs,ib_core,udp-tunnel\0vermagic=6.1\0";
        assert_eq!(
            module_depends(bytes),
            ["ib_uverbs", "ib_core", "udp_tunnel"]
        );
        assert!(module_depends(b"\0depends=\0").is_empty());
    }

    #[test]
    fn of_valgrind_only_callgrind_for_x86_64_is_kept() {
        let dir = Path::new("usr/libexec/valgrind");
        assert!(!left_out(&dir.join("callgrind-amd64-linux")));
        assert!(!left_out(&dir.join("vgpreload_core-amd64-linux.so")));
        assert!(left_out(&dir.join("memcheck-amd64-linux")));
        assert!(left_out(&dir.join("callgrind-x86-linux")));
        assert!(!left_out(dir), "the folder itself");
        assert!(!left_out(Path::new("usr/bin/valgrind")));
        assert!(left_out(Path::new("usr/share/doc")));
    }

    #[test]
    fn top_level_folders_merge_into_usr() {
        assert_eq!(image_path(Path::new("sbin/ip")), Path::new("usr/sbin/ip"));
        assert_eq!(
            image_path(Path::new("lib/x86_64-linux-gnu/libc.so.6")),
            Path::new("usr/lib/x86_64-linux-gnu/libc.so.6")
        );
        assert_eq!(image_path(Path::new("etc/x")), Path::new("etc/x"));
    }
}
