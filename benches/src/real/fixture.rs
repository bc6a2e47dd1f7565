//! The fixture every real-path server shares: where it runs (cm-testkit's addresses),
//! the client side of a connection, the accepting side's QP, teardown, and the
//! nftables rule dropping the RTU (cm-testkit's [`CmMadRule`]).

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use cm_core::CmEventType;
use cm_sys::{
    AsyncEvents, CmEvent, CmId, CompletionChannel, ConnParams, EventChannel, MemoryRegion, QpCaps,
};
use cm_testkit::{Addresses, CmMadRule, MadAction, RTU_ATTRIBUTE};

/// How long any single wait may take before the measurement gives up.
pub(super) const WAIT: Duration = Duration::from_secs(10);
/// Pause between two measured connections.
pub(super) const SETTLE: Duration = Duration::from_millis(5);
/// The kernel's timeout of one address or route resolution attempt.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// The nftables table of the bench's RTU drop.
const RTU_TABLE: &str = "cmnotify_bench";

/// Where the real measurements run.
#[derive(Debug, Clone)]
pub struct Setup {
    pub(super) addrs: Addresses,
    pub(super) nft: Option<String>,
}

/// The setup, or why the real path cannot run here (the skip reason, worded as the
/// skip protocol words it: `no RDMA device (<reason>)`).
pub fn setup() -> Result<Setup, String> {
    let addrs =
        cm_testkit::probe_addresses().map_err(|reason| format!("no RDMA device ({reason})"))?;
    Ok(Setup {
        addrs,
        nft: CmMadRule::nft_from_env(),
    })
}

impl Setup {
    /// Drops every CM RTU addressed to the listener side (A) on its INPUT hook, until the
    /// guard is dropped.
    pub(super) fn drop_rtus(&self, nft: &str) -> Result<CmMadRule, String> {
        CmMadRule::install(
            nft,
            RTU_TABLE,
            self.addrs.addr_a,
            RTU_ATTRIBUTE,
            MadAction::Drop,
        )
        .map_err(|e| format!("installing the RTU drop: {e}"))
    }
}

/// `op: error` for the error strings of the measurement.
pub(super) fn err(op: &str) -> impl Fn(cm_core::CmError) -> String + '_ {
    move |e| format!("{op}: {e}")
}

/// The next event on `channel` within [`WAIT`], which must be `expected` with status 0.
pub(super) fn expect_event(
    channel: &EventChannel,
    expected: CmEventType,
) -> Result<CmEvent, String> {
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
pub(super) struct SetupSteps {
    pub(super) resolve_addr: Duration,
    pub(super) resolve_route: Duration,
    pub(super) connect_to_accepted: Duration,
    pub(super) accepted_to_established: Duration,
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
pub(super) struct Client {
    pub(super) id: CmId,
    /// Taken just before the client posted its SEND: the start of the send-based
    /// intervals (the receive completion cannot be earlier).
    pub(super) sent: Instant,
}

/// Connects a client to `to`, leaving the server side to `serve` (which must accept
/// the request it is given and return when accepted), then sends 5 bytes as soon as the
/// client is ESTABLISHED (the data that reaches the passive QP before its lost RTU).
pub(super) fn connect_and_send(
    setup: &Setup,
    client_channel: &EventChannel,
    to: SocketAddr,
    steps: &mut SetupSteps,
    serve: impl FnOnce() -> Result<(), String>,
) -> Result<Client, String> {
    let id = resolved_client(client_channel, setup.addrs.addr_b, to, steps)?;
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
    let sent = Instant::now();
    id.post_send(&memory, 0..5, 1)
        .map_err(err("ibv_post_send"))?;
    Ok(Client { id, sent })
}

/// Accepts a connection request on a fresh QP with one receive posted. With `channel`,
/// its completion queues are created on that completion channel, armed, with `token`;
/// without, they have none (polled only).
pub(super) fn accept(
    id: &CmId,
    channel: Option<(&CompletionChannel, u64)>,
) -> Result<MemoryRegion, String> {
    match channel {
        Some((channel, token)) => id
            .create_qp_on(&QpCaps::default(), channel, token)
            .map(drop),
        None => id.create_qp(&QpCaps::default()).map(drop),
    }
    .map_err(err("rdma_create_qp"))?;
    let memory = id.register_memory(16).map_err(err("ibv_reg_mr"))?;
    id.post_recv(&memory, 0..16, 1)
        .map_err(err("ibv_post_recv"))?;
    id.accept(&ConnParams::default())
        .map_err(err("rdma_accept"))?;
    Ok(memory)
}

/// Spins on the id's receive CQ until the receive completes; returns when it was seen.
pub(super) fn spin_receive(id: &CmId) -> Result<Instant, String> {
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
pub(super) fn disconnect(
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

/// A listener bound to the setup's A address.
pub(super) fn listener(
    setup: &Setup,
    channel: &EventChannel,
) -> Result<(CmId, SocketAddr), String> {
    let id = channel.create_id().map_err(err("rdma_create_id"))?;
    id.bind_addr(SocketAddr::new(setup.addrs.addr_a, 0))
        .map_err(err("rdma_bind_addr"))?;
    id.listen(16).map_err(err("rdma_listen"))?;
    let addr = id.local_addr().ok_or("the listener has no address")?;
    Ok((id, addr))
}

/// The asynchronous events of the device `id` is bound to, non-blocking.
pub(super) fn nonblocking_events(id: &CmId) -> Result<AsyncEvents, String> {
    let device = id.async_events().map_err(err("async events"))?;
    device.set_nonblocking(true).map_err(err("O_NONBLOCK"))?;
    Ok(device)
}
