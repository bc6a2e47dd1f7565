//! Optional numbers and keys in the room of the number itself: a value never handed
//! out stands for none, so an id, a QP or a message pays nothing for the `Option`.

use cm_core::QpNum;

use crate::sim::types::{ConnId, SimIdKey};

/// An optional connection number in four bytes (`u32::MAX`, never handed out, is
/// none), half an `Option<ConnId>`: every id has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MaybeConn(pub(super) u32);

impl MaybeConn {
    pub(super) const NONE: MaybeConn = MaybeConn(u32::MAX);

    pub(super) fn new(conn: Option<ConnId>) -> Self {
        conn.map_or(MaybeConn::NONE, |c| MaybeConn(c.0))
    }

    pub(super) fn get(self) -> Option<ConnId> {
        (self != MaybeConn::NONE).then_some(ConnId(self.0))
    }
}

/// An optional QP number in four bytes (`u32::MAX`, never handed out, is none): half
/// an `Option<QpNum>`, and every id and QP has one or two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MaybeQp(u32);

impl MaybeQp {
    pub(crate) const NONE: MaybeQp = MaybeQp(u32::MAX);

    pub(crate) fn new(qp: Option<QpNum>) -> Self {
        qp.map_or(MaybeQp::NONE, |q| MaybeQp(q.0))
    }

    pub(crate) fn get(self) -> Option<QpNum> {
        (self != MaybeQp::NONE).then_some(QpNum(self.0))
    }
}

/// An optional id key in eight bytes (slot `u32::MAX`, never handed out, is none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MaybeKey(pub(super) SimIdKey);

impl MaybeKey {
    pub(super) const NONE: MaybeKey = MaybeKey(SimIdKey {
        index: u32::MAX,
        generation: 0,
    });

    pub(super) fn new(key: Option<SimIdKey>) -> Self {
        key.map_or(MaybeKey::NONE, MaybeKey)
    }

    pub(super) fn get(self) -> Option<SimIdKey> {
        (self.0.index != u32::MAX).then_some(self.0)
    }
}
