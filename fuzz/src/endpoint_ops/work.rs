//! The application's own one-sided work: posted on a connection's QP through
//! `Endpoint::cm_id` (the simulated transport's `post_one_sided`), its completions taken
//! with `take_work_completion`, each checked against what the side posted.
//!
//! What a side posted on a connection and has not taken yet is kept in posting order.
//! A completion taken is the oldest of those (so each completes once, in order, and
//! none was lost before it), carries [`APPLICATION_WR_ID`] (an endpoint message's
//! completion is never taken as work) and is the last one taken when it failed: a
//! failed one closes the connection. A close that a failed completion caused is
//! reported by `take_work_completion` only once that completion and every one before it
//! was taken. Work not taken by the time the close is reported never completes. While
//! the connection lives, what was posted comes: once the endpoint handled its inputs,
//! taking finds it.

use std::collections::VecDeque;

use cm_verbs::{
    CloseReason, CmError, ConnError, ConnState, ConnectionId, CqKind, QpErrorDetail, WcStatus,
    APPLICATION_WR_ID,
};

use super::world::World;
use super::Who;

/// Passes of `process` the endpoint gets to handle its inputs before work posted on a
/// live connection must have completed: each reads at most `PASS_BATCH` completion
/// events, and a run makes far fewer than this many of them.
const SETTLE_PASSES: usize = 32;

/// What a side did with one-sided work and sends on one connection.
#[derive(Debug, Default)]
pub(super) struct WorkLog {
    /// Work request ids posted and not yet taken, oldest first.
    pending: VecDeque<u64>,
    /// The failed completion taken, if one was: nothing is taken after it.
    failed: Option<WcStatus>,
    /// `take_work_completion` answered the close: nothing is taken after it.
    closed: bool,
    /// Pieces posted refused by the peer.
    refused: usize,
    /// Messages `send` accepted.
    pub(super) sends: u64,
    /// Sends reported completed by `Event::Sent`.
    pub(super) sent: u64,
}

impl World {
    /// The log of `who`'s work and sends on `conn`.
    pub(super) fn log(&mut self, who: Who, conn: ConnectionId) -> &mut WorkLog {
        self.side(who).work.entry(conn).or_default()
    }

    /// Posts up to `count` pieces of one-sided work on the connection `pick` chooses,
    /// while the work not taken stays within the connection's `work_depth`; the last
    /// one refused by the peer when `refused`.
    pub(super) fn post_work(&mut self, who: Who, pick: u8, count: u8, refused: bool, len: u8) {
        let Some(conn) = self.pick(who, pick) else {
            return;
        };
        let depth = self.caps.work_depth as usize;
        let was_gone = self.sides[who as usize].gone.contains(&conn);
        let device_lost = self.sides[who as usize].device_lost;
        let first = self.sides[who as usize].next_work;
        let room = depth.saturating_sub(self.log(who, conn).pending.len());
        let count = usize::from(count).min(room);
        let mut posted = Vec::new();
        let mut failed = None;
        let (result, established) = {
            let ep = self.ep(who);
            let established =
                matches!(ep.info(conn), Ok(info) if info.state == ConnState::Established);
            let result = ep.cm_id(conn).map(|id| {
                for n in 0..count {
                    let wr_id = APPLICATION_WR_ID | (first + n as u64);
                    let transport = ep.transport();
                    let len = u32::from(len) << 8;
                    let answer = if refused && n + 1 == count {
                        transport.post_one_sided_refused(id, len, wr_id)
                    } else {
                        transport.post_one_sided(id, len, wr_id)
                    };
                    match answer {
                        Ok(()) => posted.push((wr_id, refused && n + 1 == count)),
                        Err(error) => {
                            failed = Some(error);
                            break;
                        }
                    }
                }
            });
            (result, established)
        };
        let at = &self.at;
        match &failed {
            None => {}
            // Not connected yet (a request not answered has no QP, an answered one
            // may not be ready to send), or the device is gone.
            Some(CmError::Os { .. } | CmError::InvalidArgument { .. })
                if !established || device_lost => {}
            Some(error) => panic!("{at}: {who:?} {conn} refused one-sided work: {error:?}"),
        }
        self.side(who).next_work = first + count as u64;
        let log = self.log(who, conn);
        for (wr_id, refused) in posted {
            log.pending.push_back(wr_id);
            log.refused += usize::from(refused);
        }
        self.after_call(who, conn, was_gone, &result);
    }

    /// Takes up to `count` of the work completions of the connection `pick` chooses,
    /// the endpoint first handling its inputs when `process`.
    pub(super) fn take_work(&mut self, who: Who, pick: u8, count: u8, process: bool) {
        let Some(conn) = self.pick(who, pick) else {
            return;
        };
        if process {
            self.settle(who);
        }
        self.take_work_of(who, conn, usize::from(count), process);
    }

    /// Lets `who`'s endpoint handle what is there to handle (without waiting).
    fn settle(&mut self, who: Who) {
        for _ in 0..SETTLE_PASSES {
            let result = self.ep(who).process();
            if let Err(error) = result {
                panic!("{}: {who:?} process answered {error:?}", self.at);
            }
        }
    }

    /// Takes up to `count` work completions of `conn`, checking each; `settled`: the
    /// endpoint handled its inputs since the work was posted, so that none is missing
    /// while the connection lives.
    pub(super) fn take_work_of(
        &mut self,
        who: Who,
        conn: ConnectionId,
        count: usize,
        settled: bool,
    ) {
        let was_gone = self.sides[who as usize].gone.contains(&conn);
        let mut last = Ok(None);
        for _ in 0..count {
            last = self.ep(who).take_work_completion(conn);
            let at = self.at.clone();
            let log = self.log(who, conn);
            match &last {
                Ok(Some(done)) => {
                    assert!(
                        !was_gone,
                        "{at}: {who:?} {conn} named nothing, then completed work"
                    );
                    assert!(
                        done.wr_id & APPLICATION_WR_ID != 0,
                        "{at}: {who:?} {conn}: an endpoint message's completion taken as work: {done:?}"
                    );
                    assert!(
                        log.failed.is_none() && !log.closed,
                        "{at}: {who:?} {conn}: work completed after the close: {done:?} ({log:?})"
                    );
                    assert_eq!(
                        Some(done.wr_id),
                        log.pending.pop_front(),
                        "{at}: {who:?} {conn}: not the oldest work posted ({log:?})"
                    );
                    assert_eq!(done.kind, CqKind::Send, "{at}: {done:?}");
                    if !done.is_success() {
                        log.failed = Some(done.status);
                    }
                }
                Ok(None) => {
                    assert!(
                        log.failed.is_none(),
                        "{at}: {who:?} {conn} lives on after failed work ({log:?})"
                    );
                    assert!(
                        !settled || log.pending.is_empty(),
                        "{at}: {who:?} {conn}: posted work never completed ({log:?})"
                    );
                    break;
                }
                Err(ConnError::Closed { reason, .. }) => {
                    log.closed = true;
                    if let CloseReason::QpError {
                        detail: QpErrorDetail::Completion(status),
                    } = reason
                    {
                        assert_eq!(
                            log.failed,
                            Some(*status),
                            "{at}: {who:?} {conn} closed by failed work before it (and the \
                             work before it) was taken ({log:?})"
                        );
                    }
                    break;
                }
                Err(ConnError::UnknownConnection(_)) => break,
                Err(other) => panic!("{at}: take_work_completion answered {other:?}"),
            }
        }
        self.after_call(who, conn, was_gone, &last);
    }

    /// At the end of a run: every connection still there hands over all the work
    /// posted on it, or its close.
    pub(super) fn take_all_work(&mut self) {
        for who in [Who::Server, Who::Client] {
            self.settle(who);
            let conns: Vec<ConnectionId> = self.sides[who as usize]
                .work
                .iter()
                .filter(|(_, log)| !log.pending.is_empty())
                .map(|(conn, _)| *conn)
                .collect();
            for conn in conns {
                if !self.sides[who as usize].gone.contains(&conn) {
                    self.take_work_of(who, conn, usize::MAX, true);
                }
            }
        }
    }

    /// Checks a close reported by an event against the work taken: a connection that
    /// failed work closed was closed by nothing else first.
    pub(super) fn work_closed(&mut self, who: Who, conn: ConnectionId, reason: &CloseReason) {
        let at = self.at.clone();
        let log = self.log(who, conn);
        if let Some(status) = log.failed {
            assert_eq!(
                *reason,
                CloseReason::QpError {
                    detail: QpErrorDetail::Completion(status)
                },
                "{at}: {who:?} {conn} failed work, then closed for another reason"
            );
        }
        if let CloseReason::QpError {
            detail: QpErrorDetail::Completion(status),
        } = reason
        {
            // Sends and receives do not fail on the simulated fabric: only work does.
            assert!(
                *status == WcStatus::WrFlushErr || log.refused > 0,
                "{at}: {who:?} {conn} closed by a {status:?} completion no work made ({log:?})"
            );
        }
    }
}
