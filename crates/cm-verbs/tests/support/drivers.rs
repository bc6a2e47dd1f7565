//! What the simulated-fabric handle tests share: which driver runs the handles, the
//! runtime a tokio driver's task runs on, and how long a step may wait.
#![allow(dead_code)] // each test binary uses its own part

use std::time::Duration;

use cm_mock::sim::SimTransport;

/// How long a blocking call of a test waits for any one step.
pub(crate) const WAIT: Option<Duration> = Some(Duration::from_secs(5));

/// The simulated transport's address.
pub(crate) type Addr = <SimTransport as cm_verbs::Transport>::Addr;

/// Who drives the handles.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Driver {
    /// `EndpointHandle::spawn_thread`.
    Thread,
    /// `EndpointHandle::spawn_tokio`.
    Tokio,
}

/// Both drivers, for tests that run once with each.
pub(crate) const DRIVERS: [Driver; 2] = [Driver::Thread, Driver::Tokio];

/// A current-thread runtime with I/O and time.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}
