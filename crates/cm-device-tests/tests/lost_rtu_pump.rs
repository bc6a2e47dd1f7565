//! The lost-RTU case on the wire, with and without cm-verbs' notify pump, on the real
//! kernel CM (soft-RoCE in the test VM: `cargo xtask vm`). Without a device the test
//! records a skip and returns.
//!
//! An nftables rule in the INPUT hook of the passive address drops every CM RTU. Two
//! connections run at once through it; on each the active side is ESTABLISHED and sends
//! at once. The one whose passive id is registered with a [`NotifyPump`] (fed with the
//! passive device's async events and the passive QP's receive completions: soft-RoCE
//! raises no COMM_EST) is forced to ESTABLISHED by the receive completion. The other one
//! never gets there: its REP retries run out and it ends UNREACHABLE (-ETIMEDOUT).
//!
//! It runs on the kernel's own soft-RoCE, the device without COMM_EST, where the receive
//! completion is the only trigger; on the VM's COMM_EST device (`rxe-reload comm-est`)
//! `comm_est_pump` covers the same rescue with COMM_EST as the trigger.

#[path = "../../cm-sys/tests/common/mod.rs"]
mod common;
mod pump;

use pump::teardown;

use std::net::IpAddr;
use std::time::{Duration, Instant};

use cm_core::{errno, AsyncEventType, CmEventType, NotifyError, NotifyOutcome};
use cm_verbs::{NotifyPump, Progress, PumpEvent, Role, Trigger};

use common::{
    wait_completion, CmMadRule, EarlySender, MadAction, EARLY, REP_RETRIES_BOUND, RTU, WAIT,
};

/// How long the pumped connection is watched after its ESTABLISHED for a second one:
/// longer than the first REP retransmission (4.1 s after the REP under emulation), whose
/// answer would be the next RTU.
const AFTER_ESTABLISHED: Duration = Duration::from_secs(6);

/// The pumped connection: forced to ESTABLISHED by its receive completion, exactly once.
fn with_pump(passive_addr: IpAddr, active_addr: IpAddr) {
    let mut pump = NotifyPump::new();
    let conn = EarlySender::open(passive_addr, active_addr, |passive| {
        pump.register(passive.clone(), Role::Passive)
            .expect("register the accepted id");
    });
    conn.send_early();
    let qp = conn.passive_qp();
    let device = conn.passive.async_events().expect("async events");

    // The application's loop: device async events and receive completions into the pump,
    // CM events out (and back into the pump), until ESTABLISHED, then a while longer.
    let mut pump_events = Vec::new();
    let mut cm_events = Vec::new();
    let mut received = Vec::new();
    let mut deadline = Instant::now() + WAIT;
    let mut established_at = None;
    while Instant::now() < deadline {
        while let Some(event) = device.try_next_event().expect("ibv_get_async_event") {
            pump_events.push(pump.on_async_event(event));
        }
        for completion in conn.passive.poll_recv_cq(4).expect("ibv_poll_cq") {
            assert!(completion.is_success(), "{}", completion.status_str());
            received.push(completion);
            if let Some(event) = pump.on_receive_completion(completion.qp_num) {
                pump_events.push(event);
            }
        }
        while let Some(event) = conn.server.try_next_event().expect("rdma_get_cm_event") {
            cm_events.push((event.event_type(), event.status()));
            pump.on_cm_event(event.event_type(), event.qp_num());
            event.ack().expect("ack");
            if cm_events.last() == Some(&(CmEventType::Established, 0)) && established_at.is_none()
            {
                established_at = Some(Instant::now());
                deadline = Instant::now() + AFTER_ESTABLISHED;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    common::report(&format!(
        "with the pump: pump events {pump_events:?}, CM events {cm_events:?}"
    ));

    assert_eq!(received.len(), 1, "{received:?}");
    assert_eq!(
        (received[0].qp_num, received[0].byte_len),
        (qp, EARLY.len() as u32)
    );
    assert_eq!(
        conn.passive
            .read_memory(&conn.passive_memory, 0..EARLY.len())
            .expect("read"),
        EARLY
    );
    // The receive completion was the trigger, and it forced the connection (no COMM_EST
    // from soft-RoCE, so no other notify).
    assert_eq!(
        pump_events,
        [PumpEvent::Forced {
            qp,
            trigger: Trigger::ReceiveCompletion
        }]
    );
    let counters = pump.counters();
    assert_eq!(
        (
            counters.forced,
            counters.receive_triggers,
            counters.notify_failed
        ),
        (1, 1, 0),
        "{counters:?}"
    );
    assert_eq!(pump.progress(qp), Some(Progress::Established));
    // Exactly one ESTABLISHED, and nothing else, over a REP retransmission interval.
    assert_eq!(cm_events, [(CmEventType::Established, 0)]);
    assert_eq!(
        conn.passive.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );

    // Teardown: each side answers the other's DISCONNECTED with its own disconnect.
    teardown(&conn, &mut pump);
}

/// The connection nobody notifies: data arrives, the REP retries run out, UNREACHABLE.
fn without_pump(passive_addr: IpAddr, active_addr: IpAddr) {
    let conn = EarlySender::open(passive_addr, active_addr, |_| {});
    conn.send_early();
    let qp = conn.passive_qp();
    let received = wait_completion("passive receive", || conn.passive.poll_recv_cq(4));
    assert!(received.is_success(), "{}", received.status_str());
    assert_eq!(received.qp_num, qp);

    let started = Instant::now();
    let event = common::event_within(&conn.server, REP_RETRIES_BOUND)
        .unwrap_or_else(|| panic!("no passive event within {REP_RETRIES_BOUND:?}"));
    let seen = (event.event_type(), event.status());
    event.ack().expect("ack");
    common::report(&format!(
        "without the pump: {seen:?} {:.1} s after the receive completion",
        started.elapsed().as_secs_f64()
    ));
    assert_eq!(seen, (CmEventType::Unreachable, -errno::ETIMEDOUT));
    // The connection failed: notify is refused now.
    assert_eq!(
        conn.passive.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
    assert!(conn
        .server
        .try_next_event()
        .expect("rdma_get_cm_event")
        .is_none());
    // The active side still believes it is connected; its DREQ goes unanswered, so the
    // disconnect is not waited for.
    conn.active.disconnect().expect("active disconnect");
}

#[test]
fn lost_rtu_is_forced_established_by_the_pump_and_unreachable_without_it() {
    let test = "lost_rtu_is_forced_established_by_the_pump_and_unreachable_without_it";
    let Some(setup) = common::setup(test) else {
        return;
    };
    assert!(
        !common::device_raises_comm_est(),
        "{test} is written for the soft-RoCE without COMM_EST ({} says Y): run it before \
         `rxe-reload comm-est`",
        common::RXE_COMM_EST_PARAM
    );
    let rtu_drop = CmMadRule::install(
        &setup.nft,
        "cmnotify_pump",
        setup.addr_a,
        RTU,
        MadAction::Drop,
    )
    .expect("install the RTU rule");

    // The long wait (the REP retries) runs beside the pumped connection.
    let (passive, active) = (setup.addr_a, setup.addr_b);
    let unpumped = std::thread::spawn(move || without_pump(passive, active));
    with_pump(setup.addr_a, setup.addr_b);
    unpumped
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e));

    let dropped = rtu_drop.hits().expect("read the RTU counter");
    common::report(&format!(
        "RTUs dropped on the passive INPUT hook: {dropped}"
    ));
    assert!(dropped >= 2, "one RTU per connection at least: {dropped}");
}
