//! Measurements on a real RDMA device (soft-RoCE in the VM, or hardware): cm-sys
//! `notify` on an established id, the lost-RTU trigger (the passive side's receive
//! completion: soft-RoCE raises no COMM_EST) to the application reading ESTABLISHED
//! through the pump and event loop against a hand-written loop over the cm-sys calls,
//! interleaved in one process, and connection setup per step like `cmtime`.
//!
//! Needs `CMNOTIFY_ADDR_A` (listener side) and `CMNOTIFY_ADDR_B` (connecting side) on
//! RDMA devices, and `CMNOTIFY_NFT` (nft) to drop the RTU on A's INPUT hook. Without
//! them every figure is recorded as skipped, with the reason.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use cm_core::{AsyncEventType, CmEventType, NotifyOutcome};
use cm_sys::{
    AsyncEvents, CmEvent, CmId, ConnParams, EventChannel, MemoryRegion, QpCaps, RdmaBackend,
};
use cm_verbs::{
    rdma::PollWaiter, BackendLoop, Control, EventLoop, LoopEvent, NotifyPump, PumpEvent, Ready,
    Role, Waiter,
};
use criterion::Criterion;

use crate::results::{record, Figure};

/// How long any single wait may take before the measurement gives up.
const WAIT: Duration = Duration::from_secs(10);
/// Pause between two measured connections.
const SETTLE: Duration = Duration::from_millis(5);
/// The kernel's timeout of one address or route resolution attempt.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the real measurements run.
#[derive(Debug, Clone)]
pub struct Setup {
    addr_a: IpAddr,
    addr_b: IpAddr,
    nft: Option<String>,
}

/// The setup, or why the real path cannot run here (the skip reason).
pub fn setup() -> Result<Setup, String> {
    if !std::path::Path::new("/dev/infiniband/rdma_cm").exists() {
        return Err("no RDMA device (/dev/infiniband/rdma_cm does not exist)".into());
    }
    let has_device = std::fs::read_dir("/sys/class/infiniband")
        .map(|mut entries| entries.next().is_some())
        .unwrap_or(false);
    if !has_device {
        return Err("no RDMA device (/sys/class/infiniband is empty)".into());
    }
    let addr = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
    match (addr("CMNOTIFY_ADDR_A"), addr("CMNOTIFY_ADDR_B")) {
        (Some(addr_a), Some(addr_b)) => Ok(Setup {
            addr_a,
            addr_b,
            nft: std::env::var("CMNOTIFY_NFT").ok(),
        }),
        _ => Err("a device exists but CMNOTIFY_ADDR_A/CMNOTIFY_ADDR_B name no addresses".into()),
    }
}

fn err(op: &str) -> impl Fn(cm_core::CmError) -> String + '_ {
    move |e| format!("{op}: {e}")
}

/// The next event on `channel` within [`WAIT`], which must be `expected` with status 0.
fn expect_event(channel: &EventChannel, expected: CmEventType) -> Result<CmEvent, String> {
    let event = channel
        .next_event_timeout(WAIT)
        .map_err(err("rdma_get_cm_event"))?
        .ok_or_else(|| format!("no {expected} within {WAIT:?}"))?;
    if event.event_type() != expected || event.status() != 0 {
        return Err(format!(
            "expected {expected}, got {} (status {})",
            event.event_type(),
            event.status()
        ));
    }
    Ok(event)
}

/// Time of each connection-setup step.
#[derive(Debug, Clone, Copy, Default)]
struct SetupSteps {
    resolve_addr: Duration,
    resolve_route: Duration,
    connect_to_accepted: Duration,
    accepted_to_established: Duration,
}

/// A client id resolved from `src` to `dst`, retrying the first ADDR_ERROR (the
/// neighbour entry may still be resolving right after boot).
fn resolved_client(
    channel: &EventChannel,
    src: IpAddr,
    dst: SocketAddr,
    steps: &mut SetupSteps,
) -> Result<CmId, String> {
    let deadline = Instant::now() + WAIT;
    let id = loop {
        let id = channel.create_id().map_err(err("rdma_create_id"))?;
        let start = Instant::now();
        id.resolve_addr(Some(SocketAddr::new(src, 0)), dst, RESOLVE_TIMEOUT)
            .map_err(err("rdma_resolve_addr"))?;
        let event = channel
            .next_event_timeout(RESOLVE_TIMEOUT * 2)
            .map_err(err("rdma_get_cm_event"))?
            .ok_or("no address resolution event")?;
        steps.resolve_addr = start.elapsed();
        match event.event_type() {
            CmEventType::AddrResolved => {
                event.ack().map_err(err("ack"))?;
                break id;
            }
            CmEventType::AddrError if Instant::now() < deadline => continue,
            other => return Err(format!("resolving {dst}: {other}")),
        }
    };
    let start = Instant::now();
    id.resolve_route(RESOLVE_TIMEOUT)
        .map_err(err("rdma_resolve_route"))?;
    expect_event(channel, CmEventType::RouteResolved)?
        .ack()
        .map_err(err("ack"))?;
    steps.resolve_route = start.elapsed();
    Ok(id)
}

/// The client side of one connection, established and having sent its first SEND.
struct Client {
    id: CmId,
}

/// Connects a client to `to`, leaving the server side to `serve` (which must accept
/// the request it is given and return when accepted), then sends 5 bytes as soon as the
/// client is ESTABLISHED (the data that reaches the passive QP before its lost RTU).
fn connect_and_send(
    setup: &Setup,
    client_channel: &EventChannel,
    to: SocketAddr,
    steps: &mut SetupSteps,
    serve: impl FnOnce() -> Result<(), String>,
) -> Result<Client, String> {
    let id = resolved_client(client_channel, setup.addr_b, to, steps)?;
    id.create_qp(&QpCaps::default())
        .map_err(err("rdma_create_qp"))?;
    let memory = id.register_memory(16).map_err(err("ibv_reg_mr"))?;
    id.write_memory(&memory, 0, b"early")
        .map_err(err("write"))?;
    let start = Instant::now();
    id.connect(&ConnParams::default())
        .map_err(err("rdma_connect"))?;
    serve()?;
    let accepted = Instant::now();
    steps.connect_to_accepted = accepted - start;
    expect_event(client_channel, CmEventType::Established)?
        .ack()
        .map_err(err("ack"))?;
    steps.accepted_to_established = accepted.elapsed();
    id.post_send(&memory, 0..5, 1)
        .map_err(err("ibv_post_send"))?;
    Ok(Client { id })
}

/// Accepts a connection request on a fresh QP with one receive posted.
fn accept(id: &CmId) -> Result<MemoryRegion, String> {
    id.create_qp(&QpCaps::default())
        .map_err(err("rdma_create_qp"))?;
    let memory = id.register_memory(16).map_err(err("ibv_reg_mr"))?;
    id.post_recv(&memory, 0..16, 1)
        .map_err(err("ibv_post_recv"))?;
    id.accept(&ConnParams::default())
        .map_err(err("rdma_accept"))?;
    Ok(memory)
}

/// Spins on the id's receive CQ until the receive completes; returns when it was seen.
fn spin_receive(id: &CmId) -> Result<Instant, String> {
    let deadline = Instant::now() + WAIT;
    loop {
        let completions = id.poll_recv_cq(1).map_err(err("ibv_poll_cq"))?;
        if let Some(completion) = completions.first() {
            let seen = Instant::now();
            if !completion.is_success() {
                return Err(format!("receive failed: {}", completion.status_str()));
            }
            return Ok(seen);
        }
        if Instant::now() > deadline {
            return Err("no receive completion".into());
        }
    }
}

/// Tears a connection down: the client disconnects, `answer` lets the server read its
/// DISCONNECTED and disconnect too (its DREP is what the client's DISCONNECTED waits
/// for), then the client reads its DISCONNECTED.
fn disconnect(
    client: &Client,
    channel: &EventChannel,
    answer: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    client.id.disconnect().map_err(err("rdma_disconnect"))?;
    answer()?;
    expect_event(channel, CmEventType::Disconnected)?
        .ack()
        .map_err(err("ack"))
}

/// An nftables table dropping every CM RTU MAD addressed to `to` in the INPUT hook
/// (never OUTPUT: see the VM spec). Deleted on drop.
struct RtuDrop {
    nft: String,
}

impl RtuDrop {
    const TABLE: &'static str = "cmnotify_bench";

    fn install(nft: &str, to: IpAddr) -> Result<RtuDrop, String> {
        let guard = RtuDrop {
            nft: nft.to_string(),
        };
        guard.run(&["add", "table", "inet", Self::TABLE])?;
        guard.run(&[
            "add",
            "chain",
            "inet",
            Self::TABLE,
            "input",
            "{ type filter hook input priority 0; }",
        ])?;
        // RoCEv2 (UDP 4791), BTH opcode UD SEND_ONLY, MAD class CM, attribute RTU.
        let rule = format!(
            "ip daddr {to} udp dport 4791 @th,64,8 0x64 @th,232,8 0x07 @th,352,16 0x0014 \
             counter drop"
        );
        let mut args = vec!["add", "rule", "inet", Self::TABLE, "input"];
        args.extend(rule.split(' '));
        guard.run(&args)?;
        Ok(guard)
    }

    fn run(&self, args: &[&str]) -> Result<(), String> {
        let output = std::process::Command::new(&self.nft)
            .args(args)
            .output()
            .map_err(|e| format!("{} {args:?}: {e}", self.nft))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{} {args:?}: {}",
                self.nft,
                String::from_utf8_lossy(&output.stderr)
            ))
        }
    }
}

impl Drop for RtuDrop {
    fn drop(&mut self) {
        let _ = std::process::Command::new(&self.nft)
            .args(["delete", "table", "inet", Self::TABLE])
            .status();
    }
}

/// A listener bound to the setup's A address.
fn listener(setup: &Setup, channel: &EventChannel) -> Result<(CmId, SocketAddr), String> {
    let id = channel.create_id().map_err(err("rdma_create_id"))?;
    id.bind_addr(SocketAddr::new(setup.addr_a, 0))
        .map_err(err("rdma_bind_addr"))?;
    id.listen(16).map_err(err("rdma_listen"))?;
    let addr = id.local_addr().ok_or("the listener has no address")?;
    Ok((id, addr))
}

/// The asynchronous events of the device `id` is bound to, non-blocking.
fn nonblocking_events(id: &CmId) -> Result<AsyncEvents, String> {
    let device = id.async_events().map_err(err("async events"))?;
    device.set_nonblocking(true).map_err(err("O_NONBLOCK"))?;
    Ok(device)
}

fn median(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

/// "p25–p75 µs" of sorted samples.
fn interquartile(sorted: &[Duration]) -> String {
    let at = |q: usize| {
        sorted
            .get(sorted.len() * q / 4)
            .copied()
            .unwrap_or_default()
    };
    format!(
        "{:.0}–{:.0} µs",
        at(1).as_secs_f64() * 1e6,
        at(3).as_secs_f64() * 1e6
    )
}

/// A distribution-free 95% confidence interval of the median of sorted samples: the
/// order statistics n/2 ∓ 0.98·√n (the binomial's normal approximation).
fn median_interval(sorted: &[Duration]) -> (Duration, Duration) {
    let n = sorted.len() as f64;
    let half_width = 0.98 * n.sqrt();
    let at = |rank: f64| {
        let index = (rank.max(0.0) as usize).min(sorted.len().saturating_sub(1));
        sorted.get(index).copied().unwrap_or_default()
    };
    (
        at((n / 2.0 - half_width).floor()),
        at((n / 2.0 + half_width).ceil()),
    )
}

/// The range a ratio of two medians can take within both medians' 95% intervals.
fn ratio_interval(numerator: &[Duration], denominator: &[Duration]) -> (f64, f64) {
    let (num_lo, num_hi) = median_interval(numerator);
    let (den_lo, den_hi) = median_interval(denominator);
    (
        num_lo.as_secs_f64() / den_hi.as_secs_f64(),
        num_hi.as_secs_f64() / den_lo.as_secs_f64(),
    )
}

fn nanos(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

/// The server of the hand-written loop: reads its own channel, accepts, spins on the
/// receive CQ, calls notify and spins until ESTABLISHED. Like the pump's event loop it
/// checks the device's asynchronous events (forwarding a COMM_EST itself) before each
/// read of the channel, so both loops watch the same sources.
struct HandServer {
    channel: EventChannel,
    device: AsyncEvents,
    _listener: CmId,
    addr: SocketAddr,
}

impl HandServer {
    /// Spins (never blocks, as the event loop of the pump server spins) until the next
    /// CM event, which must be `kind`; the device's asynchronous events are read first.
    fn spin_event(&self, kind: CmEventType) -> Result<CmEvent, String> {
        let deadline = Instant::now() + WAIT;
        loop {
            while self
                .device
                .try_next_event()
                .map_err(err("ibv_get_async_event"))?
                .is_some()
            {}
            if let Some(event) = self
                .channel
                .try_next_event()
                .map_err(err("rdma_get_cm_event"))?
            {
                if event.event_type() != kind {
                    return Err(format!("{} while waiting for {kind}", event.event_type()));
                }
                return Ok(event);
            }
            if Instant::now() > deadline {
                return Err(format!("no {kind}"));
            }
        }
    }

    fn accept_one(&self) -> Result<(CmId, MemoryRegion), String> {
        let request = self.spin_event(CmEventType::ConnectRequest)?;
        let id = request.id().ok_or("a request carries its id")?.clone();
        request.ack().map_err(err("ack"))?;
        let memory = accept(&id)?;
        Ok((id, memory))
    }

    /// Receive completion to ESTABLISHED read by the application: notify, then block in
    /// `poll(2)` on the channel and the device's asynchronous events (as a server waits),
    /// forwarding a COMM_EST of this QP if one comes first.
    fn trigger_to_established(&self, id: &CmId) -> Result<Duration, String> {
        let trigger = spin_receive(id)?;
        match id.notify(AsyncEventType::CommEst) {
            Ok(NotifyOutcome::Established) => {}
            other => return Err(format!("notify with the RTU dropped answered {other:?}")),
        }
        let deadline = trigger + WAIT;
        let qp = id.qp_num();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ready =
                cm_sys::poll_readable(&[self.channel.as_fd(), self.device.as_fd()], Some(left))
                    .map_err(err("poll"))?;
            if ready.is_empty() {
                return Err("no ESTABLISHED after notify".into());
            }
            // Only what poll says is readable, as the event loop does.
            if ready.is_ready(1) {
                while let Some(event) = self
                    .device
                    .try_next_event()
                    .map_err(err("ibv_get_async_event"))?
                {
                    if event.event_type == AsyncEventType::CommEst && event.qp_num() == qp {
                        let _ = id.notify(AsyncEventType::CommEst);
                    }
                }
            }
            if !ready.is_ready(0) {
                continue;
            }
            if let Some(event) = self
                .channel
                .try_next_event()
                .map_err(err("rdma_get_cm_event"))?
            {
                let kind = event.event_type();
                event.ack().map_err(err("ack"))?;
                if kind == CmEventType::Established {
                    return Ok(trigger.elapsed());
                }
                return Err(format!("{kind} before ESTABLISHED"));
            }
        }
    }

    fn answer_disconnect(&self, id: &CmId) -> Result<(), String> {
        self.spin_event(CmEventType::Disconnected)?
            .ack()
            .map_err(err("ack"))?;
        id.disconnect().map_err(err("rdma_disconnect"))
    }
}

type PumpLoop = BackendLoop<RdmaBackend>;

/// The server on cm-verbs: the event loop (pump first, then CM events), spun while
/// setting up, waiting in its [`PollWaiter`] after the trigger as the hand loop waits.
struct PumpServer {
    event_loop: PumpLoop,
    waiter: PollWaiter,
    _listener: CmId,
    addr: SocketAddr,
}

const ALL: Ready = Ready {
    cm_events: true,
    async_events: true,
    shutdown: false,
};

impl PumpServer {
    /// One pass of the loop over the sources `ready` names (the pump sees every event
    /// first); the first CM event, unacknowledged, if there was one.
    fn next_cm_event(&mut self, ready: Ready) -> Result<Option<CmEvent>, String> {
        let mut seen = None;
        self.event_loop
            .poll_once(ready, &mut |_pump, event| match event {
                LoopEvent::Cm(event) => {
                    seen = Some(event);
                    Control::Stop
                }
                LoopEvent::Pump(_) => Control::Continue,
            })
            .map_err(err("event loop"))?;
        Ok(seen)
    }

    /// Spins the loop until a CM event of `kind` comes; returns its id.
    fn until(&mut self, kind: CmEventType) -> Result<CmId, String> {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(event) = self.next_cm_event(ALL)? {
                let (event_type, id) = (event.event_type(), event.id().cloned());
                let _ = event.ack();
                if event_type != kind {
                    return Err(format!("{event_type} while waiting for {kind}"));
                }
                if let Some(id) = id {
                    return Ok(id);
                }
            }
            if Instant::now() > deadline {
                return Err(format!("no {kind}"));
            }
        }
    }

    fn accept_one(&mut self) -> Result<(CmId, MemoryRegion), String> {
        let id = self.until(CmEventType::ConnectRequest)?;
        let memory = accept(&id)?;
        self.event_loop
            .pump()
            .register(id.clone(), Role::Passive)
            .map_err(|e| e.to_string())?;
        Ok((id, memory))
    }

    fn trigger_to_established(&mut self, id: &CmId) -> Result<Duration, String> {
        let trigger = spin_receive(id)?;
        let qp = id.qp_num().ok_or("accepted id without QP")?;
        match self.event_loop.pump().on_receive_completion(qp) {
            Some(PumpEvent::Forced { .. }) => {}
            other => return Err(format!("the pump answered {other:?}")),
        }
        let deadline = trigger + WAIT;
        loop {
            let ready = self.waiter.wait().map_err(err("poll"))?;
            if ready == Ready::default() && Instant::now() > deadline {
                return Err("no ESTABLISHED after notify".into());
            }
            if let Some(event) = self.next_cm_event(ready)? {
                let kind = event.event_type();
                let _ = event.ack();
                if kind != CmEventType::Established {
                    return Err(format!("{kind} before ESTABLISHED"));
                }
                break;
            }
        }
        Ok(trigger.elapsed())
    }

    fn answer_disconnect(&mut self, id: &CmId) -> Result<(), String> {
        self.until(CmEventType::Disconnected)?;
        id.disconnect().map_err(err("rdma_disconnect"))
    }
}

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
    /// Why the trigger figures are missing.
    pub trigger_skipped: Option<String>,
    /// Median setup step times (name, ns).
    pub setup_ns: Vec<(&'static str, f64)>,
}

/// Measures everything: `connections` lost-RTU connections per path, interleaved.
pub fn measure(setup: &Setup, connections: usize) -> Result<RealFigures, String> {
    let client_channel = EventChannel::new().map_err(err("rdma_create_event_channel"))?;
    let hand = hand_server(setup)?;
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
    let pump_channel = EventChannel::new().map_err(err("rdma_create_event_channel"))?;
    let (pump_listener, pump_addr) = listener(setup, &pump_channel)?;
    let device = nonblocking_events(&pump_listener)?;
    let (mut waiter, _shutdown) = PollWaiter::new(&pump_channel).map_err(err("waiter"))?;
    waiter.watch_async_events(&device).map_err(err("waiter"))?;
    // Bounds each wait, so that a lost ESTABLISHED ends the measurement instead of hanging.
    waiter.set_tick(Some(WAIT));
    let mut pumped = PumpServer {
        event_loop: EventLoop::new(pump_channel, device, NotifyPump::new()),
        waiter,
        _listener: pump_listener,
        addr: pump_addr,
    };

    let _rtu_drop = RtuDrop::install(nft, setup.addr_a)?;
    let (mut pump_samples, mut hand_samples) = (Vec::new(), Vec::new());
    for round in 0..2 * connections {
        // Let the previous teardown's kernel work finish before the next measurement.
        std::thread::sleep(SETTLE);
        let mut steps = SetupSteps::default();
        // Hand, pump, pump, hand, …: neither path always follows the other's teardown.
        if matches!(round % 4, 0 | 3) {
            let mut server_side = None;
            let client = connect_and_send(setup, &client_channel, hand.addr, &mut steps, || {
                server_side = Some(hand.accept_one()?);
                Ok(())
            })?;
            let (server, _memory) = server_side.ok_or("not accepted")?;
            hand_samples.push(hand.trigger_to_established(&server)?);
            disconnect(&client, &client_channel, || hand.answer_disconnect(&server))?;
        } else {
            let mut server_side = None;
            let client = connect_and_send(setup, &client_channel, pumped.addr, &mut steps, || {
                server_side = Some(pumped.accept_one()?);
                Ok(())
            })?;
            let (server, _memory) = server_side.ok_or("not accepted")?;
            pump_samples.push(pumped.trigger_to_established(&server)?);
            disconnect(&client, &client_channel, || {
                pumped.answer_disconnect(&server)
            })?;
        }
        steps_seen.push(steps);
    }
    figures.pump_ns = Some(nanos(median(&mut pump_samples)));
    figures.hand_ns = Some(nanos(median(&mut hand_samples)));
    let (low, high) = ratio_interval(&pump_samples, &hand_samples);
    figures.spread = format!(
        "{} samples each; p25–p75 pump {}, hand loop {}; the ratio within both medians' 95% \
         intervals: {low:.2}–{high:.2}",
        connections,
        interquartile(&pump_samples),
        interquartile(&hand_samples)
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
            for key in ["real/notify", "real/trigger_to_established", "real/setup"] {
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
            out.push(Figure::skipped("real/notify", RAW_BASELINE_MISSING));
            match (f.pump_ns, f.hand_ns) {
                (Some(pump), Some(hand)) => {
                    out.push(Figure::measured(
                        "real/trigger_to_established",
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
                    "real/trigger_to_established",
                    f.trigger_skipped.as_deref().unwrap_or("not measured"),
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

/// A hand-loop server listening on the setup's A address.
fn hand_server(setup: &Setup) -> Result<HandServer, String> {
    let channel = EventChannel::new().map_err(err("rdma_create_event_channel"))?;
    let (listener_id, addr) = listener(setup, &channel)?;
    Ok(HandServer {
        channel,
        device: nonblocking_events(&listener_id)?,
        _listener: listener_id,
        addr,
    })
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
        server_side = Some(hand.accept_one()?);
        Ok(())
    })?;
    let (server, memory) = server_side.ok_or("not accepted")?;
    expect_event(&hand.channel, CmEventType::Established)?
        .ack()
        .map_err(err("ack"))?;
    Ok((client, server, memory, steps))
}

/// Criterion on cm-sys `notify` (EISCONN) on the passive id of an established
/// connection.
fn bench_cm_sys_notify(c: &mut Criterion, setup: &Setup) -> Result<(), String> {
    let client_channel = EventChannel::new().map_err(err("rdma_create_event_channel"))?;
    let hand = hand_server(setup)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn micros(values: impl IntoIterator<Item = u64>) -> Vec<Duration> {
        values.into_iter().map(Duration::from_micros).collect()
    }

    #[test]
    fn the_median_interval_brackets_the_median_and_narrows_with_more_samples() {
        let few = micros(1..=10);
        let many = micros(1..=1000);
        let (lo, hi) = median_interval(&few);
        assert!(lo <= few[5] && few[5] <= hi);
        assert!(lo > Duration::ZERO || few[0] == lo);
        let (lo_many, hi_many) = median_interval(&many);
        assert!(lo_many <= many[500] && many[500] <= hi_many);
        let relative =
            |lo: Duration, hi: Duration, n: usize| (hi - lo).as_secs_f64() / (n as f64 * 1e-6);
        assert!(relative(lo_many, hi_many, many.len()) < relative(lo, hi, few.len()));
        assert_eq!(median_interval(&[]), (Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn the_ratio_interval_contains_the_ratio_of_medians() {
        let pump = micros((0..101).map(|i| 300 + i));
        let hand = micros((0..101).map(|i| 290 + i));
        let (low, high) = ratio_interval(&pump, &hand);
        let ratio = 350.0 / 340.0;
        assert!(low < ratio && ratio < high, "{low} {ratio} {high}");
    }
}
