//! The figures of one run: criterion's median estimates and the results file the
//! benches write (one [`Figure`] line each).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::SystemTime;

use cm_testkit::Figure;

/// Criterion's median estimates (ns per iteration) by benchmark id (`group/name`), from
/// `estimates.json` files written after `since` (older ones are from another run).
pub(super) fn read_estimates(criterion_home: &Path, since: SystemTime) -> BTreeMap<String, f64> {
    let mut estimates = BTreeMap::new();
    let mut stack = vec![criterion_home.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let is_new_estimate = path.file_name().is_some_and(|n| n == "estimates.json")
                && path
                    .parent()
                    .and_then(Path::file_name)
                    .is_some_and(|n| n == "new");
            if !is_new_estimate {
                continue;
            }
            let fresh = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|modified| modified >= since);
            let Some(id) = path
                .parent()
                .and_then(Path::parent)
                .and_then(|bench| bench.strip_prefix(criterion_home).ok())
                .map(|id| id.to_string_lossy().replace('\\', "/"))
            else {
                continue;
            };
            let median = std::fs::read_to_string(&path)
                .ok()
                .and_then(|json| json_point_estimate(&json, "median"));
            if let (true, Some(median)) = (fresh, median) {
                estimates.insert(id, median);
            }
        }
    }
    estimates
}

/// The `point_estimate` of the statistic `name` in criterion's estimates.json, found
/// with plain string search (xtask has no dependencies).
fn json_point_estimate(json: &str, name: &str) -> Option<f64> {
    let start = json.find(&format!("\"{name}\""))?;
    let rest = &json[start..];
    let value = &rest[rest.find("\"point_estimate\"")? + "\"point_estimate\"".len()..];
    let value = value.trim_start().strip_prefix(':')?.trim_start();
    let end = value
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(value.len());
    value[..end].parse().ok()
}

/// Parses the results file (lines of [`Figure::to_line`]) into figures by key; lines
/// that do not parse are dropped.
pub(super) fn parse_results(text: &str) -> BTreeMap<String, Figure> {
    let mut map = BTreeMap::new();
    for figure in text.lines().filter_map(Figure::from_line) {
        // A measured figure wins over a skipped one of the same key (the bench binary
        // skips `real/notify`, which cm-sys's own test measures in the same VM run).
        if figure.value.is_none()
            && map
                .get(&figure.key)
                .is_some_and(|f: &Figure| f.value.is_some())
        {
            continue;
        }
        map.insert(figure.key.clone(), figure);
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    const ESTIMATES: &str = r#"{"mean":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.5,"standard_error":0.1},"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":2.0},"point_estimate":1.75e2,"standard_error":0.1}}"#;

    #[test]
    fn point_estimates_come_from_the_named_statistic() {
        assert_eq!(json_point_estimate(ESTIMATES, "median"), Some(175.0));
        assert_eq!(json_point_estimate(ESTIMATES, "mean"), Some(2.5));
        assert_eq!(json_point_estimate(ESTIMATES, "slope"), None);
    }

    #[test]
    fn results_lines_parse_and_bad_ones_are_dropped() {
        let map = parse_results(
            "scale/1000/peak_bytes_per_conn\t1182.3\tbytes\tpeak heap\nreal/notify\tskipped\t\tno RDMA device\nbroken\nx\tnan-ish\tns\t\n",
        );
        assert_eq!(map.len(), 2);
        assert_eq!(map["scale/1000/peak_bytes_per_conn"].value, Some(1182.3));
        assert_eq!(map[cm_testkit::figure_keys::REAL_NOTIFY].value, None);
        assert_eq!(
            map[cm_testkit::figure_keys::REAL_NOTIFY].note,
            "no RDMA device"
        );
        // Measured beats skipped, whichever comes first.
        for lines in [
            "real/notify\t1.01\tratio\tmeasured\nreal/notify\tskipped\t\telsewhere\n",
            "real/notify\tskipped\t\telsewhere\nreal/notify\t1.01\tratio\tmeasured\n",
        ] {
            assert_eq!(
                parse_results(lines)[cm_testkit::figure_keys::REAL_NOTIFY].value,
                Some(1.01)
            );
        }
    }
}
