//! Keeps docs and style honest, in the spirit of rust-analyzer's `tidy`: runs as part
//! of `cargo test -p xtask` (and so of `cargo xtask ci`).

#![cfg(test)]

use std::path::{Path, PathBuf};

use crate::run::workspace_root;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn crate_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(workspace_root().join("crates"))
        .expect("crates/ exists")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").exists())
        .collect();
    dirs.sort();
    dirs
}

#[test]
fn unsafe_code_lives_only_in_cm_sys() {
    let root = workspace_root();
    let mut files = Vec::new();
    for top in ["crates", "xtask", "benches"] {
        rust_files(&root.join(top), &mut files);
    }
    let offenders: Vec<String> = files
        .iter()
        .filter(|f| !f.starts_with(root.join("crates/cm-sys")))
        .filter(|f| !f.ends_with("tidy.rs"))
        .filter(|f| {
            read(f).lines().any(|l| {
                l.contains("unsafe {") || l.contains("unsafe fn") || l.contains("unsafe impl")
            })
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(offenders.is_empty(), "unsafe outside cm-sys: {offenders:?}");
}

#[test]
fn every_unsafe_block_in_cm_sys_says_why() {
    let mut files = Vec::new();
    rust_files(&workspace_root().join("crates/cm-sys"), &mut files);
    for file in files {
        let text = read(&file);
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            if !line.contains("unsafe {") || line.trim_start().starts_with("//") {
                continue;
            }
            let window = &lines[i.saturating_sub(6)..=i];
            assert!(
                window.iter().any(|l| l.contains("SAFETY:")),
                "{}:{}: unsafe block without a `// SAFETY:` comment",
                file.display(),
                i + 1
            );
        }
    }
}

#[test]
fn every_library_crate_is_ready_for_crates_io() {
    for dir in crate_dirs() {
        let manifest = read(&dir.join("Cargo.toml"));
        if manifest.contains("publish = false") {
            continue;
        }
        for key in [
            "description",
            "license",
            "repository",
            "readme",
            "documentation",
        ] {
            assert!(
                manifest.lines().any(|l| l.trim_start().starts_with(key)),
                "{}: no `{key}` in Cargo.toml",
                dir.display()
            );
        }
        assert!(
            dir.join("README.md").exists(),
            "{}: no README.md",
            dir.display()
        );
        let lib = dir.join("src/lib.rs");
        if lib.exists() {
            assert!(
                read(&lib).contains("```"),
                "{}: the crate docs have no example",
                lib.display()
            );
        }
    }
}

#[test]
fn top_level_docs_name_every_crate_and_the_commands() {
    let root = workspace_root();
    let readme = read(&root.join("README.md"));
    let architecture = read(&root.join("ARCHITECTURE.md"));
    for dir in crate_dirs() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        assert!(readme.contains(&name), "README.md does not mention {name}");
        assert!(
            architecture.contains(&name),
            "ARCHITECTURE.md does not mention {name}"
        );
    }
    assert!(
        readme.contains("cargo xtask ci"),
        "README.md lost the test command"
    );
    assert!(
        readme.contains("cmnotify"),
        "README.md lost the demo command"
    );
    assert!(
        readme.contains("ibverbs"),
        "README.md should say why the ibverbs crate is not used"
    );
    let ci = read(&root.join(".ci/run"));
    assert!(
        ci.contains("cargo xtask ci"),
        ".ci/run must run the README's test command"
    );
    assert!(root.join("CONTRIBUTING.md").exists());
}

#[test]
fn no_stubs_or_unexplained_ignores() {
    let root = workspace_root();
    let mut files = Vec::new();
    for top in ["crates", "xtask", "benches"] {
        rust_files(&root.join(top), &mut files);
    }
    let stub = ["todo", "!("].concat();
    let unimpl = ["unimplemented", "!("].concat();
    let ignore = ["#[ig", "nore]"].concat();
    for file in files {
        let text = read(&file);
        for (i, line) in text.lines().enumerate() {
            assert!(
                !line.contains(&stub) && !line.contains(&unimpl),
                "{}:{}: stub left in the code",
                file.display(),
                i + 1
            );
            assert!(
                !line.contains(&ignore),
                "{}:{}: an ignored test needs a reason string (ignore = \"why\")",
                file.display(),
                i + 1
            );
        }
    }
}
