//! The connection parameters `rdma_connect` and `rdma_accept` carry besides private
//! data (`struct rdma_conn_param`), as a checked domain type.

use crate::CmError;

/// RDMA READ/atomic depths and retry counts of one side of a connection, given to
/// `rdma_connect` (sent in the REQ) or `rdma_accept` (sent in the REP).
///
/// What the kernel's IB CM makes of them (`drivers/infiniband/core/cm.c`) is not
/// symmetric: the REP's values win for the depths, the REQ's for the transport retries.
///
/// | QP attribute | active side's QP | passive side's QP |
/// |---|---|---|
/// | `max_rd_atomic` (reads it issues) | passive's `responder_resources` | passive's `initiator_depth` |
/// | `max_dest_rd_atomic` (reads it serves) | passive's `initiator_depth` | passive's `responder_resources` |
/// | `retry_cnt` | active's `retry_count` | active's `retry_count` |
/// | `rnr_retry` | passive's `rnr_retry_count` | active's `rnr_retry_count` |
///
/// So the passive side decides both directions' read depths: the active side's depths
/// reach it only as what its CONNECT_REQUEST asks for (librdmacm's own default, the
/// device's maximum capped by the request, is not what an explicit value does). Some
/// devices round a depth up (soft-RoCE: to a power of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectionParams {
    /// RDMA READs and atomics this side serves at once as responder (the QP's
    /// `max_dest_rd_atomic`). librdmacm refuses (EINVAL) more than the device's
    /// `max_qp_rd_atom`; [`ConnectionParams::DEVICE_MAX`] asks for that maximum (when
    /// accepting, capped by the request's initiator depth).
    pub responder_resources: u8,
    /// RDMA READs and atomics this side has outstanding at once as initiator (the QP's
    /// `max_rd_atomic`): more wait in the send queue. librdmacm refuses (EINVAL) more
    /// than the device's `max_qp_init_rd_atom`; [`ConnectionParams::DEVICE_MAX`] asks
    /// for that maximum (when accepting, capped by the request's responder resources).
    pub initiator_depth: u8,
    /// Transport retries (lost packet, no ACK within the local ACK timeout) before a
    /// send completes with [`WcStatus::RetryExcErr`](crate::WcStatus::RetryExcErr) and the connection fails: 0 to 7.
    /// Only the active side's value is used, for both QPs.
    pub retry_count: u8,
    /// Retries after the peer answered "receiver not ready" (no receive posted): 0 to
    /// 7, where 7 means forever: a reader that stops taking messages stalls its peer's
    /// sends with no error. Below 7, the peer's send completes with
    /// [`WcStatus::RnrRetryExcErr`](crate::WcStatus::RnrRetryExcErr) once the retries are spent and the connection fails.
    /// Each side's value bounds the retries of the *other* side's sends.
    pub rnr_retry_count: u8,
    /// The RNR NAK timer this side's QP advertises: how long a peer whose send found no
    /// receive posted here waits before it retries (the IB encoding, 0 to 31: 1 is
    /// 0.01 ms, 14 is 1.28 ms, 31 is 491.52 ms, 0 is 655.36 ms). `None`: the IB CM's
    /// choice at RTR. Set on this side's QP once it is in RTS (after `rdma_accept`
    /// returns on the passive side, at ESTABLISHED on the active side), since librdmacm
    /// moves the QP through RTR itself; a receive refused before then is answered
    /// with the CM's value. Not used on iWARP, which has no RNR NAK, nor on a QP the
    /// application made.
    pub min_rnr_timer: Option<u8>,
}

impl Default for ConnectionParams {
    /// One outstanding read each way, 7 transport retries, RNR retries forever.
    fn default() -> Self {
        ConnectionParams {
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            min_rnr_timer: None,
        }
    }
}

impl ConnectionParams {
    /// The largest retry count (3 bits on the wire); for `rnr_retry_count` it means
    /// forever.
    pub const MAX_RETRY: u8 = 7;
    /// The largest RNR NAK timer encoding (5 bits).
    pub const MAX_MIN_RNR_TIMER: u8 = 31;

    /// librdmacm's `RDMA_MAX_RESP_RES` / `RDMA_MAX_INIT_DEPTH`: as a depth, the
    /// device's maximum (`max_qp_rd_atom`, `max_qp_init_rd_atom`).
    pub const DEVICE_MAX: u8 = u8::MAX;

    /// Checks the retry counts (0 to 7); the depths take any `u8`, the device's limits
    /// being librdmacm's to check (EINVAL from connect or accept).
    pub fn validate(&self) -> Result<(), CmError> {
        let invalid = |reason| {
            Err(CmError::InvalidArgument {
                op: "ConnectionParams",
                reason,
            })
        };
        if self.retry_count > Self::MAX_RETRY {
            return invalid("retry_count above 7");
        }
        if self.rnr_retry_count > Self::MAX_RETRY {
            return invalid("rnr_retry_count above 7");
        }
        if self
            .min_rnr_timer
            .is_some_and(|t| t > Self::MAX_MIN_RNR_TIMER)
        {
            return invalid("min_rnr_timer above 31");
        }
        Ok(())
    }

    /// Whether a receiver that is not ready stalls the peer forever
    /// (`rnr_retry_count` 7) rather than failing its send.
    pub const fn rnr_retries_forever(&self) -> bool {
        self.rnr_retry_count >= Self::MAX_RETRY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_librdmacm_callers_usual_values() {
        let params = ConnectionParams::default();
        assert_eq!(
            (
                params.responder_resources,
                params.initiator_depth,
                params.retry_count,
                params.rnr_retry_count
            ),
            (1, 1, 7, 7)
        );
        assert_eq!(params.validate(), Ok(()));
        assert!(params.rnr_retries_forever());
    }

    #[test]
    fn retry_counts_above_seven_and_timers_above_31_are_refused() {
        for bad in [
            ConnectionParams {
                retry_count: 8,
                ..ConnectionParams::default()
            },
            ConnectionParams {
                rnr_retry_count: 255,
                ..ConnectionParams::default()
            },
            ConnectionParams {
                min_rnr_timer: Some(32),
                ..ConnectionParams::default()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(CmError::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
        let edge = ConnectionParams {
            responder_resources: ConnectionParams::DEVICE_MAX,
            initiator_depth: 0,
            retry_count: 0,
            rnr_retry_count: 0,
            min_rnr_timer: Some(ConnectionParams::MAX_MIN_RNR_TIMER),
        };
        assert_eq!(edge.validate(), Ok(()));
        assert!(!edge.rnr_retries_forever());
    }
}
