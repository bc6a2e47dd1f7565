//! One CM id's record, packed small (a scale run holds two per connection): its
//! place, peer, states and flags in compact fields, and the rare rest kept aside.

use std::num::NonZeroU32;

use cm_core::kernel_model::LapState;
use cm_core::{CmIdState, ConnectionParams, IbCmState, IdOptions};

use super::{MaybeConn, MaybeQp, Private};
use crate::sim::types::{MsgKind, NodeId, SimIdKey};

/// One CM id: the rdma_cm id and its IB CM id together. Compact (a scale run holds two
/// per connection): numbers in four bytes or fewer, the states and flags in two, and
/// what few ids have (private data, a LAP state, numbers too large for their field) in
/// the fabric's side table [`IdExtras`].
#[derive(Debug)]
pub(super) struct IdData {
    /// The node and the channel.
    pub(super) place: Place,
    /// Events handed out and not yet acknowledged ([`IdData::SPILLED`]: in the extras).
    pub(super) unacked: u8,
    /// Retransmissions left ([`IdData::SPILLED`]: in the extras).
    pub(super) retries_left: u8,
    /// Bumped to cancel the pending timer.
    pub(super) timer_gen: u32,
    /// What the id's owner keeps with it (rdma_cm's `id->context`; `u32::MAX`: none).
    pub(super) context: u32,
    pub(super) conn: MaybeConn,
    pub(super) qp: MaybeQp,
    pub(super) remote_qp: MaybeQp,
    /// The local port, then where `resolve_addr` points, then the peer id once known.
    peer: Peer,
    pub(super) state: IdState,
}

impl IdData {
    /// A small number's field holds this when the number is in the id's extras.
    pub(super) const SPILLED: u8 = u8::MAX;

    pub(super) fn new(place: Place) -> Self {
        IdData {
            place,
            unacked: 0,
            timer_gen: 0,
            context: u32::MAX,
            conn: MaybeConn::NONE,
            qp: MaybeQp::NONE,
            remote_qp: MaybeQp::NONE,
            retries_left: 0,
            peer: Peer::NONE,
            state: IdState::NEW,
        }
    }

    /// The local port (`bind`), while the id has no peer: only `listen` reads it, and
    /// an id that resolved an address or has a peer can no longer listen.
    pub(super) fn port(&self) -> u16 {
        if self.peer.node == u32::MAX {
            self.peer.tag as u16
        } else {
            0
        }
    }

    pub(super) fn set_port(&mut self, port: u16) {
        if self.peer.node == u32::MAX {
            self.peer.tag = u32::from(port);
        }
    }

    /// The peer id, once known (the REQ's sender on the passive side, the REP's on the
    /// active side).
    pub(super) fn remote(&self) -> Option<(NodeId, SimIdKey)> {
        (self.peer.node != u32::MAX && self.peer.index != u32::MAX).then_some((
            NodeId(self.peer.node),
            SimIdKey {
                index: self.peer.index,
                generation: self.peer.tag,
            },
        ))
    }

    pub(super) fn set_remote(&mut self, node: NodeId, key: SimIdKey) {
        self.peer = Peer {
            node: node.0,
            index: key.index,
            tag: key.generation,
        };
    }

    /// Where `resolve_addr` points, until the peer id is known: an active id addresses
    /// its REQs (and a REJ sent before the REP) by it, and after the REP only its peer.
    pub(super) fn dst(&self) -> Option<(NodeId, u16)> {
        (self.peer.node != u32::MAX && self.peer.index == u32::MAX)
            .then_some((NodeId(self.peer.node), self.peer.tag as u16))
    }

    pub(super) fn set_dst(&mut self, node: NodeId, port: u16) {
        self.peer = Peer {
            node: node.0,
            index: u32::MAX,
            tag: u32::from(port),
        };
    }
}

/// An id's node (high half) and channel index plus one (low half) in four bytes, or
/// [`Place::SPILLED`] with both in the id's extras: nodes and channels are few. Never
/// 0, so that a free slot needs no flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place(NonZeroU32);

impl Place {
    pub(super) const SPILLED: Place = Place(NonZeroU32::MAX);

    /// The compact form of (`node`, `channel`), if both fit.
    pub(super) fn new(node: NodeId, channel: usize) -> Option<Place> {
        let node = u16::try_from(node.0).ok().filter(|&n| n < u16::MAX)?;
        let channel = u16::try_from(channel + 1).ok().filter(|&c| c < u16::MAX)?;
        let place = u32::from(node) << 16 | u32::from(channel);
        NonZeroU32::new(place).map(Place)
    }

    /// The node and channel of a compact place.
    pub(super) fn get(self) -> (NodeId, usize) {
        let place = self.0.get();
        (NodeId(place >> 16), (place & 0xffff) as usize - 1)
    }
}

/// An id's peer in twelve bytes: nothing (`node` is `u32::MAX`, `tag` the local port), the address
/// `resolve_addr` gave (`index` is `u32::MAX`, `tag` the port), or the peer id (`index`
/// and `tag` its key). One field serves both: an id resolves its address only before
/// it connects, and learns its peer only after.
#[derive(Debug, Clone, Copy)]
struct Peer {
    node: u32,
    index: u32,
    tag: u32,
}

impl Peer {
    const NONE: Peer = Peer {
        node: u32::MAX,
        index: u32::MAX,
        tag: 0,
    };
}

/// An id's states and flags in sixteen bits: the IB CM state (five bits, 31: none),
/// the rdma_cm state (four), the message the timer resends (four, 15: none, the
/// TIMEWAIT timer), and three flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct IdState(u16);

impl IdState {
    const IB_NONE: u16 = 31;
    const RETRY_SHIFT: u32 = 9;
    const RETRY_NONE: u16 = 15;
    /// Bound to the node's device (bind, resolve, or created by a connection request).
    pub(super) const DEVICE: u16 = 1 << 13;
    /// The retransmission timeout is the MRA's service timeout (an MRA arrived), not
    /// the CM response timeout.
    pub(super) const MRA_TIMEOUT: u16 = 1 << 14;
    /// Created by a connection request (passive ids): the peer is the REQ's sender,
    /// whose duplicate-REQ entry goes when this id does.
    pub(super) const FROM_REQ: u16 = 1 << 15;
    /// No IB CM id, rdma_cm IDLE, no timer, no flag.
    pub(super) const NEW: IdState = IdState(Self::IB_NONE | Self::RETRY_NONE << Self::RETRY_SHIFT);

    /// The IB CM id's state; `None` until connect/accept/listen attaches one.
    pub(super) fn ib(self) -> Option<IbCmState> {
        IbCmState::from_raw(u32::from(self.0 & 31))
    }

    pub(super) fn set_ib(&mut self, ib: Option<IbCmState>) {
        let raw = ib.map_or(Self::IB_NONE, |s| s.as_raw() as u16);
        self.0 = self.0 & !31 | raw;
    }

    pub(super) fn cm(self) -> CmIdState {
        CmIdState::from_raw(u32::from(self.0 >> 5 & 15)).unwrap_or(CmIdState::Idle)
    }

    pub(super) fn set_cm(&mut self, cm: CmIdState) {
        self.0 = self.0 & !(15 << 5) | (cm.as_raw() as u16) << 5;
    }

    /// Which message the timer resends (`None`: the timer is the TIMEWAIT timer).
    pub(super) fn retrying(self) -> Option<MsgKind> {
        MsgKind::ALL
            .get(usize::from(self.0 >> Self::RETRY_SHIFT & 15))
            .copied()
    }

    pub(super) fn set_retrying(&mut self, kind: Option<MsgKind>) {
        let raw = kind.map_or(Self::RETRY_NONE, |k| k.index() as u16);
        self.0 = self.0 & !(15 << Self::RETRY_SHIFT) | raw << Self::RETRY_SHIFT;
    }

    pub(super) fn has(self, flag: u16) -> bool {
        self.0 & flag != 0
    }

    pub(super) fn set(&mut self, flag: u16, on: bool) {
        if on {
            self.0 |= flag;
        } else {
            self.0 &= !flag;
        }
    }
}

/// What few ids have, kept aside so that the rest pay nothing for it: CM private data
/// and a LAP state other than the usual none.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct IdExtras {
    /// The private data of our REQ/REP (for retransmissions).
    pub(super) private: Private,
    /// The peer's REP data on the active side, once the REP arrived.
    pub(super) peer_private: Private,
    pub(super) lap: LapState,
    /// The node and channel, when its [`Place`] is [`Place::SPILLED`].
    pub(super) place: Option<(NodeId, usize)>,
    /// The unacknowledged events, when they pass the compact field.
    pub(super) unacked: u32,
    /// The retransmissions left, when they pass the compact field.
    pub(super) retries_left: u32,
    /// The parameters of the id's connect or accept, when not the default (which most
    /// ids use: they take no entry).
    pub(super) params: Option<ConnectionParams>,
    /// What `rdma_set_option` set on the id.
    pub(super) options: IdOptions,
}

impl IdExtras {
    pub(super) fn set_params(&mut self, params: &ConnectionParams) {
        self.params = (*params != ConnectionParams::default()).then_some(*params);
    }
}

/// A slot of the id table.
#[derive(Debug, Default)]
pub(super) struct IdSlot {
    pub(super) generation: u32,
    pub(super) data: Option<IdData>,
}
