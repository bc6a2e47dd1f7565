//! The names of the environment the soft-RoCE VM's `/init` (`ci/vm/init`) gives every
//! test, and of the variables xtask sets for the tests and benches: written once here,
//! read by the tests, the benches and xtask.

/// Set to `1` inside the VM.
pub const VM: &str = "CMNOTIFY_VM";
/// The listener side's address (on soft-RoCE device A).
pub const ADDR_A: &str = "CMNOTIFY_ADDR_A";
/// The connecting side's address (on soft-RoCE device B).
pub const ADDR_B: &str = "CMNOTIFY_ADDR_B";
/// Device A's name (`rxeA`).
pub const DEV_A: &str = "CMNOTIFY_DEV_A";
/// Device B's name (`rxeB`).
pub const DEV_B: &str = "CMNOTIFY_DEV_B";
/// Device A's netdev (`vethA`).
pub const NETDEV_A: &str = "CMNOTIFY_NETDEV_A";
/// Device B's netdev (`vethB`).
pub const NETDEV_B: &str = "CMNOTIFY_NETDEV_B";
/// The nft executable.
pub const NFT: &str = "CMNOTIFY_NFT";
/// The tc executable.
pub const TC: &str = "CMNOTIFY_TC";
/// The file where tests that need a device record their skips (set by xtask).
pub const SKIP_LOG: &str = "CMNOTIFY_SKIP_LOG";
/// Where the benches write their figures (set by xtask).
pub const BENCH_OUT: &str = "CMNOTIFY_BENCH_OUT";
/// `1`: the benches' quick smoke mode (set by xtask).
pub const BENCH_SMOKE: &str = "CMNOTIFY_BENCH_SMOKE";
/// How the real-device bench was built (read when it is compiled, so its figures say
/// it): `cargo xtask bench --vm` sets it.
pub const BENCH_BUILD: &str = "CMNOTIFY_BENCH_BUILD";
/// The `cmnotify` executable the million run runs (built and set by xtask).
pub const CMNOTIFY_BIN: &str = "CMNOTIFY_BIN";

/// The value of `name`, if set and valid UTF-8.
pub fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}
