//! The figures criterion does not produce itself, appended as tab-separated lines
//! `key<TAB>value<TAB>unit<TAB>note` to `results.tsv` in the output folder, which
//! `cargo xtask bench` empties before a run and reads after it.

use std::io::Write;
use std::path::PathBuf;

/// The output folder: `CMNOTIFY_BENCH_OUT`, else `cm-benches` in the cargo target folder.
pub fn out_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CMNOTIFY_BENCH_OUT") {
        return PathBuf::from(dir);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("cm-benches")
}

/// The results file in [`out_dir`].
pub fn results_file() -> PathBuf {
    out_dir().join("results.tsv")
}

/// One figure.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    /// Stable key, `group/name` (e.g. `scale/1000/peak_bytes_per_conn`).
    pub key: String,
    /// The value; `None` for a skipped figure.
    pub value: Option<f64>,
    /// Unit of the value (`ns`, `bytes`, `count`, `ratio`).
    pub unit: String,
    /// Free text: what it is, or why it was skipped.
    pub note: String,
}

impl Figure {
    /// A measured figure.
    pub fn measured(key: &str, value: f64, unit: &str, note: &str) -> Figure {
        Figure {
            key: key.to_string(),
            value: Some(value),
            unit: unit.to_string(),
            note: note.to_string(),
        }
    }

    /// A figure that was not measured, and why.
    pub fn skipped(key: &str, reason: &str) -> Figure {
        Figure {
            key: key.to_string(),
            value: None,
            unit: String::new(),
            note: reason.to_string(),
        }
    }

    /// The tab-separated line (tabs and newlines in the note become spaces).
    pub fn to_line(&self) -> String {
        let value = self
            .value
            .map_or_else(|| "skipped".to_string(), |v| v.to_string());
        let note = self.note.replace(['\t', '\n'], " ");
        format!("{}\t{value}\t{}\t{note}", self.key, self.unit)
    }

    /// Parses a line written by [`Figure::to_line`].
    pub fn from_line(line: &str) -> Option<Figure> {
        let mut parts = line.splitn(4, '\t');
        let key = parts.next()?.to_string();
        let value = parts.next()?;
        let unit = parts.next()?.to_string();
        let note = parts.next().unwrap_or("").to_string();
        let value = match value {
            "skipped" => None,
            v => Some(v.parse().ok()?),
        };
        Some(Figure {
            key,
            value,
            unit,
            note,
        })
    }
}

/// Appends `figure` to the results file and echoes it on stderr.
pub fn record(figure: &Figure) {
    let line = figure.to_line();
    eprintln!("cm-benches: {line}");
    let path = results_file();
    let written = std::fs::create_dir_all(out_dir()).and_then(|()| {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        writeln!(file, "{line}")
    });
    if let Err(e) = written {
        eprintln!("cm-benches: cannot write {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_survive_their_line_format() {
        let measured = Figure::measured("pump/allocations", 0.0, "count", "after\twarm-up");
        let back = Figure::from_line(&measured.to_line()).unwrap();
        assert_eq!(back.value, Some(0.0));
        assert_eq!(back.note, "after warm-up");
        let skipped = Figure::skipped("real/notify", "no RDMA device");
        assert_eq!(Figure::from_line(&skipped.to_line()), Some(skipped));
        assert_eq!(Figure::from_line("no tabs"), None);
        assert_eq!(Figure::from_line("k\tnot-a-number\tns\t"), None);
    }
}
