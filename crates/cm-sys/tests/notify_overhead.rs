//! What the safe wrapper costs over the bare C call: `CmId::notify` against
//! `rdma_sys::rdma_notify` on the same established id, interleaved in one process, so
//! that both see the same machine state. Prints the ratio (a figure for the benches
//! report, never an assertion on time); asserts that both give the same answer.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cm_core::{AsyncEventType, CmEventType, NotifyOutcome};
use cm_sys::{ConnParams, EventChannel, QpCaps};
use common::{addresses, expect_event, report, resolved_id};

const ROUNDS: usize = 20;
const CALLS_PER_ROUND: usize = 200;

#[test]
fn wrapper_notify_against_raw_rdma_notify() {
    let Some(addrs) = addresses("wrapper_notify_against_raw_rdma_notify") else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let client_channel = EventChannel::new().expect("client channel");
    let listener = server_channel.create_id().expect("listener");
    listener
        .bind_addr(SocketAddr::new(addrs.addr_a, 0))
        .expect("bind");
    listener.listen(1).expect("listen");
    let server_addr = listener.local_addr().expect("listener address");
    let client = resolved_id(&client_channel, addrs.addr_b, server_addr).expect("resolve");
    client.create_qp(&QpCaps::default()).expect("client QP");
    client.connect(&ConnParams::default()).expect("connect");
    let request = expect_event(&server_channel, CmEventType::ConnectRequest);
    let server = request.id().expect("new id").clone();
    request.ack().expect("ack");
    server.create_qp(&QpCaps::default()).expect("server QP");
    server.accept(&ConnParams::default()).expect("accept");
    expect_event(&client_channel, CmEventType::Established)
        .ack()
        .expect("ack");
    expect_event(&server_channel, CmEventType::Established)
        .ack()
        .expect("ack");

    let raw_notify = || {
        // SAFETY: `server` is live for the whole test and nothing migrates it.
        let ret = unsafe {
            rdma_sys::rdma_notify(
                server.as_raw(),
                rdma_sys::ibv_event_type::IBV_EVENT_COMM_EST,
            )
        };
        (ret, std::io::Error::last_os_error().raw_os_error())
    };
    // Same answer both ways: EISCONN (the connection is established).
    assert_eq!(raw_notify(), (-1, Some(libc::EISCONN)));
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );

    let (mut raw, mut wrapped) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        // Alternate which goes first so neither always runs on a warmer cache.
        let mut measure_raw = || {
            let start = Instant::now();
            for _ in 0..CALLS_PER_ROUND {
                std::hint::black_box(raw_notify());
            }
            raw.push(start.elapsed());
        };
        let mut measure_wrapped = || {
            let start = Instant::now();
            for _ in 0..CALLS_PER_ROUND {
                let _ = std::hint::black_box(server.notify(AsyncEventType::CommEst));
            }
            wrapped.push(start.elapsed());
        };
        if round % 2 == 0 {
            measure_raw();
            measure_wrapped();
        } else {
            measure_wrapped();
            measure_raw();
        }
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort_unstable();
        v[v.len() / 2] / CALLS_PER_ROUND as u32
    };
    let (raw_median, wrapped_median) = (median(&mut raw), median(&mut wrapped));
    report(&format!(
        "notify overhead: cm-sys CmId::notify {wrapped_median:?} / raw rdma_notify {raw_median:?} \
         = {:.3} (medians of {ROUNDS} interleaved rounds of {CALLS_PER_ROUND} calls; \
         absolute times under TCG are emulation)",
        wrapped_median.as_secs_f64() / raw_median.as_secs_f64()
    ));

    client.disconnect().expect("disconnect");
    expect_event(&server_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
    server.disconnect().expect("disconnect");
    expect_event(&client_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
}
