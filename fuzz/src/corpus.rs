//! Replaying a target's committed seed corpus (`corpus/<target>/`) as an ordinary test
//! on the stable toolchain: the workspace's tests that run the target bodies include
//! this file, so that a failure names its input the same way everywhere.

use std::path::{Path, PathBuf};

/// A target's body: a plain function of the input bytes.
pub type Body = fn(&[u8]);

/// Runs `body` on `data`, naming the input (and its bytes) when it panics.
pub fn replay(target: &str, name: &str, data: &[u8], body: Body) {
    let result = std::panic::catch_unwind(|| body(data));
    if let Err(panic) = result {
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("non-string panic");
        panic!(
            "{target}: input {name} ({} bytes: {data:02x?}) failed: {message}",
            data.len()
        );
    }
}

/// Replays every file of `fuzz_dir/corpus/<target>/`, in name order; how many there
/// were. An empty or missing corpus is a failure.
pub fn replay_corpus(fuzz_dir: &Path, target: &str, body: Body) -> usize {
    let dir = fuzz_dir.join("corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{target}: the seed corpus is empty");
    for file in &files {
        let data = std::fs::read(file).expect("a readable corpus file");
        let name = file.file_name().expect("a file name").to_string_lossy();
        replay(target, &name, &data, body);
    }
    files.len()
}
