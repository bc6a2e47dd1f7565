//! Measurements on a real RDMA device (soft-RoCE in the VM, or hardware): cm-sys
//! `notify` on an established id, the lost-RTU trigger (the passive side's receive
//! completion: soft-RoCE raises no COMM_EST) to the application reading ESTABLISHED
//! through the pump and event loop and through the connection API (`Endpoint`) against
//! hand-written loops over the cm-sys calls, interleaved in one process, and connection
//! setup per step like `cmtime`.
//!
//! Needs `CMNOTIFY_ADDR_A` (listener side) and `CMNOTIFY_ADDR_B` (connecting side) on
//! RDMA devices, and `CMNOTIFY_NFT` (nft) to drop the RTU on A's INPUT hook. Without
//! them every figure is recorded as skipped, with the reason.
//!
//! The parts: `fixture` (setup, the client, accepting, teardown, the RTU drop),
//! `stats` (medians and their intervals), and one module per server: `hand` (the
//! hand-written loops), `pump` (cm-verbs' event loop and pump), `api` (the `Endpoint`).

mod api;
pub mod data;
mod fixture;
mod hand;
mod pump;
mod stats;

use std::time::{Duration, Instant};

use cm_core::{AsyncEventType, NotifyOutcome};
use cm_sys::{CmId, EventChannel, MemoryRegion};
use criterion::Criterion;

use crate::results::{record, Figure};
use api::ApiServer;
use fixture::{connect_and_send, disconnect, err, Client, SetupSteps, SETTLE};
pub use fixture::{setup, Setup};
use hand::HandServer;
use pump::PumpServer;
use stats::{interquartile, median, nanos, ratio_interval};

/// Figures of one real run.
#[derive(Debug, Clone, Default)]
pub struct RealFigures {
    /// Median cm-sys `notify` (EISCONN on an established id), ns.
    pub notify_ns: f64,
    /// Median receive completion → ESTABLISHED through the pump, ns.
    pub pump_ns: Option<f64>,
    /// The same through the hand-written loop, ns.
    pub hand_ns: Option<f64>,
    /// Interquartile ranges of the two paths, for judging the ratio's noise.
    pub spread: String,
    /// Median client's send → ESTABLISHED returned by the `Endpoint` API, ns.
    pub api_ns: Option<f64>,
    /// The same through the hand-written loop waiting as the API waits (`poll(2)` on
    /// the CM channel, asynchronous events and completion channel) and, as the API
    /// does, reading the message and posting its receive again, ns.
    pub hand_waiting_ns: Option<f64>,
    /// The same through the hand-written loop spinning on the receive CQ (the pump's
    /// baseline, timed from the send), ns: what waiting instead of spinning costs.
    pub hand_spinning_ns: Option<f64>,
    /// Median client's send → ESTABLISHED returned by the `Endpoint` API with busy
    /// polling on (it spins on its sources before it would sleep), ns: against
    /// [`RealFigures::hand_spinning_ns`].
    pub api_busy_ns: Option<f64>,
    /// Sample counts, interquartile ranges and the ratio's interval of the API figure.
    pub api_spread: String,
    /// The same for the busy-polling API figure.
    pub api_busy_spread: String,
    /// Why the trigger figures are missing.
    pub trigger_skipped: Option<String>,
    /// Median setup step times (name, ns).
    pub setup_ns: Vec<(&'static str, f64)>,
}

/// The four measured servers, in the order one block of rounds visits them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// [`HandServer`] spinning on the receive CQ.
    HandSpinning,
    /// [`PumpServer`].
    Pump,
    /// [`ApiServer`].
    Api,
    /// [`ApiServer`] with busy polling on.
    ApiBusy,
    /// [`HandServer`] waiting on its completion channel.
    HandWaiting,
}

/// Each path twice in 10 rounds, the second half mirroring the first: no path always
/// follows another's teardown.
const ROUNDS: [Path; 10] = [
    Path::HandSpinning,
    Path::Pump,
    Path::Api,
    Path::HandWaiting,
    Path::ApiBusy,
    Path::ApiBusy,
    Path::HandWaiting,
    Path::Api,
    Path::Pump,
    Path::HandSpinning,
];

/// How long the busy-polling `Endpoint` spins before it would sleep: longer than a
/// whole send → ESTABLISHED, so it never sleeps in the measurement.
const BUSY_POLL: Duration = Duration::from_millis(20);

/// Where the time of one waiting path's sample went, both from the client's send.
#[derive(Debug, Clone, Copy)]
struct Phases {
    /// To `rdma_notify` returning (the receive completion's wake-up, its reads and the
    /// notify itself).
    notified: Duration,
    /// To ESTABLISHED read (and, for the API, `accept` returning).
    established: Duration,
}

/// Samples of every path.
///
/// What is measured. The pump and its hand loop both spin on the receive CQ and time
/// from the moment the completion is polled to ESTABLISHED read and acknowledged. The
/// `Endpoint` owns its CQs (its reader sees the completion on the device's completion
/// channel), so nothing outside it can see when the completion became available: its
/// figure and its hand loop's both start just before the client posts its SEND
/// ([`Client::sent`], taken the same way for every path) and end when ESTABLISHED has
/// been read and acknowledged (the API: when `Endpoint::accept` returns the
/// connection). That hand loop waits as the endpoint waits (`poll(2)` on the CM
/// channel, the asynchronous events and a completion channel; CQs re-armed then polled;
/// the message copied out and its receive posted again), so the ratio compares the
/// endpoint's work per event with the same work written by hand, not blocking with
/// spinning. The send → completion part (soft-RoCE's send and receive processing) is
/// common to both and dilutes the ratio towards 1: the absolute difference of the
/// medians is reported next to it. The spinning hand loop timed from the send shows
/// what waiting costs against spinning.
#[derive(Debug, Default)]
struct Samples {
    /// Receive completion seen → ESTABLISHED read (spinning on the CQ: the pump and its
    /// hand loop).
    pump: Vec<Duration>,
    hand: Vec<Duration>,
    /// Client's send → ESTABLISHED read.
    api: Vec<Duration>,
    hand_waiting: Vec<Duration>,
    hand_spinning: Vec<Duration>,
    api_busy: Vec<Duration>,
    /// Client's send → `rdma_notify` returned, of `api` and `hand_waiting`.
    api_notified: Vec<Duration>,
    hand_waiting_notified: Vec<Duration>,
}

/// Measures everything: `connections` lost-RTU connections per path (five paths),
/// interleaved.
pub fn measure(setup: &Setup, connections: usize) -> Result<RealFigures, String> {
    let client_channel = EventChannel::new().map_err(err("rdma_create_event_channel"))?;
    let mut hand = HandServer::new(setup)?;
    let mut figures = RealFigures::default();
    let mut steps_seen: Vec<SetupSteps> = Vec::new();

    // cm-sys notify on an established connection (the RTU arrives: no drop yet).
    {
        let (client, server, _memory, steps) = established_on(setup, &client_channel, &hand)?;
        steps_seen.push(steps);
        let mut samples = Vec::new();
        for _ in 0..if connections > 10 { 200 } else { 50 } {
            let start = Instant::now();
            for _ in 0..100 {
                let answer = server.notify(AsyncEventType::CommEst);
                if answer != Ok(NotifyOutcome::AlreadyEstablished) {
                    return Err(format!("notify on an established id: {answer:?}"));
                }
            }
            samples.push(start.elapsed() / 100);
        }
        figures.notify_ns = nanos(median(&mut samples));
        disconnect(&client, &client_channel, || hand.answer_disconnect(&server))?;
    }

    let Some(nft) = setup.nft.as_deref() else {
        figures.trigger_skipped = Some("CMNOTIFY_NFT names no nft to drop the RTU".into());
        return Ok(figures);
    };
    let mut pumped = PumpServer::new(setup)?;
    // One endpoint for both API paths: a process has one reader per device.
    let mut api = ApiServer::new(setup)?;

    let _rtu_drop = setup.drop_rtus(nft)?;
    let mut samples = Samples::default();
    for round in 0..ROUNDS.len() / 2 * connections {
        // Let the previous teardown's kernel work finish before the next measurement.
        std::thread::sleep(SETTLE);
        let mut steps = SetupSteps::default();
        let path = ROUNDS[round % ROUNDS.len()];
        match path {
            Path::HandSpinning | Path::HandWaiting => {
                let waiting = path == Path::HandWaiting;
                let mut server_side = None;
                let client =
                    connect_and_send(setup, &client_channel, hand.addr, &mut steps, || {
                        server_side = Some(hand.accept_one(waiting)?);
                        Ok(())
                    })?;
                let (server, memory) = server_side.ok_or("not accepted")?;
                if waiting {
                    let phases = hand.send_to_established(&server, &memory, client.sent)?;
                    samples.hand_waiting.push(phases.established);
                    samples.hand_waiting_notified.push(phases.notified);
                } else {
                    let (trigger, established) = hand.trigger_to_established(&server)?;
                    samples.hand.push(established - trigger);
                    samples.hand_spinning.push(established - client.sent);
                }
                disconnect(&client, &client_channel, || hand.answer_disconnect(&server))?;
            }
            Path::Pump => {
                let mut server_side = None;
                let client =
                    connect_and_send(setup, &client_channel, pumped.addr, &mut steps, || {
                        server_side = Some(pumped.accept_one()?);
                        Ok(())
                    })?;
                let (server, _memory) = server_side.ok_or("not accepted")?;
                let (trigger, established) = pumped.trigger_to_established(&server)?;
                samples.pump.push(established - trigger);
                disconnect(&client, &client_channel, || {
                    pumped.answer_disconnect(&server)
                })?;
            }
            Path::Api | Path::ApiBusy => {
                let busy = path == Path::ApiBusy;
                api.set_busy_poll(busy.then_some(BUSY_POLL));
                let server = &mut api;
                let into = if busy {
                    &mut samples.api_busy
                } else {
                    &mut samples.api
                };
                let mut server_side = None;
                let client =
                    connect_and_send(setup, &client_channel, server.addr, &mut steps, || {
                        server_side = Some(server.accept_one()?);
                        Ok(())
                    })?;
                let conn = server_side.ok_or("not accepted")?;
                let phases = server.send_to_established(conn, client.sent)?;
                into.push(phases.established);
                if !busy {
                    samples.api_notified.push(phases.notified);
                }
                disconnect(&client, &client_channel, || server.answer_disconnect(conn))?;
            }
        }
        steps_seen.push(steps);
    }
    figures.pump_ns = Some(nanos(median(&mut samples.pump)));
    figures.hand_ns = Some(nanos(median(&mut samples.hand)));
    let (low, high) = ratio_interval(&samples.pump, &samples.hand);
    figures.spread = format!(
        "{} samples each; p25–p75 pump {}, hand loop {}; the ratio within both medians' 95% \
         intervals: {low:.2}–{high:.2}",
        connections,
        interquartile(&samples.pump),
        interquartile(&samples.hand)
    );
    figures.api_ns = Some(nanos(median(&mut samples.api)));
    figures.hand_waiting_ns = Some(nanos(median(&mut samples.hand_waiting)));
    figures.hand_spinning_ns = Some(nanos(median(&mut samples.hand_spinning)));
    figures.api_busy_ns = Some(nanos(median(&mut samples.api_busy)));
    let (low, high) = ratio_interval(&samples.api_busy, &samples.hand_spinning);
    figures.api_busy_spread = format!(
        "{connections} samples each; p25–p75 busy-polling API {}, spinning hand loop {}; the \
         ratio within both medians' 95% intervals: {low:.2}–{high:.2}",
        interquartile(&samples.api_busy),
        interquartile(&samples.hand_spinning)
    );
    let (low, high) = ratio_interval(&samples.api, &samples.hand_waiting);
    let difference =
        figures.api_ns.unwrap_or_default() - figures.hand_waiting_ns.unwrap_or_default();
    let micros = |samples: &mut Vec<Duration>| median(samples).as_secs_f64() * 1e6;
    let (api_notified, hand_notified) = (
        micros(&mut samples.api_notified),
        micros(&mut samples.hand_waiting_notified),
    );
    figures.api_spread = format!(
        "{} samples each; the medians differ by {:+.0} µs; p25–p75 API {}, waiting hand loop \
         {}, spinning hand loop {}; the ratio within both medians' 95% intervals: \
         {low:.2}–{high:.2}; send → notify returned: API {api_notified:.0} µs, hand loop \
         {hand_notified:.0} µs (the rest, to ESTABLISHED read: {:.0} / {:.0} µs)",
        connections,
        difference / 1e3,
        interquartile(&samples.api),
        interquartile(&samples.hand_waiting),
        interquartile(&samples.hand_spinning),
        figures.api_ns.unwrap_or_default() / 1e3 - api_notified,
        figures.hand_waiting_ns.unwrap_or_default() / 1e3 - hand_notified,
    );
    let step = |f: fn(&SetupSteps) -> Duration| {
        let mut samples: Vec<Duration> = steps_seen.iter().map(f).collect();
        nanos(median(&mut samples))
    };
    figures.setup_ns = vec![
        ("resolve_addr", step(|s| s.resolve_addr)),
        ("resolve_route", step(|s| s.resolve_route)),
        ("connect_to_accepted", step(|s| s.connect_to_accepted)),
        (
            "accepted_to_established",
            step(|s| s.accepted_to_established),
        ),
    ];
    Ok(figures)
}

/// Where the raw-call baseline is measured instead.
pub const RAW_BASELINE_MISSING: &str = "measured in cm-sys's own test \
    (crates/cm-sys/tests/notify_overhead.rs: the bare call needs `unsafe`, which only cm-sys \
    may use); `cargo xtask bench --vm` runs it and reads its figure, and every CI run prints \
    its `notify overhead:` line in the VM console log";

/// Records `figures` (or the skip reason) in the results file; returns the records.
pub fn record_figures(result: &Result<RealFigures, String>, machine: &str) -> Vec<Figure> {
    // Unoptimised code is slow enough to show in the ratios (pump / hand loop measured
    // 1.41 unoptimised, 0.98 optimised): say so next to every figure.
    let machine = &if cfg!(debug_assertions) {
        format!("{machine}; UNOPTIMISED build: ratios include debug-code overhead")
    } else {
        machine.to_string()
    };
    let mut out = Vec::new();
    match result {
        Err(reason) => {
            for key in [
                cm_testkit::figure_keys::REAL_NOTIFY,
                cm_testkit::figure_keys::REAL_TRIGGER_TO_ESTABLISHED,
                cm_testkit::figure_keys::REAL_API_TO_ESTABLISHED,
                cm_testkit::figure_keys::REAL_API_BUSY_TO_ESTABLISHED,
                cm_testkit::figure_keys::REAL_SETUP,
            ] {
                out.push(Figure::skipped(key, reason));
            }
        }
        Ok(f) => {
            out.push(Figure::measured(
                "real/notify/cm_sys",
                f.notify_ns,
                "ns",
                &format!("cm-sys CmId::notify, EISCONN on an established id; {machine}"),
            ));
            out.push(Figure::skipped(
                cm_testkit::figure_keys::REAL_NOTIFY,
                RAW_BASELINE_MISSING,
            ));
            let not_measured = f.trigger_skipped.as_deref().unwrap_or("not measured");
            match (f.pump_ns, f.hand_ns) {
                (Some(pump), Some(hand)) => {
                    out.push(Figure::measured(
                        cm_testkit::figure_keys::REAL_TRIGGER_TO_ESTABLISHED,
                        pump / hand,
                        "ratio",
                        &format!(
                            "receive completion (RTU dropped) → ESTABLISHED read, medians: pump \
                             {:.0} µs / hand loop over cm-sys calls {:.0} µs ({}); {machine}",
                            pump / 1e3,
                            hand / 1e3,
                            f.spread
                        ),
                    ));
                    out.push(Figure::measured(
                        "real/trigger_to_established/pump",
                        pump,
                        "ns",
                        machine,
                    ));
                    out.push(Figure::measured(
                        "real/trigger_to_established/hand_loop",
                        hand,
                        "ns",
                        machine,
                    ));
                }
                _ => out.push(Figure::skipped(
                    cm_testkit::figure_keys::REAL_TRIGGER_TO_ESTABLISHED,
                    not_measured,
                )),
            }
            match (f.api_ns, f.hand_waiting_ns) {
                (Some(api), Some(hand)) => {
                    let spinning = f.hand_spinning_ns.map_or_else(String::new, |s| {
                        format!(", spinning on the CQ {:.0} µs", s / 1e3)
                    });
                    out.push(Figure::measured(
                        cm_testkit::figure_keys::REAL_API_TO_ESTABLISHED,
                        api / hand,
                        "ratio",
                        &format!(
                            "client's SEND (RTU dropped) → ESTABLISHED returned, medians: \
                             Endpoint::accept {:.0} µs / hand loop over cm-sys calls waiting in \
                             poll(2) on the CM, async and completion channels, reading the \
                             message and re-posting its receive as the endpoint does {:.0} µs \
                             (hand loop{spinning}; {}); {machine}",
                            api / 1e3,
                            hand / 1e3,
                            f.api_spread
                        ),
                    ));
                    out.push(Figure::measured(
                        "real/api_to_established/api",
                        api,
                        "ns",
                        machine,
                    ));
                    out.push(Figure::measured(
                        "real/api_to_established/hand_loop",
                        hand,
                        "ns",
                        machine,
                    ));
                    if let Some(spinning) = f.hand_spinning_ns {
                        out.push(Figure::measured(
                            "real/api_to_established/hand_loop_spinning",
                            spinning,
                            "ns",
                            machine,
                        ));
                    }
                }
                _ => out.push(Figure::skipped(
                    cm_testkit::figure_keys::REAL_API_TO_ESTABLISHED,
                    not_measured,
                )),
            }
            match (f.api_busy_ns, f.hand_spinning_ns) {
                (Some(busy), Some(spinning)) => out.push(Figure::measured(
                    cm_testkit::figure_keys::REAL_API_BUSY_TO_ESTABLISHED,
                    busy / spinning,
                    "ratio",
                    &format!(
                        "client's SEND (RTU dropped) → ESTABLISHED returned, medians: \
                         Endpoint::accept busy polling {:.0} µs / hand loop spinning on the \
                         receive CQ {:.0} µs ({}); {machine}",
                        busy / 1e3,
                        spinning / 1e3,
                        f.api_busy_spread
                    ),
                )),
                _ => out.push(Figure::skipped(
                    cm_testkit::figure_keys::REAL_API_BUSY_TO_ESTABLISHED,
                    not_measured,
                )),
            }
            for (step, value) in &f.setup_ns {
                out.push(Figure::measured(
                    &format!("real/setup/{step}"),
                    *value,
                    "ns",
                    machine,
                ));
            }
        }
    }
    for figure in &out {
        record(figure);
    }
    out
}

/// One connection from `client_channel` to the hand server, established on both sides
/// with its RTU delivered: the client, the server's id and memory, the setup steps.
fn established_on(
    setup: &Setup,
    client_channel: &EventChannel,
    hand: &HandServer,
) -> Result<(Client, CmId, MemoryRegion, SetupSteps), String> {
    let mut steps = SetupSteps::default();
    let mut server_side = None;
    let client = connect_and_send(setup, client_channel, hand.addr, &mut steps, || {
        server_side = Some(hand.accept_one(false)?);
        Ok(())
    })?;
    let (server, memory) = server_side.ok_or("not accepted")?;
    hand.expect_established()?;
    Ok((client, server, memory, steps))
}

/// Criterion on cm-sys `notify` (EISCONN) on the passive id of an established
/// connection.
fn bench_cm_sys_notify(c: &mut Criterion, setup: &Setup) -> Result<(), String> {
    let client_channel = EventChannel::new().map_err(err("rdma_create_event_channel"))?;
    let hand = HandServer::new(setup)?;
    let (client, server, _memory, _steps) = established_on(setup, &client_channel, &hand)?;
    c.bench_function("real/notify_cm_sys", |b| {
        b.iter(|| server.notify(AsyncEventType::CommEst))
    });
    disconnect(&client, &client_channel, || hand.answer_disconnect(&server))
}

/// The criterion part: cm-sys notify on an established id, then the interleaved ratio
/// figures; on a machine without a device, every figure recorded as skipped.
pub fn criterion_benches(c: &mut Criterion) {
    let machine = crate::machine_label();
    let setup = match setup() {
        Ok(setup) => setup,
        Err(reason) => {
            record_figures(&Err(reason), &machine);
            return;
        }
    };
    if let Err(e) = bench_cm_sys_notify(c, &setup) {
        eprintln!("cm-benches: real/notify_cm_sys failed: {e}");
    }
    let connections = if crate::smoke_mode() { 5 } else { 30 };
    let result = measure(&setup, connections).map_err(|e| format!("measurement failed: {e}"));
    record_figures(&result, &machine);
}
