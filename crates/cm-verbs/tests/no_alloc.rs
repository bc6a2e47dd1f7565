//! Handling an event through the pump allocates nothing after warm-up, counted by a
//! counting global allocator (a behaviour check, not a timing).

use cm_core::{AsyncEvent, AsyncEventType, CmEventType, QpNum};
use cm_mock::KernelLikeId;
use cm_verbs::{NotifyPump, PumpEvent, Role};

#[test]
fn pumped_events_allocate_nothing_after_warm_up() {
    const CONNECTIONS: u32 = 1024;
    let mut pump = NotifyPump::with_policy(Default::default(), CONNECTIONS as usize);
    for n in 0..CONNECTIONS {
        pump.register(KernelLikeId::new(QpNum(n)), Role::Passive)
            .unwrap();
    }
    // Warm-up: one event of each kind.
    pump.on_async_event(AsyncEvent::qp(AsyncEventType::CommEst, QpNum(0)));

    let mut forced = 0u32;
    let info = allocation_counter::measure(|| {
        for n in 0..CONNECTIONS {
            let qp = QpNum(n);
            if let PumpEvent::Forced { .. } =
                pump.on_async_event(AsyncEvent::qp(AsyncEventType::CommEst, qp))
            {
                forced += 1;
            }
            pump.on_async_event(AsyncEvent::qp(AsyncEventType::QpFatal, qp));
            pump.on_async_event(AsyncEvent::qp(
                AsyncEventType::CommEst,
                QpNum(n + CONNECTIONS),
            ));
            pump.on_receive_completion(qp);
            // Early triggers (kept inline, oldest evicted) allocate nothing either.
            pump.on_receive_completion(QpNum(n + CONNECTIONS));
            pump.on_cm_event(CmEventType::Established, Some(qp));
        }
    });
    assert_eq!(
        forced,
        CONNECTIONS - 1,
        "every connection but the warm-up one forced"
    );
    assert_eq!(info.count_total, 0, "allocations while pumping: {info:?}");
    let c = pump.counters();
    assert_eq!(c.unrouted, CONNECTIONS as u64);
    assert_eq!(c.passed_through, CONNECTIONS as u64);
    assert_eq!(c.early_kept, 2 * CONNECTIONS as u64);
    assert_eq!(pump.early_triggers(), 2 * cm_verbs::EARLY_TRIGGERS);
}
