//! The fuzz targets' bodies (fuzz/src) as ordinary tests on the stable toolchain: every
//! file of the committed seed corpus (fuzz/corpus/<target>/), then a batch of
//! pseudo-random inputs per target. A failure here is a fuzz finding: save the input
//! under fuzz/corpus/<target>/ as its regression test.

#[allow(unreachable_pub, dead_code)]
#[path = "../../../fuzz/src/decode_checks.rs"]
mod decode_checks;
#[allow(unreachable_pub, dead_code)]
#[path = "../../../fuzz/src/input.rs"]
mod input;
#[allow(unreachable_pub, dead_code)]
#[path = "../../../fuzz/src/sim_ops.rs"]
mod sim_ops;

use std::path::{Path, PathBuf};

use cm_mock::sim::SplitMix64;

type Body = fn(&[u8]);

const TARGETS: [(&str, Body); 5] = [
    ("async_event", decode_checks::async_event),
    ("cm_event", decode_checks::cm_event),
    ("errno_mapping", decode_checks::errno_mapping),
    ("event_numbers", decode_checks::event_numbers),
    ("sim_ops", sim_ops::run),
];

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

/// Runs `body` on `data`, naming the input when it panics.
fn replay(target: &str, name: &str, data: &[u8], body: Body) {
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

#[test]
fn committed_seed_corpus_replays_without_a_finding() {
    let mut total = 0;
    for (target, body) in TARGETS {
        let dir = corpus_dir(target);
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
        total += files.len();
    }
    eprintln!("replayed {total} corpus inputs");
}

#[test]
fn pseudo_random_inputs_hold_every_target_contract() {
    let cases: u64 = std::env::var("FUZZ_REPLAY_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    for (target, body) in TARGETS {
        let mut rng = SplitMix64::new(0x5eed ^ target.len() as u64);
        for case in 0..cases {
            let len = rng.up_to(512) as usize;
            let data: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            replay(target, &format!("random #{case}"), &data, body);
        }
    }
}

#[test]
fn empty_and_extreme_inputs_are_fine() {
    for (target, body) in TARGETS {
        replay(target, "empty", &[], body);
        replay(target, "all-ones", &[0xff; 64], body);
        replay(target, "zeroes", &[0; 64], body);
    }
}
