//! The simulated fabric's handles are `Send`: a server whose tasks are spawned on a
//! multi-threaded runtime, or a connection handle moved to another thread, runs on it.
//! Checked when compiling, and at run time across threads.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use cm_core::{CmEvent, CmEventSource, CmEventType, Transport};
use cm_mock::sim::{
    SimAddr, SimBackend, SimBuffers, SimChannel, SimCmEvent, SimCmId, SimConfig, SimDevice,
    SimDeviceReader, SimFabric, SimNode, SimPair, SimShared, SimSide, SimStats, SimTransport,
    SimTransports, Trace,
};

fn assert_send<T: Send>() {}

/// Fails to compile when a public handle of the fabric stops being `Send`.
#[test]
fn every_handle_of_the_fabric_is_send() {
    assert_send::<SimFabric>();
    assert_send::<SimNode>();
    assert_send::<SimChannel>();
    assert_send::<SimDevice>();
    assert_send::<SimCmId>();
    assert_send::<SimCmEvent>();
    assert_send::<SimBackend>();
    assert_send::<SimPair>();
    assert_send::<SimSide>();
    assert_send::<SimTransport>();
    assert_send::<SimTransports>();
    assert_send::<SimAddr>();
    assert_send::<SimBuffers>();
    assert_send::<SimShared>();
    assert_send::<SimDeviceReader>();
    assert_send::<SimStats>();
    assert_send::<Trace>();
}

const PORT: u16 = 18516;

/// A connection started on one thread is finished on another, its transports moved
/// there, while the first thread keeps its clone of the fabric.
#[test]
fn a_connection_moves_between_threads() {
    let mut pair = SimPair::new(SimConfig::default(), 11);
    let _listener = pair.listen(PORT).unwrap();
    let active = pair.connect(PORT).unwrap();
    let server = SimTransport::on_side(pair.server.clone());
    let fabric = pair.fabric.clone();
    let passive = thread::spawn(move || {
        let passive = pair.request().unwrap();
        pair.accept(&passive).unwrap();
        let events = pair.client.drain();
        assert_eq!(events[0].1, CmEventType::Established);
        pair.fabric.advance(SimPair::STEP);
        assert_eq!(pair.server.drain()[0].1, CmEventType::Established);
        (passive, server, pair.fabric.now())
    })
    .join()
    .unwrap();
    let (passive, mut server, then) = passive;
    // The clock the other thread moved reads the same here.
    assert_eq!(fabric.now(), then);
    assert!(then >= SimPair::STEP * 4);
    assert!(active.qp_ready_to_send() && passive.qp_ready_to_send());
    assert_eq!(fabric.stats().events_acked, fabric.stats().events_delivered);
    // The moved transport still reads its side of the fabric.
    assert!(server.next_cm_event().unwrap().is_none());
}

/// An event dropped unacknowledged is acknowledged even while another thread is inside
/// a call on the fabric: the drop waits for it rather than skipping the ack, so every
/// id can be destroyed afterwards.
#[test]
fn events_dropped_while_another_thread_calls_the_fabric_are_acknowledged() {
    const IDS: usize = 2_000;
    let fabric = SimFabric::new(SimConfig::default(), 12);
    let (server, client) = (fabric.add_node(), fabric.add_node());
    let mut channel = client.create_channel();
    let ids: Vec<SimCmId> = (0..IDS)
        .map(|_| {
            let id = channel.create_id();
            id.resolve_addr(server.id(), PORT).unwrap();
            id
        })
        .collect();
    fabric.run_until_idle();

    // The other thread calls the fabric without a pause from before the first drop to
    // after the last.
    let (started, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let busy = {
        let (fabric, started, done) = (fabric.clone(), Arc::clone(&started), Arc::clone(&done));
        thread::spawn(move || {
            let mut calls = 0u64;
            while !done.load(Ordering::Relaxed) {
                std::hint::black_box(fabric.pending());
                calls += 1;
                started.store(true, Ordering::Relaxed);
            }
            calls
        })
    };
    while !started.load(Ordering::Relaxed) {
        thread::yield_now();
    }
    let mut dropped = 0;
    while let Some(event) = channel.try_next_event().unwrap() {
        assert_eq!(event.event_type(), CmEventType::AddrResolved);
        drop(event);
        dropped += 1;
    }
    done.store(true, Ordering::Relaxed);
    assert!(busy.join().unwrap() > 0);
    assert_eq!(dropped, IDS);
    let stats = fabric.stats();
    assert_eq!(stats.events_acked, stats.events_delivered);
    for id in &ids {
        assert_eq!(id.unacked_events(), Ok(0));
        id.destroy().unwrap();
    }
}
