//! Criterion benchmarks of the notify path.
//!
//! - `notify/*`: one `notify` through the cm-core trait: on an id that costs nothing
//!   (the baseline), on the mockall mock, on an established [`SimFabric`] connection.
//! - `pump/*`: one asynchronous event through `NotifyPump` (route, lookup, notify,
//!   counters) and one receive completion; allocations per event are counted apart.
//! - `lookup/*`: one QP-number lookup with std's SipHash and with FxHash, the pump's
//!   hasher before its table was indexed by QP number: what the choice of hash saves.
//! - `scale/*`: whole simulated server/client runs of 1k, 10k and 100k connections at 10%
//!   RTU loss, both sides on the connection API (`cm_verbs::Endpoint` over the simulated
//!   transport); peak heap and page faults per connection are measured in separate,
//!   untimed runs, and a point whose untimed run exceeds a budget is not repeated (nor
//!   run, when linear growth from the previous point would already exceed it).
//! - `endpoint_echo/*`: one echo round trip through the connection API (`send`, `recv`)
//!   on a simulated connection while 0, 1k, 10k or 100k others sit idle.
//! - `soak/*`: 10M messages echoed over 1k connections through the connection API;
//!   queued events, held messages and RSS at the start, middle and end (untimed).
//! - `million/*`: `cmnotify -c 1000000 --resources` itself (a million simulated
//!   connections, both sides on the connection API; `cargo xtask bench` builds it), in
//!   a process of its own started with glibc's default memory settings: wall time and
//!   peak RSS (untimed by criterion; not in smoke mode). Without xtask, the same run in
//!   this binary again, whose allocation counter copies on every reallocation.
//! - `real/*` (feature `rdma`, on a device): cm-sys `notify` on an established id and
//!   the lost-RTU trigger to ESTABLISHED, pump against a hand-written loop.
//!
//! Figures criterion does not produce go to the results file (see `cm_benches::results`).
//! `CMNOTIFY_BENCH_SMOKE=1` runs a short smoke mode without the 100k point.
//!
//! [`SimFabric`]: cm_mock::sim::SimFabric

use std::hint::black_box;
use std::time::{Duration, Instant};

use cm_benches::endpoint::{
    soak, EchoFixture, ECHO_IDLE_POINTS, ECHO_THREADS_TWO_OVER_ONE, SOAK_QUEUED_END,
    SOAK_RSS_END_OVER_MIDDLE,
};
use cm_benches::results::{record, Figure};
use cm_benches::sim::{
    established_connections, heap_kept_warm, million_child, minor_page_faults, scale_config,
    KernelLikeId, MILLION, MILLION_CHILD_VAR, MILLION_PEAK_RSS_MB, MILLION_SECONDS, SCALE_POINTS,
    SCALE_RTU_LOSS,
};
use cm_benches::smoke_mode;
use cm_core::{AsyncEvent, AsyncEventType, CmId, NotifyOutcome, QpNum};
use cm_mock::MockCmId;
use cm_verbs::{NotifyPump, Role};
use criterion::{criterion_group, BatchSize, BenchmarkId, Criterion, Throughput};

/// A scale point whose untimed run takes longer than this gets no timed repetitions
/// (criterion's ten would take ten times as long): the untimed run's time per
/// connection stands for it. A point that would exceed it even growing linearly from
/// the previous one is not run at all. Ten repetitions of a run at the budget take five
/// minutes.
const SCALE_RUN_BUDGET: Duration = Duration::from_secs(30);

/// Connections registered with the pump in the pump benches: the lookup is in a table of
/// realistic size, not a one-entry map.
const PUMP_CONNECTIONS: u32 = 1024;

fn notify_through_the_trait(c: &mut Criterion) {
    let mut group = c.benchmark_group("notify");

    // Baseline: the trait call on an id that does nothing but answer.
    let free = KernelLikeId::new(QpNum(1));
    free.notify(AsyncEventType::CommEst)
        .expect("first notify forces");
    group.bench_function("direct", |b| {
        b.iter(|| black_box(&free).notify(black_box(AsyncEventType::CommEst)))
    });

    let mut mock = MockCmId::new();
    mock.expect_notify()
        .returning(|_| Ok(NotifyOutcome::AlreadyEstablished));
    mock.expect_qp_num().return_const(Some(QpNum(1)));
    group.bench_function("mock", |b| {
        b.iter(|| black_box(&mock).notify(black_box(AsyncEventType::CommEst)))
    });

    let conns = established_connections(1);
    let sim_id = &conns.passive[0];
    group.bench_function("sim", |b| {
        b.iter(|| black_box(sim_id).notify(black_box(AsyncEventType::CommEst)))
    });
    group.finish();
}

/// One QP-number lookup in a table of [`PUMP_CONNECTIONS`]: std's default SipHash
/// against FxHash, the pump's hasher before its table was indexed by QP number (QP
/// numbers are chosen by the kernel, not peers).
fn qp_lookup(c: &mut Criterion) {
    use std::collections::HashMap;
    let mut group = c.benchmark_group("lookup");
    let sip: HashMap<QpNum, u64> = (0..PUMP_CONNECTIONS)
        .map(|n| (QpNum(n), u64::from(n)))
        .collect();
    let fast: rustc_hash::FxHashMap<QpNum, u64> = (0..PUMP_CONNECTIONS)
        .map(|n| (QpNum(n), u64::from(n)))
        .collect();
    let mut next = 0u32;
    group.bench_function("siphash", |b| {
        b.iter(|| {
            next = (next + 1) % PUMP_CONNECTIONS;
            black_box(sip.get(&black_box(QpNum(next))))
        })
    });
    group.bench_function("fxhash", |b| {
        b.iter(|| {
            next = (next + 1) % PUMP_CONNECTIONS;
            black_box(fast.get(&black_box(QpNum(next))))
        })
    });
    group.finish();
}

/// A pump with [`PUMP_CONNECTIONS`] kernel-like ids, each already forced once, so every
/// further COMM_EST is the steady state: route, lookup, notify (EISCONN), counters.
fn warm_pump() -> NotifyPump<KernelLikeId> {
    let mut pump = NotifyPump::with_policy(Default::default(), PUMP_CONNECTIONS as usize);
    for n in 0..PUMP_CONNECTIONS {
        pump.register(KernelLikeId::new(QpNum(n)), Role::Passive)
            .expect("unique QP numbers");
        pump.on_async_event(AsyncEvent::qp(AsyncEventType::CommEst, QpNum(n)));
    }
    pump
}

fn pump_one_event(c: &mut Criterion) {
    let mut group = c.benchmark_group("pump");
    group.throughput(Throughput::Elements(1));

    let mut pump = warm_pump();
    let mut next = 0u32;
    group.bench_function("comm_est", |b| {
        b.iter(|| {
            next = (next + 1) % PUMP_CONNECTIONS;
            black_box(pump.on_async_event(black_box(AsyncEvent::qp(
                AsyncEventType::CommEst,
                QpNum(next),
            ))))
        })
    });
    group.bench_function("receive_completion", |b| {
        b.iter(|| {
            next = (next + 1) % PUMP_CONNECTIONS;
            black_box(pump.on_receive_completion(black_box(QpNum(next))))
        })
    });

    // A fresh forced establish (notify answers 0) per event: the pump is rebuilt
    // outside the timing for every batch.
    group.bench_function("comm_est_forced", |b| {
        b.iter_batched_ref(
            || {
                let mut pump =
                    NotifyPump::with_policy(Default::default(), PUMP_CONNECTIONS as usize);
                for n in 0..PUMP_CONNECTIONS {
                    pump.register(KernelLikeId::new(QpNum(n)), Role::Passive)
                        .expect("unique QP numbers");
                }
                (pump, 0u32)
            },
            |(pump, n)| {
                *n = (*n + 1) % PUMP_CONNECTIONS;
                black_box(pump.on_async_event(AsyncEvent::qp(AsyncEventType::CommEst, QpNum(*n))))
            },
            BatchSize::LargeInput,
        )
    });

    // The same through simulated ids: the pump in front of the simulated kernel.
    let conns = established_connections(64);
    let (mut sim_pump, qps) = conns.passive_pump();
    let mut i = 0usize;
    group.bench_function("comm_est_sim", |b| {
        b.iter(|| {
            i = (i + 1) % qps.len();
            black_box(sim_pump.on_async_event(AsyncEvent::qp(AsyncEventType::CommEst, qps[i])))
        })
    });
    group.finish();

    count_pump_allocations();
}

/// Heap allocations per pumped event after warm-up (counted, not timed).
fn count_pump_allocations() {
    let mut pump = warm_pump();
    let events = if smoke_mode() { 10_000 } else { 1_000_000 };
    let info = allocation_counter::measure(|| {
        for n in 0..events {
            let qp = QpNum(n % PUMP_CONNECTIONS);
            black_box(pump.on_async_event(AsyncEvent::qp(AsyncEventType::CommEst, qp)));
            black_box(pump.on_receive_completion(qp));
        }
    });
    record(&Figure::measured(
        cm_testkit::figure_keys::PUMP_ALLOCATIONS_PER_EVENT,
        info.count_total as f64 / f64::from(events),
        "count",
        &format!(
            "{} allocations over {events} COMM_EST events and receive completions",
            info.count_total
        ),
    ));
}

fn scale(c: &mut Criterion) {
    let mut group = c.benchmark_group("scale");
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(1));
    // The previous point's connections and the time of its untimed run.
    let mut previous: Option<(u32, Duration)> = None;
    for &connections in &SCALE_POINTS {
        if smoke_mode() && connections > 10_000 {
            record(&Figure::skipped(
                &format!("scale/{connections}"),
                "smoke mode: the 100k point runs only in `cargo xtask bench`",
            ));
            continue;
        }
        // Even linear growth from the previous point would take this one past the
        // budget: not even its untimed run is worth the wait.
        if let Some((before, took)) = previous {
            let at_least = took.mul_f64(f64::from(connections) / f64::from(before));
            if at_least > SCALE_RUN_BUDGET {
                record(&Figure::skipped(
                    &format!("scale/{connections}"),
                    &format!(
                        "the {before}-connection run took {:.1} s: this one would take at \
                         least {:.0} s, over the {} s budget",
                        took.as_secs_f64(),
                        at_least.as_secs_f64(),
                        SCALE_RUN_BUDGET.as_secs()
                    ),
                ));
                continue;
            }
        }
        let config = scale_config(connections);
        // Untimed run: outcome and peak heap.
        let mut report = None;
        let started = Instant::now();
        let info = allocation_counter::measure(|| {
            report = Some(cm_tools::sim_run::run(&config));
        });
        let took = started.elapsed();
        previous = Some((connections, took));
        let report = report.expect("the run returned");
        let key = format!("scale/{connections}");
        // The simulated work: messages delivered and CM events handed over, per
        // connection. Constant means the run is linear in its work; the time per
        // connection can still grow as the working set leaves the caches.
        let work = report.fabric.delivered.iter().sum::<u64>() + report.fabric.events_delivered;
        record(&Figure::measured(
            &format!("{key}/work_per_conn"),
            work as f64 / f64::from(connections),
            "count",
            "messages delivered + CM events handed to the application, per connection",
        ));
        record(&Figure::measured(
            &format!("{key}/peak_bytes_per_conn"),
            info.bytes_max as f64 / f64::from(connections),
            "bytes",
            &format!("peak heap {} bytes", info.bytes_max),
        ));
        record(&Figure::measured(
            &format!("{key}/established"),
            report.established() as f64,
            "count",
            &format!(
                "of {connections} at {:.0}% RTU loss: {} forced by notify, {} by RTU, {} failed, \
                 {} invariant violations, {} teardown failures",
                SCALE_RTU_LOSS * 100.0,
                report.forced(),
                report.via_rtu(),
                report.failed(),
                report.invariant_violations(),
                report.teardown_failures
            ),
        ));
        let per_conn_ns = took.as_nanos() as f64 / f64::from(connections);
        record(&Figure::measured(
            &format!("{key}/one_run_ns_per_conn"),
            per_conn_ns,
            "ns",
            "wall time of the untimed run (allocations counted), per connection",
        ));
        if took > SCALE_RUN_BUDGET {
            record(&Figure::skipped(
                &key,
                &format!(
                    "one run took {:.0} s ({:.1} µs per connection), over the {} s budget \
                     for timed repetitions",
                    took.as_secs_f64(),
                    per_conn_ns / 1e3,
                    SCALE_RUN_BUDGET.as_secs()
                ),
            ));
            continue;
        }
        // A second untimed run sees the heap as the timed repetitions do.
        let faults_before = minor_page_faults();
        black_box(cm_tools::sim_run::run(&config));
        if let Some((before, after)) = faults_before.zip(minor_page_faults()) {
            let heap = if heap_kept_warm() {
                "heap kept between runs (GLIBC_TUNABLES trim threshold)"
            } else {
                "glibc's default trimming: large runs map their heap afresh each time"
            };
            record(&Figure::measured(
                &format!("{key}/page_faults_per_conn"),
                (after - before) as f64 / f64::from(connections),
                "count",
                &format!("minor page faults of one repeated run; {heap}"),
            ));
        }
        group.throughput(Throughput::Elements(u64::from(connections)));
        group.bench_with_input(
            BenchmarkId::from_parameter(connections),
            &config,
            |b, config| b.iter(|| black_box(cm_tools::sim_run::run(config)).established()),
        );
    }
    group.finish();
}

/// One echo round trip through the connection API while N other connections sit idle:
/// the cost per event must not depend on N.
fn endpoint_echo(c: &mut Criterion) {
    let mut group = c.benchmark_group("endpoint_echo");
    for &idle in &ECHO_IDLE_POINTS {
        if smoke_mode() && idle > 10_000 {
            record(&Figure::skipped(
                &format!("endpoint_echo/{idle}"),
                "smoke mode: the 100k point runs only in `cargo xtask bench`",
            ));
            continue;
        }
        let mut fixture = EchoFixture::new(idle);
        group.bench_function(BenchmarkId::from_parameter(idle), |b| {
            b.iter(|| black_box(fixture.echo(black_box(b"ping"))))
        });
    }
    group.finish();
}

/// Echo round trips per second with one endpoint driven by one thread, and with two,
/// each its own endpoint pair on its own thread (one per core, as a server shards its
/// listeners), measured in one run: the ratio says what a second core buys, which only
/// state shared between endpoints (or the allocator) would take away.
fn endpoint_echo_threads(_c: &mut Criterion) {
    let rounds: u32 = if smoke_mode() { 200_000 } else { 2_000_000 };
    let per_second = |threads: u32| -> f64 {
        let start = std::sync::Arc::new(std::sync::Barrier::new(threads as usize + 1));
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let start = std::sync::Arc::clone(&start);
                std::thread::spawn(move || {
                    let mut fixture = EchoFixture::new(0);
                    start.wait();
                    for _ in 0..rounds {
                        black_box(fixture.echo(black_box(b"ping")));
                    }
                })
            })
            .collect();
        start.wait();
        let began = Instant::now();
        for worker in workers {
            worker.join().expect("echo thread");
        }
        f64::from(threads * rounds) / began.elapsed().as_secs_f64()
    };
    let one = per_second(1);
    let two = per_second(2);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    record(&Figure::measured(
        ECHO_THREADS_TWO_OVER_ONE,
        two / one,
        "ratio",
        &format!(
            "{rounds} round trips per thread, {cores} cores: 1 thread {one:.0}/s, \
             2 threads {two:.0}/s"
        ),
    ));
}

/// A soak of the connection API (untimed): 10M messages echoed over 1k connections
/// (100k in smoke mode); what the server holds and the process's memory at the start,
/// the middle and the end.
fn endpoint_soak(_c: &mut Criterion) {
    let messages = if smoke_mode() { 100_000 } else { 10_000_000 };
    let [start, middle, end] = soak(1_000, messages);
    let note = format!(
        "{messages} messages over 1000 connections; queued / held / RSS: start {} / {} / {} kB, \
         middle {} / {} / {} kB, end {} / {} / {} kB",
        start.queued,
        start.held,
        start.rss / 1024,
        middle.queued,
        middle.held,
        middle.rss / 1024,
        end.queued,
        end.held,
        end.rss / 1024
    );
    if middle.rss > 0 {
        record(&Figure::measured(
            SOAK_RSS_END_OVER_MIDDLE,
            end.rss as f64 / middle.rss as f64,
            "ratio",
            &note,
        ));
    } else {
        record(&Figure::skipped(
            SOAK_RSS_END_OVER_MIDDLE,
            "no /proc/self/statm",
        ));
    }
    record(&Figure::measured(
        SOAK_QUEUED_END,
        (end.queued + end.held) as f64,
        "count",
        &note,
    ));
}

/// The million run in a process of its own (`cmnotify` itself, or this binary again):
/// its peak RSS is the run's alone.
fn million(_c: &mut Criterion) {
    if smoke_mode() {
        for key in [MILLION_SECONDS, MILLION_PEAK_RSS_MB] {
            record(&Figure::skipped(
                key,
                "smoke mode: the million run is only in `cargo xtask bench`",
            ));
        }
        return;
    }
    // `cmnotify` itself when xtask built it (what a user runs); else this binary again,
    // whose allocation counter turns every reallocation into a copy (an upper bound).
    let cmnotify = cm_testkit::env::var(cm_testkit::env::CMNOTIFY_BIN);
    let (run, whose) = match &cmnotify {
        Some(bin) => (million_in_cmnotify(bin), "`cmnotify -c 1000000`"),
        None => (
            million_in_this_binary(),
            "this bench binary (its allocation counter copies on every reallocation: \
             an upper bound)",
        ),
    };
    let Some((nanos, rss, established)) = run else {
        for key in [MILLION_SECONDS, MILLION_PEAK_RSS_MB] {
            record(&Figure::skipped(key, "the million run's process failed"));
        }
        return;
    };
    let note = format!(
        "{established} of {MILLION} established (every RTU lost, data sent, teardown), \
         measured in {whose}"
    );
    record(&Figure::measured(
        MILLION_SECONDS,
        nanos as f64 / 1e9,
        "s",
        &note,
    ));
    record(&Figure::measured(
        MILLION_PEAK_RSS_MB,
        rss as f64 / 1e6,
        "MB",
        &format!("{} bytes per connection; {note}", rss / u64::from(MILLION)),
    ));
}

/// As a user runs it: glibc trims and maps as it does by default.
fn without_warm_heap(command: &mut std::process::Command) -> &mut std::process::Command {
    command.env_remove("GLIBC_TUNABLES")
}

/// `cmnotify -c 1000000 --json --resources`: its wall time and peak RSS (its
/// `resources` line on stderr) and the connections it established (its JSON).
fn million_in_cmnotify(bin: &str) -> Option<(u64, u64, u64)> {
    let mut command = std::process::Command::new(bin);
    command.args(["-c", &MILLION.to_string(), "--json", "--resources"]);
    let out = without_warm_heap(&mut command).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let stderr = String::from_utf8(out.stderr).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = stderr
            .lines()
            .find(|l| l.starts_with("cmnotify: resources:"))?;
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))?
            .parse()
            .ok()
    };
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let established = report.get("established")?.as_u64()?;
    Some((field("wall_ns")?, field("peak_rss_bytes")?, established))
}

/// The million run in this binary again (told so by [`MILLION_CHILD_VAR`]).
fn million_in_this_binary() -> Option<(u64, u64, u64)> {
    let exe = std::env::current_exe().ok()?;
    let mut command = std::process::Command::new(exe);
    command.env(MILLION_CHILD_VAR, "1");
    let out = without_warm_heap(&mut command).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let printed = String::from_utf8(out.stdout).ok()?;
    let fields: Vec<u64> = printed
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    match fields[..] {
        [nanos, rss, established] => Some((nanos, rss, established)),
        _ => None,
    }
}

#[cfg(feature = "rdma")]
fn real(c: &mut Criterion) {
    cm_benches::real::criterion_benches(c);
}

#[cfg(not(feature = "rdma"))]
fn real(_c: &mut Criterion) {
    for key in [
        cm_testkit::figure_keys::REAL_NOTIFY,
        cm_testkit::figure_keys::REAL_TRIGGER_TO_ESTABLISHED,
        cm_testkit::figure_keys::REAL_SETUP,
    ] {
        record(&Figure::skipped(
            key,
            "built without the `rdma` feature (no librdmacm)",
        ));
    }
}

fn config() -> Criterion {
    let criterion = Criterion::default();
    if smoke_mode() {
        criterion
            .warm_up_time(Duration::from_millis(100))
            .measurement_time(Duration::from_millis(300))
            .sample_size(10)
    } else {
        criterion
    }
}

criterion_group! {
    name = benches;
    config = config();
    targets = notify_through_the_trait, pump_one_event, qp_lookup, scale, endpoint_echo, endpoint_echo_threads, endpoint_soak, million, real
}

fn main() {
    if std::env::var_os(MILLION_CHILD_VAR).is_some() {
        million_child();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
