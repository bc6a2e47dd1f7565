//! Ladder diagrams of three connections: a lost RTU rescued by notify, a late RTU, and
//! an RTU that won the race (notify answered EISCONN). Each SVG is parsed with a real
//! XML parser and checked against the trace it was drawn from; the text renderings are
//! compared byte for byte with `tests/golden/`, and the README's picture with
//! `docs/ladder-lost-rtu.svg`.
//!
//! After an intended change of the drawing, regenerate the golden files and the
//! README's picture with `UPDATE_GOLDEN=1 cargo test -p cm-tools --test ladder`, and
//! review the diff.

use std::path::PathBuf;
use std::time::Duration;

use cm_core::{AsyncEventSource, AsyncEventType, CmEvent, CmEventType, CmId, NotifyOutcome};
use cm_mock::sim::{FaultAction, FaultRule, MsgKind, SimConfig, SimPair, TraceEntry, TraceEvent};
use cm_tools::ladder::svg::{TextBox, FONT_SIZE};
use cm_tools::ladder::{svg, text, Ladder};
use cm_tools::sim_run::{run, SimRun};

const LOST_RED: &str = "#d62728";
/// How late the late RTU is: after the data's COMM_EST, notify and the server's
/// ESTABLISHED (120 µs), before the client's DREQ (sent at 130 µs, once the echo came
/// back), so that it lands on an established connection.
const RTU_DELAY: Duration = Duration::from_micros(60);

fn workspace_file(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
}

/// Every RTU lost; the client's SEND raises COMM_EST and the pump's notify rescues the
/// connection. The same run as `cmnotify -c 1 --trace 0`.
fn lost_rtu() -> Vec<TraceEntry> {
    traced(SimRun {
        connections: 1,
        trace_conn: Some(0),
        ..SimRun::default()
    })
}

/// The RTU delayed past the data: notify rescues the connection, the RTU lands late.
fn late_rtu() -> Vec<TraceEntry> {
    traced(SimRun {
        connections: 1,
        rtu_loss: 0.0,
        rules: vec![FaultRule::new(MsgKind::Rtu, FaultAction::Delay(RTU_DELAY))],
        trace_conn: Some(0),
        ..SimRun::default()
    })
}

/// The traced connection's entries of a run whose one connection the pump rescued (as
/// the report counts it: the ladder must then show notify answering 0).
fn traced(config: SimRun) -> Vec<TraceEntry> {
    let report = run(&config);
    assert_eq!(
        (report.established(), report.forced()),
        (1, 1),
        "{:?}",
        report.trace
    );
    report.trace_entries
}

/// The RTU 2 µs behind the data, and a server slow to read its COMM_EST: by the time it
/// calls notify the RTU has arrived, and notify answers EISCONN. The run loop of
/// `sim_run` always forwards COMM_EST before the next delivery, so this one is driven by
/// hand.
fn rtu_won() -> Vec<TraceEntry> {
    let config = SimConfig {
        trace: true,
        ..SimConfig::default()
    };
    let mut pair = SimPair::new(config, 1);
    pair.fabric.add_fault(FaultRule::new(
        MsgKind::Rtu,
        FaultAction::Delay(Duration::from_micros(2)),
    ));
    pair.listen(7471).expect("a fresh node listens");
    let (active, passive) = pair.connect_until_rep(7471).expect("REQ and REP");
    let mut device = pair.server.node.device();
    loop {
        while let Some(event) = pair.client.next_event().expect("a live channel") {
            let kind = event.event_type();
            event.ack().expect("acked once");
            if kind == CmEventType::Established {
                active.post_send(64).expect("an established QP sends");
            }
        }
        if let Some(event) = device.try_next_async_event().expect("a simulated device") {
            assert_eq!(event.event_type, AsyncEventType::CommEst);
            break;
        }
        assert!(pair.fabric.step(), "the data never raised COMM_EST");
    }
    // The server is slow: the RTU lands before its notify.
    assert!(pair.fabric.step());
    assert_eq!(
        passive.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    pair.run_until_idle();
    pair.fabric.trace().expect("tracing is on").entries
}

/// What the diagram must show for an entry, in the trace's order: arrows' ends and the
/// notes' gist, independently of how the ladder words them.
fn expected_marks(entries: &[TraceEntry]) -> Vec<String> {
    let name = |kind: MsgKind| match kind {
        MsgKind::Data => "SEND".to_owned(),
        other => other.to_string(),
    };
    entries
        .iter()
        .filter_map(|entry| match &entry.event {
            TraceEvent::Sent { kind, .. } => Some(format!("send {}", name(*kind))),
            TraceEvent::Delivered { kind, .. } => Some(format!("arrive {}", name(*kind))),
            TraceEvent::Fault {
                action: FaultAction::Drop,
                ..
            } => Some("lost".into()),
            TraceEvent::Ignored { .. } => Some("ignored".into()),
            TraceEvent::CmEvent { event, .. } => Some(
                event
                    .name()
                    .expect("a known event")
                    .trim_start_matches("RDMA_CM_EVENT_")
                    .to_owned(),
            ),
            TraceEvent::AsyncEvent { .. } => Some("COMM_EST".into()),
            TraceEvent::RecvCompletion { .. } => Some("receive completion".into()),
            TraceEvent::Notify { .. } => Some("rdma_notify".into()),
            TraceEvent::Fault { .. } | TraceEvent::State { .. } => None,
        })
        .collect()
}

fn number(node: roxmltree::Node<'_, '_>, attribute: &str) -> f64 {
    node.attribute(attribute)
        .unwrap_or_else(|| panic!("{node:?} has {attribute}"))
        .parse()
        .expect("a number")
}

fn has_class(node: &roxmltree::Node<'_, '_>, class: &str) -> bool {
    node.attribute("class") == Some(class)
}

fn child<'a, 'i>(node: roxmltree::Node<'a, 'i>, tag: &str) -> roxmltree::Node<'a, 'i> {
    node.children()
        .find(|c| c.has_tag_name(tag))
        .unwrap_or_else(|| panic!("{node:?} has a <{tag}>"))
}

fn text_of<'a>(node: roxmltree::Node<'a, '_>) -> &'a str {
    node.text().unwrap_or("")
}

/// One arrow as drawn.
#[derive(Debug, PartialEq)]
struct DrawnArrow {
    kind: String,
    from: String,
    /// "arrived", "lost" or "in-flight".
    end: String,
    stroke: String,
    label: String,
    /// Where its line ends.
    end_y: f64,
}

/// What one parsed diagram shows.
struct Drawn {
    /// (y, mark) of every arrow end, ✕ and note, top to bottom.
    marks: Vec<(f64, String)>,
    /// Every arrow, in document order.
    arrows: Vec<DrawnArrow>,
    /// (lane, y, text) of every note.
    notes: Vec<(String, f64, String)>,
    /// The x of the active and the passive lane.
    lanes: (f64, f64),
    /// How many ✕ marks.
    crosses: usize,
    /// The y of every time label on the axis, top to bottom.
    times: Vec<f64>,
}

fn parse(svg: &str) -> Drawn {
    let document = roxmltree::Document::parse(svg).expect("well-formed XML");
    let root = document.root_element();
    assert!(root.has_tag_name("svg"));
    let lane_x = |lane: &str| {
        let lines: Vec<_> = root
            .descendants()
            .filter(|n| has_class(n, "lane") && n.attribute("data-lane") == Some(lane))
            .collect();
        assert_eq!(lines.len(), 1, "one {lane} lane");
        number(lines[0], "x1")
    };
    let mut drawn = Drawn {
        marks: Vec::new(),
        arrows: Vec::new(),
        notes: Vec::new(),
        lanes: (lane_x("active"), lane_x("passive")),
        crosses: 0,
        times: Vec::new(),
    };
    for node in root.descendants() {
        if has_class(&node, "arrow") {
            let kind = node.attribute("data-kind").expect("a kind").to_owned();
            let end = node.attribute("data-end").expect("an end").to_owned();
            let shaft = child(node, "line");
            drawn
                .marks
                .push((number(shaft, "y1"), format!("send {kind}")));
            if end == "arrived" {
                drawn
                    .marks
                    .push((number(shaft, "y2"), format!("arrive {kind}")));
            }
            drawn.arrows.push(DrawnArrow {
                kind,
                from: node.attribute("data-from").expect("a sender").to_owned(),
                end,
                stroke: shaft.attribute("stroke").expect("a colour").to_owned(),
                label: text_of(child(node, "text")).to_owned(),
                end_y: number(shaft, "y2"),
            });
        } else if has_class(&node, "lost") {
            let stroke = child(node, "line");
            assert_eq!(stroke.attribute("stroke"), Some(LOST_RED), "the ✕ is red");
            let y = (number(stroke, "y1") + number(stroke, "y2")) / 2.0;
            drawn.marks.push((y, "lost".into()));
            drawn.crosses += 1;
        } else if has_class(&node, "note") {
            let y = number(child(node, "circle"), "cy");
            let text = text_of(child(node, "text")).to_owned();
            let gist = if text.starts_with("rdma_notify") {
                "rdma_notify".to_owned()
            } else if text.contains(" ignored: ") {
                "ignored".to_owned()
            } else {
                text.clone()
            };
            drawn.marks.push((y, gist));
            let lane = node.attribute("data-lane").expect("a lane").to_owned();
            drawn.notes.push((lane, y, text));
        } else if has_class(&node, "time") {
            drawn.times.push(number(node, "y"));
        }
    }
    // Stable: an arrow that arrives at the row it left (never here) keeps its order.
    drawn.marks.sort_by(|a, b| a.0.total_cmp(&b.0));
    drawn
}

fn inherited<'a>(node: roxmltree::Node<'a, '_>, attribute: &str) -> Option<&'a str> {
    node.ancestors().find_map(|n| n.attribute(attribute))
}

/// Every label of `svg` and its box by `shape` (`TextBox::of`: characters × font size ×
/// 0.6 wide, one font size tall above the baseline; or what the layout reserved), in
/// document order.
fn label_boxes(
    svg: &str,
    shape: fn(&str, f64, f64, &str, f64) -> TextBox,
) -> Vec<(String, TextBox)> {
    let document = roxmltree::Document::parse(svg).expect("well-formed XML");
    document
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| {
            let size: f64 = inherited(n, "font-size")
                .expect("a font size")
                .parse()
                .expect("a number");
            let anchor = inherited(n, "text-anchor").unwrap_or("start");
            let text = text_of(n).to_owned();
            let area = shape(&text, number(n, "x"), number(n, "y"), anchor, size);
            (text, area)
        })
        .collect()
}

/// No two labels' estimated boxes overlap.
fn assert_no_overlap(svg: &str) {
    let boxes = label_boxes(svg, TextBox::of);
    assert!(boxes.len() > 10, "labels: {}", boxes.len());
    for (i, (a, box_a)) in boxes.iter().enumerate() {
        for (b, box_b) in &boxes[i + 1..] {
            assert!(
                !box_a.overlaps(box_b),
                "`{a}` {box_a:?} overlaps `{b}` {box_b:?}"
            );
        }
    }
}

/// Draws `entries` and checks what every ladder shows whatever the fault: lanes, the
/// trace's order, the axis, ESTABLISHED on both sides, no label over another.
fn draw(entries: &[TraceEntry]) -> (String, Drawn) {
    let svg = svg::render(&Ladder::from_trace(0, entries).expect("a REQ"));
    let drawn = parse(&svg);
    assert!(drawn.lanes.0 < drawn.lanes.1, "active on the left");
    let marks: Vec<&str> = drawn.marks.iter().map(|(_, m)| m.as_str()).collect();
    assert_eq!(
        marks,
        expected_marks(entries),
        "the diagram follows the trace"
    );
    let ys: Vec<f64> = drawn.marks.iter().map(|(y, _)| *y).collect();
    assert!(
        ys.windows(2).all(|w| w[1] - w[0] >= FONT_SIZE),
        "one row per event, at least a label's height apart: {ys:?}"
    );
    assert!(drawn.times.windows(2).all(|w| w[0] < w[1]));
    assert!(!drawn.times.is_empty());
    for lane in ["active", "passive"] {
        assert!(
            drawn
                .notes
                .iter()
                .any(|(l, _, text)| l == lane && text == "ESTABLISHED"),
            "ESTABLISHED on the {lane} side"
        );
    }
    assert_no_overlap(&svg);
    (svg, drawn)
}

impl Drawn {
    fn note_y(&self, lane: &str, starts: &str) -> f64 {
        self.notes
            .iter()
            .find(|(l, _, text)| l == lane && text.starts_with(starts))
            .unwrap_or_else(|| panic!("a {lane} note `{starts}…`: {:?}", self.notes))
            .1
    }

    /// The one RTU arrow.
    fn rtu(&self) -> &DrawnArrow {
        let rtus: Vec<_> = self.arrows.iter().filter(|a| a.kind == "RTU").collect();
        assert_eq!(rtus.len(), 1, "{:?}", self.arrows);
        rtus[0]
    }
}

#[test]
fn a_lost_rtu_ends_in_a_red_cross_and_notify_rescues_the_connection() {
    let (svg, drawn) = draw(&lost_rtu());
    assert_eq!(drawn.crosses, 1);
    let rtu = drawn.rtu();
    assert_eq!(
        (&*rtu.from, &*rtu.end, &*rtu.stroke, &*rtu.label),
        ("active", "lost", LOST_RED, "RTU")
    );
    let notify = drawn.note_y("passive", "rdma_notify(COMM_EST) = 0");
    assert!(drawn.note_y("passive", "COMM_EST") < notify);
    assert!(notify < drawn.note_y("passive", "ESTABLISHED"));
    assert!(svg.contains("connection 0: RTU lost, rescued by rdma_notify"));
}

#[test]
fn a_late_rtu_lands_after_notify_and_is_ignored() {
    let (svg, drawn) = draw(&late_rtu());
    assert_eq!(drawn.crosses, 0);
    let rtu = drawn.rtu();
    let label = format!("RTU (delayed {} µs)", RTU_DELAY.as_micros());
    assert_eq!((&*rtu.end, &*rtu.label), ("arrived", &*label));
    assert_ne!(rtu.stroke, LOST_RED);
    assert!(drawn.note_y("passive", "rdma_notify(COMM_EST) = 0") < rtu.end_y);
    assert!(drawn.note_y("passive", "ESTABLISHED") < rtu.end_y);
    assert!(rtu.end_y < drawn.note_y("passive", "RTU ignored: late RTU"));
    assert!(svg.contains("RTU late, rescued by rdma_notify"));
}

#[test]
fn an_rtu_that_won_the_race_gets_eisconn_from_notify() {
    let (svg, drawn) = draw(&rtu_won());
    assert_eq!(drawn.crosses, 0);
    let (rtu, notify) = (
        drawn.rtu(),
        drawn.note_y("passive", "rdma_notify(COMM_EST) = EISCONN"),
    );
    assert_eq!(rtu.end, "arrived");
    assert!(drawn.note_y("passive", "COMM_EST") < rtu.end_y);
    assert!(rtu.end_y < notify);
    assert!(drawn.note_y("passive", "ESTABLISHED") < notify);
    assert!(svg.contains("the RTU won the race: rdma_notify answered EISCONN"));
}

#[test]
fn labels_never_overlap_whatever_the_faults() {
    let us = Duration::from_micros;
    let rules = [
        vec![FaultRule::new(MsgKind::Rep, FaultAction::Drop).nth(0)],
        vec![FaultRule::new(MsgKind::Req, FaultAction::Drop).nth(0)],
        vec![FaultRule::new(MsgKind::Rtu, FaultAction::Duplicate)],
        vec![FaultRule::new(MsgKind::Rtu, FaultAction::Reorder)],
        vec![FaultRule::new(MsgKind::Data, FaultAction::Delay(us(3)))],
        vec![FaultRule::new(MsgKind::Rtu, FaultAction::Delay(us(9)))],
        vec![
            FaultRule::new(MsgKind::Rtu, FaultAction::Delay(us(15))),
            FaultRule::new(MsgKind::Data, FaultAction::Duplicate),
        ],
    ];
    for (case, rules) in rules.into_iter().enumerate() {
        for (pump, soft_roce) in [(true, false), (true, true), (false, false)] {
            let report = run(&SimRun {
                connections: 2,
                rtu_loss: 0.0,
                drop_rtu_of: if case % 2 == 0 { vec![1] } else { vec![] },
                pump,
                soft_roce,
                seed: case as u64,
                rules: rules.clone(),
                trace_conn: Some(1),
                ..SimRun::default()
            });
            let ladder = Ladder::from_report(&report).expect("a REQ");
            assert_no_overlap(&svg::render(&ladder));
        }
    }
}

/// `expected` must equal the file `relative` (from the workspace root); with
/// `UPDATE_GOLDEN=1` the file is rewritten instead.
fn golden(relative: &str, expected: &str) {
    let path = workspace_file(relative);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, expected).expect("the golden file is writable");
        return;
    }
    let committed = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; generate it with UPDATE_GOLDEN=1", path.display()));
    if committed != expected {
        let (line, (was, now)) = committed
            .lines()
            .chain(std::iter::repeat(""))
            .zip(expected.lines().chain(std::iter::repeat("")))
            .enumerate()
            .find(|(_, (was, now))| was != now)
            .expect("texts that differ differ in a line");
        panic!(
            "{relative} is not what is drawn now (UPDATE_GOLDEN=1 rewrites it); line {}:\n\
             committed: {was}\n\
             drawn:     {now}",
            line + 1
        );
    }
}

#[test]
fn the_text_ladders_match_their_golden_files() {
    for (name, entries) in [
        ("lost-rtu", lost_rtu()),
        ("late-rtu", late_rtu()),
        ("rtu-won", rtu_won()),
    ] {
        let ladder = Ladder::from_trace(0, &entries).expect("a REQ");
        golden(
            &format!("crates/cm-tools/tests/golden/ladder-{name}.txt"),
            &text::render(&ladder),
        );
    }
}

#[test]
fn the_readme_picture_is_current() {
    let ladder = Ladder::from_trace(0, &lost_rtu()).expect("a REQ");
    golden("docs/ladder-lost-rtu.svg", &svg::render(&ladder));
}

/// The text of every `<text>` resvg laid out, and the box of its glyphs on the canvas.
fn glyph_boxes(group: &resvg::usvg::Group, out: &mut Vec<(String, resvg::usvg::Rect)>) {
    for node in group.children() {
        match node {
            resvg::usvg::Node::Group(inner) => glyph_boxes(inner, out),
            resvg::usvg::Node::Text(text) => out.push((
                text.chunks().iter().map(|c| c.text()).collect(),
                text.abs_bounding_box(),
            )),
            resvg::usvg::Node::Path(_) | resvg::usvg::Node::Image(_) => {}
        }
    }
}

/// Renders `svg` to pixels, saves them as `name`.png in the test's target directory
/// (to look at), and returns the pixmap. Every label is laid out with a real font, and
/// its glyphs stay inside the box the layout reserved for it (so the estimate behind
/// "no overlap" holds) and inside the picture.
fn rasterise(svg: &str, name: &str) -> resvg::tiny_skia::Pixmap {
    let mut options = resvg::usvg::Options::default();
    options.fontdb_mut().load_system_fonts();
    let tree = resvg::usvg::Tree::from_str(svg, &options).expect("resvg reads the SVG");
    let mut glyphs = Vec::new();
    glyph_boxes(tree.root(), &mut glyphs);
    let estimated = label_boxes(svg, TextBox::reserved);
    assert_eq!(
        glyphs.len(),
        estimated.len(),
        "every label laid out (no monospace font? Debian: fonts-dejavu-core)"
    );
    let (width, height) = (tree.size().width(), tree.size().height());
    for ((text, glyph), (label, reserved)) in glyphs.iter().zip(&estimated) {
        assert_eq!(text, label);
        // Antialiasing and bold strokes reach a pixel past the advance.
        let slack = 1.0;
        assert!(
            f64::from(glyph.left()) >= reserved.left - slack
                && f64::from(glyph.right()) <= reserved.right + slack
                && f64::from(glyph.top()) >= reserved.top - slack
                && f64::from(glyph.bottom()) <= reserved.bottom + slack,
            "`{text}`: glyphs {glyph:?} outside the reserved {reserved:?}"
        );
        assert!(
            glyph.left() >= 0.0
                && glyph.top() >= 0.0
                && glyph.right() <= width
                && glyph.bottom() <= height,
            "`{text}` {glyph:?} leaves the {width}×{height} picture"
        );
    }
    let size = tree.size().to_int_size();
    let mut pixmap =
        resvg::tiny_skia::Pixmap::new(size.width(), size.height()).expect("a non-empty picture");
    resvg::render(
        &tree,
        resvg::tiny_skia::Transform::default(),
        &mut pixmap.as_mut(),
    );
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.png"));
    pixmap.save_png(&out).expect("the PNG is writable");
    pixmap
}

#[test]
fn the_pictures_render() {
    for (name, entries) in [("late-rtu", late_rtu()), ("rtu-won", rtu_won())] {
        let svg = svg::render(&Ladder::from_trace(0, &entries).expect("a REQ"));
        rasterise(&svg, &format!("ladder-{name}"));
    }
    let svg = svg::render(&Ladder::from_trace(0, &lost_rtu()).expect("a REQ"));
    let pixmap = rasterise(&svg, "ladder-lost-rtu");
    let pixels = pixmap.pixels();
    let red = pixels
        .iter()
        .filter(|p| p.red() > 180 && p.green() < 80 && p.blue() < 80)
        .count();
    let ink = pixels.iter().filter(|p| p.red() < 128).count();
    assert!(red > 40, "the lost RTU is drawn in red: {red} pixels");
    assert!(
        ink * 100 > pixels.len(),
        "lanes and labels are drawn: {ink} dark pixels"
    );
}
