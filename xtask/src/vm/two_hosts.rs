//! `cargo xtask vm --two-hosts`: a server VM and a client VM on two kernels (6.12 serving
//! 6.1, then 6.1 serving 6.12), joined by one virtual wire: a virtio NIC each on qemu's socket network, one TCP connection over the
//! loopback address between the two qemu processes (no host network, no tap device).
//! Each VM has soft-RoCE on its NIC (`/init` reads its role from the kernel command
//! line), runs its own manifest (`ci/vm/two-hosts/`) and gives its own verdict; the two
//! payloads meet through readiness ports the server opens when it listens.

use std::time::Duration;

use super::qemu::{Accel, Nic};
use super::{conclude, prepare, start, vm_dir, Options, Prepared};
use crate::run::workspace_root;

/// The (server, client) kernels of each run: both ways round.
const PAIRS: &[(&str, &str)] = &[("6.12", "6.1"), ("6.1", "6.12")];
/// The ladder of the first pair's rescued connection (`ci/vm/ladder-capture
/// two-hosts-server` prints it), saved again under the name the README shows.
const FIRST_LADDER: (&str, &str) = ("ladder-two-hosts-server-6.12.svg", "ladder-two-hosts.svg");
/// The server VM's manifest, relative to the workspace root.
const SERVER_MANIFEST: &str = "ci/vm/two-hosts/server.txt";
/// The client VM's manifest.
const CLIENT_MANIFEST: &str = "ci/vm/two-hosts/client.txt";
/// How long the server's qemu may take to open its end of the wire.
const WIRE_WAIT: Duration = Duration::from_secs(30);

/// Runs each pair of [`PAIRS`] (a server VM and a client VM at once); the one-line note
/// names every verdict.
pub(crate) fn run(options: &Options) -> Result<String, String> {
    let mut notes = Vec::new();
    let mut failed = false;
    for &(server, client) in PAIRS {
        println!("vm: two hosts: server on {server}, client on {client}");
        match run_pair(options, server, client) {
            Ok(note) => {
                if (server, client) == PAIRS[0] {
                    let (drawn, shown) = FIRST_LADDER;
                    std::fs::copy(vm_dir().join(drawn), vm_dir().join(shown))
                        .map_err(|e| format!("{drawn}: {e}"))?;
                }
                notes.push(note);
            }
            Err(note) => {
                failed = true;
                notes.push(note);
            }
        }
    }
    let all = join_notes(&notes.iter().map(String::as_str).collect::<Vec<_>>(), "; ");
    if failed {
        Err(all)
    } else {
        Ok(all)
    }
}

/// One server VM on `server_kernel` and one client VM on `client_kernel`.
fn run_pair(options: &Options, server_kernel: &str, client_kernel: &str) -> Result<String, String> {
    let side = |kernel: &str, manifest: &str, role: &str| Options {
        kernel: Some(kernel.to_string()),
        manifest: Some(workspace_root().join(manifest)),
        run_dir: Some(vm_dir().join(format!("two-hosts-{role}-{kernel}"))),
        timeout: options.timeout,
        ..Options::default()
    };
    let mut server = prepare(&side(server_kernel, SERVER_MANIFEST, "server"))?;
    let mut client = prepare(&side(client_kernel, CLIENT_MANIFEST, "client"))?;
    let port = free_loopback_port()?;
    wire(
        &mut server,
        "server",
        format!("listen=127.0.0.1:{port}"),
        2,
        options,
    );
    wire(
        &mut client,
        "client",
        format!("connect=127.0.0.1:{port}"),
        1,
        options,
    );

    // The listening end first: the client's qemu connects as it starts.
    let server = std::thread::spawn(move || start(&server.config).map(|ended| (server, ended)));
    let opened = wait_listening(port, WIRE_WAIT);
    let client_ended = if opened {
        start(&client.config)
    } else {
        Err(format!(
            "the server VM's qemu did not listen on 127.0.0.1:{port}"
        ))
    };
    let (server, server_ended) = server
        .join()
        .map_err(|_| "the server VM's thread panicked".to_string())??;
    let server_note = conclude(&server, server_ended);
    let client_note = client_ended.and_then(|ended| conclude(&client, ended));
    match (server_note, client_note) {
        (Ok(s), Ok(c)) => Ok(format!("server {s}, client {c}")),
        (s, c) => Err(join_notes(
            &[
                &format!("server: {}", s.unwrap_or_else(|e| e)),
                &format!("client: {}", c.unwrap_or_else(|e| e)),
            ],
            "; ",
        )),
    }
}

/// Notes joined into one: their first lines (the summary's) on the first line, the
/// further lines (failed entries' output) after it.
fn join_notes(notes: &[&str], separator: &str) -> String {
    let firsts: Vec<&str> = notes
        .iter()
        .map(|n| n.lines().next().unwrap_or(""))
        .collect();
    let mut joined = firsts.join(separator);
    for line in notes.iter().flat_map(|n| n.lines().skip(1)) {
        joined.push('\n');
        joined.push_str(line);
    }
    joined
}

/// Gives `side` its NIC (MAC ending in `last_octet`: the two must differ, soft-RoCE
/// derives its GID from it) and its role; one CPU each (the two share the host's cores),
/// TCG unless KVM is asked for (the KVM probe would restart qemu and cut the wire).
fn wire(side: &mut Prepared, role: &str, socket: String, last_octet: u8, options: &Options) {
    side.config.nic = Some(Nic {
        socket,
        mac: format!("52:54:00:00:00:{last_octet:02x}"),
    });
    side.config.cmdline = format!("cmnotify.host={role}");
    side.config.cpus = 1;
    side.config.accel = options.accel.unwrap_or(Accel::Tcg);
}

/// A loopback port nothing listens on now.
fn free_loopback_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// Waits until a socket listens on 127.0.0.1:`port` (read from `/proc/net/tcp`: a probe
/// connection would be taken by qemu as the other VM).
fn wait_listening(port: u16, within: Duration) -> bool {
    let started = std::time::Instant::now();
    while started.elapsed() < within {
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
        if listens(&table, port) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// Whether `/proc/net/tcp`'s `table` has a socket listening on 127.0.0.1:`port`.
fn listens(table: &str, port: u16) -> bool {
    let local = format!("0100007F:{port:04X}");
    table.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"0A")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_lines_are_joined_and_further_lines_follow() {
        let joined = join_notes(
            &["server: ok", "client: failed\n`x`, its last lines:\n    y"],
            "; ",
        );
        assert_eq!(
            joined,
            "server: ok; client: failed\n`x`, its last lines:\n    y"
        );
    }

    #[test]
    fn a_listening_loopback_socket_is_found_in_the_tcp_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue\n\
                     0: 0100007F:445C 00000000:0000 0A 00000000:00000000\n\
                     1: 0100007F:1F90 0100007F:9C40 01 00000000:00000000\n";
        assert!(listens(table, 0x445C));
        assert!(!listens(table, 0x1F90), "established, not listening");
        assert!(!listens(table, 7));
    }
}
