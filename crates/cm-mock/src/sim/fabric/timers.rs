//! The ids' timers: retransmission of a REQ, REP or DREQ, its extension by an MRA,
//! and TIMEWAIT. One timer per id; bumping its generation cancels the pending one.

use cm_core::IbCmState;

use super::{nanos, Action, Fabric, IdState};
use crate::sim::types::{MsgKind, SimIdKey};

impl Fabric {
    pub(super) fn cancel_timer(&mut self, key: SimIdKey) {
        if let Some(id) = self.id_mut(key) {
            id.timer_gen = id.timer_gen.wrapping_add(1);
            id.state.set_retrying(None);
        }
    }

    pub(super) fn start_retry(&mut self, key: SimIdKey, kind: MsgKind) {
        let timeout = nanos(self.config.cm_response_timeout);
        let retries = self.config.max_cm_retries;
        let Some(id) = self.id_mut(key) else { return };
        id.timer_gen = id.timer_gen.wrapping_add(1);
        id.state.set_retrying(Some(kind));
        id.state.set(IdState::MRA_TIMEOUT, false);
        let gen = id.timer_gen;
        self.set_retries(key, retries);
        self.schedule(timeout, Action::Timer { id: key, gen });
    }

    /// An MRA: the peer needs more time; the pending message's timeout becomes the
    /// MRA's service timeout (for this and later retries).
    pub(super) fn extend_retry(&mut self, key: SimIdKey) {
        let timeout = nanos(self.config.mra_service_timeout);
        let Some(id) = self.id_mut(key) else { return };
        id.timer_gen = id.timer_gen.wrapping_add(1);
        id.state.set(IdState::MRA_TIMEOUT, true);
        let gen = id.timer_gen;
        self.schedule(timeout, Action::Timer { id: key, gen });
    }

    pub(super) fn enter_timewait(&mut self, key: SimIdKey) {
        self.set_ib(key, IbCmState::Timewait);
        let timewait = nanos(self.config.timewait);
        let Some(id) = self.id_mut(key) else { return };
        id.timer_gen = id.timer_gen.wrapping_add(1);
        id.state.set_retrying(None);
        let gen = id.timer_gen;
        self.schedule(timewait, Action::Timer { id: key, gen });
    }
}
