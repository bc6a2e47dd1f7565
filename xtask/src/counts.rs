//! Test counts read from libtest output, shared by `ci` and `vm`.

/// Test counts gathered from `cargo test` output and the skip log.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct TestCounts {
    pub(crate) passed: u64,
    pub(crate) failed: u64,
    pub(crate) ignored: u64,
    pub(crate) skipped: Vec<String>,
}

impl TestCounts {
    /// Adds up every `test result:` line of libtest output.
    pub(crate) fn parse(output: &str) -> TestCounts {
        let mut counts = TestCounts::default();
        for line in output.lines() {
            let Some(rest) = line.trim().strip_prefix("test result: ") else {
                continue;
            };
            for part in rest.split(';') {
                let mut words = part.split_whitespace().rev();
                let (Some(kind), Some(number)) = (words.next(), words.next()) else {
                    continue;
                };
                let Ok(n) = number.parse::<u64>() else {
                    continue;
                };
                match kind {
                    "passed" => counts.passed += n,
                    "failed" => counts.failed += n,
                    "ignored" => counts.ignored += n,
                    _ => {}
                }
            }
        }
        counts
    }

    /// The closing line: tests that really ran and passed, failures, and skips.
    pub(crate) fn line(&self) -> String {
        let skipped = self.skipped.len() as u64;
        format!(
            "{} passed, {} failed, {} skipped",
            self.passed.saturating_sub(skipped),
            self.failed,
            skipped + self.ignored
        )
    }
}
