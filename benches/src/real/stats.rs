//! Statistics of the real-path samples: medians, quartiles and the distribution-free
//! 95% interval of a ratio of two medians.

use std::time::Duration;

/// The median of `samples` (sorted in place).
pub(super) fn median(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

/// "p25–p75 µs" of sorted samples.
pub(super) fn interquartile(sorted: &[Duration]) -> String {
    let at = |q: usize| {
        sorted
            .get(sorted.len() * q / 4)
            .copied()
            .unwrap_or_default()
    };
    format!(
        "{:.0}–{:.0} µs",
        at(1).as_secs_f64() * 1e6,
        at(3).as_secs_f64() * 1e6
    )
}

/// A distribution-free 95% confidence interval of the median of sorted samples: the
/// order statistics n/2 ∓ 0.98·√n (the binomial's normal approximation).
pub(super) fn median_interval(sorted: &[Duration]) -> (Duration, Duration) {
    let n = sorted.len() as f64;
    let half_width = 0.98 * n.sqrt();
    let at = |rank: f64| {
        let index = (rank.max(0.0) as usize).min(sorted.len().saturating_sub(1));
        sorted.get(index).copied().unwrap_or_default()
    };
    (
        at((n / 2.0 - half_width).floor()),
        at((n / 2.0 + half_width).ceil()),
    )
}

/// The range a ratio of two medians can take within both medians' 95% intervals.
pub(super) fn ratio_interval(numerator: &[Duration], denominator: &[Duration]) -> (f64, f64) {
    let (num_lo, num_hi) = median_interval(numerator);
    let (den_lo, den_hi) = median_interval(denominator);
    (
        num_lo.as_secs_f64() / den_hi.as_secs_f64(),
        num_hi.as_secs_f64() / den_lo.as_secs_f64(),
    )
}

/// A duration in nanoseconds.
pub(super) fn nanos(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    fn micros(values: impl IntoIterator<Item = u64>) -> Vec<Duration> {
        values.into_iter().map(Duration::from_micros).collect()
    }

    #[test]
    fn the_median_interval_brackets_the_median_and_narrows_with_more_samples() {
        let few = micros(1..=10);
        let many = micros(1..=1000);
        let (lo, hi) = median_interval(&few);
        assert!(lo <= few[5] && few[5] <= hi);
        assert!(lo > Duration::ZERO || few[0] == lo);
        let (lo_many, hi_many) = median_interval(&many);
        assert!(lo_many <= many[500] && many[500] <= hi_many);
        let relative =
            |lo: Duration, hi: Duration, n: usize| (hi - lo).as_secs_f64() / (n as f64 * 1e-6);
        assert!(relative(lo_many, hi_many, many.len()) < relative(lo, hi, few.len()));
        assert_eq!(median_interval(&[]), (Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn the_ratio_interval_contains_the_ratio_of_medians() {
        let pump = micros((0..101).map(|i| 300 + i));
        let hand = micros((0..101).map(|i| 290 + i));
        let (low, high) = ratio_interval(&pump, &hand);
        let ratio = 350.0 / 340.0;
        assert!(low < ratio && ratio < high, "{low} {ratio} {high}");
    }
}
