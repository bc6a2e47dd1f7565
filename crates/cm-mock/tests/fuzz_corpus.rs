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

#[allow(unreachable_pub, dead_code)]
#[path = "../../../fuzz/src/corpus.rs"]
mod corpus;

use std::path::Path;

use cm_mock::sim::SplitMix64;
use corpus::{replay, Body};

const TARGETS: [(&str, Body); 5] = [
    ("async_event", decode_checks::async_event),
    ("cm_event", decode_checks::cm_event),
    ("errno_mapping", decode_checks::errno_mapping),
    ("event_numbers", decode_checks::event_numbers),
    ("sim_ops", sim_ops::run),
];

#[test]
fn committed_seed_corpus_replays_without_a_finding() {
    let fuzz_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let total: usize = TARGETS
        .iter()
        .map(|(target, body)| corpus::replay_corpus(&fuzz_dir, target, *body))
        .sum();
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
