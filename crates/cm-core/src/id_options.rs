//! The options `rdma_set_option` sets on an id (level `RDMA_OPTION_ID`), as a checked
//! domain type: type of service, the local ACK timeout, address reuse and IPv6-only
//! binding.

use crate::CmError;

/// The port space an id is created in (`rdma_create_id`'s `ps`): ports of one space do
/// not meet those of another (a REQ reaches only a listener of its own space), and the
/// IB CM's service ID is the space's number, then the port.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum PortSpace {
    /// `RDMA_PS_TCP` (0x0106): reliable-connected ids, the space of most RDMA services.
    #[default]
    Tcp,
    /// `RDMA_PS_IB` (0x013F): any QP type, the space native InfiniBand services use.
    Ib,
}

impl PortSpace {
    /// Its number (`enum rdma_port_space`).
    pub const fn raw(self) -> u32 {
        match self {
            PortSpace::Tcp => 0x0106,
            PortSpace::Ib => 0x013F,
        }
    }

    /// The service ID of `port` in this space (`RDMA_IB_IP_PS_*`: the space's number,
    /// then the port in the low 16 bits), as the REQ carries it.
    pub const fn service_id(self, port: u16) -> u64 {
        ((self.raw() as u64) << 16) | port as u64
    }
}

/// One `rdma_set_option(id, RDMA_OPTION_ID, name, value)` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdOption {
    /// `RDMA_OPTION_ID_TOS` (a `u8`): the type of service of the connection's packets.
    /// On RoCE it is the IP header's traffic class (DSCP in the upper six bits, ECN in
    /// the lower two) and picks the service level; it must be set before the route is
    /// resolved.
    TypeOfService(u8),
    /// `RDMA_OPTION_ID_ACK_TIMEOUT` (a `u8`, 0 to 31): the QP's local ACK timeout,
    /// 4.096 µs × 2^value, applied when the QP moves to RTS; on RoCE it also sets the
    /// path's packet lifetime (value − 1), which the CM's own response timeouts follow.
    AckTimeout(u8),
    /// `RDMA_OPTION_ID_REUSEADDR` (an `int`): the id may bind a port other ids with
    /// this option hold (not one being listened on). Before bind only.
    ReuseAddr(bool),
    /// `RDMA_OPTION_ID_AFONLY` (an `int`): an id bound to an IPv6 address takes only
    /// IPv6 (`true`) or IPv4 too (`false`; otherwise the sysctl
    /// `net.ipv6.bindv6only` decides). Before bind only.
    Ipv6Only(bool),
}

impl IdOption {
    /// librdmacm's `RDMA_OPTION_ID`: the level of every option here.
    pub const LEVEL_ID: i32 = 0;
    /// The largest ACK timeout (5 bits in the QP attribute).
    pub const MAX_ACK_TIMEOUT: u8 = 31;

    /// The option's number at level `RDMA_OPTION_ID` (`RDMA_OPTION_ID_TOS` 0,
    /// `_REUSEADDR` 1, `_AFONLY` 2, `_ACK_TIMEOUT` 3).
    pub const fn name(&self) -> i32 {
        match self {
            IdOption::TypeOfService(_) => 0,
            IdOption::ReuseAddr(_) => 1,
            IdOption::Ipv6Only(_) => 2,
            IdOption::AckTimeout(_) => 3,
        }
    }

    /// Whether the kernel takes the option only before the id is bound (EINVAL after).
    pub const fn before_bind_only(&self) -> bool {
        matches!(self, IdOption::ReuseAddr(_) | IdOption::Ipv6Only(_))
    }

    /// Checks the value the kernel would refuse: an ACK timeout above 31.
    pub fn validate(&self) -> Result<(), CmError> {
        match self {
            IdOption::AckTimeout(timeout) if *timeout > Self::MAX_ACK_TIMEOUT => {
                Err(CmError::InvalidArgument {
                    op: "rdma_set_option",
                    reason: "ack_timeout above 31",
                })
            }
            _ => Ok(()),
        }
    }
}

/// The `rdma_set_option` choices of a connection or a listener; `None` (or `false`)
/// leaves the kernel's default and makes no call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct IdOptions {
    /// [`IdOption::TypeOfService`]. On the active side it goes into the path and the
    /// REQ; the passive side's QP takes the request's traffic class whatever its
    /// listener's choice.
    pub type_of_service: Option<u8>,
    /// [`IdOption::AckTimeout`], 0 to 31 (`None`: the CM derives it from the path's
    /// packet lifetime: on soft-RoCE 19 under Linux 6.1, about 2.1 s per retry, and
    /// 17 under 6.12, about 0.5 s). Each side's QP takes its own side's value.
    pub ack_timeout: Option<u8>,
    /// [`IdOption::ReuseAddr`] (`false`: no call).
    pub reuse_addr: bool,
    /// [`IdOption::Ipv6Only`] (`None`: the sysctl `net.ipv6.bindv6only` decides).
    pub ipv6_only: Option<bool>,
    /// The port space the id is created in (not an `rdma_set_option` call: it is
    /// `rdma_create_id`'s argument). A listener and its clients must agree.
    pub port_space: PortSpace,
}

impl IdOptions {
    /// The calls these options make, in the order they must be made: those the kernel
    /// takes only before bind first.
    pub fn calls(&self) -> impl Iterator<Item = IdOption> {
        [
            self.reuse_addr.then_some(IdOption::ReuseAddr(true)),
            self.ipv6_only.map(IdOption::Ipv6Only),
            self.type_of_service.map(IdOption::TypeOfService),
            self.ack_timeout.map(IdOption::AckTimeout),
        ]
        .into_iter()
        .flatten()
    }

    /// Checks every value (an ACK timeout 0 to 31).
    pub fn validate(&self) -> Result<(), CmError> {
        self.calls().try_for_each(|option| option.validate())
    }

    /// Whether no option is set (no call is made).
    pub fn is_default(&self) -> bool {
        *self == IdOptions::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_spaces_number_their_service_ids_as_librdmacm_does() {
        assert_eq!(PortSpace::default(), PortSpace::Tcp);
        assert_eq!(PortSpace::Tcp.service_id(7471), 0x0106_1D2F);
        assert_eq!(PortSpace::Ib.service_id(7471), 0x013F_1D2F);
        assert!(IdOptions {
            port_space: PortSpace::Ib,
            ..IdOptions::default()
        }
        .calls()
        .next()
        .is_none());
    }

    #[test]
    fn numbers_are_librdmacm_s() {
        assert_eq!(IdOption::LEVEL_ID, 0);
        assert_eq!(IdOption::TypeOfService(0).name(), 0);
        assert_eq!(IdOption::ReuseAddr(true).name(), 1);
        assert_eq!(IdOption::Ipv6Only(true).name(), 2);
        assert_eq!(IdOption::AckTimeout(0).name(), 3);
    }

    #[test]
    fn ack_timeout_above_31_is_refused() {
        assert_eq!(IdOption::AckTimeout(31).validate(), Ok(()));
        assert!(matches!(
            IdOption::AckTimeout(32).validate(),
            Err(CmError::InvalidArgument { .. })
        ));
        let options = IdOptions {
            ack_timeout: Some(255),
            ..IdOptions::default()
        };
        assert!(options.validate().is_err());
    }

    #[test]
    fn calls_come_before_bind_first_and_only_for_what_is_set() {
        assert_eq!(IdOptions::default().calls().count(), 0);
        assert!(IdOptions::default().is_default());
        let options = IdOptions {
            type_of_service: Some(0x68),
            ack_timeout: Some(14),
            reuse_addr: true,
            ipv6_only: Some(false),
            port_space: PortSpace::Tcp,
        };
        let calls: Vec<_> = options.calls().collect();
        assert_eq!(
            calls,
            [
                IdOption::ReuseAddr(true),
                IdOption::Ipv6Only(false),
                IdOption::TypeOfService(0x68),
                IdOption::AckTimeout(14),
            ]
        );
        let first_late = calls.iter().position(|c| !c.before_bind_only()).unwrap();
        assert!(calls[first_late..].iter().all(|c| !c.before_bind_only()));
    }
}
