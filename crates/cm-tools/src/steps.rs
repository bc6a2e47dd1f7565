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
/// since the transport was created). Compact (two nanosecond counts): a run keeps one
/// per step of every connection, a million connections included.
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
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let done: Vec<(Duration, Duration)> = spans
            .iter()
            .filter_map(|s| Some((s.start()?, s.end()?)))
            .collect();
        let mut stats = StepStats {
            step,
            count: done.len(),
            ..StepStats::default()
        };
        if done.is_empty() {
            return stats;
        }
        let first = done.iter().map(|d| d.0).min().expect("non-empty");
        let last = done.iter().map(|d| d.1).max().expect("non-empty");
        let per_conn: Vec<u64> = done
            .iter()
            .map(|(start, end)| micros(end.saturating_sub(*start)))
            .collect();
        let connections = u64::from(connections.max(1));
        stats.total_us = micros(last.saturating_sub(first));
        stats.avg_per_conn_us = stats.total_us / connections;
        stats.sum_us = per_conn.iter().sum();
        stats.us_per_conn = stats.sum_us / connections;
        stats.max_us = per_conn.iter().copied().max().unwrap_or(0);
        stats.min_us = per_conn.iter().copied().min().unwrap_or(0);
        stats
    }
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
