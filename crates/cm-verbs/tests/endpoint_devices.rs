//! One endpoint over many device contexts, one of which fails: the others go on.
//!
//! The simulation has one device per node. [`PortDevices`] wraps the simulated
//! transport and shows the endpoint each listening port as a device of its own (the
//! ids of a port's listener and of the connections it accepts are that device's), so
//! an endpoint reads forty device contexts and a DEVICE_FATAL can hit one of them.
//! Everything else is the simulated transport's own.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use cm_mock::sim::{SimAddr, SimBuffers, SimConfig, SimDeviceReader, SimPair, SimTransport};
use cm_verbs::core::{
    errno, AsyncEvent, AsyncEventType, CmError, CmEventType, ConnectionParams, CqKind, Errno,
    EventElement, QpNum, QueueCaps, Transport, WorkCompletion,
};
use cm_verbs::{
    CloseReason, ConnectOptions, ConnectionId, Endpoint, Event, ListenOptions, QpErrorDetail,
};

const FIRST_PORT: u16 = 7000;
const DEVICES: u16 = 40;
const SECOND: Option<Duration> = Some(Duration::from_secs(1));

/// The simulated transport, each listening port a device.
struct PortDevices {
    inner: SimTransport,
    /// Each id's port, by id key: listeners when bound, accepted ids with their
    /// listener's.
    ports: HashMap<usize, u16>,
    /// Ports whose device is to report DEVICE_FATAL on its next read (the test's
    /// handle on the device).
    failing: Rc<RefCell<Vec<u16>>>,
    /// Ports whose device reported DEVICE_FATAL.
    dead: Vec<u16>,
    /// Ports whose reader fails every read (EIO), as a descriptor gone bad does.
    broken: Rc<RefCell<Vec<u16>>>,
    /// Whether the CM event channel fails every read (the endpoint's own source).
    channel_broken: Rc<Cell<bool>>,
    /// How many of the next CM channel reads answer ENOMEM (the event stays queued).
    channel_out_of_memory: Rc<Cell<u32>>,
    /// Whether re-arming a completion queue fails (EIO).
    arm_broken: Rc<Cell<bool>>,
    /// A reader of the node's one device, for waiting on it.
    node_reader: Option<SimDeviceReader>,
}

/// One port's reader; the node's events and completions are read through any of them
/// (the endpoint routes them by QP and by connection, not by reader).
#[derive(Debug)]
struct PortDevice {
    port: u16,
    inner: SimDeviceReader,
}

type Id = <SimTransport as Transport>::Id;
type CmEvent = <SimTransport as Transport>::Event;

impl Transport for PortDevices {
    type Addr = SimAddr;
    type Id = Id;
    type Event = CmEvent;
    type Device = PortDevice;
    type DeviceKey = u16;
    type Buffers = SimBuffers;
    type Shared = ();

    fn create_id(&mut self) -> Result<Id, CmError> {
        self.inner.create_id()
    }
    fn id_key(&self, id: &Id) -> usize {
        self.inner.id_key(id)
    }
    fn next_cm_event(&mut self) -> Result<Option<CmEvent>, CmError> {
        if self.channel_broken.get() {
            return Err(CmError::from_errno("rdma_get_cm_event", 5));
        }
        if self.channel_out_of_memory.get() > 0 {
            self.channel_out_of_memory
                .set(self.channel_out_of_memory.get() - 1);
            return Err(CmError::from_errno("rdma_get_cm_event", errno::ENOMEM));
        }
        let event = self.inner.next_cm_event()?;
        if let Some(event) = &event {
            let request = cm_verbs::core::CmEvent::event_type(event) == CmEventType::ConnectRequest;
            if let (true, Some(id), Some(listener)) = (
                request,
                self.inner.event_id(event),
                self.inner.event_listener(event),
            ) {
                if let Some(&port) = self.ports.get(&self.inner.id_key(&listener)) {
                    self.ports.insert(self.inner.id_key(&id), port);
                }
            }
        }
        Ok(event)
    }
    fn event_id(&self, event: &CmEvent) -> Option<Id> {
        self.inner.event_id(event)
    }
    fn event_listener(&self, event: &CmEvent) -> Option<Id> {
        self.inner.event_listener(event)
    }
    fn bind(&mut self, id: &Id, addr: SimAddr) -> Result<(), CmError> {
        self.inner.bind(id, addr)?;
        self.ports.insert(self.inner.id_key(id), addr.port);
        Ok(())
    }
    fn listen(&mut self, id: &Id, backlog: u16) -> Result<(), CmError> {
        self.inner.listen(id, backlog)
    }
    fn resolve_addr(
        &mut self,
        id: &Id,
        src: Option<SimAddr>,
        dst: SimAddr,
        timeout: Duration,
    ) -> Result<(), CmError> {
        self.inner.resolve_addr(id, src, dst, timeout)
    }
    fn resolve_route(&mut self, id: &Id, timeout: Duration) -> Result<(), CmError> {
        self.inner.resolve_route(id, timeout)
    }
    fn connect(
        &mut self,
        id: &Id,
        private_data: &[u8],
        params: &ConnectionParams,
    ) -> Result<(), CmError> {
        self.inner.connect(id, private_data, params)
    }
    fn accept(
        &mut self,
        id: &Id,
        private_data: &[u8],
        params: &ConnectionParams,
    ) -> Result<(), CmError> {
        self.inner.accept(id, private_data, params)
    }
    fn reject(&mut self, id: &Id, private_data: &[u8]) -> Result<(), CmError> {
        self.inner.reject(id, private_data)
    }
    fn disconnect(&mut self, id: &Id) -> Result<(), CmError> {
        self.inner.disconnect(id)
    }
    fn local_addr(&self, id: &Id) -> Option<SimAddr> {
        self.inner.local_addr(id)
    }
    fn peer_addr(&self, id: &Id) -> Option<SimAddr> {
        self.inner.peer_addr(id)
    }
    fn device_key(&self, id: &Id) -> Option<u16> {
        self.inner.device_key(id)?;
        self.ports.get(&self.inner.id_key(id)).copied()
    }
    fn open_device(&mut self, id: &Id) -> Result<PortDevice, CmError> {
        let port = self.device_key(id).ok_or(CmError::InvalidArgument {
            op: "open_device",
            reason: "an id of no port",
        })?;
        if self.node_reader.is_none() {
            self.node_reader = Some(self.inner.open_device(id)?);
        }
        Ok(PortDevice {
            port,
            inner: self.inner.open_device(id)?,
        })
    }
    fn next_async_event(&mut self, device: &mut PortDevice) -> Result<Option<AsyncEvent>, CmError> {
        if self.broken.borrow().contains(&device.port) {
            return Err(CmError::from_errno("ibv_get_async_event", 5));
        }
        let mut failing = self.failing.borrow_mut();
        if let Some(at) = failing.iter().position(|&p| p == device.port) {
            failing.swap_remove(at);
            self.dead.push(device.port);
            return Ok(Some(AsyncEvent {
                event_type: AsyncEventType::DeviceFatal,
                element: EventElement::Port(1),
            }));
        }
        self.inner.next_async_event(&mut device.inner)
    }
    fn release_id(&mut self, id: Id) {
        let port = self.ports.remove(&self.inner.id_key(&id));
        if port.is_some_and(|p| self.dead.contains(&p)) {
            // A dead device sends nothing; the node's simulated device is alive, so its
            // destroy would send the DREQ this one cannot: the id is let go as it is.
            return;
        }
        self.inner.release_id(id);
    }
    fn next_cq_event(&mut self, device: &mut PortDevice) -> Result<Option<u64>, CmError> {
        if self.broken.borrow().contains(&device.port) {
            return Err(CmError::from_errno("ibv_get_cq_event", 5));
        }
        self.inner.next_cq_event(&mut device.inner)
    }
    fn create_qp(
        &mut self,
        id: &Id,
        device: &PortDevice,
        token: u64,
        caps: &QueueCaps,
    ) -> Result<QpNum, CmError> {
        self.inner.create_qp(id, &device.inner, token, caps)
    }
    fn register_buffers(&mut self, id: &Id, caps: &QueueCaps) -> Result<SimBuffers, CmError> {
        self.inner.register_buffers(id, caps)
    }
    fn post_recv(
        &mut self,
        id: &Id,
        buffers: &SimBuffers,
        slot: u32,
        wr_id: u64,
    ) -> Result<(), CmError> {
        self.inner.post_recv(id, buffers, slot, wr_id)
    }
    fn post_send(
        &mut self,
        id: &Id,
        buffers: &SimBuffers,
        slot: u32,
        data: &[u8],
        wr_id: u64,
    ) -> Result<(), CmError> {
        self.inner.post_send(id, buffers, slot, data, wr_id)
    }
    fn read_recv(
        &mut self,
        id: &Id,
        buffers: &SimBuffers,
        slot: u32,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CmError> {
        self.inner.read_recv(id, buffers, slot, len, out)
    }
    fn arm_cq(&mut self, id: &Id, kind: CqKind) -> Result<(), CmError> {
        if self.arm_broken.get() {
            return Err(CmError::from_errno("ibv_req_notify_cq", errno::EIO));
        }
        self.inner.arm_cq(id, kind)
    }
    fn poll_cq(
        &mut self,
        id: &Id,
        kind: CqKind,
        out: &mut Vec<WorkCompletion>,
        max: usize,
    ) -> Result<usize, CmError> {
        self.inner.poll_cq(id, kind, out, max)
    }
    fn now(&self) -> Duration {
        self.inner.now()
    }
    fn wait(&mut self, devices: &[PortDevice], timeout: Option<Duration>) -> Result<bool, CmError> {
        if devices
            .iter()
            .any(|d| self.failing.borrow().contains(&d.port))
        {
            return Ok(true);
        }
        let readers = match (&self.node_reader, devices.is_empty()) {
            (Some(reader), false) => std::slice::from_ref(reader),
            _ => &[],
        };
        self.inner.wait(readers, timeout)
    }
}

/// A server endpoint reading one device per listening port, a client on the other
/// node, and the test's handles on the server's devices.
struct Rig {
    fabric: cm_mock::sim::SimFabric,
    server: Endpoint<PortDevices>,
    client: Endpoint<SimTransport>,
    /// Ports whose device reports DEVICE_FATAL next.
    failing: Rc<RefCell<Vec<u16>>>,
    /// Ports whose reader fails every read.
    broken: Rc<RefCell<Vec<u16>>>,
    /// Whether the CM channel fails every read.
    channel_broken: Rc<Cell<bool>>,
    /// How many of the next CM channel reads answer ENOMEM.
    channel_out_of_memory: Rc<Cell<u32>>,
    /// Whether re-arming a completion queue fails.
    arm_broken: Rc<Cell<bool>>,
}

impl Rig {
    fn new() -> Self {
        let SimPair {
            fabric,
            server,
            client,
        } = SimPair::new(SimConfig::default(), 21);
        let (failing, broken) = (Rc::new(RefCell::new(Vec::new())), Rc::default());
        let channel_broken = Rc::new(Cell::new(false));
        let (channel_out_of_memory, arm_broken) = (Rc::new(Cell::new(0)), Rc::default());
        let server = PortDevices {
            inner: SimTransport::on_side(server),
            ports: HashMap::new(),
            failing: Rc::clone(&failing),
            dead: Vec::new(),
            broken: Rc::clone(&broken),
            channel_broken: Rc::clone(&channel_broken),
            channel_out_of_memory: Rc::clone(&channel_out_of_memory),
            arm_broken: Rc::clone(&arm_broken),
            node_reader: None,
        };
        Rig {
            fabric,
            server: Endpoint::new(server),
            client: Endpoint::new(SimTransport::on_side(client)),
            failing,
            broken,
            channel_broken,
            channel_out_of_memory,
            arm_broken,
        }
    }

    /// The server listens on `ports`, the client connects once to each.
    fn connect_to(&mut self, ports: impl Iterator<Item = u16> + Clone) -> Vec<ConnectionId> {
        for port in ports.clone() {
            let addr = self.server.transport().inner.addr(port);
            self.server.listen(addr, ListenOptions::default()).unwrap();
        }
        ports
            .map(|port| {
                let to = self.server.transport().inner.addr(port);
                self.client.connect(to, ConnectOptions::default()).unwrap()
            })
            .collect()
    }

    /// Runs both endpoints until neither has anything to do; what each reported.
    fn settle(&mut self) -> (Vec<Event>, Vec<Event>) {
        let (mut served, mut seen) = (Vec::new(), Vec::new());
        loop {
            let before = served.len() + seen.len();
            served.extend(std::iter::from_fn(|| self.server.poll().unwrap()));
            seen.extend(std::iter::from_fn(|| self.client.poll().unwrap()));
            if !self.fabric.step() && served.len() + seen.len() == before {
                return (served, seen);
            }
        }
    }

    /// Each of `conns` (the client's) sends one message; the server echoes every
    /// message it gets. How many echoes came back.
    fn echo_round(&mut self, conns: &[ConnectionId]) -> usize {
        for &conn in conns {
            self.client.send(conn, b"ping").unwrap();
        }
        let (served, _) = self.settle();
        for event in served {
            if let Event::Received { conn, data } = event {
                self.server.send(conn, &data).unwrap();
            }
        }
        let (_, seen) = self.settle();
        seen.iter()
            .filter(|e| matches!(e, Event::Received { .. }))
            .count()
    }
}

#[test]
fn forty_device_contexts_are_read_and_one_failing_leaves_the_others_serving() {
    let mut rig = Rig::new();
    let conns = rig.connect_to(FIRST_PORT..FIRST_PORT + DEVICES);
    let (served, seen) = rig.settle();
    let established = |events: &[Event]| {
        events
            .iter()
            .filter(|e| matches!(e, Event::Established { .. }))
            .count()
    };
    assert_eq!(established(&served), DEVICES as usize);
    assert_eq!(established(&seen), DEVICES as usize);
    assert_eq!(
        rig.server.device_count(),
        DEVICES as usize,
        "one reader per port"
    );
    assert_eq!(rig.echo_round(&conns), DEVICES as usize);

    // The fourth port's device fails (no removal): its listener and connection end,
    // the other 39 go on.
    rig.failing.borrow_mut().push(FIRST_PORT + 3);
    let (served, seen) = rig.settle();
    assert!(
        matches!(
            served.first(),
            Some(Event::Device(AsyncEvent {
                event_type: AsyncEventType::DeviceFatal,
                ..
            }))
        ),
        "{served:?}"
    );
    let ended = |reason: &CloseReason| *reason == CloseReason::DeviceFatal;
    assert_eq!(
        served
            .iter()
            .filter(|e| matches!(e, Event::ListenerClosed { reason, .. } if ended(reason)))
            .count(),
        1,
        "{served:?}"
    );
    assert_eq!(
        served
            .iter()
            .filter(|e| matches!(e, Event::Closed { reason, .. } if ended(reason)))
            .count(),
        1,
        "{served:?}"
    );
    assert_eq!(rig.server.device_count(), DEVICES as usize - 1);
    assert_eq!(rig.server.listener_count(), DEVICES as usize - 1);
    // A dead device sends nothing: the client hears of it only when its own traffic
    // fails; nothing else changed on its side.
    assert!(
        seen.iter().all(|e| !matches!(e, Event::Closed { .. })),
        "{seen:?}"
    );
    let others: Vec<ConnectionId> = conns
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != 3)
        .map(|(_, &c)| c)
        .collect();
    assert_eq!(rig.echo_round(&others), others.len());
    // The endpoint waits and times out normally: the failed device is not polled.
    assert!(matches!(
        rig.server.next_event(SECOND),
        Err(cm_verbs::ConnError::Timeout)
    ));
}

#[test]
fn a_device_whose_reads_fail_does_not_stop_the_others() {
    let mut rig = Rig::new();
    let conns = rig.connect_to(FIRST_PORT..FIRST_PORT + 3);
    rig.settle();
    assert_eq!(rig.server.connection_count(), 3);
    // The first port's reader fails every read from now on: it is taken as lost,
    // the other two devices are still read and served.
    rig.broken.borrow_mut().push(FIRST_PORT);
    let served: Vec<Event> = std::iter::from_fn(|| rig.server.poll().unwrap()).collect();
    assert!(
        matches!(served.first(), Some(Event::DeviceFailed { error }) if error.errno() == 5),
        "reported first, errno kept: {served:?}"
    );
    let failed = |reason: &CloseReason| matches!(reason, CloseReason::DeviceFailed(_));
    assert!(served
        .iter()
        .any(|e| matches!(e, Event::Closed { reason, .. } if failed(reason))));
    assert!(served
        .iter()
        .any(|e| matches!(e, Event::ListenerClosed { reason, .. } if failed(reason))));
    assert_eq!(
        (rig.server.device_count(), rig.server.connection_count()),
        (2, 2),
        "its reader released, nothing of it kept"
    );
    assert_eq!(rig.echo_round(&conns[1..]), 2);
}

#[test]
fn only_the_endpoints_own_failure_ends_it() {
    let mut rig = Rig::new();
    rig.connect_to(FIRST_PORT..FIRST_PORT + 1);
    rig.settle();
    // A call's own failure: the port is taken. The endpoint goes on.
    let taken = rig.server.transport().inner.addr(FIRST_PORT);
    let refused = rig.server.listen(taken, ListenOptions::default());
    assert!(
        matches!(&refused, Err(e) if !e.ends_endpoint()),
        "{refused:?}"
    );
    // A device failing is that device's end, not the endpoint's.
    rig.broken.borrow_mut().push(FIRST_PORT);
    assert!(rig.server.poll().is_ok());
    // The CM channel failing is the endpoint's: once what was already reported is
    // taken (the device's end, nothing lost), every wait says so, errno kept.
    rig.channel_broken.set(true);
    let ended = std::iter::repeat_with(|| rig.server.next_event(SECOND))
        .take(16)
        .find(Result::is_err)
        .expect("the failure comes after the events already queued");
    assert!(
        matches!(&ended, Err(e @ cm_verbs::ConnError::Endpoint(cm)) if e.ends_endpoint() && cm.errno() == 5),
        "{ended:?}"
    );
    let again = rig.server.next_event(SECOND);
    assert!(matches!(&again, Err(e) if e.ends_endpoint()), "{again:?}");
}

#[test]
fn an_out_of_memory_cm_read_is_retried_and_not_the_endpoints_end() {
    let mut rig = Rig::new();
    // The first two reads of the server's channel answer ENOMEM (the kernel keeps the
    // event): the connection request is read on a later pass, the endpoint goes on.
    rig.channel_out_of_memory.set(2);
    rig.connect_to(FIRST_PORT..FIRST_PORT + 1);
    let mut served = Vec::new();
    loop {
        match rig.server.poll() {
            Ok(Some(event)) => served.push(event),
            Ok(None) => {
                rig.client.poll().unwrap();
                if !rig.fabric.step() {
                    break;
                }
            }
            Err(error) => panic!("ENOMEM ended the endpoint: {error}"),
        }
    }
    assert_eq!(rig.channel_out_of_memory.get(), 0, "both faults were met");
    assert!(
        served
            .iter()
            .any(|e| matches!(e, Event::Established { .. })),
        "{served:?}"
    );
    assert_eq!(rig.server.connection_count(), 1);
}

#[test]
fn a_queue_that_cannot_be_rearmed_closes_its_connection_after_what_came() {
    let mut rig = Rig::new();
    let conns = rig.connect_to(FIRST_PORT..FIRST_PORT + 1);
    rig.settle();
    assert_eq!(rig.echo_round(&conns), 1);
    // From now on no queue can be re-armed: the next completion event is the last the
    // connection would raise, so it ends, typed, after the message that came with it.
    rig.arm_broken.set(true);
    rig.client.send(conns[0], b"last").unwrap();
    let (served, _) = rig.settle();
    let closed = CloseReason::QpError {
        detail: QpErrorDetail::ArmFailed {
            kind: CqKind::Recv,
            errno: Errno(errno::EIO),
        },
    };
    assert!(
        matches!(
            served.as_slice(),
            [Event::Received { data, .. }, Event::Closed { reason, .. }]
                if data == b"last" && *reason == closed
        ),
        "{served:?}"
    );
    assert_eq!(rig.server.connection_count(), 0);
}
