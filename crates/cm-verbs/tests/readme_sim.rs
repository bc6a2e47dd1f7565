//! The README's unit test of a server on the simulated fabric
//! (`examples/sim_server_test.rs`), run as written.
#![cfg(feature = "sim")]

#[path = "../examples/sim_server_test.rs"]
#[allow(dead_code)] // its `main` is the example's own
mod example;

use cm_verbs::EstablishedVia;

#[test]
fn the_readme_shows_the_simulated_test_as_it_is() {
    let readme = include_str!("../README.md");
    assert!(readme.contains(include_str!("../examples/sim_server_test.rs")));
}

#[test]
fn the_simulated_test_sees_its_server_rescued_once() {
    let vias = example::serve_on_the_simulated_fabric().expect("the simulated run");
    assert!(matches!(vias[..], [EstablishedVia::Notify(_)]), "{vias:?}");
}
