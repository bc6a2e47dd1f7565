//! What the pump's device tests share: the teardown of a pumped connection.
#![allow(dead_code)] // each test binary uses its own part

use cm_core::CmEventType;
use cm_verbs::NotifyPump;

use crate::common::{expect_event, EarlySender};

/// Both sides disconnect, each answering the other's DISCONNECTED; the pump gives the id
/// back.
pub(crate) fn teardown(conn: &EarlySender, pump: &mut NotifyPump<cm_sys::CmId>) {
    conn.active.disconnect().expect("active disconnect");
    let disconnected = expect_event(&conn.server, CmEventType::Disconnected);
    assert_eq!(
        pump.on_cm_event(disconnected.event_type(), disconnected.qp_num()),
        Some(conn.passive.clone())
    );
    disconnected.ack().expect("ack");
    conn.passive.disconnect().expect("passive disconnect");
    expect_event(&conn.client, CmEventType::Disconnected)
        .ack()
        .expect("ack");
    assert!(pump.is_empty());
}
