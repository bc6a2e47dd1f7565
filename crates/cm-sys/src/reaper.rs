//! Where the ids of connections are destroyed: on a few threads of the process, never on
//! the thread that dropped the last handle.
//!
//! The kernel's `rdma_destroy_id` returns only once none of the id's CM messages is still
//! outstanding, and a message holds the id for as long as it may be retried: up to about
//! a minute with rdma_cm's defaults (15 tries of 4.3 s), 68.7 s for a REP its peer
//! answered with an MRA. Linux 6.12 was seen holding the destroy of a server's id whose
//! RTU was lost and whose peer left at once for 69 s (IB CM state TIMEWAIT, one reference
//! left, `cm_destroy_id_wait_timeout` in the kernel log). An event loop that destroyed its
//! own ids would stop for that long, and every other connection with it: requests
//! unanswered, establishments unreported, clients timing out. Here the wait holds up one
//! destroying thread only; a job queued behind it starts another, up to
//! [`MAX_THREADS`].
//!
//! Destroying threads run at the lowest priority (nice 19): a destroy is work nobody
//! waits for, and on a busy machine it would take the CPU from what peers wait for (the
//! reply to the next DREQ, the next REP). Measured in the soft-RoCE VM (2 vCPUs, 10,000
//! connections of a cmtime client, the id and its QP destroyed here): the disconnect
//! step went from 1,450 and 1,390 µs a connection to 850 and 900, its slowest from
//! 3.7 s to 0.17 s. Past [`URGENT_BACKLOG`] jobs waiting, a thread of the process's
//! own priority joins until half of them are done, so a load that never lets up
//! cannot grow the queue without end.
//!
//! A QP's destroy holds its channel's lock shared (an event read may not write into the
//! id meanwhile): a read on that channel waits for it, as it did when the event loop
//! destroyed the QP itself, and only when the two meet.
//!
//! Jobs still queued when the process exits are not lost: closing the channel's
//! descriptor makes the kernel destroy the ids.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};

/// The most threads destroying at once: one is the rule; more run only while the kernel
/// holds every one of them.
pub(crate) const MAX_THREADS: usize = 4;

/// Jobs waiting (queued, not taken) past which a destroying thread of the process's own
/// priority joins the low-priority ones, until half of them are taken: a bound of a
/// few thousand ids with their QPs (some kilobytes of kernel memory each) on what a
/// busy machine leaves for later.
pub const URGENT_BACKLOG: usize = 4096;

/// The nice value of the ordinary destroying threads: the lowest priority.
const LOW_PRIORITY_NICE: libc::c_int = 19;

/// A destruction to run later, queued by value: queueing one allocates nothing beyond
/// the queue's own growth.
pub(crate) trait Job: Send + 'static {
    /// Runs it, on a destroying thread.
    fn run(self);
}

/// The queue and its threads.
pub(crate) struct Reaper<J> {
    state: Mutex<State<J>>,
    ready: Condvar,
    /// Jobs queued or running. Outside the lock: a job's end takes no lock, so a
    /// destroying thread locks once a job, when it takes it.
    pending: AtomicUsize,
    /// Jobs waiting past which a thread of normal priority joins ([`URGENT_BACKLOG`]).
    urgent_backlog: usize,
}

struct State<J> {
    jobs: VecDeque<J>,
    /// Threads started and still running.
    threads: usize,
    /// Threads waiting for a job.
    idle: usize,
    /// Whether a thread of normal priority is draining the backlog.
    urgent: bool,
}

/// The process's reaper of ids (see `crate::id`).
static REAPER: OnceLock<Reaper<crate::id::DestroyJob>> = OnceLock::new();

fn reaper() -> &'static Reaper<crate::id::DestroyJob> {
    REAPER.get_or_init(Reaper::new)
}

/// Runs `job` on a destroying thread of the process's reaper (see [`Reaper::run_later`]).
pub(crate) fn run_later(job: crate::id::DestroyJob) {
    reaper().run_later(job);
}

/// Ids dropped whose `rdma_destroy_id` has not returned yet, in this process: queued or
/// being destroyed. The kernel holds a destroy while a CM message of the id may still be
/// retried (up to about a minute); a process that must see every id gone before it goes
/// on (a leak check, a rebind of the same port) waits for this to reach 0.
pub fn pending_destroys() -> usize {
    reaper().pending()
}

impl<J: Job> Reaper<J> {
    /// A reaper with no job and no thread yet.
    fn new() -> Self {
        Self::with_urgent_backlog(URGENT_BACKLOG)
    }

    fn with_urgent_backlog(urgent_backlog: usize) -> Self {
        Reaper {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                threads: 0,
                idle: 0,
                urgent: false,
            }),
            ready: Condvar::new(),
            pending: AtomicUsize::new(0),
            urgent_backlog,
        }
    }

    /// Runs `job` on a destroying thread. A job that finds no thread idle starts one
    /// while fewer than [`MAX_THREADS`] run; where no thread can be started at all, it
    /// runs here.
    fn run_later(&'static self, job: J) {
        self.pending.fetch_add(1, Ordering::AcqRel);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.jobs.push_back(job);
        if state.jobs.len() >= self.urgent_backlog && !state.urgent {
            state.urgent = true;
            let started = std::thread::Builder::new()
                .name("cm-destroy-urgent".into())
                .spawn(move || self.drain_backlog());
            if started.is_err() {
                // The low-priority threads still take every job, only later.
                state.urgent = false;
            }
        }
        if state.idle > 0 || state.threads >= MAX_THREADS {
            drop(state);
            self.ready.notify_one();
            return;
        }
        state.threads += 1;
        drop(state);
        let started = std::thread::Builder::new()
            .name("cm-destroy".into())
            .spawn(move || self.work());
        if started.is_err() {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.threads -= 1;
            if state.threads == 0 {
                // Nobody else will take it: this thread does, as if there were no reaper.
                let jobs: Vec<J> = state.jobs.drain(..).collect();
                drop(state);
                for job in jobs {
                    job.run();
                    self.finished();
                }
            }
        }
    }

    /// Jobs queued or running.
    fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    fn finished(&self) {
        self.pending.fetch_sub(1, Ordering::AcqRel);
    }

    /// The thread of normal priority: takes jobs until half of the backlog that
    /// started it is left, then ends.
    fn drain_backlog(&'static self) {
        loop {
            let job = {
                let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                if state.jobs.len() <= self.urgent_backlog / 2 {
                    state.urgent = false;
                    return;
                }
                state.jobs.pop_front()
            };
            if let Some(job) = job {
                job.run();
                self.finished();
            }
        }
    }

    /// A destroying thread: takes jobs until the process ends, at the lowest priority.
    fn work(&'static self) {
        lower_this_threads_priority();
        loop {
            let job = {
                let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                loop {
                    if let Some(job) = state.jobs.pop_front() {
                        break job;
                    }
                    state.idle += 1;
                    state = self
                        .ready
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
                    state.idle -= 1;
                }
            };
            job.run();
            self.finished();
        }
    }
}

/// Sets the calling thread's nice value to [`LOW_PRIORITY_NICE`]. On Linux a nice value
/// is a thread's own: `setpriority(PRIO_PROCESS, tid)` changes this thread only. Where
/// it fails the thread stays at the process's priority, as before.
fn lower_this_threads_priority() {
    // SAFETY: gettid has no preconditions and cannot fail.
    let tid = unsafe { libc::gettid() };
    // SAFETY: plain system call on this thread's own id; it reads and writes no memory.
    let ret = unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::id_t::try_from(tid).unwrap_or(0),
            LOW_PRIORITY_NICE,
        )
    };
    // A thread left at normal priority destroys as before: nothing to report.
    let _ = ret;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A job of the tests: any closure.
    struct Closure(Box<dyn FnOnce() + Send>);

    impl Job for Closure {
        fn run(self) {
            (self.0)();
        }
    }

    /// A reaper of the test's own, for the life of the process (its threads outlive
    /// the test).
    fn test_reaper() -> &'static Reaper<Closure> {
        Box::leak(Box::new(Reaper::new()))
    }

    /// What the reaper exists for: a destroy the kernel holds up does not hold up the
    /// ones queued after it.
    #[test]
    fn a_job_held_up_does_not_hold_up_the_next() {
        let reaper = test_reaper();
        let (release, held) = mpsc::channel::<()>();
        let (done_tx, done) = mpsc::channel::<&'static str>();
        let first_done = done_tx.clone();
        reaper.run_later(Closure(Box::new(move || {
            held.recv().ok();
            first_done.send("held").ok();
        })));
        reaper.run_later(Closure(Box::new(move || {
            done_tx.send("next").ok();
        })));
        // The second job finishes while the first is still held.
        assert_eq!(done.recv_timeout(Duration::from_secs(30)), Ok("next"));
        settles_at(reaper, 1, "the held job is still pending");
        release.send(()).unwrap();
        assert_eq!(done.recv_timeout(Duration::from_secs(30)), Ok("held"));
        settles_at(reaper, 0, "every job finished");
    }

    /// Waits until `reaper` counts `pending` jobs: a job is counted as finished just
    /// after it has run, so its own message can come a moment before its count.
    fn settles_at(reaper: &Reaper<Closure>, pending: usize, what: &str) {
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while reaper.pending() != pending && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(reaper.pending(), pending, "{what}");
    }

    /// The nice value of the calling thread.
    fn this_threads_nice() -> libc::c_int {
        // SAFETY: plain system calls on this thread's own id.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }

    #[test]
    fn destroying_threads_run_at_the_lowest_priority() {
        let reaper = test_reaper();
        let (tx, rx) = mpsc::channel();
        reaper.run_later(Closure(Box::new(move || {
            tx.send(this_threads_nice()).ok();
        })));
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(30)),
            Ok(LOW_PRIORITY_NICE)
        );
    }

    /// With every low-priority thread held, a backlog past the mark still drains: a
    /// thread of normal priority takes jobs until half the mark is left, then ends.
    #[test]
    fn a_backlog_past_the_mark_is_drained_at_normal_priority() {
        const MARK: usize = 8;
        let reaper: &'static Reaper<Closure> =
            Box::leak(Box::new(Reaper::with_urgent_backlog(MARK)));
        let (release, held) = mpsc::channel::<()>();
        let held = std::sync::Arc::new(Mutex::new(held));
        let (taken_tx, taken) = mpsc::channel::<()>();
        for _ in 0..MAX_THREADS {
            let held = std::sync::Arc::clone(&held);
            let taken_tx = taken_tx.clone();
            reaper.run_later(Closure(Box::new(move || {
                taken_tx.send(()).ok();
                held.lock().unwrap().recv().ok();
            })));
        }
        // Every low-priority thread holds a job before the backlog is queued.
        for _ in 0..MAX_THREADS {
            taken.recv_timeout(Duration::from_secs(30)).unwrap();
        }
        let (done_tx, done) = mpsc::channel::<libc::c_int>();
        for _ in 0..MARK {
            let done_tx = done_tx.clone();
            reaper.run_later(Closure(Box::new(move || {
                done_tx.send(this_threads_nice()).ok();
            })));
        }
        // The held threads take nothing; the urgent thread runs jobs down to MARK / 2.
        for _ in 0..MARK - MARK / 2 {
            let nice = done.recv_timeout(Duration::from_secs(30)).unwrap();
            assert_ne!(nice, LOW_PRIORITY_NICE, "run by the normal-priority thread");
        }
        settles_at(reaper, MAX_THREADS + MARK / 2, "half the mark is left");
        // It ends just after its last job's count: wait for that too.
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while reaper.state.lock().unwrap().urgent && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            !reaper.state.lock().unwrap().urgent,
            "the urgent thread ended"
        );
        for _ in 0..MAX_THREADS {
            release.send(()).unwrap();
        }
        settles_at(reaper, 0, "every job finished");
    }

    #[test]
    fn every_job_runs_once_even_with_every_thread_held() {
        let reaper = test_reaper();
        let (release, held) = mpsc::channel::<()>();
        let held = std::sync::Arc::new(Mutex::new(held));
        let (done_tx, done) = mpsc::channel::<usize>();
        let jobs = MAX_THREADS * 3;
        for index in 0..jobs {
            let held = std::sync::Arc::clone(&held);
            let done_tx = done_tx.clone();
            reaper.run_later(Closure(Box::new(move || {
                held.lock().unwrap().recv().ok();
                done_tx.send(index).ok();
            })));
        }
        for _ in 0..jobs {
            release.send(()).unwrap();
        }
        let mut seen: Vec<usize> = (0..jobs)
            .map(|_| done.recv_timeout(Duration::from_secs(30)).unwrap())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..jobs).collect::<Vec<_>>());
        assert!(reaper.state.lock().unwrap().threads <= MAX_THREADS);
    }
}
