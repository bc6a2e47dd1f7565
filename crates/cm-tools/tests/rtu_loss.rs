//! A server written against cm-verbs survives 100% RTU loss with data flowing; without
//! the pump the same scenario ends in UNREACHABLE. The client disconnects right after
//! its exchange, not after some stale CM timer. And the exactly-once property holds
//! through the pump for random fault schedules.

use std::time::Duration;

use cm_core::CmEventType;
use cm_mock::sim::{FaultOdds, MsgKind, TraceEntry, TraceEvent};
use cm_tools::sim_run::{run, SimRun};
use cm_verbs::CloseReason;
use proptest::prelude::*;

#[test]
fn every_connection_is_rescued_by_the_pump_under_total_rtu_loss() {
    for soft_roce in [false, true] {
        let report = run(&SimRun {
            connections: 200,
            rtu_loss: 1.0,
            soft_roce,
            ..SimRun::default()
        });
        assert_eq!(report.established(), 200, "soft_roce={soft_roce}");
        assert_eq!(report.forced(), 200);
        assert_eq!(report.invariant_violations(), 0);
        assert_eq!(report.teardown_failures, 0);
        assert_eq!(report.pump.forced, 200);
        if soft_roce {
            assert_eq!(
                report.fabric.comm_est_raised, 0,
                "soft-RoCE raises no COMM_EST"
            );
            assert_eq!(report.pump.receive_triggers, 200);
        } else {
            assert_eq!(report.pump.receive_triggers, 0, "COMM_EST came first");
        }
    }
}

#[test]
fn without_the_pump_the_same_scenario_ends_unreachable() {
    let report = run(&SimRun {
        connections: 50,
        rtu_loss: 1.0,
        pump: false,
        ..SimRun::default()
    });
    assert_eq!(report.established(), 0);
    assert_eq!(report.unreachable(), 50);
    assert_eq!(report.comm_est_ignored, 50);
    for outcome in &report.outcomes {
        assert!(
            matches!(
                outcome.passive_failure,
                Some(CloseReason::Unreachable { .. })
            ),
            "{outcome:?}"
        );
        assert_eq!(
            outcome.active_established, 1,
            "the active side thinks it is up"
        );
    }
    assert!(
        report.fabric.retransmissions >= 50 * 15,
        "REP retries ran out"
    );
    assert_eq!(report.teardown_failures, 0);
}

#[test]
fn no_data_means_no_trigger_even_with_the_pump() {
    let report = run(&SimRun {
        connections: 5,
        rtu_loss: 1.0,
        send_data: false,
        ..SimRun::default()
    });
    assert_eq!(report.unreachable(), 5);
    assert_eq!(report.pump.forced, 0);
}

#[test]
fn without_loss_the_rtu_does_it_alone() {
    let report = run(&SimRun {
        connections: 30,
        rtu_loss: 0.0,
        ..SimRun::default()
    });
    assert_eq!(report.established(), 30);
    assert_eq!(report.via_rtu(), 30);
    assert_eq!(report.pump.forced, 0);
}

#[test]
fn rule_drops_only_the_named_connections_rtu() {
    let report = run(&SimRun {
        connections: 4,
        rtu_loss: 0.0,
        drop_rtu_of: vec![2],
        ..SimRun::default()
    });
    assert_eq!(report.established(), 4);
    assert_eq!(report.forced(), 1);
    assert!(report.outcomes[2].forced);
}

/// The most virtual time between the echo reaching the client and its DREQ, and
/// between that and the server's DISCONNECTED: a few wire hops (10 µs each), far below
/// any CM timer (the REP's retry is 4.29 s).
const DISCONNECT_WITHIN: Duration = Duration::from_millis(10);

/// When the first (or, with `last`, the last) entry `matches` was recorded.
fn recorded_at(
    entries: &[TraceEntry],
    last: bool,
    matches: impl Fn(&TraceEvent) -> bool,
) -> Option<Duration> {
    let mut found = entries.iter().filter(|e| matches(&e.event)).map(|e| e.at);
    if last {
        found.next_back()
    } else {
        found.next()
    }
}

/// The client disconnects as soon as its message came back, as a real client does:
/// the DREQ follows the last SEND by microseconds of virtual time, whatever CM timer
/// is still scheduled (the REP's retry, stale once notify established the server).
#[test]
fn the_client_disconnects_right_after_its_exchange() {
    for (connections, traced, soft_roce) in [(1, 0, false), (1, 0, true), (100, 99, false)] {
        let report = run(&SimRun {
            connections,
            trace_conn: Some(traced),
            soft_roce,
            ..SimRun::default()
        });
        let case = format!("{connections} connections, traced {traced}, soft_roce={soft_roce}");
        assert_eq!(report.forced(), connections as usize, "{case}");
        let at = |last: bool, what: &str, matches: &dyn Fn(&TraceEvent) -> bool| {
            recorded_at(&report.trace_entries, last, matches)
                .unwrap_or_else(|| panic!("{case}: no {what}: {:?}", report.trace))
        };
        let echoed = at(true, "SEND delivered", &|e| {
            matches!(
                e,
                TraceEvent::Delivered {
                    kind: MsgKind::Data,
                    ..
                }
            )
        });
        let dreq = at(false, "DREQ", &|e| {
            matches!(
                e,
                TraceEvent::Sent {
                    kind: MsgKind::Dreq,
                    ..
                }
            )
        });
        let disconnected = at(false, "DISCONNECTED", &|e| {
            matches!(
                e,
                TraceEvent::CmEvent {
                    event: CmEventType::Disconnected,
                    ..
                }
            )
        });
        assert!(
            echoed <= dreq && dreq - echoed < DISCONNECT_WITHIN,
            "{case}: last SEND at {echoed:?}, DREQ at {dreq:?}"
        );
        assert!(
            dreq <= disconnected && disconnected - dreq < DISCONNECT_WITHIN,
            "{case}: DREQ at {dreq:?}, DISCONNECTED at {disconnected:?}"
        );
    }
}

fn odds() -> impl Strategy<Value = FaultOdds> {
    (
        0.0..0.4f64,
        0.0..0.3f64,
        0.0..0.5f64,
        0u64..20_000,
        0.0..0.3f64,
    )
        .prop_map(
            |(drop, duplicate, delay, max_delay_us, reorder)| FaultOdds {
                drop,
                duplicate,
                delay,
                max_delay: Duration::from_micros(max_delay_us),
                reorder,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// Whatever the interleaving of RTU, data and notify: exactly one ESTABLISHED per
    /// side or a failure, never two; nothing left unacknowledged at teardown.
    #[test]
    fn exactly_once_through_the_pump(
        seed in any::<u64>(),
        rtu_loss in prop_oneof![Just(1.0f64), Just(0.0f64), 0.0..1.0f64],
        rtu in odds(),
        data in odds(),
        lossless_data in any::<bool>(),
        rep in odds(),
        pump in any::<bool>(),
        soft_roce in any::<bool>(),
    ) {
        let data = if lossless_data { FaultOdds { drop: 0.0, ..data } } else { data };
        let config = SimRun {
            connections: 12,
            rtu_loss,
            pump,
            soft_roce,
            seed,
            odds: vec![(MsgKind::Rtu, FaultOdds { drop: rtu_loss.max(rtu.drop), ..rtu }),
                       (MsgKind::Data, data), (MsgKind::Rep, rep)],
            ..SimRun::default()
        };
        let report = run(&config);
        let repro = format!(
            "reproduce: cm_tools::sim_run::run(&{config:?})"
        );
        prop_assert_eq!(report.invariant_violations(), 0, "{}", repro);
        prop_assert_eq!(report.teardown_failures, 0, "{}", repro);
        if pump && data.drop == 0.0 {
            // With the pump, data reaching a server still waiting for its RTU always
            // rescues it: no client can be established while its server failed.
            for (n, o) in report.outcomes.iter().enumerate() {
                prop_assert!(
                    o.active_established == 0 || o.passive_established == 1,
                    "conn {} not rescued: {:?} {}", n, o, repro
                );
            }
        }
    }
}
