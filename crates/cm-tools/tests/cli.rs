//! The `cmnotify` binary: its output, its JSON, its refusals.

use std::process::{Command, Output, Stdio};

fn cmnotify(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cmnotify"))
        .args(args)
        .output()
        .expect("cmnotify runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn default_run_shows_connections_rescued_by_notify() {
    let out = cmnotify(&[]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    let rescued = text
        .lines()
        .find(|l| l.contains("rescued by notify"))
        .expect("a rescued line");
    assert!(rescued.contains(" 100 "), "{text}");
    assert!(text.contains("exactly-once violations 0"), "{text}");
}

#[test]
fn without_the_pump_the_server_ends_unreachable() {
    let out = cmnotify(&["--no-pump", "-c", "20"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "every connection failed: {out:?}"
    );
    let text = stdout(&out);
    assert!(text.contains("pump OFF"), "{text}");
    assert!(text.contains("(server UNREACHABLE: 20)"), "{text}");
}

#[test]
fn json_output_is_stable() {
    let out = cmnotify(&["--json", "-c", "50", "--rtu-loss", "10%", "--seed", "7"]);
    assert!(out.status.success(), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    let fields = [
        "backend",
        "connections",
        "seed",
        "rtu_loss",
        "pump",
        "soft_roce",
        "send_data",
        "established",
        "via_rtu",
        "via_notify",
        "already_established_races",
        "failed",
        "unreachable",
        "invariant_violations",
        "notify_failed",
        "notify_failed_retriable",
        "notify_errors",
        "comm_est_ignored",
        "rtus_sent",
        "messages_dropped",
        "late_rtus",
        "trigger_to_established_us",
        "virtual_seconds",
        "teardown_failures",
    ];
    let object = json.as_object().expect("an object");
    for field in fields {
        assert!(object.contains_key(field), "missing {field}: {json}");
    }
    assert_eq!(
        object.len(),
        fields.len(),
        "new fields must be added to this list: {json}"
    );
    assert_eq!(json["backend"], "sim");
    assert_eq!(json["connections"], 50);
    assert_eq!(json["established"], 50);
    assert_eq!(json["invariant_violations"], 0);
    // `notify_errors` is the first name of `notify_failed`, kept for older readers.
    assert_eq!(json["notify_errors"], json["notify_failed"]);
    assert!(json.get("trace").is_none(), "no trace unless asked: {json}");
    let via = json["via_rtu"].as_u64().unwrap() + json["via_notify"].as_u64().unwrap();
    assert_eq!(via, 50);
    assert!(
        json["via_notify"].as_u64().unwrap() > 0,
        "10% loss rescues some: {json}"
    );
    // Same seed, same document.
    let again = cmnotify(&["--json", "-c", "50", "--rtu-loss", "10%", "--seed", "7"]);
    assert_eq!(out.stdout, again.stdout);
}

#[test]
fn trace_prints_one_connections_timeline() {
    let out = cmnotify(&["-c", "3", "--trace", "1"]);
    let text = stdout(&out);
    assert!(text.contains("timeline of connection 1"), "{text}");
    assert!(text.contains("conn1 RTU dropped"), "{text}");
    assert!(
        text.contains("notify(communication established) = Ok(Established)"),
        "{text}"
    );
    assert!(!text.contains("conn0 "), "only connection 1: {text}");
}

#[test]
fn ladder_draws_the_readme_picture_and_the_text_to_stdout() {
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-ladder.svg");
    let path = file.to_str().expect("a UTF-8 path");
    // The command next to the picture in the README.
    let out = cmnotify(&["-c", "1", "--trace", "0", "--ladder", path]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout(&out).contains("rescued by notify"),
        "the usual summary too"
    );
    let committed = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/ladder-lost-rtu.svg"
    );
    assert!(
        std::fs::read(&file).expect("the SVG is written")
            == std::fs::read(committed).expect("the README's picture"),
        "the README's command draws the README's picture"
    );
    let out = cmnotify(&["-c", "1", "--trace", "0", "--ladder", "-"]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    assert!(
        text.starts_with("connection 0: RTU lost, rescued by rdma_notify\n"),
        "{text}"
    );
    assert!(text.contains("rdma_notify(COMM_EST) = 0"), "{text}");
    assert!(!text.contains("rescued by notify "), "no summary: {text}");
}

#[test]
fn refusals_are_one_line_and_status_2() {
    let cases: &[&[&str]] = &[
        &["--trace", "100", "-c", "10"],
        &["--drop-rtu-of", "10", "-c", "10"],
        &["--server"],
        &["--backend", "rdma", "--soft-roce"],
        &["--ladder", "x.svg"],
        &["--trace", "0", "--ladder", "-", "--json"],
        // Flags the simulated backend would silently ignore.
        &["-p", "9000"],
        &["--port", "9000"],
        &["-S", "10"],
    ];
    for args in cases {
        let out = cmnotify(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("cmnotify: "), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn syntax_errors_keep_clap_s_whole_message_and_status_2() {
    let cases: &[(&[&str], &str)] = &[
        (&["--rtu-loss", "1.5"], "outside 0..1"),
        (&["--rtu-loss", "lots"], "not a number"),
        (&["-c", "0"], "--connections"),
        (&["--backend", "infiniband"], "possible values"),
        (&["--no-such-flag"], "Usage:"),
        // Negative numbers: clap's explanation, naming the flag, is the useful part.
        (
            &["-c", "-5"],
            "invalid value '-5' for '--connections <CONNECTIONS>'",
        ),
        (&["--seed", "-3"], "invalid value '-3' for '--seed <SEED>'"),
        (&["--rtu-loss", "-0.1"], "`-0.1` is outside 0..1"),
    ];
    for (args, wanted) in cases {
        let out = cmnotify(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(err.contains(wanted), "{args:?} lacks {wanted:?}: {err}");
        assert!(err.contains("--help"), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[cfg(not(feature = "rdma"))]
#[test]
fn a_missing_rdma_backend_is_said_first() {
    for args in [
        &["--backend", "rdma"][..],
        &["--backend", "rdma", "--seed", "3"],
    ] {
        let out = cmnotify(args);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--features rdma"), "{err}");
        assert!(!err.contains("--address"), "{err}");
        assert!(!err.contains("--seed"), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
}

#[cfg(feature = "rdma")]
#[test]
fn flags_the_real_backend_would_ignore_are_refused() {
    for (args, flag) in [
        (
            &["--backend", "rdma", "-s", "--rtu-loss", "0"][..],
            "--rtu-loss",
        ),
        (&["--backend", "rdma", "-s", "--seed", "3"][..], "--seed"),
        (
            &["--backend", "rdma", "-a", "10.0.0.1", "--no-data"][..],
            "--no-data",
        ),
    ] {
        let out = cmnotify(args);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with(&format!("cmnotify: {flag}")), "{err}");
    }
}

#[test]
fn exit_status_is_0_when_all_established_1_when_some_failed() {
    assert_eq!(cmnotify(&["-c", "5"]).status.code(), Some(0));
    // No data and every RTU lost: nothing can rescue connection 0.
    let out = cmnotify(&[
        "-c",
        "3",
        "--rtu-loss",
        "0",
        "--drop-rtu-of",
        "0",
        "--no-data",
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        stdout(&out).contains("failed                      1"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn a_closed_stdout_ends_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cmnotify"))
        .args(["-c", "2000", "--json", "--trace", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cmnotify runs");
    // Close the reading end before cmnotify writes: its write meets EPIPE.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("cmnotify ends");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.is_empty(), "{err}");
}

#[cfg(target_os = "linux")]
#[test]
fn a_full_disk_is_one_line_and_status_1() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full exists on Linux");
    let out = Command::new(env!("CARGO_BIN_EXE_cmnotify"))
        .args(["-c", "5"])
        .stdout(full)
        .output()
        .expect("cmnotify runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.starts_with("cmnotify: cannot write the output: "),
        "{err}"
    );
}

#[test]
fn json_and_trace_combine() {
    let out = cmnotify(&["--json", "-c", "3", "--trace", "1"]);
    assert!(out.status.success(), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    let lines: Vec<&str> = json["trace"]
        .as_array()
        .expect("a trace array")
        .iter()
        .map(|l| l.as_str().expect("a line"))
        .collect();
    assert!(
        lines.iter().any(|l| l.contains("conn1 RTU dropped")),
        "{lines:?}"
    );
    assert!(!lines.iter().any(|l| l.contains("conn0 ")), "{lines:?}");
}

#[test]
fn minus_zero_loss_prints_as_zero() {
    let out = cmnotify(&["-c", "2", "--rtu-loss=-0"]);
    let text = stdout(&out);
    assert!(text.contains("RTU loss 0%"), "{text}");
    assert!(!text.contains("-0%"), "{text}");
    let out = cmnotify(&["-c", "2", "--rtu-loss=-0", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(json["rtu_loss"].to_string(), "0.0");
}

#[test]
fn a_repeated_drop_rtu_of_counts_once() {
    let out = cmnotify(&[
        "-c",
        "4",
        "--rtu-loss",
        "0",
        "--drop-rtu-of",
        "2",
        "--drop-rtu-of",
        "2",
        "--drop-rtu-of",
        "2",
    ]);
    let text = stdout(&out);
    assert!(text.contains("RTU dropped on [2],"), "{text}");
}

#[test]
fn help_documents_every_flag() {
    let out = cmnotify(&["--help"]);
    assert!(out.status.success());
    let text = stdout(&out);
    for flag in [
        "--backend",
        "--connections",
        "--rtu-loss",
        "--drop-rtu-of",
        "--no-data",
        "--no-pump",
        "--soft-roce",
        "--seed",
        "--trace",
        "--ladder",
        "--json",
        "--server",
        "--bind",
        "--address",
        "--port",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}: {text}");
    }
    assert!(text.contains("Exit status:"), "{text}");
    for code in [
        "  0  every connection",
        "  1  some connection failed",
        "  2  usage",
    ] {
        assert!(text.contains(code), "--help lacks {code:?}: {text}");
    }
}

#[test]
fn capture_draws_the_real_kernels_ladder_without_running_anything() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/vm-ladder-6.1.txt"
    );
    let out = cmnotify(&["--capture", fixture, "--ladder", "-"]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    assert!(
        text.starts_with("connection 0 (kernel 6.1.0-57-amd64, stock rxe): RTU lost, rescued"),
        "{text}"
    );
    assert!(text.contains("*  rdma_notify(COMM_EST) = 0"), "{text}");
    // The summary closes the output, for a script to check.
    assert!(
        text.ends_with("stock rxe): RTU lost, rescued by rdma_notify\n"),
        "{text}"
    );
    let svg = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-vm-ladder.svg");
    let out = cmnotify(&["--capture", fixture, "--ladder", svg.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(std::fs::read_to_string(&svg)
        .unwrap()
        .contains("data-origin=\"kernel\""));
    for (args, says) in [
        (
            &["--capture", fixture, "--ladder", "-", "--json"][..],
            "--json does not go",
        ),
        (
            &["--capture", "/nonexistent", "--ladder", "-"][..],
            "cannot read",
        ),
    ] {
        let out = cmnotify(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    }
    let out = cmnotify(&["--capture", fixture]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "--capture needs --ladder: {out:?}"
    );
}
