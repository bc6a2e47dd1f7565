//! Property: over random fault schedules and seeds, every connection ends with exactly
//! one ESTABLISHED per side or a failure event, never two ESTABLISHED; no event is lost
//! or left unacknowledged. A failure prints a one-line reproduction.

use std::collections::HashMap;
use std::time::Duration;

use cm_core::{
    AsyncEventSource, AsyncEventType, CmEvent, CmEventSource, CmEventType, CmId, NotifyError,
    NotifyOutcome, QpNum,
};
use cm_mock::sim::{
    ConnId, FaultAction, FaultOdds, FaultRule, MsgKind, SimCmId, SimConfig, SimIdKey, SimPair,
};
use proptest::prelude::*;

const PORT: u16 = 4791;

/// One random run, printable on one line.
#[derive(Debug, Clone)]
struct Schedule {
    seed: u64,
    connections: usize,
    comm_est: bool,
    delayed_mra: bool,
    /// Notify on a receive completion too (the soft-RoCE trigger).
    notify_on_completion: bool,
    /// The active side disconnects right after sending its first data, racing the
    /// passive side's notify and its deferred ESTABLISHED.
    disconnect_early: bool,
    /// Per kind: drop, duplicate, delay, reorder, in percent.
    odds: Vec<(MsgKind, u8, u8, u8, u8)>,
    /// Deterministic rules: kind, connection, nth, action.
    rules: Vec<(MsgKind, Option<u32>, Option<u32>, FaultAction)>,
}

impl Schedule {
    /// The schedule as Rust source, for pasting into `fixed_schedules_hold`.
    fn repro(&self) -> String {
        let action = |a: &FaultAction| match a {
            FaultAction::Delay(d) => {
                format!("FaultAction::Delay(Duration::from_nanos({}))", d.as_nanos())
            }
            other => format!("FaultAction::{other:?}"),
        };
        let odds: Vec<String> = self
            .odds
            .iter()
            .map(|(k, a, b, c, d)| format!("(MsgKind::{k:?}, {a}, {b}, {c}, {d})"))
            .collect();
        let rules: Vec<String> = self
            .rules
            .iter()
            .map(|(k, conn, nth, a)| format!("(MsgKind::{k:?}, {conn:?}, {nth:?}, {})", action(a)))
            .collect();
        format!(
            "run_schedule(&Schedule {{ seed: {}, connections: {}, comm_est: {}, delayed_mra: {}, \
             notify_on_completion: {}, disconnect_early: {}, odds: vec![{}], rules: vec![{}] }})",
            self.seed,
            self.connections,
            self.comm_est,
            self.delayed_mra,
            self.notify_on_completion,
            self.disconnect_early,
            odds.join(", "),
            rules.join(", ")
        )
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct SideTally {
    established: u32,
    failures: u32,
    disconnected: u32,
    /// The application disconnected after ESTABLISHED: a late REJ (a retried REQ
    /// finding the peer in TIMEWAIT) may then still be reported, as the kernel does.
    disconnected_by_us: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    active: SideTally,
    passive: Option<SideTally>,
}

fn tally(side: &mut SideTally, event: CmEventType) -> Result<(), String> {
    match event {
        CmEventType::Established => side.established += 1,
        e if e.is_connect_failure() => side.failures += 1,
        CmEventType::Disconnected => side.disconnected += 1,
        CmEventType::TimewaitExit => {}
        other => return Err(format!("unexpected event {other}")),
    }
    Ok(())
}

fn check_notify(result: Result<NotifyOutcome, NotifyError>) -> Result<(), String> {
    match result {
        Ok(_) | Err(NotifyError::WrongState) => Ok(()),
        Err(other) => Err(format!("notify answered {other:?}")),
    }
}

fn run_schedule(s: &Schedule) -> Result<(), String> {
    let config = SimConfig {
        comm_est: s.comm_est,
        delayed_mra: s.delayed_mra,
        ..SimConfig::default()
    };
    let pair = SimPair::new(config, s.seed);
    let fabric = &pair.fabric;
    for &(kind, drop, duplicate, delay, reorder) in &s.odds {
        fabric.set_fault_odds(
            kind,
            FaultOdds {
                drop: f64::from(drop) / 100.0,
                duplicate: f64::from(duplicate) / 100.0,
                delay: f64::from(delay) / 100.0,
                max_delay: Duration::from_secs(6),
                reorder: f64::from(reorder) / 100.0,
            },
        );
    }
    for &(kind, conn, nth, action) in &s.rules {
        let mut rule = FaultRule::new(kind, action);
        rule.conn = conn.map(ConnId);
        rule.nth = nth;
        fabric.add_fault(rule);
    }
    let listener = pair.listen(PORT).map_err(|e| e.to_string())?;
    let SimPair {
        fabric,
        server,
        client,
    } = pair;
    let (server_node, mut server, mut device) = (server.node, server.channel, server.device);
    let mut client = client.channel;

    let mut tallies = vec![Tally::default(); s.connections];
    let mut all_ids: Vec<SimCmId> = vec![listener.clone()];
    let mut index_of_active: HashMap<SimIdKey, usize> = HashMap::new();
    let mut index_of_conn: HashMap<ConnId, usize> = HashMap::new();
    let mut index_of_passive: HashMap<SimIdKey, usize> = HashMap::new();
    let mut passive_by_qp: HashMap<QpNum, SimCmId> = HashMap::new();
    for i in 0..s.connections {
        let id = client.create_id();
        id.resolve_addr(server_node.id(), PORT)
            .map_err(|e| e.to_string())?;
        index_of_active.insert(id.key(), i);
        all_ids.push(id);
    }

    loop {
        let mut busy = false;
        while let Some(event) = client.try_next_event().map_err(|e| e.to_string())? {
            busy = true;
            let id = event.id();
            let i = index_of_active[&id.key()];
            match event.event_type() {
                CmEventType::AddrResolved => id.resolve_route().map_err(|e| e.to_string())?,
                CmEventType::RouteResolved => {
                    id.create_qp().map_err(|e| e.to_string())?;
                    let conn = id.connect(&[]).map_err(|e| e.to_string())?;
                    index_of_conn.insert(conn, i);
                }
                other => {
                    tally(&mut tallies[i].active, other)
                        .map_err(|e| format!("connection {i} active side: {e}"))?;
                    if other == CmEventType::Established {
                        id.post_send(32).map_err(|e| e.to_string())?;
                        if s.disconnect_early {
                            id.disconnect().map_err(|e| e.to_string())?;
                            tallies[i].active.disconnected_by_us = true;
                        }
                    }
                    if other == CmEventType::Disconnected {
                        // Answer the peer's DREQ with a DREP (a no-op otherwise).
                        id.disconnect().map_err(|e| e.to_string())?;
                    }
                }
            }
            event.ack().map_err(|e| e.to_string())?;
        }
        while let Some(event) = server.try_next_event().map_err(|e| e.to_string())? {
            busy = true;
            let id = event.id();
            if event.event_type() == CmEventType::ConnectRequest {
                let conn = id.conn().ok_or("request without connection")?;
                let i = index_of_conn[&conn];
                if tallies[i].passive.is_some() {
                    return Err(format!("connection {i}: a second CONNECT_REQUEST"));
                }
                tallies[i].passive = Some(SideTally::default());
                index_of_passive.insert(id.key(), i);
                let qp = id.create_qp().map_err(|e| e.to_string())?;
                id.accept(&[]).map_err(|e| e.to_string())?;
                passive_by_qp.insert(qp, id.clone());
                all_ids.push(id);
            } else {
                let i = index_of_passive[&id.key()];
                let side = tallies[i].passive.as_mut().ok_or("event before request")?;
                tally(side, event.event_type())
                    .map_err(|e| format!("connection {i} passive side: {e}"))?;
                if event.event_type() == CmEventType::Disconnected {
                    id.disconnect().map_err(|e| e.to_string())?;
                }
            }
            event.ack().map_err(|e| e.to_string())?;
        }
        while let Some(event) = device.try_next_async_event().map_err(|e| e.to_string())? {
            busy = true;
            if event.event_type != AsyncEventType::CommEst {
                return Err(format!("unexpected async event {event}"));
            }
            let qp = event.qp_num().ok_or("COMM_EST without QP")?;
            check_notify(passive_by_qp[&qp].notify(AsyncEventType::CommEst))?;
        }
        while let Some(completion) = device.poll_cq() {
            busy = true;
            if s.notify_on_completion {
                check_notify(passive_by_qp[&completion.qp].notify(AsyncEventType::CommEst))?;
            }
        }
        if !busy && !fabric.step() {
            break;
        }
    }

    for (i, t) in tallies.iter().enumerate() {
        // At most one ESTABLISHED and one DISCONNECTED; a side without ESTABLISHED
        // failed, or was disconnected first (DREQ before the deferred work item); a
        // side with ESTABLISHED saw no failure unless it disconnected itself.
        let one_outcome = |side: &SideTally| {
            let ended = side.established == 1 || side.failures >= 1 || side.disconnected == 1;
            side.established <= 1
                && side.disconnected <= 1
                && ended
                && (side.established == 0 || side.failures == 0 || side.disconnected_by_us)
        };
        if !one_outcome(&t.active) {
            return Err(format!("connection {i} active side: {:?}", t.active));
        }
        match t.passive {
            Some(p) if !one_outcome(&p) => {
                return Err(format!("connection {i} passive side: {p:?}"));
            }
            None if t.active.failures == 0 => {
                return Err(format!(
                    "connection {i}: no request reached the passive side, yet the active side did not fail: {:?}",
                    t.active
                ));
            }
            _ => {}
        }
    }
    let stats = fabric.stats();
    if stats.events_queued != stats.events_delivered + stats.events_discarded
        || stats.events_delivered != stats.events_acked
        || server.queued() + client.queued() != 0
    {
        return Err(format!("event accounting: {stats:?}"));
    }
    for id in &all_ids {
        if id.unacked_events().map_err(|e| e.to_string())? != 0 {
            return Err(format!("{id:?} has unacknowledged events"));
        }
    }
    Ok(())
}

fn kind() -> impl Strategy<Value = MsgKind> {
    prop::sample::select(MsgKind::ALL.to_vec())
}

fn action() -> impl Strategy<Value = FaultAction> {
    prop_oneof![
        Just(FaultAction::Drop),
        Just(FaultAction::Duplicate),
        Just(FaultAction::Reorder),
        (0u64..10_000).prop_map(|ms| FaultAction::Delay(Duration::from_millis(ms))),
    ]
}

fn schedule() -> impl Strategy<Value = Schedule> {
    (
        any::<u64>(),
        1usize..6,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop::collection::vec((kind(), 0u8..40, 0u8..20, 0u8..20, 0u8..20), 0..4),
        prop::collection::vec(
            (
                kind(),
                prop::option::of(0u32..6),
                prop::option::of(0u32..3),
                action(),
            ),
            0..4,
        ),
    )
        .prop_map(
            |(
                seed,
                connections,
                comm_est,
                delayed_mra,
                notify_on_completion,
                disconnect_early,
                odds,
                rules,
            )| {
                Schedule {
                    seed,
                    connections,
                    comm_est,
                    delayed_mra,
                    notify_on_completion,
                    disconnect_early,
                    odds,
                    rules,
                }
            },
        )
}

proptest! {
    // 200 cases unless PROPTEST_CASES says otherwise (e.g. a long soak run).
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(200)
    ))]

    #[test]
    fn every_connection_ends_once_per_side_and_no_event_is_lost(s in schedule()) {
        if let Err(why) = run_schedule(&s) {
            panic!("{why}; reproduce: {}", s.repro());
        }
    }
}

#[test]
fn fixed_schedules_hold() {
    let base = Schedule {
        seed: 1,
        connections: 4,
        comm_est: false,
        delayed_mra: true,
        notify_on_completion: true,
        disconnect_early: false,
        odds: Vec::new(),
        rules: vec![(MsgKind::Rtu, None, None, FaultAction::Drop)],
    };
    let cases = [
        base.clone(),
        Schedule {
            notify_on_completion: false,
            ..base.clone()
        },
        Schedule {
            comm_est: true,
            notify_on_completion: false,
            ..base.clone()
        },
        Schedule {
            rules: vec![(MsgKind::Req, None, None, FaultAction::Drop)],
            ..base.clone()
        },
        Schedule {
            rules: vec![(MsgKind::Rep, None, None, FaultAction::Drop)],
            ..base.clone()
        },
        Schedule {
            disconnect_early: true,
            ..base.clone()
        },
        Schedule {
            odds: MsgKind::ALL.iter().map(|&k| (k, 30, 10, 10, 10)).collect(),
            rules: Vec::new(),
            connections: 5,
            ..base
        },
    ];
    for s in &cases {
        if let Err(why) = run_schedule(s) {
            panic!("{why}; reproduce: {}", s.repro());
        }
    }
}
