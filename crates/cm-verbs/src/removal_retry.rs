//! How the real backend retries the device-list refreshes that let librdmacm close a
//! removed device's context: quick at first, then ever slower, then given up.

use std::time::Duration;

/// How soon a pending device removal is first retried; each retry then waits twice as
/// long, up to [`REMOVAL_RETRY_MAX`].
const REMOVAL_RETRY_FIRST: Duration = Duration::from_millis(50);
/// The longest wait between two retries.
const REMOVAL_RETRY_MAX: Duration = Duration::from_secs(2);
/// How long retries go on before they are given up: a device that failed without
/// being removed (DEVICE_FATAL) stays in the device list and is not polled forever.
const REMOVAL_RETRY_FOR: Duration = Duration::from_secs(120);
/// How long refreshes go on after the kernel announced a removal: the device may be one
/// librdmacm never opened, so this gives up sooner.
pub(crate) const ANNOUNCED_RETRY_FOR: Duration = Duration::from_secs(10);

/// The retries of a pending removal: quick at first (the kernel's removal waits for
/// the context to close), then ever slower, then given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RemovalRetry {
    /// Time waited so far.
    spent: Duration,
    /// The next wait.
    next: Duration,
    /// When the retries are given up.
    limit: Duration,
}

impl RemovalRetry {
    /// The retries of a removal just begun.
    pub(crate) fn begin() -> Self {
        Self::for_at_most(REMOVAL_RETRY_FOR)
    }

    /// Retries that end once `limit` is spent.
    pub(crate) fn for_at_most(limit: Duration) -> Self {
        RemovalRetry {
            spent: Duration::ZERO,
            next: REMOVAL_RETRY_FIRST,
            limit,
        }
    }

    /// How long to wait before the next retry; `None` once they are given up.
    pub(crate) fn after(&mut self) -> Option<Duration> {
        if self.spent >= self.limit {
            return None;
        }
        let wait = self.next;
        self.spent += wait;
        self.next = (self.next * 2).min(REMOVAL_RETRY_MAX);
        Some(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_retries_slow_down_and_end() {
        let mut retry = RemovalRetry::begin();
        let waits: Vec<Duration> = std::iter::from_fn(|| retry.after()).collect();
        assert_eq!(waits[0], REMOVAL_RETRY_FIRST);
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert!(waits.iter().all(|w| *w <= REMOVAL_RETRY_MAX));
        let total: Duration = waits.iter().sum();
        assert!(total >= REMOVAL_RETRY_FOR && total < REMOVAL_RETRY_FOR + REMOVAL_RETRY_MAX);
        assert!(waits.len() < 80, "{} retries", waits.len());
        assert_eq!(retry.after(), None, "given up for good");
    }
}
