//! Ladder (message sequence) diagrams of one connection, drawn from the fabric's trace:
//! a lane for the active side and one for the passive side, an arrow per message (a lost
//! one ends in a red ✕ on the wire, a delayed one lands late), and on the lanes what each
//! side saw: CM events, COMM_EST, receive completions and the `rdma_notify` call with its
//! answer. [`svg::render`] draws it as SVG, [`text::render`] for a terminal.
//!
//! ```
//! use cm_tools::ladder::Ladder;
//! use cm_tools::sim_run::{run, SimRun};
//!
//! // One connection whose RTU is lost: the data's COMM_EST and rdma_notify rescue it.
//! let report = run(&SimRun { connections: 1, trace_conn: Some(0), ..SimRun::default() });
//! let ladder = Ladder::from_report(&report).unwrap();
//! assert_eq!(ladder.summary(), "RTU lost, rescued by rdma_notify");
//! assert!(cm_tools::ladder::text::render(&ladder).contains("rdma_notify(COMM_EST) = 0"));
//! ```

pub mod kernel;
pub mod svg;
pub mod text;
pub mod two_hosts;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use cm_core::{errno, AsyncEventType, CmEventType, IbCmState, NotifyOutcome};
use cm_mock::sim::{FaultAction, MsgKind, NodeId, SimIdKey, TraceEntry, TraceEvent};

use crate::sim_run::SimReport;

/// One side of the connection: a lane of the diagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The side that sent the REQ (the client).
    Active,
    /// The side that answered with the REP (the server).
    Passive,
}

impl Lane {
    /// The lane's name, as its heading says it.
    pub const fn name(self) -> &'static str {
        match self {
            Lane::Active => "active",
            Lane::Passive => "passive",
        }
    }
}

/// What a mark means, which sets its colour: the lost RTU must stand out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tone {
    /// A handshake message or an ordinary event.
    Plain,
    /// A data SEND and its receive completion.
    Data,
    /// A message lost on the wire.
    Lost,
    /// A message delayed, or ignored because it came too late.
    Late,
    /// ESTABLISHED.
    Good,
    /// COMM_EST and the `rdma_notify` call.
    Notify,
    /// A failure event (UNREACHABLE, REJECTED, …).
    Bad,
}

/// Where a row or an arrow comes from: the simulation's trace, or, for a ladder drawn
/// from the real kernel ([`kernel`]), the kernel's tracepoints, the library's own
/// timeline or the nftables counter. The renderers style them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Origin {
    /// The simulated fabric's trace.
    #[default]
    Simulation,
    /// The kernel's view: a tracefs event (an `rdma_cma`/`ib_cma` tracepoint, or a
    /// kprobe on `rdma_notify` or the QP event handler).
    Kernel,
    /// The library's view: the endpoint's timeline of the connection (`cmnotify
    /// --timeline`), on the same clock.
    Library,
    /// The nftables rule that drops the RTU (its counter says that it did, not when).
    Nftables,
}

impl Origin {
    /// Its name in the SVG's `data-origin` attribute.
    pub const fn name(self) -> &'static str {
        match self {
            Origin::Simulation => "simulation",
            Origin::Kernel => "kernel",
            Origin::Library => "library",
            Origin::Nftables => "nftables",
        }
    }
}

/// The clock of the time axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Clock {
    /// The simulation's virtual clock.
    #[default]
    Virtual,
    /// CLOCK_MONOTONIC (tracefs' `mono` trace clock), from the first row.
    Monotonic,
}

impl Clock {
    /// The axis' heading.
    pub const fn heading(self) -> &'static str {
        match self {
            Clock::Virtual => AXIS_HEADING,
            Clock::Monotonic => "real time",
        }
    }

    /// A skip longer than this between two rows is drawn as a break: the simulation's
    /// steps are microseconds, the real kernel's (under emulation) milliseconds.
    pub const fn gap_break(self) -> Duration {
        match self {
            Clock::Virtual => GAP_BREAK,
            Clock::Monotonic => Duration::from_millis(50),
        }
    }
}

/// How a message's arrow ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// It arrived at the other lane, at this row.
    Arrived(usize),
    /// It was lost on the wire, at this row.
    Lost(usize),
    /// The trace ends before it arrives.
    InFlight,
}

/// A message between the lanes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrow {
    /// What it says on the arrow ("REQ", "RTU (delayed 200 µs)", "SEND").
    pub label: String,
    /// Its kind.
    pub kind: MsgKind,
    /// The sending lane.
    pub from: Lane,
    /// Its colour.
    pub tone: Tone,
    /// The row it leaves at.
    pub sent: usize,
    /// How it ends.
    pub end: End,
    /// Where it comes from.
    pub origin: Origin,
}

/// What one row of the diagram shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mark {
    /// Arrow `n` leaves its lane.
    Send(usize),
    /// Arrow `n` arrives.
    Arrive(usize),
    /// Arrow `n` is lost.
    Lose(usize),
    /// Something one side saw.
    Note {
        /// Its side.
        lane: Lane,
        /// What it says ("ESTABLISHED", "rdma_notify(COMM_EST) = 0").
        text: String,
        /// Its colour.
        tone: Tone,
    },
}

/// One row: one thing that happened, in trace order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// The run's clock (virtual time on the simulation).
    pub at: Duration,
    /// What happened.
    pub mark: Mark,
    /// Where it comes from.
    pub origin: Origin,
}

/// The diagram of one connection, ready to render.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ladder {
    /// The connection (0-based).
    pub conn: u32,
    /// The active side's node.
    pub active: NodeId,
    /// The passive side's node.
    pub passive: NodeId,
    /// The messages.
    pub arrows: Vec<Arrow>,
    /// The rows, top to bottom.
    pub rows: Vec<Row>,
    /// The clock of the axis.
    pub clock: Clock,
    /// The lanes' hosts as their headings name them (the real kernel's addresses);
    /// `None`: the simulated nodes.
    pub hosts: Option<[String; 2]>,
    /// Said in the title after the connection ("kernel 6.1.0-57-amd64, stock rxe").
    pub context: Option<String>,
    /// The active lane's marks were stamped on another host's clock, aligned to the
    /// passive host's within ± this ([`two_hosts`]); `None`: one clock.
    pub active_clock_uncertainty: Option<Duration>,
}

/// What a ladder cannot be drawn from.
pub const NO_REQ: &str = "the trace has no REQ: nothing to draw";

impl Ladder {
    /// The ladder of the traced connection of a run (`--trace N`).
    pub fn from_report(report: &SimReport) -> Result<Ladder, String> {
        let conn = report
            .run
            .trace_conn
            .ok_or("the run traced no connection (--trace N)")?;
        Ladder::from_trace(conn, &report.trace_entries)
    }

    /// The ladder of connection `conn` from its trace entries (the entries of other
    /// connections must already be filtered out). The lanes are named by the first REQ.
    pub fn from_trace(conn: u32, entries: &[TraceEntry]) -> Result<Ladder, String> {
        let (active, passive) = entries
            .iter()
            .find_map(|e| match e.event {
                TraceEvent::Sent {
                    kind: MsgKind::Req,
                    from,
                    to,
                    ..
                } => Some((from, to)),
                _ => None,
            })
            .ok_or(NO_REQ)?;
        let mut builder = Builder {
            ladder: Ladder {
                conn,
                active,
                passive,
                arrows: Vec::new(),
                rows: Vec::new(),
                clock: Clock::Virtual,
                hosts: None,
                context: None,
                active_clock_uncertainty: None,
            },
            ids: id_lanes(entries),
            in_flight: Vec::new(),
        };
        for entry in entries {
            builder.add(entry);
        }
        Ok(builder.ladder)
    }

    /// The node on `lane`.
    pub fn node(&self, lane: Lane) -> NodeId {
        match lane {
            Lane::Active => self.active,
            Lane::Passive => self.passive,
        }
    }

    /// A lane's heading ("active (node1)", "passive (10.77.1.1)").
    pub fn heading(&self, lane: Lane) -> String {
        match &self.hosts {
            Some([active, passive]) => {
                let host = if lane == Lane::Active {
                    active
                } else {
                    passive
                };
                format!("{} ({host})", lane.name())
            }
            None => format!("{} ({})", lane.name(), self.node(lane)),
        }
    }

    /// The title: the connection, its context if any, and the summary.
    pub fn title(&self) -> String {
        match &self.context {
            Some(context) => format!("connection {} ({context}): {}", self.conn, self.summary()),
            None => format!("connection {}: {}", self.conn, self.summary()),
        }
    }

    /// Across two hosts, what the drawing says of the active lane's clock.
    pub fn clock_note(&self) -> Option<String> {
        self.active_clock_uncertainty.map(|u| {
            format!(
                "active lane: its own host's clock, aligned to the passive host's within ± {} \
                 by the REQ and REP stamps (bars: the rows each active mark may lie among)",
                clock(u)
            )
        })
    }

    /// The lane a row's mark stands on (an arrow's sending or receiving lane); `None`
    /// for a loss, which is on the wire.
    pub fn row_lane(&self, row: &Row) -> Option<Lane> {
        match &row.mark {
            Mark::Note { lane, .. } => Some(*lane),
            Mark::Send(arrow) => Some(self.arrows[*arrow].from),
            Mark::Arrive(arrow) => Some(match self.arrows[*arrow].from {
                Lane::Active => Lane::Passive,
                Lane::Passive => Lane::Active,
            }),
            Mark::Lose(_) => None,
        }
    }

    /// Across two hosts, the first and last rows an active-lane mark at row `index` may
    /// lie among, given the clocks' uncertainty (rows are in time order).
    pub fn uncertain_rows(&self, index: usize) -> Option<(usize, usize)> {
        let u = self.active_clock_uncertainty?;
        let row = self.rows.get(index)?;
        if self.row_lane(row) != Some(Lane::Active) {
            return None;
        }
        let low = self.rows.partition_point(|r| r.at + u < row.at);
        let high = self.rows.partition_point(|r| r.at <= row.at + u);
        Some((low, high.saturating_sub(1).max(low)))
    }

    /// Whether any row or arrow comes from the real kernel's capture (the renderers
    /// then add a legend of the origins).
    pub fn is_real(&self) -> bool {
        self.rows.iter().any(|r| r.origin != Origin::Simulation)
    }

    /// One line saying how the connection went, from what the diagram shows.
    pub fn summary(&self) -> String {
        // A transient error may come before the call that rescues the connection.
        let notifies: Vec<&str> = self
            .notes(Lane::Passive)
            .filter(|t| t.starts_with("rdma_notify"))
            .collect();
        let rtu = |pred: fn(&Arrow) -> bool| {
            self.arrows
                .iter()
                .any(|a| a.kind == MsgKind::Rtu && pred(a))
        };
        let failure = [Lane::Passive, Lane::Active].into_iter().find_map(|lane| {
            self.rows.iter().find_map(|row| match &row.mark {
                Mark::Note {
                    lane: l,
                    text,
                    tone: Tone::Bad,
                } if *l == lane => Some(format!("{} side {text}", lane.name())),
                _ => None,
            })
        });
        if let Some(failure) = failure {
            return failure;
        }
        let rescued = notifies.iter().any(|n| n.ends_with("= 0"));
        match (rescued, notifies.last().copied()) {
            (true, _) if rtu(|a| matches!(a.end, End::Lost(_))) => {
                "RTU lost, rescued by rdma_notify".into()
            }
            (true, _) if rtu(|a| a.tone == Tone::Late) => "RTU late, rescued by rdma_notify".into(),
            (true, _) => "rescued by rdma_notify".into(),
            (false, Some(n)) if n.ends_with("EISCONN") => {
                "the RTU won the race: rdma_notify answered EISCONN".into()
            }
            (false, Some(n)) => n.to_owned(),
            (false, None) if self.notes(Lane::Passive).any(|t| t == ESTABLISHED) => {
                "established by the RTU".into()
            }
            (false, None) => "not established".into(),
        }
    }

    /// The notes of one lane, in order.
    fn notes(&self, lane: Lane) -> impl Iterator<Item = &str> {
        self.rows.iter().filter_map(move |row| match &row.mark {
            Mark::Note { lane: l, text, .. } if *l == lane => Some(text.as_str()),
            _ => None,
        })
    }
}

/// The note of the CM event ESTABLISHED.
const ESTABLISHED: &str = "ESTABLISHED";

/// Which lane each CM id is on: the id that sent the REQ is active, the one that
/// received it passive. Found first, because an id's events may come before its state.
fn id_lanes(entries: &[TraceEntry]) -> HashMap<SimIdKey, Lane> {
    let mut lanes = HashMap::new();
    for entry in entries {
        let (id, lane) = match entry.event {
            TraceEvent::State {
                id,
                to: IbCmState::ReqSent,
                ..
            } => (id, Lane::Active),
            TraceEvent::State {
                id,
                to: IbCmState::ReqRcvd,
                ..
            } => (id, Lane::Passive),
            _ => continue,
        };
        lanes.entry(id).or_insert(lane);
    }
    lanes
}

/// Turns trace entries into rows, pairing each message's sending and arrival.
struct Builder {
    ladder: Ladder,
    ids: HashMap<SimIdKey, Lane>,
    /// Arrows sent and not yet arrived or lost, oldest first.
    in_flight: Vec<usize>,
}

impl Builder {
    fn lane_of_node(&self, node: NodeId) -> Option<Lane> {
        if node == self.ladder.active {
            Some(Lane::Active)
        } else if node == self.ladder.passive {
            Some(Lane::Passive)
        } else {
            None
        }
    }

    fn row(&mut self, at: Duration, mark: Mark) {
        self.ladder.rows.push(Row {
            at,
            mark,
            origin: Origin::Simulation,
        });
    }

    fn note(&mut self, at: Duration, lane: Option<Lane>, text: String, tone: Tone) {
        if let Some(lane) = lane {
            self.row(at, Mark::Note { lane, text, tone });
        }
    }

    /// The oldest arrow in flight of `kind`, the newest first when `newest` (a fault
    /// hits the message just sent).
    fn take_in_flight(&mut self, kind: MsgKind, newest: bool) -> Option<usize> {
        let arrows = &self.ladder.arrows;
        let mut matching = self
            .in_flight
            .iter()
            .enumerate()
            .filter(|(_, &a)| arrows[a].kind == kind);
        let (slot, &arrow) = if newest {
            matching.next_back()?
        } else {
            matching.next()?
        };
        self.in_flight.remove(slot);
        Some(arrow)
    }

    fn add(&mut self, entry: &TraceEntry) {
        let at = entry.at;
        match &entry.event {
            &TraceEvent::Sent {
                kind,
                from,
                retransmit,
                ..
            } => {
                let Some(from) = self.lane_of_node(from) else {
                    return;
                };
                let mut label = message_name(kind).to_owned();
                if retransmit {
                    label.push_str(" (retry)");
                }
                let arrow = self.ladder.arrows.len();
                self.ladder.arrows.push(Arrow {
                    label,
                    kind,
                    from,
                    tone: if kind == MsgKind::Data {
                        Tone::Data
                    } else {
                        Tone::Plain
                    },
                    sent: self.ladder.rows.len(),
                    end: End::InFlight,
                    origin: Origin::Simulation,
                });
                self.in_flight.push(arrow);
                self.row(at, Mark::Send(arrow));
            }
            &TraceEvent::Fault { kind, action, .. } => {
                let Some(arrow) = self.take_in_flight(kind, true) else {
                    return;
                };
                let suffix = match action {
                    FaultAction::Drop => {
                        self.ladder.arrows[arrow].tone = Tone::Lost;
                        self.ladder.arrows[arrow].end = End::Lost(self.ladder.rows.len());
                        self.row(at, Mark::Lose(arrow));
                        return;
                    }
                    FaultAction::Delay(by) => format!("delayed {}", clock(by)),
                    FaultAction::Duplicate => "duplicated".to_owned(),
                    FaultAction::Reorder => "reordered".to_owned(),
                };
                let shown = &mut self.ladder.arrows[arrow];
                let name = shown.label.clone();
                shown.label = format!("{name} ({suffix})");
                shown.tone = Tone::Late;
                self.in_flight.push(arrow);
                if action == FaultAction::Duplicate {
                    // Two arrivals: the copy is one more arrow from the same row, behind
                    // the original.
                    let copy = Arrow {
                        label: format!("{name} (copy)"),
                        ..self.ladder.arrows[arrow].clone()
                    };
                    self.ladder.arrows.push(copy);
                    self.in_flight.push(self.ladder.arrows.len() - 1);
                }
            }
            &TraceEvent::Delivered { kind, .. } => {
                if let Some(arrow) = self.take_in_flight(kind, false) {
                    self.ladder.arrows[arrow].end = End::Arrived(self.ladder.rows.len());
                    self.row(at, Mark::Arrive(arrow));
                }
            }
            &TraceEvent::Ignored { kind, reason, .. } => {
                // The arrival has its row; say on the receiving lane why it did nothing.
                let lane = self
                    .ladder
                    .arrows
                    .iter()
                    .rev()
                    .find(|a| a.kind == kind && matches!(a.end, End::Arrived(_)))
                    .map(|a| match a.from {
                        Lane::Active => Lane::Passive,
                        Lane::Passive => Lane::Active,
                    });
                let reason = reason.split(" (").next().unwrap_or(reason);
                self.note(
                    at,
                    lane,
                    format!("{} ignored: {reason}", message_name(kind)),
                    Tone::Late,
                );
            }
            TraceEvent::State { .. } => {}
            &TraceEvent::CmEvent {
                id, event, status, ..
            } => {
                let name = event.name().map_or_else(
                    || event.to_string(),
                    |n| n.trim_start_matches("RDMA_CM_EVENT_").to_owned(),
                );
                let text = match status {
                    0 => name,
                    status => format!("{name} (status {status})"),
                };
                let tone = if event == CmEventType::Established {
                    Tone::Good
                } else if event.is_connect_failure() {
                    Tone::Bad
                } else {
                    Tone::Plain
                };
                self.note(at, self.ids.get(&id).copied(), text, tone);
            }
            TraceEvent::AsyncEvent { node, event } => {
                let tone = if event.event_type == AsyncEventType::CommEst {
                    Tone::Notify
                } else {
                    Tone::Plain
                };
                self.note(
                    at,
                    self.lane_of_node(*node),
                    async_name(event.event_type).to_owned(),
                    tone,
                );
            }
            TraceEvent::RecvCompletion { node, .. } => {
                self.note(
                    at,
                    self.lane_of_node(*node),
                    "receive completion".into(),
                    Tone::Data,
                );
            }
            TraceEvent::Notify {
                id, event, result, ..
            } => {
                let answer = match result {
                    Ok(NotifyOutcome::Established) => "0".to_owned(),
                    Ok(NotifyOutcome::AlreadyEstablished) => "EISCONN".to_owned(),
                    Err(error) => errno::name(error.errno())
                        .map_or_else(|| format!("-{}", error.errno()), str::to_owned),
                };
                self.note(
                    at,
                    self.ids.get(id).copied(),
                    format!("rdma_notify({}) = {answer}", async_name(*event)),
                    Tone::Notify,
                );
            }
        }
    }
}

/// A message's name on its arrow: the CM's names, "SEND" for data.
pub(crate) fn message_name(kind: MsgKind) -> &'static str {
    match kind {
        MsgKind::Data => "SEND",
        other => other.name(),
    }
}

/// An asynchronous event's short name (COMM_EST is what engineers call it).
fn async_name(event: AsyncEventType) -> &'static str {
    match event {
        AsyncEventType::CommEst => "COMM_EST",
        other => other.libibverbs_str(),
    }
}

/// The time axis' heading: the simulation's clock is virtual.
pub const AXIS_HEADING: &str = "virtual time";

/// A skip of the clock between two rows longer than this is drawn as a break: the rows
/// are not to scale there.
pub const GAP_BREAK: Duration = Duration::from_millis(1);

/// Whether the clock skips more than its [`Clock::gap_break`] between row `row` and the
/// one above.
pub fn clock_jumps(ladder: &Ladder, row: usize) -> bool {
    row > 0
        && ladder.rows[row].at.saturating_sub(ladder.rows[row - 1].at) > ladder.clock.gap_break()
}

/// Per row, its time on the axis: shown where the clock moved since the row above, so
/// that rows of one instant share one label.
pub fn axis_labels(ladder: &Ladder) -> Vec<Option<String>> {
    let mut last = None;
    ladder
        .rows
        .iter()
        .map(|row| {
            let moved = last != Some(row.at);
            last = Some(row.at);
            moved.then(|| clock(row.at))
        })
        .collect()
}

/// A time on the run's clock to the microsecond or finer, in the unit that suits it
/// ("70 µs", "4.010 ms", "4.295017 s"): milliseconds and seconds with fixed decimals so
/// that the axis' labels line up; microseconds, mostly whole on the simulation, without
/// trailing zeros.
pub fn clock(at: Duration) -> String {
    let nanos = at.as_nanos() as f64;
    if at < Duration::from_millis(1) {
        let micros = format!("{:.3}", nanos / 1e3);
        format!("{} µs", micros.trim_end_matches('0').trim_end_matches('.'))
    } else if at < Duration::from_secs(1) {
        format!("{:.3} ms", nanos / 1e6)
    } else {
        format!("{:.6} s", nanos / 1e9)
    }
}

/// Draws the traced connection of `report` to `target`: an SVG file, or the text
/// rendering on stdout when `target` is `-`. `Err` is one line for the user.
pub fn write(report: &SimReport, target: &Path) -> Result<(), String> {
    draw(&Ladder::from_report(report)?, target)
}

/// Draws `ladder` to `target`: an SVG file, or the text rendering on stdout when
/// `target` is `-`. `Err` is one line for the user.
pub fn draw(ladder: &Ladder, target: &Path) -> Result<(), String> {
    let ladder = ladder.clone();
    if target == Path::new("-") {
        let text = text::render(&ladder);
        crate::report::write_quietly(&mut std::io::stdout().lock(), text.as_bytes())
    } else {
        std::fs::write(target, svg::render(&ladder))
            .map_err(|e| format!("cannot write {}: {e}", target.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duplicated_rtu_arrives_twice_and_a_trace_without_req_is_refused() {
        let report = crate::sim_run::run(&crate::sim_run::SimRun {
            connections: 1,
            rtu_loss: 0.0,
            rules: vec![cm_mock::sim::FaultRule::new(
                MsgKind::Rtu,
                FaultAction::Duplicate,
            )],
            trace_conn: Some(0),
            ..Default::default()
        });
        let ladder = Ladder::from_report(&report).expect("a REQ");
        let rtus: Vec<_> = ladder
            .arrows
            .iter()
            .filter(|a| a.kind == MsgKind::Rtu)
            .map(|a| (a.label.as_str(), matches!(a.end, End::Arrived(_))))
            .collect();
        assert_eq!(rtus, [("RTU (duplicated)", true), ("RTU (copy)", true)]);
        let after_req = report
            .trace_entries
            .iter()
            .position(|e| {
                matches!(
                    e.event,
                    TraceEvent::Sent {
                        kind: MsgKind::Req,
                        ..
                    }
                )
            })
            .expect("a REQ");
        assert_eq!(
            Ladder::from_trace(0, &report.trace_entries[after_req + 1..]),
            Err(NO_REQ.to_owned())
        );
    }

    #[test]
    fn the_clock_picks_its_unit_and_aligns_milliseconds_and_seconds() {
        let cases = [
            (Duration::from_micros(70), "70 µs"),
            (Duration::from_nanos(1), "0.001 µs"),
            (Duration::from_micros(4010), "4.010 ms"),
            (Duration::from_millis(200), "200.000 ms"),
            (
                Duration::from_secs(47) + Duration::from_micros(244_700),
                "47.244700 s",
            ),
            (Duration::from_nanos(4_295_017_000), "4.295017 s"),
        ];
        for (at, shown) in cases {
            assert_eq!(clock(at), shown);
        }
    }
}
