//! Criterion benchmarks of the notify path.

use criterion::{criterion_group, criterion_main, Criterion};

fn placeholder_free(c: &mut Criterion) {
    c.bench_function("routing/comm_est", |b| {
        let event = cm_core::AsyncEvent::qp(cm_core::AsyncEventType::CommEst, cm_core::QpNum(1));
        b.iter(|| cm_core::RoutingPolicy::default().route(std::hint::black_box(&event)))
    });
}

criterion_group!(benches, placeholder_free);
criterion_main!(benches);
