//! A server on its own data path: for each request it makes its own QP, registers a
//! buffer of its own (`register_buffer`: the buffer is borrowed while registered and
//! its own again afterwards), posts its receive on the request's id, accepts, and reads
//! its own completion queues; the endpoint is only its connection manager. A client's first message says
//! where the client's registered bytes are; the server RDMA-READs them and answers with
//! a SEND from its own memory. When the client's RTU is lost, the one line that hands
//! the receive to the endpoint (`received`) is all it takes: the endpoint notifies the
//! CM and the connection is established; no notify code here.
//!
//! `own_qp server ADDR:PORT [CONNECTIONS]` serves that many clients, one after another;
//! `own_qp client ADDR:PORT SOURCE` is one client.
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use cm_verbs::rdma::RdmaTransport;
use cm_verbs::sys::{BorrowedRegion, CmId, Completion, QpCaps, RemoteMemory};
use cm_verbs::{CmError, ConnectOptions, Endpoint, Event, ListenOptions, PrivateData};

/// What a client exposes for the server to read.
const CLIENT_BYTES: &[u8] = b"bytes the client registered, read by the server";
/// How long any one step may take.
const WAIT: Duration = Duration::from_secs(30);

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["server", addr] => serve(addr.parse()?, 1),
        ["server", addr, count] => serve(addr.parse()?, count.parse()?),
        ["client", addr, source] => client(addr.parse()?, source.parse()?),
        _ => Err(
            "usage: own_qp server ADDR:PORT [CONNECTIONS] | own_qp client ADDR:PORT SOURCE".into(),
        ),
    }
}

fn serve(addr: SocketAddr, connections: usize) -> Result<(), Error> {
    let mut endpoint = Endpoint::new(RdmaTransport::new()?);
    let manual = ListenOptions {
        auto_accept: false,
        ..ListenOptions::default()
    };
    endpoint.listen(addr, manual)?;
    for _ in 0..connections {
        let conn = match endpoint.next_event(Some(WAIT))? {
            Event::Request { conn, .. } => conn,
            other => return Err(format!("expected a request, got {other:?}").into()),
        };
        let id = endpoint.cm_id(conn)?.clone();
        // The application's own QP (librdmacm makes its completion queues), memory and
        // receive, before the accept: the endpoint adopts the QP and never reads it.
        id.create_qp(&QpCaps::default())?;
        let mut buffer = vec![0u8; 256];
        let memory = id.register_buffer(&mut buffer, false)?;
        memory.post_recv(0..64, 1)?;
        endpoint.accept_request(conn, &PrivateData::empty())?;
        let received = next_completion(|| id.poll_recv_cq(4))?;
        // The one line for the notify path: a receive on a connection the CM may not
        // know is established yet (its RTU lost).
        endpoint.received(conn)?;
        let via = endpoint.established(conn, Some(WAIT))?;
        let read = read_and_answer(&id, &memory, received.byte_len as usize)?;
        // Deregistered: the buffer is the server's own again, the bytes read in it.
        drop(memory);
        println!(
            "{conn}: established via {via:?}, read {:?}",
            String::from_utf8_lossy(&buffer[read])
        );
        // The client disconnects once it has the answer.
        loop {
            if let Event::Closed { conn: closed, .. } = endpoint.next_event(Some(WAIT))? {
                if closed == conn {
                    break;
                }
            }
        }
    }
    println!("own_qp server: served {connections}");
    Ok(())
}

/// RDMA READ of the client's bytes named by the first message (`len` bytes at the start
/// of `memory`), then the answer, `read N bytes`, as a SEND; where in the buffer the
/// bytes read are.
fn read_and_answer(
    id: &CmId,
    memory: &BorrowedRegion<'_>,
    len: usize,
) -> Result<std::ops::Range<usize>, Error> {
    let remote = RemoteMemory::from_bytes(&memory.read(0..len)?)
        .ok_or("the first message is not a memory descriptor")?;
    let into = 64..64 + (remote.len as usize).min(128);
    memory.post_rdma_read(into.clone(), remote, 2)?;
    next_completion(|| id.poll_send_cq(4))?;
    let answer = format!("read {} bytes", into.len());
    memory.write(192, answer.as_bytes())?;
    memory.post_send(192..192 + answer.len(), 3)?;
    next_completion(|| id.poll_send_cq(4))?;
    Ok(into)
}

/// Polls `poll` until a completion comes (within [`WAIT`]); an error if it failed.
fn next_completion(
    mut poll: impl FnMut() -> Result<Vec<Completion>, CmError>,
) -> Result<Completion, Error> {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if let Some(completion) = poll()?.into_iter().next() {
            if !completion.is_success() {
                return Err(format!("work request failed: {completion:?}").into());
            }
            return Ok(completion);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Err("no completion in time".into())
}

fn client(server: SocketAddr, source: IpAddr) -> Result<(), Error> {
    let mut endpoint = Endpoint::new(RdmaTransport::new()?);
    let options = ConnectOptions {
        source: Some(SocketAddr::new(source, 0)),
        ..ConnectOptions::default()
    };
    let conn = endpoint.connect(server, options)?;
    endpoint.established(conn, Some(WAIT))?;
    let id = endpoint.cm_id(conn)?;
    let region = id.register_remote_memory(CLIENT_BYTES.len())?;
    id.write_memory(&region, 0, CLIENT_BYTES)?;
    let remote = id.remote_memory(&region, 0..CLIENT_BYTES.len())?;
    endpoint.send(conn, &remote.to_bytes())?;
    let answer = endpoint.recv(conn, Some(WAIT))?;
    println!("own_qp client: {}", String::from_utf8_lossy(&answer));
    endpoint.disconnect(conn)?;
    Ok(())
}
