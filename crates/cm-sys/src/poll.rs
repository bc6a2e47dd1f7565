//! Waiting on several descriptors at once (`poll(2)`), for event loops that watch a CM
//! event channel, a device's asynchronous events and a wake-up descriptor together.

use std::ffi::c_int;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::time::{Duration, Instant};

use cm_core::CmError;

use crate::ffi;

/// Which of the descriptors given to [`poll_readable`] are ready, by position.
///
/// "Ready" means a read will not block: data is there, or the descriptor hung up or has
/// an error that the read will report. Any number of positions; the first
/// [`ReadySet::INLINE`] take no allocation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct ReadySet {
    first: u64,
    /// Positions from 64 on, 64 per word (empty, unallocated, below 64 descriptors).
    rest: Vec<u64>,
}

impl ReadySet {
    /// Positions held without allocating: a server with one or two device contexts
    /// never allocates to wait.
    pub const INLINE: usize = 64;

    /// Marks the descriptor at `index` ready.
    fn insert(&mut self, index: usize) {
        if index < Self::INLINE {
            self.first |= 1 << index;
            return;
        }
        let (word, bit) = ((index - Self::INLINE) / 64, (index - Self::INLINE) % 64);
        if self.rest.len() <= word {
            self.rest.resize(word + 1, 0);
        }
        self.rest[word] |= 1 << bit;
    }

    /// Whether the descriptor at `index` (its position in the slice) is ready.
    pub fn is_ready(&self, index: usize) -> bool {
        if index < Self::INLINE {
            return self.first & (1 << index) != 0;
        }
        let (word, bit) = ((index - Self::INLINE) / 64, (index - Self::INLINE) % 64);
        self.rest.get(word).is_some_and(|w| w & (1 << bit) != 0)
    }

    /// Whether none is ready (the timeout passed).
    pub fn is_empty(&self) -> bool {
        self.first == 0 && self.rest.iter().all(|&w| w == 0)
    }

    /// How many are ready.
    pub fn len(&self) -> usize {
        let rest: u32 = self.rest.iter().map(|w| w.count_ones()).sum();
        (self.first.count_ones() + rest) as usize
    }

    /// The positions of the ready descriptors, in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(self.first)
            .chain(self.rest.iter().copied())
            .enumerate()
            .flat_map(|(word, bits)| {
                (0..64)
                    .filter(move |bit| bits & (1 << bit) != 0)
                    .map(move |bit| word * 64 + bit)
            })
    }
}

/// Waits until at least one of `fds` is readable, or `timeout` passes (`None`: as long as
/// it takes). Interrupted waits (EINTR) are resumed with the time left.
///
/// Returns the ready positions; an empty set means the timeout passed. Any number of
/// descriptors (a process may read dozens of device contexts); up to
/// [`ReadySet::INLINE`] nothing is allocated.
///
/// ```
/// use std::io::Write;
/// use std::os::fd::AsFd;
/// use std::os::unix::net::UnixStream;
/// use std::time::Duration;
///
/// let (quiet, _keep) = UnixStream::pair()?;
/// let (mut writer, busy) = UnixStream::pair()?;
/// writer.write_all(b"x")?;
/// let ready = cm_sys::poll_readable(&[quiet.as_fd(), busy.as_fd()], Some(Duration::ZERO))?;
/// assert!(!ready.is_ready(0));
/// assert!(ready.is_ready(1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn poll_readable(
    fds: &[BorrowedFd<'_>],
    timeout: Option<Duration>,
) -> Result<ReadySet, CmError> {
    const UNUSED: libc::pollfd = libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    };
    let mut inline = [UNUSED; ReadySet::INLINE];
    let mut spilled = Vec::new();
    let pollfds = if fds.len() <= ReadySet::INLINE {
        &mut inline[..fds.len()]
    } else {
        spilled.resize(fds.len(), UNUSED);
        &mut spilled[..]
    };
    for (slot, fd) in pollfds.iter_mut().zip(fds) {
        slot.fd = fd.as_raw_fd();
        slot.events = libc::POLLIN;
    }
    poll_fds(pollfds, timeout).map_err(|e| CmError::from_errno("poll", e))?;
    let mut ready = ReadySet::default();
    for (index, slot) in pollfds.iter().enumerate() {
        if slot.revents & libc::POLLNVAL != 0 {
            // A BorrowedFd is open by construction; this would be a closed-under-us fd.
            return Err(CmError::from_errno("poll", libc::EBADF));
        }
        if slot.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            ready.insert(index);
        }
    }
    Ok(ready)
}

/// `poll(2)` over `pollfds` until one has events or `timeout` passes (`None`: forever),
/// resuming after EINTR with the time left. Returns how many have events (0: timeout),
/// or the errno.
pub(crate) fn poll_fds(
    pollfds: &mut [libc::pollfd],
    timeout: Option<Duration>,
) -> Result<usize, i32> {
    let count = libc::nfds_t::try_from(pollfds.len()).map_err(|_| libc::EINVAL)?;
    // The clock is read once, and only for a timeout EINTR can cut short: where the
    // clock source has no vDSO (HPET in a VM) each read is a syscall, and a zero
    // timeout (busy polling) would pay for two per call.
    let start = match timeout {
        Some(t) if !t.is_zero() => Some(Instant::now()),
        _ => None,
    };
    let deadline = start.and_then(|start| start.checked_add(timeout?));
    let mut left = timeout;
    loop {
        let timeout_ms: c_int = match (left, deadline) {
            (Some(left), Some(_)) => {
                // Round up so that a sub-millisecond remainder still waits.
                c_int::try_from(left.as_micros().div_ceil(1000)).unwrap_or(c_int::MAX)
            }
            (Some(_), None) if start.is_none() => 0,
            // No timeout, or one too long to be an instant.
            _ => -1,
        };
        // SAFETY: `pollfds` is a live, exclusively borrowed array of `count` pollfd
        // structs; poll writes only their `revents` fields.
        let ready = unsafe { libc::poll(pollfds.as_mut_ptr(), count, timeout_ms) };
        match usize::try_from(ready) {
            Ok(n) => return Ok(n),
            Err(_) => {
                let errno = ffi::last_errno();
                if errno != libc::EINTR {
                    return Err(errno);
                }
                if let Some(deadline) = deadline {
                    left = Some(deadline.saturating_duration_since(Instant::now()));
                }
            }
        }
    }
}

/// The instant `timeout` from now; `None` (wait forever) for no timeout and for one so
/// long that the instant is not representable (e.g. `Duration::MAX`).
pub(crate) fn deadline_after(timeout: Option<Duration>) -> Option<Instant> {
    timeout.and_then(|t| Instant::now().checked_add(t))
}

/// What one read attempt of [`wait_then_read`] found.
pub(crate) enum Attempt<T> {
    /// Something for the caller.
    Got(T),
    /// Nothing to read (EAGAIN, or another reader was faster).
    Nothing,
    /// Something read and disposed of (an event about an id being destroyed): look for
    /// the next one.
    Skipped,
}

/// Waits until `fd` is readable (at most `timeout`; `None`: as long as it takes) and
/// reads with `read` until it gets something or the time is up. `Some(Duration::ZERO)`
/// never waits: one look, and `Ok(None)` if nothing was there.
pub(crate) fn wait_then_read<T>(
    fd: RawFd,
    timeout: Option<Duration>,
    op: &'static str,
    mut read: impl FnMut() -> Result<Attempt<T>, CmError>,
) -> Result<Option<T>, CmError> {
    let once = timeout == Some(Duration::ZERO);
    // One look needs no clock (a read of it can be a syscall: HPET in a VM).
    let deadline = if once { None } else { deadline_after(timeout) };
    loop {
        let left = match (timeout, deadline) {
            (Some(_), _) if once => Some(Duration::ZERO),
            (Some(_), Some(deadline)) => Some(deadline.saturating_duration_since(Instant::now())),
            // No timeout, or one too long to represent: wait forever.
            _ => None,
        };
        if !wait_readable(fd, left).map_err(|e| CmError::from_errno(op, e))? {
            return Ok(None);
        }
        match read()? {
            Attempt::Got(value) => return Ok(Some(value)),
            Attempt::Skipped => continue,
            Attempt::Nothing if once => return Ok(None),
            Attempt::Nothing => continue,
        }
    }
}

/// Waits until `fd` is readable or `timeout` passes (`None`: forever). Retries on EINTR.
pub(crate) fn wait_readable(fd: RawFd, timeout: Option<Duration>) -> Result<bool, i32> {
    let mut pollfd = [libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }];
    poll_fds(&mut pollfd, timeout).map(|ready| ready > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn only_the_descriptors_with_data_are_ready() {
        let (mut a_writer, a) = UnixStream::pair().unwrap();
        let (_b_writer, b) = UnixStream::pair().unwrap();
        let (mut c_writer, c) = UnixStream::pair().unwrap();
        let fds = [a.as_fd(), b.as_fd(), c.as_fd()];
        let ready = poll_readable(&fds, Some(Duration::ZERO)).unwrap();
        assert!(ready.is_empty());
        a_writer.write_all(b"1").unwrap();
        c_writer.write_all(b"1").unwrap();
        let ready = poll_readable(&fds, None).unwrap();
        assert_eq!(ready.iter().collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(ready.len(), 2);
        assert!(!ready.is_ready(1));
        assert!(!ready.is_ready(ReadySet::INLINE));
        assert!(!ready.is_ready(1000));
    }

    #[test]
    fn a_hung_up_peer_counts_as_ready() {
        let (writer, reader) = UnixStream::pair().unwrap();
        drop(writer);
        let ready = poll_readable(&[reader.as_fd()], Some(Duration::from_secs(10))).unwrap();
        assert!(ready.is_ready(0));
    }

    #[test]
    fn a_wake_up_from_another_thread_ends_an_unbounded_wait() {
        let (mut writer, reader) = UnixStream::pair().unwrap();
        let waker = std::thread::spawn(move || writer.write_all(b"w").unwrap());
        let ready = poll_readable(&[reader.as_fd()], None).unwrap();
        assert!(ready.is_ready(0));
        waker.join().unwrap();
    }

    #[test]
    fn the_timeout_passes_with_nothing_ready() {
        let (_writer, reader) = UnixStream::pair().unwrap();
        let ready = poll_readable(&[reader.as_fd()], Some(Duration::from_millis(5))).unwrap();
        assert!(ready.is_empty());
        assert!(poll_readable(&[], Some(Duration::ZERO)).unwrap().is_empty());
    }

    #[test]
    fn the_longest_timeouts_wait_like_no_timeout_instead_of_panicking() {
        let (mut writer, reader) = UnixStream::pair().unwrap();
        writer.write_all(b"x").unwrap();
        for timeout in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
            let ready = poll_readable(&[reader.as_fd()], Some(timeout)).unwrap();
            assert!(ready.is_ready(0));
        }
        assert_eq!(deadline_after(Some(Duration::MAX)), None);
        assert_eq!(deadline_after(None), None);
        assert!(deadline_after(Some(Duration::ZERO)).is_some());
    }

    #[test]
    fn wait_then_read_looks_once_for_a_zero_timeout_and_skips_disposed_reads() {
        let (mut writer, reader) = UnixStream::pair().unwrap();
        let fd = reader.as_raw_fd();
        let mut calls = 0;
        let got: Option<u8> = wait_then_read(fd, Some(Duration::ZERO), "poll", || {
            calls += 1;
            Ok(Attempt::Nothing)
        })
        .unwrap();
        assert_eq!((got, calls), (None, 0), "nothing readable: no read");
        writer.write_all(b"x").unwrap();
        let got = wait_then_read(fd, Some(Duration::ZERO), "poll", || {
            calls += 1;
            Ok(Attempt::<u8>::Nothing)
        })
        .unwrap();
        assert_eq!((got, calls), (None, 1), "one look");
        let mut attempts = vec![Attempt::Got(7u8), Attempt::Skipped, Attempt::Skipped];
        let got = wait_then_read(fd, Some(Duration::MAX), "poll", || {
            Ok(attempts.pop().unwrap())
        })
        .unwrap();
        assert_eq!(got, Some(7));
        assert!(attempts.is_empty());
    }

    #[test]
    fn as_many_descriptors_as_forty_device_contexts_are_watched() {
        // The CM channel, then each device's asynchronous events and completion channel:
        // 81 descriptors, past the 64 a set holds inline.
        let pairs: Vec<(UnixStream, UnixStream)> =
            (0..81).map(|_| UnixStream::pair().unwrap()).collect();
        let fds: Vec<_> = pairs.iter().map(|(_, reader)| reader.as_fd()).collect();
        assert!(poll_readable(&fds, Some(Duration::ZERO))
            .unwrap()
            .is_empty());
        for index in [3, 64, 80] {
            (&pairs[index].0).write_all(b"x").unwrap();
        }
        let ready = poll_readable(&fds, None).unwrap();
        assert_eq!(ready.iter().collect::<Vec<_>>(), vec![3, 64, 80]);
        assert_eq!(ready.len(), 3);
        assert!(ready.is_ready(64) && ready.is_ready(80) && !ready.is_ready(79));
        assert!(!ready.is_empty());
    }
}
