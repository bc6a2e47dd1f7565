//! A thousand clients leave at once: the server's CM channel holds a DISCONNECTED for
//! each. The kernel's `rdma_destroy_id` walks every event still unread on the channel
//! to drop the id's own, so a server that destroyed each id as it read its
//! DISCONNECTED would walk about half a million events; the endpoint destroys the ids
//! of a pass once the channel has less than a full batch waiting.

#[path = "common/sim.rs"]
mod sim;

use std::time::Duration;

use cm_mock::sim::SimTransport;
use cm_verbs::{
    CloseReason, ConnectOptions, ConnectionId, Endpoint, EndpointOptions, Event,
    DEFERRED_DESTROY_MAX, PASS_BATCH,
};
use sim::{establish, listening, SimEndpoints};

const PORT: u16 = 7471;
const CLIENTS: usize = 1000;

/// Polls `endpoint` until nothing is ready; its events.
fn drain(endpoint: &mut Endpoint<SimTransport>) -> Vec<Event> {
    let mut events = Vec::new();
    while let Some(event) = endpoint.poll().expect("poll") {
        events.push(event);
    }
    events
}

#[test]
fn a_mass_disconnect_destroys_ids_once_the_channel_is_read() {
    let SimEndpoints {
        fabric,
        mut server,
        mut client,
        addr: to,
    } = listening(7, PORT, EndpointOptions::default());
    let conns: Vec<ConnectionId> = (0..CLIENTS)
        .map(|_| client.connect(to, ConnectOptions::default()).unwrap())
        .collect();
    establish(&fabric, &mut server, &mut client, CLIENTS);

    for conn in conns {
        client.disconnect(conn).unwrap();
    }
    // Every DREQ arrives, the server reads nothing yet.
    fabric.advance(Duration::from_millis(1));
    let before = fabric.stats();

    let mut closed = 0;
    let mut most_deferred = 0;
    for _ in 0..10 * CLIENTS {
        if closed == CLIENTS {
            break;
        }
        let event = server.poll().expect("a pass");
        most_deferred = most_deferred.max(server.stats().ended_ids);
        match event {
            None => {}
            Some(Event::Closed {
                reason: CloseReason::Disconnected,
                ..
            }) => closed += 1,
            Some(other) => panic!("server: unexpected {other:?}"),
        }
    }
    assert_eq!(closed, CLIENTS);
    drain(&mut server);
    let after = fabric.stats();
    assert_eq!(after.ids_destroyed - before.ids_destroyed, CLIENTS as u64);
    assert_eq!(server.stats().ended_ids, 0, "every ended id destroyed");
    assert_eq!(server.connection_count(), 0);
    let walked = after.events_walked_by_destroy - before.events_walked_by_destroy;
    assert!(
        walked <= (PASS_BATCH * CLIENTS) as u64 / 8,
        "destroys walked {walked} unread events for {CLIENTS} ids"
    );
    assert!(
        most_deferred > PASS_BATCH && most_deferred <= DEFERRED_DESTROY_MAX,
        "ids waited for the channel to be read ({most_deferred} at most)"
    );
}
