//! The compact field types of a connection's slot. A scale run holds a slot per
//! connection and side, so each field takes the bytes it needs: times as offsets,
//! numbers with a spare value for none, and what is seldom there in a box that is
//! absent while empty.

use std::collections::VecDeque;
use std::time::Duration;

use cm_core::{ConnectionParams, QpNum};

use super::{ConnTimes, ConnectionId, PrivateData};

/// An optional time or duration in eight bytes (nanoseconds; `u64::MAX` is none, later
/// saturates just below): half an `Option<Duration>`, on every connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Nanos(u64);

impl Nanos {
    pub(super) const NONE: Nanos = Nanos(u64::MAX);

    pub(super) fn new(at: Option<Duration>) -> Self {
        // A time is never taken for none, however far.
        at.map_or(Nanos::NONE, |at| Nanos(nanos(at).min(u64::MAX - 1)))
    }

    pub(super) fn get(self) -> Option<Duration> {
        (self != Nanos::NONE).then(|| Duration::from_nanos(self.0))
    }
}

/// A connection's QP number in four bytes (IB QP numbers are 24-bit, so `u32::MAX`
/// is free to stand for none): half an `Option<QpNum>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct QpSlot(u32);

impl QpSlot {
    pub(super) const NONE: QpSlot = QpSlot(u32::MAX);

    pub(super) fn new(qp: QpNum) -> Self {
        debug_assert_ne!(qp.0, u32::MAX, "QP numbers are 24-bit");
        QpSlot(qp.0)
    }

    pub(super) fn get(self) -> Option<QpNum> {
        (self != QpSlot::NONE).then_some(QpNum(self.0))
    }
}

/// A duration in whole microseconds, rounded up, in four bytes (up to 71 minutes, then
/// saturated): resolution timeouts, which librdmacm takes in milliseconds anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Micros(u32);

impl Micros {
    pub(super) fn new(duration: Duration) -> Self {
        let micros = duration.as_nanos().div_ceil(1000);
        Micros(u32::try_from(micros).unwrap_or(u32::MAX))
    }

    pub(super) fn get(self) -> Duration {
        Duration::from_micros(u64::from(self.0))
    }
}

/// A connection's received messages, with the receive slot each used: nothing at all
/// (eight bytes) while there is none, which is nearly always, and one allocation for
/// the usual one message. The box is there only while it holds a message.
#[derive(Debug, Default)]
pub(super) struct Inbox(Option<Box<Held>>);

/// A received message and the receive slot it used.
type Received = (u32, Vec<u8>);

/// What an [`Inbox`] holds.
#[derive(Debug)]
enum Held {
    One(Received),
    Many(VecDeque<Received>),
}

impl Inbox {
    pub(super) fn capacity(&self) -> usize {
        match self.0.as_deref() {
            None => 0,
            Some(Held::One(_)) => 1,
            Some(Held::Many(q)) => q.capacity(),
        }
    }

    /// Room is made as messages come: one needs no queue.
    pub(super) fn reserve_exact(&mut self, additional: usize) {
        if let Some(Held::Many(q)) = self.0.as_deref_mut() {
            q.reserve_exact(additional);
        }
    }

    pub(super) fn push_back(&mut self, message: Received) {
        match self.0.take().map(|held| *held) {
            None => self.0 = Some(Box::new(Held::One(message))),
            Some(Held::One(first)) => {
                self.0 = Some(Box::new(Held::Many(VecDeque::from([first, message]))));
            }
            Some(Held::Many(mut q)) => {
                q.push_back(message);
                self.0 = Some(Box::new(Held::Many(q)));
            }
        }
    }

    pub(super) fn pop_front(&mut self) -> Option<Received> {
        let message = match self.0.as_deref_mut()? {
            Held::Many(q) => q.pop_front(),
            Held::One(_) => match self.0.take().map(|held| *held) {
                Some(Held::One(message)) => Some(message),
                _ => None,
            },
        };
        if matches!(self.0.as_deref(), Some(Held::Many(q)) if q.is_empty()) {
            self.0 = None;
        }
        message
    }

    /// Without reading the box: it is there only while it holds a message.
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub(super) fn len(&self) -> usize {
        match self.0.as_deref() {
            None => 0,
            Some(Held::One(_)) => 1,
            Some(Held::Many(q)) => q.len(),
        }
    }

    /// The messages, oldest first, without their slots.
    pub(super) fn into_messages(self) -> VecDeque<Vec<u8>> {
        match self.0.map(|held| *held) {
            None => VecDeque::new(),
            Some(Held::One((_, data))) => VecDeque::from([data]),
            Some(Held::Many(q)) => q.into_iter().map(|(_, data)| data).collect(),
        }
    }
}

/// What a connection seldom has, kept together: its private data (nearly always
/// empty or zero-filled), connection parameters other than the default (active side,
/// until the REQ) and a notify failure not yet reported. Nothing boxed while all are
/// empty or zero-filled, which is nearly always: zero-filled private data (what a
/// request carries when its sender put none) is its length alone.
#[derive(Debug, Default)]
pub(super) struct Rare {
    parts: Option<Box<RareParts>>,
    /// The length of zero-filled private data kept outside the box (0: none there).
    zero_private: u16,
}

#[derive(Debug, Default)]
struct RareParts {
    private: PrivateData,
    params: Option<ConnectionParams>,
    notify_failed: Option<cm_core::NotifyError>,
    /// ADDR_CHANGE events the CM reported for the connection.
    address_changes: u32,
}

impl Rare {
    /// Keeps `data` (the REQ's to send, or the peer's until reported).
    pub(super) fn set_private(&mut self, data: PrivateData) {
        self.zero_private = 0;
        match data.zeros_len() {
            Some(len) => {
                self.zero_private = len;
                if let Some(parts) = self.parts.as_deref_mut() {
                    parts.private = PrivateData::empty();
                }
                self.shrink();
            }
            None => self.parts.get_or_insert_default().private = data,
        }
    }

    pub(super) fn private(&self) -> PrivateData {
        match self.parts.as_deref() {
            Some(parts) if !parts.private.is_empty() => parts.private.clone(),
            _ => PrivateData::zeros(usize::from(self.zero_private)),
        }
    }

    pub(super) fn take_private(&mut self) -> PrivateData {
        let data = self.private_taken();
        self.shrink();
        data
    }

    fn private_taken(&mut self) -> PrivateData {
        let zeros = std::mem::take(&mut self.zero_private);
        match self.parts.as_deref_mut() {
            Some(parts) if !parts.private.is_empty() => std::mem::take(&mut parts.private),
            _ => PrivateData::zeros(usize::from(zeros)),
        }
    }

    /// Keeps the parameters of the REQ to send; the default takes no room.
    pub(super) fn set_params(&mut self, params: ConnectionParams) {
        if params == ConnectionParams::default() {
            if let Some(parts) = self.parts.as_deref_mut() {
                parts.params = None;
            }
            self.shrink();
        } else {
            self.parts.get_or_insert_default().params = Some(params);
        }
    }

    pub(super) fn take_params(&mut self) -> ConnectionParams {
        let params = self
            .parts
            .as_deref_mut()
            .and_then(|parts| parts.params.take())
            .unwrap_or_default();
        self.shrink();
        params
    }

    /// The latest notify failure not yet reported ([`crate::Event::NotifyFailed`]).
    pub(super) fn notify_failed(&self) -> Option<cm_core::NotifyError> {
        self.parts.as_deref().and_then(|parts| parts.notify_failed)
    }

    pub(super) fn set_notify_failed(&mut self, error: Option<cm_core::NotifyError>) {
        match error {
            Some(error) => self.parts.get_or_insert_default().notify_failed = Some(error),
            None => {
                if let Some(parts) = self.parts.as_deref_mut() {
                    parts.notify_failed = None;
                }
                self.shrink();
            }
        }
    }

    /// ADDR_CHANGE events the CM reported for the connection.
    pub(super) fn address_changes(&self) -> u32 {
        self.parts
            .as_deref()
            .map_or(0, |parts| parts.address_changes)
    }

    /// Counts one more ADDR_CHANGE.
    pub(super) fn count_address_change(&mut self) {
        let parts = self.parts.get_or_insert_default();
        parts.address_changes = parts.address_changes.saturating_add(1);
    }

    /// The box goes once it holds nothing.
    pub(super) fn shrink(&mut self) {
        if self.parts.as_deref().is_some_and(|parts| {
            parts.private.as_bytes().is_empty()
                && parts.params.is_none()
                && parts.notify_failed.is_none()
                && parts.address_changes == 0
        }) {
            self.parts = None;
        }
    }
}

/// When a connection passed each step of its setup, compactly: the start in
/// nanoseconds on the transport's clock and each step as nanoseconds after it
/// ([`Times::NOT_YET`] for a step not passed); a step more than four seconds after the
/// start (or before it) moves every time to a boxed table, exact. [`ConnTimes`] per
/// connection would double the size of its entry.
#[derive(Debug, Clone)]
pub(super) enum Times {
    /// Every step passed so far within four seconds of the start.
    Near {
        started: u64,
        steps: [u32; Step::COUNT],
    },
    /// The start, then each step ([`Times::NONE`]: not passed), in nanoseconds.
    Far(Box<[u64; Step::COUNT + 1]>),
}

/// The steps [`Times`] records, in [`ConnTimes`]' order.
#[derive(Debug, Clone, Copy)]
pub(super) enum Step {
    AddrResolved,
    RouteResolved,
    CreateQpCalled,
    QpCreated,
    ConnectCalled,
    ConnectReturned,
    Established,
}

impl Step {
    pub(super) const COUNT: usize = 7;
}

impl Times {
    pub(super) const NONE: u64 = u64::MAX;
    /// A step not passed, in `steps`.
    pub(super) const NOT_YET: u32 = u32::MAX;

    pub(super) fn new(started: Duration) -> Self {
        Times::Near {
            started: nanos(started),
            steps: [Self::NOT_YET; Step::COUNT],
        }
    }

    pub(super) fn mark(&mut self, step: Step, at: Duration) {
        let at = nanos(at);
        let (started, steps) = match self {
            Times::Far(exact) => {
                exact[step as usize + 1] = at;
                return;
            }
            Times::Near { started, steps } => (*started, steps),
        };
        match at
            .checked_sub(started)
            .and_then(|after| u32::try_from(after).ok())
            .filter(|&after| after != Self::NOT_YET)
        {
            Some(after) => steps[step as usize] = after,
            None => {
                let mut exact = [Self::NONE; Step::COUNT + 1];
                exact[0] = started;
                for (slot, &after) in steps.iter().enumerate() {
                    if after != Self::NOT_YET {
                        exact[slot + 1] = started + u64::from(after);
                    }
                }
                exact[step as usize + 1] = at;
                *self = Times::Far(Box::new(exact));
            }
        }
    }

    pub(super) fn started(&self) -> u64 {
        match self {
            Times::Near { started, .. } => *started,
            Times::Far(exact) => exact[0],
        }
    }

    /// The time of `step`, in nanoseconds ([`Times::NONE`]: not passed).
    pub(super) fn at(&self, step: Step) -> u64 {
        match self {
            Times::Far(exact) => exact[step as usize + 1],
            Times::Near { steps, .. } if steps[step as usize] == Self::NOT_YET => Self::NONE,
            Times::Near { started, steps } => started + u64::from(steps[step as usize]),
        }
    }

    pub(super) fn public(&self) -> ConnTimes {
        let step = |s: Step| {
            let at = self.at(s);
            (at != Self::NONE).then(|| Duration::from_nanos(at))
        };
        ConnTimes {
            started: Duration::from_nanos(self.started()),
            addr_resolved: step(Step::AddrResolved),
            route_resolved: step(Step::RouteResolved),
            create_qp_called: step(Step::CreateQpCalled),
            qp_created: step(Step::QpCreated),
            connect_called: step(Step::ConnectCalled),
            connect_returned: step(Step::ConnectReturned),
            established: step(Step::Established),
        }
    }
}

/// A time as nanoseconds (584 years fit; later saturates just below "none").
fn nanos(at: Duration) -> u64 {
    u64::try_from(at.as_nanos()).unwrap_or(Times::NONE - 1)
}

/// A connection's slot index, stored one above so that it is never zero: the QP
/// table's empty entries then cost nothing beside it (four bytes per QP number).
#[derive(Debug, Clone, Copy)]
pub(super) struct SlotIndex(std::num::NonZeroU32);

impl SlotIndex {
    pub(super) fn of(conn: ConnectionId) -> Self {
        let index = u32::try_from(conn.index()).expect("slot indexes are 32-bit");
        SlotIndex(std::num::NonZeroU32::new(index.wrapping_add(1)).expect("below u32::MAX"))
    }

    pub(super) fn get(self) -> u32 {
        self.0.get() - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_stay_exact_near_and_far_from_the_start() {
        let start = Duration::from_secs(3);
        let mut times = Times::new(start);
        times.mark(Step::AddrResolved, start + Duration::from_nanos(7));
        assert!(matches!(times, Times::Near { .. }));
        // More than four seconds later: every step moves to the exact table.
        times.mark(Step::Established, start + Duration::from_secs(9));
        assert!(matches!(times, Times::Far(_)));
        times.mark(Step::ConnectCalled, start + Duration::from_millis(1));
        let public = times.public();
        assert_eq!(public.started, start);
        assert_eq!(public.addr_resolved, Some(start + Duration::from_nanos(7)));
        assert_eq!(
            public.connect_called,
            Some(start + Duration::from_millis(1))
        );
        assert_eq!(public.established, Some(start + Duration::from_secs(9)));
        assert_eq!(public.route_resolved, None);
        let mut early = Times::new(start);
        early.mark(Step::QpCreated, Duration::from_secs(1));
        assert_eq!(early.public().qp_created, Some(Duration::from_secs(1)));
    }

    #[test]
    fn compact_fields_answer_as_the_plain_ones() {
        assert_eq!(Nanos::new(None).get(), None);
        let at = Some(Duration::new(5, 17));
        assert_eq!(Nanos::new(at).get(), at);
        assert!(Nanos::new(Some(Duration::MAX)).get().is_some());
        let mut inbox = Inbox::default();
        assert!(inbox.is_empty() && inbox.capacity() == 0);
        inbox.reserve_exact(1);
        inbox.push_back((3, vec![1]));
        inbox.push_back((4, vec![2]));
        assert_eq!(inbox.len(), 2);
        assert_eq!(inbox.pop_front(), Some((3, vec![1])));
        assert_eq!(inbox.into_messages(), [vec![2]]);
        let mut inbox = Inbox::default();
        for slot in 0..3 {
            inbox.push_back((slot, vec![slot as u8]));
        }
        assert_eq!((inbox.len(), inbox.pop_front()), (3, Some((0, vec![0]))));
        inbox.push_back((3, vec![3]));
        assert_eq!(inbox.into_messages(), [vec![1], vec![2], vec![3]]);
        let mut one = Inbox::default();
        one.push_back((5, vec![5]));
        assert_eq!((one.capacity(), one.pop_front()), (1, Some((5, vec![5]))));
        assert!(one.is_empty() && one.pop_front().is_none());
        let mut rare = Rare::default();
        rare.set_private(PrivateData::from(&b"hi"[..]));
        rare.set_notify_failed(Some(cm_core::NotifyError::WrongState));
        assert_eq!(rare.private().as_bytes(), b"hi");
        assert_eq!(rare.take_private().as_bytes(), b"hi");
        assert_eq!(rare.notify_failed(), Some(cm_core::NotifyError::WrongState));
        rare.set_notify_failed(None);
        assert!(rare.parts.is_none(), "the box goes with its last part");
        rare.set_private(PrivateData::empty());
        assert!(rare.parts.is_none());
    }

    /// A request's private data is nearly always the message's room of zeros: kept
    /// without a box, given back at its exact length, and replaced by what comes next.
    #[test]
    fn zero_filled_private_data_is_kept_unboxed_at_its_length() {
        let mut rare = Rare::default();
        rare.set_private(PrivateData::from(&[0u8; 56]));
        assert!(rare.parts.is_none(), "no box for zeros");
        assert_eq!(rare.private().as_bytes(), &[0u8; 56][..]);
        rare.set_params(ConnectionParams {
            retry_count: 3,
            ..ConnectionParams::default()
        });
        assert_eq!(
            rare.private().len(),
            56,
            "a box for another part keeps them"
        );
        rare.set_private(PrivateData::from(&b"\0x"[..]));
        assert_eq!(rare.private().as_bytes(), b"\0x", "bytes replace zeros");
        rare.set_private(PrivateData::from(&[0u8; 3]));
        assert_eq!(
            rare.private().as_bytes(),
            &[0u8; 3][..],
            "zeros replace bytes"
        );
        assert_eq!(rare.take_private().len(), 3);
        assert!(rare.take_private().is_empty(), "taken once");
        rare.take_params();
        assert!(rare.parts.is_none());
    }
}
