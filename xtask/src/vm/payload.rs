//! The payload: what runs inside the VM, read from `ci/vm/payload.txt`, built on the host
//! and laid out in the folder shared read-only into the VM.
//!
//! Share layout: `bin/` (test executables and binaries; on PATH inside), `entries/N.sh`
//! (one busybox `sh` script per entry) and `entries.list` (`<timeout> <script> <name>`),
//! which `ci/vm/init` runs in order.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::run::{cargo, status, workspace_root};
use crate::vm::console::TEST_ENTRY_PREFIX;

/// The manifest, relative to the workspace root.
pub(crate) const MANIFEST: &str = "ci/vm/payload.txt";
/// Timeout of an `exec` entry without `timeout=`.
const EXEC_TIMEOUT_SECS: u64 = 120;
/// Timeout of one test executable.
const TEST_TIMEOUT_SECS: u64 = 300;

/// One manifest line.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Item {
    /// Every test executable of a package, or only those named by `test=` (and `lib`).
    CargoTest {
        /// Package name.
        package: String,
        /// Value for `--features`, if any.
        features: Option<String>,
        /// Timeout of each of its test executables.
        timeout_secs: u64,
        /// Only these integration test targets (`cargo test --test NAME` for each), and
        /// the library's unit tests when `lib` is set; every test target when both are
        /// empty.
        tests: Vec<String>,
        /// The library's unit tests (`cargo test --lib`), beside `tests`.
        lib: bool,
        /// Appended to the entry names (`label=NAME`), to tell apart a second run of
        /// the same executable (e.g. on another device).
        label: Option<String>,
        /// Built with ThreadSanitizer (`tsan`: the nightly toolchain, `-Zsanitizer=thread`
        /// with a rebuilt standard library) and run with any report failing the test.
        tsan: bool,
    },
    /// A named binary, put on PATH inside.
    CargoBin {
        /// Package name.
        package: String,
        /// Binary (or example) name.
        binary: String,
        /// An example of the package (`cargo-example`), not one of its binaries.
        example: bool,
        /// Value for `--features`, if any.
        features: Option<String>,
    },
    /// A shell command run inside.
    Exec {
        /// Entry name.
        name: String,
        /// Per-entry timeout.
        timeout_secs: u64,
        /// busybox `sh` text.
        command: String,
    },
}

/// Parses the manifest text (see the header of `ci/vm/payload.txt`).
pub(crate) fn parse_manifest(text: &str) -> Result<Vec<Item>, String> {
    let mut logical = Vec::new();
    let mut pending = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if pending.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            // The backslash stays: busybox sh joins the lines itself.
            Some(_) => {
                pending.push_str(trimmed);
                pending.push('\n');
            }
            None => {
                pending.push_str(trimmed);
                logical.push(std::mem::take(&mut pending));
            }
        }
    }
    if !pending.is_empty() {
        return Err(format!("{MANIFEST}: the last line ends in `\\`"));
    }
    logical.iter().map(|l| parse_item(l)).collect()
}

fn parse_item(line: &str) -> Result<Item, String> {
    let (kind, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
    let words: Vec<&str> = rest.split_whitespace().collect();
    let bad = || format!("{MANIFEST}: cannot read `{line}`");
    match kind {
        "cargo-test" => {
            let mut timeout_secs = TEST_TIMEOUT_SECS;
            let mut tests = Vec::new();
            let mut lib = false;
            let mut label = None;
            let mut tsan = false;
            let mut rest = Vec::new();
            for word in words {
                if word == "tsan" {
                    tsan = true;
                } else if word == "lib" {
                    lib = true;
                } else if word == "\\" {
                    // A line continuation, kept by the manifest reader for `exec`.
                } else if let Some(secs) = word.strip_prefix("timeout=") {
                    timeout_secs = secs.parse().map_err(|_| bad())?;
                } else if let Some(names) = word.strip_prefix("test=") {
                    for name in names.split(',') {
                        if name.is_empty() {
                            return Err(bad());
                        }
                        tests.push(name.to_string());
                    }
                } else if let Some(name) = word.strip_prefix("label=") {
                    label = Some(name.to_string()).filter(|n| !n.is_empty());
                    label.as_ref().ok_or_else(bad)?;
                } else {
                    rest.push(word);
                }
            }
            let (package, features) = match rest.as_slice() {
                [package] => (package, None),
                [package, features] => (package, Some(features.to_string())),
                _ => return Err(bad()),
            };
            Ok(Item::CargoTest {
                package: package.to_string(),
                features,
                timeout_secs,
                tests,
                lib,
                label,
                tsan,
            })
        }
        "cargo-bin" | "cargo-example" => {
            let example = kind == "cargo-example";
            match words.as_slice() {
                [package, binary] => Ok(Item::CargoBin {
                    package: package.to_string(),
                    binary: binary.to_string(),
                    example,
                    features: None,
                }),
                [package, binary, features] => Ok(Item::CargoBin {
                    package: package.to_string(),
                    binary: binary.to_string(),
                    example,
                    features: Some(features.to_string()),
                }),
                _ => Err(bad()),
            }
        }
        "exec" => {
            let rest = rest.trim_start();
            let (name, mut command) = rest.split_once(char::is_whitespace).ok_or_else(bad)?;
            command = skip_blank(command);
            let mut timeout_secs = EXEC_TIMEOUT_SECS;
            if let Some(after) = command.strip_prefix("timeout=") {
                let (secs, tail) = after.split_once(char::is_whitespace).ok_or_else(bad)?;
                timeout_secs = secs.parse().map_err(|_| bad())?;
                command = skip_blank(tail);
            }
            if name.contains(char::is_whitespace) || command.is_empty() {
                return Err(bad());
            }
            Ok(Item::Exec {
                name: name.to_string(),
                timeout_secs,
                command: command.to_string(),
            })
        }
        _ => Err(bad()),
    }
}

/// Skips whitespace and line continuations (a backslash before a newline).
fn skip_blank(mut text: &str) -> &str {
    loop {
        text = text.trim_start();
        match text.strip_prefix("\\\n") {
            Some(rest) => text = rest,
            None => return text,
        }
    }
}

/// The built payload.
pub(crate) struct Payload {
    /// Entry names in run order.
    pub(crate) entries: Vec<String>,
    /// Packages whose tests must really run in the VM.
    pub(crate) test_packages: Vec<String>,
    /// Host executables copied into the share (their libraries go into the image).
    pub(crate) executables: Vec<PathBuf>,
    /// Sum of the entries' timeouts.
    pub(crate) total_timeout_secs: u64,
}

/// Builds everything the manifest at `path` names and lays out `share`.
pub(crate) fn build(path: &Path, share: &Path) -> Result<Payload, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let items = parse_manifest(&text)?;
    if share.exists() {
        std::fs::remove_dir_all(share).map_err(|e| format!("{}: {e}", share.display()))?;
    }
    let bin = share.join("bin");
    let scripts = share.join("entries");
    for dir in [&bin, &scripts] {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    const DEVICES_ENV: &str = "/tmp/rdma-devices.env";
    let mut payload = Payload {
        entries: Vec::new(),
        test_packages: Vec::new(),
        executables: Vec::new(),
        total_timeout_secs: 0,
    };
    let mut list = String::new();
    let mut add_entry = |payload: &mut Payload, name: String, secs: u64, script: String| {
        let file = format!("{}.sh", payload.entries.len());
        list.push_str(&format!("{secs} {file} {name}\n"));
        payload.entries.push(name);
        payload.total_timeout_secs += secs;
        // The devices an earlier entry moved (`rdma-devices`) are this entry's too.
        let script = format!("[ -r {DEVICES_ENV} ] && . {DEVICES_ENV}\n{script}");
        std::fs::write(scripts.join(&file), script).map_err(|e| e.to_string())
    };
    for item in items {
        match item {
            Item::CargoTest {
                package,
                features,
                timeout_secs,
                tests,
                lib,
                label,
                tsan,
            } => {
                let mut args = vec!["test", "--no-run", "--message-format=json", "-p", &package];
                if let Some(f) = &features {
                    args.extend(["--features", f]);
                }
                if lib {
                    args.push("--lib");
                }
                for name in &tests {
                    args.extend(["--test", name]);
                }
                if tsan {
                    args.extend(["-Zbuild-std", "--target", TSAN_TARGET]);
                }
                // Only test harnesses: `cargo test` also builds the package's examples and
                // binaries, which are not tests and expect arguments of their own.
                let executables = if tsan {
                    tsan_prerequisites()?;
                    test_executables(&run_json(&mut tsan_cargo(&args))?)
                } else {
                    cargo_test_executables(&args)?
                };
                if executables.is_empty() {
                    return Err(format!(
                        "`cargo test -p {package}` built no test executable"
                    ));
                }
                for exe in executables {
                    let file = copy_into(&exe, &bin, None)?;
                    payload.executables.push(exe);
                    // Any ThreadSanitizer report fails the test (exit 66).
                    let env = if tsan {
                        "TSAN_OPTIONS=halt_on_error=1 "
                    } else {
                        ""
                    };
                    let script = format!("{env}exec /mnt/host/bin/{file} --test-threads=1\n");
                    let suffix = label.as_ref().map_or(String::new(), |l| format!(" {l}"));
                    add_entry(
                        &mut payload,
                        format!("{TEST_ENTRY_PREFIX}{package} {file}{suffix}"),
                        timeout_secs,
                        script,
                    )?;
                }
                payload.test_packages.push(package);
            }
            Item::CargoBin {
                package,
                binary,
                example,
                features,
            } => {
                let mut args = vec![
                    "build",
                    "--message-format=json",
                    "-p",
                    &package,
                    if example { "--example" } else { "--bin" },
                    &binary,
                ];
                if let Some(f) = &features {
                    args.extend(["--features", f]);
                }
                let exe = cargo_executables(&args)?
                    .pop()
                    .ok_or_else(|| format!("`cargo build --bin {binary}` built no executable"))?;
                copy_into(&exe, &bin, Some(&binary))?;
                payload.executables.push(exe);
            }
            Item::Exec {
                name,
                timeout_secs,
                command,
            } => add_entry(&mut payload, name, timeout_secs, format!("{command}\n"))?,
        }
    }
    std::fs::write(share.join("entries.list"), list).map_err(|e| e.to_string())?;
    Ok(payload)
}

fn copy_into(exe: &Path, bin: &Path, name: Option<&str>) -> Result<String, String> {
    let file = match name {
        Some(name) => name.to_string(),
        None => exe
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or("executable without a name")?
            .to_string(),
    };
    std::fs::copy(exe, bin.join(&file)).map_err(|e| format!("{}: {e}", exe.display()))?;
    Ok(file)
}

/// Runs a cargo build with `--message-format=json` and returns every executable it made.
fn cargo_executables(args: &[&str]) -> Result<Vec<PathBuf>, String> {
    cargo_json(args).map(|json| executables(&json))
}

/// As [`cargo_executables`], keeping only test harnesses (`"test":true` profiles).
fn cargo_test_executables(args: &[&str]) -> Result<Vec<PathBuf>, String> {
    cargo_json(args).map(|json| test_executables(&json))
}

/// Runs cargo with `args` (which ask for `--message-format=json`) and returns its
/// messages, one per line.
fn cargo_json(args: &[&str]) -> Result<String, String> {
    println!("vm: cargo {}", args.join(" "));
    run_json(&mut cargo(args))
}

/// The target triple ThreadSanitizer builds name (`-Zbuild-std` needs one).
const TSAN_TARGET: &str = "x86_64-unknown-linux-gnu";

/// `cargo` on the nightly toolchain with ThreadSanitizer, in a target directory of its
/// own (`<target>/tsan`) so that the ordinary builds stay as they are.
fn tsan_cargo(args: &[&str]) -> Command {
    println!(
        "vm: RUSTFLAGS=-Zsanitizer=thread cargo +nightly {}",
        args.join(" ")
    );
    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", "cargo"])
        .args(args)
        .current_dir(workspace_root())
        .env("RUSTFLAGS", "-Zsanitizer=thread")
        .env("CARGO_TARGET_DIR", crate::vm::target_dir().join("tsan"))
        .env_remove("CARGO")
        .env_remove("RUSTC")
        .env_remove("RUSTDOC")
        .env_remove("RUSTUP_TOOLCHAIN");
    cmd
}

/// The nightly toolchain and its standard library's source, which `-Zbuild-std` needs;
/// the source component is added when missing (it comes from the toolchain's own
/// distribution, like the toolchain).
fn tsan_prerequisites() -> Result<(), String> {
    let installed = Command::new("rustup")
        .args(["component", "list", "--toolchain", "nightly", "--installed"])
        .output()
        .map_err(|e| format!("ThreadSanitizer build: cannot run rustup: {e}"))?;
    if !installed.status.success() {
        return Err(
            "ThreadSanitizer build: no nightly toolchain (rustup toolchain install nightly)".into(),
        );
    }
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|l| l.trim() == "rust-src")
    {
        return Ok(());
    }
    status(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))
        .map_err(|e| format!("ThreadSanitizer build needs nightly's rust-src: {e}"))
}

/// Runs `cmd` and returns its standard output (cargo's JSON messages).
fn run_json(cmd: &mut Command) -> Result<String, String> {
    let shown = format!("{cmd:?}");
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("could not start {shown}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{shown} failed ({})", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The executables of cargo's JSON messages built as tests (`"test":true`).
pub(crate) fn test_executables(json_lines: &str) -> Vec<PathBuf> {
    let tests: String = json_lines
        .lines()
        .filter(|line| line.contains("\"test\":true"))
        .map(|line| format!("{line}\n"))
        .collect();
    executables(&tests)
}

/// The `"executable"` fields of cargo's JSON messages (one message per line).
pub(crate) fn executables(json_lines: &str) -> Vec<PathBuf> {
    const KEY: &str = "\"executable\":";
    json_lines
        .lines()
        .filter_map(|line| {
            let value = line[line.find(KEY)? + KEY.len()..].trim_start();
            json_string(value.strip_prefix('"')?).map(PathBuf::from)
        })
        .collect()
}

/// Decodes a JSON string body up to its closing quote.
fn json_string(body: &str) -> Option<String> {
    let mut out = String::new();
    let mut chars = body.chars();
    loop {
        match chars.next()? {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                'b' => out.push('\u{8}'),
                'f' => out.push('\u{c}'),
                'u' => {
                    let hex: String = chars.by_ref().take(4).collect();
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                }
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::workspace_root;

    #[test]
    fn manifest_lines_and_continuations_are_read() {
        let text = "\
# comment
cargo-test cm-sys
cargo-test cm-verbs real-device,extra timeout=90
cargo-test cm-sys test=notify_overhead
cargo-test cm-sys test=conformance_real label=comm-est
cargo-test cm-sys test=fields_race tsan label=tsan
cargo-test cm-verbs rdma lib test=a_rdma,b_rdma \\
  timeout=60
cargo-bin cm-sys notify-peer
cargo-example cm-verbs server rdma
exec ibv-devices ibv_devices
exec rping timeout=30 \\
  rping -s & \\
  rping -c
";
        let items = parse_manifest(text).expect("valid manifest");
        assert_eq!(
            items,
            [
                Item::CargoTest {
                    package: "cm-sys".into(),
                    features: None,
                    timeout_secs: TEST_TIMEOUT_SECS,
                    tests: Vec::new(),
                    lib: false,
                    label: None,
                    tsan: false,
                },
                Item::CargoTest {
                    package: "cm-verbs".into(),
                    features: Some("real-device,extra".into()),
                    timeout_secs: 90,
                    tests: Vec::new(),
                    lib: false,
                    label: None,
                    tsan: false,
                },
                Item::CargoTest {
                    package: "cm-sys".into(),
                    features: None,
                    timeout_secs: TEST_TIMEOUT_SECS,
                    tests: vec!["notify_overhead".into()],
                    lib: false,
                    label: None,
                    tsan: false,
                },
                Item::CargoTest {
                    package: "cm-sys".into(),
                    features: None,
                    timeout_secs: TEST_TIMEOUT_SECS,
                    tests: vec!["conformance_real".into()],
                    lib: false,
                    label: Some("comm-est".into()),
                    tsan: false,
                },
                Item::CargoTest {
                    package: "cm-sys".into(),
                    features: None,
                    timeout_secs: TEST_TIMEOUT_SECS,
                    tests: vec!["fields_race".into()],
                    lib: false,
                    label: Some("tsan".into()),
                    tsan: true,
                },
                Item::CargoTest {
                    package: "cm-verbs".into(),
                    features: Some("rdma".into()),
                    timeout_secs: 60,
                    tests: vec!["a_rdma".into(), "b_rdma".into()],
                    lib: true,
                    label: None,
                    tsan: false,
                },
                Item::CargoBin {
                    package: "cm-sys".into(),
                    binary: "notify-peer".into(),
                    example: false,
                    features: None
                },
                Item::CargoBin {
                    package: "cm-verbs".into(),
                    binary: "server".into(),
                    example: true,
                    features: Some("rdma".into())
                },
                Item::Exec {
                    name: "ibv-devices".into(),
                    timeout_secs: EXEC_TIMEOUT_SECS,
                    command: "ibv_devices".into()
                },
                Item::Exec {
                    name: "rping".into(),
                    timeout_secs: 30,
                    command: "rping -s & \\\nrping -c".into()
                },
            ]
        );
    }

    #[test]
    fn bad_manifest_lines_are_errors() {
        assert!(parse_manifest("frobnicate x").is_err());
        assert!(parse_manifest("exec lonely").is_err());
        assert!(parse_manifest("exec a timeout=soon b").is_err());
        assert!(parse_manifest("exec a b \\").is_err());
        assert!(parse_manifest("cargo-test a b c").is_err());
        assert!(parse_manifest("cargo-test a timeout=").is_err());
        assert!(parse_manifest("cargo-test a test=").is_err());
        assert!(parse_manifest("cargo-test a test=b,,c").is_err());
        assert!(parse_manifest("cargo-test a label=").is_err());
    }

    #[test]
    fn the_project_manifest_parses() {
        let text = std::fs::read_to_string(workspace_root().join(MANIFEST)).expect("manifest");
        let items = parse_manifest(&text).expect("valid manifest");
        assert!(items
            .iter()
            .any(|i| matches!(i, Item::Exec { name, .. } if name == "rping-veth")));
    }

    #[test]
    fn executables_come_from_cargo_json() {
        let json = r#"{"reason":"compiler-artifact","target":{"kind":["lib"]},"executable":null,"fresh":true}
{"reason":"compiler-artifact","profile":{"test":true},"executable":"/t/debug/deps/cm_sys-ab12","fresh":false}
{"reason":"compiler-artifact","executable":"/odd \"dir\"/x","fresh":false}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            executables(json),
            [
                PathBuf::from("/t/debug/deps/cm_sys-ab12"),
                PathBuf::from("/odd \"dir\"/x")
            ]
        );
    }

    #[test]
    fn only_test_harnesses_count_as_tests() {
        let json = r#"{"reason":"compiler-artifact","profile":{"test":true},"executable":"/t/deps/endpoint_rdma-1","fresh":false}
{"reason":"compiler-artifact","profile":{"test":false},"executable":"/t/examples/server","fresh":false}
{"reason":"compiler-artifact","profile":{"test":false},"executable":"/t/cmnotify","fresh":false}"#;
        assert_eq!(
            test_executables(json),
            [PathBuf::from("/t/deps/endpoint_rdma-1")]
        );
    }
}
