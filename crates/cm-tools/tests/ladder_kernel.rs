//! Ladders of the real kernel, drawn from captures the soft-RoCE VM made
//! (`tests/fixtures/vm-ladder-*.txt`: printed by `ci/vm/ladder-capture`, saved by
//! `cargo xtask vm` as `target/vm/ladder-<kernel>[-comm-est].capture.txt`) for both
//! kernels and both devices. Each is read, turned into a ladder and drawn; the SVG is
//! parsed with a real XML parser and checked against the capture: its lanes, the order
//! of its arrows, which marks come from the kernel, the library and nftables.
//!
//! To refresh a fixture, copy the capture of a `cargo xtask vm` run over it.

mod common;

use std::time::Duration;

use cm_mock::sim::MsgKind;
use cm_tools::ladder::kernel::Capture;
use cm_tools::ladder::{svg, text, End, Ladder, Lane, Mark, Origin};

/// (fixture, kernel series, device).
const FIXTURES: [(&str, &str, &str); 4] = [
    (include_str!("fixtures/vm-ladder-6.1.txt"), "6.1.", "stock"),
    (
        include_str!("fixtures/vm-ladder-6.1-comm-est.txt"),
        "6.1.",
        "comm-est",
    ),
    (
        include_str!("fixtures/vm-ladder-6.12.txt"),
        "6.12.",
        "stock",
    ),
    (
        include_str!("fixtures/vm-ladder-6.12-comm-est.txt"),
        "6.12.",
        "comm-est",
    ),
];

fn ladders() -> Vec<(Capture, Ladder)> {
    FIXTURES
        .iter()
        .map(|(text, series, device)| {
            let capture = Capture::parse(text).expect("a capture");
            assert!(capture.kernel.starts_with(series), "{}", capture.kernel);
            assert_eq!(capture.device, *device);
            let ladder = Ladder::from_capture(&capture).expect("a ladder");
            (capture, ladder)
        })
        .collect()
}

/// The passive lane's notes, in order, with their origin.
fn notes(ladder: &Ladder, lane: Lane) -> Vec<(Origin, String)> {
    ladder
        .rows
        .iter()
        .filter_map(|row| match &row.mark {
            Mark::Note { lane: l, text, .. } if *l == lane => Some((row.origin, text.clone())),
            _ => None,
        })
        .collect()
}

fn position(notes: &[(Origin, String)], origin: Origin, text: &str) -> usize {
    notes
        .iter()
        .position(|(o, t)| *o == origin && t == text)
        .unwrap_or_else(|| panic!("no {origin:?} note `{text}` in {notes:?}"))
}

#[test]
fn every_capture_draws_a_lost_rtu_rescued_by_notify() {
    for (capture, ladder) in ladders() {
        let what = format!("{} {}", capture.kernel, capture.device);
        assert_eq!(
            ladder.summary(),
            "RTU lost, rescued by rdma_notify",
            "{what}"
        );
        assert!(capture.nft_drops > 0, "{what}");
        // The handshake's and the teardown's messages leave in this order, all but the
        // library's SEND seen by the kernel.
        let mut sent: Vec<_> = ladder.arrows.iter().collect();
        sent.sort_by_key(|a| a.sent);
        let kinds: Vec<(MsgKind, Origin)> = sent.iter().map(|a| (a.kind, a.origin)).collect();
        assert_eq!(
            kinds,
            [
                (MsgKind::Req, Origin::Kernel),
                (MsgKind::Rep, Origin::Kernel),
                (MsgKind::Rtu, Origin::Kernel),
                (MsgKind::Data, Origin::Library),
                (MsgKind::Dreq, Origin::Kernel),
                (MsgKind::Drep, Origin::Kernel),
            ],
            "{what}"
        );
        for arrow in &ladder.arrows {
            match arrow.kind {
                // The RTU ends in the ✕ the nftables counter stands for.
                MsgKind::Rtu => {
                    let End::Lost(row) = arrow.end else {
                        panic!("{what}: the RTU is not lost: {arrow:?}")
                    };
                    assert_eq!(ladder.rows[row].origin, Origin::Nftables, "{what}");
                }
                _ => assert!(
                    matches!(arrow.end, End::Arrived(row) if row > arrow.sent),
                    "{what}: {arrow:?}"
                ),
            }
        }
        // The rows run in time, on the real clock from the first one.
        assert_eq!(ladder.rows[0].at, Duration::ZERO, "{what}");
        assert!(ladder.rows.windows(2).all(|w| w[0].at <= w[1].at), "{what}");
    }
}

#[test]
fn the_passive_lane_shows_the_trigger_notify_and_established_in_order() {
    for (capture, ladder) in ladders() {
        let what = format!("{} {}", capture.kernel, capture.device);
        let passive = notes(&ladder, Lane::Passive);
        let request = position(&passive, Origin::Kernel, "CONNECT_REQUEST");
        let accept = position(&passive, Origin::Library, "rdma_accept");
        let notify = position(&passive, Origin::Kernel, "rdma_notify(COMM_EST) = 0");
        let established = position(&passive, Origin::Kernel, "ESTABLISHED");
        let reported = position(&passive, Origin::Library, "ESTABLISHED reported");
        assert!(
            request < accept && accept < notify && notify < established && established < reported,
            "{what}: {passive:?}"
        );
        // The trigger the endpoint names comes just before the notify it caused.
        let trigger = passive
            .iter()
            .position(|(o, t)| *o == Origin::Library && t.ends_with("(endpoint)"))
            .unwrap_or_else(|| panic!("{what}: no trigger in {passive:?}"));
        assert!(trigger < notify, "{what}: {passive:?}");
        if capture.device == "comm-est" {
            // The device raised COMM_EST: the kernel's QP event handler saw it.
            let comm_est = position(&passive, Origin::Kernel, "COMM_EST");
            assert!(comm_est < established, "{what}: {passive:?}");
        } else {
            assert_eq!(
                passive[trigger].1, "receive completion (endpoint)",
                "{what}"
            );
            assert!(
                !passive.iter().any(|(_, t)| t == "COMM_EST"),
                "{what}: the stock rxe raises no COMM_EST"
            );
        }
        // librdmacm makes the active side's ESTABLISHED from the REP itself: only the
        // library shows it, after the kernel's CONNECT_RESPONSE.
        let active = notes(&ladder, Lane::Active);
        let response = position(&active, Origin::Kernel, "CONNECT_RESPONSE");
        let established = position(&active, Origin::Library, "ESTABLISHED");
        assert!(response < established, "{what}: {active:?}");
    }
}

#[test]
fn the_svg_has_both_lanes_and_the_arrows_in_the_captures_order() {
    for (capture, ladder) in ladders() {
        let what = format!("{} {}", capture.kernel, capture.device);
        let drawn = svg::render(&ladder);
        let document = roxmltree::Document::parse(&drawn).expect("well-formed XML");
        let root = document.root_element();
        let headings: Vec<&str> = root
            .descendants()
            .filter(|n| n.attribute("class") == Some("heading"))
            .filter_map(|n| n.text())
            .collect();
        assert_eq!(
            headings,
            [
                "real time",
                &format!("active ({})", ladder.hosts.as_ref().unwrap()[0]),
                &format!("passive ({})", capture.passive),
            ],
            "{what}"
        );
        let lanes: Vec<&str> = root
            .descendants()
            .filter(|n| n.attribute("class") == Some("lane"))
            .filter_map(|n| n.attribute("data-lane"))
            .collect();
        assert_eq!(lanes, ["active", "passive"], "{what}");
        // Arrows in document order, each with where it starts: the REQ first, the
        // lost RTU dashed to the middle, the library's SEND dotted.
        let arrows: Vec<(String, String, String, f64)> = root
            .descendants()
            .filter(|n| n.attribute("class") == Some("arrow"))
            .map(|group| {
                let line = group
                    .children()
                    .find(|c| c.has_tag_name("line"))
                    .expect("a shaft");
                (
                    group.attribute("data-kind").unwrap().to_owned(),
                    group.attribute("data-origin").unwrap().to_owned(),
                    group.attribute("data-end").unwrap().to_owned(),
                    line.attribute("y1").unwrap().parse().unwrap(),
                )
            })
            .collect();
        let mut by_start = arrows.clone();
        by_start.sort_by(|a, b| a.3.total_cmp(&b.3));
        let order: Vec<(&str, &str, &str)> = by_start
            .iter()
            .map(|(k, o, e, _)| (k.as_str(), o.as_str(), e.as_str()))
            .collect();
        assert_eq!(
            order,
            [
                ("REQ", "kernel", "arrived"),
                ("REP", "kernel", "arrived"),
                ("RTU", "kernel", "lost"),
                ("SEND", "library", "arrived"),
                ("DREQ", "kernel", "arrived"),
                ("DREP", "kernel", "arrived"),
            ],
            "{what}"
        );
        let lost: Vec<_> = root
            .descendants()
            .filter(|n| n.attribute("class") == Some("lost"))
            .map(|n| n.attribute("data-origin"))
            .collect();
        assert_eq!(lost, [Some("nftables")], "{what}");
        let legend = root
            .descendants()
            .find(|n| n.attribute("class") == Some("legend"))
            .and_then(|n| n.text());
        assert_eq!(legend, Some(svg::LEGEND), "{what}");
        let title = root
            .descendants()
            .find(|n| n.attribute("class") == Some("title"))
            .and_then(|n| n.text())
            .unwrap_or_default();
        assert!(
            title.contains(&capture.kernel) && title.ends_with("RTU lost, rescued by rdma_notify"),
            "{what}: {title}"
        );
    }
}

#[test]
fn the_text_rendering_marks_the_librarys_notes_apart() {
    let (_, ladder) = ladders().swap_remove(0);
    let rendered = text::render(&ladder);
    assert!(rendered.ends_with(&format!("\n{}\n", text::TEXT_LEGEND)));
    let line = |needle: &str| {
        rendered
            .lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no `{needle}` in\n{rendered}"))
    };
    assert!(line("rdma_notify(COMM_EST) = 0").contains("*  rdma_notify"));
    assert!(line("ESTABLISHED reported").contains("o  ESTABLISHED reported"));
    assert!(line("✕").contains("RTU (nft dropped"));
}

#[test]
fn a_capture_without_its_connection_is_refused() {
    let (text, _, _) = FIXTURES[0];
    let without_req: String = text
        .lines()
        .filter(|l| !l.contains("cm_send_req:"))
        .map(|l| format!("{l}\n"))
        .collect();
    let capture = Capture::parse(&without_req).expect("still a capture");
    let refusal = Ladder::from_capture(&capture).expect_err("nothing to draw");
    assert!(refusal.contains("cm_send_req"), "{refusal}");
    assert!(Capture::parse("kernel x\n").is_err(), "no addresses");
}

#[test]
fn every_real_ladder_renders_to_pixels() {
    for (capture, ladder) in ladders() {
        let name = format!("vm-ladder-{}-{}.png", capture.kernel, capture.device);
        let inked = common::render_png(&svg::render(&ladder), &name);
        assert!(inked > 1000, "{}: {inked} dark pixels", capture.kernel);
    }
}

#[test]
fn an_earlier_refused_attempt_is_not_drawn() {
    let (text, _, _) = FIXTURES[0];
    let earlier = "\
        cmnotify-9 [000] .....     1.000000: cm_send_req: cm.id=0 src=10.77.1.2:40000 dst=10.77.1.1:7471 tos=0 qp_num=17
        cmnotify-9 [000] d..1.     1.000100: icm_send_req: local_id=1 remote_id=0 state=IDLE lap_state=LAP_UNINIT
     kworker/1:1-29 [001] .....    1.040000: cm_event_handler: cm.id=0 src=10.77.1.2:40000 dst=10.77.1.1:7471 tos=0 REJECTED (8/8)
";
    let with_attempt = text.replacen("--- trace\n", &format!("--- trace\n{earlier}"), 1);
    assert_ne!(with_attempt, text);
    let drawn = |text: &str| Ladder::from_capture(&Capture::parse(text).unwrap()).unwrap();
    assert_eq!(drawn(&with_attempt), drawn(text));
}
