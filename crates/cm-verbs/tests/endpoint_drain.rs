//! Graceful close (simulated fabric): `Endpoint::close_gracefully` delivers every
//! message sent before it, then disconnects; sends after it are refused; with nothing
//! in flight it disconnects at once. On shared queues and on queues of each
//! connection's own. The handles' `Connection::close` (and dropping the last clone) is
//! the same close.
#![cfg(all(feature = "tokio", feature = "sim"))]

use cm_mock::sim::{SimConfig, SimFabric, SimTransport, SimTransports};
use cm_verbs::handle::EndpointHandle;
use cm_verbs::{
    CloseReason, ConnError, ConnectOptions, ConnectionId, Endpoint, EndpointOptions, Event,
    ListenOptions,
};

const PORT: u16 = 7496;
const MESSAGES: u8 = 12;

type SimEndpoint = Endpoint<SimTransport>;

fn endpoints(options: EndpointOptions, seed: u64) -> (SimFabric, SimEndpoint, SimEndpoint) {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), seed);
    (
        fabric,
        Endpoint::with_options(server, options),
        Endpoint::with_options(client, options),
    )
}

/// The client sends [`MESSAGES`] messages as soon as it is established and closes at
/// once; what the server got, in order, and how its connection ended.
fn send_then_close(options: EndpointOptions) -> (Vec<Vec<u8>>, Vec<CloseReason>) {
    let (fabric, mut server, mut client) = endpoints(options, 21);
    let addr = server.transport().addr(PORT);
    server.listen(addr, ListenOptions::default()).unwrap();
    let out = client.connect(addr, ConnectOptions::default()).unwrap();
    let (mut received, mut closed) = (Vec::new(), Vec::new());
    let mut closing = false;
    loop {
        while let Some(event) = server.poll().unwrap() {
            match event {
                Event::Received { data, .. } => received.push(data),
                Event::Closed { reason, .. } => closed.push(reason),
                _ => {}
            }
        }
        while let Some(event) = client.poll().unwrap() {
            match event {
                Event::Established { conn, .. } if conn == out => {
                    for n in 0..MESSAGES {
                        client.send(out, &[n; 64]).unwrap();
                    }
                    assert!(client.info(out).unwrap().sends_in_flight > 0);
                    client.close_gracefully(out).unwrap();
                    closing = true;
                    // Refused from now on; still there until its sends completed.
                    assert!(matches!(
                        client.send(out, b"late"),
                        Err(ConnError::WrongState { .. })
                    ));
                }
                Event::Closed { conn, reason } => panic!("{conn}: {reason:?}"),
                _ => {}
            }
        }
        if !fabric.step() {
            break;
        }
    }
    assert!(closing, "the client was established");
    // Forgotten once drained: nothing more is reported of it.
    assert!(matches!(
        client.info(out),
        Err(ConnError::UnknownConnection(c)) if c == out
    ));
    assert_eq!(client.stats().connections, 0);
    (received, closed)
}

#[test]
fn a_graceful_close_delivers_what_was_sent_then_disconnects() {
    for options in [EndpointOptions::default(), EndpointOptions::own_queues()] {
        let (received, closed) = send_then_close(options);
        let expected: Vec<Vec<u8>> = (0..MESSAGES).map(|n| vec![n; 64]).collect();
        assert_eq!(received, expected, "{options:?}");
        assert_eq!(closed, vec![CloseReason::Disconnected], "{options:?}");
    }
}

#[test]
fn a_graceful_close_with_nothing_in_flight_disconnects_at_once() {
    let (fabric, mut server, mut client) = endpoints(EndpointOptions::default(), 22);
    let addr = server.transport().addr(PORT);
    server.listen(addr, ListenOptions::default()).unwrap();
    let out = client.connect(addr, ConnectOptions::default()).unwrap();
    let mut established = None::<ConnectionId>;
    while established.is_none() {
        while server.poll().unwrap().is_some() {}
        while let Some(event) = client.poll().unwrap() {
            if let Event::Established { conn, .. } = event {
                established = Some(conn);
            }
        }
        assert!(fabric.step(), "the connection comes up");
    }
    client.close_gracefully(out).unwrap();
    assert!(matches!(
        client.info(out),
        Err(ConnError::UnknownConnection(_))
    ));
    assert!(matches!(
        client.close_gracefully(out),
        Err(ConnError::UnknownConnection(_))
    ));
}

/// A tokio task per connection that sends and drops its handle: its messages still
/// reach the server, then the close.
#[test]
fn dropping_the_last_handle_still_delivers_what_was_sent() {
    let SimTransports {
        fabric: _fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), 23);
    let addr = server.addr(PORT);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let server = EndpointHandle::spawn_tokio(Endpoint::new(server)).unwrap();
        let client = EndpointHandle::spawn_tokio(Endpoint::new(client)).unwrap();
        let listener = server.listen(addr, ListenOptions::default()).unwrap();
        let sender = tokio::spawn(async move {
            let out = client.connect(addr, ConnectOptions::default()).unwrap();
            out.established().await.unwrap();
            for n in 0..MESSAGES {
                out.send(&[n; 32]).await.unwrap();
            }
            drop(out); // the last clone: closed once its sends completed
            client
        });
        let conn = listener.accept().await.unwrap();
        for n in 0..MESSAGES {
            assert_eq!(conn.recv().await.unwrap(), vec![n; 32]);
        }
        assert!(matches!(
            conn.recv().await,
            Err(ConnError::Closed {
                reason: CloseReason::Disconnected,
                ..
            })
        ));
        drop(sender.await.unwrap());
    });
}
