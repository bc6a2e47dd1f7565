//! An echo server with a thread per connection on connection handles, as the `handle`
//! module's documentation shows it; lost RTUs are rescued before `accept`, and a
//! connection whose client left before it was accepted still comes, with its messages.
use cm_verbs::handle::EndpointHandle;
use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{ConnError, Endpoint, ListenOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1); // [ADDR [CONNECTIONS]]: ends after that many
    let addr = args.next().unwrap_or("10.77.1.1:7471".into()).parse()?;
    let connections: usize = args.next().map_or(Ok(1), |n| n.parse())?;
    let endpoint = EndpointHandle::spawn_thread(Endpoint::new(RdmaTransport::new()?))?;
    let listener = endpoint.listen(addr, ListenOptions::default())?;
    let mut threads = Vec::with_capacity(connections);
    for _ in 0..connections {
        let conn = listener.blocking_accept(None)?; // a lost RTU is rescued before this returns
        threads.push(std::thread::spawn(move || {
            let via = conn.blocking_established(None)?; // answered at once: accept waited for it
            println!("{}: established via {via:?}", conn.id());
            let mut messages = 0;
            while let Ok(message) = conn.blocking_recv(None) {
                messages += 1;
                conn.blocking_send(&message, None).ok(); // until the client leaves
            }
            println!("{}: closed after {messages} messages", conn.id());
            Ok::<_, ConnError>(messages)
        }));
    }
    let mut messages = 0;
    for thread in threads {
        messages += thread
            .join()
            .map_err(|_| "a connection's thread panicked")??;
    }
    println!("thread server: accepted {connections}, messages {messages}");
    Ok(())
}
