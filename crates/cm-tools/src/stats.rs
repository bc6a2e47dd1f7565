//! Latency summaries, and the process's peak memory.

use std::time::Duration;

/// Percentiles of a set of durations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LatencySummary {
    /// How many samples.
    pub count: usize,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Largest sample.
    pub max: Duration,
}

impl LatencySummary {
    /// Summarises `samples` (sorted in place). Nearest-rank percentiles.
    pub fn from_durations(samples: &mut [Duration]) -> Self {
        if samples.is_empty() {
            return LatencySummary::default();
        }
        samples.sort_unstable();
        let rank = |p: usize| samples[(samples.len() * p).div_ceil(100).max(1) - 1];
        LatencySummary {
            count: samples.len(),
            p50: rank(50),
            p99: rank(99),
            max: samples[samples.len() - 1],
        }
    }
}

/// The process's peak resident set (`VmHWM` of `/proc/self/status`), in bytes; `None`
/// where there is no such file.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut samples: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let s = LatencySummary::from_durations(&mut samples);
        assert_eq!(s.count, 100);
        assert_eq!(s.p50, Duration::from_micros(50));
        assert_eq!(s.p99, Duration::from_micros(99));
        assert_eq!(s.max, Duration::from_micros(100));
        assert_eq!(
            LatencySummary::from_durations(&mut []),
            LatencySummary::default()
        );
        let mut one = [Duration::from_millis(3)];
        assert_eq!(
            LatencySummary::from_durations(&mut one).p99,
            Duration::from_millis(3)
        );
    }

    #[test]
    fn the_peak_resident_set_is_read_and_covers_touched_memory() {
        let before = peak_rss_bytes().expect("Linux has /proc/self/status");
        // Written, so resident (a peak never falls, whatever other tests did).
        let touched = vec![1u8; 64 << 20];
        let after = peak_rss_bytes().expect("Linux has /proc/self/status");
        assert!(after >= before && after >= 64 << 20, "{before} -> {after}");
        drop(touched);
    }
}
