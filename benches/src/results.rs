//! The figures criterion does not produce itself, appended as tab-separated lines
//! `key<TAB>value<TAB>unit<TAB>note` to `results.tsv` in the output folder, which
//! `cargo xtask bench` empties before a run and reads after it.

use std::io::Write;
use std::path::PathBuf;

/// The output folder: `CMNOTIFY_BENCH_OUT`, else `cm-benches` in the cargo target folder.
pub fn out_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(cm_testkit::env::BENCH_OUT) {
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

pub use cm_testkit::Figure;

/// Appends `figure` to the results file and echoes it on stderr.
pub fn record(figure: &Figure) {
    let line = figure.to_line();
    figure.report();
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

/// Prints `figures` as the markdown table the bench binaries end with, under the
/// machine they were measured on.
pub fn print_table(machine: &str, figures: &[Figure]) {
    println!("machine: {machine}");
    println!("| figure | value | unit | note |");
    println!("|---|---|---|---|");
    for figure in figures {
        let value = figure
            .value
            .map_or_else(|| "skipped".to_string(), |v| format!("{v:.3}"));
        println!(
            "| {} | {value} | {} | {} |",
            figure.key, figure.unit, figure.note
        );
    }
}
