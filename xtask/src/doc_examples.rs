//! cm-verbs' examples built as a user builds them: in a scratch crate whose one
//! dependency is cm-verbs. A doctest also sees the crate's own dependencies and
//! dev-dependencies (cm-core, cm-sys, cm-mock…), so an example that names `cm_core::`
//! passes `cargo test` and fails for a user with the one dependency line the README
//! promises; here it fails the check.
//!
//! The doc examples are taken out of the doc comments and Markdown the way rustdoc
//! reads them (fences, hidden `# ` lines, the `fn main` wrapper), each written as an
//! example target of the scratch crate, with the crate's own `examples/`, and checked
//! with `cargo check --examples`.

use std::path::{Path, PathBuf};

use crate::run::{cargo, status, workspace_root};

/// One code example, where it came from and its program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Example {
    /// `file:line` of its opening fence.
    pub(crate) origin: String,
    /// A whole program, as rustdoc would compile it.
    pub(crate) program: String,
}

/// The crate whose examples are checked, and what it is built with.
const CRATE: &str = "crates/cm-verbs";
const FEATURES: &str = "\"rdma\", \"tokio\", \"sim\"";

/// Builds every example of cm-verbs in a scratch crate that depends on cm-verbs alone
/// (and tokio, for an async example's `#[tokio::main]`); the summary line.
pub(crate) fn check() -> Result<String, String> {
    let root = workspace_root();
    let krate = root.join(CRATE);
    let mut examples = Vec::new();
    for file in rust_sources(&krate.join("src"))? {
        let text = read(&file)?;
        examples.extend(from_rust_source(&label(&root, &file), &text));
    }
    let readme = krate.join("README.md");
    examples.extend(from_markdown(&label(&root, &readme), &read(&readme)?));
    let own = rust_sources(&krate.join("examples"))?;

    let scratch = root.join("target/xtask/doc-examples");
    let dir = scratch.join("examples");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(scratch.join("src")).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    write(&scratch.join("Cargo.toml"), &manifest(&krate))?;
    write(&scratch.join("src/lib.rs"), "")?;
    // The workspace's versions: nothing to resolve, the same builds reused.
    std::fs::copy(root.join("Cargo.lock"), scratch.join("Cargo.lock"))
        .map_err(|e| format!("Cargo.lock: {e}"))?;
    for (n, example) in examples.iter().enumerate() {
        let body = format!("// From {}.\n{}", example.origin, example.program);
        write(&dir.join(format!("doc_{n:02}.rs")), &body)?;
    }
    for file in &own {
        let name = file.file_name().expect("a file").to_string_lossy();
        write(&dir.join(format!("own_{name}")), &read(file)?)?;
    }
    let target = root.join("target");
    status(
        cargo(&["check", "--examples", "--quiet", "--manifest-path"])
            .arg(scratch.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", target),
    )
    .map_err(|e| {
        format!(
            "{e}\nthe examples, each naming its origin, are in {}",
            dir.display()
        )
    })?;
    Ok(format!(
        "{} doc examples and {} example programs of cm-verbs build with cm-verbs as the only dependency (and tokio, the runtime an async main starts)",
        examples.len(),
        own.len()
    ))
}

fn manifest(krate: &Path) -> String {
    format!(
        "[package]\n\
         name = \"cm-verbs-doc-examples\"\n\
         version = \"0.0.0\"\n\
         edition = \"2021\"\n\
         publish = false\n\n\
         [dependencies]\n\
         cm-verbs = {{ path = \"{}\", features = [{FEATURES}] }}\n\
         # What an async application has beside it: the runtime its main starts.\n\
         tokio = {{ version = \"1\", default-features = false, features = [\"macros\", \"rt\"] }}\n\n\
         # Not a member of the project's workspace: its own root.\n\
         [workspace]\n",
        krate.display()
    )
}

/// The examples in the doc comments (`///`, `//!`) of one Rust file.
pub(crate) fn from_rust_source(file: &str, text: &str) -> Vec<Example> {
    let mut docs = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let doc = trimmed
            .strip_prefix("///")
            .filter(|rest| !rest.starts_with('/'))
            .or_else(|| trimmed.strip_prefix("//!"));
        match doc {
            Some(rest) => docs.push((index + 1, rest.strip_prefix(' ').unwrap_or(rest))),
            // A run of doc lines ends: a fence never spans two runs.
            None => docs.push((index + 1, END_OF_RUN)),
        }
    }
    examples(file, &docs)
}

/// The examples in a Markdown file.
pub(crate) fn from_markdown(file: &str, text: &str) -> Vec<Example> {
    let lines: Vec<(usize, &str)> = text.lines().enumerate().map(|(i, l)| (i + 1, l)).collect();
    examples(file, &lines)
}

/// Marks the end of a run of doc comment lines.
const END_OF_RUN: &str = "\u{0}";

fn examples(file: &str, lines: &[(usize, &str)]) -> Vec<Example> {
    let mut found = Vec::new();
    let mut open: Option<(usize, bool, Vec<&str>)> = None;
    for &(number, line) in lines {
        let fence = line.trim_start().strip_prefix("```");
        match (&mut open, fence) {
            (None, Some(info)) => open = Some((number, is_checked_rust(info), Vec::new())),
            (Some(_), Some(_)) => {
                let (start, checked, code) = open.take().expect("open");
                if checked {
                    found.push(Example {
                        origin: format!("{file}:{start}"),
                        program: program(&code),
                    });
                }
            }
            (Some(_), None) if line == END_OF_RUN => open = None,
            (Some((_, _, code)), None) => code.push(line),
            (None, None) => {}
        }
    }
    found
}

/// Whether a fence's info string makes its block a Rust example rustdoc compiles.
fn is_checked_rust(info: &str) -> bool {
    let mut rust = true;
    for token in info
        .split([',', ' '])
        .map(str::trim)
        .filter(|t| !t.is_empty())
    {
        match token {
            "rust" | "no_run" | "should_panic" | "test_harness" => {}
            "ignore" | "compile_fail" => return false,
            edition if edition.starts_with("edition") => {}
            _ => rust = false,
        }
    }
    rust
}

/// The program rustdoc makes of a block: hidden lines shown, wrapped in `fn main`
/// unless it has one (returning a `Result` when the block ends in `Ok::<…>(())`, as
/// rustdoc does).
fn program(code: &[&str]) -> String {
    let lines: Vec<String> = code.iter().map(|line| unhide(line)).collect();
    let body = lines.join("\n");
    let mut program = String::from("#![allow(unused)]\n");
    if body.contains("fn main") {
        program.push_str(&body);
    } else if lines
        .iter()
        .rev()
        .find(|l| !l.trim().is_empty())
        .is_some_and(|l| l.trim_end().ends_with("(())"))
    {
        program.push_str("fn main() -> Result<(), impl core::fmt::Debug> {\n");
        program.push_str(&body);
        program.push_str("\n}");
    } else {
        program.push_str("fn main() {\n");
        program.push_str(&body);
        program.push_str("\n}");
    }
    program.push('\n');
    program
}

/// A line of a doc example as compiled: `# code` is hidden code, `#` alone an empty
/// line, `##` an escaped `#`.
fn unhide(line: &str) -> String {
    let trimmed = line.trim_start();
    let indent = &line[..line.len() - trimmed.len()];
    if trimmed == "#" {
        String::new()
    } else if let Some(rest) = trimmed.strip_prefix("##") {
        format!("{indent}#{rest}")
    } else if let Some(rest) = trimmed.strip_prefix("# ") {
        format!("{indent}{rest}")
    } else {
        line.to_string()
    }
}

/// Every `.rs` file under `dir`, sorted.
fn rust_sources(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for entry in entries {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }
    found.sort();
    Ok(found)
}

fn label(root: &Path, file: &Path) -> String {
    file.strip_prefix(root)
        .unwrap_or(file)
        .display()
        .to_string()
}

fn read(file: &Path) -> Result<String, String> {
    std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))
}

fn write(file: &Path, text: &str) -> Result<(), String> {
    std::fs::write(file, text).map_err(|e| format!("{}: {e}", file.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doc_comment_examples_are_taken_as_rustdoc_compiles_them() {
        let source = "\
/// Text.
///
/// ```
/// # use cm_verbs::Endpoint;
/// let x = 1;
/// # Ok::<(), std::io::Error>(())
/// ```
///
/// ```text
/// not rust
/// ```
fn f() {}
//! ```no_run
//! fn main() {}
//! ```
//! ```ignore
//! broken
//! ```
";
        let found = from_rust_source("lib.rs", source);
        assert_eq!(found.len(), 2, "{found:#?}");
        assert_eq!(found[0].origin, "lib.rs:3");
        assert_eq!(
            found[0].program,
            "#![allow(unused)]\nfn main() -> Result<(), impl core::fmt::Debug> {\n\
             use cm_verbs::Endpoint;\nlet x = 1;\nOk::<(), std::io::Error>(())\n}\n"
        );
        assert_eq!(found[1].origin, "lib.rs:13");
        assert_eq!(found[1].program, "#![allow(unused)]\nfn main() {}\n");
    }

    #[test]
    fn a_fence_left_open_ends_with_its_doc_comment() {
        let source = "/// ```\n/// let a = 1;\nfn f() {}\n/// ```\n/// let b = 2;\n/// ```\n";
        let found = from_rust_source("x.rs", source);
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(found[0].program.contains("let b = 2;"));
    }

    #[test]
    fn markdown_blocks_and_hidden_lines() {
        let text = "# Title\n\n```rust,no_run\n#\n##[derive(Debug)]\nstruct S;\n```\n\n```toml\nx = 1\n```\n";
        let found = from_markdown("README.md", text);
        assert_eq!(found.len(), 1);
        assert_eq!(
            found[0].program,
            "#![allow(unused)]\nfn main() {\n\n#[derive(Debug)]\nstruct S;\n}\n"
        );
    }
}
