//! The connection handles under random plans on the simulated fabric (see
//! fuzz/src/handle_ops.rs, the `handle_ops` fuzz target's body, for the plans and what
//! is checked): nothing is lost, whatever the interleaving of the clients', the
//! server's and the drivers' tasks. Its committed seed corpus replays here too.
#![cfg(all(feature = "tokio", feature = "sim"))]

#[allow(unreachable_pub, dead_code)]
#[path = "../../../fuzz/src/corpus.rs"]
mod corpus;
#[allow(unreachable_pub)]
#[path = "../../../fuzz/src/handle_ops.rs"]
mod handle_ops;
#[allow(unreachable_pub, dead_code)]
#[path = "../../../fuzz/src/input.rs"]
mod input;

use proptest::prelude::*;

proptest! {
    // 128 cases unless PROPTEST_CASES says otherwise (e.g. a long soak run).
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Nine bytes of set-up and seed, then a byte per client: shrinking drops clients.
    #[test]
    fn handles_lose_nothing_whatever_the_plan(data in prop::collection::vec(any::<u8>(), 9..15)) {
        handle_ops::run(&data);
    }
}

/// The committed seed corpus of the `handle_ops` fuzz target replays without a finding.
#[test]
fn committed_seed_corpus_replays_without_a_finding() {
    let fuzz_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let replayed = corpus::replay_corpus(&fuzz_dir, "handle_ops", handle_ops::run);
    assert!(replayed >= 4, "{replayed} seeds");
}
