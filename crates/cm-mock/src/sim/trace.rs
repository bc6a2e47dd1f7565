//! The optional record of everything the fabric did, with virtual timestamps.

use core::fmt;
use std::time::Duration;

use cm_core::{AsyncEvent, AsyncEventType, CmEventType, IbCmState, NotifyError, NotifyOutcome};

use super::types::{ConnId, FaultAction, MsgKind, NodeId, SimIdKey};

/// One thing that happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceEvent {
    /// A message left a node.
    Sent {
        /// Its kind.
        kind: MsgKind,
        /// Its connection, when it belongs to one.
        conn: Option<ConnId>,
        /// The sender.
        from: NodeId,
        /// The receiver.
        to: NodeId,
        /// Whether it is a retransmission (REQ/REP/DREQ timer).
        retransmit: bool,
    },
    /// A fault hit a message just sent.
    Fault {
        /// The message's kind.
        kind: MsgKind,
        /// Its connection.
        conn: Option<ConnId>,
        /// What the fault did.
        action: FaultAction,
    },
    /// A message arrived and was processed.
    Delivered {
        /// Its kind.
        kind: MsgKind,
        /// Its connection.
        conn: Option<ConnId>,
        /// The receiving node.
        to: NodeId,
    },
    /// A message arrived and was ignored (no such id, wrong state, late RTU, …).
    Ignored {
        /// Its kind.
        kind: MsgKind,
        /// Its connection.
        conn: Option<ConnId>,
        /// Why.
        reason: &'static str,
    },
    /// An id's IB CM state changed.
    State {
        /// The id.
        id: SimIdKey,
        /// Its connection.
        conn: Option<ConnId>,
        /// The state before (`None`: no IB CM id yet).
        from: Option<IbCmState>,
        /// The new state.
        to: IbCmState,
    },
    /// A CM event was queued on an id's channel.
    CmEvent {
        /// The id it is about.
        id: SimIdKey,
        /// Its connection.
        conn: Option<ConnId>,
        /// The event.
        event: CmEventType,
        /// Its status.
        status: i32,
    },
    /// A verbs asynchronous event was raised on a node's device.
    AsyncEvent {
        /// The node.
        node: NodeId,
        /// The event.
        event: AsyncEvent,
    },
    /// A receive completed on a QP.
    RecvCompletion {
        /// The node.
        node: NodeId,
        /// The completion.
        qp: cm_core::QpNum,
    },
    /// The application called notify.
    Notify {
        /// The id.
        id: SimIdKey,
        /// Its connection.
        conn: Option<ConnId>,
        /// The event number passed.
        event: AsyncEventType,
        /// The answer.
        result: Result<NotifyOutcome, NotifyError>,
    },
}

fn conn_str(conn: Option<ConnId>) -> String {
    conn.map_or_else(|| "-".to_owned(), |c| c.to_string())
}

impl fmt::Display for TraceEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceEvent::Sent {
                kind,
                conn,
                from,
                to,
                retransmit,
            } => {
                write!(f, "{} {kind} {from} -> {to}", conn_str(*conn))?;
                if *retransmit {
                    f.write_str(" (retransmit)")?;
                }
                Ok(())
            }
            TraceEvent::Fault { kind, conn, action } => {
                write!(f, "{} {kind} {action}", conn_str(*conn))
            }
            TraceEvent::Delivered { kind, conn, to } => {
                write!(f, "{} {kind} delivered to {to}", conn_str(*conn))
            }
            TraceEvent::Ignored { kind, conn, reason } => {
                write!(f, "{} {kind} ignored: {reason}", conn_str(*conn))
            }
            TraceEvent::State { id, conn, from, to } => match from {
                Some(from) => write!(f, "{} {id} {from} -> {to}", conn_str(*conn)),
                None => write!(f, "{} {id} -> {to}", conn_str(*conn)),
            },
            TraceEvent::CmEvent {
                id,
                conn,
                event,
                status,
            } => write!(f, "{} {id} event {event} status {status}", conn_str(*conn)),
            TraceEvent::AsyncEvent { node, event } => write!(f, "{node} async {event}"),
            TraceEvent::RecvCompletion { node, qp } => write!(f, "{node} recv completion {qp}"),
            TraceEvent::Notify {
                id,
                conn,
                event,
                result,
            } => {
                write!(f, "{} {id} notify({event}) = ", conn_str(*conn))?;
                match result {
                    Ok(outcome) => write!(f, "Ok({outcome:?})"),
                    Err(error) => write!(f, "Err({})", cm_core::Errno(error.errno())),
                }
            }
        }
    }
}

/// One trace line: when, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEntry {
    /// Virtual time since the fabric was created.
    pub at: Duration,
    /// What happened.
    pub event: TraceEvent,
}

impl fmt::Display for TraceEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{:>12.6}s] {}", self.at.as_secs_f64(), self.event)
    }
}

/// Everything the fabric did, in order. Two runs with the same seed, configuration and
/// calls give equal traces.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// The entries, oldest first.
    pub entries: Vec<TraceEntry>,
}

impl Trace {
    /// The entries whose event satisfies `pred`.
    pub fn filter<'a>(
        &'a self,
        mut pred: impl FnMut(&TraceEvent) -> bool + 'a,
    ) -> impl Iterator<Item = &'a TraceEntry> + 'a {
        self.entries.iter().filter(move |e| pred(&e.event))
    }

    /// How many entries there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for entry in &self.entries {
            writeln!(f, "{entry}")?;
        }
        Ok(())
    }
}
