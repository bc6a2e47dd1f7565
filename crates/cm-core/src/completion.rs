//! Work completions (`struct ibv_wc`): the status and opcode, decoded totally.

use core::fmt;

/// An `enum ibv_wc_status` value, decoded totally: numbers this crate does not know
/// become [`WcStatus::Unknown`].
///
/// The numbers are the libibverbs ABI and must never change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS` (0): the work request completed.
    Success,
    /// `IBV_WC_LOC_LEN_ERR` (1): a message too long for the receive buffer, or a
    /// send longer than the port allows.
    LocLenErr,
    /// `IBV_WC_LOC_QP_OP_ERR` (2): an internal QP consistency error.
    LocQpOpErr,
    /// `IBV_WC_LOC_EEC_OP_ERR` (3): an internal EE context consistency error.
    LocEecOpErr,
    /// `IBV_WC_LOC_PROT_ERR` (4): a buffer not registered for the access, or of
    /// another protection domain.
    LocProtErr,
    /// `IBV_WC_WR_FLUSH_ERR` (5): flushed, the QP being in the error state.
    WrFlushErr,
    /// `IBV_WC_MW_BIND_ERR` (6): a memory window bind failed.
    MwBindErr,
    /// `IBV_WC_BAD_RESP_ERR` (7): an unexpected transport response.
    BadRespErr,
    /// `IBV_WC_LOC_ACCESS_ERR` (8): a protection error on a local buffer of an
    /// incoming RDMA write with immediate.
    LocAccessErr,
    /// `IBV_WC_REM_INV_REQ_ERR` (9): the responder found the request invalid.
    RemInvReqErr,
    /// `IBV_WC_REM_ACCESS_ERR` (10): a protection error on the remote buffer.
    RemAccessErr,
    /// `IBV_WC_REM_OP_ERR` (11): the responder could not complete the operation.
    RemOpErr,
    /// `IBV_WC_RETRY_EXC_ERR` (12): the transport retry counter was exceeded.
    RetryExcErr,
    /// `IBV_WC_RNR_RETRY_EXC_ERR` (13): the receiver-not-ready retry counter was
    /// exceeded.
    RnrRetryExcErr,
    /// `IBV_WC_LOC_RDD_VIOL_ERR` (14): a reliable datagram domain violation.
    LocRddViolErr,
    /// `IBV_WC_REM_INV_RD_REQ_ERR` (15): an invalid reliable datagram request.
    RemInvRdReqErr,
    /// `IBV_WC_REM_ABORT_ERR` (16): the responder aborted the operation.
    RemAbortErr,
    /// `IBV_WC_INV_EECN_ERR` (17): an invalid EE context number.
    InvEecnErr,
    /// `IBV_WC_INV_EEC_STATE_ERR` (18): an invalid EE context state.
    InvEecStateErr,
    /// `IBV_WC_FATAL_ERR` (19): a fatal transport error.
    FatalErr,
    /// `IBV_WC_RESP_TIMEOUT_ERR` (20): a response timeout.
    RespTimeoutErr,
    /// `IBV_WC_GENERAL_ERR` (21): any other error.
    GeneralErr,
    /// `IBV_WC_TM_ERR` (22): a tag-matching error.
    TmErr,
    /// `IBV_WC_TM_RNDV_INCOMPLETE` (23): a tag-matching rendezvous left to software.
    TmRndvIncomplete,
    /// A number this crate does not know (a newer libibverbs or provider).
    Unknown(u32),
}

/// Every known status, in ABI order (index == number).
const STATUSES: [WcStatus; 24] = [
    WcStatus::Success,
    WcStatus::LocLenErr,
    WcStatus::LocQpOpErr,
    WcStatus::LocEecOpErr,
    WcStatus::LocProtErr,
    WcStatus::WrFlushErr,
    WcStatus::MwBindErr,
    WcStatus::BadRespErr,
    WcStatus::LocAccessErr,
    WcStatus::RemInvReqErr,
    WcStatus::RemAccessErr,
    WcStatus::RemOpErr,
    WcStatus::RetryExcErr,
    WcStatus::RnrRetryExcErr,
    WcStatus::LocRddViolErr,
    WcStatus::RemInvRdReqErr,
    WcStatus::RemAbortErr,
    WcStatus::InvEecnErr,
    WcStatus::InvEecStateErr,
    WcStatus::FatalErr,
    WcStatus::RespTimeoutErr,
    WcStatus::GeneralErr,
    WcStatus::TmErr,
    WcStatus::TmRndvIncomplete,
];

/// libibverbs' `ibv_wc_status_str` texts, by number.
const STATUS_TEXT: [&str; 24] = [
    "success",
    "local length error",
    "local QP operation error",
    "local EE context operation error",
    "local protection error",
    "Work Request Flushed Error",
    "memory management operation error",
    "bad response error",
    "local access error",
    "remote invalid request error",
    "remote access error",
    "remote operation error",
    "transport retry counter exceeded",
    "RNR retry counter exceeded",
    "local RDD violation error",
    "remote invalid RD request",
    "aborted error",
    "invalid EE context number",
    "invalid EE context state",
    "fatal error",
    "response timeout error",
    "general error",
    "TM error",
    "TM software rendezvous",
];

impl WcStatus {
    /// Every named status, in ABI order.
    pub const KNOWN: &'static [WcStatus] = &STATUSES;

    /// Decodes a raw `ibv_wc_status` number; never fails.
    pub const fn from_raw(raw: u32) -> Self {
        if (raw as usize) < STATUSES.len() {
            STATUSES[raw as usize]
        } else {
            WcStatus::Unknown(raw)
        }
    }

    /// The raw number (the value it was decoded from).
    pub const fn as_raw(self) -> u32 {
        match self {
            WcStatus::Success => 0,
            WcStatus::LocLenErr => 1,
            WcStatus::LocQpOpErr => 2,
            WcStatus::LocEecOpErr => 3,
            WcStatus::LocProtErr => 4,
            WcStatus::WrFlushErr => 5,
            WcStatus::MwBindErr => 6,
            WcStatus::BadRespErr => 7,
            WcStatus::LocAccessErr => 8,
            WcStatus::RemInvReqErr => 9,
            WcStatus::RemAccessErr => 10,
            WcStatus::RemOpErr => 11,
            WcStatus::RetryExcErr => 12,
            WcStatus::RnrRetryExcErr => 13,
            WcStatus::LocRddViolErr => 14,
            WcStatus::RemInvRdReqErr => 15,
            WcStatus::RemAbortErr => 16,
            WcStatus::InvEecnErr => 17,
            WcStatus::InvEecStateErr => 18,
            WcStatus::FatalErr => 19,
            WcStatus::RespTimeoutErr => 20,
            WcStatus::GeneralErr => 21,
            WcStatus::TmErr => 22,
            WcStatus::TmRndvIncomplete => 23,
            WcStatus::Unknown(raw) => raw,
        }
    }

    /// Whether the work request succeeded.
    pub const fn is_success(self) -> bool {
        matches!(self, WcStatus::Success)
    }

    /// libibverbs' text for the status (`ibv_wc_status_str`): "unknown" for numbers it
    /// does not name.
    pub const fn as_str(self) -> &'static str {
        match self {
            WcStatus::Unknown(_) => "unknown",
            known => STATUS_TEXT[known.as_raw() as usize],
        }
    }
}

impl fmt::Display for WcStatus {
    /// As libibverbs' `ibv_wc_status_str`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An `enum ibv_wc_opcode` value, decoded totally: numbers this crate does not know
/// become [`WcOpcode::Unknown`].
///
/// Receive completions have bit 7 (`IBV_WC_RECV`, 128) set, as libibverbs defines:
/// [`WcOpcode::is_recv`] tests that bit, for unknown numbers too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// `IBV_WC_SEND` (0).
    Send,
    /// `IBV_WC_RDMA_WRITE` (1).
    RdmaWrite,
    /// `IBV_WC_RDMA_READ` (2).
    RdmaRead,
    /// `IBV_WC_COMP_SWAP` (3): atomic compare and swap.
    CompSwap,
    /// `IBV_WC_FETCH_ADD` (4): atomic fetch and add.
    FetchAdd,
    /// `IBV_WC_BIND_MW` (5): memory window bind.
    BindMw,
    /// `IBV_WC_LOCAL_INV` (6): local invalidate.
    LocalInv,
    /// `IBV_WC_TSO` (7): TCP segmentation offload send.
    Tso,
    /// `IBV_WC_ATOMIC_WRITE` (9).
    AtomicWrite,
    /// `IBV_WC_RECV` (128): a receive.
    Recv,
    /// `IBV_WC_RECV_RDMA_WITH_IMM` (129): an RDMA write with immediate received.
    RecvRdmaWithImm,
    /// `IBV_WC_TM_ADD` (130): tag-matching list add.
    TmAdd,
    /// `IBV_WC_TM_DEL` (131): tag-matching list delete.
    TmDel,
    /// `IBV_WC_TM_SYNC` (132): tag-matching list sync.
    TmSync,
    /// `IBV_WC_TM_RECV` (133): a tag-matched receive.
    TmRecv,
    /// `IBV_WC_TM_NO_TAG` (134): a receive that matched no tag.
    TmNoTag,
    /// `IBV_WC_DRIVER1` (135): provider specific.
    Driver1,
    /// `IBV_WC_DRIVER2` (136): provider specific.
    Driver2,
    /// `IBV_WC_DRIVER3` (137): provider specific.
    Driver3,
    /// A number this crate does not know.
    Unknown(u32),
}

/// Every known opcode with its number and C name.
const OPCODES: [(WcOpcode, u32, &str); 19] = [
    (WcOpcode::Send, 0, "IBV_WC_SEND"),
    (WcOpcode::RdmaWrite, 1, "IBV_WC_RDMA_WRITE"),
    (WcOpcode::RdmaRead, 2, "IBV_WC_RDMA_READ"),
    (WcOpcode::CompSwap, 3, "IBV_WC_COMP_SWAP"),
    (WcOpcode::FetchAdd, 4, "IBV_WC_FETCH_ADD"),
    (WcOpcode::BindMw, 5, "IBV_WC_BIND_MW"),
    (WcOpcode::LocalInv, 6, "IBV_WC_LOCAL_INV"),
    (WcOpcode::Tso, 7, "IBV_WC_TSO"),
    (WcOpcode::AtomicWrite, 9, "IBV_WC_ATOMIC_WRITE"),
    (WcOpcode::Recv, 128, "IBV_WC_RECV"),
    (WcOpcode::RecvRdmaWithImm, 129, "IBV_WC_RECV_RDMA_WITH_IMM"),
    (WcOpcode::TmAdd, 130, "IBV_WC_TM_ADD"),
    (WcOpcode::TmDel, 131, "IBV_WC_TM_DEL"),
    (WcOpcode::TmSync, 132, "IBV_WC_TM_SYNC"),
    (WcOpcode::TmRecv, 133, "IBV_WC_TM_RECV"),
    (WcOpcode::TmNoTag, 134, "IBV_WC_TM_NO_TAG"),
    (WcOpcode::Driver1, 135, "IBV_WC_DRIVER1"),
    (WcOpcode::Driver2, 136, "IBV_WC_DRIVER2"),
    (WcOpcode::Driver3, 137, "IBV_WC_DRIVER3"),
];

impl WcOpcode {
    /// `IBV_WC_RECV`: the bit every receive opcode has set.
    pub const RECV_BIT: u32 = 128;

    /// Decodes a raw `ibv_wc_opcode` number; never fails.
    pub fn from_raw(raw: u32) -> Self {
        OPCODES
            .iter()
            .find(|(_, number, _)| *number == raw)
            .map_or(WcOpcode::Unknown(raw), |(opcode, _, _)| *opcode)
    }

    /// The raw number (the value it was decoded from).
    pub fn as_raw(self) -> u32 {
        match self {
            WcOpcode::Unknown(raw) => raw,
            known => OPCODES
                .iter()
                .find(|(opcode, _, _)| *opcode == known)
                .map_or(u32::MAX, |(_, number, _)| *number),
        }
    }

    /// Whether this completes a receive (`opcode & IBV_WC_RECV`).
    pub fn is_recv(self) -> bool {
        self.as_raw() & Self::RECV_BIT != 0
    }
}

impl fmt::Display for WcOpcode {
    /// The C name (`IBV_WC_RECV`), or the number for unknown ones.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WcOpcode::Unknown(raw) => write!(f, "unknown opcode {raw}"),
            known => {
                let name = OPCODES
                    .iter()
                    .find(|(opcode, _, _)| opcode == known)
                    .map_or("unknown opcode", |(_, _, name)| name);
                f.write_str(name)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_round_trips_and_unknown_numbers_stay_themselves() {
        for raw in 0..=23u32 {
            let status = WcStatus::from_raw(raw);
            assert!(!matches!(status, WcStatus::Unknown(_)), "{raw}");
            assert_eq!(status.as_raw(), raw);
            assert_eq!(WcStatus::KNOWN[raw as usize], status);
        }
        for raw in [24u32, 64, 0x7fff_ffff, u32::MAX] {
            let status = WcStatus::from_raw(raw);
            assert_eq!(status, WcStatus::Unknown(raw));
            assert_eq!(status.as_raw(), raw);
            assert_eq!(status.to_string(), "unknown");
            assert!(!status.is_success());
        }
        assert!(WcStatus::from_raw(0).is_success());
        assert!(!WcStatus::from_raw(5).is_success());
        assert_eq!(WcStatus::WrFlushErr.as_raw(), 5);
        assert_eq!(WcStatus::GeneralErr.as_raw(), 21);
        assert_eq!(
            WcStatus::from_raw(13).to_string(),
            "RNR retry counter exceeded"
        );
        assert_eq!(WcStatus::Success.to_string(), "success");
    }

    #[test]
    fn every_opcode_round_trips_and_receives_are_the_bit_7_ones() {
        for (opcode, raw, name) in OPCODES {
            assert_eq!(WcOpcode::from_raw(raw), opcode);
            assert_eq!(opcode.as_raw(), raw);
            assert_eq!(opcode.to_string(), name);
            assert_eq!(opcode.is_recv(), raw >= 128, "{name}");
        }
        assert_eq!(WcOpcode::Recv.as_raw(), 128);
        assert!(WcOpcode::Recv.is_recv());
        assert!(WcOpcode::RecvRdmaWithImm.is_recv());
        assert!(!WcOpcode::Send.is_recv());
        for raw in [8u32, 10, 127, 138, 255, 0x180, u32::MAX] {
            let opcode = WcOpcode::from_raw(raw);
            assert_eq!(opcode, WcOpcode::Unknown(raw));
            assert_eq!(opcode.as_raw(), raw);
            assert_eq!(opcode.is_recv(), raw & 128 != 0);
            assert_eq!(opcode.to_string(), format!("unknown opcode {raw}"));
        }
    }
}
