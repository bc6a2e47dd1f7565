//! What the driver and the calls tell each other: the one state machine that decides
//! when the driver must look again and when (on a simulation) time may move on.
//!
//! Every field lives under the handles' lock, beside the endpoint; the lock-free parts
//! (who wants the lock, whether the thread driver blocks in the transport's wait) are
//! in [`crate::wake`].
//!
//! | driver state | entered by | left when | a call's poke |
//! |---|---|---|---|
//! | passing | lock held, [`Pacing::take_poke`] | the pass ran | not seen until the next look |
//! | waiting (real transport) | [`Pacing::begin_wait`]: the devices and the deadline it covers | a descriptor, the deadline, or a poke that changes either | wakes it only if the devices or an earlier deadline changed what it covers |
//! | stepping (simulation) | nothing to pass | one step ran: [`Pacing::quiet_turn`] | always wakes it: the quiet count starts again |
//! | parked | [`Pacing::park`] (the async driver), or a turn on the condvar (the thread driver) | a poke, or one turn | wakes it |
//! | idle (simulation) | [`Pacing::quiet_turn`] found nothing for [`IDLE_TURNS`] turns and no deadline: [`Pacing::went_idle`] | a poke | calls waiting since before answer `Idle` |
//! | stopped | [`Pacing::stop`]: every handle gone, for good | never | ignored |
//!
//! On a simulation the calls act between the fabric's steps, so every call that may
//! have moved something pokes, and news a pass routed counts as a poke too: either
//! gives the calls their turn again before virtual time jumps past what they would do.

use std::task::Waker;
use std::time::Duration;

use crate::endpoint::IDLE_TURNS;

/// The driver's side of the conversation with the calls.
#[derive(Debug)]
pub(super) struct Pacing {
    /// A transport whose wait never blocks in real time (a simulation).
    virtual_time: bool,
    /// A call changed something the driver waits on, since it last looked.
    poked: bool,
    /// A pass routed news (a call may act on it) since the driver last looked.
    routed: bool,
    /// The async driver, parked.
    parked: Option<Waker>,
    /// What the driver's current wait covers: the device readers it watches, and
    /// until when (`None`: no deadline).
    seen_devices: usize,
    seen_until: Option<Duration>,
    /// How many times the driver found that nothing could happen anywhere (a
    /// simulation only). A call waiting since before the latest answers `Idle`.
    idle_epoch: u64,
    /// Turns in a row with nothing happening anywhere on the fabric, and the fabric's
    /// activity count when last seen ([`crate::Transport::activity`]).
    quiet_turns: u32,
    last_activity: u64,
    /// Every handle is gone: the driver ends.
    stopped: bool,
}

/// What a driver on a simulation does after a step that moved nothing.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum QuietTurn {
    /// Something happened, or not for long enough: the others' turn, then a step.
    Wait,
    /// Nothing happened anywhere for [`IDLE_TURNS`] turns: time may move on.
    MoveTime,
}

impl Pacing {
    pub(super) fn new(virtual_time: bool) -> Self {
        Pacing {
            virtual_time,
            poked: false,
            routed: false,
            parked: None,
            seen_devices: 0,
            seen_until: None,
            idle_epoch: 0,
            quiet_turns: 0,
            last_activity: 0,
            stopped: false,
        }
    }

    pub(super) fn virtual_time(&self) -> bool {
        self.virtual_time
    }

    /// A call may have changed what the driver waits on: `devices` readers now and
    /// the earliest deadline `next_due`. Returns whether the thread driver sleeping on
    /// the condvar must be woken (a parked async driver is woken here). On a real
    /// transport only a change of the devices or an earlier deadline counts: the rest
    /// reaches the driver through the descriptors it watches.
    pub(super) fn poke(&mut self, devices: usize, next_due: Option<Duration>) -> bool {
        if !(self.virtual_time || self.stopped || self.covers_less_than(devices, next_due)) {
            return false;
        }
        self.poked = true;
        if let Some(driver) = self.parked.take() {
            driver.wake();
        }
        self.virtual_time || self.stopped
    }

    fn covers_less_than(&self, devices: usize, next_due: Option<Duration>) -> bool {
        if devices != self.seen_devices {
            return true;
        }
        match (next_due, self.seen_until) {
            (Some(due), Some(until)) => due < until,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    /// The driver is about to wait on `devices` readers until `next_due`.
    pub(super) fn begin_wait(&mut self, devices: usize, next_due: Option<Duration>) {
        self.seen_devices = devices;
        self.seen_until = next_due;
    }

    /// A pass routed news a call may act on.
    pub(super) fn note_routed(&mut self) {
        self.routed = true;
    }

    /// Takes the poke: whether a call changed something since the driver last looked,
    /// or (on a simulation) a pass routed news. Either starts the quiet count again.
    pub(super) fn take_poke(&mut self) -> bool {
        let routed = std::mem::take(&mut self.routed) && self.virtual_time;
        let poked = std::mem::take(&mut self.poked) | routed;
        if poked {
            self.quiet_turns = 0;
        }
        poked
    }

    /// After a step on a simulation that moved nothing itself, with the fabric's
    /// activity count now `activity`: whether virtual time may move on.
    pub(super) fn quiet_turn(&mut self, activity: u64) -> QuietTurn {
        if activity != self.last_activity {
            self.last_activity = activity;
            self.quiet_turns = 0;
            return QuietTurn::Wait;
        }
        self.quiet_turns += 1;
        if self.quiet_turns <= IDLE_TURNS {
            return QuietTurn::Wait;
        }
        self.quiet_turns = 0;
        QuietTurn::MoveTime
    }

    /// Something moved (a step, a turn that ended in a call's poke): the quiet count
    /// starts again.
    pub(super) fn moved(&mut self, activity: u64) {
        self.last_activity = activity;
        self.quiet_turns = 0;
    }

    /// Parks the async driver until the next poke.
    #[cfg(feature = "tokio")]
    pub(super) fn park(&mut self, waker: &Waker) {
        self.parked = Some(waker.clone());
    }

    /// Nothing can happen on the simulated fabric until a call moves something.
    pub(super) fn went_idle(&mut self) {
        self.idle_epoch += 1;
    }

    /// The count of idle findings, for a call that starts waiting.
    pub(super) fn idle_epoch(&self) -> u64 {
        self.idle_epoch
    }

    /// Whether the driver found the fabric idle since `since`.
    pub(super) fn idle_since(&self, since: u64) -> bool {
        self.idle_epoch > since
    }

    pub(super) fn stop(&mut self) {
        self.stopped = true;
    }

    pub(super) fn stopped(&self) -> bool {
        self.stopped
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    use super::*;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn on_a_real_transport_only_a_change_of_what_the_wait_covers_wakes_the_driver() {
        let mut pacing = Pacing::new(false);
        pacing.begin_wait(1, Some(Duration::from_secs(5)));
        assert!(!pacing.poke(1, Some(Duration::from_secs(6))));
        assert!(!pacing.take_poke(), "a later deadline is covered");
        assert!(!pacing.poke(1, Some(Duration::from_secs(4))));
        assert!(pacing.take_poke(), "an earlier deadline is news");
        assert!(!pacing.poke(2, Some(Duration::from_secs(5))));
        assert!(pacing.take_poke(), "a new device is news");
        pacing.stop();
        assert!(pacing.poke(1, None), "a stop wakes even the thread driver");
    }

    #[test]
    fn a_poke_wakes_the_parked_async_driver_once() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&count));
        let mut pacing = Pacing::new(true);
        pacing.parked = Some(waker);
        assert!(pacing.poke(0, None));
        assert!(pacing.poke(0, None));
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(pacing.take_poke());
        assert!(!pacing.take_poke(), "taken once");
    }

    #[test]
    fn time_moves_on_only_after_enough_quiet_turns_and_any_news_starts_again() {
        let mut pacing = Pacing::new(true);
        for _ in 0..IDLE_TURNS {
            assert_eq!(pacing.quiet_turn(0), QuietTurn::Wait);
        }
        pacing.note_routed();
        assert!(pacing.take_poke(), "routed news is a poke on a simulation");
        for _ in 0..IDLE_TURNS {
            assert_eq!(pacing.quiet_turn(0), QuietTurn::Wait);
        }
        assert_eq!(pacing.quiet_turn(7), QuietTurn::Wait, "activity elsewhere");
        for _ in 0..IDLE_TURNS {
            assert_eq!(pacing.quiet_turn(7), QuietTurn::Wait);
        }
        assert_eq!(pacing.quiet_turn(7), QuietTurn::MoveTime);
        assert_eq!(
            pacing.quiet_turn(7),
            QuietTurn::Wait,
            "the count starts again"
        );
    }

    #[test]
    fn calls_that_began_before_an_idle_finding_see_it() {
        let mut pacing = Pacing::new(true);
        let since = pacing.idle_epoch();
        assert!(!pacing.idle_since(since));
        pacing.went_idle();
        assert!(pacing.idle_since(since));
        assert!(!pacing.idle_since(pacing.idle_epoch()));
    }
}
