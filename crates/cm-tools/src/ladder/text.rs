//! The ladder for a terminal: the same rows as the SVG, one line each. A message shows
//! twice, leaving its lane (first half of the wire) and arriving (second half); a lost
//! one ends in a ✕ in the middle.

use super::{axis_labels, clock_jumps, Arrow, End, Ladder, Lane, Mark, Origin};

/// Under a ladder drawn from the real kernel: what the lane marks come from.
pub const TEXT_LEGEND: &str =
    "* kernel (tracefs)   o library (endpoint timeline)   ✕ nftables counter";

/// `text` padded with spaces to `width` characters, on the left when `right_aligned`.
fn pad(text: &str, width: usize, right_aligned: bool) -> String {
    let fill = " ".repeat(width.saturating_sub(text.chars().count()));
    if right_aligned {
        format!("{fill}{text}")
    } else {
        format!("{text}{fill}")
    }
}

/// Half a wire, `half` characters: "-- REQ ------->" or "<------ REP --".
fn half_arrow(label: &str, rightwards: bool, half: usize) -> String {
    let body = format!(" {label} ");
    let fill = "-".repeat(half.saturating_sub(body.chars().count() + 3));
    if rightwards {
        format!("--{body}{fill}>")
    } else {
        format!("<{fill}{body}--")
    }
}

/// The text rendering of `ladder`, lines ending in `\n`, no trailing spaces.
pub fn render(ladder: &Ladder) -> String {
    let times = axis_labels(ladder);
    let time_width = times
        .iter()
        .flatten()
        .map(|t| t.chars().count())
        .chain([ladder.clock.heading().len()])
        .max()
        .unwrap_or(0);
    let active_heading = ladder.heading(Lane::Active);
    let active_width = ladder
        .rows
        .iter()
        .filter_map(|row| match &row.mark {
            Mark::Note {
                lane: Lane::Active,
                text,
                ..
            } => Some(text.chars().count()),
            _ => None,
        })
        .chain([active_heading.chars().count()])
        .max()
        .unwrap_or(0);
    let half = ladder
        .arrows
        .iter()
        .map(|a| a.label.chars().count() + 8)
        .chain([16])
        .max()
        .unwrap_or(16);
    let blank = " ".repeat(half);

    let mut out = format!(
        "{}\n\n{}  {} |{}|  {}\n",
        ladder.title(),
        pad(ladder.clock.heading(), time_width, true),
        pad(&active_heading, active_width, true),
        " ".repeat(2 * half + 1),
        ladder.heading(Lane::Passive),
    );
    for (index, (row, time)) in ladder.rows.iter().zip(&times).enumerate() {
        if clock_jumps(ladder, index) {
            // Not to scale: the clock skips ahead here.
            let skip = format!("{}  {} ~", " ".repeat(time_width), " ".repeat(active_width));
            out.push_str(&format!("{skip}{}~\n", " ".repeat(2 * half + 1)));
        }
        let (mut left, mut middle, mut right) = (blank.clone(), " ".to_owned(), blank.clone());
        let (mut lanes, mut notes) = (['|', '|'], [String::new(), String::new()]);
        let arrow = |n: usize| -> &Arrow { &ladder.arrows[n] };
        match &row.mark {
            Mark::Send(n) => match arrow(*n).from {
                Lane::Active => left = half_arrow(&arrow(*n).label, true, half),
                Lane::Passive => right = half_arrow(&arrow(*n).label, false, half),
            },
            Mark::Arrive(n) => match arrow(*n).from {
                Lane::Active => right = half_arrow(&arrow(*n).label, true, half),
                Lane::Passive => left = half_arrow(&arrow(*n).label, false, half),
            },
            Mark::Lose(n) => {
                middle = "✕".into();
                let lost = format!("{} lost", arrow(*n).label);
                match arrow(*n).from {
                    Lane::Active => right = pad(&format!(" {lost}"), half, false),
                    Lane::Passive => left = pad(&format!("{lost} "), half, true),
                }
            }
            Mark::Note { lane, text, .. } => {
                let side = usize::from(*lane == Lane::Passive);
                // A real ladder tells the library's notes from the kernel's.
                lanes[side] = if row.origin == Origin::Library {
                    'o'
                } else {
                    '*'
                };
                notes[side] = text.clone();
            }
        }
        let line = format!(
            "{}  {} {}{left}{middle}{right}{}  {}",
            pad(time.as_deref().unwrap_or(""), time_width, true),
            pad(&notes[0], active_width, true),
            lanes[0],
            lanes[1],
            notes[1],
        );
        out.push_str(line.trim_end());
        out.push('\n');
    }
    // An arrow still in flight when the trace ends is said, not silently dropped.
    for arrow in ladder.arrows.iter().filter(|a| a.end == End::InFlight) {
        out.push_str(&format!("({} still in flight)\n", arrow.label));
    }
    if ladder.is_real() {
        out.push_str(&format!("\n{TEXT_LEGEND}\n"));
    }
    if let Some(note) = ladder.clock_note() {
        out.push_str(&format!("{note}\n"));
    }
    out
}
