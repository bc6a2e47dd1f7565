//! The ladder of one real connection, drawn from a capture made in the soft-RoCE VM: the
//! kernel's tracefs events, the nftables counter of the rule that drops the RTU, and
//! the endpoint's own timeline of each side (`cmnotify --timeline`), all on
//! CLOCK_MONOTONIC (tracefs' `mono` trace clock).
//!
//! Where each mark comes from ([`Origin`]):
//!
//! - kernel: REQ, REP, RTU, DREQ and DREP leave their lane at the IB CM's
//!   `ib_cma:icm_send_*` tracepoint; a REQ arrives at `rdma_cma:cm_req_handler`, a REP at
//!   the active side's `CONNECT_RESPONSE`, a DREQ or a DREP at the `DISCONNECTED` of the
//!   side it goes to (`rdma_cma:cm_event_handler`, whose other events are notes too);
//!   `rdma_notify` and its answer come from a kprobe and a kretprobe on the kernel's
//!   `rdma_notify`, COMM_EST from a kprobe on `ib_uverbs_qp_event_handler`.
//! - nftables: the ✕ of the RTU, when the rule's counter is above zero (it says that
//!   the RTU was dropped, not when: the ✕ follows the RTU's sending).
//! - library: `rdma_connect` and `rdma_accept`, ESTABLISHED on the active side
//!   (librdmacm makes it itself from the REP), the client's SEND (from its
//!   ESTABLISHED to the passive side's trigger), the trigger the endpoint names for a
//!   rescued connection (a receive completion has no kernel event: it is drawn just
//!   before the `rdma_notify` it caused) and the passive side's ESTABLISHED as reported
//!   to the application.
//!
//! ```
//! use cm_tools::ladder::kernel::Capture;
//! use cm_tools::ladder::Ladder;
//!
//! let capture = Capture::parse(include_str!("../../tests/fixtures/vm-ladder-6.1.txt")).unwrap();
//! let ladder = Ladder::from_capture(&capture).unwrap();
//! assert_eq!(ladder.summary(), "RTU lost, rescued by rdma_notify");
//! ```

use std::fmt::Write as _;
use std::time::Duration;

use cm_mock::sim::{MsgKind, NodeId};

use super::{Arrow, Clock, End, Ladder, Lane, Mark, Origin, Row, Tone};

/// The first line of a capture.
pub const CAPTURE_HEADER: &str = "# cmnotify real-kernel ladder capture";
/// The first line of an endpoint timeline.
pub const TIMELINE_HEADER: &str = "# cmnotify endpoint timeline (CLOCK_MONOTONIC ns)";

/// One event line of tracefs' `trace` file:
/// `cmnotify-165 [000] ..... 15.861556: rdma_notify: (rdma_notify+0x0/0x40 [rdma_cm]) event=4`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceLine {
    /// The timestamp, on the trace clock.
    pub at: Duration,
    /// The task that was running (`cmnotify-165`, `kworker/1:1-29`).
    pub task: String,
    /// The event's name (`cm_event_handler`, `icm_send_rep`, a probe's name).
    pub event: String,
    /// The rest of the line, as the event printed it.
    pub fields: String,
}

impl TraceLine {
    /// Reads one line; `None` for comments, blank lines and anything else.
    pub fn parse(line: &str) -> Option<TraceLine> {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        // The task name may hold spaces; the CPU column `[001]` ends it.
        let (task, rest) = line.split_once(" [")?;
        let (_cpu, rest) = rest.split_once(']')?;
        let mut words = rest.split_whitespace();
        // Flags (`.....`, `d..1.`), then the timestamp ending in a colon (older
        // kernels without the flags column put it first).
        let stamp = words.find(|w| w.ends_with(':') && seconds(w).is_some())?;
        let at = seconds(stamp)?;
        let after = rest.split_once(stamp)?.1.trim_start();
        let (event, fields) = after.split_once(':')?;
        Some(TraceLine {
            at,
            task: task.trim().to_string(),
            event: event.trim().to_string(),
            fields: fields.trim().to_string(),
        })
    }

    /// The value of `name=value` among the fields.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields.split_whitespace().find_map(|word| {
            word.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('='))
        })
    }

    /// The RDMA CM or IB CM event named after `tos=N` (`ESTABLISHED`, `REQ_RECEIVED`).
    pub fn cm_event(&self) -> Option<&str> {
        let mut words = self.fields.split_whitespace();
        words.find(|w| w.starts_with("tos="))?;
        words.next()
    }
}

/// `12.345678:` as a duration.
fn seconds(word: &str) -> Option<Duration> {
    let text = word.trim_end_matches(':');
    let (whole, fraction) = text.split_once('.')?;
    let whole: u64 = whole.parse().ok()?;
    if fraction.is_empty() || fraction.len() > 9 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let nanos: u32 = format!("{fraction:0<9}").parse().ok()?;
    Some(Duration::new(whole, nanos))
}

/// What the endpoint saw of one connection, on CLOCK_MONOTONIC (see
/// [`Timeline::render`] for the file).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Timeline {
    /// `server` or `client`.
    pub role: String,
    /// (time, what) in order: `rdma_connect`, `rdma_accept`, `established <via>`,
    /// `send`, `exchange-done`, `disconnect`.
    pub entries: Vec<(Duration, String)>,
}

impl Timeline {
    /// The file: [`TIMELINE_HEADER`], `role <role>`, then `<nanoseconds> <what>` lines.
    pub fn render(&self) -> String {
        let mut out = format!("{TIMELINE_HEADER}\nrole {}\n", self.role);
        for (at, what) in &self.entries {
            let _ = writeln!(out, "{} {what}", at.as_nanos());
        }
        out
    }

    /// Reads what [`Timeline::render`] wrote.
    pub fn parse(text: &str) -> Result<Timeline, String> {
        let mut timeline = Timeline::default();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(role) = line.strip_prefix("role ") {
                timeline.role = role.trim().to_string();
                continue;
            }
            let (nanos, what) = line
                .split_once(' ')
                .ok_or_else(|| format!("timeline: cannot read `{line}`"))?;
            let nanos: u64 = nanos
                .parse()
                .map_err(|_| format!("timeline: `{nanos}` is not a time in ns"))?;
            timeline
                .entries
                .push((Duration::from_nanos(nanos), what.trim().to_string()));
        }
        Ok(timeline)
    }

    /// The first entry whose text starts with `what`.
    fn find(&self, what: &str) -> Option<(Duration, &str)> {
        self.entries
            .iter()
            .find(|(_, text)| text.starts_with(what))
            .map(|(at, text)| (*at, text.as_str()))
    }
}

/// Everything recorded in the VM of one lost-RTU connection: the file `ci/vm/ladder-capture`
/// prints, sections after `--- name` lines.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capture {
    /// `uname -r`.
    pub kernel: String,
    /// The soft-RoCE module: `stock` or `comm-est`.
    pub device: String,
    /// The nftables rule's packet counter: RTUs dropped.
    pub nft_drops: u64,
    /// The passive side's address and port (`10.77.1.1:7471`).
    pub passive: String,
    /// The active side's address (`10.77.1.2`).
    pub active: String,
    /// tracefs' event lines.
    pub trace: Vec<TraceLine>,
    /// The server's endpoint timeline.
    pub server: Timeline,
    /// The client's endpoint timeline.
    pub client: Timeline,
}

impl Capture {
    /// Reads a capture: `key value` lines, then the sections `--- trace`, `--- server`
    /// and `--- client`.
    pub fn parse(text: &str) -> Result<Capture, String> {
        let mut capture = Capture::default();
        let mut section = String::new();
        let (mut server, mut client) = (String::new(), String::new());
        for line in text.lines() {
            let line = line.trim_end_matches('\r');
            if let Some(name) = line.strip_prefix("--- ") {
                section = name.trim().to_string();
                continue;
            }
            match section.as_str() {
                "" => {
                    let Some((key, value)) = line.trim().split_once(' ') else {
                        continue;
                    };
                    let value = value.trim().to_string();
                    match key {
                        "kernel" => capture.kernel = value,
                        "device" => capture.device = value,
                        "passive" => capture.passive = value,
                        "active" => capture.active = value,
                        "nft-drops" => {
                            capture.nft_drops = value
                                .parse()
                                .map_err(|_| format!("capture: nft-drops `{value}`"))?;
                        }
                        _ => {}
                    }
                }
                "trace" => capture.trace.extend(TraceLine::parse(line)),
                "server" => {
                    server.push_str(line);
                    server.push('\n');
                }
                "client" => {
                    client.push_str(line);
                    client.push('\n');
                }
                _ => {}
            }
        }
        capture.server = Timeline::parse(&server)?;
        capture.client = Timeline::parse(&client)?;
        if capture.passive.is_empty() || capture.active.is_empty() {
            return Err("capture: the passive and active addresses are missing".into());
        }
        Ok(capture)
    }
}

/// What goes on one row before the rows are sorted by time.
enum Item {
    Send(usize),
    Arrive(MsgKind, Lane),
    Lose(usize),
    Note(Lane, String, Tone),
}

/// Collects the items of a capture, then lays them out in time order.
struct Collect {
    /// (time, rank, origin, item): of one instant, lower ranks go first.
    items: Vec<(Duration, u8, Origin, Item)>,
    arrows: Vec<Arrow>,
}

/// The rank of most items.
const LATER: u8 = 1;
/// The rank of the SEND's arrival and the trigger the endpoint names: drawn at the
/// instant of the notify they caused, they come before it.
const FIRST: u8 = 0;

impl Collect {
    fn send(&mut self, at: Duration, origin: Origin, kind: MsgKind, from: Lane, label: String) {
        let tone = if kind == MsgKind::Data {
            Tone::Data
        } else {
            Tone::Plain
        };
        self.arrows.push(Arrow {
            label,
            kind,
            from,
            tone,
            sent: 0,
            end: End::InFlight,
            origin,
        });
        self.items
            .push((at, LATER, origin, Item::Send(self.arrows.len() - 1)));
    }

    fn note(&mut self, at: Duration, origin: Origin, lane: Lane, text: &str, tone: Tone) {
        self.items
            .push((at, LATER, origin, Item::Note(lane, text.to_string(), tone)));
    }

    fn push(&mut self, at: Duration, rank: u8, origin: Origin, item: Item) {
        self.items.push((at, rank, origin, item));
    }

    /// Rows in time order (a stable sort: items of one instant keep the order they
    /// were found in), each arrival paired with the oldest unmatched arrow of its kind.
    fn finish(mut self, conn: u32) -> Ladder {
        self.items.sort_by_key(|(at, rank, _, _)| (*at, *rank));
        let origin_of_time = self.items.first().map_or(Duration::ZERO, |i| i.0);
        let mut rows = Vec::new();
        let mut waiting: Vec<usize> = Vec::new();
        for (at, _, origin, item) in self.items {
            let at = at.saturating_sub(origin_of_time);
            let mark = match item {
                Item::Send(arrow) => {
                    self.arrows[arrow].sent = rows.len();
                    waiting.push(arrow);
                    Mark::Send(arrow)
                }
                Item::Lose(arrow) => {
                    waiting.retain(|&a| a != arrow);
                    self.arrows[arrow].end = End::Lost(rows.len());
                    self.arrows[arrow].tone = Tone::Lost;
                    Mark::Lose(arrow)
                }
                Item::Arrive(kind, to) => {
                    let arrows = &self.arrows;
                    let Some(slot) = waiting
                        .iter()
                        .position(|&a| arrows[a].kind == kind && arrows[a].from != to)
                    else {
                        continue;
                    };
                    let arrow = waiting.remove(slot);
                    self.arrows[arrow].end = End::Arrived(rows.len());
                    Mark::Arrive(arrow)
                }
                Item::Note(lane, text, tone) => Mark::Note { lane, text, tone },
            };
            rows.push(Row { at, mark, origin });
        }
        Ladder {
            conn,
            active: NodeId(1),
            passive: NodeId(0),
            arrows: self.arrows,
            rows,
            clock: Clock::Monotonic,
            hosts: None,
            context: None,
            active_clock_uncertainty: None,
        }
    }
}

/// The wire messages of the IB CM's `icm_send_*` tracepoints.
fn icm_message(event: &str) -> Option<MsgKind> {
    Some(match event {
        "icm_send_req" => MsgKind::Req,
        "icm_send_rep" => MsgKind::Rep,
        "icm_send_rtu" => MsgKind::Rtu,
        "icm_send_dreq" => MsgKind::Dreq,
        "icm_send_drep" => MsgKind::Drep,
        _ => return None,
    })
}

/// The IB verbs event number of COMM_EST (`enum ib_event_type`).
const IB_EVENT_COMM_EST: &str = "4";

/// An `rdma_notify` answer as the kretprobe prints it.
fn notify_answer(ret: &str) -> String {
    match ret {
        "0" => "0".into(),
        "-106" => "EISCONN".into(),
        "-22" => "EINVAL".into(),
        other => other.to_string(),
    }
}

impl Ladder {
    /// The ladder of the one connection of a capture (see the module documentation for
    /// which marks come from where).
    pub fn from_capture(capture: &Capture) -> Result<Ladder, String> {
        // The active side's address and port, from its REQ's rdma_cma event: the lines
        // of other connections are left out by it. The last REQ: an earlier attempt
        // (refused before the server listened) is not the connection drawn.
        let req = capture
            .trace
            .iter()
            .rfind(|l| {
                l.event == "cm_send_req"
                    && l.field("dst") == Some(capture.passive.as_str())
                    && l.field("src")
                        .is_some_and(|s| s.starts_with(&format!("{}:", capture.active)))
            })
            .ok_or("the trace has no cm_send_req from the active side: nothing to draw")?;
        let active_addr = req.field("src").unwrap_or_default().to_string();
        let lane_of = |line: &TraceLine| -> Option<Lane> {
            let (src, dst) = (line.field("src")?, line.field("dst")?);
            if src == active_addr && dst == capture.passive {
                Some(Lane::Active)
            } else if src == capture.passive && dst == active_addr {
                Some(Lane::Passive)
            } else {
                None
            }
        };
        let mut collect = Collect {
            items: Vec::new(),
            arrows: Vec::new(),
        };
        // The IB CM ids of the two sides, learned from the REQ and the REP; the
        // processes, from the REQ and the REP the rdma_cma sent on their behalf.
        let (mut active_id, mut passive_id) = (None, None);
        let active_task = req.task.clone();
        let passive_task = capture
            .trace
            .iter()
            .find(|l| l.event == "cm_send_rep" && lane_of(l) == Some(Lane::Passive))
            .map(|l| l.task.clone());
        let lane_of_task = |task: &str| {
            if task == active_task {
                Some(Lane::Active)
            } else if Some(task) == passive_task.as_deref() {
                Some(Lane::Passive)
            } else {
                None
            }
        };
        let mut rtu = None;
        let mut rep_sent = false;
        // The passive side's first notify and COMM_EST: where the SEND arrived.
        let (mut notify_at, mut comm_est_at) = (None, None);
        // Per process, its notify call not yet answered: (time, event number).
        let mut calls: Vec<(String, Duration, Option<String>)> = Vec::new();
        let start = req.at;
        for line in capture.trace.iter().filter(|l| l.at >= start) {
            let event = line.event.as_str();
            if let Some(kind) = icm_message(event) {
                let local = line.field("local_id");
                let from = match kind {
                    MsgKind::Req if active_id.is_none() => {
                        active_id = local.map(str::to_string);
                        Lane::Active
                    }
                    MsgKind::Rep
                        if passive_id.is_none()
                            && line.field("remote_id") == active_id.as_deref() =>
                    {
                        passive_id = local.map(str::to_string);
                        rep_sent = true;
                        Lane::Passive
                    }
                    _ if local.is_some() && local == active_id.as_deref() => Lane::Active,
                    _ if local.is_some() && local == passive_id.as_deref() => Lane::Passive,
                    _ => continue,
                };
                let label = super::message_name(kind).to_string();
                collect.send(line.at, Origin::Kernel, kind, from, label);
                if kind == MsgKind::Rtu && rtu.is_none() {
                    rtu = Some((line.at, collect.arrows.len() - 1));
                }
                continue;
            }
            match event {
                "cm_req_handler"
                    if line.field("src") == Some(capture.passive.as_str())
                        && line.cm_event() == Some("REQ_RECEIVED") =>
                {
                    collect.push(
                        line.at,
                        LATER,
                        Origin::Kernel,
                        Item::Arrive(MsgKind::Req, Lane::Passive),
                    );
                }
                "cm_event_handler" => {
                    let (Some(lane), Some(name)) = (lane_of(line), line.cm_event()) else {
                        continue;
                    };
                    match (lane, name) {
                        (Lane::Active, "CONNECT_RESPONSE") => collect.push(
                            line.at,
                            LATER,
                            Origin::Kernel,
                            Item::Arrive(MsgKind::Rep, Lane::Active),
                        ),
                        (_, "DISCONNECTED") => {
                            // The DREQ reaches the side that did not send it; the DREP
                            // answers it.
                            let kind = if lane == Lane::Passive {
                                MsgKind::Dreq
                            } else {
                                MsgKind::Drep
                            };
                            collect.push(line.at, LATER, Origin::Kernel, Item::Arrive(kind, lane));
                        }
                        _ => {}
                    }
                    let tone = match name {
                        "ESTABLISHED" => Tone::Good,
                        "UNREACHABLE" | "REJECTED" | "CONNECT_ERROR" => Tone::Bad,
                        _ => Tone::Plain,
                    };
                    collect.note(line.at, Origin::Kernel, lane, name, tone);
                }
                "rdma_notify" => {
                    calls.retain(|(task, _, _)| *task != line.task);
                    let number = line.field("event").map(str::to_string);
                    calls.push((line.task.clone(), line.at, number));
                }
                "rdma_notify_ret" => {
                    let Some(slot) = calls.iter().position(|(task, _, _)| *task == line.task)
                    else {
                        continue;
                    };
                    let (task, at, number) = calls.remove(slot);
                    let Some(lane) = lane_of_task(&task) else {
                        continue;
                    };
                    let event = match number.as_deref() {
                        Some(IB_EVENT_COMM_EST) | None => "COMM_EST".to_string(),
                        Some(other) => format!("event {other}"),
                    };
                    let answer = notify_answer(line.field("ret").unwrap_or("?"));
                    if lane == Lane::Passive && notify_at.is_none() {
                        notify_at = Some(at);
                    }
                    collect.note(
                        at,
                        Origin::Kernel,
                        lane,
                        &format!("rdma_notify({event}) = {answer}"),
                        Tone::Notify,
                    );
                }
                // The handler runs wherever the packet was processed, so its process
                // says nothing. The client sends first: the first COMM_EST after the
                // REP is the passive QP's, a later one the active QP's (the echo's).
                // Across two hosts, the line's host says it.
                "qp_event" if rep_sent && line.field("type") == Some(IB_EVENT_COMM_EST) => {
                    let lane = super::two_hosts::host_lane(&line.task).unwrap_or(
                        if comm_est_at.is_none() {
                            Lane::Passive
                        } else {
                            Lane::Active
                        },
                    );
                    if lane == Lane::Passive && comm_est_at.is_none() {
                        comm_est_at = Some(line.at);
                    }
                    collect.note(line.at, Origin::Kernel, lane, "COMM_EST", Tone::Notify);
                }
                _ => {}
            }
        }
        if let Some((at, arrow)) = rtu.filter(|_| capture.nft_drops > 0) {
            collect.arrows[arrow].label = format!("RTU (nft dropped {})", capture.nft_drops);
            collect.push(at, LATER, Origin::Nftables, Item::Lose(arrow));
        }
        library_rows(&mut collect, capture, notify_at, comm_est_at)?;
        let mut ladder = collect.finish(0);
        ladder.hosts = Some([active_addr.clone(), capture.passive.clone()]);
        let device = match capture.device.as_str() {
            "comm-est" => "rxe raising COMM_EST",
            _ => "stock rxe",
        };
        ladder.context = Some(format!("kernel {}, {device}", capture.kernel));
        Ok(ladder)
    }
}

/// The library's rows: its calls, the active side's ESTABLISHED, the client's SEND and
/// the passive side's trigger and ESTABLISHED. `notify_at` and `comm_est_at` are the
/// kernel's times of the passive side's first notify and COMM_EST, if it saw them.
fn library_rows(
    collect: &mut Collect,
    capture: &Capture,
    notify_at: Option<Duration>,
    comm_est_at: Option<Duration>,
) -> Result<(), String> {
    let client = &capture.client;
    let server = &capture.server;
    let lib = Origin::Library;
    if let Some((at, _)) = client.find("rdma_connect") {
        collect.note(at, lib, Lane::Active, "rdma_connect", Tone::Plain);
    }
    if let Some((at, _)) = server.find("rdma_accept") {
        collect.note(at, lib, Lane::Passive, "rdma_accept", Tone::Plain);
    }
    if let Some((at, _)) = client.find("established") {
        collect.note(at, lib, Lane::Active, "ESTABLISHED", Tone::Good);
    }
    if let Some((at, _)) = client.find("send") {
        collect.send(at, lib, MsgKind::Data, Lane::Active, "SEND".into());
    }
    let (established, via) = server
        .find("established")
        .ok_or("the server's timeline has no established entry: the connection never was")?;
    // The endpoint records when it read ESTABLISHED, not when the trigger came: the
    // trigger is drawn just before the notify it caused (the kernel's probe), else at
    // the ESTABLISHED. The SEND arrived when its packet raised COMM_EST, if the kernel
    // saw that, else with the trigger.
    let trigger_at = notify_at.unwrap_or(established);
    let arrival = comm_est_at.unwrap_or(trigger_at);
    collect.push(
        arrival,
        FIRST,
        lib,
        Item::Arrive(MsgKind::Data, Lane::Passive),
    );
    let trigger = if via.contains("comm-est") {
        Some(("COMM_EST", Tone::Notify))
    } else if via.contains("receive-completion") {
        Some(("receive completion", Tone::Data))
    } else {
        None
    };
    if let Some((trigger, tone)) = trigger {
        collect.push(
            trigger_at,
            FIRST,
            lib,
            Item::Note(Lane::Passive, format!("{trigger} (endpoint)"), tone),
        );
        if notify_at.is_none() {
            // Without the probe, the library's word for the notify: its answer was 0
            // (else the endpoint says the RTU won the race).
            let answer = if via.starts_with("established rtu-won-race") {
                "EISCONN"
            } else {
                "0"
            };
            collect.note(
                established,
                lib,
                Lane::Passive,
                &format!("rdma_notify(COMM_EST) = {answer}"),
                Tone::Notify,
            );
        }
    }
    collect.note(
        established,
        lib,
        Lane::Passive,
        "ESTABLISHED reported",
        Tone::Good,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_lines_are_read_with_and_without_the_flags_column() {
        let line = TraceLine::parse(
            "     kworker/1:1-29      [001] .....    15.772950: cm_event_handler: cm.id=1 \
             src=10.77.1.1:7471 dst=10.77.1.2:50785 tos=0 CONNECT_REQUEST (4/0)",
        )
        .expect("an event line");
        assert_eq!(line.at, Duration::new(15, 772_950_000));
        assert_eq!(line.task, "kworker/1:1-29");
        assert_eq!(line.event, "cm_event_handler");
        assert_eq!(line.field("src"), Some("10.77.1.1:7471"));
        assert_eq!(line.cm_event(), Some("CONNECT_REQUEST"));
        let old = TraceLine::parse("cmnotify-9 [000] 1.5: icm_send_rtu: local_id=7 remote_id=8")
            .expect("no flags column");
        assert_eq!(
            (old.at, old.field("local_id")),
            (Duration::from_millis(1500), Some("7"))
        );
        for junk in [
            "# tracer: nop",
            "",
            "=== end",
            "cmnotify [x] no stamp: here",
        ] {
            assert_eq!(TraceLine::parse(junk), None, "{junk}");
        }
    }

    #[test]
    fn a_timeline_reads_back_what_it_wrote() {
        let timeline = Timeline {
            role: "server".into(),
            entries: vec![
                (Duration::from_nanos(15_808_000_123), "rdma_accept".into()),
                (
                    Duration::from_nanos(15_870_000_000),
                    "established notify receive-completion".into(),
                ),
            ],
        };
        assert_eq!(Timeline::parse(&timeline.render()), Ok(timeline));
        assert!(Timeline::parse("role x\nsoon rdma_accept\n").is_err());
    }
}
