//! Benchmark figures measured outside criterion: one tab-separated line each,
//! `key<TAB>value<TAB>unit<TAB>note`. The benches append them to their results file; a
//! test measuring inside the VM prints them after [`FIGURE_PREFIX`] on stderr, where
//! `cargo xtask bench` finds them in the console log.

/// The keys of the figures measured outside criterion that more than one crate names
/// (the benches and tests that measure them, xtask's report that reads them).
pub mod keys {
    /// cm-sys `CmId::notify` against the raw `rdma_notify` (ratio).
    pub const REAL_NOTIFY: &str = "real/notify";
    /// Receive completion to ESTABLISHED, the pump against a hand loop (ratio).
    pub const REAL_TRIGGER_TO_ESTABLISHED: &str = "real/trigger_to_established";
    /// The client's SEND to ESTABLISHED, the Endpoint API against a hand loop (ratio).
    pub const REAL_API_TO_ESTABLISHED: &str = "real/api_to_established";
    /// The client's SEND to ESTABLISHED, the Endpoint API busy polling against a hand
    /// loop spinning on the receive CQ (ratio).
    pub const REAL_API_BUSY_TO_ESTABLISHED: &str = "real/api_busy_to_established";
    /// Connection setup per step (cmtime-like).
    pub const REAL_SETUP: &str = "real/setup";
    /// Connection setup with rdma-core's cmtime client: cmtime's server against
    /// cmnotify's (steps per connection, peak memory per connection, ratios).
    pub const REAL_SETUP_VS_CMTIME: &str = "real/setup_vs_cmtime";
    /// User-space instructions per connection of cmtime's server and of cmnotify's,
    /// counted by callgrind in the VM (per connection, ratios).
    pub const REAL_SETUP_INSTRUCTIONS: &str = "real/setup_instructions";
    /// Accepts per second of a cmnotify server with two endpoints, each on its own thread
    /// (`--endpoints 2`), and with one, cmtime clients on each port at once.
    pub const REAL_SETUP_ENDPOINTS: &str = "real/setup_endpoints";
    /// The data path, the Endpoint API against perftest (`ib_send_lat`, `ib_send_bw`)
    /// on the same devices in one run (ratios and their parts).
    pub const REAL_DATA_PATH: &str = "real/data_path";
    /// Allocations per pumped event.
    pub const PUMP_ALLOCATIONS_PER_EVENT: &str = "pump/allocations_per_event";
}

/// What precedes a figure's line on stderr (and so in the VM console log).
pub const FIGURE_PREFIX: &str = "cm-benches: ";

/// One figure.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    /// Stable key, `group/name` (e.g. `scale/1000/peak_bytes_per_conn`).
    pub key: String,
    /// The value; `None` for a skipped figure.
    pub value: Option<f64>,
    /// Unit of the value (`ns`, `bytes`, `count`, `ratio`).
    pub unit: String,
    /// Free text: what it is, or why it was skipped.
    pub note: String,
}

impl Figure {
    /// A measured figure.
    pub fn measured(key: &str, value: f64, unit: &str, note: &str) -> Figure {
        Figure {
            key: key.to_string(),
            value: Some(value),
            unit: unit.to_string(),
            note: note.to_string(),
        }
    }

    /// A figure that was not measured, and why.
    pub fn skipped(key: &str, reason: &str) -> Figure {
        Figure {
            key: key.to_string(),
            value: None,
            unit: String::new(),
            note: reason.to_string(),
        }
    }

    /// The tab-separated line (tabs and newlines in the note become spaces).
    pub fn to_line(&self) -> String {
        let value = self
            .value
            .map_or_else(|| "skipped".to_string(), |v| v.to_string());
        let note = self.note.replace(['\t', '\n'], " ");
        format!("{}\t{value}\t{}\t{note}", self.key, self.unit)
    }

    /// Parses a line written by [`Figure::to_line`].
    pub fn from_line(line: &str) -> Option<Figure> {
        let mut parts = line.splitn(4, '\t');
        let key = parts.next()?.to_string();
        let value = parts.next()?;
        let unit = parts.next()?.to_string();
        let note = parts.next().unwrap_or("").to_string();
        let value = match value {
            "skipped" => None,
            v => Some(v.parse().ok()?),
        };
        Some(Figure {
            key,
            value,
            unit,
            note,
        })
    }

    /// Prints the line after [`FIGURE_PREFIX`] straight to stderr (see [`crate::report`]).
    pub fn report(&self) {
        crate::report(&format!("{FIGURE_PREFIX}{}", self.to_line()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_survive_their_line_format() {
        let measured = Figure::measured("pump/allocations", 0.0, "count", "after\twarm-up");
        let back = Figure::from_line(&measured.to_line()).unwrap();
        assert_eq!(back.value, Some(0.0));
        assert_eq!(back.note, "after warm-up");
        let skipped = Figure::skipped("real/notify", "no RDMA device");
        assert_eq!(Figure::from_line(&skipped.to_line()), Some(skipped));
        assert_eq!(Figure::from_line("no tabs"), None);
        assert_eq!(Figure::from_line("k\tnot-a-number\tns\t"), None);
    }
}
