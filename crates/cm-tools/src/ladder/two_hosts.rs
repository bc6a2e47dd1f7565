//! The ladder of one connection between two hosts: each host captured its own side
//! (its tracefs events and its endpoint's timeline, on its own CLOCK_MONOTONIC), and
//! the two clocks are aligned by the handshake itself, as NTP aligns a client with its
//! server.
//!
//! Four stamps, two on each clock: the active host sends the REQ at `t1` and reads the
//! REP at `t4` (its `CONNECT_RESPONSE`); the passive host reads the REQ at `t2` and sends
//! the REP at `t3`. No message arrives before it is sent, so the offset θ that turns an
//! active-host time into a passive-host time obeys `t1 + θ <= t2` and `t3 <= t4 + θ`:
//! θ lies in `[t3 - t4, t2 - t1]`, whatever the two one-way delays were. The ladder puts
//! the active lane at the middle of that interval and draws half its width as the
//! uncertainty of every active mark. The earliest REQ and REP sent are taken, so a
//! resent one only widens the interval; the clocks' drift over the seconds of one
//! connection is far below it.
//!
//! ```
//! use cm_tools::ladder::kernel::Capture;
//! use cm_tools::ladder::two_hosts::split_one_host;
//! use cm_tools::ladder::Ladder;
//! use std::time::Duration;
//!
//! // One VM's capture cut into its two hosts, the active one's clock 5 s behind.
//! let one = Capture::parse(include_str!("../../tests/fixtures/vm-ladder-6.1.txt")).unwrap();
//! let (passive, active) = split_one_host(&one, -5_000_000_000);
//! let ladder = Ladder::from_two_hosts(&passive, &active).unwrap();
//! assert_eq!(ladder.summary(), "RTU lost, rescued by rdma_notify");
//! assert!(ladder.active_clock_uncertainty.unwrap() < Duration::from_millis(50));
//! ```

use std::time::Duration;

use super::kernel::{Capture, TraceLine};
use super::{clock, Ladder, Lane};

/// Prefix of a merged trace line's task: the line came from the passive host.
pub const PASSIVE_HOST: &str = "passive-host:";
/// Prefix of a merged trace line's task: the line came from the active host.
pub const ACTIVE_HOST: &str = "active-host:";

/// The lane of a merged trace line's host, from its task's prefix; `None` on a capture of
/// one host.
pub fn host_lane(task: &str) -> Option<Lane> {
    if task.starts_with(PASSIVE_HOST) {
        Some(Lane::Passive)
    } else if task.starts_with(ACTIVE_HOST) {
        Some(Lane::Active)
    } else {
        None
    }
}

/// How the active host's clock reads on the passive host's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alignment {
    /// Nanoseconds added to an active-host time to read it on the passive host's clock:
    /// the middle of the interval the offset is known to lie in.
    pub offset_ns: i128,
    /// Half the interval's width: the true offset is within `offset_ns` ± this.
    pub uncertainty: Duration,
}

fn nanos(at: Duration) -> i128 {
    at.as_nanos() as i128
}

impl Alignment {
    /// The alignment from the REQ's and the REP's stamps on both hosts (see the module
    /// documentation).
    pub fn from_captures(passive: &Capture, active: &Capture) -> Result<Alignment, String> {
        let from_active = |l: &&TraceLine| {
            l.field("dst") == Some(passive.passive.as_str())
                && l.field("src")
                    .is_some_and(|s| s.starts_with(&format!("{}:", active.active)))
        };
        // The active side's last connection attempt, as the single-host ladder draws it.
        let req = active
            .trace
            .iter()
            .rfind(|l| l.event == "cm_send_req" && from_active(l))
            .ok_or("the active host's trace has no cm_send_req to the passive side")?;
        let sent_req = active
            .trace
            .iter()
            .find(|l| l.event == "icm_send_req" && l.at >= req.at)
            .ok_or("the active host's trace has no icm_send_req")?;
        let local_id = sent_req.field("local_id").unwrap_or_default();
        let rep_read = active
            .trace
            .iter()
            .find(|l| {
                l.event == "cm_event_handler"
                    && l.at >= req.at
                    && l.field("src") == req.field("src")
                    && l.cm_event() == Some("CONNECT_RESPONSE")
            })
            .ok_or("the active host's trace has no CONNECT_RESPONSE: the REP never came")?;
        let req_read = passive
            .trace
            .iter()
            .find(|l| {
                l.event == "cm_req_handler"
                    && l.field("src") == Some(passive.passive.as_str())
                    && l.cm_event() == Some("REQ_RECEIVED")
            })
            .ok_or("the passive host's trace has no REQ_RECEIVED")?;
        let sent_rep = passive
            .trace
            .iter()
            .find(|l| l.event == "icm_send_rep" && l.field("remote_id") == Some(local_id))
            .ok_or("the passive host's trace has no icm_send_rep answering the REQ")?;
        let (t1, t4) = (nanos(sent_req.at), nanos(rep_read.at));
        let (t2, t3) = (nanos(req_read.at), nanos(sent_rep.at));
        let (lowest, highest) = (t3 - t4, t2 - t1);
        if lowest > highest {
            return Err(format!(
                "the REQ and REP stamps contradict each other (offset at least {lowest} ns and \
                 at most {highest} ns): not the same connection on both hosts?"
            ));
        }
        Ok(Alignment {
            offset_ns: lowest + (highest - lowest) / 2,
            uncertainty: Duration::from_nanos(((highest - lowest) / 2) as u64),
        })
    }

    /// The offset as the ladder's title says it: "+1.234567 s" or "-12.000 ms".
    pub fn offset_text(&self) -> String {
        let sign = if self.offset_ns < 0 { '-' } else { '+' };
        let magnitude = Duration::from_nanos(self.offset_ns.unsigned_abs() as u64);
        format!("{sign}{}", clock(magnitude))
    }
}

/// One capture of both sides on the passive host's clock: the active host's trace lines
/// and its client timeline moved by the alignment, every task named after its host
/// ([`PASSIVE_HOST`], [`ACTIVE_HOST`]), the passive host's server timeline and drop
/// counter. Also the alignment.
pub fn merge(passive: &Capture, active: &Capture) -> Result<(Capture, Alignment), String> {
    let alignment = Alignment::from_captures(passive, active)?;
    // Times stay positive: both clocks move up by as much as the active one would go
    // below zero (the ladder's axis starts at its first row anyway).
    let lift = (-alignment.offset_ns).max(0);
    let on_passive = |at: Duration| Duration::from_nanos((nanos(at) + lift) as u64);
    let on_active =
        |at: Duration| Duration::from_nanos((nanos(at) + alignment.offset_ns + lift).max(0) as u64);
    let mut trace: Vec<TraceLine> = passive
        .trace
        .iter()
        .map(|l| TraceLine {
            at: on_passive(l.at),
            task: format!("{PASSIVE_HOST}{}", l.task),
            ..l.clone()
        })
        .chain(active.trace.iter().map(|l| TraceLine {
            at: on_active(l.at),
            task: format!("{ACTIVE_HOST}{}", l.task),
            ..l.clone()
        }))
        .collect();
    trace.sort_by_key(|l| l.at);
    let mut server = passive.server.clone();
    server
        .entries
        .iter_mut()
        .for_each(|(at, _)| *at = on_passive(*at));
    let mut client = active.client.clone();
    client
        .entries
        .iter_mut()
        .for_each(|(at, _)| *at = on_active(*at));
    let merged = Capture {
        kernel: format!("{} (passive), {} (active)", passive.kernel, active.kernel),
        device: passive.device.clone(),
        nft_drops: passive.nft_drops + active.nft_drops,
        passive: passive.passive.clone(),
        active: active.active.clone(),
        trace,
        server,
        client,
    };
    Ok((merged, alignment))
}

impl Ladder {
    /// The ladder of one connection captured on two hosts: `passive` the server's
    /// capture, `active` the client's (see the module documentation for the clocks).
    pub fn from_two_hosts(passive: &Capture, active: &Capture) -> Result<Ladder, String> {
        let (merged, alignment) = merge(passive, active)?;
        let mut ladder = Ladder::from_capture(&merged)?;
        ladder.active_clock_uncertainty = Some(alignment.uncertainty);
        ladder.context = Some(format!(
            "passive on {}, active on {}, two hosts, active clock {} ± {}",
            passive.kernel,
            active.kernel,
            alignment.offset_text(),
            clock(alignment.uncertainty)
        ));
        Ok(ladder)
    }
}

/// One host's capture cut in two, as if each side had been on its own host and the
/// active one's clock were `active_shift_ns` off: what the tests of the alignment start
/// from. A line belongs to the host its `src` address names, else (the IB CM's
/// tracepoints and the probes) to the host of the process or IB CM id it names.
pub fn split_one_host(capture: &Capture, active_shift_ns: i128) -> (Capture, Capture) {
    let active_prefix = format!("{}:", capture.active);
    let passive_prefix = format!("{}:", capture.passive.split(':').next().unwrap_or(""));
    let on_active = |l: &TraceLine, tasks: &[&str], ids: &[&str]| -> bool {
        match l.field("src") {
            Some(src) if src.starts_with(&active_prefix) => true,
            Some(src) if src.starts_with(&passive_prefix) => false,
            _ => {
                tasks.contains(&l.task.as_str())
                    || l.field("local_id").is_some_and(|id| ids.contains(&id))
            }
        }
    };
    let req = capture.trace.iter().find(|l| l.event == "icm_send_req");
    let active_task = capture
        .trace
        .iter()
        .find(|l| l.event == "cm_send_req")
        .map(|l| l.task.as_str());
    let ids: Vec<&str> = req.and_then(|l| l.field("local_id")).into_iter().collect();
    let tasks: Vec<&str> = active_task.into_iter().collect();
    let shift = |at: Duration| Duration::from_nanos((nanos(at) + active_shift_ns).max(0) as u64);
    let (mut passive, mut active) = (capture.clone(), capture.clone());
    passive.trace.retain(|l| !on_active(l, &tasks, &ids));
    active.trace.retain(|l| on_active(l, &tasks, &ids));
    active.trace.iter_mut().for_each(|l| l.at = shift(l.at));
    active
        .client
        .entries
        .iter_mut()
        .for_each(|(at, _)| *at = shift(*at));
    passive.client.entries.clear();
    active.server.entries.clear();
    active.nft_drops = 0;
    (passive, active)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Capture {
        let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
        Capture::parse(&std::fs::read_to_string(path).expect("fixture")).expect("capture")
    }

    #[test]
    fn the_offset_found_holds_the_true_one_within_its_uncertainty() {
        for name in ["vm-ladder-6.1.txt", "vm-ladder-6.12.txt"] {
            let one = fixture(name);
            for shift in [-7_000_000_000i128, 0, 3_250_000_123] {
                let (passive, active) = split_one_host(&one, shift);
                let alignment = Alignment::from_captures(&passive, &active).expect(name);
                // The true offset undoes the shift.
                let error = (alignment.offset_ns + shift).unsigned_abs();
                assert!(
                    error <= alignment.uncertainty.as_nanos(),
                    "{name}, shift {shift}: {alignment:?}"
                );
                let single = Ladder::from_capture(&one).expect(name);
                let two = Ladder::from_two_hosts(&passive, &active).expect(name);
                assert_eq!(two.summary(), single.summary(), "{name}");
                assert_eq!(two.arrows.len(), single.arrows.len(), "{name}");
                assert!(two.title().contains("two hosts"), "{}", two.title());
            }
        }
    }

    #[test]
    fn stamps_of_two_different_connections_are_refused() {
        let (passive, mut active) = split_one_host(&fixture("vm-ladder-6.1.txt"), 0);
        // The REP read before the REQ was sent: impossible for one connection.
        let req_at = active
            .trace
            .iter()
            .find(|l| l.event == "icm_send_req")
            .map(|l| l.at)
            .expect("a REQ");
        for line in &mut active.trace {
            if line.cm_event() == Some("CONNECT_RESPONSE") {
                line.at = req_at;
            }
        }
        let passive_late = {
            let mut p = passive.clone();
            for line in &mut p.trace {
                if line.event == "cm_req_handler" {
                    line.at = Duration::ZERO;
                }
            }
            p
        };
        assert!(Alignment::from_captures(&passive_late, &active).is_err());
    }

    #[test]
    fn a_merged_line_names_its_host() {
        let (passive, active) = split_one_host(&fixture("vm-ladder-6.12.txt"), 1_000_000);
        let (merged, _) = merge(&passive, &active).expect("merge");
        assert!(merged.trace.windows(2).all(|w| w[0].at <= w[1].at));
        let lanes: Vec<Option<Lane>> = merged.trace.iter().map(|l| host_lane(&l.task)).collect();
        assert!(lanes.contains(&Some(Lane::Active)) && lanes.contains(&Some(Lane::Passive)));
        assert!(lanes.iter().all(Option::is_some));
        assert_eq!(host_lane("cmnotify-205"), None);
    }
}
