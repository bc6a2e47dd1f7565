//! The timed steps of a connection's life, cmtime style: when each began and ended, and
//! the summary of one step over every connection. Both transports' runs record them.

use std::time::Duration;

use serde::Serialize;

/// The timed steps of a connection, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Client: `rdma_resolve_addr` to ADDR_RESOLVED (the successful attempt).
    ResolveAddr,
    /// Client: `rdma_resolve_route` to ROUTE_RESOLVED.
    ResolveRoute,
    /// `rdma_create_qp`.
    CreateQp,
    /// The `rdma_connect` (client) or `rdma_accept` (server) call.
    Connect,
    /// From the return of the connect/accept call until the connection is established
    /// (ESTABLISHED, or the notify that forced it).
    Established,
    /// From ESTABLISHED until this side's messages are sent and as many received.
    Exchange,
    /// On the side that disconnects: the disconnect call, after which the connection
    /// counts as closed (the side disconnected by its peer records none).
    Disconnect,
}

impl Step {
    /// Every step, in order.
    pub const ALL: [Step; 7] = [
        Step::ResolveAddr,
        Step::ResolveRoute,
        Step::CreateQp,
        Step::Connect,
        Step::Established,
        Step::Exchange,
        Step::Disconnect,
    ];

    /// The step's name in the table and the JSON.
    pub const fn name(self, server: bool) -> &'static str {
        match self {
            Step::ResolveAddr => "resolve_addr",
            Step::ResolveRoute => "resolve_route",
            Step::CreateQp => "create_qp",
            Step::Connect if server => "accept",
            Step::Connect => "connect",
            Step::Established => "established",
            Step::Exchange => "exchange",
            Step::Disconnect => "disconnect",
        }
    }

    pub(crate) const fn index(self) -> usize {
        self as usize
    }
}

/// When one step of one connection started and ended, on the endpoint's clock (time
/// since the transport was created). Compact (two nanosecond counts). A run sums each
/// step up over its connections ([`StepTotals`]) and keeps the spans of its first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    start: u64,
    end: u64,
}

impl Default for Span {
    fn default() -> Self {
        Span {
            start: Span::UNSET,
            end: Span::UNSET,
        }
    }
}

impl Span {
    /// An instant not recorded.
    const UNSET: u64 = u64::MAX;

    /// A span from `start` to `end`, either possibly unknown.
    pub fn between(start: Option<Duration>, end: Option<Duration>) -> Self {
        let mut span = Span::default();
        if let Some(start) = start {
            span.begin(start);
        }
        if let Some(end) = end {
            span.finish(end);
        }
        span
    }

    /// Notes the start (the first one counts).
    pub fn begin(&mut self, at: Duration) {
        if self.start == Span::UNSET {
            self.start = nanos(at);
        }
    }

    /// Notes the end (the first one after a start counts).
    pub fn finish(&mut self, at: Duration) {
        if self.start != Span::UNSET && self.end == Span::UNSET {
            self.end = nanos(at);
        }
    }

    /// The start, once noted.
    pub fn start(&self) -> Option<Duration> {
        (self.start != Span::UNSET).then(|| Duration::from_nanos(self.start))
    }

    /// The end, once noted.
    pub fn end(&self) -> Option<Duration> {
        (self.end != Span::UNSET).then(|| Duration::from_nanos(self.end))
    }

    /// The duration, when the step both started and ended.
    pub fn duration(&self) -> Option<Duration> {
        Some(self.end()?.saturating_sub(self.start()?))
    }
}

/// `at` in nanoseconds, short of [`Span::UNSET`] (584 years of run time).
fn nanos(at: Duration) -> u64 {
    u64::try_from(at.as_nanos()).map_or(Span::UNSET - 1, |n| n.min(Span::UNSET - 1))
}

/// One step over all connections, as cmtime reports it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct StepStats {
    /// The step's name.
    pub step: &'static str,
    /// Connections that completed the step.
    pub count: usize,
    /// Wall time from the first start to the last end, µs.
    pub total_us: u64,
    /// `total_us` divided by the connections of the run (cmtime's "avg/conn").
    pub avg_per_conn_us: u64,
    /// Sum of the per-connection durations, µs.
    pub sum_us: u64,
    /// `sum_us` divided by the connections of the run (cmtime's "us/conn").
    pub us_per_conn: u64,
    /// Longest per-connection duration, µs.
    pub max_us: u64,
    /// Shortest per-connection duration, µs.
    pub min_us: u64,
}

impl StepStats {
    /// Summarises `spans` (one per connection that took part) over a run of
    /// `connections`.
    pub fn from_spans(step: &'static str, spans: &[Span], connections: u32) -> Self {
        let mut totals = StepTotals::default();
        for span in spans {
            if let (Some(start), Some(end)) = (span.start(), span.end()) {
                totals.add(start, end);
            }
        }
        totals.stats(step, connections)
    }
}

/// One step over every connection, summed up as the connections pass it: what
/// [`StepStats`] needs (count, first start, last end, sum, shortest, longest), so that a
/// run keeps a few numbers per step instead of a span per connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepTotals {
    count: usize,
    first_start: Option<Duration>,
    last_end: Option<Duration>,
    sum_us: u64,
    min_us: u64,
    max_us: u64,
}

impl StepTotals {
    /// Counts one connection that began the step at `start` and ended it at `end`.
    pub fn add(&mut self, start: Duration, end: Duration) {
        // Rounded per connection, as cmtime sums them.
        let us = micros(end.saturating_sub(start));
        self.min_us = if self.count == 0 {
            us
        } else {
            self.min_us.min(us)
        };
        self.max_us = self.max_us.max(us);
        self.sum_us = self.sum_us.saturating_add(us);
        self.count += 1;
        self.first_start = Some(self.first_start.map_or(start, |s| s.min(start)));
        self.last_end = Some(self.last_end.map_or(end, |e| e.max(end)));
    }

    /// Connections that completed the step.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Adds `other`'s connections, whose clock runs `shift` behind this one's (another
    /// endpoint's, made `shift` later).
    pub fn merge(&mut self, other: &StepTotals, shift: Duration) {
        if other.count == 0 {
            return;
        }
        self.min_us = if self.count == 0 {
            other.min_us
        } else {
            self.min_us.min(other.min_us)
        };
        self.max_us = self.max_us.max(other.max_us);
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
        self.count += other.count;
        let start = other.first_start.map(|s| s + shift);
        let end = other.last_end.map(|e| e + shift);
        self.first_start = match (self.first_start, start) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.last_end = match (self.last_end, end) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }

    /// The summary over a run of `connections`, named `step`.
    pub fn stats(&self, step: &'static str, connections: u32) -> StepStats {
        let (Some(first), Some(last)) = (self.first_start, self.last_end) else {
            return StepStats {
                step,
                ..StepStats::default()
            };
        };
        let connections = u64::from(connections.max(1));
        let total_us = micros(last.saturating_sub(first));
        StepStats {
            step,
            count: self.count,
            total_us,
            avg_per_conn_us: total_us / connections,
            sum_us: self.sum_us,
            us_per_conn: self.sum_us / connections,
            max_us: self.max_us,
            min_us: self.min_us,
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A span from `start_us` to `end_us` microseconds.
    pub(crate) fn span(start_us: u64, end_us: u64) -> Span {
        Span::between(
            Some(Duration::from_micros(start_us)),
            Some(Duration::from_micros(end_us)),
        )
    }

    #[test]
    fn step_stats_follow_cmtime() {
        let spans = [
            span(0, 100),
            span(50, 350),
            Span::default(),
            Span::between(Some(Duration::ZERO), None),
        ];
        let stats = StepStats::from_spans("connect", &spans, 4);
        assert_eq!(stats.count, 2);
        assert_eq!(stats.total_us, 350, "first start to last end");
        assert_eq!(stats.avg_per_conn_us, 350 / 4);
        assert_eq!(stats.sum_us, 400);
        assert_eq!(stats.us_per_conn, 100);
        assert_eq!((stats.max_us, stats.min_us), (300, 100));
    }

    #[test]
    fn totals_of_two_endpoints_merge_on_one_clock() {
        let us = Duration::from_micros;
        let mut first = StepTotals::default();
        first.add(us(0), us(100));
        let mut second = StepTotals::default();
        second.add(us(10), us(60)); // its clock starts 200 µs after the first's
        second.add(us(20), us(320));
        first.merge(&second, us(200));
        first.merge(&StepTotals::default(), us(999));
        let stats = first.stats("connect", 3);
        assert_eq!(stats.count, 3);
        assert_eq!(stats.total_us, 520, "0 to 320 + 200");
        assert_eq!(stats.sum_us, 100 + 50 + 300);
        assert_eq!((stats.max_us, stats.min_us), (300, 50));
        let mut empty = StepTotals::default();
        empty.merge(&second, us(0));
        assert_eq!(
            empty.stats("connect", 2).min_us,
            50,
            "an empty side takes the other's"
        );
    }

    #[test]
    fn a_step_nobody_completed_is_all_zeroes() {
        let stats = StepStats::from_spans("disconnect", &[Span::default()], 1);
        assert_eq!(
            stats,
            StepStats {
                step: "disconnect",
                ..StepStats::default()
            }
        );
    }

    #[test]
    fn spans_keep_their_first_start_and_end() {
        let base = Duration::from_secs(5);
        let mut s = Span::default();
        s.finish(base);
        assert_eq!(s.end(), None, "no end without a start");
        s.begin(base);
        s.begin(base + Duration::from_secs(1));
        s.finish(base + Duration::from_millis(3));
        s.finish(base + Duration::from_secs(2));
        assert_eq!(s.duration(), Some(Duration::from_millis(3)));
    }
}
