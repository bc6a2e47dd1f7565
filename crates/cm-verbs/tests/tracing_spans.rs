//! The endpoint's tracing (simulated fabric): each step of a connection's setup and its
//! close is a debug event inside the connection's `conn` span, and names the connection
//! itself, on both sides. A recording subscriber, written here, sees what any
//! subscriber would.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cm_mock::sim::{SimConfig, SimTransports};
use cm_verbs::{ConnectOptions, Endpoint, Event, ListenOptions};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Metadata, Subscriber};

/// One event as recorded: its message, the `conn` field it names and the `conn` field
/// of the span it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    message: String,
    conn: Option<String>,
    span_conn: Option<String>,
    fields: Vec<(String, String)>,
}

#[derive(Default)]
struct Fields(Vec<(String, String)>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

impl Fields {
    fn get(&self, name: &str) -> Option<String> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
}

#[derive(Default)]
struct Recorder {
    next_id: AtomicU64,
    /// Each span's `conn` field, by id.
    spans: Mutex<HashMap<u64, Option<String>>>,
    /// The spans entered, innermost last (the test is one thread).
    entered: Mutex<Vec<u64>>,
    events: Mutex<Vec<Seen>>,
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let mut fields = Fields::default();
        span.record(&mut fields);
        assert_eq!(
            span.metadata().name(),
            "conn",
            "the one span the endpoint makes"
        );
        self.spans.lock().unwrap().insert(id, fields.get("conn"));
        Id::from_u64(id)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let parent = match event.parent() {
            Some(id) => Some(id.into_u64()),
            None if event.is_contextual() => self.entered.lock().unwrap().last().copied(),
            None => None,
        };
        let span_conn = parent.and_then(|id| self.spans.lock().unwrap().get(&id).cloned()?);
        self.events.lock().unwrap().push(Seen {
            message: fields.get("message").unwrap_or_default(),
            conn: fields.get("conn"),
            span_conn,
            fields: fields.0,
        });
    }

    fn enter(&self, span: &Id) {
        self.entered.lock().unwrap().push(span.into_u64());
    }

    fn exit(&self, span: &Id) {
        let mut entered = self.entered.lock().unwrap();
        if let Some(at) = entered.iter().rposition(|&id| id == span.into_u64()) {
            entered.remove(at);
        }
    }
}

/// The messages of the events about `conn` (the connection's Display form), in order,
/// checking each is inside that connection's span.
fn steps_of(events: &[Seen], conn: &str) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.conn.as_deref() == Some(conn))
        .map(|e| {
            assert_eq!(e.span_conn.as_deref(), Some(conn), "in its span: {e:?}");
            match e.fields.iter().find(|(name, _)| name == "event") {
                Some((_, kind)) => format!("{}: {kind}", e.message),
                None => e.message.clone(),
            }
        })
        .collect()
}

/// Runs `f` with `recorder` as the thread's subscriber.
fn traced<R>(recorder: &Arc<Recorder>, f: impl FnOnce() -> R) -> R {
    tracing::subscriber::with_default(recorder.clone(), f)
}

#[test]
fn each_setup_step_and_the_close_is_an_event_in_the_connections_span() {
    // One recorder per side: both endpoints number their connections alike.
    let (server_seen, client_seen) = (Arc::default(), Arc::default());
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), 41);
    let mut server = Endpoint::new(server);
    let mut client = Endpoint::new(client);
    let addr = server.transport().addr(7492);
    traced(&server_seen, || {
        server.listen(addr, ListenOptions::default())
    })
    .unwrap();
    let out = traced(&client_seen, || {
        client.connect(addr, ConnectOptions::default())
    })
    .unwrap();
    let mut accepted = None;
    let mut closed = false;
    for _ in 0..10_000 {
        traced(&server_seen, || {
            while let Some(event) = server.poll().unwrap() {
                match event {
                    Event::Established { conn, .. } => accepted = Some(conn),
                    Event::Closed { .. } => closed = true,
                    _ => {}
                }
            }
        });
        traced(&client_seen, || {
            while let Some(event) = client.poll().unwrap() {
                if let Event::Established { conn, .. } = event {
                    client.disconnect(conn).unwrap();
                }
            }
        });
        if closed || !fabric.step() {
            break;
        }
    }
    assert!(closed, "the server heard the disconnect");
    let client_events = client_seen.events.lock().unwrap().clone();
    assert_eq!(
        steps_of(&client_events, &out.to_string()),
        [
            "resolving the address",
            "CM event: RDMA_CM_EVENT_ADDR_RESOLVED",
            "CM event: RDMA_CM_EVENT_ROUTE_RESOLVED",
            "connecting",
            "CM event: RDMA_CM_EVENT_ESTABLISHED",
            "established",
            "closed",
        ],
        "the client's: {client_events:#?}"
    );
    let server_conn = accepted.expect("accepted").to_string();
    let server_events = server_seen.events.lock().unwrap().clone();
    assert_eq!(
        steps_of(&server_events, &server_conn),
        [
            "requested",
            "accepted",
            "CM event: RDMA_CM_EVENT_ESTABLISHED",
            "established",
            "CM event: RDMA_CM_EVENT_DISCONNECTED",
            "closed",
        ],
        "the server's: {server_events:#?}"
    );
    let closed = server_events
        .iter()
        .find(|e| e.message == "closed")
        .unwrap();
    assert!(
        closed
            .fields
            .iter()
            .any(|(name, value)| name == "reason" && value == "Some(Disconnected)"),
        "the close says why: {closed:?}"
    );
}
