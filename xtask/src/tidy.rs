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

/// The Markdown files whose links and backticked paths must resolve.
fn doc_files() -> Vec<PathBuf> {
    let root = workspace_root();
    let mut docs: Vec<PathBuf> = ["README.md", "ARCHITECTURE.md", "CONTRIBUTING.md"]
        .iter()
        .map(|f| root.join(f))
        .collect();
    let markdown_in = |dir: &Path| -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|e| e == "md"))
                    .collect()
            })
            .unwrap_or_default();
        files.sort();
        files
    };
    docs.extend(markdown_in(&root.join("docs")));
    for dir in crate_dirs() {
        let readme = dir.join("README.md");
        if readme.exists() {
            docs.push(readme);
        }
    }
    docs.push(root.join("fuzz/README.md"));
    let mut under_ci = Vec::new();
    all_files(&root.join("ci"), &mut under_ci);
    under_ci.retain(|p| p.file_name().is_some_and(|n| n == "README.md"));
    under_ci.sort();
    docs.extend(under_ci);
    docs.retain(|p| p.exists());
    docs
}

/// Every file below `dir`, build outputs and `.git` left out.
fn all_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name == ".git" {
            continue;
        }
        if path.is_dir() {
            all_files(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// The lines of `text` outside fenced code blocks, with their indexes.
fn prose_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut fenced = false;
    text.lines().enumerate().filter(move |(_, line)| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// The targets of the Markdown links of `text` (inline `[text](target)` and reference
/// definitions `[label]: target`), fenced code blocks left out, with their line numbers.
fn markdown_links(text: &str) -> Vec<(usize, String)> {
    let mut links = Vec::new();
    for (i, line) in prose_lines(text) {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            links.push((i + 1, target.to_owned()));
            rest = &rest[end..];
        }
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') {
            if let Some(at) = trimmed.find("]: ") {
                let target = trimmed[at + 3..].split_whitespace().next().unwrap_or("");
                links.push((i + 1, target.to_owned()));
            }
        }
    }
    links
}

/// The inline code spans of `text` that look like relative paths (a `/`, nothing but
/// path characters), fenced code blocks left out, with their line numbers.
fn backticked_paths(text: &str) -> Vec<(usize, String)> {
    let mut paths = Vec::new();
    for (i, line) in prose_lines(text) {
        for span in line.split('`').skip(1).step_by(2) {
            let path_like = span.contains('/')
                && !span.contains("://")
                && span
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "/._-{},<>*".contains(c));
            if path_like {
                paths.push((i + 1, span.to_owned()));
            }
        }
    }
    paths
}

/// Backticked paths that are not the repository's: absolute paths (the machine's, e.g.
/// `/dev/infiniband/rdma_cm`), build outputs, the Linux source tree, the VM's share.
fn outside_the_repository(path: &str) -> bool {
    const NOT_OURS: [&str; 4] = ["/", "target/", "drivers/", "rxe/"];
    NOT_OURS.iter().any(|prefix| path.starts_with(prefix))
}

/// `a/{b,c}.rs` → `a/b.rs`, `a/c.rs` (one brace group at a time, nested ones too).
fn expand_braces(path: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (path.find('{'), path.find('}')) else {
        return vec![path.to_owned()];
    };
    if close < open {
        return vec![path.to_owned()];
    }
    let (head, tail) = (&path[..open], &path[close + 1..]);
    path[open + 1..close]
        .split(',')
        .flat_map(|alt| expand_braces(&format!("{head}{alt}{tail}")))
        .collect()
}

/// Whether a file name matches a pattern where `<placeholder>` and `*` stand for any
/// non-empty run of characters.
fn name_matches(pattern: &str, name: &str) -> bool {
    let mut pattern = pattern.to_owned();
    while let (Some(open), Some(close)) = (pattern.find('<'), pattern.find('>')) {
        if close < open {
            break;
        }
        pattern.replace_range(open..=close, "*");
    }
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || !name.ends_with(last) || name.len() <= first.len() + last.len() {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// Whether `relative` (possibly with `<placeholder>`s, `*` or `..`) names an existing file
/// or directory below `base` that lies inside the repository.
fn resolves_inside(root: &Path, base: &Path, relative: &str) -> bool {
    let mut candidates = vec![base.to_path_buf()];
    for part in relative.split('/').filter(|p| !p.is_empty() && *p != ".") {
        candidates = candidates
            .into_iter()
            .flat_map(|dir| {
                if part == ".." {
                    return dir.parent().map(Path::to_path_buf).into_iter().collect();
                }
                if !part.contains(['<', '*']) {
                    return vec![dir.join(part)];
                }
                std::fs::read_dir(&dir)
                    .map(|entries| {
                        entries
                            .flatten()
                            .filter(|e| name_matches(part, &e.file_name().to_string_lossy()))
                            .map(|e| e.path())
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect();
    }
    let Ok(root) = root.canonicalize() else {
        return false;
    };
    candidates
        .iter()
        .filter_map(|c| c.canonicalize().ok())
        .any(|c| c.starts_with(&root))
}

#[test]
fn doc_links_and_paths_resolve_inside_the_repository() {
    let root = workspace_root();
    let docs = doc_files();
    assert!(docs.len() > 5, "the docs were not found: {docs:?}");
    let mut broken = Vec::new();
    for doc in &docs {
        let text = read(doc);
        let dir = doc.parent().expect("a file has a folder");
        let shown = doc.strip_prefix(&root).unwrap_or(doc).display().to_string();
        for (line, target) in markdown_links(&text) {
            if target.is_empty()
                || target.starts_with('#')
                || target.contains("://")
                || target.starts_with("mailto:")
            {
                continue;
            }
            let path = target.split('#').next().unwrap_or_default();
            if !resolves_inside(&root, dir, path) {
                broken.push(format!("{shown}:{line}: link ({target})"));
            }
        }
        for (line, path) in backticked_paths(&text) {
            if outside_the_repository(&path) {
                continue;
            }
            // A path is the repository's (from its root) or the document's folder's.
            for expanded in expand_braces(&path) {
                if !resolves_inside(&root, &root, &expanded)
                    && !resolves_inside(&root, dir, &expanded)
                {
                    broken.push(format!("{shown}:{line}: `{expanded}`"));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links or paths that name nothing in the repository:\n{}",
        broken.join("\n")
    );
}

#[test]
fn no_reference_to_documents_outside_the_repository() {
    let root = workspace_root();
    let mut files = Vec::new();
    all_files(&root, &mut files);
    // Spelled in pieces so that this file does not match itself.
    let outside = [["shared", "/spec"].concat(), ["softroce", "-vm"].concat()];
    let ours = ["notify-semantics", ".md"].concat();
    let ours_in_place = ["docs/", &ours].concat();
    let mut offenders = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue; // not text
        };
        let shown = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .display()
            .to_string();
        for (i, line) in text.lines().enumerate() {
            for needle in &outside {
                if line.contains(needle.as_str()) {
                    offenders.push(format!("{shown}:{}: mentions {needle}", i + 1));
                }
            }
            let mut rest = line;
            while let Some(at) = rest.find(&ours) {
                let before = &line[..line.len() - rest.len() + at];
                if !before.ends_with("docs/") {
                    offenders.push(format!(
                        "{shown}:{}: {ours} not as {ours_in_place} (a link from docs/ too: \
                         ../{ours_in_place})",
                        i + 1
                    ));
                }
                rest = &rest[at + ours.len()..];
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "references to documents outside the repository:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_path_helpers_work() {
    assert_eq!(
        expand_braces("crates/cm-core/src/{event,error}.rs"),
        ["crates/cm-core/src/event.rs", "crates/cm-core/src/error.rs"]
    );
    assert!(name_matches("<kernel>.patch", "6.1.patch"));
    assert!(name_matches("*.txt", "6.12.txt"));
    assert!(!name_matches("<kernel>.patch", ".patch"));
    assert!(!name_matches("<kernel>.txt", "6.1.patch"));
    let root = workspace_root();
    assert!(resolves_inside(
        &root,
        &root,
        "ci/vm/rxe-comm-est/<kernel>.patch"
    ));
    assert!(resolves_inside(&root, &root.join("docs"), "../README.md"));
    assert!(!resolves_inside(&root, &root, "docs/no-such-file.md"));
    assert!(!resolves_inside(&root, &root.join("docs"), "../.."));
    assert_eq!(
        backticked_paths("see `a/b.rs`, `cargo xtask ci` and `x`"),
        [(1, "a/b.rs".to_owned())]
    );
    assert_eq!(
        markdown_links("[a](b.md#c) [d](https://e)\n[f]: g/h.md"),
        [
            (1, "b.md#c".to_owned()),
            (1, "https://e".to_owned()),
            (2, "g/h.md".to_owned())
        ]
    );
}

#[test]
fn the_endpoint_proptest_replays_every_committed_seed() {
    let root = workspace_root();
    let test = read(&root.join("crates/cm-verbs/tests/endpoint_proptest.rs"));
    let corpus = root.join("fuzz/corpus/endpoint_ops");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&corpus).expect("the endpoint_ops corpus") {
        let name = entry.expect("a directory entry").file_name();
        let name = name.to_string_lossy();
        if !test.contains(&format!("fuzz/corpus/endpoint_ops/{name}\")")) {
            missing.push(name.into_owned());
        }
    }
    assert!(
        missing.is_empty(),
        "seeds of fuzz/corpus/endpoint_ops not in SEEDS of endpoint_proptest.rs: {missing:?}"
    );
}

/// Users depend on cm-verbs alone (it re-exports cm-core as `cm_verbs::core` and cm-sys
/// as `cm_verbs::sys`): its doc examples must compile with that one dependency line.
#[test]
fn cm_verbs_doc_examples_name_only_cm_verbs_paths() {
    let mut files = Vec::new();
    rust_files(&workspace_root().join("crates/cm-verbs/src"), &mut files);
    let mut found = Vec::new();
    for file in &files {
        for (number, line) in read(file).lines().enumerate() {
            let doc = line.trim_start();
            let is_doc = doc.starts_with("//!") || doc.starts_with("///");
            if is_doc && (doc.contains("cm_core::") || doc.contains("cm_sys::")) {
                found.push(format!("{}:{}: {doc}", file.display(), number + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "doc examples naming cm_core/cm_sys: {found:#?}"
    );
}

/// The VM builds only cm-verbs' integration tests that its manifest names (the others
/// run on the simulated fabric, on the host): every test that reads the device
/// addresses must be among them, and every name must be a test.
#[test]
fn every_cm_verbs_device_test_runs_in_the_vm() {
    use crate::vm::payload::{parse_manifest, Item, MANIFEST};
    let root = workspace_root();
    let items = parse_manifest(&read(&root.join(MANIFEST))).expect("the VM manifest");
    let listed: Vec<String> = items
        .into_iter()
        .filter_map(|item| match item {
            Item::CargoTest {
                package,
                tests,
                label: None,
                tsan: false,
                ..
            } if package == "cm-verbs" => Some(tests),
            _ => None,
        })
        .flatten()
        .collect();
    let dir = root.join("crates/cm-verbs/tests");
    let mut uses_a_device = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("cm-verbs tests") {
        let path = entry.expect("a directory entry").path();
        let Some(name) = path.file_stem().map(|s| s.to_string_lossy().into_owned()) else {
            continue;
        };
        if path.extension().is_some_and(|e| e == "rs") && read(&path).contains("addresses(") {
            uses_a_device.push(name);
        }
    }
    let missing: Vec<_> = uses_a_device
        .iter()
        .filter(|n| !listed.contains(n))
        .collect();
    assert!(
        missing.is_empty(),
        "cm-verbs tests that use a device but are not built for the VM ({MANIFEST}): {missing:?}"
    );
    let unknown: Vec<_> = listed
        .iter()
        .filter(|n| !dir.join(format!("{n}.rs")).is_file())
        .collect();
    assert!(
        unknown.is_empty(),
        "{MANIFEST} names no such cm-verbs test: {unknown:?}"
    );
}
