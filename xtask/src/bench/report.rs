//! The report's rows (criterion figures against their baselines, the scale curve's
//! verdicts, the real-device figures) and its markdown table.

use std::collections::BTreeMap;

use cm_testkit::Figure;

/// The scale points the benches run, in connections.
const SCALE_POINTS: [u64; 3] = [
    cm_testkit::SCALE_POINTS[0] as u64,
    cm_testkit::SCALE_POINTS[1] as u64,
    cm_testkit::SCALE_POINTS[2] as u64,
];
/// The largest growth of the time per connection over the 1k point that the report
/// still calls flat.
const FLAT_RATIO: f64 = 1.25;
/// How far the simulated work per connection may differ from the 1k point's and still
/// count as the same work (10% RTU loss draws a slightly different share at each N).
const WORK_TOLERANCE: f64 = 0.02;

/// Everything measured in one run.
pub(super) struct Figures {
    pub(super) estimates: BTreeMap<String, f64>,
    pub(super) extra: BTreeMap<String, Figure>,
    /// The real-device figures measured inside the VM (`--vm`).
    pub(super) vm: BTreeMap<String, Figure>,
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Row {
    figure: String,
    value: String,
    baseline: String,
    ratio: String,
    target: String,
    machine: String,
    note: String,
}

fn ns(value: f64) -> String {
    if value >= 1e6 {
        format!("{:.2} ms", value / 1e6)
    } else if value >= 1e3 {
        format!("{:.2} µs", value / 1e3)
    } else {
        format!("{value:.1} ns")
    }
}

/// `value / baseline`, or "-".
fn ratio(value: Option<f64>, baseline: Option<f64>) -> String {
    match (value, baseline) {
        (Some(v), Some(b)) if b > 0.0 => format!("{:.2}", v / b),
        _ => "-".to_string(),
    }
}

/// One point of the scale curve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct ScalePoint {
    pub(super) connections: u64,
    pub(super) ns_per_conn: Option<f64>,
    pub(super) bytes_per_conn: Option<f64>,
}

impl Figures {
    fn estimate(&self, id: &str) -> Option<f64> {
        self.estimates.get(id).copied()
    }

    fn extra(&self, key: &str) -> Option<&Figure> {
        self.extra.get(key)
    }

    pub(super) fn scale_points(&self) -> Vec<ScalePoint> {
        SCALE_POINTS
            .iter()
            .map(|&n| ScalePoint {
                connections: n,
                ns_per_conn: self.estimate(&format!("scale/{n}")).map(|t| t / n as f64),
                bytes_per_conn: self
                    .extra(&format!("scale/{n}/peak_bytes_per_conn"))
                    .and_then(|e| e.value),
            })
            .collect()
    }

    /// A timed criterion figure against a timed baseline.
    fn timed(
        &self,
        figure: &str,
        id: &str,
        baseline: Option<(&str, &str)>,
        target: &str,
        machine: &str,
        note: &str,
    ) -> Row {
        let value = self.estimate(id);
        let base = baseline.and_then(|(base_id, _)| self.estimate(base_id));
        Row {
            figure: figure.to_string(),
            value: value.map_or_else(|| "not run".to_string(), ns),
            baseline: match baseline {
                Some((_, name)) => base.map_or_else(
                    || format!("{name}: not run"),
                    |b| format!("{name}: {}", ns(b)),
                ),
                None => "-".to_string(),
            },
            ratio: ratio(value, base),
            target: target.to_string(),
            machine: machine.to_string(),
            note: note.to_string(),
        }
    }

    pub(super) fn rows(&self, machine: &str) -> Vec<Row> {
        let mut rows = vec![
            self.timed(
                "notify through the trait: mockall mock",
                "notify/mock",
                Some(("notify/direct", "free id")),
                "-",
                machine,
                "EISCONN answer; mockall's matching dominates",
            ),
            self.timed(
                "notify through the trait: SimFabric",
                "notify/sim",
                Some(("notify/direct", "free id")),
                "-",
                machine,
                "established simulated connection (EISCONN)",
            ),
            self.timed(
                "pumped COMM_EST (lookup, notify, counters)",
                "pump/comm_est",
                Some(("notify/direct", "free id")),
                "≤ 50 ns",
                machine,
                "1024 registered connections, steady state (EISCONN)",
            ),
            self.timed(
                "pumped COMM_EST, forced establish",
                "pump/comm_est_forced",
                Some(("notify/direct", "free id")),
                "≤ 50 ns",
                machine,
                "first notify of a pending connection",
            ),
            self.timed(
                "pumped receive completion (established conn)",
                "pump/receive_completion",
                None,
                "-",
                machine,
                "one lookup, no notify",
            ),
            self.timed(
                "pumped COMM_EST on SimFabric ids",
                "pump/comm_est_sim",
                Some(("notify/sim", "SimFabric notify")),
                "-",
                machine,
                "pump in front of the simulated kernel",
            ),
        ];
        for idle in ["10000", "100000"] {
            rows.push(self.timed(
                &format!("echo round trip beside {idle} idle connections"),
                &format!("endpoint_echo/{idle}"),
                Some(("endpoint_echo/0", "no idle connection")),
                "≤ 1.2",
                machine,
                "connection API on the simulated fabric: send, recv, send, recv",
            ));
        }
        rows.push(self.timed(
            "QP lookup, std SipHash",
            "lookup/siphash",
            Some(("lookup/fxhash", "FxHash (the pump's)")),
            "-",
            machine,
            "1024 entries; the pump pays one FxHash lookup per event",
        ));
        for (figure, key, target) in [
            (
                "1M simulated connections (cmnotify -c 1000000): wall time, s",
                "million/seconds",
                "< 10",
            ),
            (
                "1M simulated connections: peak RSS, MB",
                "million/peak_rss_mb",
                "< 1000",
            ),
            (
                "echo round trips per second, 2 endpoints on 2 threads / 1 on 1 (simulated)",
                "echo_threads/two_over_one",
                "≥ 1.6",
            ),
            (
                "soak: RSS end / middle",
                "soak/rss_end_over_middle",
                "≤ 1.05",
            ),
            (
                "soak: queued + held at the end",
                "soak/queued_end",
                "bounded (≤ 64)",
            ),
        ] {
            let extra = self.extra(key);
            rows.push(Row {
                figure: figure.to_string(),
                value: extra
                    .and_then(|e| e.value)
                    .map_or_else(|| "not run".to_string(), |v| format!("{v:.3}")),
                baseline: "-".to_string(),
                ratio: "-".to_string(),
                target: target.to_string(),
                machine: machine.to_string(),
                note: extra.map_or_else(String::new, |e| e.note.clone()),
            });
        }
        let allocations = self.extra(cm_testkit::figure_keys::PUMP_ALLOCATIONS_PER_EVENT);
        rows.push(Row {
            figure: "allocations per pumped event".to_string(),
            value: allocations
                .and_then(|e| e.value)
                .map_or_else(|| "not run".to_string(), |v| format!("{v}")),
            baseline: "-".to_string(),
            ratio: "-".to_string(),
            target: "0".to_string(),
            machine: machine.to_string(),
            note: allocations.map_or_else(String::new, |e| e.note.clone()),
        });

        let points = self.scale_points();
        let base = points.first().copied();
        for point in &points {
            let n = point.connections;
            let skipped = self
                .extra(&format!("scale/{n}"))
                .filter(|e| e.value.is_none());
            let outcome = self.extra(&format!("scale/{n}/established"));
            let label = format!("{}k", n / 1000);
            let note = match (skipped, outcome) {
                (Some(skip), _) => format!("skipped: {}", skip.note),
                (None, Some(o)) => {
                    let faults = self
                        .extra(&format!("scale/{n}/page_faults_per_conn"))
                        .and_then(|f| {
                            f.value
                                .map(|v| format!("; {v:.2} page faults per conn ({})", f.note))
                        })
                        .unwrap_or_default();
                    format!("{} established {}{faults}", o.value.unwrap_or(0.0), o.note)
                }
                (None, None) => "not run".to_string(),
            };
            // A figure of this point over the 1k point's (none for the 1k point itself).
            let over_1k = |value: Option<f64>, base: Option<f64>| {
                value
                    .zip(base)
                    .filter(|_| n != SCALE_POINTS[0])
                    .map(|(v, b)| v / b)
            };
            let work = |n: u64| {
                self.extra(&format!("scale/{n}/work_per_conn"))
                    .and_then(|e| e.value)
            };
            let growth = over_1k(point.ns_per_conn, base.and_then(|b| b.ns_per_conn));
            let work_growth = over_1k(work(n), work(SCALE_POINTS[0]));
            let verdict = match (growth, work_growth) {
                (Some(g), _) if g <= FLAT_RATIO => format!("flat ({g:.3}x the 1k cost); "),
                (Some(g), Some(w)) if (w - 1.0).abs() <= WORK_TOLERANCE => format!(
                    "not flat: {g:.3}x the 1k cost, for the same work per connection \
                     ({w:.3}x): linear in work, the time grows as the working set \
                     (peak heap per conn × N) outgrows the caches; "
                ),
                (Some(g), _) => format!("not flat: {g:.3}x the 1k cost; "),
                (None, _) => String::new(),
            };
            rows.push(Row {
                figure: format!("SimFabric {label} conns, 10% RTU loss: time per conn"),
                value: point.ns_per_conn.map_or_else(|| "not run".to_string(), ns),
                baseline: base
                    .and_then(|b| b.ns_per_conn)
                    .map_or_else(|| "-".to_string(), |b| format!("1k: {}", ns(b))),
                ratio: ratio(point.ns_per_conn, base.and_then(|b| b.ns_per_conn)),
                target: format!("flat (ratio ≤ {FLAT_RATIO})"),
                machine: machine.to_string(),
                note: format!("{verdict}{note}"),
            });
            rows.push(Row {
                figure: format!("SimFabric {label} conns: peak heap per conn"),
                value: point
                    .bytes_per_conn
                    .map_or_else(|| "not run".to_string(), |b| format!("{b:.0} B")),
                baseline: base
                    .and_then(|b| b.bytes_per_conn)
                    .map_or_else(|| "-".to_string(), |b| format!("1k: {b:.0} B")),
                ratio: ratio(point.bytes_per_conn, base.and_then(|b| b.bytes_per_conn)),
                target: "flat (ratio ≈ 1)".to_string(),
                machine: machine.to_string(),
                note: "peak heap of one whole run / connections".to_string(),
            });
        }

        // Real-device figures: criterion estimates on a device, or the benches' skip.
        let vm_machine = &cm_testkit::vm_machine(Some(super::VM_BENCH_BUILD));
        let vm_machine = vm_machine.as_str();
        for (key, figure, target) in [
            (
                cm_testkit::figure_keys::REAL_NOTIFY,
                "cm-sys notify / raw rdma_notify",
                "≤ 1.02",
            ),
            (
                cm_testkit::figure_keys::REAL_TRIGGER_TO_ESTABLISHED,
                "trigger→ESTABLISHED: pump / raw loop",
                "≤ 1.05",
            ),
            (
                cm_testkit::figure_keys::REAL_API_TO_ESTABLISHED,
                "send→ESTABLISHED: Endpoint API / hand loop",
                "≤ 1.05",
            ),
            (
                cm_testkit::figure_keys::REAL_API_BUSY_TO_ESTABLISHED,
                "send→ESTABLISHED: busy-polling API / spinning hand loop",
                "≤ 1.05",
            ),
            (
                cm_testkit::figure_keys::REAL_SETUP,
                "connection setup per step (cmtime-like)",
                "-",
            ),
            (
                cm_testkit::figure_keys::REAL_DATA_PATH,
                "data path: Endpoint / perftest",
                "report",
            ),
            (
                cm_testkit::figure_keys::REAL_SETUP_VS_CMTIME,
                "cmtime client: cmnotify server against cmtime server",
                "≤ 1.0",
            ),
            (
                cm_testkit::figure_keys::REAL_SETUP_INSTRUCTIONS,
                "user-space instructions per connection: cmnotify server / cmtime server",
                "≤ 1.10",
            ),
            (
                cm_testkit::figure_keys::REAL_SETUP_ENDPOINTS,
                "accepts per second: cmnotify server, 2 endpoints on 2 threads / 1",
                "report",
            ),
        ] {
            let is_part = |k: &str| k == key || k.starts_with(&format!("{key}/"));
            let matching: Vec<(&String, &Figure, &str)> = self
                .extra
                .iter()
                .map(|(k, e)| (k, e, machine))
                .chain(self.vm.iter().map(|(k, e)| (k, e, vm_machine)))
                .filter(|(k, _, _)| is_part(k))
                .collect();
            // The host's "no device" skip says nothing once the VM measured the figure.
            let measured_in_vm = self.vm.iter().any(|(k, e)| is_part(k) && e.value.is_some());
            let matching: Vec<_> = matching
                .into_iter()
                .filter(|(_, e, m)| !(measured_in_vm && e.value.is_none() && *m != vm_machine))
                .collect();
            if matching.is_empty() {
                rows.push(Row {
                    figure: figure.to_string(),
                    value: "not run".to_string(),
                    baseline: "-".to_string(),
                    ratio: "-".to_string(),
                    target: target.to_string(),
                    machine: machine.to_string(),
                    note: "no figure from the benches".to_string(),
                });
            }
            for (k, e, machine) in matching {
                let is_ratio = e.unit == "ratio";
                rows.push(Row {
                    figure: if k == key {
                        figure.to_string()
                    } else {
                        format!("{figure}: {}", &k[key.len() + 1..])
                    },
                    value: match (e.value, is_ratio) {
                        (None, _) => "skipped".to_string(),
                        (Some(_), true) => "-".to_string(),
                        (Some(v), false) if e.unit == "ns" => ns(v),
                        (Some(v), false) => format!("{v} {}", e.unit),
                    },
                    baseline: "-".to_string(),
                    ratio: match (e.value, is_ratio) {
                        (Some(v), true) => format!("{v:.3}"),
                        _ => "-".to_string(),
                    },
                    target: if is_ratio || e.value.is_none() {
                        target.to_string()
                    } else {
                        "-".to_string()
                    },
                    machine: machine.to_string(),
                    note: e.note.clone(),
                });
            }
        }
        rows
    }
}

pub(super) fn render_markdown(rows: &[Row], machine: &str, smoke: bool) -> String {
    let mut text = String::from("# Notify path benchmarks\n\n");
    text.push_str(&format!(
        "Machine: {machine}. Times are criterion medians{}. Ratio = figure / baseline.\n\n",
        if smoke {
            " in smoke mode (short samples: indicative only)"
        } else {
            ""
        }
    ));
    text.push_str("| figure | value | baseline | ratio | target | machine | note |\n");
    text.push_str("|---|---|---|---|---|---|---|\n");
    for r in rows {
        text.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.figure,
            r.value,
            r.baseline,
            r.ratio,
            r.target,
            r.machine,
            r.note.replace('|', "/")
        ));
    }
    text.push_str(
        "\nScale curve: bench-scale.svg. Criterion's HTML report: criterion/report/index.html.\n",
    );
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::estimates::parse_results;
    use crate::bench::svg::render_svg;

    #[test]
    fn scale_growth_past_the_flat_ratio_is_called_so() {
        let mut estimates = BTreeMap::new();
        estimates.insert("scale/1000".to_string(), 10e6);
        estimates.insert("scale/100000".to_string(), 1_440e6);
        let figures = Figures {
            estimates,
            extra: BTreeMap::new(),
            vm: BTreeMap::new(),
        };
        let rows = figures.rows("test machine");
        let time_row = |label: &str| {
            rows.iter()
                .find(|r| r.figure.contains(&format!("{label} conns, 10% RTU loss")))
                .unwrap()
        };
        assert!(time_row("100k").note.starts_with("not flat: 1.440x"));
        assert!(!time_row("100k").note.contains("same work"));
        assert!(!time_row("1k").note.contains("flat"));
    }

    #[test]
    fn scale_growth_with_constant_work_is_called_linear_and_still_not_flat() {
        let mut estimates = BTreeMap::new();
        estimates.insert("scale/1000".to_string(), 10e6);
        estimates.insert("scale/100000".to_string(), 1_400e6);
        let work = |w: f64| {
            parse_results(&format!(
                "scale/1000/work_per_conn\t20\tcount\t\nscale/100000/work_per_conn\t{w}\tcount\t\n"
            ))
        };
        let note_at_100k = |extra| {
            let figures = Figures {
                estimates: estimates.clone(),
                extra,
                vm: BTreeMap::new(),
            };
            let rows = figures.rows("test machine");
            rows.iter()
                .find(|r| r.figure.contains("100k conns, 10% RTU loss"))
                .unwrap()
                .note
                .clone()
        };
        let same = note_at_100k(work(20.1));
        assert!(same.starts_with("not flat: 1.400x"), "{same}");
        assert!(same.contains("same work per connection (1.005x)"), "{same}");
        let more = note_at_100k(work(25.0));
        assert!(!more.contains("same work"), "{more}");
    }

    #[test]
    fn the_table_has_ratios_and_scale_rows() {
        let mut estimates = BTreeMap::new();
        estimates.insert("notify/direct".to_string(), 5.0);
        estimates.insert("pump/comm_est".to_string(), 40.0);
        estimates.insert("scale/1000".to_string(), 10e6);
        estimates.insert("scale/10000".to_string(), 120e6);
        let extra = parse_results(
            "scale/1000/peak_bytes_per_conn\t1000\tbytes\t\nscale/100000\tskipped\t\tsmoke mode\n\
             real/trigger_to_established\tskipped\t\tno RDMA device\n\
             real/setup\tskipped\t\tno RDMA device\n",
        );
        let figures = Figures {
            estimates,
            extra,
            vm: parse_results(
                "real/trigger_to_established\t1.01\tratio\tpump / hand\n\
                 real/api_to_established\t1.03\tratio\tapi / hand\n\
                 real/api_to_established/api\t300000\tns\tVM\n",
            ),
        };
        let rows = figures.rows("test machine");
        let pump = rows
            .iter()
            .find(|r| r.figure.starts_with("pumped COMM_EST ("))
            .unwrap();
        assert_eq!(pump.ratio, "8.00");
        assert_eq!(pump.value, "40.0 ns");
        let ten_k = rows
            .iter()
            .find(|r| r.figure.contains("10k conns, 10% RTU loss"))
            .unwrap();
        assert_eq!(ten_k.ratio, "1.20");
        assert!(ten_k.note.starts_with("flat (1.200x"), "{}", ten_k.note);
        let hundred_k = rows
            .iter()
            .find(|r| r.figure.contains("100k conns, 10% RTU loss"))
            .unwrap();
        assert_eq!(hundred_k.value, "not run");
        assert!(hundred_k.note.contains("smoke mode"));
        let vm_row = rows.iter().find(|r| r.machine.starts_with("VM")).unwrap();
        assert_eq!(vm_row.ratio, "1.010");
        let api = rows
            .iter()
            .find(|r| r.figure == "send→ESTABLISHED: Endpoint API / hand loop")
            .unwrap();
        assert_eq!(
            (api.ratio.as_str(), api.target.as_str()),
            ("1.030", "≤ 1.05")
        );
        let api_median = rows
            .iter()
            .find(|r| r.figure == "send→ESTABLISHED: Endpoint API / hand loop: api")
            .unwrap();
        assert_eq!(api_median.value, "300.00 µs");
        // The host's skip goes where the VM measured the figure, stays where it did not.
        let trigger_rows = rows
            .iter()
            .filter(|r| r.figure.starts_with("trigger→ESTABLISHED"))
            .count();
        assert_eq!(trigger_rows, 1);
        assert!(rows
            .iter()
            .any(|r| r.figure.starts_with("connection setup") && r.value == "skipped"));
        let markdown = render_markdown(&rows, "test machine", true);
        assert!(markdown.contains("| figure | value | baseline | ratio |"));
        let svg = render_svg(&figures.scale_points());
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("polyline"));
    }
}
