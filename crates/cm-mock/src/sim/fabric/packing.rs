//! How an [`Action`] is packed into the schedule's lanes and read back: a header byte,
//! a byte of which fields follow, then those fields as varints.

use cm_core::QpNum;

use super::{Action, MaybeKey, Message, Private};
use crate::sim::schedule::{Packed, Packer, Unpacker};
use crate::sim::types::{ConnId, MsgKind, NodeId, SimIdKey};

// The first byte of a packed action: the variant in the low three bits; for a message,
// its kind in the next three, and its two flags.
const ACTION_DELIVER: u8 = 0;
const ACTION_TIMER: u8 = 1;
const ACTION_ADDR_RESOLVED: u8 = 2;
const ACTION_ROUTE_RESOLVED: u8 = 3;
const ACTION_ESTABLISH_WORK: u8 = 4;
const MSG_RETRANSMIT: u8 = 1 << 6;
const MSG_COPY: u8 = 1 << 7;
// The second byte of a packed message: which of its optional fields follow.
const HAS_CONN: u8 = 1;
const HAS_SRC: u8 = 1 << 1;
const HAS_DST: u8 = 1 << 2;
const HAS_QP: u8 = 1 << 3;
const HAS_PORT: u8 = 1 << 4;
const HAS_VALUE: u8 = 1 << 5;
const HAS_PRIVATE: u8 = 1 << 6;
const HAS_PAYLOAD: u8 = 1 << 7;

/// An id key: its generation, then its slot relative to the lane's previous one.
fn pack_key(out: &mut Packer, key: SimIdKey) {
    out.varint(u64::from(key.generation));
    out.near(key.index);
}

fn unpack_key(input: &mut Unpacker<'_>) -> SimIdKey {
    let generation = input.varint() as u32;
    SimIdKey {
        index: input.near(),
        generation,
    }
}

/// An action naming only an id: its variant, then the key; a generation below 31 goes
/// in the first byte's five spare bits (as generation + 1).
fn pack_id_action(out: &mut Packer, tag: u8, key: SimIdKey) {
    match u8::try_from(key.generation) {
        Ok(generation) if generation < 31 => {
            out.byte(tag | (generation + 1) << 3);
            out.near(key.index);
        }
        _ => {
            out.byte(tag);
            pack_key(out, key);
        }
    }
}

fn unpack_id_action(input: &mut Unpacker<'_>, first: u8) -> SimIdKey {
    match first >> 3 {
        0 => unpack_key(input),
        small => SimIdKey {
            index: input.near(),
            generation: u32::from(small - 1),
        },
    }
}

impl Packed for Action {
    fn pack(self, out: &mut Packer) {
        match self {
            Action::Deliver(msg) => pack_message(out, msg),
            Action::Timer { id, gen } => {
                // The usual timer: a first-generation id, few timers so far.
                if id.generation == 0 && gen < 31 {
                    out.byte(ACTION_TIMER | (gen as u8 + 1) << 3);
                    out.near(id.index);
                } else {
                    out.byte(ACTION_TIMER);
                    pack_key(out, id);
                    out.varint(u64::from(gen));
                }
            }
            Action::AddrResolved(id) => pack_id_action(out, ACTION_ADDR_RESOLVED, id),
            Action::RouteResolved(id) => pack_id_action(out, ACTION_ROUTE_RESOLVED, id),
            Action::EstablishWork(id) => pack_id_action(out, ACTION_ESTABLISH_WORK, id),
        }
    }

    fn unpack(input: &mut Unpacker<'_>) -> Self {
        let first = input.byte();
        match first & 7 {
            ACTION_DELIVER => Action::Deliver(unpack_message(input, first)),
            ACTION_TIMER => match first >> 3 {
                0 => {
                    let id = unpack_key(input);
                    let gen = input.varint() as u32;
                    Action::Timer { id, gen }
                }
                small => Action::Timer {
                    id: SimIdKey {
                        index: input.near(),
                        generation: 0,
                    },
                    gen: u32::from(small - 1),
                },
            },
            ACTION_ADDR_RESOLVED => Action::AddrResolved(unpack_id_action(input, first)),
            ACTION_ROUTE_RESOLVED => Action::RouteResolved(unpack_id_action(input, first)),
            _ => Action::EstablishWork(unpack_id_action(input, first)),
        }
    }
}

/// A message as a header byte, a byte of which fields follow, and those fields as
/// varints; a payload without its trailing zero bytes (messages are often padded with
/// zeros to a fixed size), restored when it is read back.
fn pack_message(out: &mut Packer, msg: Message) {
    let fields = present_fields(&msg);
    out.byte(message_header(&msg));
    out.byte(fields);
    out.varint(u64::from(msg.from.0));
    out.varint(u64::from(msg.to.0));
    if let Some(conn) = msg.conn {
        out.varint(u64::from(conn.0));
    }
    pack_optional_fields(out, &msg, fields);
}

/// The first byte of a packed message: the variant, the message's kind and its flags.
fn message_header(msg: &Message) -> u8 {
    let mut first = ACTION_DELIVER | (msg.kind.index() as u8) << 3;
    if msg.retransmit {
        first |= MSG_RETRANSMIT;
    }
    if msg.copy {
        first |= MSG_COPY;
    }
    first
}

/// The second byte of a packed message: which of its optional fields follow.
fn present_fields(msg: &Message) -> u8 {
    let present = [
        msg.conn.is_some(),
        msg.src != MaybeKey::NONE,
        msg.dst != MaybeKey::NONE,
        msg.qp.0 != 0,
        msg.port != 0,
        msg.value != 0,
        msg.private != Private::default(),
        msg.payload.is_some(),
    ];
    // Bit i of `fields` says field i is there (HAS_CONN is bit 0, …, HAS_PAYLOAD bit 7).
    present
        .iter()
        .enumerate()
        .fold(0u8, |fields, (bit, &on)| fields | u8::from(on) << bit)
}

/// The fields after the connection that `fields` says are there, in their bit order.
fn pack_optional_fields(out: &mut Packer, msg: &Message, fields: u8) {
    if fields & HAS_SRC != 0 {
        pack_key(out, msg.src.0);
    }
    if fields & HAS_DST != 0 {
        pack_key(out, msg.dst.0);
    }
    if fields & HAS_QP != 0 {
        out.varint(u64::from(msg.qp.0));
    }
    if fields & HAS_PORT != 0 {
        out.varint(u64::from(msg.port));
    }
    if fields & HAS_VALUE != 0 {
        out.varint(u64::from(zigzag(msg.value)));
    }
    if fields & HAS_PRIVATE != 0 {
        out.varint(u64::from(msg.private.start));
        out.varint(u64::from(msg.private.len));
    }
    if let Some(payload) = &msg.payload {
        pack_payload(out, payload);
    }
}

/// A payload as its length, then its bytes up to the last non-zero one.
fn pack_payload(out: &mut Packer, payload: &[u8]) {
    let kept = payload
        .iter()
        .rposition(|&b| b != 0)
        .map_or(0, |last| last + 1);
    out.varint(payload.len() as u64);
    out.varint(kept as u64);
    out.bytes(&payload[..kept]);
}

/// Zigzag: small negative values take one byte too.
fn zigzag(value: i32) -> u32 {
    ((value << 1) ^ (value >> 31)) as u32
}

/// Undoes [`zigzag`].
fn unzigzag(zigzag: u32) -> i32 {
    (zigzag >> 1) as i32 ^ -((zigzag & 1) as i32)
}

fn unpack_message(input: &mut Unpacker<'_>, first: u8) -> Message {
    let fields = input.byte();
    let kind = MsgKind::ALL[usize::from(first >> 3 & 7)];
    let from = NodeId(input.varint() as u32);
    let to = NodeId(input.varint() as u32);
    let conn = (fields & HAS_CONN != 0).then(|| ConnId(input.varint() as u32));
    let mut msg = Message::new(kind, conn, from, to);
    msg.retransmit = first & MSG_RETRANSMIT != 0;
    msg.copy = first & MSG_COPY != 0;
    unpack_optional_fields(input, fields, &mut msg);
    msg
}

/// Reads back what [`pack_optional_fields`] wrote, into `msg`.
fn unpack_optional_fields(input: &mut Unpacker<'_>, fields: u8, msg: &mut Message) {
    if fields & HAS_SRC != 0 {
        msg.src = MaybeKey(unpack_key(input));
    }
    if fields & HAS_DST != 0 {
        msg.dst = MaybeKey(unpack_key(input));
    }
    if fields & HAS_QP != 0 {
        msg.qp = QpNum(input.varint() as u32);
    }
    if fields & HAS_PORT != 0 {
        msg.port = input.varint() as u16;
    }
    if fields & HAS_VALUE != 0 {
        msg.value = unzigzag(input.varint() as u32);
    }
    if fields & HAS_PRIVATE != 0 {
        msg.private = Private {
            start: input.varint() as u32,
            len: input.varint() as u32,
        };
    }
    if fields & HAS_PAYLOAD != 0 {
        msg.payload = Some(unpack_payload(input));
    }
}

/// Reads back what [`pack_payload`] wrote: the trailing zeros restored.
fn unpack_payload(input: &mut Unpacker<'_>) -> Box<[u8]> {
    let len = input.varint() as usize;
    let kept = input.varint() as usize;
    let mut payload = vec![0; len].into_boxed_slice();
    input.bytes(&mut payload[..kept]);
    payload
}

#[cfg(test)]
mod tests {
    use super::super::{Action, MaybeKey, Message, Private};
    use crate::sim::schedule::Schedule;
    use crate::sim::{ConnId, MsgKind, NodeId, SimIdKey};
    use cm_core::QpNum;

    /// Every field of a message and every action come back from a lane as they went
    /// in: extreme values, negative ones, payloads with and without trailing zeros.
    #[test]
    fn actions_come_back_from_a_lane_unchanged() {
        let key = |index, generation| SimIdKey { index, generation };
        let mut full = Message::new(
            MsgKind::Rej,
            Some(ConnId(u32::MAX - 1)),
            NodeId(3),
            NodeId(u32::MAX),
        );
        full.src = MaybeKey(key(u32::MAX - 1, u32::MAX));
        full.dst = MaybeKey(key(0, 7));
        full.qp = QpNum(u32::MAX);
        full.port = u16::MAX;
        full.value = i32::MIN;
        full.private = Private {
            start: u32::MAX,
            len: 196,
        };
        full.retransmit = true;
        full.copy = true;
        let mut data = Message::new(MsgKind::Data, None, NodeId(0), NodeId(1));
        data.value = i32::MAX;
        let mut actions = vec![
            Action::Deliver(full),
            Action::Deliver(Message::new(MsgKind::Rtu, None, NodeId(0), NodeId(0))),
            Action::Timer {
                id: key(5, 6),
                gen: u32::MAX,
            },
            Action::AddrResolved(key(u32::MAX - 1, 0)),
            Action::RouteResolved(key(1, 2)),
            Action::EstablishWork(key(3, 4)),
            Action::Timer {
                id: key(9, 0),
                gen: 30,
            },
            Action::Timer {
                id: key(0, 0),
                gen: 31,
            },
            Action::EstablishWork(key(u32::MAX - 1, 31)),
        ];
        for payload in [&b"padded\0\0\0"[..], b"\0\0", b"x", &[7; 20_000]] {
            let mut msg = data.clone();
            msg.value = -1;
            msg.payload = Some(payload.into());
            actions.push(Action::Deliver(msg));
        }
        let expected: Vec<String> = actions.iter().map(|a| format!("{a:?}")).collect();
        let mut schedule = Schedule::default();
        for (n, action) in actions.into_iter().enumerate() {
            schedule.push_fixed(n as u64 * 1_000_000_007, 10, action);
        }
        let back: Vec<String> = std::iter::from_fn(|| schedule.pop())
            .map(|(_, a)| format!("{a:?}"))
            .collect();
        assert_eq!(back, expected);
    }
}
