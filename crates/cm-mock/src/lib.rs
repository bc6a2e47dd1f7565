//! Test doubles for the cm-core backend traits.
//!
//! - `MockCmId`, `MockCmEvent`, `MockCmEventSource`, `MockAsyncEventSource` (and
//!   `MockBackend` tying them together): mockall mocks, for unit tests that script exact
//!   calls. They are behind the `mocks` feature (off by default: the simulation and the
//!   conformance suite need no mockall), so a test enables it:
//!   `cm-mock = { version = "0.1", features = ["mocks"] }` under `[dev-dependencies]`.
//! - [`sim::SimFabric`]: a deterministic simulated RDMA CM fabric (virtual clock,
//!   seeded faults, the kernel's IB CM states and notify answers) on which the same
//!   consumer code runs unchanged.
//! - [`conformance`]: the notify-path scenarios, written once against
//!   [`conformance::Harness`], run on the simulator ([`conformance::SimHarness`]) and
//!   on any real backend that implements the harness.
//!
#![cfg_attr(
    feature = "mocks",
    doc = r#"
Unit-testing a consumer of the traits with the mocks: a function that forwards a
COMM_EST to the id owning the QP must call `notify(CommEst)` exactly once.

```
use cm_core::{AsyncEvent, AsyncEventSource, AsyncEventType, CmId, NotifyOutcome, QpNum};
use cm_mock::{MockAsyncEventSource, MockCmId};
use mockall::predicate::eq;

/// Reads one async event and forwards it to `id` when it is a COMM_EST on its QP.
fn forward_one(source: &mut impl AsyncEventSource, id: &impl CmId) -> Option<NotifyOutcome> {
    let event = source.try_next_async_event().ok()??;
    if event.event_type == AsyncEventType::CommEst && event.qp_num() == id.qp_num() {
        id.notify(AsyncEventType::CommEst).ok()
    } else {
        None
    }
}

let mut source = MockAsyncEventSource::new();
source
    .expect_try_next_async_event()
    .times(1)
    .returning(|| Ok(Some(AsyncEvent::qp(AsyncEventType::CommEst, QpNum(0x11)))));

let mut id = MockCmId::new();
id.expect_qp_num().return_const(Some(QpNum(0x11)));
id.expect_notify()
    .with(eq(AsyncEventType::CommEst))
    .times(1)
    .returning(|_| Ok(NotifyOutcome::Established));

assert_eq!(forward_one(&mut source, &id), Some(NotifyOutcome::Established));
// Dropping `id` checks `times(1)`: a second notify, or none, fails the test.
```
"#
)]
#![forbid(unsafe_code)]

pub mod conformance;
mod kernel_like;
#[cfg(feature = "mocks")]
mod mocks;
pub mod sim;

pub use kernel_like::KernelLikeId;
#[cfg(feature = "mocks")]
pub use mocks::{MockAsyncEventSource, MockBackend, MockCmEvent, MockCmEventSource, MockCmId};
