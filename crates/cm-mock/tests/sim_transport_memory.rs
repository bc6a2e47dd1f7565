//! What `SimTransport` holds per QP, counted by a counting global allocator (a
//! behaviour check, not a timing): a scale run keeps one QP per connection and side,
//! so an idle one must cost a few dozen bytes (one on shared queues less), and traffic
//! must not leave more behind.

use cm_core::{CqKind, QueueCaps, SharedCaps, Transport};
use cm_mock::sim::{SimConfig, SimPair, SimTransport};

const QPS: usize = 10_000;

#[test]
fn an_idle_qp_with_its_receives_posted_costs_a_few_dozen_bytes() {
    let pair = SimPair::new(SimConfig::default(), 1);
    let mut transport = SimTransport::on_side(pair.server.clone());
    let caps = QueueCaps::default();
    let ids: Vec<_> = (0..QPS)
        .map(|n| {
            let id = transport.create_id().unwrap();
            let port = u16::try_from(n + 1).unwrap();
            transport.bind(&id, transport.addr(port)).unwrap();
            id
        })
        .collect();
    let device = transport.open_device(&ids[0]).unwrap();
    let buffers = transport.register_buffers(&ids[0], &caps).unwrap();
    let info = allocation_counter::measure(|| {
        for (n, id) in ids.iter().enumerate() {
            transport.create_qp(id, &device, n as u64, &caps).unwrap();
            for slot in 0..caps.recv_depth {
                transport
                    .post_recv(id, &buffers, slot, u64::from(slot))
                    .unwrap();
            }
            // An idle connection's calls: arming and polling find nothing to keep.
            transport.arm_cq(id, CqKind::Recv).unwrap();
            let mut none = Vec::new();
            assert_eq!(
                transport.poll_cq(id, CqKind::Recv, &mut none, 8).unwrap(),
                0
            );
        }
    });
    // The fabric's QP record (24 bytes), the transport's slot (24) and its entry in the
    // QP-number table (4), all in tables grown by whole chunks.
    let per_qp = info.bytes_current as f64 / QPS as f64;
    assert!(per_qp <= 64.0, "{per_qp:.1} bytes per QP: {info:?}");
}

/// A QP on shared queues keeps nothing of its own on the transport: it costs less than
/// an idle QP with its own queues (only the fabric's QP record and the table entry).
#[test]
fn a_qp_on_shared_queues_costs_less_than_an_idle_one() {
    let pair = SimPair::new(SimConfig::default(), 1);
    let mut transport = SimTransport::on_side(pair.server.clone());
    let caps = QueueCaps::default();
    let ids: Vec<_> = (0..QPS)
        .map(|n| {
            let id = transport.create_id().unwrap();
            let port = u16::try_from(n + 1).unwrap();
            transport.bind(&id, transport.addr(port)).unwrap();
            id
        })
        .collect();
    let device = transport.open_device(&ids[0]).unwrap();
    let shared_caps = SharedCaps::default();
    let shared = transport
        .create_shared(&ids[0], &device, 0, &shared_caps)
        .unwrap();
    for slot in 0..shared_caps.recv_slots {
        transport
            .post_shared_recv(&shared, slot, u64::from(slot))
            .unwrap();
    }
    let info = allocation_counter::measure(|| {
        for id in &ids {
            transport.create_qp_shared(id, &shared, &caps).unwrap();
        }
        transport.arm_shared_cq(&shared, CqKind::Recv).unwrap();
        let mut none = Vec::new();
        assert_eq!(
            transport
                .poll_shared_cq(&shared, CqKind::Recv, &mut none, 8)
                .unwrap(),
            0
        );
    });
    // The fabric's QP record (24 bytes) and the QP-number table's entry (4), in tables
    // grown by whole chunks: no slot of the transport's own.
    let per_qp = info.bytes_current as f64 / QPS as f64;
    assert!(per_qp <= 32.0, "{per_qp:.1} bytes per QP: {info:?}");
}
