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
//! The queue is unbounded: it holds what was dropped and not destroyed yet (a few dozen
//! bytes each), which only a kernel holding every thread at once can grow. Jobs still
//! queued when the process exits are not lost: closing the channel's descriptor makes
//! the kernel destroy the ids.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};

/// The most threads destroying at once: one is the rule; more run only while the kernel
/// holds every one of them.
pub(crate) const MAX_THREADS: usize = 4;

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
}

struct State<J> {
    jobs: VecDeque<J>,
    /// Threads started and still running.
    threads: usize,
    /// Threads waiting for a job.
    idle: usize,
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
        Reaper {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                threads: 0,
                idle: 0,
            }),
            ready: Condvar::new(),
            pending: AtomicUsize::new(0),
        }
    }

    /// Runs `job` on a destroying thread. A job that finds no thread idle starts one
    /// while fewer than [`MAX_THREADS`] run; where no thread can be started at all, it
    /// runs here.
    fn run_later(&'static self, job: J) {
        self.pending.fetch_add(1, Ordering::AcqRel);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.jobs.push_back(job);
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

    /// A destroying thread: takes jobs until the process ends.
    fn work(&'static self) {
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
