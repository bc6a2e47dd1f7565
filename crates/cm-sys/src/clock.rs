//! The monotonic clock as a number, to line times up with the kernel's own records.

use std::time::Duration;

/// `CLOCK_MONOTONIC` now. It is the clock of [`std::time::Instant`] on Linux and of
/// tracefs's `mono` trace clock, so a time taken here lines up with kernel trace
/// records (an `Instant` has no readable value).
pub fn monotonic_now() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec for the call's duration, and
    // CLOCK_MONOTONIC exists on every Linux kernel: the call cannot fail.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    debug_assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC)");
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_moves_forward_with_instant() {
        let (before, instant) = (monotonic_now(), std::time::Instant::now());
        std::thread::sleep(Duration::from_millis(2));
        let (after, elapsed) = (monotonic_now(), instant.elapsed());
        assert!(after > before);
        // Both read CLOCK_MONOTONIC: the clock moved at least as far as the Instant saw
        // before its own read.
        assert!(after - before >= elapsed.saturating_sub(Duration::from_millis(1)));
    }
}
