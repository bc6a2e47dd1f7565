//! The conformance suite on the simulated fabric, with and without COMM_EST, over a few
//! seeds.

use cm_mock::conformance::{run_all, Harness, SimHarness, Verdict};
use cm_mock::sim::SimConfig;

fn check(config: SimConfig, seed: u64) {
    let report = run_all(|| SimHarness::new(config.clone(), seed));
    let failures: Vec<String> = report
        .iter()
        .filter_map(|(name, result)| match result {
            Ok(Verdict::Passed) => None,
            Ok(Verdict::Skipped(why)) => Some(format!("{name}: skipped on the simulator: {why}")),
            Err(error) => Some(error.to_string()),
        })
        .collect();
    let backend = SimHarness::new(config, seed).describe();
    assert!(failures.is_empty(), "{backend}:\n{}", failures.join("\n"));
    assert!(report.len() >= 11);
}

#[test]
fn every_scenario_passes_with_comm_est() {
    for seed in [1, 2, 3] {
        check(SimConfig::default(), seed);
    }
}

#[test]
fn every_scenario_passes_in_soft_roce_mode() {
    for seed in [1, 2, 3] {
        check(SimConfig::soft_roce(), seed);
    }
}

#[test]
fn every_scenario_passes_without_delayed_mra() {
    let config = SimConfig {
        delayed_mra: false,
        ..SimConfig::default()
    };
    check(config, 4);
}

mod mutant {
    //! A harness whose ids answer notify wrongly in one way, to show the suite catches
    //! it and names the scenario and both answers.
    use std::time::Duration;

    use cm_core::{AsyncEvent, AsyncEventType, CmError, CmId, NotifyError, NotifyOutcome, QpNum};
    use cm_mock::conformance::{Connection, Harness, SeenEvent, Side, SimHarness};
    use cm_mock::sim::SimCmId;

    /// The bug class: EISCONN reported as a fresh forced establish.
    #[derive(Clone, Debug)]
    pub(crate) struct EisconnAsZero(pub(crate) SimCmId);

    impl CmId for EisconnAsZero {
        fn notify(&self, event: AsyncEventType) -> Result<NotifyOutcome, NotifyError> {
            match self.0.notify(event) {
                Ok(NotifyOutcome::AlreadyEstablished) => Ok(NotifyOutcome::Established),
                other => other,
            }
        }
        fn qp_num(&self) -> Option<QpNum> {
            self.0.qp_num()
        }
    }

    pub(crate) struct Mutant(pub(crate) SimHarness);

    fn unwrap(conn: &Connection<EisconnAsZero>) -> Connection<SimCmId> {
        Connection {
            active: conn.active.0.clone(),
            passive: conn.passive.0.clone(),
        }
    }

    impl Harness for Mutant {
        type Id = EisconnAsZero;
        fn describe(&self) -> String {
            format!("mutant of {}", self.0.describe())
        }
        fn raises_comm_est(&self) -> bool {
            self.0.raises_comm_est()
        }
        fn drop_rtus(&mut self, drop: bool) -> Result<(), CmError> {
            self.0.drop_rtus(drop)
        }
        fn delay_rtus(&mut self, delay: Option<Duration>) -> Result<bool, CmError> {
            self.0.delay_rtus(delay)
        }
        fn fresh_id(&mut self) -> Result<EisconnAsZero, CmError> {
            self.0.fresh_id().map(EisconnAsZero)
        }
        fn listener(&mut self) -> Result<EisconnAsZero, CmError> {
            self.0.listener().map(EisconnAsZero)
        }
        fn connect_until_rep(&mut self) -> Result<Connection<EisconnAsZero>, CmError> {
            let c = self.0.connect_until_rep()?;
            Ok(Connection {
                active: EisconnAsZero(c.active),
                passive: EisconnAsZero(c.passive),
            })
        }
        fn complete_active(&mut self, conn: &Connection<EisconnAsZero>) -> Result<(), CmError> {
            self.0.complete_active(&unwrap(conn))
        }
        fn send_from_active(&mut self, conn: &Connection<EisconnAsZero>) -> Result<(), CmError> {
            self.0.send_from_active(&unwrap(conn))
        }
        fn disconnect(
            &mut self,
            conn: &Connection<EisconnAsZero>,
            side: Side,
        ) -> Result<(), CmError> {
            self.0.disconnect(&unwrap(conn), side)
        }
        fn settle(&mut self) -> Result<(), CmError> {
            self.0.settle()
        }
        fn wait(&mut self, duration: Duration) -> Result<(), CmError> {
            self.0.wait(duration)
        }
        fn wait_for_rep_retries(&mut self) -> Result<(), CmError> {
            self.0.wait_for_rep_retries()
        }
        fn take_events(&mut self, side: Side) -> Result<Vec<SeenEvent>, CmError> {
            self.0.take_events(side)
        }
        fn take_passive_async_events(&mut self) -> Result<Vec<AsyncEvent>, CmError> {
            self.0.take_passive_async_events()
        }
        fn take_passive_completions(&mut self) -> Result<Vec<QpNum>, CmError> {
            self.0.take_passive_completions()
        }
    }
}

#[test]
fn a_wrong_backend_fails_with_the_scenario_and_both_answers() {
    let report = run_all(|| mutant::Mutant(SimHarness::new(SimConfig::default(), 1)));
    let failed: Vec<String> = report
        .iter()
        .filter_map(|(_, r)| r.as_ref().err().map(ToString::to_string))
        .collect();
    let eisconn = failed
        .iter()
        .find(|m| m.contains("rtu_first_then_notify_is_eisconn"))
        .expect("the EISCONN scenario must fail on the mutant");
    assert!(
        eisconn.contains("expected Ok(AlreadyEstablished) (EISCONN), got Ok(Established) (0)"),
        "{eisconn}"
    );
    // Scenarios that never see EISCONN still pass.
    assert!(report
        .iter()
        .any(|(name, r)| *name == "notify_on_fresh_id" && matches!(r, Ok(Verdict::Passed))));
}
