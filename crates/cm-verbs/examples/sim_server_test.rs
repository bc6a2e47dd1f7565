//! A unit test of a server on the simulated fabric: every RTU is lost on the wire, and
//! the server's connection is still reported established once, rescued by notify.
use cm_verbs::sim::{FaultAction, FaultRule, MsgKind, SimConfig, SimTransports};
use cm_verbs::{ConnError, ConnectOptions, Endpoint, EstablishedVia, Event, ListenOptions};

/// Runs a server and a client on one fabric until nothing is left to happen; how the
/// server's connections were established.
pub(crate) fn serve_on_the_simulated_fabric() -> Result<Vec<EstablishedVia>, ConnError> {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), 1);
    fabric.add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    let mut server = Endpoint::new(server);
    let mut client = Endpoint::new(client);
    let addr = server.transport().addr(7471);
    server.listen(addr, ListenOptions::default())?;
    client.connect(addr, ConnectOptions::default())?;
    let mut vias = Vec::new();
    loop {
        while let Some(event) = server.poll()? {
            if let Event::Established { via, .. } = event {
                vias.push(via);
            }
        }
        while let Some(event) = client.poll()? {
            if let Event::Established { conn, .. } = event {
                client.send(conn, b"first message")?; // what rescues the server's side
            }
        }
        if !fabric.step() {
            return Ok(vias); // virtual time: no wait, nothing left to happen
        }
    }
}

fn main() -> Result<(), ConnError> {
    let vias = serve_on_the_simulated_fabric()?;
    assert!(matches!(vias[..], [EstablishedVia::Notify(_)]), "{vias:?}");
    println!("the server's connection: established via {vias:?}");
    Ok(())
}
