//! What `SimTransport` holds per QP, counted by a counting global allocator (a
//! behaviour check, not a timing): a scale run keeps one QP per connection and side,
//! so an idle one must cost a few dozen bytes, and traffic must not leave more behind.

use cm_core::{CqKind, QueueCaps, Transport};
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
