//! The ladder as SVG: one row per trace event at a fixed vertical gap (so labels never
//! collide however close the events are in time), the run's clock on the left axis.
//!
//! Text is monospace, so a label's width is its characters × the advance × the font
//! size; the layout sizes every column from that (with [`RESERVED_WIDTH`], a little more
//! than real fonts' advance) and places each arrow's label where no other label is.

use svg::node::element::{Circle, Element, Group, Line, Polygon, Rectangle, Title};
use svg::node::{Node, Value};
use svg::Document;

use super::{axis_labels, clock_jumps, Arrow, End, Ladder, Lane, Mark, Origin, Tone};

/// The font size of every label but the title, in px.
pub const FONT_SIZE: f64 = 12.0;
/// The title's font size, in px.
pub const TITLE_SIZE: f64 = 14.0;
/// A monospace character's advance, as a fraction of the font size: the estimate labels
/// are checked with (DejaVu Sans Mono's 0.602 rounds to it).
pub const CHAR_WIDTH: f64 = 0.6;
/// The advance the layout reserves: above common monospace fonts' (DejaVu Sans Mono and
/// Menlo 0.602, Consolas 0.55), so that real glyphs stay inside their boxes.
pub const RESERVED_WIDTH: f64 = 0.62;
/// The vertical gap between rows, in px: more than a label's height.
pub const ROW_GAP: f64 = 24.0;
const PAD: f64 = 10.0;
/// Where the first row's band starts: below the title and the lane headings.
const TOP: f64 = 64.0;
/// The narrowest wire between the lanes.
const MIN_WIRE: f64 = 360.0;
const FONT_FAMILY: &str = "DejaVu Sans Mono, Menlo, Consolas, monospace";

/// A label's box: left, top, right, bottom.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TextBox {
    /// Left edge.
    pub left: f64,
    /// Top edge.
    pub top: f64,
    /// Right edge.
    pub right: f64,
    /// Bottom edge.
    pub bottom: f64,
}

impl TextBox {
    /// The estimated box of `text` set at (`x`, baseline `y`) with `anchor` ("start",
    /// "middle", "end") and `size`: [`CHAR_WIDTH`] per character, one font size above the
    /// baseline, a fifth below (descenders).
    pub fn of(text: &str, x: f64, y: f64, anchor: &str, size: f64) -> TextBox {
        TextBox::with_advance(text, x, y, anchor, size, CHAR_WIDTH)
    }

    /// The box the layout reserves for `text`: as [`TextBox::of`], with
    /// [`RESERVED_WIDTH`] per character.
    pub fn reserved(text: &str, x: f64, y: f64, anchor: &str, size: f64) -> TextBox {
        TextBox::with_advance(text, x, y, anchor, size, RESERVED_WIDTH)
    }

    fn with_advance(text: &str, x: f64, y: f64, anchor: &str, size: f64, advance: f64) -> Self {
        let width = text.chars().count() as f64 * size * advance;
        let left = match anchor {
            "middle" => x - width / 2.0,
            "end" => x - width,
            _ => x,
        };
        TextBox {
            left,
            top: y - size,
            right: left + width,
            bottom: y + size * 0.2,
        }
    }

    /// Whether two boxes share any area.
    pub fn overlaps(&self, other: &TextBox) -> bool {
        self.left < other.right
            && other.left < self.right
            && self.top < other.bottom
            && other.top < self.bottom
    }
}

/// The width the layout reserves for a label.
fn width(text: &str) -> f64 {
    text.chars().count() as f64 * FONT_SIZE * RESERVED_WIDTH
}

/// Rounds to a tenth of a pixel: short, stable numbers in the file.
fn px(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

fn colour(tone: Tone) -> &'static str {
    match tone {
        Tone::Plain => "#222222",
        Tone::Data => "#1f6fb4",
        Tone::Lost | Tone::Bad => "#d62728",
        Tone::Late => "#c26100",
        Tone::Good => "#2a8a3a",
        Tone::Notify => "#7b3fb5",
    }
}

fn bold(tone: Tone) -> bool {
    matches!(tone, Tone::Lost | Tone::Bad | Tone::Good | Tone::Notify)
}

/// Where things go.
struct Layout {
    axis: f64,
    active: f64,
    passive: f64,
    width: f64,
    height: f64,
}

impl Layout {
    fn new(ladder: &Ladder, times: &[Option<String>], title: &str) -> Layout {
        let widest = |texts: &mut dyn Iterator<Item = f64>| texts.fold(0.0, f64::max);
        let note_width = |lane: Lane| {
            widest(&mut ladder.rows.iter().filter_map(|row| match &row.mark {
                Mark::Note { lane: l, text, .. } if *l == lane => Some(width(text)),
                _ => None,
            }))
            .max(width(&ladder.heading(lane)) / 2.0)
        };
        let axis = PAD
            + widest(&mut times.iter().flatten().map(|t| width(t)))
                .max(width(ladder.clock.heading()))
            + PAD;
        let active = axis + PAD + note_width(Lane::Active) + 2.0 * PAD;
        let wire = (2.0 * widest(&mut ladder.arrows.iter().map(|a| width(&a.label))) + 4.0 * PAD)
            .max(MIN_WIRE);
        let passive = active + wire;
        let right = passive + 2.0 * PAD + note_width(Lane::Passive) + 2.0 * PAD;
        let title = 2.0 * PAD + title.chars().count() as f64 * TITLE_SIZE * RESERVED_WIDTH;
        let legend = if ladder.is_real() {
            2.0 * PAD + width(LEGEND)
        } else {
            0.0
        };
        let clock_note = ladder
            .clock_note()
            .map_or(0.0, |note| 2.0 * PAD + width(&note));
        // The legend of the origins takes one more band under a real ladder, the note on
        // the clocks one more across two hosts.
        let bands = ladder.rows.len()
            + usize::from(ladder.is_real())
            + usize::from(ladder.active_clock_uncertainty.is_some());
        Layout {
            axis: px(axis),
            active: px(active),
            passive: px(passive),
            width: px(right.max(title).max(legend).max(clock_note)),
            height: TOP + ROW_GAP * bands as f64 + PAD,
        }
    }

    fn lane(&self, lane: Lane) -> f64 {
        match lane {
            Lane::Active => self.active,
            Lane::Passive => self.passive,
        }
    }

    fn middle(&self) -> f64 {
        px((self.active + self.passive) / 2.0)
    }

    /// The y of row `row`: the middle of its band.
    fn row(&self, row: usize) -> f64 {
        TOP + ROW_GAP * (row as f64 + 0.5)
    }
}

/// A `<text>` whose content stays on its line: the crate's `Text` element wraps it in
/// newlines, which a parser reading the label back would keep.
struct Label(Element);

impl Label {
    fn set(mut self, name: &str, value: impl Into<Value>) -> Label {
        self.0.assign(name, value);
        self
    }
}

impl From<Label> for Box<dyn Node> {
    fn from(label: Label) -> Self {
        Box::new(label.0)
    }
}

fn text(content: &str, x: f64, y: f64, anchor: &str, size: f64, tone: Tone) -> Label {
    let mut element = Element::new("text");
    element.append(svg::node::Text::new(content));
    let mut element = Label(element)
        .set("x", px(x))
        .set("y", px(y))
        .set("font-size", size)
        .set("fill", colour(tone));
    if anchor != "start" {
        element = element.set("text-anchor", anchor);
    }
    if bold(tone) {
        element = element.set("font-weight", "bold");
    }
    element
}

fn line(x1: f64, y1: f64, x2: f64, y2: f64, stroke: &str) -> Line {
    Line::new()
        .set("x1", px(x1))
        .set("y1", px(y1))
        .set("x2", px(x2))
        .set("y2", px(y2))
        .set("stroke", stroke)
}

/// Under a ladder drawn from the real kernel: what each kind of mark comes from.
pub const LEGEND: &str =
    "● kernel (tracefs)   ○ library (endpoint timeline, dotted arrows)   ✕ nftables counter";

/// The SVG document of `ladder`. On a real ladder every arrow and mark carries
/// `data-origin` (see
/// [`Origin::name`]); on a real ladder the library's notes are hollow dots in italics and
/// its arrows dotted, the kernel's filled and solid, and a legend says so.
pub fn render(ladder: &Ladder) -> String {
    let times = axis_labels(ladder);
    let title = ladder.title();
    let layout = Layout::new(ladder, &times, &title);
    let bottom = TOP + ROW_GAP * ladder.rows.len() as f64;
    let mut document = Document::new()
        .set("width", layout.width)
        .set("height", layout.height)
        .set("viewBox", (0, 0, layout.width, layout.height))
        .set("font-family", FONT_FAMILY)
        // What screen readers and tooltips say of the picture.
        .add(Title::new(format!("Ladder diagram of {title}")))
        .add(
            Rectangle::new()
                .set("width", "100%")
                .set("height", "100%")
                .set("fill", "white"),
        )
        .add(text(&title, PAD, 22.0, "start", TITLE_SIZE, Tone::Plain).set("class", "title"));

    // Headings, lanes and the axis.
    let mut frame = Group::new().set("class", "frame");
    frame = frame.add(
        text(
            ladder.clock.heading(),
            layout.axis,
            48.0,
            "end",
            FONT_SIZE,
            Tone::Plain,
        )
        .set("class", "heading"),
    );
    frame = frame.add(line(layout.axis, TOP - 6.0, layout.axis, bottom, "#999999"));
    for lane in [Lane::Active, Lane::Passive] {
        let x = layout.lane(lane);
        frame = frame
            .add(
                text(
                    &ladder.heading(lane),
                    x,
                    48.0,
                    "middle",
                    FONT_SIZE,
                    Tone::Plain,
                )
                .set("class", "heading")
                .set("font-weight", "bold"),
            )
            .add(
                line(x, TOP - 6.0, x, bottom, "#555555")
                    .set("class", "lane")
                    .set("data-lane", lane.name())
                    .set("stroke-width", 2),
            );
    }
    document = document.add(frame);

    let mut axis = Group::new().set("class", "axis");
    for (row, shown) in times.iter().enumerate() {
        let y = layout.row(row);
        if clock_jumps(ladder, row) {
            // The clock jumps: a dashed line across says rows are not to scale here.
            let gap_y = y - ROW_GAP / 2.0;
            axis = axis.add(
                line(
                    layout.axis - 6.0,
                    gap_y,
                    layout.width - PAD,
                    gap_y,
                    "#bbbbbb",
                )
                .set("class", "gap")
                .set("stroke-dasharray", "2 4"),
            );
        }
        if let Some(label) = shown {
            axis = axis
                .add(line(layout.axis - 4.0, y, layout.axis, y, "#999999"))
                .add(
                    text(
                        label,
                        layout.axis - 6.0,
                        y + 4.0,
                        "end",
                        FONT_SIZE,
                        Tone::Plain,
                    )
                    .set("class", "time")
                    .set("fill", "#555555"),
                );
        }
    }
    document = document.add(axis);

    // Fixed marks first (the ✕ and its word), so that arrow labels are placed around them.
    let mut placed = Vec::new();
    let mut marks = Vec::new();
    for (row, entry) in ladder.rows.iter().enumerate() {
        let y = layout.row(row);
        match &entry.mark {
            Mark::Lose(arrow) => {
                let x = layout.middle();
                placed.push(TextBox {
                    left: x - 6.0,
                    top: y - 6.0,
                    right: x + 6.0,
                    bottom: y + 6.0,
                });
                // The word goes on the side the wire does not come from.
                let (word_x, anchor) = match ladder.arrows[*arrow].from {
                    Lane::Active => (x + 10.0, "start"),
                    Lane::Passive => (x - 10.0, "end"),
                };
                placed.push(TextBox::reserved(
                    "lost",
                    word_x,
                    y + 4.0,
                    anchor,
                    FONT_SIZE,
                ));
                marks.push(
                    origin(Group::new().set("class", "lost"), entry.origin)
                        .add(
                            line(x - 6.0, y - 6.0, x + 6.0, y + 6.0, colour(Tone::Lost))
                                .set("stroke-width", 3),
                        )
                        .add(
                            line(x - 6.0, y + 6.0, x + 6.0, y - 6.0, colour(Tone::Lost))
                                .set("stroke-width", 3),
                        )
                        .add(text("lost", word_x, y + 4.0, anchor, FONT_SIZE, Tone::Lost)),
                );
            }
            Mark::Note {
                lane,
                text: note,
                tone,
            } => {
                let x = layout.lane(*lane);
                let (label_x, anchor) = match lane {
                    Lane::Active => (x - 2.0 * PAD, "end"),
                    Lane::Passive => (x + 2.0 * PAD, "start"),
                };
                let library = entry.origin == Origin::Library;
                let mut dot = Circle::new()
                    .set("cx", x)
                    .set("cy", px(y))
                    .set("r", 4)
                    .set("fill", if library { "white" } else { colour(*tone) });
                let mut label = text(note, label_x, y + 4.0, anchor, FONT_SIZE, *tone);
                if library {
                    dot = dot.set("stroke", colour(*tone)).set("stroke-width", 1.5);
                    label = label.set("font-style", "italic");
                }
                marks.push(
                    origin(
                        Group::new()
                            .set("class", "note")
                            .set("data-lane", lane.name()),
                        entry.origin,
                    )
                    .add(dot)
                    .add(label),
                );
            }
            Mark::Send(_) | Mark::Arrive(_) => {}
        }
    }
    let shafts: Vec<Shaft> = ladder
        .arrows
        .iter()
        .map(|arrow| Shaft::of(arrow, &layout))
        .collect();
    let mut arrows = Group::new().set("class", "arrows");
    for (arrow, shaft) in ladder.arrows.iter().zip(&shafts) {
        arrows = arrows.add(draw_arrow(arrow, shaft, &shafts, &layout, &mut placed));
    }
    document = document.add(arrows);
    if ladder.active_clock_uncertainty.is_some() {
        document = document.add(uncertainty_bars(ladder, &layout));
    }
    for mark in marks {
        document = document.add(mark);
    }
    if ladder.is_real() {
        document = document.add(
            text(
                LEGEND,
                PAD,
                bottom + ROW_GAP / 2.0 + 4.0,
                "start",
                FONT_SIZE,
                Tone::Plain,
            )
            .set("class", "legend")
            .set("fill", "#555555"),
        );
    }
    if let Some(note) = ladder.clock_note() {
        document = document.add(
            text(
                &note,
                PAD,
                bottom + ROW_GAP * 1.5 + 4.0,
                "start",
                FONT_SIZE,
                Tone::Plain,
            )
            .set("class", "clock-note")
            .set("fill", "#555555"),
        );
    }
    let mut out = document.to_string();
    out.push('\n');
    out
}

/// Across two hosts, a grey bar left of each active-lane mark over the rows it may lie
/// among ([`Ladder::uncertain_rows`]); bars of neighbouring marks are set a little apart.
fn uncertainty_bars(ladder: &Ladder, layout: &Layout) -> Group {
    let mut bars = Group::new().set("class", "uncertainty");
    let spans = (0..ladder.rows.len()).filter_map(|row| Some((row, ladder.uncertain_rows(row)?)));
    for (nth, (row, (low, high))) in spans.enumerate() {
        let x = layout.active - 8.0 - 3.0 * (nth % 3) as f64;
        let (top, bottom) = (layout.row(low) - 4.0, layout.row(high) + 4.0);
        bars = bars.add(
            line(x, top, x, bottom, "#bbbbbb")
                .set("stroke-width", 2)
                .set("data-row", row),
        );
    }
    bars
}

/// `group` with its `data-origin`, unless it comes from the simulation (whose pictures
/// have one origin only).
fn origin(group: Group, origin: Origin) -> Group {
    match origin {
        Origin::Simulation => group,
        other => group.set("data-origin", other.name()),
    }
}

/// Where an arrow's line runs, and how it ends ("arrived", "lost", "in-flight").
#[derive(Debug, Clone, Copy, PartialEq)]
struct Shaft {
    x1: f64,
    y1: f64,
    x2: f64,
    y2: f64,
    end: &'static str,
}

impl Shaft {
    fn of(arrow: &Arrow, layout: &Layout) -> Shaft {
        let (x1, y1) = (layout.lane(arrow.from), layout.row(arrow.sent));
        let to = match arrow.from {
            Lane::Active => layout.passive,
            Lane::Passive => layout.active,
        };
        let (x2, y2, end) = match arrow.end {
            End::Arrived(row) => (to, layout.row(row), "arrived"),
            End::Lost(row) => (layout.middle(), layout.row(row), "lost"),
            End::InFlight => (layout.middle(), y1 + ROW_GAP / 2.0, "in-flight"),
        };
        Shaft {
            x1,
            y1,
            x2,
            y2,
            end,
        }
    }

    /// The point a fraction `t` of the way.
    fn at(&self, t: f64) -> (f64, f64) {
        (
            self.x1 + (self.x2 - self.x1) * t,
            self.y1 + (self.y2 - self.y1) * t,
        )
    }

    /// Whether the line crosses `area` (sampled every pixel or so: labels are far bigger).
    fn crosses(&self, area: &TextBox) -> bool {
        let steps = (self.x2 - self.x1)
            .abs()
            .max((self.y2 - self.y1).abs())
            .ceil() as usize;
        (0..=steps).any(|i| {
            let (x, y) = self.at(i as f64 / steps.max(1) as f64);
            area.left <= x && x <= area.right && area.top <= y && y <= area.bottom
        })
    }
}

/// An arrow: its line, its head when it arrives, and its label where no other label and
/// no line is.
fn draw_arrow(
    arrow: &Arrow,
    shaft: &Shaft,
    shafts: &[Shaft],
    layout: &Layout,
    placed: &mut Vec<TextBox>,
) -> Group {
    let Shaft {
        x1,
        y1,
        x2,
        y2,
        end,
    } = *shaft;
    let stroke = colour(arrow.tone);
    let mut line = line(x1, y1, x2, y2, stroke).set("stroke-width", 1.5);
    if end != "arrived" {
        line = line.set("stroke-dasharray", "6 3");
    } else if arrow.origin == Origin::Library {
        line = line.set("stroke-dasharray", "2 3");
    }
    let group = Group::new()
        .set("class", "arrow")
        .set("data-kind", super::message_name(arrow.kind))
        .set("data-from", arrow.from.name())
        .set("data-end", end);
    let mut group = origin(group, arrow.origin).add(line);
    if end == "arrived" {
        // The head: a triangle along the shaft, its tip on the lane.
        let (dx, dy) = (x2 - x1, y2 - y1);
        let length = (dx * dx + dy * dy).sqrt();
        let (ux, uy) = (dx / length, dy / length);
        let (bx, by) = (x2 - 9.0 * ux, y2 - 9.0 * uy);
        let points = format!(
            "{},{} {},{} {},{}",
            px(x2),
            px(y2),
            px(bx - 4.0 * uy),
            px(by + 4.0 * ux),
            px(bx + 4.0 * uy),
            px(by - 4.0 * ux)
        );
        group = group.add(Polygon::new().set("points", points).set("fill", stroke));
    }
    let (x, y, anchor) = place_label(&arrow.label, shaft, shafts, layout, placed);
    placed.push(TextBox::reserved(&arrow.label, x, y, anchor, FONT_SIZE));
    group.add(
        text(&arrow.label, x, y, anchor, FONT_SIZE, arrow.tone)
            .set("class", "label")
            .set("stroke", "white")
            .set("stroke-width", 3)
            .set("paint-order", "stroke"),
    )
}

/// Where an arrow's label goes: (x, baseline, anchor). Every line slopes down, so a
/// label set above the line and away from its start ("start" anchor on a rightward
/// arrow), or below it and towards its start, never touches its own line. Tried first
/// centred over the wire, then further along either way; the first spot free of other
/// labels and lines wins.
fn place_label(
    label: &str,
    shaft: &Shaft,
    shafts: &[Shaft],
    layout: &Layout,
    placed: &[TextBox],
) -> (f64, f64, &'static str) {
    let rightwards = shaft.x2 > shaft.x1;
    let label_width = width(label);
    let (low, high) = (layout.active + PAD, layout.passive - PAD);
    let span = shaft.x2 - shaft.x1;
    let spot = |t: f64, above: bool| {
        let (x, y) = shaft.at(t);
        match (rightwards == above, above) {
            (true, true) => (x + 2.0, y - 4.0, "start"),
            (true, false) => (x + 2.0, y + FONT_SIZE + 2.0, "start"),
            (false, true) => (x - 2.0, y - 4.0, "end"),
            (false, false) => (x - 2.0, y + FONT_SIZE + 2.0, "end"),
        }
    };
    // Where the label's near edge sits for it to be centred over the wire.
    let centred = if span == 0.0 {
        0.5
    } else {
        (((layout.middle() - shaft.x1) - label_width / 2.0 * span.signum()) / span).clamp(0.0, 1.0)
    };
    let fits = |&(x, y, anchor): &(f64, f64, &'static str)| {
        let area = TextBox::reserved(label, x, y, anchor, FONT_SIZE);
        area.left >= low
            && area.right <= high
            && !placed.iter().any(|b| b.overlaps(&area))
            && !shafts.iter().any(|s| s.crosses(&area))
    };
    let offsets = [0.0, -0.1, 0.1, -0.2, 0.2, -0.3, 0.3, -0.4, 0.4];
    [true, false]
        .iter()
        .flat_map(|&above| {
            offsets
                .iter()
                .map(move |&d| spot((centred + d).clamp(0.0, 1.0), above))
        })
        .find(fits)
        .unwrap_or_else(|| spot(centred, true))
}
