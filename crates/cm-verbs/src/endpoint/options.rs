//! What a listener and a connection are created with: private data, the listen and
//! connect options.

use std::time::Duration;

use cm_core::{ConnectionParams, IdOptions, QueueCaps};

use super::ConnError;

/// Private data carried by a CM message, checked against the size the message allows
/// (IB CM: REQ 56 bytes, REP 196, REJ 148).
///
/// Zero-filled data is kept as its length alone: an IB CM message has room of a fixed
/// size, and librdmacm reports all of it, zeros where the sender put nothing, so
/// nearly every request carries 56 zero bytes. Reading one allocates nothing.
#[derive(Clone, Default)]
pub struct PrivateData(Repr);

#[derive(Clone)]
enum Repr {
    /// This many zero bytes (at most [`ZEROS`]' length).
    Zeros(u16),
    Bytes(Vec<u8>),
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Zeros(0)
    }
}

/// What [`Repr::Zeros`] lends its bytes from: room for the largest IB CM message's.
static ZEROS: [u8; 256] = [0; 256];

impl PrivateData {
    /// Room in a REQ (`rdma_connect`).
    pub const MAX_REQ: usize = 56;
    /// Room in a REP (`rdma_accept`).
    pub const MAX_REP: usize = 196;
    /// Room in a REJ (`rdma_reject`).
    pub const MAX_REJ: usize = 148;

    /// No private data.
    pub const fn empty() -> Self {
        PrivateData(Repr::Zeros(0))
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Zeros(len) => &ZEROS[..usize::from(*len)],
            Repr::Bytes(bytes) => bytes,
        }
    }

    /// How many bytes.
    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The length of zero-filled data that needs no allocation, or `None`.
    pub(crate) fn zeros_len(&self) -> Option<u16> {
        match self.0 {
            Repr::Zeros(len) => Some(len),
            Repr::Bytes(_) => None,
        }
    }

    /// Zero-filled data of `len` bytes, without allocating where it fits [`ZEROS`].
    pub(crate) fn zeros(len: usize) -> Self {
        match u16::try_from(len) {
            Ok(short) if len <= ZEROS.len() => PrivateData(Repr::Zeros(short)),
            _ => PrivateData(Repr::Bytes(vec![0; len])),
        }
    }

    /// Whether `bytes` can be kept as [`Repr::Zeros`]. The OR of every byte, not an
    /// early exit: the compiler makes it a few vector instructions.
    fn all_zero(bytes: &[u8]) -> bool {
        bytes.len() <= ZEROS.len() && bytes.iter().fold(0u8, |acc, &b| acc | b) == 0
    }

    /// Checks the data fits a message with room for `max` bytes.
    pub(crate) fn check(&self, message: &'static str, max: usize) -> Result<(), ConnError> {
        let len = self.len();
        if len > max {
            Err(ConnError::PrivateDataTooLong { message, len, max })
        } else {
            Ok(())
        }
    }
}

impl std::fmt::Debug for PrivateData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PrivateData")
            .field(&self.as_bytes())
            .finish()
    }
}

impl PartialEq for PrivateData {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for PrivateData {}

impl std::hash::Hash for PrivateData {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl From<&[u8]> for PrivateData {
    fn from(bytes: &[u8]) -> Self {
        if PrivateData::all_zero(bytes) {
            PrivateData::zeros(bytes.len())
        } else {
            PrivateData(Repr::Bytes(bytes.to_vec()))
        }
    }
}

impl From<Vec<u8>> for PrivateData {
    fn from(bytes: Vec<u8>) -> Self {
        if PrivateData::all_zero(&bytes) {
            PrivateData::zeros(bytes.len())
        } else {
            PrivateData(Repr::Bytes(bytes))
        }
    }
}

impl<const N: usize> From<&[u8; N]> for PrivateData {
    fn from(bytes: &[u8; N]) -> Self {
        PrivateData::from(&bytes[..])
    }
}

/// How a listener treats connection requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenOptions {
    /// `rdma_listen` backlog: how many connection requests the kernel holds for this
    /// listener before the endpoint has read them. Past it the kernel drops a REQ
    /// without any reply, and the peer resends it only after its CM response timeout
    /// (about 4 s), so this is not a bound on connections in setup
    /// ([`ListenOptions::max_in_setup`] is, refusing with a REJ). The endpoint reads
    /// the CM channel ahead of its setup work, so requests wait in its own queue rather
    /// than the kernel's. Linux caps it at the sysctl `net.rdma_ucm.max_backlog`
    /// (1024 by default); 0 means that cap.
    pub backlog: u16,
    /// Queue sizes of every accepted connection.
    pub caps: QueueCaps,
    /// `true`: every request is accepted by the endpoint with
    /// [`ListenOptions::private_data`], in the order they came (at most
    /// [`PASS_BATCH`](crate::PASS_BATCH) setups a pass, the CM channel read after each);
    /// `false`: each one is reported as [`Event::Request`](crate::Event::Request) for
    /// [`Endpoint::accept_request`](crate::Endpoint::accept_request) or
    /// [`Endpoint::reject_request`](crate::Endpoint::reject_request).
    pub auto_accept: bool,
    /// Private data sent in every automatic REP.
    pub private_data: PrivateData,
    /// How long an accepted connection may take to become established before it is
    /// closed with [`CloseReason::TimedOut`](crate::CloseReason::TimedOut) (`None`: the CM's own REP retries decide,
    /// ~69 s to UNREACHABLE).
    pub establish_timeout: Option<Duration>,
    /// Manual accept: how long a reported [`Event::Request`](crate::Event::Request) may wait for the
    /// application's answer before it is rejected (REJ) and closed with
    /// [`CloseReason::TimedOut`](crate::CloseReason::TimedOut) (`None`: until the application answers).
    pub request_timeout: Option<Duration>,
    /// Connections of this listener being set up at most: requests reported and not
    /// answered, and accepted connections not yet established. A request past it is
    /// rejected at once and counted in
    /// [`EndpointStats::requests_refused`](crate::EndpointStats::requests_refused),
    /// so a flood of requests holds at most this many connections' queues and
    /// buffers, however long the peers keep retrying.
    pub max_in_setup: u32,
    /// The connection parameters of every accept (sent in the REP), checked by
    /// [`Endpoint::listen`](crate::Endpoint::listen) ([`ConnectionParams::validate`]:
    /// retry counts 0 to 7). The kernel's IB CM builds *both* QPs' read depths from the
    /// REP: `initiator_depth` becomes this side's outstanding RDMA READs (`max_rd_atomic`)
    /// and the peer's served ones, `responder_resources` this side's served reads
    /// (`max_dest_rd_atomic`) and the peer's outstanding ones. Nothing caps them by
    /// what the peer's request asked for, and a depth the peer's device cannot take
    /// fails the peer's QP setup: keep them within what peers ask for. `rnr_retry_count` bounds the *peer's* sends into this side's
    /// receive queue: 7 (the default) retries forever, so a slow reader here stalls the
    /// peer with no error; below 7 the peer's send completes with
    /// [`WcStatus::RnrRetryExcErr`](crate::WcStatus::RnrRetryExcErr) and the
    /// connection closes. `retry_count` is the peer's (the REQ's) to choose: unused
    /// here. librdmacm refuses (EINVAL, the accept fails) a depth above the device's
    /// `max_qp_rd_atom` / `max_qp_init_rd_atom`, except
    /// [`ConnectionParams::DEVICE_MAX`].
    pub params: ConnectionParams,
    /// `rdma_set_option` on the listening id (address reuse, IPv6 only: before it is
    /// bound) and, for the ACK timeout, on every id it accepts (before its QP moves
    /// to RTS), checked by [`Endpoint::listen`](crate::Endpoint::listen) (an ACK
    /// timeout above 31 is refused). A type of service set here is the listening id's
    /// only: each accepted QP takes the traffic class of the peer's request.
    pub id_options: IdOptions,
}

impl Default for ListenOptions {
    /// Backlog 1024 (Linux's default cap), default queues, automatic accept, no
    /// private data, no establish deadline, requests answered within 10 s, at most 1024
    /// connections in setup, default connection parameters (one outstanding read each
    /// way, RNR retries forever), no id options.
    fn default() -> Self {
        ListenOptions {
            backlog: 1024,
            caps: QueueCaps::default(),
            auto_accept: true,
            private_data: PrivateData::empty(),
            establish_timeout: None,
            request_timeout: Some(Duration::from_secs(10)),
            max_in_setup: 1024,
            params: ConnectionParams::default(),
            id_options: IdOptions::default(),
        }
    }
}

/// How [`Endpoint::connect`](crate::Endpoint::connect) connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions<A> {
    /// The local address to resolve from (`None`: the routing table decides).
    pub source: Option<A>,
    /// Queue sizes of the connection.
    pub caps: QueueCaps,
    /// Private data sent in the REQ (at most [`PrivateData::MAX_REQ`] bytes).
    pub private_data: PrivateData,
    /// Address and route resolution timeout, each.
    pub resolve_timeout: Duration,
    /// How long the whole connect may take before it is closed with
    /// [`CloseReason::TimedOut`](crate::CloseReason::TimedOut) (`None`: the CM's own timeouts decide).
    pub timeout: Option<Duration>,
    /// The connection parameters of the REQ, checked by
    /// [`Endpoint::connect`](crate::Endpoint::connect) ([`ConnectionParams::validate`]:
    /// retry counts 0 to 7; nothing is created when they fail). `retry_count` is used by
    /// both QPs (transport retries before
    /// [`WcStatus::RetryExcErr`](crate::WcStatus::RetryExcErr)); `rnr_retry_count`
    /// bounds the *peer's* sends into this side's receive queue (7, the default:
    /// forever, a slow reader here stalls the peer with no error; below 7 the peer's
    /// send fails with [`WcStatus::RnrRetryExcErr`](crate::WcStatus::RnrRetryExcErr)).
    /// The read depths are only a request: the kernel's IB CM sets both QPs' depths
    /// from the accepting side's REP ([`ListenOptions::params`]), so this side's
    /// outstanding RDMA READs are the peer's `responder_resources`. librdmacm refuses
    /// (EINVAL) a depth above the device's `max_qp_rd_atom` / `max_qp_init_rd_atom`,
    /// except [`ConnectionParams::DEVICE_MAX`].
    pub params: ConnectionParams,
    /// `rdma_set_option` on the connection's id, before its address is resolved
    /// (checked by [`Endpoint::connect`](crate::Endpoint::connect): an ACK timeout
    /// above 31 is refused, nothing created). The type of service goes into the route
    /// and the REQ, so both QPs' traffic class is this one; the ACK timeout is this
    /// side's QP's.
    pub id_options: IdOptions,
    /// The application makes the connection's QP itself (its own completion queues,
    /// protection domain and memory): once the route is resolved the endpoint reports
    /// [`Event::RouteResolved`](crate::Event::RouteResolved) and waits; the application
    /// creates its QP on [`Endpoint::cm_id`](crate::Endpoint::cm_id) and calls
    /// [`Endpoint::connect_application_qp`](crate::Endpoint::connect_application_qp).
    /// The endpoint then makes nothing for the connection and never reads its queues;
    /// it stays its CM (REQ, REP, DREQ, events). `caps` is unused.
    pub application_qp: bool,
}

impl<A> Default for ConnectOptions<A> {
    /// No source address, default queues, no private data, 2 s resolution, no deadline,
    /// default connection parameters, no id options, the endpoint's own QP.
    fn default() -> Self {
        ConnectOptions {
            source: None,
            caps: QueueCaps::default(),
            private_data: PrivateData::empty(),
            resolve_timeout: Duration::from_secs(2),
            timeout: None,
            params: ConnectionParams::default(),
            id_options: IdOptions::default(),
            application_qp: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};

    fn hash(data: &PrivateData) -> u64 {
        let mut hasher = DefaultHasher::new();
        data.hash(&mut hasher);
        hasher.finish()
    }

    /// Zeros kept as a length and zeros kept as bytes are the same data: equal, hashed
    /// alike, the same bytes; only data that fits the shared zeros goes unallocated.
    #[test]
    fn zero_filled_data_is_the_same_data_however_kept() {
        let short = PrivateData::from(&[0u8; 56]);
        assert_eq!(short.zeros_len(), Some(56));
        let long = PrivateData::from(vec![0u8; 300]);
        assert_eq!(long.zeros_len(), None, "past the shared zeros: allocated");
        assert_eq!(long.len(), 300);
        assert!(long.as_bytes().iter().all(|&b| b == 0));
        let bytes = PrivateData(Repr::Bytes(vec![0; 56]));
        assert_eq!(short, bytes);
        assert_eq!(hash(&short), hash(&bytes));
        assert_eq!(format!("{short:?}"), format!("{bytes:?}"));
        let mut one = [0u8; 56];
        one[55] = 1;
        let data = PrivateData::from(&one);
        assert_eq!((data.zeros_len(), data.as_bytes()), (None, &one[..]));
        assert_ne!(data, short);
        assert_eq!(PrivateData::empty(), PrivateData::from(Vec::new()));
        assert!(PrivateData::default().is_empty());
        assert!(matches!(
            PrivateData::zeros(PrivateData::MAX_REJ + 1).check("REJ", PrivateData::MAX_REJ),
            Err(ConnError::PrivateDataTooLong {
                len: 149,
                max: 148,
                ..
            })
        ));
    }
}
