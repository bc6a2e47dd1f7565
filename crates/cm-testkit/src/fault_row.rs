//! One row of the real-kernel fault matrix: a fault scenario run in the VM prints it
//! after [`FAULT_PREFIX`] on stderr; `cargo xtask vm` reads the rows from the console
//! log, prints them and adds them to `target/fault-matrix.md`.

/// What precedes a row on stderr (and so in the VM console log).
pub const FAULT_PREFIX: &str = "cm-fault: ";

/// What one fault scenario did on the real kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultRow {
    /// The fault, e.g. `random RTU loss 30%`.
    pub fault: String,
    /// Connections attempted.
    pub connections: u64,
    /// Connections reported established (exactly once each).
    pub established: u64,
    /// Of those, established by notify (the RTU was lost).
    pub rescued: u64,
    /// Connections that failed or were closed by the fault.
    pub failed: u64,
    /// Kernel CM ids left over afterwards (`rdma resource show cm_id` against its count
    /// before).
    pub leaked_ids: u64,
}

impl FaultRow {
    /// The tab-separated line.
    pub fn to_line(&self) -> String {
        format!(
            "{}\t{}\t{}\t{}\t{}\t{}",
            self.fault.replace(['\t', '\n'], " "),
            self.connections,
            self.established,
            self.rescued,
            self.failed,
            self.leaked_ids
        )
    }

    /// Parses a line written by [`FaultRow::to_line`].
    pub fn from_line(line: &str) -> Option<FaultRow> {
        let mut parts = line.split('\t');
        let fault = parts.next()?.to_string();
        let mut number = || parts.next()?.trim().parse::<u64>().ok();
        Some(FaultRow {
            fault,
            connections: number()?,
            established: number()?,
            rescued: number()?,
            failed: number()?,
            leaked_ids: number()?,
        })
    }

    /// Prints the row for the console log.
    pub fn report(&self) {
        crate::report(&format!("{FAULT_PREFIX}{}", self.to_line()));
    }

    /// The Markdown table header of the rows.
    pub const TABLE_HEADER: &'static str = "| fault | connections | established | rescued | failed | leaked ids |\n|---|---|---|---|---|---|";

    /// The row as a Markdown table row.
    pub fn table_row(&self) -> String {
        format!(
            "| {} | {} | {} | {} | {} | {} |",
            self.fault,
            self.connections,
            self.established,
            self.rescued,
            self.failed,
            self.leaked_ids
        )
    }
}

/// The kernel's count of RDMA CM ids (`rdma resource show cm_id`, one line each), for a
/// leak check around a fault scenario; `None` when the `rdma` tool cannot be run.
pub fn kernel_cm_ids() -> Option<u64> {
    let output = std::process::Command::new("rdma")
        .args(["resource", "show", "cm_id"])
        .output()
        .ok()?;
    output.status.success().then(|| {
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .count() as u64
    })
}

/// How many kernel CM ids are left above `baseline`, after waiting (at most 10 s) for
/// destroyed ids to go.
pub fn leaked_cm_ids(baseline: u64) -> u64 {
    let mut now = kernel_cm_ids().unwrap_or(baseline);
    for _ in 0..100 {
        if now <= baseline {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        now = kernel_cm_ids().unwrap_or(baseline);
    }
    now.saturating_sub(baseline)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_survives_its_line() {
        let row = FaultRow {
            fault: "random RTU loss 30%".into(),
            connections: 200,
            established: 200,
            rescued: 61,
            failed: 0,
            leaked_ids: 0,
        };
        assert_eq!(FaultRow::from_line(&row.to_line()), Some(row.clone()));
        assert!(row.table_row().starts_with("| random RTU loss 30% | 200 |"));
        assert_eq!(FaultRow::from_line("garbage"), None);
    }
}
