//! Helpers shared by the real-kernel test binaries (`device`, `conformance_real`,
//! `lost_rtu_pump`, `comm_est_pump`, ...): the skip protocol, the VM's addresses, bounded
//! event and completion waits, address resolution with a retry, an nftables RTU drop, a
//! connection whose active side sends early, and whether the device raises COMM_EST.
//!
//! Each test binary uses a subset of them.
#![allow(dead_code)]

use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use cm_core::{CmError, CmEventType};
use cm_sys::{CmEvent, CmId, Completion, ConnParams, EventChannel, MemoryRegion, QpCaps};

/// The bound of every short wait (an event, a completion, a resolution).
pub(crate) const WAIT: Duration = Duration::from_secs(10);

/// The kernel's timeout of one address or route resolution attempt.
pub(crate) const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// The bound of a wait for the passive side's REP retries to run out: measured at ~69 s
/// under emulation (16 REP sends), so this leaves room without letting a hang last.
pub(crate) const REP_RETRIES_BOUND: Duration = Duration::from_secs(100);

#[allow(unused_imports)] // each test binary uses its own part
pub(crate) use cm_testkit::{addresses, report, skip, Addresses};

/// The VM's test setup.
#[derive(Debug, Clone)]
pub(crate) struct Setup {
    /// The listener side's address (`CMNOTIFY_ADDR_A`, on soft-RoCE device A).
    pub(crate) addr_a: IpAddr,
    /// The connecting side's address (`CMNOTIFY_ADDR_B`, on soft-RoCE device B).
    pub(crate) addr_b: IpAddr,
    /// The nft executable (`CMNOTIFY_NFT`).
    pub(crate) nft: String,
    /// What delays packets on the wire: `tc` (`CMNOTIFY_TC`) and the netdevs of the two
    /// addresses (`CMNOTIFY_NETDEV_A`, `CMNOTIFY_NETDEV_B`); `None` where not given.
    pub(crate) netem: Option<Netem>,
}

/// How to delay packets between the two addresses with netem.
#[derive(Debug, Clone)]
pub(crate) struct Netem {
    /// The tc executable.
    pub(crate) tc: String,
    /// The netdev of address A; traffic from A to B leaves by it.
    pub(crate) netdev_a: String,
    /// The netdev of address B; traffic from B to A leaves by it.
    pub(crate) netdev_b: String,
}

/// The setup (two devices and nft to drop RTUs with), or `None` after recording a skip
/// (on iWARP too: its MPA exchange has no RTU, and notify forces nothing there).
pub(crate) fn setup(test: &str) -> Option<Setup> {
    let Addresses { addr_a, addr_b } = addresses(test)?;
    if cm_testkit::skip_on_iwarp(test, "an RTU to drop and a notify that forces") {
        return None;
    }
    let Ok(nft) = std::env::var(cm_testkit::env::NFT) else {
        skip(
            test,
            "a device exists but CMNOTIFY_NFT names no nft to drop the RTU with",
        );
        return None;
    };
    let var = |name: &str| std::env::var(name).ok();
    let netem = match (
        var(cm_testkit::env::TC),
        var(cm_testkit::env::NETDEV_A),
        var(cm_testkit::env::NETDEV_B),
    ) {
        (Some(tc), Some(netdev_a), Some(netdev_b)) => Some(Netem {
            tc,
            netdev_a,
            netdev_b,
        }),
        _ => None,
    };
    Some(Setup {
        addr_a,
        addr_b,
        nft,
        netem,
    })
}

/// A listener on `channel`, bound to `addr` (any port) with `backlog`.
pub(crate) fn listener_on(channel: &EventChannel, addr: IpAddr, backlog: i32) -> CmId {
    let listener = channel.create_id().expect("listener");
    listener.bind_addr(SocketAddr::new(addr, 0)).expect("bind");
    listener.listen(backlog).expect("listen");
    listener
}

/// A client id on `channel`, its address (from `from`) and route resolved to
/// `listener`.
pub(crate) fn resolved_to(listener: &CmId, channel: &EventChannel, from: IpAddr) -> CmId {
    let target = listener.local_addr().expect("listener address");
    resolved_id(channel, from, target).expect("resolve")
}

/// The next event on `channel` within `timeout`, if any.
pub(crate) fn event_within(channel: &EventChannel, timeout: Duration) -> Option<CmEvent> {
    channel
        .next_event_timeout(timeout)
        .expect("rdma_get_cm_event")
}

/// The next event on `channel` (within [`WAIT`]), which must be `expected` with status 0.
pub(crate) fn expect_event(channel: &EventChannel, expected: CmEventType) -> CmEvent {
    let event =
        event_within(channel, WAIT).unwrap_or_else(|| panic!("no {expected} within {WAIT:?}"));
    assert_eq!(
        (event.event_type(), event.status()),
        (expected, 0),
        "{event:?}"
    );
    event
}

/// Whether `channel` has an event pending within `timeout`, without reading it: reading
/// the active side's CONNECT_RESPONSE is what makes librdmacm send the RTU.
pub(crate) fn wait_readable(channel: &EventChannel, timeout: Duration) -> bool {
    cm_sys::poll_readable(&[channel.as_fd()], Some(timeout))
        .map(|ready| ready.is_ready(0))
        .unwrap_or(false)
}

/// Polls `poll` until it yields a completion, for at most [`WAIT`].
pub(crate) fn wait_completion(
    what: &str,
    mut poll: impl FnMut() -> Result<Vec<Completion>, CmError>,
) -> Completion {
    let deadline = Instant::now() + WAIT;
    loop {
        let completions = poll().expect("ibv_poll_cq");
        if let Some(completion) = completions.first() {
            assert_eq!(completions.len(), 1, "one work request, one completion");
            return *completion;
        }
        assert!(
            Instant::now() < deadline,
            "no {what} completion within {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A new id on `channel` whose address resolution from `src` to `dst` succeeded, with
/// its ADDR_RESOLVED event (not yet acknowledged).
///
/// The first resolution after the devices come up can time out (the neighbour entry is
/// still being resolved), so an ADDR_ERROR is retried with a fresh id, the whole bounded
/// by [`WAIT`].
pub(crate) fn addr_resolved_id(
    channel: &EventChannel,
    src: IpAddr,
    dst: SocketAddr,
) -> Result<(CmId, CmEvent), CmError> {
    let deadline = Instant::now() + WAIT;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let id = channel.create_id()?;
        id.resolve_addr(Some(SocketAddr::new(src, 0)), dst, RESOLVE_TIMEOUT)?;
        let event = event_within(channel, RESOLVE_TIMEOUT * 2).ok_or(CmError::InvalidArgument {
            op: "rdma_resolve_addr",
            reason: "no address resolution event",
        })?;
        match event.event_type() {
            CmEventType::AddrResolved if event.id() == Some(&id) => {
                if attempt > 1 {
                    eprintln!("resolved {dst} on attempt {attempt}");
                }
                return Ok((id, event));
            }
            CmEventType::AddrError if Instant::now() < deadline => {
                eprintln!(
                    "attempt {attempt}: ADDR_ERROR (status {}) resolving {dst}; retrying",
                    event.status()
                );
            }
            _ => {
                eprintln!("resolving {dst}: unexpected {event:?}");
                return Err(CmError::InvalidArgument {
                    op: "rdma_resolve_addr",
                    reason: "address resolution failed",
                });
            }
        }
    }
}

/// A new id on `channel`, resolved (address and route) from `src` to `dst`: see
/// [`addr_resolved_id`].
pub(crate) fn resolved_id(
    channel: &EventChannel,
    src: IpAddr,
    dst: SocketAddr,
) -> Result<CmId, CmError> {
    let (id, event) = addr_resolved_id(channel, src, dst)?;
    event.ack()?;
    id.resolve_route(RESOLVE_TIMEOUT)?;
    match event_within(channel, WAIT) {
        Some(event) if (event.event_type(), event.status()) == (CmEventType::RouteResolved, 0) => {
            event.ack()?
        }
        _ => {
            return Err(CmError::InvalidArgument {
                op: "rdma_resolve_route",
                reason: "no ROUTE_RESOLVED",
            })
        }
    }
    Ok(id)
}

/// CM MAD attribute id of an MRA.
pub(crate) const MRA: u16 = 0x0011;
/// CM MAD attribute id of a REP.
pub(crate) const REP: u16 = 0x0013;
/// CM MAD attribute id of an RTU.
pub(crate) const RTU: u16 = 0x0014;

#[allow(unused_imports)] // each test binary uses its own part
pub(crate) use cm_testkit::{run_tool, CmMadRule, MadAction};

/// The packet count of the first `counter` in an `nft list` output.
fn first_counter(listing: &str) -> Result<u64, CmError> {
    cm_testkit::parse_hits(listing).ok_or(CmError::InvalidArgument {
        op: "nft list",
        reason: "no counter in the listing",
    })
}

/// Every CM RTU to one address held back on the wire by netem: an nftables rule in the
/// OUTPUT hook marks it (marking there is safe; only dropping there jams QP1), and a
/// `prio` qdisc on the netdev it leaves by sends the mark to a netem band. Unmarked
/// traffic keeps the default bands and is not delayed. Removed on drop.
#[derive(Debug)]
pub(crate) struct RtuDelay {
    nft: String,
    tc: String,
    netdev: String,
    table: String,
}

impl RtuDelay {
    /// Delays by `delay` every RTU to `to`, which leaves by `netdev`; the marking rule
    /// lives in the nftables table `table`.
    pub(crate) fn install(
        nft: &str,
        tc: &str,
        netdev: &str,
        table: &str,
        to: IpAddr,
        delay: Duration,
    ) -> Result<RtuDelay, CmError> {
        let guard = RtuDelay {
            nft: nft.to_owned(),
            tc: tc.to_owned(),
            netdev: netdev.to_owned(),
            table: table.to_owned(),
        };
        // Leftovers of a killed run would make the adds fail: start clean, quietly.
        guard.remove();
        run_tool(nft, &["add", "table", "inet", table])?;
        run_tool(
            nft,
            &[
                "add",
                "chain",
                "inet",
                table,
                "output",
                "{ type filter hook output priority 0; }",
            ],
        )?;
        let rule = format!(
            "ip daddr {to} udp dport 4791 @th,64,8 0x64 @th,232,8 0x07 @th,352,16 \
             {RTU:#06x} counter meta mark set 0x1"
        );
        let mut args = vec!["add", "rule", "inet", table, "output"];
        args.extend(rule.split(' '));
        run_tool(nft, &args)?;
        let millis = format!("{}ms", delay.as_millis());
        run_tool(
            tc,
            &[
                "qdisc", "add", "dev", netdev, "root", "handle", "1:", "prio",
            ],
        )?;
        run_tool(
            tc,
            &[
                "qdisc", "add", "dev", netdev, "parent", "1:3", "handle", "30:", "netem", "delay",
                &millis,
            ],
        )?;
        run_tool(
            tc,
            &[
                "filter", "add", "dev", netdev, "parent", "1:0", "protocol", "ip", "handle", "1",
                "fw", "flowid", "1:3",
            ],
        )?;
        Ok(guard)
    }

    /// How many RTUs were marked (sent into the delay) so far.
    pub(crate) fn marked(&self) -> Result<u64, CmError> {
        first_counter(&run_tool(
            &self.nft,
            &["list", "table", "inet", &self.table],
        )?)
    }

    /// The netem qdisc's statistics line (packets that went through it).
    pub(crate) fn netem_stats(&self) -> String {
        run_tool(&self.tc, &["-s", "qdisc", "show", "dev", &self.netdev])
            .unwrap_or_default()
            .lines()
            .skip_while(|l| !l.contains("netem"))
            .take(2)
            .map(str::trim)
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn remove(&self) {
        let quiet = |program: &str, args: &[&str]| {
            let _ = std::process::Command::new(program)
                .args(args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        };
        quiet(&self.tc, &["qdisc", "del", "dev", &self.netdev, "root"]);
        quiet(&self.nft, &["delete", "table", "inet", &self.table]);
    }
}

impl Drop for RtuDelay {
    fn drop(&mut self) {
        self.remove();
    }
}

/// The soft-RoCE module's `comm_est` parameter: `Y` when the VM runs the patched
/// `rdma_rxe` of `ci/vm/rxe-comm-est` with it on (`rxe-reload comm-est`); absent with
/// the kernel's own module.
pub(crate) const RXE_COMM_EST_PARAM: &str = "/sys/module/rdma_rxe/parameters/comm_est";

/// Whether the loaded soft-RoCE raises `IBV_EVENT_COMM_EST` on an RC QP's first packet,
/// as InfiniBand hardware does (the patched module with `comm_est=1`); the stock module
/// never does.
pub(crate) fn device_raises_comm_est() -> bool {
    std::fs::read_to_string(RXE_COMM_EST_PARAM).is_ok_and(|value| value.trim() == "Y")
}

/// The data the active side sends right after its ESTABLISHED.
pub(crate) const EARLY: &[u8] = b"early data";

/// One connection across the veth, up to the active side's ESTABLISHED: the passive id
/// is accepted (REP sent, one receive posted), the active id has read the REP (RTU sent,
/// or dropped by a rule the caller installed) and is ESTABLISHED.
pub(crate) struct EarlySender {
    /// The passive side's channel (the listener's and the accepted id's events).
    pub(crate) server: EventChannel,
    /// The active side's channel.
    pub(crate) client: EventChannel,
    _listener: CmId,
    /// The connecting id.
    pub(crate) active: CmId,
    /// The accepted id.
    pub(crate) passive: CmId,
    /// Where the passive receive lands.
    pub(crate) passive_memory: MemoryRegion,
    active_memory: MemoryRegion,
}

impl EarlySender {
    /// Connects `active_addr` to a fresh listener on `passive_addr`. `before_accept` runs
    /// with the accepted id once its QP exists (a pump registers it there).
    pub(crate) fn open(
        passive_addr: IpAddr,
        active_addr: IpAddr,
        before_accept: impl FnOnce(&CmId),
    ) -> Self {
        let server = EventChannel::new().expect("server channel");
        let client = EventChannel::new().expect("client channel");
        let listener = listener_on(&server, passive_addr, 4);
        let target = listener.local_addr().expect("listener address");

        let active = resolved_id(&client, active_addr, target).expect("resolve");
        active.create_qp(&QpCaps::default()).expect("active QP");
        let active_memory = active.register_memory(EARLY.len()).expect("memory");
        active.connect(&ConnParams::default()).expect("connect");

        let request = expect_event(&server, CmEventType::ConnectRequest);
        let passive = request.id().expect("new id").clone();
        request.ack().expect("ack");
        passive.create_qp(&QpCaps::default()).expect("passive QP");
        let passive_memory = passive.register_memory(64).expect("memory");
        passive
            .post_recv(&passive_memory, 0..64, 1)
            .expect("post_recv");
        before_accept(&passive);
        passive.accept(&ConnParams::default()).expect("accept");

        // Reading the REP sends the RTU and reports ESTABLISHED.
        expect_event(&client, CmEventType::Established)
            .ack()
            .expect("ack");
        EarlySender {
            server,
            client,
            _listener: listener,
            active,
            passive,
            passive_memory,
            active_memory,
        }
    }

    /// Posts the active side's one SEND of [`EARLY`].
    pub(crate) fn send_early(&self) {
        self.active
            .write_memory(&self.active_memory, 0, EARLY)
            .expect("write");
        self.active
            .post_send(&self.active_memory, 0..EARLY.len(), 7)
            .expect("post_send");
    }

    /// The passive QP's number.
    pub(crate) fn passive_qp(&self) -> cm_core::QpNum {
        self.passive.qp_num().expect("passive QP")
    }
}

/// A connection request from `addrs.addr_b` to a listener on `addrs.addr_a`, read and
/// acknowledged: (server channel, listener, the request's id, client channel, client id).
pub(crate) fn requested(addrs: &Addresses) -> (EventChannel, CmId, CmId, EventChannel, CmId) {
    let server_channel = EventChannel::new().expect("server channel");
    let client_channel = EventChannel::new().expect("client channel");
    let listener = listener_on(&server_channel, addrs.addr_a, 4);
    let client = resolved_to(&listener, &client_channel, addrs.addr_b);
    client.create_qp(&QpCaps::default()).expect("client QP");
    client.connect(&ConnParams::default()).expect("connect");
    let request = expect_event(&server_channel, CmEventType::ConnectRequest);
    let server = request.id().expect("new id").clone();
    request.ack().expect("ack");
    (server_channel, listener, server, client_channel, client)
}

/// Reads and acknowledges ESTABLISHED on the client's channel, then on the server's.
pub(crate) fn expect_established(server_channel: &EventChannel, client_channel: &EventChannel) {
    for channel in [client_channel, server_channel] {
        expect_event(channel, CmEventType::Established)
            .ack()
            .expect("ack");
    }
}
