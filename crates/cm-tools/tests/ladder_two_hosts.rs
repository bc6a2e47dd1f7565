//! Ladders of one connection between two hosts, each side captured on its own clock:
//! the VM's single-host captures cut into their two hosts with a known clock offset
//! (`two_hosts::split_one_host`), and the captures `cargo xtask vm --two-hosts` made on
//! two VMs on two kernels (`tests/fixtures/vm-ladder-two-hosts-<server kernel>-<client kernel>-*.txt`, saved as
//! `target/vm/ladder-two-hosts-server-<kernel>-{passive,active}.capture.txt`). Each is
//! aligned, drawn, parsed back as XML and rendered to pixels.

mod common;

use cm_tools::ladder::kernel::Capture;
use cm_tools::ladder::two_hosts::{split_one_host, Alignment};
use cm_tools::ladder::{svg, text, Ladder, Lane};

/// The single-host captures, cut in two here.
const ONE_HOST: [&str; 2] = [
    include_str!("fixtures/vm-ladder-6.1.txt"),
    include_str!("fixtures/vm-ladder-6.12.txt"),
];

/// (passive host's capture, active host's capture) made on two VMs: a 6.12 server with a
/// 6.1 client, and the reverse.
const TWO_HOSTS: [(&str, &str); 2] = [
    (
        include_str!("fixtures/vm-ladder-two-hosts-6.12-6.1-passive.txt"),
        include_str!("fixtures/vm-ladder-two-hosts-6.12-6.1-active.txt"),
    ),
    (
        include_str!("fixtures/vm-ladder-two-hosts-6.1-6.12-passive.txt"),
        include_str!("fixtures/vm-ladder-two-hosts-6.1-6.12-active.txt"),
    ),
];

/// Every pair of captures: cut from one host with offsets either way, and made on two.
fn pairs() -> Vec<(String, Capture, Capture)> {
    let mut pairs = Vec::new();
    for text in ONE_HOST {
        let one = Capture::parse(text).expect("a capture");
        for shift in [-4_000_000_000i128, 2_500_000_000] {
            let (passive, active) = split_one_host(&one, shift);
            pairs.push((
                format!("{} cut, shift {shift}", one.kernel),
                passive,
                active,
            ));
        }
    }
    for (passive, active) in TWO_HOSTS {
        let passive = Capture::parse(passive).expect("the passive host's capture");
        let active = Capture::parse(active).expect("the active host's capture");
        let name = format!("{} serving {}", passive.kernel, active.kernel);
        pairs.push((name, passive, active));
    }
    pairs
}

#[test]
fn every_pair_draws_a_rescue_with_its_clock_uncertainty() {
    for (name, passive, active) in pairs() {
        let alignment = Alignment::from_captures(&passive, &active).expect(&name);
        let ladder = Ladder::from_two_hosts(&passive, &active).expect(&name);
        assert_eq!(
            ladder.summary(),
            "RTU lost, rescued by rdma_notify",
            "{name}"
        );
        assert_eq!(
            ladder.active_clock_uncertainty,
            Some(alignment.uncertainty),
            "{name}"
        );
        let title = ladder.title();
        assert!(title.contains("two hosts"), "{name}: {title}");
        assert!(title.contains(&alignment.offset_text()), "{name}: {title}");
        // Causality on the drawing: every arrow arrives at or after the row it left.
        for arrow in &ladder.arrows {
            if let cm_tools::ladder::End::Arrived(row) = arrow.end {
                assert!(
                    row > arrow.sent,
                    "{name}: {} arrives before it leaves",
                    arrow.label
                );
            }
        }
        let drawn = text::render(&ladder);
        assert!(
            drawn.contains("aligned to the passive host's within"),
            "{name}"
        );
    }
}

#[test]
fn each_active_mark_has_a_bar_over_the_rows_it_may_lie_among() {
    for (name, passive, active) in pairs() {
        let ladder = Ladder::from_two_hosts(&passive, &active).expect(&name);
        let drawn = svg::render(&ladder);
        let document = roxmltree::Document::parse(&drawn).expect("well-formed SVG");
        let bars: Vec<usize> = document
            .descendants()
            .filter(|n| n.attribute("class") == Some("uncertainty"))
            .flat_map(|group| group.children().filter(|c| c.is_element()))
            .map(|bar| {
                bar.attribute("data-row")
                    .expect("a row")
                    .parse()
                    .expect("a number")
            })
            .collect();
        let active_rows: Vec<usize> = (0..ladder.rows.len())
            .filter(|&row| ladder.row_lane(&ladder.rows[row]) == Some(Lane::Active))
            .collect();
        assert_eq!(bars, active_rows, "{name}");
        for row in active_rows {
            let (low, high) = ladder.uncertain_rows(row).expect("an active row");
            assert!(
                low <= row && row <= high,
                "{name}: row {row} in {low}..={high}"
            );
        }
        assert!(
            document
                .descendants()
                .any(|n| n.attribute("class") == Some("clock-note")),
            "{name}"
        );
    }
}

#[test]
fn two_host_ladders_render_to_pixels() {
    for (index, (name, passive, active)) in pairs().into_iter().enumerate() {
        let ladder = Ladder::from_two_hosts(&passive, &active).expect(&name);
        let inked = common::render_png(
            &svg::render(&ladder),
            &format!("ladder-two-hosts-{index}.png"),
        );
        assert!(inked > 1000, "{name}: {inked} dark pixels");
    }
}
