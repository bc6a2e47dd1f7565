//! Connection parameters and id options on a simulated id: given to connect, accept
//! and `rdma_set_option`, and kept, so that a test can check what a connection layer
//! passed down.

use cm_core::{CmError, ConnectionParams, IdOption, IdOptions};

use super::{ConnId, SimCmId};

impl SimCmId {
    /// `rdma_connect` with connection parameters (route resolved and QP created);
    /// returns the connection's number. The fabric records the parameters as given
    /// ([`SimCmId::conn_params`]; the kernel would cap the retry counts at 7); its
    /// messages do not depend on them.
    pub fn connect_with(
        &self,
        private_data: &[u8],
        params: &ConnectionParams,
    ) -> Result<ConnId, CmError> {
        self.with(|f| f.connect(self.key, private_data, params))
    }

    /// `rdma_accept` with connection parameters on an id from CONNECT_REQUEST: QP to RTR
    /// and RTS, REP sent. The fabric records the parameters ([`SimCmId::conn_params`]).
    pub fn accept_with(
        &self,
        private_data: &[u8],
        params: &ConnectionParams,
    ) -> Result<(), CmError> {
        self.with(|f| f.accept(self.key, private_data, params))
    }

    /// The parameters this id was last connected or accepted with (the default for an
    /// id that made neither call, as for one that used the default); `None` once the
    /// id is destroyed.
    pub fn conn_params(&self) -> Option<ConnectionParams> {
        self.with(|f| f.conn_params(self.key))
    }

    /// `rdma_set_option(RDMA_OPTION_ID, ..)`: checked as the kernel does (an address
    /// option after bind is EINVAL) and recorded ([`SimCmId::id_options`]).
    pub fn set_option(&self, option: IdOption) -> Result<(), CmError> {
        self.with(|f| f.set_option(self.key, option))
    }

    /// What `rdma_set_option` set on this id; `None` once the id is destroyed.
    pub fn id_options(&self) -> Option<IdOptions> {
        self.with(|f| f.id_options(self.key))
    }
}
