//! What the safe wrapper costs over the bare C call: `CmId::notify` against
//! `rdma_sys::rdma_notify` (then errno read straight from its slot, as C code does) on
//! the same established id, interleaved in one process, so that both see the same
//! machine state. Each round times a batch of each, in rotating
//! order; the figure is the median of the rounds' own ratios, so drift between rounds
//! (other vCPU work, the host) cancels. A third batch times the bare call inside an
//! uncontended `RwLock` read: what guarding notify against a racing `rdma_migrate_id`
//! with a lock would cost (`CmId::notify` takes none: `migrate` needs the id to itself).
//!
//! Prints the figures (a human line and a `cm-benches:` figure line that `cargo xtask
//! bench` reads from the VM console log; never an assertion on time); asserts that both
//! calls give the same answer.

mod common;

use std::sync::RwLock;
use std::time::{Duration, Instant};

use cm_core::{AsyncEventType, CmEventType, NotifyOutcome};
use cm_sys::{ConnParams, QpCaps};
use cm_testkit::Figure;
use common::{addresses, expect_event, report};

const ROUNDS: usize = 400;
const CALLS_PER_ROUND: usize = 50;

/// The median of `values` (sorted in place).
fn median(values: &mut [f64]) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    values[values.len() / 2]
}

#[test]
fn wrapper_notify_against_raw_rdma_notify() {
    let Some(addrs) = addresses("wrapper_notify_against_raw_rdma_notify") else {
        return;
    };
    let (server_channel, _listener, server, client_channel, client) = common::requested(&addrs);
    server.create_qp(&QpCaps::default()).expect("server QP");
    server.accept(&ConnParams::default()).expect("accept");
    common::expect_established(&server_channel, &client_channel);

    let raw_notify = || {
        // SAFETY: `server` is live for the whole test and nothing migrates it.
        let ret = unsafe {
            rdma_sys::rdma_notify(
                server.as_raw(),
                rdma_sys::ibv_event_type::IBV_EVENT_COMM_EST,
            )
        };
        // SAFETY: __errno_location is the calling thread's errno slot, always valid.
        (ret, unsafe { *libc::__errno_location() })
    };
    // Same answer both ways: EISCONN (the connection is established).
    assert_eq!(raw_notify(), (-1, libc::EISCONN));
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );

    let lock = RwLock::new(());
    let locked_notify = || {
        let _guard = lock.read().expect("never poisoned");
        raw_notify()
    };
    let wrapped_notify = || server.notify(AsyncEventType::CommEst);
    let time = |f: &dyn Fn()| {
        let start = Instant::now();
        for _ in 0..CALLS_PER_ROUND {
            f();
        }
        start.elapsed()
    };
    let variants: [&dyn Fn(); 3] = [
        &|| {
            std::hint::black_box(raw_notify());
        },
        &|| {
            std::hint::black_box(locked_notify());
        },
        &|| {
            let _ = std::hint::black_box(wrapped_notify());
        },
    ];
    let (mut wrapped_ratios, mut locked_ratios) = (Vec::new(), Vec::new());
    let mut times: [Vec<Duration>; 3] = Default::default();
    for round in 0..ROUNDS {
        // Rotate the order so that no variant always runs first or last.
        let mut round_times = [Duration::ZERO; 3];
        for step in 0..3 {
            let which = (round + step) % 3;
            round_times[which] = time(variants[which]);
        }
        let raw = round_times[0].as_secs_f64();
        locked_ratios.push(round_times[1].as_secs_f64() / raw);
        wrapped_ratios.push(round_times[2].as_secs_f64() / raw);
        for (all, one) in times.iter_mut().zip(round_times) {
            all.push(one);
        }
    }
    let per_call = |v: &mut Vec<Duration>| {
        v.sort_unstable();
        v[v.len() / 2] / CALLS_PER_ROUND as u32
    };
    let [raw_times, locked_times, wrapped_times] = &mut times;
    let (raw_median, locked_median, wrapped_median) = (
        per_call(raw_times),
        per_call(locked_times),
        per_call(wrapped_times),
    );
    let wrapped_ratio = median(&mut wrapped_ratios);
    let locked_ratio = median(&mut locked_ratios);
    let how = format!(
        "median of the ratios of {ROUNDS} interleaved rounds of {CALLS_PER_ROUND} calls each; \
         per call: CmId::notify {wrapped_median:?}, raw rdma_notify {raw_median:?}, \
         raw inside an uncontended RwLock read {locked_median:?} (ratio {locked_ratio:.3}: \
         what a lock against a racing rdma_migrate_id would cost; CmId::notify takes none)"
    );
    report(&format!(
        "notify overhead: cm-sys CmId::notify / raw rdma_notify = {wrapped_ratio:.3} ({how})"
    ));
    Figure::measured(
        cm_testkit::figure_keys::REAL_NOTIFY,
        wrapped_ratio,
        "ratio",
        &format!("EISCONN on an established id; {how}"),
    )
    .report();

    client.disconnect().expect("disconnect");
    expect_event(&server_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
    server.disconnect().expect("disconnect");
    expect_event(&client_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
}
