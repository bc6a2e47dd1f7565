//! `log` users keep working: with no tracing subscriber in the process, the endpoint's
//! events reach a `log` logger (tracing's log bridge), each line naming its connection.
//! A process of its own: a logger is global.

#[path = "common/sim.rs"]
mod sim;

use std::sync::Mutex;

use cm_verbs::{ConnectOptions, EndpointOptions, Event};
use sim::{listening, SimEndpoints};

struct Lines(Mutex<Vec<(log::Level, String)>>);

impl log::Log for Lines {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        self.0
            .lock()
            .unwrap()
            .push((record.level(), record.args().to_string()));
    }

    fn flush(&self) {}
}

static LINES: Lines = Lines(Mutex::new(Vec::new()));

#[test]
fn a_log_logger_sees_each_step_with_its_connection() {
    log::set_logger(&LINES).unwrap();
    log::set_max_level(log::LevelFilter::Debug);
    let SimEndpoints {
        fabric,
        mut server,
        mut client,
        addr,
    } = listening(42, 7493, EndpointOptions::default());
    let out = client.connect(addr, ConnectOptions::default()).unwrap();
    let mut established = false;
    for _ in 0..10_000 {
        while server.poll().unwrap().is_some() {}
        while let Some(event) = client.poll().unwrap() {
            established |= matches!(event, Event::Established { .. });
        }
        if established || !fabric.step() {
            break;
        }
    }
    assert!(established);
    let lines = LINES.0.lock().unwrap().clone();
    let about = format!("conn={out}");
    for step in ["resolving the address", "connecting", "established"] {
        assert!(
            lines.iter().any(|(level, line)| *level == log::Level::Debug
                && line.starts_with(step)
                && line.contains(&about)),
            "a debug line `{step} ... {about}`: {lines:#?}"
        );
    }
}
