//! The state behind the handles' lock: the endpoint, who waits on what, and the
//! listeners' queues of established connections (and, on a listener that does not
//! accept by itself, of requests). Every operation here is O(1)
//! (amortised) in the number of connections and of waiting calls, except the wake-up of
//! every waiting call when the endpoint ends.
//!
//! Waiters are bounded by live calls: each waiting call registers under its own number
//! ([`Core::new_call`]) and its entry goes when the call answers, times out or is
//! dropped ([`Core::end_call`]), or when news wakes it (it registers again if it waits
//! on).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::task::Waker;
use std::time::Duration;

use rustc_hash::{FxHashMap, FxHashSet};

use cm_core::{CmError, Transport};

use crate::{
    CloseReason, ConnError, ConnState, ConnectOptions, ConnectionId, Endpoint, EstablishedVia,
    Event, ListenOptions, ListenerId, PrivateData, ENDPOINT_EVENT_BACKLOG,
};

use super::pacing::Pacing;
use super::HandleStats;

/// The calls waiting on one thing, each under its number: a handful per connection.
type Waiters = Vec<(u64, Waker)>;

/// Wakes every call in `waiters` and forgets them; how many there were.
fn wake_waiters(waiters: &mut Waiters) -> usize {
    let woken = waiters.len();
    waiters.drain(..).for_each(|(_, waker)| waker.wake());
    woken
}

/// What a waiting call waits on.
#[derive(Debug, Clone, Copy)]
pub(super) enum WaitOn {
    /// News of one connection (a message, its establishment, a free send buffer, its
    /// end).
    Conn(ConnectionId),
    /// A listener's next established connection, or its end.
    Listener(ListenerId),
    /// A manual listener's next request, or its end.
    Requests(ListenerId),
}

/// A listener's connections established and not yet accepted, or (manual accept) its
/// requests not yet taken.
struct Accepting {
    queue: VecDeque<ConnectionId>,
    /// At most this many wait in `queue`.
    bound: usize,
    /// Why it ended, once it did (its device went away).
    ended: Option<CloseReason>,
    waiters: Waiters,
    /// Its requests wait for the application's answer (`auto_accept` off).
    manual: bool,
    /// Requests not yet taken, oldest first; an entry no longer in
    /// [`Core::queued_requests`] is stale (it closed and was freed) and skipped. The
    /// endpoint bounds the live ones (`max_in_setup`, `request_timeout`).
    requests: VecDeque<ConnectionId>,
    request_waiters: Waiters,
}

/// A request taken from its listener's queue, held for the application's answer.
pub(super) struct TakenRequest<A> {
    pub(super) conn: ConnectionId,
    pub(super) private_data: PrivateData,
    pub(super) peer_addr: Option<A>,
}

/// An accepted connection as `accept` hands it out: how it was established and the
/// peer's private data.
pub(super) type Accepted = (ConnectionId, Option<EstablishedVia>, Option<PrivateData>);

pub(super) struct Core<T: Transport> {
    endpoint: Endpoint<T>,
    /// The calls waiting on each connection's news.
    conn_waiters: FxHashMap<ConnectionId, Waiters>,
    /// Entries in `conn_waiters` and the listeners' waiters together.
    registered: usize,
    /// The last number given to a waiting call.
    last_call: u64,
    listeners: FxHashMap<ListenerId, Accepting>,
    /// Connections a handle holds (a request taken included), or queued for `accept`:
    /// the others are freed as soon as they close (nobody would take their end).
    held: FxHashSet<ConnectionId>,
    /// Requests in a listener's queue, not yet taken.
    queued_requests: FxHashSet<ConnectionId>,
    /// Blocking calls' deadlines (transport time); an entry whose waker is gone is
    /// stale.
    timers: BinaryHeap<Reverse<(Duration, u64)>>,
    timer_wakers: FxHashMap<u64, Waker>,
    next_timer: u64,
    /// Endpoint-wide events for [`super::EndpointHandle::endpoint_event`].
    endpoint_events: VecDeque<Event>,
    accepts_refused: u64,
    /// The endpoint's own failure: every call answers it.
    failed: Option<CmError>,
    /// What the driver and the calls tell each other ([`Pacing`]).
    pacing: Pacing,
}

impl<T: Transport> Core<T> {
    pub(super) fn new(endpoint: Endpoint<T>, virtual_time: bool) -> Self {
        Core {
            endpoint,
            conn_waiters: FxHashMap::default(),
            registered: 0,
            last_call: 0,
            listeners: FxHashMap::default(),
            held: FxHashSet::default(),
            queued_requests: FxHashSet::default(),
            timers: BinaryHeap::new(),
            timer_wakers: FxHashMap::default(),
            next_timer: 0,
            endpoint_events: VecDeque::new(),
            accepts_refused: 0,
            failed: None,
            pacing: Pacing::new(virtual_time),
        }
    }

    pub(super) fn endpoint(&self) -> &Endpoint<T> {
        &self.endpoint
    }

    pub(super) fn endpoint_mut(&mut self) -> &mut Endpoint<T> {
        &mut self.endpoint
    }

    pub(super) fn now(&self) -> Duration {
        self.endpoint.transport().now()
    }

    pub(super) fn virtual_time(&self) -> bool {
        self.pacing.virtual_time()
    }

    /// Notes that a call may have changed what the driver waits on; whether the thread
    /// driver sleeping on an idle simulation must be woken (see [`Pacing::poke`]).
    pub(super) fn poke(&mut self) -> bool {
        let devices = self.endpoint.device_count();
        let next_due = self.next_due();
        self.pacing.poke(devices, next_due)
    }

    /// The driver is about to wait; returns how long until the earliest deadline
    /// (`None`: no deadline).
    pub(super) fn begin_wait(&mut self) -> Option<Duration> {
        let next_due = self.next_due();
        self.pacing
            .begin_wait(self.endpoint.device_count(), next_due);
        next_due.map(|due| due.saturating_sub(self.now()))
    }

    /// The driver and the calls' shared state, for the driver.
    pub(super) fn pacing(&mut self) -> &mut Pacing {
        &mut self.pacing
    }

    pub(super) fn stop(&mut self) {
        self.pacing.stop();
    }

    pub(super) fn stopped(&self) -> bool {
        self.pacing.stopped()
    }

    /// Whether the endpoint itself failed.
    pub(super) fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// The driver's count of idle findings, for a call that starts waiting.
    pub(super) fn idle_epoch(&self) -> u64 {
        self.pacing.idle_epoch()
    }

    /// Why a call waiting since idle epoch `since` cannot be answered, if it cannot:
    /// the endpoint failed, or nothing could happen anywhere since it began.
    pub(super) fn stop_reason(&self, since: u64) -> Option<ConnError> {
        if let Some(error) = &self.failed {
            return Some(ConnError::Endpoint(error.clone()));
        }
        self.pacing
            .idle_since(since)
            .then_some(ConnError::Cm(CmError::Idle {
                op: "wait on the simulated fabric",
            }))
    }

    /// A number for a call that starts waiting.
    pub(super) fn new_call(&mut self) -> u64 {
        self.last_call += 1;
        self.last_call
    }

    /// Call `call` waits on `on` with `waker`: one entry per call, its waker replaced
    /// if it changed (a future moved to another task).
    pub(super) fn register(&mut self, on: WaitOn, call: u64, waker: &Waker) {
        let waiters = match on {
            WaitOn::Conn(conn) => self.conn_waiters.entry(conn).or_default(),
            WaitOn::Listener(listener) => match self.listeners.get_mut(&listener) {
                Some(accepting) => &mut accepting.waiters,
                None => return,
            },
            WaitOn::Requests(listener) => match self.listeners.get_mut(&listener) {
                Some(accepting) => &mut accepting.request_waiters,
                None => return,
            },
        };
        match waiters.iter_mut().find(|(c, _)| *c == call) {
            Some((_, known)) => {
                if !known.will_wake(waker) {
                    known.clone_from(waker);
                }
            }
            None => {
                waiters.push((call, waker.clone()));
                self.registered += 1;
            }
        }
    }

    /// Call `call` is over (answered, timed out or dropped): its entry and its timer
    /// go.
    pub(super) fn end_call(&mut self, on: WaitOn, call: u64, timer: Option<u64>) {
        if let Some(timer) = timer {
            self.remove_timer(timer);
        }
        let waiters = match on {
            WaitOn::Conn(conn) => self.conn_waiters.get_mut(&conn),
            WaitOn::Listener(listener) => self.listeners.get_mut(&listener).map(|a| &mut a.waiters),
            WaitOn::Requests(listener) => self
                .listeners
                .get_mut(&listener)
                .map(|a| &mut a.request_waiters),
        };
        let Some(waiters) = waiters else {
            return;
        };
        if let Some(at) = waiters.iter().position(|(c, _)| *c == call) {
            waiters.swap_remove(at);
            self.registered -= 1;
        }
        if let (WaitOn::Conn(conn), true) = (on, waiters.is_empty()) {
            self.conn_waiters.remove(&conn);
        }
    }

    /// Wakes (and forgets) every call waiting on `conn`.
    fn wake_conn(&mut self, conn: ConnectionId) -> bool {
        let Some(mut waiters) = self.conn_waiters.remove(&conn) else {
            return false;
        };
        self.registered -= wake_waiters(&mut waiters);
        true
    }

    /// What the handles hold and wait on, for monitoring and tests. O(listeners).
    pub(super) fn stats(&self) -> HandleStats {
        HandleStats {
            waiting_calls: self.registered,
            timers: self.timer_wakers.len(),
            held_connections: self.held.len(),
            accept_queued: self.listeners.values().map(|a| a.queue.len()).sum(),
            requests_queued: self.queued_requests.len(),
        }
    }

    pub(super) fn add_timer(&mut self, due: Duration, waker: Waker) -> u64 {
        self.next_timer += 1;
        let timer = self.next_timer;
        self.timers.push(Reverse((due, timer)));
        self.timer_wakers.insert(timer, waker);
        timer
    }

    pub(super) fn remove_timer(&mut self, timer: u64) {
        self.timer_wakers.remove(&timer);
        // Stale entries go once they outnumber the live ones.
        if self.timers.len() > 2 * self.timer_wakers.len() + 64 {
            let wakers = &self.timer_wakers;
            self.timers.retain(|Reverse((_, t))| wakers.contains_key(t));
        }
    }

    /// The earliest of the endpoint's deadlines and the waiting calls'.
    pub(super) fn next_due(&mut self) -> Option<Duration> {
        while let Some(Reverse((_, timer))) = self.timers.peek() {
            if self.timer_wakers.contains_key(timer) {
                break;
            }
            self.timers.pop();
        }
        let timer = self.timers.peek().map(|Reverse((due, _))| *due);
        [timer, self.endpoint.next_deadline()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Wakes the waiting calls whose deadline passed.
    fn expire_timers(&mut self) {
        let now = self.now();
        while let Some(&Reverse((due, timer))) = self.timers.peek() {
            if due > now {
                break;
            }
            self.timers.pop();
            if let Some(waker) = self.timer_wakers.remove(&timer) {
                waker.wake();
            }
        }
    }

    /// One pass of the endpoint, then the news routed to who waits for it; whether a
    /// source had more than a pass reads.
    pub(super) fn pass(&mut self) -> bool {
        let more = match self.endpoint.process_pass() {
            Ok(more) => more,
            Err(ConnError::Endpoint(error)) => {
                self.fail(error);
                return false;
            }
            Err(error) => {
                tracing::warn!("endpoint pass: {error}");
                false
            }
        };
        self.route();
        self.expire_timers();
        more
    }

    /// The endpoint cannot go on: every waiting call is told.
    pub(super) fn fail(&mut self, error: CmError) {
        tracing::error!("the endpoint ended: {error}");
        self.failed = Some(error);
        self.wake_all();
    }

    /// Nothing can happen on the simulated fabric: waiting calls answer `Idle` until a
    /// call moves something.
    pub(super) fn set_idle(&mut self) {
        self.pacing.went_idle();
        self.wake_all();
    }

    /// Wakes every waiting call: O(waiting calls), only when the endpoint ends or goes
    /// idle.
    fn wake_all(&mut self) {
        for (_, mut waiters) in self.conn_waiters.drain() {
            wake_waiters(&mut waiters);
        }
        for accepting in self.listeners.values_mut() {
            wake_waiters(&mut accepting.waiters);
            wake_waiters(&mut accepting.request_waiters);
        }
        self.registered = 0;
        for (_, waker) in self.timer_wakers.drain() {
            waker.wake();
        }
        self.timers.clear();
    }

    /// Routes what the pass produced: established connections to their listener's
    /// queue, requests to their manual listener's, news to the calls waiting on their
    /// connection, endpoint-wide events to their queue. O(1) per item.
    fn route(&mut self) {
        while let Some(accepted) = self.endpoint.try_accept() {
            self.pacing.note_routed();
            match accepted {
                Ok(conn) => self.queue_accepted(conn),
                Err(ConnError::ListenerClosed { listener, reason }) => {
                    self.listener_ended(listener, reason);
                }
                Err(_) => {}
            }
        }
        while let Some(ready) = self.endpoint.take_ready() {
            self.pacing.note_routed();
            match ready {
                Ok(conn) => {
                    if self.wake_conn(conn) || self.held.contains(&conn) {
                        continue;
                    }
                    if self.endpoint.is_closed(conn) {
                        // Closed before anyone held it (a connection in setup, a request
                        // not yet taken that timed out): its queue entry goes stale.
                        self.queued_requests.remove(&conn);
                        let _ = self.endpoint.disconnect(conn);
                    } else {
                        self.queue_request(conn);
                    }
                }
                Err(Event::ListenerClosed { listener, reason }) => {
                    self.listener_ended(listener, reason);
                }
                Err(event) => {
                    if self.endpoint_events.len() >= ENDPOINT_EVENT_BACKLOG {
                        self.endpoint_events.pop_front();
                    }
                    self.endpoint_events.push_back(event);
                }
            }
        }
    }

    /// An established passive connection goes to its listener's queue for `accept`,
    /// whether it is still up or closed since (in the same pass: a client that
    /// connects, sends and leaves at once), as TCP's `accept` returns a connection
    /// whose peer has gone: its messages, then its close, are read from it.
    fn queue_accepted(&mut self, conn: ConnectionId) {
        if self.held.contains(&conn) {
            // A request's `accept` handed it out already: its `Connection` hears of it,
            // and no second handle is made.
            return;
        }
        let accepting = self
            .endpoint
            .listener_of(conn)
            .and_then(|listener| self.listeners.get_mut(&listener));
        let Some(accepting) = accepting else {
            tracing::debug!("{conn}: its listener is gone, disconnected");
            self.refuse(conn);
            return;
        };
        if accepting.queue.len() >= accepting.bound {
            tracing::warn!("{conn}: its listener's accept queue is full, disconnected");
            self.refuse(conn);
            return;
        }
        accepting.queue.push_back(conn);
        self.registered -= wake_waiters(&mut accepting.waiters);
        self.hold(conn);
    }

    /// A live connection with news that nobody holds or waits on: on a manual listener,
    /// a request (nothing else of it is unheld and live), queued for `next_request`.
    fn queue_request(&mut self, conn: ConnectionId) {
        let Some(listener) = self.endpoint.listener_of(conn) else {
            return;
        };
        let Some(accepting) = self.listeners.get_mut(&listener).filter(|a| a.manual) else {
            return;
        };
        if !self.queued_requests.insert(conn) {
            return;
        }
        accepting.requests.push_back(conn);
        // Stale entries go once they outnumber the live ones (of every listener).
        let queued = &self.queued_requests;
        if accepting.requests.len() > 2 * queued.len() + 64 {
            accepting.requests.retain(|c| queued.contains(c));
        }
        self.registered -= wake_waiters(&mut accepting.request_waiters);
    }

    /// An established connection nobody will accept: disconnected, and counted.
    fn refuse(&mut self, conn: ConnectionId) {
        self.accepts_refused += 1;
        let _ = self.endpoint.disconnect(conn);
    }

    /// A handle holds `conn` (or its listener's queue does): its close is kept for it.
    fn hold(&mut self, conn: ConnectionId) {
        self.held.insert(conn);
        self.endpoint.hold(conn, true);
    }

    /// Whether `conn` was held; it is not any more.
    fn unhold(&mut self, conn: ConnectionId) -> bool {
        self.endpoint.hold(conn, false);
        self.held.remove(&conn)
    }

    fn listener_ended(&mut self, listener: ListenerId, reason: CloseReason) {
        if let Some(accepting) = self.listeners.get_mut(&listener) {
            accepting.ended = Some(reason);
            self.registered -= wake_waiters(&mut accepting.waiters);
            self.registered -= wake_waiters(&mut accepting.request_waiters);
        }
    }

    pub(super) fn listen(
        &mut self,
        addr: T::Addr,
        options: ListenOptions,
        bound: u32,
    ) -> Result<ListenerId, ConnError> {
        let manual = !options.auto_accept;
        let listener = self.endpoint.listen(addr, options)?;
        self.listeners.insert(
            listener,
            Accepting {
                queue: VecDeque::new(),
                bound: bound.max(1) as usize,
                ended: None,
                waiters: Vec::new(),
                manual,
                requests: VecDeque::new(),
                request_waiters: Vec::new(),
            },
        );
        Ok(listener)
    }

    pub(super) fn connect(
        &mut self,
        dst: T::Addr,
        options: ConnectOptions<T::Addr>,
    ) -> Result<ConnectionId, ConnError> {
        if options.application_qp {
            // Its RouteResolved would wait for a call no handle makes.
            return Err(ConnError::InvalidOptions(
                "a connection over the application's QP is made on the Endpoint \
                 (Event::RouteResolved, Endpoint::connect_application_qp)",
            ));
        }
        let conn = self.endpoint.connect(dst, options)?;
        self.hold(conn);
        Ok(conn)
    }

    /// For `accept`: the listener's next connection with how it was established and
    /// the peer's private data, or the listener's end.
    pub(super) fn try_accept(
        &mut self,
        listener: ListenerId,
    ) -> Option<Result<Accepted, ConnError>> {
        let Some(accepting) = self.listeners.get_mut(&listener) else {
            return Some(Err(ConnError::UnknownListener(listener)));
        };
        if accepting.manual {
            return Some(Err(ConnError::InvalidOptions(
                "this listener's requests wait for an answer: take them with next_request",
            )));
        }
        if let Some(conn) = accepting.queue.pop_front() {
            let via = self.endpoint.established_via(conn);
            return Some(Ok((conn, via, self.endpoint.peer_private_data(conn))));
        }
        accepting
            .ended
            .clone()
            .map(|reason| Err(ConnError::ListenerClosed { listener, reason }))
    }

    /// For `next_request`: the listener's oldest request not yet taken, held from now
    /// on for the application's answer, or the listener's end. Requests that closed
    /// since they were queued (timed out, the peer gave up) are skipped.
    pub(super) fn try_request(
        &mut self,
        listener: ListenerId,
    ) -> Option<Result<TakenRequest<T::Addr>, ConnError>> {
        loop {
            let Some(accepting) = self.listeners.get_mut(&listener) else {
                return Some(Err(ConnError::UnknownListener(listener)));
            };
            if !accepting.manual {
                return Some(Err(ConnError::InvalidOptions(
                    "this listener accepts by itself (auto_accept): take connections with accept",
                )));
            }
            let Some(conn) = accepting.requests.pop_front() else {
                let reason = accepting.ended.clone()?;
                return Some(Err(ConnError::ListenerClosed { listener, reason }));
            };
            if !self.queued_requests.remove(&conn) {
                continue;
            }
            match self.endpoint.info(conn) {
                Ok(info) if info.state == ConnState::Requested => {
                    self.hold(conn);
                    return Some(Ok(TakenRequest {
                        conn,
                        private_data: self.endpoint.peer_private_data(conn).unwrap_or_default(),
                        peer_addr: info.peer_addr,
                    }));
                }
                // Closed and not yet routed: nobody will take its end.
                Err(ConnError::Closed { .. }) => {
                    let _ = self.endpoint.disconnect(conn);
                }
                _ => {}
            }
        }
    }

    /// `Request::accept`: the REP goes with `private_data`, and the connection stays
    /// held (a `Connection` takes it over). If it cannot go, the request is rejected
    /// and freed (the peer is not left waiting), and the error returned.
    pub(super) fn accept_request(
        &mut self,
        conn: ConnectionId,
        private_data: &PrivateData,
    ) -> Result<(), ConnError> {
        let accepted = self.endpoint.accept_request(conn, private_data);
        if accepted.is_err() {
            self.drop_request(conn);
        }
        accepted
    }

    /// `Request::reject`: the REJ goes with `private_data`; if it cannot go (too much
    /// data), with none. Nothing of the request is left.
    pub(super) fn reject_request(
        &mut self,
        conn: ConnectionId,
        private_data: &PrivateData,
    ) -> Result<(), ConnError> {
        let rejected = self.endpoint.reject_request(conn, private_data);
        self.drop_request(conn);
        rejected
    }

    /// A request dropped unanswered (or whose answer failed): rejected with no private
    /// data if it still can be, and freed, closed or not.
    pub(super) fn drop_request(&mut self, conn: ConnectionId) {
        let _ = self.endpoint.reject_request(conn, &PrivateData::empty());
        self.unhold(conn);
        // A request that closed meanwhile (timed out) keeps its record until now.
        let _ = self.endpoint.disconnect(conn);
    }

    /// For `send`: sent, refused for good, or every buffer in flight (`None`: wait).
    pub(super) fn try_send(
        &mut self,
        conn: ConnectionId,
        data: &[u8],
    ) -> Option<Result<(), ConnError>> {
        match self.endpoint.send(conn, data) {
            Err(ConnError::SendQueueFull(_)) => None,
            answer => Some(answer),
        }
    }

    /// The listener's handle is gone: it stops listening, the connections it had
    /// established and not handed out are disconnected, and its requests not yet taken
    /// rejected. Requests taken already stay with their `Request`.
    pub(super) fn close_listener(&mut self, listener: ListenerId) {
        if let Some(accepting) = self.listeners.remove(&listener) {
            self.registered -= accepting.waiters.len() + accepting.request_waiters.len();
            for conn in accepting.queue {
                self.unhold(conn);
                self.refuse(conn);
            }
            // Requests not yet taken are answered now, not left to their timeout.
            for conn in accepting.requests {
                if self.queued_requests.remove(&conn) {
                    self.drop_request(conn);
                }
            }
        }
        // Already closed when its device went away.
        let _ = self.endpoint.close_listener(listener);
    }

    /// The last handle of `conn` is gone.
    pub(super) fn release(&mut self, conn: ConnectionId) {
        self.wake_conn(conn);
        if self.unhold(conn) {
            // What it sent is still delivered, then the DREQ.
            let _ = self.endpoint.close_gracefully(conn);
        }
    }

    /// `Connection::close`: disconnects once its sends completed; the other clones'
    /// calls are told.
    pub(super) fn close(&mut self, conn: ConnectionId) -> Result<(), ConnError> {
        self.unhold(conn);
        self.wake_conn(conn);
        self.endpoint.close_gracefully(conn)
    }

    /// `Connection::abort`: disconnects now; the other clones' calls are told.
    pub(super) fn disconnect(&mut self, conn: ConnectionId) -> Result<(), ConnError> {
        self.unhold(conn);
        self.wake_conn(conn);
        self.endpoint.disconnect(conn)
    }

    pub(super) fn take_endpoint_event(&mut self) -> Option<Event> {
        self.endpoint_events.pop_front()
    }

    pub(super) fn accepts_refused(&self) -> u64 {
        self.accepts_refused
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    use cm_mock::sim::{SimConfig, SimTransports};

    use super::{Core, WaitOn};
    use crate::{ConnectOptions, ConnectionId, Endpoint, Event, ListenOptions};

    /// Counts its wake-ups.
    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// News of one connection wakes the call waiting on it and no other, however many
    /// wait: the work per event does not grow with the waiting calls.
    #[test]
    fn news_wakes_only_the_calls_waiting_on_its_connection() {
        const CONNECTIONS: usize = 200;
        let SimTransports {
            fabric,
            server,
            client,
        } = SimTransports::new(SimConfig::default(), 7);
        let mut server = Endpoint::new(server);
        let mut client = Endpoint::new(client);
        let addr = server.transport().addr(7471);
        server.listen(addr, ListenOptions::default()).unwrap();
        let outs: Vec<ConnectionId> = (0..CONNECTIONS)
            .map(|_| client.connect(addr, ConnectOptions::default()).unwrap())
            .collect();
        let mut accepted = Vec::new();
        loop {
            while let Some(event) = server.poll().unwrap() {
                if let Event::Established { conn, .. } = event {
                    accepted.push(conn);
                }
            }
            while client.poll().unwrap().is_some() {}
            if !fabric.step() {
                break;
            }
        }
        assert_eq!(accepted.len(), CONNECTIONS);
        let mut core = Core::new(server, true);
        let counters: Vec<Arc<Counting>> = accepted
            .iter()
            .map(|&conn| {
                let counter = Arc::new(Counting(AtomicUsize::new(0)));
                let call = core.new_call();
                core.register(WaitOn::Conn(conn), call, &Waker::from(Arc::clone(&counter)));
                counter
            })
            .collect();
        client.send(outs[CONNECTIONS / 2], b"news").unwrap();
        while fabric.step() {}
        while core.pass() {}
        let woken: Vec<usize> = counters
            .iter()
            .enumerate()
            .filter(|(_, c)| c.0.load(Ordering::SeqCst) > 0)
            .map(|(n, _)| n)
            .collect();
        assert_eq!(woken.len(), 1, "one connection had news: {woken:?}");
        let conn = accepted[woken[0]];
        let message = core.endpoint_mut().try_recv(conn);
        assert_eq!(message, Some(Ok(b"news".to_vec())));
    }
}
