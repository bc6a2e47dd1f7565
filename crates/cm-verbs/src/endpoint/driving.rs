//! Driving the endpoint: one pass over every source (CM events first, then the
//! devices' asynchronous events and completions, deadlines last), and the loop of a
//! waiting call around it (wait before read, reads stopped at the answer, busy polling);
//! and the application's calls that drive it (`poll`, `next_event`, the blocking waits).

use std::cmp::Reverse;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cm_core::Transport;

use super::{
    CloseReason, ConnError, ConnectionId, Endpoint, EndpointWaker, EstablishedVia, Event,
    DEFERRED_DESTROY_MAX, PASS_BATCH,
};

impl<T: Transport> Endpoint<T> {
    /// Asks `take` for what it looks for; until it has it, waits in the transport and
    /// handles what the wait found ready (spinning instead of waiting, when busy
    /// polling is on).
    pub(crate) fn wait_for<R>(
        &mut self,
        timeout: Option<Duration>,
        take: impl FnMut(&mut Self) -> Option<Result<R, ConnError>>,
    ) -> Result<R, ConnError> {
        let answer = self.wait_or_spin(timeout, take);
        self.spinning = false;
        // What a spin left unarmed is armed before anything else waits on the
        // endpoint's descriptors (a handle's driver, tokio, the application's own
        // poll); what came meanwhile is read now and kept for the next call.
        self.arm_shared_again();
        answer
    }

    fn wait_or_spin<R>(
        &mut self,
        timeout: Option<Duration>,
        mut take: impl FnMut(&mut Self) -> Option<Result<R, ConnError>>,
    ) -> Result<R, ConnError> {
        // What is already there is answered without reading anything.
        if let Some(found) = take(self) {
            return found;
        }
        let mut now = self.transport.now();
        let deadline = timeout.map(|t| now.saturating_add(t));
        let mut spin = Spin::new(self.options.busy_poll, now);
        let mut spinning = self.options.busy_poll.is_some();
        self.spinning = spinning;
        let mut round: u32 = 0;
        let mut more = false;
        loop {
            // Spinning, the receive queues of the accepted connections come first: a
            // receive there forces the establish without the completion event's reads
            // (the event comes anyway and finds the queue empty), and the ESTABLISHED
            // the kernel then delivers is read at once.
            if spinning && self.poll_awaiting() {
                let mut first_error = None;
                let mut found = None;
                self.read_cm_events(&mut first_error, &mut |ep| {
                    found = take(ep);
                    found.is_some()
                });
                if let Some(found) = found.or_else(|| take(self)) {
                    return found;
                }
                if let Some(error) = first_error {
                    return Err(ConnError::Endpoint(error));
                }
            }
            // Spinning, the devices' shared completion queues too: a message (or a
            // freed send buffer) is there without waiting for the completion event.
            if spinning {
                self.poll_shared_all();
                if let Some(found) = take(self) {
                    return found;
                }
            }
            let ready = if spinning {
                // A look at every source (a zero-timeout wait: one poll(2) on a
                // device) every few rounds says which to read, rather than a read of
                // each on every round: the rounds between poll the receive queues
                // alone.
                round = round.wrapping_add(1);
                round % Spin::LOOK_EVERY == 1
                    && self
                        .transport
                        .wait(&self.devices, Some(Duration::ZERO))
                        .map_err(ConnError::Endpoint)?
            } else if more {
                // A source had more than its batch: read on without waiting.
                true
            } else if self.arm_shared_again() {
                // The spin ended with shared queues unarmed: armed again, and what came
                // meanwhile read; looked at before any wait.
                true
            } else {
                // The wait comes before the first read: it says which sources have
                // something (and returns at once if any has), so no source is read
                // only to find it empty. A deadline already due, or a waker that
                // already fired, is handled first.
                let wait = [deadline, self.next_deadline()]
                    .into_iter()
                    .flatten()
                    .min()
                    .map(|d| d.saturating_sub(now));
                if wait != Some(Duration::ZERO) && !self.woken.load(Ordering::Acquire) {
                    match self.transport.wait(&self.devices, wait) {
                        Ok(_) => {}
                        // The simulation: nothing can ever happen. With a deadline
                        // that is a timeout; without one the wait would never end.
                        Err(cm_core::CmError::Idle { .. }) if deadline.is_some() => {
                            return Err(ConnError::Timeout)
                        }
                        Err(e @ cm_core::CmError::Idle { .. }) => return Err(e.into()),
                        Err(e) => return Err(ConnError::Endpoint(e)),
                    }
                }
                true
            };
            let mut found = None;
            more = if ready {
                // The CM reads stop at the event that answers: the call returns
                // without reading the channel again to find it empty.
                self.process_pass_until(&mut |ep| {
                    if found.is_none() {
                        found = take(ep);
                    }
                    found.is_some()
                })?
            } else {
                self.expire()
            };
            if let Some(found) = found.or_else(|| take(self)) {
                return found;
            }
            if self.woken.swap(false, Ordering::AcqRel) {
                return Err(ConnError::Woken);
            }
            now = self.transport.now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(ConnError::Timeout);
            }
            spinning = spin.keep_spinning(now);
            self.spinning = spinning;
            if spinning {
                // Kernel work this call waits for may need this CPU: soft-RoCE's
                // packet processing and the CM's worker run in kernel threads, and a
                // scheduler that lets a spinning thread run out its slice (EEVDF, from
                // Linux 6.6) held them off for milliseconds without this yield.
                std::thread::yield_now();
            }
        }
    }

    /// The earliest connect/establish deadline (or transport housekeeping), for a
    /// caller that waits by itself. O(1); it may name a deadline that no longer
    /// applies (a connection established since), which costs one early wake-up.
    pub fn next_deadline(&self) -> Option<Duration> {
        let heap = self.deadlines.peek().map(|Reverse((due, _))| *due);
        [heap, self.housekeeping_due].into_iter().flatten().min()
    }

    /// Handles what is ready on every source, at most [`PASS_BATCH`] from each: CM
    /// events first (an RTU read now is not mistaken for a lost one), then asynchronous
    /// events (COMM_EST) and completions (a receive on a connection not yet
    /// established is the other trigger), then the CM again if a trigger forced an
    /// establish (its ESTABLISHED may be there already), then deadlines. O(1) per event handled, whatever the number of
    /// connections.
    pub fn process(&mut self) -> Result<(), ConnError> {
        self.process_pass().map(|_| ())
    }

    /// One pass of [`Endpoint::process`]; whether a source had more than its batch.
    pub(crate) fn process_pass(&mut self) -> Result<bool, ConnError> {
        self.process_pass_until(&mut |_| false)
    }

    /// One pass whose CM reads stop at the event after which `answered` (asked after
    /// each) says the waiting caller has its answer: the channel is not read again only
    /// to find it empty. The other sources still have their turn.
    fn process_pass_until(
        &mut self,
        answered: &mut dyn FnMut(&mut Self) -> bool,
    ) -> Result<bool, ConnError> {
        let mut more = false;
        let mut first_error = None;
        // CM events first: an RTU read now is not mistaken for a lost one.
        more |= self.read_cm_events(&mut first_error, answered);
        let forced_before = self.pump.counters().forced;
        // A device whose reader fails is lost, once the pass has read the others.
        let mut failed = Vec::new();
        // Then the triggers, COMM_EST just before the completions: on a device that
        // raises both for the same packet, the one that came first is the one used.
        more |= self.read_devices(&mut failed, |ep, index| {
            let event = ep.transport.next_async_event(&mut ep.devices[index])?;
            Ok(event.map(|event| ep.on_async_event(index, event)))
        });
        more |= self.read_devices(&mut failed, |ep, index| {
            let token = ep.transport.next_cq_event(&mut ep.devices[index])?;
            Ok(token.map(|token| match ConnectionId::from_token(token) {
                Some(conn) => ep.on_cq_event(conn),
                // The device's shared queues (`shared::SHARED_TOKEN`).
                None => ep.on_shared_cq_event(index),
            }))
        });
        // A trigger that forced an establish: its ESTABLISHED may be there already
        // (the kernel's worker may have run on another CPU meanwhile), and reading it
        // now saves the application a wait.
        if self.pump.counters().forced != forced_before {
            more |= self.read_cm_events(&mut first_error, answered);
        }
        for (key, error) in failed {
            if self.device_keys.contains(&key) {
                tracing::warn!("reading device {key:?} failed, it is taken as lost: {error}");
                self.push_endpoint_event(Event::DeviceFailed {
                    error: error.clone(),
                });
                self.device_lost(key, &CloseReason::DeviceFailed(error));
            }
        }
        more |= self.set_up_requests(&mut first_error);
        more |= self.expire();
        if !self.cm_batch_full || self.ended_ids.len() >= DEFERRED_DESTROY_MAX {
            // Each destroy walks the events still unread on the channel: few now.
            for id in self.ended_ids.drain(..) {
                self.transport.release_id(id);
            }
        }
        // The clock is read only when housekeeping is pending (a read per pass shows on
        // the notify path).
        let wanted = self.transport.wants_housekeeping();
        if wanted || self.device_released || self.housekeeping_due.is_some() {
            let now = self.transport.now();
            if wanted || self.device_released || self.housekeeping_due.is_some_and(|due| due <= now)
            {
                self.device_released = false;
                self.housekeeping_due = self
                    .transport
                    .housekeeping()
                    .map(|after| now.saturating_add(after));
            }
        }
        // One failing source does not keep the others from being handled; a failing
        // device ended above, only the CM channel's error (the endpoint's own) is left.
        match first_error {
            Some(error) => Err(ConnError::Endpoint(error)),
            None => Ok(more),
        }
    }
}

impl<T: Transport> Endpoint<T> {
    /// Runs `read_one` (one read of a device's source, handled; `None` when it is
    /// empty) up to [`PASS_BATCH`] times per device; whether a device had more. A
    /// device whose read fails is noted in `failed` and read no further.
    fn read_devices(
        &mut self,
        failed: &mut Vec<(T::DeviceKey, cm_core::CmError)>,
        mut read_one: impl FnMut(&mut Self, usize) -> Result<Option<()>, cm_core::CmError>,
    ) -> bool {
        let mut more = false;
        for index in 0..self.devices.len() {
            let mut handled = 0;
            // A handler may close a device (DEVICE_FATAL): the list can shrink.
            while index < self.devices.len() {
                if handled == PASS_BATCH {
                    more = true;
                    break;
                }
                match read_one(self, index) {
                    Ok(Some(())) => handled += 1,
                    Ok(None) => break,
                    Err(error) => {
                        failed.push((self.device_keys[index], error));
                        break;
                    }
                }
            }
        }
        more
    }

    /// Sets up at most [`PASS_BATCH`] of the requests read from the CM channel, oldest
    /// first, reading the channel again after each: a setup costs system calls (QP,
    /// queues, registration) while requests keep arriving, and one the kernel holds
    /// unread counts against the listen backlog. Whether more are waiting.
    fn set_up_requests(&mut self, first_error: &mut Option<cm_core::CmError>) -> bool {
        for _ in 0..PASS_BATCH {
            let Some(conn) = self.to_set_up.pop_front() else {
                return false;
            };
            self.set_up_request(conn);
            self.read_cm_events(first_error, &mut |_| false);
        }
        !self.to_set_up.is_empty()
    }

    /// Reads at most [`PASS_BATCH`] CM events outside a pass, after work long enough
    /// for requests to pile up in the kernel's listen backlog (past it the kernel drops
    /// a REQ unanswered). A read error is left for the next pass, which meets it again.
    pub(super) fn read_cm_ahead(&mut self) {
        let mut first_error = None;
        self.read_cm_events(&mut first_error, &mut |_| false);
        if let Some(error) = first_error {
            tracing::debug!("reading the CM channel after a setup: {error}");
        }
    }

    /// Reads at most [`PASS_BATCH`] CM events, stopping after the one for which
    /// `answered` is true; whether more may be waiting (the batch was full, or the read
    /// stopped early). The first error is kept in `first_error` and ends the read,
    /// except ENOMEM, which is transient: librdmacm could not allocate the event's copy
    /// and the kernel keeps the event, so the read stops and is retried next pass.
    /// Connections that end meanwhile keep their ids for the end of the pass.
    fn read_cm_events(
        &mut self,
        first_error: &mut Option<cm_core::CmError>,
        answered: &mut dyn FnMut(&mut Self) -> bool,
    ) -> bool {
        self.reading_cm = true;
        self.cm_batch_full = false;
        let more = self.read_cm_batch(first_error, answered);
        self.reading_cm = false;
        more
    }

    fn read_cm_batch(
        &mut self,
        first_error: &mut Option<cm_core::CmError>,
        answered: &mut dyn FnMut(&mut Self) -> bool,
    ) -> bool {
        for _ in 0..PASS_BATCH {
            match self.transport.next_cm_event() {
                Ok(Some(event)) => {
                    self.on_cm_event(event);
                    if answered(self) {
                        return true;
                    }
                }
                Ok(None) => return false,
                Err(error) if error.errno() == cm_core::errno::ENOMEM => {
                    // "More": the next pass reads again without waiting, as a
                    // reactor that already reported the channel readable will not
                    // report it again for the same event.
                    tracing::warn!("reading the CM channel: {error}; retried next pass");
                    return true;
                }
                Err(error) => {
                    first_error.get_or_insert(error);
                    return false;
                }
            }
        }
        self.cm_batch_full = true;
        true
    }
}

/// Busy polling's budget within one wait: spin until `budget` has passed on the
/// transport's clock. A clock that does not move while spinning (a simulation's
/// virtual time) ends the spin after a few rounds.
struct Spin {
    until: Option<Duration>,
    last: Duration,
    still: u32,
}

impl Spin {
    /// Rounds without the clock moving before the spin gives up.
    const STILL_ROUNDS: u32 = 64;
    /// Every how many rounds the spin looks at every source (the others poll the
    /// receive queues of the accepted connections only).
    const LOOK_EVERY: u32 = 8;

    fn new(budget: Option<Duration>, now: Duration) -> Self {
        Spin {
            until: budget.map(|b| now.saturating_add(b)),
            last: now,
            still: 0,
        }
    }

    fn keep_spinning(&mut self, now: Duration) -> bool {
        let Some(until) = self.until else {
            return false;
        };
        if now == self.last {
            self.still += 1;
        } else {
            self.last = now;
            self.still = 0;
        }
        now < until && self.still < Self::STILL_ROUNDS
    }
}

/// The calls an application drives the endpoint with: a pass, or a wait for what it
/// asks.
impl<T: Transport> Endpoint<T> {
    /// Handles what is ready now (one bounded pass, see [`PASS_BATCH`]), without
    /// waiting, and returns the oldest thing to report, if any. O(1) per event handled.
    pub fn poll(&mut self) -> Result<Option<Event>, ConnError> {
        self.process()?;
        Ok(self.try_next_event())
    }

    /// The next event, waiting at most `timeout` (`None`: as long as it takes). As
    /// every waiting call: [`ConnError::Timeout`] when the timeout passed,
    /// [`ConnError::Woken`] when an [`EndpointWaker`] ended the wait. Events come in
    /// order per connection; connections with something to report take turns. O(1)
    /// amortised. On the simulated fabric, a wait with no timeout when nothing is
    /// pending at all (no message, event or timer) answers
    /// [`CmError::Idle`](crate::CmError::Idle) at once instead of hanging.
    pub fn next_event(&mut self, timeout: Option<Duration>) -> Result<Event, ConnError> {
        self.wait_for(timeout, |ep| ep.try_next_event().map(Ok))
    }

    /// A handle that wakes this endpoint's waiting call from another thread (see
    /// [`EndpointWaker`]). The real transport makes its wake-up socket on the first
    /// call. O(1).
    pub fn waker(&mut self) -> Result<EndpointWaker, ConnError> {
        Ok(EndpointWaker {
            woken: Arc::clone(&self.woken),
            transport: self.transport.waker()?,
        })
    }

    /// Waits for the next accepted connection to be established (on any listener) and
    /// returns it; its [`Event::Established`] is consumed, nothing else is. Ends with
    /// [`ConnError::Timeout`], or [`ConnError::ListenerClosed`] when a listener ended
    /// (its device was removed) and no established connection is waiting. O(1)
    /// amortised.
    pub fn accept(&mut self, timeout: Option<Duration>) -> Result<ConnectionId, ConnError> {
        self.wait_for(timeout, Self::try_accept)
    }

    /// Waits for `conn` to be established (after [`Endpoint::connect`] or an accept)
    /// and says how it got there; its [`Event::Established`] is consumed (asking again
    /// answers the same from the connection's state). Ends with [`ConnError::Closed`]
    /// if it failed; answers at once with [`ConnError::UnknownConnection`] for a handle
    /// that names nothing. O(1).
    pub fn established(
        &mut self,
        conn: ConnectionId,
        timeout: Option<Duration>,
    ) -> Result<EstablishedVia, ConnError> {
        if let Some(answer) = self.try_established(conn) {
            return answer;
        }
        self.wait_for(timeout, |ep| ep.try_established(conn))
    }

    /// Waits for the next message on `conn` (taking it posts its receive again);
    /// nothing else is consumed except the connection's [`Event::Established`]. After
    /// the last message of a connection that closed, answers [`ConnError::Closed`]
    /// once, then [`ConnError::UnknownConnection`]: both at once, never a wait. O(1).
    pub fn recv(
        &mut self,
        conn: ConnectionId,
        timeout: Option<Duration>,
    ) -> Result<Vec<u8>, ConnError> {
        if let Some(answer) = self.try_recv(conn) {
            return answer;
        }
        self.wait_for(timeout, |ep| ep.try_recv(conn))
    }
}
