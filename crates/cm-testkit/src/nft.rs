//! The nftables rule device tests use to drop (or count) CM MADs on the wire.

use std::net::IpAddr;

use cm_core::CmError;

use crate::report;

/// The CM MAD attribute of the RTU (ReadyToUse).
pub const RTU_ATTRIBUTE: u16 = 0x0014;

/// What a [`CmMadRule`] does with the MADs it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MadAction {
    /// Count them only.
    Count,
    /// Count and drop them.
    Drop,
}

/// An nftables table whose INPUT hook chain counts (and maybe drops) every CM MAD of one
/// attribute addressed to one IP. Never the OUTPUT hook: a local send failure makes
/// soft-RoCE retry in a tight loop. The table is deleted on drop.
#[derive(Debug)]
pub struct CmMadRule {
    nft: String,
    table: String,
    /// Set once the table is deleted (by [`CmMadRule::remove`] or the drop).
    removed: std::sync::atomic::AtomicBool,
}

impl CmMadRule {
    /// Installs the table `table` with one rule for `attribute` MADs to `to`, using the
    /// nft executable `nft` (the VM names it in `CMNOTIFY_NFT`).
    pub fn install(
        nft: &str,
        table: &str,
        to: IpAddr,
        attribute: u16,
        action: MadAction,
    ) -> Result<CmMadRule, CmError> {
        let statement = match action {
            MadAction::Count => "counter",
            MadAction::Drop => "counter drop",
        };
        Self::install_with(nft, table, to, attribute, statement)
    }

    /// As [`CmMadRule::install`], with the rule's statement spelled out after the match
    /// (e.g. `numgen random mod 10 < 3 counter drop`: drop three in ten at random).
    pub fn install_with(
        nft: &str,
        table: &str,
        to: IpAddr,
        attribute: u16,
        statement: &str,
    ) -> Result<CmMadRule, CmError> {
        let guard = CmMadRule {
            nft: nft.to_owned(),
            table: table.to_owned(),
            removed: std::sync::atomic::AtomicBool::new(false),
        };
        // A table left by a killed run would make `add chain` fail: start clean.
        let _ = std::process::Command::new(nft)
            .args(["delete", "table", "inet", table])
            .stderr(std::process::Stdio::null())
            .status();
        guard.run(&["add", "table", "inet", table])?;
        guard.run(&[
            "add",
            "chain",
            "inet",
            table,
            "input",
            "{ type filter hook input priority 0; }",
        ])?;
        let mut args = rule_args(table, to, attribute, MadAction::Count);
        args.pop(); // "counter": the statement says what to do
        args.extend(statement.split(' ').map(str::to_owned));
        guard.run(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
        Ok(guard)
    }

    /// For a device test: a rule in table `table` dropping every RTU to `to`, or `None`
    /// after recording a skip of `test` when the environment names no nft.
    pub fn drop_rtus(test: &str, table: &str, to: IpAddr) -> Option<CmMadRule> {
        let Some(nft) = Self::nft_from_env() else {
            crate::skip(test, "CMNOTIFY_NFT names no nft to drop the RTU with");
            return None;
        };
        match Self::install(&nft, table, to, RTU_ATTRIBUTE, MadAction::Drop) {
            Ok(rule) => Some(rule),
            Err(e) => panic!("{test}: installing the RTU drop: {e}"),
        }
    }

    /// The nft executable named by `CMNOTIFY_NFT`, if any.
    pub fn nft_from_env() -> Option<String> {
        crate::env::var(crate::env::NFT)
    }

    fn run(&self, args: &[&str]) -> Result<String, CmError> {
        run_tool(&self.nft, args)
    }

    /// How many MADs the rule matched so far.
    pub fn hits(&self) -> Result<u64, CmError> {
        let listing = self.run(&["list", "table", "inet", &self.table])?;
        parse_hits(&listing).ok_or_else(|| {
            report(&format!("no counter in the listing: {listing}"));
            CmError::InvalidArgument {
                op: "nft list table",
                reason: "no counter in the listing",
            }
        })
    }

    /// Deletes the rule's table now (once: later calls and the drop do nothing), for a
    /// test that ends its process without unwinding (a watchdog's exit), which would
    /// leave the rule dropping MADs for every test after it.
    pub fn remove(&self) {
        if !self.removed.swap(true, std::sync::atomic::Ordering::AcqRel) {
            let _ = self.run(&["delete", "table", "inet", &self.table]);
        }
    }
}

impl Drop for CmMadRule {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Runs `program` (nft, tc) with `args`; its stdout, or an error after reporting the
/// command and its stderr on the console.
pub fn run_tool(program: &str, args: &[&str]) -> Result<String, CmError> {
    let failed = CmError::InvalidArgument {
        op: "nft/tc",
        reason: "a wire-fault command failed",
    };
    let output = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|e| {
            report(&format!("{program} {args:?}: {e}"));
            failed.clone()
        })?;
    if !output.status.success() {
        report(&format!(
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
        return Err(failed);
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The `nft add rule` arguments: RoCEv2 (UDP 4791), BTH opcode UD SEND_ONLY (QP1), MAD
/// class CM, the attribute.
pub fn rule_args(table: &str, to: IpAddr, attribute: u16, action: MadAction) -> Vec<String> {
    let verdict = match action {
        MadAction::Count => "",
        MadAction::Drop => " drop",
    };
    let rule = format!(
        "ip daddr {to} udp dport 4791 @th,64,8 0x64 @th,232,8 0x07 @th,352,16 \
         {attribute:#06x} counter{verdict}"
    );
    let mut args: Vec<String> = ["add", "rule", "inet", table, "input"]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    args.extend(rule.split(' ').map(str::to_owned));
    args
}

/// The packet count of the first `counter` in an `nft list` output.
pub fn parse_hits(listing: &str) -> Option<u64> {
    listing
        .split("counter packets ")
        .nth(1)
        .and_then(|after| after.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_matches_the_cm_rtu_on_the_input_hook() {
        let args = rule_args(
            "t",
            "10.77.1.1".parse().unwrap(),
            RTU_ATTRIBUTE,
            MadAction::Drop,
        );
        let line = args.join(" ");
        assert_eq!(
            line,
            "add rule inet t input ip daddr 10.77.1.1 udp dport 4791 @th,64,8 0x64 \
             @th,232,8 0x07 @th,352,16 0x0014 counter drop"
        );
        assert_eq!(
            parse_hits("  ... counter packets 7 bytes 420 drop"),
            Some(7)
        );
        assert_eq!(parse_hits("no counter"), None);
    }
}
