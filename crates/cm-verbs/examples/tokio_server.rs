//! An echo server with a tokio task per connection; lost RTUs are rescued before `accept`.
use cm_verbs::async_endpoint::AsyncWait;
use cm_verbs::handle::{EndpointHandle, Listener};
use cm_verbs::{ConnError, Endpoint, ListenOptions};

/// Serves `connections` clients, each in a task of its own, echoing each message.
pub(crate) async fn serve<T: AsyncWait + 'static>(
    listener: Listener<T>,
    connections: usize,
) -> Result<(), ConnError>
where
    Endpoint<T>: Send,
{
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..connections {
        let conn = listener.accept().await?;
        tasks.spawn(async move {
            let via = conn.established().await?; // answered at once: accept waited for it
            println!("{}: established via {via:?}", conn.id());
            while let Ok(message) = conn.recv().await {
                println!("{}: received {} bytes", conn.id(), message.len());
                conn.send(&message).await.ok(); // until the client leaves
            }
            Ok::<_, ConnError>(())
        });
    }
    while tasks.join_next().await.is_some() {}
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1); // [ADDR [CONNECTIONS]]
    let addr = args.next().unwrap_or("10.77.1.1:7471".into()).parse()?;
    let transport = cm_verbs::rdma::RdmaTransport::new()?;
    let listener = EndpointHandle::spawn_tokio(Endpoint::new(transport))?
        .listen(addr, ListenOptions::default())?;
    Ok(serve(listener, args.next().map_or(Ok(1), |n| n.parse())?).await?)
}
