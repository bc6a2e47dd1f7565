//! How input bytes become a run: the set-up from the first four, then an operation
//! from each four after.

use std::time::Duration;

use cm_mock::sim::{FaultAction, MsgKind, SimConfig};
use cm_verbs::{QueueCaps, SharedCaps};

use super::{DeviceOp, Op, Setup, Who, BUFFER};
use crate::input::Input;

fn who(byte: u8) -> Who {
    if byte & 1 == 0 {
        Who::Server
    } else {
        Who::Client
    }
}

/// A deadline of 4 to 67 milliseconds a quarter of the time, else none, from a byte.
fn deadline_ms(byte: u8) -> Option<u8> {
    (byte & 3 == 3).then_some(4 + (byte >> 2) % 64)
}

impl Setup {
    pub(super) fn decode(input: &mut Input<'_>) -> Self {
        let [flags, depths, seed_lo, seed_hi] = input.u32().to_le_bytes();
        // Short CM timeouts (a few retries of a millisecond), so that REP retries and
        // UNREACHABLE happen within a run; kernel-like ones for the other half.
        let config = if flags & 4 == 0 {
            SimConfig {
                cm_response_timeout: Duration::from_millis(1),
                mra_service_timeout: Duration::from_millis(4),
                max_cm_retries: u32::from((flags >> 3) & 3),
                timewait: Duration::from_millis(1),
                ..SimConfig::default()
            }
        } else {
            SimConfig::default()
        };
        Setup {
            config: SimConfig {
                comm_est: flags & 1 == 0,
                delayed_mra: flags & 2 == 0,
                ..config
            },
            seed: u64::from(u16::from_le_bytes([seed_lo, seed_hi])),
            caps: QueueCaps {
                recv_depth: 1 + u32::from(depths & 3),
                send_depth: 1 + u32::from((depths >> 2) & 3),
                buffer_size: BUFFER,
                // None in a quarter of the runs.
                work_depth: [0, 1, 2, 4, 0, 1, 3, 8][usize::from(depths >> 5)],
            },
            establish_timeout: deadline_ms(flags >> 5)
                .map(|ms| Duration::from_millis(u64::from(ms))),
            busy_poll: (depths & 16 != 0).then_some(Duration::from_micros(50)),
            // Half the runs on a small shared pool: few receives, so that messages wait
            // for one and the limit event comes.
            shared_queues: (seed_hi & 0x80 != 0).then_some(SharedCaps {
                recv_slots: 8,
                send_slots: 4,
                buffer_size: BUFFER,
                limit: 2,
                ready_qps: 0,
            }),
        }
    }
}

impl Op {
    pub(super) fn decode(input: &mut Input<'_>) -> Self {
        let [kind, a, b, c] = input.u32().to_le_bytes();
        // Kinds 0 to 23 as before one-sided work came: the committed seeds keep
        // their meaning.
        match kind % 28 {
            0..=2 => Op::Connect {
                // The accepting listener most of the time.
                port: [0, 0, 0, 0, 0, 1, 1, 2][usize::from(a % 8)],
                // Now and then a burst.
                count: [1, 1, 2, 3, 24][usize::from(b % 5)],
                timeout_ms: deadline_ms(c),
                too_long: c & 0x80 != 0 && c & 0x40 != 0,
            },
            3 | 4 => Op::Answer {
                pick: a,
                accept: b & 1 == 0,
                too_long: c % 16 == 0,
            },
            5 | 6 => Op::Send {
                who: who(a),
                pick: b,
                len: c,
            },
            7 | 8 => Op::Recv {
                who: who(a),
                pick: b,
                wait: c,
            },
            9 => Op::Established {
                who: who(a),
                pick: b,
                wait: c,
            },
            10 => Op::Accept { wait: a },
            11 => Op::Disconnect {
                who: who(a),
                pick: b,
            },
            12 | 13 => Op::NextEvent {
                who: who(a),
                wait: b,
                count: 1 + c % 4,
            },
            14 => Op::Drain { who: who(a) },
            15 => Op::Process { who: who(a) },
            16 | 17 => Op::Advance { exp: a % 24 },
            18 => {
                // Other kinds only once a connection: a rule for all of them would
                // leave nothing to connect.
                let (kind, nth) = if a & 1 == 0 {
                    (MsgKind::Rtu, (c & 1 == 1).then_some(u32::from(c >> 1) % 4))
                } else {
                    let kind = MsgKind::ALL[usize::from(a >> 1) % MsgKind::ALL.len()];
                    (kind, Some(u32::from(c >> 1) % 4))
                };
                let action = match b % 4 {
                    0 | 1 => FaultAction::Drop,
                    2 => FaultAction::Delay(Duration::from_micros(1 << ((b >> 2) % 24))),
                    _ => FaultAction::Duplicate,
                };
                Op::Fault { kind, action, nth }
            }
            19 => Op::Device {
                who: who(a),
                // The device lost (which ends the side's run) the least often.
                what: match b % 16 {
                    0 => DeviceOp::Fatal,
                    1 => DeviceOp::Remove,
                    2..=5 => DeviceOp::Port(b & 16 == 0),
                    6..=8 => DeviceOp::QpFatal(c),
                    _ => DeviceOp::CommEst(c),
                },
            },
            20 => Op::SetNotify {
                who: who(a),
                on: b & 1 == 1,
            },
            21 => Op::CloseListener { pick: a },
            22 => Op::Listen {
                port: a % 3,
                manual: b & 1 == 1,
                timeout_ms: deadline_ms(c),
            },
            24 | 25 => Op::Work {
                who: who(a),
                pick: b,
                count: 1 + (c & 3),
                refused: (c >> 2) % 8 == 0,
                len: a >> 1,
            },
            26 | 27 => Op::TakeWork {
                who: who(a),
                pick: b,
                count: 1 + c % 4,
                process: a & 2 != 0,
            },
            _ => Op::Process { who: who(a) },
        }
    }
}
