//! The project's whole path on the real kernel: the device raises `IBV_EVENT_COMM_EST`,
//! the application's [`NotifyPump`] reads it from the async fd, calls `rdma_notify`, and
//! the kernel CM delivers one ESTABLISHED. Without a device the tests record a skip and
//! return.
//!
//! The stock soft-RoCE never raises COMM_EST; the VM's patched `rdma_rxe`
//! (`ci/vm/rxe-comm-est`, loaded by `rxe-reload comm-est`) raises it on the first packet
//! an RC QP executes, as InfiniBand hardware does. The tests run on both and expect what
//! the loaded device does (`/sys/module/rdma_rxe/parameters/comm_est`): COMM_EST as the
//! trigger where the device raises it, the receive completion where it does not.
//!
//! Order matters and is not left to timing: the device queues COMM_EST on the async fd
//! before it writes the receive completion (both from the responder, in that order), so
//! a loop that drains the async fd after polling the CQ and before handing the
//! completions to the pump always shows the pump COMM_EST first.

#[path = "../../cm-sys/tests/common/mod.rs"]
mod common;
mod pump;

use pump::teardown;

use std::time::{Duration, Instant};

use cm_core::{AsyncEvent, AsyncEventType, CmEventType, NotifyOutcome};
use cm_sys::{AsyncEvents, Completion};
use cm_verbs::{NotifyPump, Progress, PumpEvent, Role, Trigger};

use common::{expect_event, CmMadRule, EarlySender, MadAction, EARLY, RTU, WAIT};

/// How long the passive side is watched after its ESTABLISHED for a second one: longer
/// than the first REP retransmission (4.1 s after the REP under emulation), whose answer
/// would be the next RTU.
const AFTER_ESTABLISHED: Duration = Duration::from_secs(6);

/// What [`run_loop`] saw.
struct Observed {
    pump_events: Vec<PumpEvent>,
    async_events: Vec<AsyncEvent>,
    cm_events: Vec<(CmEventType, i32)>,
    received: Vec<Completion>,
}

/// The application's loop over one connection: receive completions, device async events
/// and CM events into the pump, for [`WAIT`], or until `after` past the passive side's
/// first ESTABLISHED.
/// Prints what one run of the loop saw, for the console log.
fn report_run(label: &str, raises: bool, seen: &Observed, pump: &NotifyPump<cm_sys::CmId>) {
    for event in &seen.pump_events {
        common::report(&format!("comm_est_pump ({label}): {event:?}"));
    }
    common::report(&format!(
        "comm_est_pump ({label}): device raises COMM_EST: {raises}; async events {:?}; \
         passive CM events {:?}; counters {:?}",
        seen.async_events,
        seen.cm_events,
        pump.counters()
    ));
}

fn run_loop(
    conn: &EarlySender,
    device: &AsyncEvents,
    pump: &mut NotifyPump<cm_sys::CmId>,
    after: Duration,
) -> Observed {
    let mut seen = Observed {
        pump_events: Vec::new(),
        async_events: Vec::new(),
        cm_events: Vec::new(),
        received: Vec::new(),
    };
    let mut deadline = Instant::now() + WAIT;
    let mut established = false;
    while Instant::now() < deadline {
        // Completions first, then the async fd: whatever COMM_EST the device raised for a
        // packet whose completion is in hand is already readable, and reaches the pump
        // before that completion does.
        let completions = conn.passive.poll_recv_cq(4).expect("ibv_poll_cq");
        while let Some(event) = device.try_next_event().expect("ibv_get_async_event") {
            seen.async_events.push(event);
            seen.pump_events.push(pump.on_async_event(event));
        }
        for completion in completions {
            assert!(completion.is_success(), "{}", completion.status_str());
            seen.received.push(completion);
            if let Some(event) = pump.on_receive_completion(completion.qp_num) {
                seen.pump_events.push(event);
            }
        }
        while let Some(event) = conn.server.try_next_event().expect("rdma_get_cm_event") {
            seen.cm_events.push((event.event_type(), event.status()));
            pump.on_cm_event(event.event_type(), event.qp_num());
            event.ack().expect("ack");
            if event_is_established(&seen.cm_events) && !established {
                established = true;
                deadline = Instant::now() + after;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    seen
}

fn event_is_established(events: &[(CmEventType, i32)]) -> bool {
    events.last() == Some(&(CmEventType::Established, 0))
}

/// The COMM_EST events of `events`, as the QPs they name.
fn comm_est_qps(events: &[AsyncEvent]) -> Vec<Option<cm_core::QpNum>> {
    events
        .iter()
        .filter(|e| e.event_type == AsyncEventType::CommEst)
        .map(|e| e.qp_num())
        .collect()
}

/// RTU dropped, active side sending at once: the device's COMM_EST (or, on the stock
/// device, the receive completion) forces the connection, exactly one ESTABLISHED.
#[test]
fn comm_est_from_the_device_rescues_a_lost_rtu_through_the_pump() {
    let test = "comm_est_from_the_device_rescues_a_lost_rtu_through_the_pump";
    let Some(setup) = common::setup(test) else {
        return;
    };
    let raises = common::device_raises_comm_est();
    let rtu_drop = CmMadRule::install(
        &setup.nft,
        "cmnotify_comm_est",
        setup.addr_a,
        RTU,
        MadAction::Drop,
    )
    .expect("install the RTU rule");

    let mut pump = NotifyPump::new();
    let conn = EarlySender::open(setup.addr_a, setup.addr_b, |passive| {
        pump.register(passive.clone(), Role::Passive)
            .expect("register the accepted id");
    });
    let qp = conn.passive_qp();
    let device = conn.passive.async_events().expect("async events");
    conn.send_early();
    let seen = run_loop(&conn, &device, &mut pump, AFTER_ESTABLISHED);
    report_run("lost RTU", raises, &seen, &pump);

    assert_eq!(seen.received.len(), 1, "{:?}", seen.received);
    assert_eq!(
        (seen.received[0].qp_num, seen.received[0].byte_len),
        (qp, EARLY.len() as u32)
    );
    let counters = pump.counters();
    if raises {
        // COMM_EST was the trigger; the receive completion then found the connection
        // established and triggered nothing.
        assert_eq!(comm_est_qps(&seen.async_events), [Some(qp)]);
        assert_eq!(
            seen.pump_events,
            [PumpEvent::Forced {
                qp,
                trigger: Trigger::AsyncEvent(AsyncEventType::CommEst)
            }]
        );
        assert_eq!(
            (
                counters.forced,
                counters.receive_triggers,
                counters.notify_failed
            ),
            (1, 0, 0),
            "{counters:?}"
        );
    } else {
        assert_eq!(comm_est_qps(&seen.async_events), []);
        assert_eq!(
            seen.pump_events,
            [PumpEvent::Forced {
                qp,
                trigger: Trigger::ReceiveCompletion
            }]
        );
        assert_eq!(
            (
                counters.forced,
                counters.receive_triggers,
                counters.notify_failed
            ),
            (1, 1, 0),
            "{counters:?}"
        );
    }
    assert_eq!(pump.progress(qp), Some(Progress::Established));
    // Exactly one ESTABLISHED, and nothing else, over a REP retransmission interval.
    assert_eq!(seen.cm_events, [(CmEventType::Established, 0)]);
    assert_eq!(
        conn.passive.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    teardown(&conn, &mut pump);
    let dropped = rtu_drop.hits().expect("read the RTU counter");
    common::report(&format!(
        "comm_est_pump (lost RTU): RTUs dropped: {dropped}"
    ));
    assert!(dropped >= 1, "the RTU was not dropped: {dropped}");
}

/// RTU delivered: the passive side is ESTABLISHED before the active side sends; the
/// device's COMM_EST for that first packet then reaches the pump, whose notify answers
/// EISCONN (harmless), and no second ESTABLISHED follows.
#[test]
fn comm_est_after_the_rtu_is_eisconn_and_harmless() {
    let test = "comm_est_after_the_rtu_is_eisconn_and_harmless";
    let Some(setup) = common::setup(test) else {
        return;
    };
    let raises = common::device_raises_comm_est();
    let mut pump = NotifyPump::new();
    let conn = EarlySender::open(setup.addr_a, setup.addr_b, |passive| {
        pump.register(passive.clone(), Role::Passive)
            .expect("register the accepted id");
    });
    let qp = conn.passive_qp();
    let device = conn.passive.async_events().expect("async events");
    // The RTU's ESTABLISHED first, then the data.
    let established = expect_event(&conn.server, CmEventType::Established);
    pump.on_cm_event(established.event_type(), established.qp_num());
    established.ack().expect("ack");
    conn.send_early();
    // No further ESTABLISHED is expected, so the loop runs its whole bound.
    let seen = run_loop(&conn, &device, &mut pump, Duration::ZERO);
    report_run("RTU first", raises, &seen, &pump);

    assert_eq!(seen.received.len(), 1, "{:?}", seen.received);
    assert_eq!(seen.received[0].qp_num, qp);
    let counters = pump.counters();
    if raises {
        assert_eq!(comm_est_qps(&seen.async_events), [Some(qp)]);
        assert_eq!(
            seen.pump_events,
            [PumpEvent::AlreadyEstablished {
                qp,
                trigger: Trigger::AsyncEvent(AsyncEventType::CommEst)
            }]
        );
        assert_eq!(
            (counters.forced, counters.already_established),
            (0, 1),
            "{counters:?}"
        );
    } else {
        assert_eq!(comm_est_qps(&seen.async_events), []);
        assert_eq!(seen.pump_events, []);
    }
    assert_eq!(counters.receive_triggers, 0, "{counters:?}");
    assert_eq!(pump.progress(qp), Some(Progress::Established));
    // No second ESTABLISHED after the one the RTU brought.
    assert_eq!(seen.cm_events, []);
    teardown(&conn, &mut pump);
}
