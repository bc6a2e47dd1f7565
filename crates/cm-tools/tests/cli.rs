//! The `cmnotify` binary: its output, its JSON, its refusals.

use std::process::{Command, Output};

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
    assert!(out.status.success(), "{out:?}");
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
fn bad_input_is_one_line_and_status_2() {
    let cases: &[&[&str]] = &[
        &["--rtu-loss", "1.5"],
        &["--rtu-loss", "lots"],
        &["-c", "0"],
        &["--trace", "100", "-c", "10"],
        &["--drop-rtu-of", "10", "-c", "10"],
        &["--backend", "infiniband"],
        &["--server"],
        &["--backend", "rdma", "--soft-roce"],
        &["--no-such-flag"],
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
        "--json",
        "--server",
        "--bind",
        "--address",
        "--port",
    ] {
        assert!(text.contains(flag), "--help lacks {flag}: {text}");
    }
}
