//! [`ConnRecord`]: one connection as the run sees it, packed small (a run may hold a
//! million), with what few connections have kept aside in a box.

use std::collections::VecDeque;
use std::time::Duration;

use cm_core::{AsyncEventType, QpNum};
use cm_verbs::{CloseReason, ConnectionId, EstablishedVia, Trigger};

/// One connection as the run sees it (a retried address resolution keeps its slot).
/// Compact, a run may hold a million (64 bytes): the steps' timings are summed up on
/// the session ([`Session::step_totals`]) rather than kept here, what is rare (a
/// failure, a close for another reason than the usual two, echoes waiting for a
/// buffer, an unusual way of getting established, a setup slower than four seconds)
/// is boxed, and small values take the bytes they need.
///
/// [`Session::step_totals`]: super::Session::step_totals
#[derive(Debug, Clone, PartialEq)]
pub struct ConnRecord {
    /// The endpoint's handle of the current attempt (`None`: connect failed at once).
    pub handle: Option<ConnectionId>,
    /// Its QP number once known ([`NO_QP`]: not yet).
    qp: u32,
    /// Address resolution attempts so far.
    pub attempts: u32,
    /// Messages posted.
    pub sends_posted: u32,
    /// Sends reported complete ([`Event::Sent`]'s counts).
    ///
    /// [`Event::Sent`]: cm_verbs::Event::Sent
    pub sends_done: u32,
    /// Messages received.
    pub received: u32,
    /// What the caller of [`Session::handle_ready`] tagged it with (`u32::MAX`: nothing).
    ///
    /// [`Session::handle_ready`]: super::Session::handle_ready
    pub(super) tag: u32,
    /// How long its [`Step::Established`] took, in nanoseconds (`u32::MAX`: not timed;
    /// [`FAR`]: longer, in `rare`).
    ///
    /// [`Step::Established`]: crate::steps::Step::Established
    established_in: u32,
    /// When its exchange began, in nanoseconds (`u64::MAX`: not yet).
    pub(super) exchange_start: u64,
    /// When it is given up if nothing happens (set once established), in nanoseconds
    /// (`u64::MAX`: not set).
    pub(super) idle_deadline: u64,
    /// What few connections have: a failure, an unusual close, echoes waiting.
    pub(super) rare: Option<Box<Rare>>,
    /// How it became established (the first report), as a [`Via`] code.
    established: u8,
    /// [`Event::Established`] reports received, saturating (exactly one for an
    /// established connection).
    ///
    /// [`Event::Established`]: cm_verbs::Event::Established
    pub(super) established_reports: u8,
    /// How it ended: the two usual reasons here, any other in `rare`.
    pub(super) closed: Closed,
    /// [`Flag`]s.
    flags: u8,
}

/// A [`ConnRecord`]'s QP number before it is known (QP numbers are 24-bit).
const NO_QP: u32 = u32::MAX;
/// A [`ConnRecord::established_in`] kept in `rare` (four seconds or more).
const FAR: u32 = u32::MAX - 1;

/// The bits of [`ConnRecord::flags`].
#[derive(Debug, Clone, Copy)]
pub(super) enum Flag {
    /// Its exchange completed.
    Exchanged = 1,
    /// It has its entry in the session's idle heap.
    IdleQueued = 2,
    /// This side called disconnect on it.
    DisconnectCalled = 4,
}

/// How a connection became established, in a byte: the usual ways have a code, any
/// other is kept whole in [`Rare::established`].
struct Via;

impl Via {
    const NONE: u8 = 0;
    const OTHER: u8 = u8::MAX;
    const USUAL: [EstablishedVia; 5] = [
        EstablishedVia::Handshake,
        EstablishedVia::Notify(Trigger::AsyncEvent(AsyncEventType::CommEst)),
        EstablishedVia::Notify(Trigger::ReceiveCompletion),
        EstablishedVia::RtuWonRace(Trigger::AsyncEvent(AsyncEventType::CommEst)),
        EstablishedVia::RtuWonRace(Trigger::ReceiveCompletion),
    ];

    fn code(via: EstablishedVia) -> u8 {
        Self::USUAL
            .iter()
            .position(|usual| *usual == via)
            .map_or(Self::OTHER, |index| index as u8 + 1)
    }
}

/// How a connection ended, in a byte: nearly all end disconnected or timed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Closed {
    Open,
    Disconnected,
    TimedOut,
    /// The reason is in [`Rare::closed`].
    Other,
}

/// The part of a [`ConnRecord`] few connections need.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) struct Rare {
    /// Why it failed, one line.
    pub(super) failure: Option<String>,
    /// How it ended, for a reason other than the usual two.
    pub(super) closed: Option<CloseReason>,
    /// Echoes waiting for a free send buffer.
    pub(super) pending: VecDeque<Vec<u8>>,
    /// How it became established, when no [`Via`] code says it.
    established: Option<EstablishedVia>,
    /// How long its [`Step::Established`] took, in nanoseconds, when it did not fit.
    ///
    /// [`Step::Established`]: crate::steps::Step::Established
    established_in: Option<u64>,
}

/// An unset instant or duration of a [`ConnRecord`].
pub(super) const UNSET: u64 = u64::MAX;

/// `at` in nanoseconds, short of [`UNSET`].
pub(super) fn nanos(at: Duration) -> u64 {
    u64::try_from(at.as_nanos()).map_or(UNSET - 1, |n| n.min(UNSET - 1))
}

impl ConnRecord {
    pub(super) fn new(handle: Option<ConnectionId>, attempts: u32) -> Self {
        ConnRecord {
            handle,
            qp: NO_QP,
            attempts,
            sends_posted: 0,
            sends_done: 0,
            received: 0,
            tag: u32::MAX,
            established_in: u32::MAX,
            exchange_start: UNSET,
            idle_deadline: UNSET,
            rare: None,
            established: Via::NONE,
            established_reports: 0,
            closed: Closed::Open,
            flags: 0,
        }
    }

    /// Its QP, once known.
    pub fn qp(&self) -> Option<QpNum> {
        (self.qp != NO_QP).then_some(QpNum(self.qp))
    }

    pub(super) fn set_qp(&mut self, qp: Option<QpNum>) {
        self.qp = qp.map_or(NO_QP, |qp| qp.0);
    }

    /// How it became established (the first report).
    pub fn established(&self) -> Option<EstablishedVia> {
        match self.established {
            Via::NONE => None,
            Via::OTHER => self.rare.as_ref().and_then(|r| r.established),
            code => Via::USUAL.get(usize::from(code) - 1).copied(),
        }
    }

    pub(super) fn set_established(&mut self, via: EstablishedVia) {
        self.established = Via::code(via);
        if self.established == Via::OTHER {
            self.rare.get_or_insert_default().established = Some(via);
        }
    }

    /// [`Event::Established`] reports received (exactly one for an established
    /// connection; counted up to 255).
    ///
    /// [`Event::Established`]: cm_verbs::Event::Established
    pub fn established_reports(&self) -> u32 {
        u32::from(self.established_reports)
    }

    pub(super) fn flag(&self, flag: Flag) -> bool {
        self.flags & flag as u8 != 0
    }

    pub(super) fn set_flag(&mut self, flag: Flag, on: bool) {
        if on {
            self.flags |= flag as u8;
        } else {
            self.flags &= !(flag as u8);
        }
    }

    /// Whether it ended.
    pub fn is_done(&self) -> bool {
        self.closed != Closed::Open
    }

    /// How it ended, once it did (for a connection this side closed: the reason it
    /// closed it with).
    pub fn closed(&self) -> Option<CloseReason> {
        match self.closed {
            Closed::Open => None,
            Closed::Disconnected => Some(CloseReason::Disconnected),
            Closed::TimedOut => Some(CloseReason::TimedOut),
            Closed::Other => self.rare.as_ref().and_then(|r| r.closed.clone()),
        }
    }

    /// Why it failed, one line.
    pub fn failure(&self) -> Option<&str> {
        self.rare.as_ref()?.failure.as_deref()
    }

    /// How long its [`Step::Established`] took (from the return of the connect or
    /// accept call to established), once it is.
    ///
    /// [`Step::Established`]: crate::steps::Step::Established
    pub fn established_in(&self) -> Option<Duration> {
        match self.established_in {
            u32::MAX => None,
            FAR => self
                .rare
                .as_ref()
                .and_then(|r| r.established_in)
                .map(Duration::from_nanos),
            nanos => Some(Duration::from_nanos(u64::from(nanos))),
        }
    }

    pub(super) fn set_established_in(&mut self, nanos: u64) {
        match u32::try_from(nanos).ok().filter(|&n| n < FAR) {
            Some(near) => self.established_in = near,
            None => {
                self.established_in = FAR;
                self.rare.get_or_insert_default().established_in = Some(nanos);
            }
        }
    }

    /// What [`Session::handle_ready`]'s caller tagged it with.
    ///
    /// [`Session::handle_ready`]: super::Session::handle_ready
    pub fn tag(&self) -> Option<u32> {
        (self.tag != u32::MAX).then_some(self.tag)
    }

    pub(super) fn set_failure(&mut self, why: String) {
        self.rare.get_or_insert_default().failure = Some(why);
    }

    pub(super) fn pending_is_empty(&self) -> bool {
        self.rare.as_ref().is_none_or(|r| r.pending.is_empty())
    }

    pub(super) fn queue_echo(&mut self, data: Vec<u8>) {
        self.rare.get_or_insert_default().pending.push_back(data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_keeps_the_unusual_exactly_beside_the_usual() {
        let mut record = ConnRecord::new(None, 1);
        assert_eq!(
            (record.established(), record.established_in()),
            (None, None)
        );
        assert_eq!(record.qp(), None);
        for via in Via::USUAL {
            record.set_established(via);
            assert_eq!(record.established(), Some(via));
        }
        assert!(record.rare.is_none(), "the usual ways take no box");
        let unusual = EstablishedVia::Notify(Trigger::AsyncEvent(AsyncEventType::PathMig));
        record.set_established(unusual);
        assert_eq!(record.established(), Some(unusual));
        record.set_established_in(70_000);
        assert_eq!(record.established_in(), Some(Duration::from_nanos(70_000)));
        let slow = 5_000_000_123;
        record.set_established_in(slow);
        assert_eq!(record.established_in(), Some(Duration::from_nanos(slow)));
        record.set_qp(Some(QpNum(0xff_ffff)));
        assert_eq!(record.qp(), Some(QpNum(0xff_ffff)));
        record.set_flag(Flag::IdleQueued, true);
        record.set_flag(Flag::Exchanged, true);
        record.set_flag(Flag::IdleQueued, false);
        assert!(record.flag(Flag::Exchanged) && !record.flag(Flag::IdleQueued));
        assert!(!record.flag(Flag::DisconnectCalled));
    }
}
