//! The run itself: the shared [`Session`] on one [`Endpoint`] over the real transport,
//! and its report.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use cm_core::CmError;
use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{CloseReason, Endpoint, EstablishedVia, Trigger};

use super::report::RealReport;
use super::{RealRun, CONNECT_WINDOW, ESTABLISH_TIMEOUT, RESOLVE_ATTEMPTS, RESOLVE_TIMEOUT};
use crate::session::{cm_error, endpoint_options, queue_caps, Plan, Session};
use crate::steps::{Span, Step, StepStats, StepTotals};

/// Runs the server or the client to the end and reports. Errors are what stops the run
/// before it starts (no device, the listen address unusable) or a failure of the
/// endpoint itself.
pub fn run(config: &RealRun) -> Result<RealReport, CmError> {
    if config.connections == 0 {
        return Err(CmError::InvalidArgument {
            op: "cmnotify",
            reason: "no connections asked for",
        });
    }
    if !config.server && config.address.is_none() {
        return Err(CmError::InvalidArgument {
            op: "cmnotify",
            reason: "the client needs the server's address (-a)",
        });
    }
    if config.endpoints <= 1 {
        return run_one(config).map(|shard| shard.report);
    }
    super::shards::run(config)
}

/// What one endpoint's run found: its report, its steps summed up and when its clock
/// began (to merge the steps of several endpoints on one clock).
pub(super) struct Shard {
    pub(super) report: RealReport,
    pub(super) totals: Vec<StepTotals>,
    pub(super) origin: Instant,
}

/// One endpoint's session, driven to its end on this thread.
pub(super) fn run_one(config: &RealRun) -> Result<Shard, CmError> {
    let options = endpoint_options(config.own_queues, config.message_size, config.ready_qps);
    let transport = RdmaTransport::new()?;
    let origin = transport.origin();
    let endpoint = Endpoint::with_options(transport, options);
    let mut session = Session::new(endpoint, plan(config));
    session.start()?;
    session.drive().map_err(cm_error)?;
    let took = session.now();
    if let Some(path) = &config.timeline {
        write_timeline(path, config, &session)?;
    }
    let totals = Step::ALL
        .iter()
        .map(|&step| session.step_totals(step))
        .collect();
    Ok(Shard {
        report: report(config, &session, took),
        totals,
        origin,
    })
    // The endpoint goes with the session: every connection left, then the listener.
}

/// Writes the first connection's timeline (`--timeline`) on CLOCK_MONOTONIC: the
/// endpoint's clock is an `Instant` (CLOCK_MONOTONIC on Linux) since the transport was
/// made, so its origin is the monotonic now less the endpoint's now.
fn write_timeline(
    path: &std::path::Path,
    config: &RealRun,
    session: &Session<RdmaTransport>,
) -> Result<(), CmError> {
    let mono = cm_sys::monotonic_now();
    let origin = mono.saturating_sub(session.now());
    let first = session.conns().first().map(|conn| {
        (
            conn.established(),
            Step::ALL.map(|step| session.first_span(step)),
        )
    });
    let timeline = timeline(config.server, first, origin);
    std::fs::write(path, timeline.render()).map_err(|e| CmError::InvalidArgument {
        op: "cmnotify --timeline",
        reason: if e.kind() == std::io::ErrorKind::NotFound {
            "its directory does not exist"
        } else {
            "the file cannot be written"
        },
    })
}

/// What the endpoint saw of a connection (how it was established, and its steps in
/// [`Step::ALL`]'s order), moved by `origin` onto CLOCK_MONOTONIC.
fn timeline(
    server: bool,
    conn: Option<(Option<EstablishedVia>, [Span; Step::ALL.len()])>,
    origin: Duration,
) -> crate::ladder::kernel::Timeline {
    let mut entries = Vec::new();
    if let Some((established, spans)) = conn {
        let span = |step: Step| spans[step.index()];
        let mut add = |at: Option<Duration>, what: String| {
            if let Some(at) = at {
                entries.push((origin + at, what));
            }
        };
        let call = if server {
            "rdma_accept"
        } else {
            "rdma_connect"
        };
        add(span(Step::Connect).start(), call.to_string());
        let via = match established {
            Some(EstablishedVia::Handshake) | None => "handshake".to_string(),
            Some(EstablishedVia::Notify(trigger)) => format!("notify {}", trigger_name(trigger)),
            Some(EstablishedVia::RtuWonRace(trigger)) => {
                format!("rtu-won-race {}", trigger_name(trigger))
            }
            Some(EstablishedVia::PeerMessage) => "peer-message".to_string(),
        };
        add(span(Step::Established).end(), format!("established {via}"));
        add(span(Step::Exchange).start(), "send".to_string());
        add(span(Step::Exchange).end(), "exchange-done".to_string());
        add(span(Step::Disconnect).start(), "disconnect".to_string());
    }
    entries.sort_by_key(|(at, _)| *at);
    crate::ladder::kernel::Timeline {
        role: if server { "server" } else { "client" }.to_string(),
        entries,
    }
}

fn trigger_name(trigger: Trigger) -> &'static str {
    match trigger {
        Trigger::AsyncEvent(cm_core::AsyncEventType::CommEst) => "comm-est",
        Trigger::AsyncEvent(_) => "async-event",
        Trigger::ReceiveCompletion => "receive-completion",
    }
}

/// The shared server or client, as the command line asked.
fn plan(config: &RealRun) -> Plan<SocketAddr> {
    let addr = if config.server {
        SocketAddr::new(
            config.bind.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
            config.port,
        )
    } else {
        server_addr(config)
    };
    Plan {
        server: config.server,
        addr,
        source: if config.server {
            None
        } else {
            config.bind.map(|ip| SocketAddr::new(ip, 0))
        },
        connections: config.connections,
        notify: config.pump,
        messages: config.messages(),
        message_size: config.message_size,
        caps: queue_caps(config.message_size),
        resolve_timeout: RESOLVE_TIMEOUT,
        resolve_attempts: RESOLVE_ATTEMPTS,
        establish_timeout: Some(ESTABLISH_TIMEOUT),
        disconnect_when_done: true,
        connect_window: Some(CONNECT_WINDOW),
        id_options: config.id_options,
    }
}

fn server_addr(config: &RealRun) -> SocketAddr {
    SocketAddr::new(
        config.address.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        config.port,
    )
}

/// The steps a run of `config` reports, from each step's totals.
pub(super) fn step_stats(config: &RealRun, totals: impl Fn(Step) -> StepTotals) -> Vec<StepStats> {
    let (server, messages) = (config.server, config.messages());
    Step::ALL
        .iter()
        .filter(|step| match step {
            Step::ResolveAddr | Step::ResolveRoute => !server,
            Step::Exchange => messages > 0,
            // An echoing server never disconnects: its clients do.
            Step::Disconnect => !server || messages > 0,
            _ => true,
        })
        .map(|&step| totals(step).stats(step.name(server), config.connections))
        .collect()
}

/// What the finished run found.
fn report(config: &RealRun, session: &Session<RdmaTransport>, took: Duration) -> RealReport {
    let server = config.server;
    let messages = config.messages();
    let conns = session.conns();
    let steps = step_stats(config, |step| session.step_totals(step));
    let count = |pick: fn(EstablishedVia) -> bool| {
        conns
            .iter()
            .filter(|c| c.established().is_some_and(pick))
            .count()
    };
    let established = count(|_| true);
    let via_comm_est = count(|via| matches!(via, EstablishedVia::Notify(Trigger::AsyncEvent(_))));
    let via_receive =
        count(|via| matches!(via, EstablishedVia::Notify(Trigger::ReceiveCompletion)));
    let via_notify = via_comm_est + via_receive;
    let via_peer_message = count(|via| via == EstablishedVia::PeerMessage);
    let wanted = usize::try_from(config.connections).unwrap_or(usize::MAX);
    let unstarted = wanted.saturating_sub(conns.len());
    let remote = if server {
        session.remote()
    } else {
        Some(server_addr(config))
    };
    RealReport {
        backend: "rdma",
        role: if server { "server" } else { "client" },
        local: session.local().map(|a| a.to_string()),
        remote: remote.map(|a| a.to_string()),
        connections: config.connections,
        endpoints: 1,
        pump: config.pump,
        messages,
        message_size: config.message_size,
        established,
        via_rtu: established - via_notify - via_peer_message,
        via_notify,
        via_comm_est,
        via_receive,
        already_established_races: count(|via| matches!(via, EstablishedVia::RtuWonRace(_))),
        via_peer_message,
        failed: conns.iter().filter(|c| c.failure().is_some()).count() + unstarted,
        disconnected: conns
            .iter()
            .filter(|c| c.closed() == Some(CloseReason::Disconnected) && c.failure().is_none())
            .count(),
        timed_out: conns
            .iter()
            .filter(|c| c.closed() == Some(CloseReason::TimedOut))
            .count(),
        aborted: session.aborted().map(str::to_owned),
        resolve_retries: session.resolve_retries(),
        messages_sent: conns.iter().map(|c| u64::from(c.sends_done)).sum(),
        messages_received: conns.iter().map(|c| u64::from(c.received)).sum(),
        ready_qps_taken: session.endpoint().stats().ready_qps_taken,
        pump_counters: session.endpoint().counters().into(),
        steps,
        failures: conns
            .iter()
            .filter_map(|c| c.failure().map(str::to_owned))
            .collect(),
        seconds: took.as_secs_f64(),
    }
}
