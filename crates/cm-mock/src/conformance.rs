//! The conformance suite: notify-path scenarios written once against [`Harness`], run
//! on the simulated fabric ([`SimHarness`]) by `cargo test -p cm-mock`, and on a real
//! backend by any crate that implements [`Harness`] for it.
//!
//! The only wire fault a real harness can inject is "drop RTUs" (an nftables rule on the
//! CM MAD attribute 0x0014); scenarios that need more (a delayed RTU) ask for it through
//! [`Harness::delay_rtus`] and are skipped, with a reason, where it is not supported.
//!
//! ```
//! use cm_mock::conformance::{run_all, SimHarness, Verdict};
//! use cm_mock::sim::SimConfig;
//!
//! let report = run_all(|| SimHarness::new(SimConfig::default(), 1));
//! for (name, result) in &report {
//!     assert!(matches!(result, Ok(Verdict::Passed)), "{name}: {result:?}");
//! }
//! ```

use core::fmt;
use std::time::Duration;

use cm_core::{
    AsyncEvent, AsyncEventSource, AsyncEventType, CmError, CmEvent, CmEventType, CmId, Errno,
    NotifyError, NotifyOutcome, QpNum,
};

use crate::sim::{
    FaultAction, FaultRule, MsgKind, SimCmId, SimConfig, SimFabric, SimPair, SimSide,
};

/// One side of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The side that called connect (sends the RTU).
    Active,
    /// The side that accepted (sends the REP, waits for the RTU).
    Passive,
}

/// The two ids of one connection.
#[derive(Debug, Clone)]
pub struct Connection<I> {
    /// The connecting id.
    pub active: I,
    /// The accepted id (from CONNECT_REQUEST).
    pub passive: I,
}

impl<I> Connection<I> {
    /// The id of `side`.
    pub fn id(&self, side: Side) -> &I {
        match side {
            Side::Active => &self.active,
            Side::Passive => &self.passive,
        }
    }
}

/// A CM event as a scenario sees it (already acknowledged by the harness).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeenEvent {
    /// The event.
    pub event: CmEventType,
    /// Its status.
    pub status: i32,
}

impl SeenEvent {
    /// An event with status 0.
    pub const fn ok(event: CmEventType) -> Self {
        SeenEvent { event, status: 0 }
    }
}

/// What a backend must offer to run the scenarios. One harness runs one scenario: the
/// suite builds a fresh one for each, so every connection the harness opens is the
/// only one on its channels.
pub trait Harness {
    /// The backend's id type.
    type Id: CmId;

    /// A one-line description ("simulated fabric, seed 1, COMM_EST on").
    fn describe(&self) -> String;

    /// Whether the passive device raises COMM_EST (soft-RoCE does not: scenarios then
    /// use the receive completion as the trigger).
    fn raises_comm_est(&self) -> bool;

    /// From now on, drop (or stop dropping) every RTU on the wire.
    fn drop_rtus(&mut self, drop: bool) -> Result<(), CmError>;

    /// From now on, delay every RTU by `delay` (`None`: stop). Returns `false` when the
    /// backend cannot (the default): scenarios needing it are skipped.
    fn delay_rtus(&mut self, delay: Option<Duration>) -> Result<bool, CmError> {
        let _ = delay;
        Ok(false)
    }

    /// A freshly created id: no address, no device.
    fn fresh_id(&mut self) -> Result<Self::Id, CmError>;

    /// The harness's listening id.
    fn listener(&mut self) -> Result<Self::Id, CmError>;

    /// Opens a connection up to the point where the passive side has accepted (REP
    /// sent) and the REP reached the active side, which has not processed it yet (no
    /// RTU sent).
    fn connect_until_rep(&mut self) -> Result<Connection<Self::Id>, CmError>;

    /// Lets the active side process the REP: QP to RTS, RTU sent (or dropped). Its
    /// ESTABLISHED event is kept for [`Harness::take_events`].
    fn complete_active(&mut self, conn: &Connection<Self::Id>) -> Result<(), CmError>;

    /// Posts one SEND from the active side.
    fn send_from_active(&mut self, conn: &Connection<Self::Id>) -> Result<(), CmError>;

    /// `rdma_disconnect` on one side.
    fn disconnect(&mut self, conn: &Connection<Self::Id>, side: Side) -> Result<(), CmError>;

    /// Lets in-flight messages and deferred work run; shorter than any CM timeout.
    fn settle(&mut self) -> Result<(), CmError>;

    /// Lets `duration` pass.
    fn wait(&mut self, duration: Duration) -> Result<(), CmError>;

    /// Lets enough time pass for the passive side's REP retries to run out.
    fn wait_for_rep_retries(&mut self) -> Result<(), CmError>;

    /// Every CM event of `side` since the last call, read and acknowledged, oldest
    /// first (setup events such as ADDR_RESOLVED and CONNECT_REQUEST excluded).
    fn take_events(&mut self, side: Side) -> Result<Vec<SeenEvent>, CmError>;

    /// The passive device's asynchronous events since the last call.
    fn take_passive_async_events(&mut self) -> Result<Vec<AsyncEvent>, CmError>;

    /// The QPs of the passive device's receive completions since the last call.
    fn take_passive_completions(&mut self) -> Result<Vec<QpNum>, CmError>;
}

/// How a scenario ended when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every check held.
    Passed,
    /// The backend cannot run the scenario.
    Skipped(&'static str),
}

/// A scenario that did not pass: which one, which check, what was expected and what
/// the backend did. cm-mock's one error type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConformanceError {
    /// A check saw something other than the documented answer (docs/notify-semantics.md).
    Mismatch {
        /// The scenario.
        scenario: &'static str,
        /// The check within it.
        check: String,
        /// The documented answer.
        expected: String,
        /// The backend's answer.
        got: String,
    },
    /// A harness call failed (the errno is kept in the [`CmError`]).
    Backend {
        /// The scenario.
        scenario: &'static str,
        /// What the harness was doing.
        during: &'static str,
        /// The error.
        error: CmError,
    },
}

impl fmt::Display for ConformanceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConformanceError::Mismatch {
                scenario,
                check,
                expected,
                got,
            } => write!(
                f,
                "scenario `{scenario}`: {check}: expected {expected}, got {got}"
            ),
            ConformanceError::Backend {
                scenario,
                during,
                error,
            } => write!(f, "scenario `{scenario}`: {during} failed: {error}"),
        }
    }
}

impl std::error::Error for ConformanceError {}

/// A notify answer written with its errno, as docs/notify-semantics.md writes it: "0",
/// "EISCONN", "EINVAL (22)".
pub fn describe_notify(result: &Result<NotifyOutcome, NotifyError>) -> String {
    match result {
        Ok(NotifyOutcome::Established) => "Ok(Established) (0)".to_owned(),
        Ok(NotifyOutcome::AlreadyEstablished) => "Ok(AlreadyEstablished) (EISCONN)".to_owned(),
        Err(error) => format!("Err({})", Errno(error.errno())),
    }
}

fn describe_events(events: &[SeenEvent]) -> String {
    let parts: Vec<String> = events
        .iter()
        .map(|e| {
            if e.status == 0 {
                e.event.to_string()
            } else {
                format!("{} (status {})", e.event, e.status)
            }
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// Context of a running scenario: turns harness errors and mismatches into
/// [`ConformanceError`]s naming the scenario.
struct Ctx {
    scenario: &'static str,
}

impl Ctx {
    fn call<T>(
        &self,
        during: &'static str,
        result: Result<T, CmError>,
    ) -> Result<T, ConformanceError> {
        result.map_err(|error| ConformanceError::Backend {
            scenario: self.scenario,
            during,
            error,
        })
    }

    fn mismatch(&self, check: &str, expected: String, got: String) -> ConformanceError {
        ConformanceError::Mismatch {
            scenario: self.scenario,
            check: check.to_owned(),
            expected,
            got,
        }
    }

    fn notify<I: CmId>(
        &self,
        check: &str,
        id: &I,
        event: AsyncEventType,
        expected: Result<NotifyOutcome, NotifyError>,
    ) -> Result<(), ConformanceError> {
        let got = id.notify(event);
        if got == expected {
            Ok(())
        } else {
            Err(self.mismatch(check, describe_notify(&expected), describe_notify(&got)))
        }
    }

    fn events<H: Harness>(
        &self,
        check: &str,
        h: &mut H,
        side: Side,
        expected: &[SeenEvent],
    ) -> Result<(), ConformanceError> {
        let got = self.call("reading CM events", h.take_events(side))?;
        if got == expected {
            Ok(())
        } else {
            Err(self.mismatch(check, describe_events(expected), describe_events(&got)))
        }
    }
}

const EINVAL: Result<NotifyOutcome, NotifyError> = Err(NotifyError::WrongState);
const FORCED: Result<NotifyOutcome, NotifyError> = Ok(NotifyOutcome::Established);
const EISCONN: Result<NotifyOutcome, NotifyError> = Ok(NotifyOutcome::AlreadyEstablished);
const ESTABLISHED: SeenEvent = SeenEvent::ok(CmEventType::Established);

/// One scenario: a name and a function over any harness.
pub struct Scenario<H: Harness> {
    /// The scenario's name, as failures print it.
    pub name: &'static str,
    /// Runs it on a fresh harness.
    pub run: fn(&mut H) -> Result<Verdict, ConformanceError>,
}

impl<H: Harness> fmt::Debug for Scenario<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scenario")
            .field("name", &self.name)
            .finish()
    }
}

/// Every scenario of the suite.
pub fn scenarios<H: Harness>() -> Vec<Scenario<H>> {
    vec![
        Scenario {
            name: "normal_connect",
            run: normal_connect::<H>,
        },
        Scenario {
            name: "rtu_lost_then_data_then_notify",
            run: rtu_lost_then_data_then_notify::<H>,
        },
        Scenario {
            name: "rtu_first_then_notify_is_eisconn",
            run: rtu_first_then_notify_is_eisconn::<H>,
        },
        Scenario {
            name: "notify_on_fresh_id",
            run: notify_on_fresh_id::<H>,
        },
        Scenario {
            name: "notify_on_listener",
            run: notify_on_listener::<H>,
        },
        Scenario {
            name: "notify_on_active_before_and_after_rtu",
            run: notify_on_active_before_and_after_rtu::<H>,
        },
        Scenario {
            name: "notify_after_disconnect",
            run: notify_after_disconnect::<H>,
        },
        Scenario {
            name: "late_rtu_gives_no_second_established",
            run: late_rtu_gives_no_second_established::<H>,
        },
        Scenario {
            name: "no_rtu_no_notify_unreachable_then_einval",
            run: no_rtu_no_notify_unreachable_then_einval::<H>,
        },
        Scenario {
            name: "dreq_before_work_item_suppresses_established",
            run: dreq_before_work_item_suppresses_established::<H>,
        },
        Scenario {
            name: "other_event_numbers",
            run: other_event_numbers::<H>,
        },
    ]
}

/// Runs every scenario, each on a fresh harness from `make`.
pub fn run_all<H: Harness>(
    mut make: impl FnMut() -> H,
) -> Vec<(&'static str, Result<Verdict, ConformanceError>)> {
    scenarios::<H>()
        .into_iter()
        .map(|s| {
            let mut harness = make();
            (s.name, (s.run)(&mut harness))
        })
        .collect()
}

fn normal_connect<H: Harness>(h: &mut H) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "normal_connect",
    };
    let conn = cx.call("connect", h.connect_until_rep())?;
    cx.call("active processes REP", h.complete_active(&conn))?;
    cx.call("settle", h.settle())?;
    cx.events("active side events", h, Side::Active, &[ESTABLISHED])?;
    cx.events("passive side events", h, Side::Passive, &[ESTABLISHED])?;
    cx.call("wait", h.wait_for_rep_retries())?;
    cx.events("active side events later", h, Side::Active, &[])?;
    cx.events("passive side events later", h, Side::Passive, &[])?;
    Ok(Verdict::Passed)
}

/// Data from the active side after a lost RTU: the passive device reports COMM_EST
/// (or, on soft-RoCE, a receive completion) on the passive QP.
fn expect_trigger<H: Harness>(
    cx: &Ctx,
    h: &mut H,
    qp: Option<QpNum>,
) -> Result<(), ConformanceError> {
    let completions = cx.call("polling completions", h.take_passive_completions())?;
    if !completions.iter().any(|c| Some(*c) == qp) {
        return Err(cx.mismatch(
            "receive completion on the passive QP",
            format!("{qp:?}"),
            format!("{completions:?}"),
        ));
    }
    let async_events = cx.call("reading async events", h.take_passive_async_events())?;
    let comm_est: Vec<&AsyncEvent> = async_events
        .iter()
        .filter(|e| e.event_type == AsyncEventType::CommEst)
        .collect();
    let expected = usize::from(h.raises_comm_est());
    if comm_est.len() != expected || comm_est.iter().any(|e| e.qp_num() != qp) {
        return Err(cx.mismatch(
            "COMM_EST on the passive QP",
            format!("{expected} COMM_EST on {qp:?}"),
            format!("{async_events:?}"),
        ));
    }
    Ok(())
}

/// The rescue every lost- or late-RTU scenario shares: the active side sends, the
/// passive side sees the trigger, notify forces ESTABLISHED, exactly one ESTABLISHED
/// follows.
fn send_then_notify_forces_established<H: Harness>(
    cx: &Ctx,
    h: &mut H,
    conn: &Connection<H::Id>,
) -> Result<(), ConformanceError> {
    cx.call("send", h.send_from_active(conn))?;
    cx.call("settle", h.settle())?;
    expect_trigger(cx, h, conn.passive.qp_num())?;
    cx.notify(
        "notify(COMM_EST) on the passive id",
        &conn.passive,
        AsyncEventType::CommEst,
        FORCED,
    )?;
    cx.call("settle", h.settle())?;
    cx.events(
        "passive side after notify",
        h,
        Side::Passive,
        &[ESTABLISHED],
    )
}

fn rtu_lost_then_data_then_notify<H: Harness>(h: &mut H) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "rtu_lost_then_data_then_notify",
    };
    cx.call("drop RTUs", h.drop_rtus(true))?;
    let conn = cx.call("connect", h.connect_until_rep())?;
    cx.call("active processes REP", h.complete_active(&conn))?;
    cx.call("settle", h.settle())?;
    cx.events("active side events", h, Side::Active, &[ESTABLISHED])?;
    cx.events("passive side before data", h, Side::Passive, &[])?;
    send_then_notify_forces_established(&cx, h, &conn)?;
    cx.notify(
        "second notify(COMM_EST)",
        &conn.passive,
        AsyncEventType::CommEst,
        EISCONN,
    )?;
    cx.call("wait", h.wait_for_rep_retries())?;
    cx.events("passive side later", h, Side::Passive, &[])?;
    Ok(Verdict::Passed)
}

fn rtu_first_then_notify_is_eisconn<H: Harness>(h: &mut H) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "rtu_first_then_notify_is_eisconn",
    };
    let conn = cx.call("connect", h.connect_until_rep())?;
    cx.call("active processes REP", h.complete_active(&conn))?;
    cx.call("send", h.send_from_active(&conn))?;
    cx.call("settle", h.settle())?;
    cx.events("passive side events", h, Side::Passive, &[ESTABLISHED])?;
    cx.notify(
        "notify(COMM_EST) after the RTU",
        &conn.passive,
        AsyncEventType::CommEst,
        EISCONN,
    )?;
    cx.call("settle", h.settle())?;
    cx.events("passive side after notify", h, Side::Passive, &[])?;
    Ok(Verdict::Passed)
}

fn notify_on_fresh_id<H: Harness>(h: &mut H) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "notify_on_fresh_id",
    };
    let id = cx.call("create id", h.fresh_id())?;
    cx.notify(
        "notify(COMM_EST) on a fresh id",
        &id,
        AsyncEventType::CommEst,
        EINVAL,
    )?;
    Ok(Verdict::Passed)
}

fn notify_on_listener<H: Harness>(h: &mut H) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "notify_on_listener",
    };
    let id = cx.call("listener", h.listener())?;
    cx.notify(
        "notify(COMM_EST) on a listener",
        &id,
        AsyncEventType::CommEst,
        EINVAL,
    )?;
    Ok(Verdict::Passed)
}

fn notify_on_active_before_and_after_rtu<H: Harness>(
    h: &mut H,
) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "notify_on_active_before_and_after_rtu",
    };
    let conn = cx.call("connect", h.connect_until_rep())?;
    cx.notify(
        "notify(COMM_EST) on the active id before its RTU",
        &conn.active,
        AsyncEventType::CommEst,
        EINVAL,
    )?;
    cx.call("active processes REP", h.complete_active(&conn))?;
    cx.call("settle", h.settle())?;
    cx.notify(
        "notify(COMM_EST) on the active id after its RTU",
        &conn.active,
        AsyncEventType::CommEst,
        EISCONN,
    )?;
    cx.events("active side events", h, Side::Active, &[ESTABLISHED])?;
    cx.events("passive side events", h, Side::Passive, &[ESTABLISHED])?;
    Ok(Verdict::Passed)
}

fn notify_after_disconnect<H: Harness>(h: &mut H) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "notify_after_disconnect",
    };
    let conn = cx.call("connect", h.connect_until_rep())?;
    cx.call("active processes REP", h.complete_active(&conn))?;
    cx.call("settle", h.settle())?;
    cx.events("passive side events", h, Side::Passive, &[ESTABLISHED])?;
    cx.call("disconnect", h.disconnect(&conn, Side::Active))?;
    cx.call("settle", h.settle())?;
    cx.notify(
        "notify(COMM_EST) on the disconnecting active id",
        &conn.active,
        AsyncEventType::CommEst,
        EINVAL,
    )?;
    cx.notify(
        "notify(COMM_EST) on the disconnected passive id",
        &conn.passive,
        AsyncEventType::CommEst,
        EINVAL,
    )?;
    cx.events(
        "passive side after the DREQ",
        h,
        Side::Passive,
        &[SeenEvent::ok(CmEventType::Disconnected)],
    )?;
    Ok(Verdict::Passed)
}

fn late_rtu_gives_no_second_established<H: Harness>(
    h: &mut H,
) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "late_rtu_gives_no_second_established",
    };
    // Late, but before the first REP retransmission (~4 s).
    if !cx.call("delay RTUs", h.delay_rtus(Some(Duration::from_secs(1))))? {
        return Ok(Verdict::Skipped("the backend cannot delay RTUs"));
    }
    let conn = cx.call("connect", h.connect_until_rep())?;
    cx.call("active processes REP", h.complete_active(&conn))?;
    // Notify comes before the late RTU.
    send_then_notify_forces_established(&cx, h, &conn)?;
    cx.call("wait for the late RTU", h.wait(Duration::from_secs(2)))?;
    cx.events("passive side after the late RTU", h, Side::Passive, &[])?;
    cx.notify(
        "notify(COMM_EST) after the late RTU",
        &conn.passive,
        AsyncEventType::CommEst,
        EISCONN,
    )?;
    Ok(Verdict::Passed)
}

fn no_rtu_no_notify_unreachable_then_einval<H: Harness>(
    h: &mut H,
) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "no_rtu_no_notify_unreachable_then_einval",
    };
    cx.call("drop RTUs", h.drop_rtus(true))?;
    let conn = cx.call("connect", h.connect_until_rep())?;
    cx.call("active processes REP", h.complete_active(&conn))?;
    cx.call("wait for the REP retries", h.wait_for_rep_retries())?;
    cx.events(
        "passive side after the REP retries",
        h,
        Side::Passive,
        &[SeenEvent {
            event: CmEventType::Unreachable,
            status: -cm_core::errno::ETIMEDOUT,
        }],
    )?;
    cx.notify(
        "notify(COMM_EST) after UNREACHABLE",
        &conn.passive,
        AsyncEventType::CommEst,
        EINVAL,
    )?;
    Ok(Verdict::Passed)
}

fn dreq_before_work_item_suppresses_established<H: Harness>(
    h: &mut H,
) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "dreq_before_work_item_suppresses_established",
    };
    cx.call("drop RTUs", h.drop_rtus(true))?;
    let conn = cx.call("connect", h.connect_until_rep())?;
    cx.call("active processes REP", h.complete_active(&conn))?;
    cx.call("send", h.send_from_active(&conn))?;
    cx.call("settle", h.settle())?;
    cx.notify(
        "notify(COMM_EST)",
        &conn.passive,
        AsyncEventType::CommEst,
        FORCED,
    )?;
    // No settling: the active side's DREQ races the deferred work item.
    cx.call("disconnect", h.disconnect(&conn, Side::Active))?;
    cx.call("settle", h.settle())?;
    cx.events(
        "passive side events",
        h,
        Side::Passive,
        &[SeenEvent::ok(CmEventType::Disconnected)],
    )?;
    Ok(Verdict::Passed)
}

/// The answer for any event number other than COMM_EST (docs/notify-semantics.md): PATH_MIG is accepted
/// only on an ESTABLISHED id (LAP state UNINIT), everything else is EINVAL.
fn other_event_numbers<H: Harness>(h: &mut H) -> Result<Verdict, ConformanceError> {
    let cx = Ctx {
        scenario: "other_event_numbers",
    };
    cx.call("drop RTUs", h.drop_rtus(true))?;
    let conn = cx.call("connect", h.connect_until_rep())?;
    cx.call("active processes REP", h.complete_active(&conn))?;
    cx.call("settle", h.settle())?;
    let numbers = (0..=24u32).chain([31, 255, 1 << 16, u32::MAX]);
    for raw in numbers.clone().filter(|&n| n != 4) {
        let event = AsyncEventType::from_raw(raw);
        // Passive side: REP_SENT (the RTU is lost). Active side: ESTABLISHED.
        cx.notify(
            &format!("notify({event}, #{raw}) on the passive id in REP_SENT"),
            &conn.passive,
            event,
            EINVAL,
        )?;
        let on_established = if event == AsyncEventType::PathMig {
            FORCED
        } else {
            EINVAL
        };
        cx.notify(
            &format!("notify({event}, #{raw}) on the established active id"),
            &conn.active,
            event,
            on_established,
        )?;
    }
    cx.call("settle", h.settle())?;
    // None of them changed anything: no event, and COMM_EST still forces.
    cx.events("passive side events", h, Side::Passive, &[])?;
    cx.notify(
        "notify(COMM_EST) afterwards",
        &conn.passive,
        AsyncEventType::CommEst,
        FORCED,
    )?;
    Ok(Verdict::Passed)
}

/// [`Harness`] on the simulated fabric: two nodes, a listener on the first.
#[derive(Debug)]
pub struct SimHarness {
    pair: SimPair,
    listener: SimCmId,
    seed: u64,
    active_seen: Vec<SeenEvent>,
}

/// The port the harness listens on.
const PORT: u16 = 18515;

impl SimHarness {
    /// A harness on a fresh fabric with `config` and `seed`.
    pub fn new(config: SimConfig, seed: u64) -> Self {
        let pair = SimPair::new(config, seed);
        let listener = pair.listen(PORT).expect("a fresh id binds and listens");
        SimHarness {
            pair,
            listener,
            seed,
            active_seen: Vec::new(),
        }
    }

    /// The fabric, for inspection (trace, stats).
    pub fn fabric(&self) -> &SimFabric {
        &self.pair.fabric
    }

    fn drain(side: &mut SimSide, into: &mut Vec<SeenEvent>) -> Result<(), CmError> {
        while let Some(event) = side.next_event()? {
            into.push(SeenEvent {
                event: event.event_type(),
                status: event.status(),
            });
            event.ack()?;
        }
        Ok(())
    }
}

impl Harness for SimHarness {
    type Id = SimCmId;

    fn describe(&self) -> String {
        let config = self.pair.fabric.config();
        format!(
            "simulated fabric, seed {}, COMM_EST {}",
            self.seed,
            if config.comm_est {
                "on"
            } else {
                "off (soft-RoCE)"
            }
        )
    }

    fn raises_comm_est(&self) -> bool {
        self.pair.fabric.config().comm_est
    }

    fn drop_rtus(&mut self, drop: bool) -> Result<(), CmError> {
        self.pair.fabric.clear_faults();
        if drop {
            self.pair
                .fabric
                .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
        }
        Ok(())
    }

    fn delay_rtus(&mut self, delay: Option<Duration>) -> Result<bool, CmError> {
        self.pair.fabric.clear_faults();
        if let Some(delay) = delay {
            self.pair
                .fabric
                .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Delay(delay)));
        }
        Ok(true)
    }

    fn fresh_id(&mut self) -> Result<SimCmId, CmError> {
        Ok(self.pair.client.channel.create_id())
    }

    fn listener(&mut self) -> Result<SimCmId, CmError> {
        Ok(self.listener.clone())
    }

    fn connect_until_rep(&mut self) -> Result<Connection<SimCmId>, CmError> {
        let (active, passive) = self.pair.connect_until_rep(PORT)?;
        Ok(Connection { active, passive })
    }

    fn complete_active(&mut self, _conn: &Connection<SimCmId>) -> Result<(), CmError> {
        Self::drain(&mut self.pair.client, &mut self.active_seen)
    }

    fn send_from_active(&mut self, conn: &Connection<SimCmId>) -> Result<(), CmError> {
        conn.active.post_send(64)
    }

    fn disconnect(&mut self, conn: &Connection<SimCmId>, side: Side) -> Result<(), CmError> {
        conn.id(side).disconnect()
    }

    fn settle(&mut self) -> Result<(), CmError> {
        self.pair.fabric.advance(Duration::from_millis(10));
        Ok(())
    }

    fn wait(&mut self, duration: Duration) -> Result<(), CmError> {
        self.pair.fabric.advance(duration);
        Ok(())
    }

    fn wait_for_rep_retries(&mut self) -> Result<(), CmError> {
        let config = self.pair.fabric.config();
        let sends = config.max_cm_retries.saturating_add(1);
        self.pair
            .fabric
            .advance(config.cm_response_timeout.saturating_mul(sends) + Duration::from_secs(1));
        Ok(())
    }

    fn take_events(&mut self, side: Side) -> Result<Vec<SeenEvent>, CmError> {
        match side {
            Side::Active => {
                let mut seen = std::mem::take(&mut self.active_seen);
                Self::drain(&mut self.pair.client, &mut seen)?;
                Ok(seen)
            }
            Side::Passive => {
                let mut seen = Vec::new();
                Self::drain(&mut self.pair.server, &mut seen)?;
                Ok(seen)
            }
        }
    }

    fn take_passive_async_events(&mut self) -> Result<Vec<AsyncEvent>, CmError> {
        let mut events = Vec::new();
        while let Some(event) = self.pair.server.device.try_next_async_event()? {
            events.push(event);
        }
        Ok(events)
    }

    fn take_passive_completions(&mut self) -> Result<Vec<QpNum>, CmError> {
        let mut qps = Vec::new();
        while let Some(completion) = self.pair.server.device.poll_cq() {
            qps.push(completion.qp);
        }
        Ok(qps)
    }
}
