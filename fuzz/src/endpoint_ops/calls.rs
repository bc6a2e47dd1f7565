//! The application's calls on the endpoints (connect, answer a request, send, recv,
//! established, accept, disconnect) and the events they report, each answer checked
//! against what the side saw of the handle before.

use std::time::Duration;

use cm_verbs::{ConnError, ConnectOptions, ConnectionId, Event, PrivateData};

use super::world::{millis, World};
use super::{Who, BUFFER, MAX_CONNECTS, PORTS};

impl World {
    pub(super) fn connect(&mut self, port: u8, timeout_ms: Option<u8>, too_long: bool) {
        if self.connects >= MAX_CONNECTS {
            return;
        }
        self.connects += 1;
        let data: &[u8] = if too_long {
            &[7; PrivateData::MAX_REQ + 1]
        } else {
            b"hello"
        };
        let to = self
            .ep(Who::Server)
            .transport()
            .addr(PORTS[usize::from(port)]);
        let options = ConnectOptions {
            caps: self.caps,
            private_data: PrivateData::from(data),
            timeout: timeout_ms.map(millis),
            ..ConnectOptions::default()
        };
        let result = self.ep(Who::Client).connect(to, options);
        match result {
            Ok(conn) => {
                assert!(!too_long, "{}: a REQ too long was sent", self.at);
                assert!(
                    !self.sides[Who::Client as usize].known.contains(&conn),
                    "{}: connect gave an old handle {conn}",
                    self.at
                );
                self.learn(Who::Client, conn);
            }
            Err(ConnError::PrivateDataTooLong { .. }) => assert!(too_long),
            // The device is gone.
            Err(ConnError::Cm(_)) => {}
            Err(other) => panic!("{}: connect answered {other:?}", self.at),
        }
    }

    pub(super) fn answer(&mut self, pick: u8, accept: bool, too_long: bool) {
        let conn = if self.requests.is_empty() {
            match self.pick(Who::Server, pick) {
                Some(conn) => conn,
                None => return,
            }
        } else {
            self.requests
                .remove(usize::from(pick) % self.requests.len())
        };
        let was_gone = self.sides[0].gone.contains(&conn);
        let len = if too_long {
            PrivateData::MAX_REP + 1
        } else {
            4
        };
        let data = PrivateData::from(vec![1; len]);
        let result = if accept {
            self.ep(Who::Server).accept_request(conn, &data)
        } else {
            self.ep(Who::Server).reject_request(conn, &data)
        };
        match &result {
            Ok(()) if !accept => self.closed_for_good(Who::Server, conn),
            Err(ConnError::PrivateDataTooLong { .. }) => assert!(too_long),
            Ok(())
            | Err(ConnError::WrongState { .. })
            | Err(ConnError::Closed { .. })
            | Err(ConnError::UnknownConnection(_))
            | Err(ConnError::Cm(_)) => {}
            Err(other) => panic!("{}: answering a request answered {other:?}", self.at),
        }
        self.after_call(Who::Server, conn, was_gone, &result);
    }

    /// Checks a call's answer on `conn` against what the handle was, and learns
    /// whether it names anything still.
    pub(super) fn after_call<T: std::fmt::Debug>(
        &mut self,
        who: Who,
        conn: ConnectionId,
        was_gone: bool,
        result: &Result<T, ConnError>,
    ) {
        if was_gone {
            // Arguments are checked before the handle.
            assert!(
                matches!(result, Err(ConnError::UnknownConnection(c)) if *c == conn)
                    || matches!(result, Err(ConnError::PrivateDataTooLong { .. })),
                "{}: {who:?} {conn} named nothing, then answered {result:?}",
                self.at
            );
        }
        if let Err(
            ConnError::UnknownConnection(c)
            | ConnError::Closed { conn: c, .. }
            | ConnError::WrongState { conn: c, .. }
            | ConnError::SendQueueFull(c),
        ) = result
        {
            assert_eq!(*c, conn, "{}: an error named another handle", self.at);
        }
        if let Err(ConnError::Closed { reason, .. }) = result {
            self.work_closed(who, conn, reason);
        }
        let info = self.ep(who).info(conn);
        match info {
            Err(ConnError::UnknownConnection(_)) => {
                self.side(who).gone.insert(conn);
            }
            Ok(_) | Err(ConnError::Closed { .. }) => assert!(
                !was_gone,
                "{}: {who:?} {conn} named nothing, then something",
                self.at
            ),
            Err(other) => panic!("{}: info answered {other:?}", self.at),
        }
    }

    /// `conn` was closed and its close reported (or the application closed it): from
    /// now on every call answers `UnknownConnection` at once.
    fn closed_for_good(&mut self, who: Who, conn: ConnectionId) {
        let unknown = Err::<(), _>(ConnError::UnknownConnection(conn));
        let mut ep = self.ep(who);
        let answers = [
            ep.info(conn).map(drop),
            ep.recv(conn, Some(Duration::ZERO)).map(drop),
            ep.established(conn, Some(Duration::ZERO)).map(drop),
            ep.send(conn, b"x"),
            ep.disconnect(conn),
        ];
        drop(ep);
        for answer in answers {
            assert_eq!(
                answer, unknown,
                "{}: {who:?} {conn} closed, yet it answers",
                self.at
            );
        }
        self.side(who).gone.insert(conn);
    }

    pub(super) fn send(&mut self, who: Who, pick: u8, len: u8) {
        let Some((conn, was_gone, result)) = self.call_on(who, pick, |ep, conn| {
            ep.send(conn, &vec![len; usize::from(len)])
        }) else {
            return;
        };
        match &result {
            Ok(()) => {
                assert!(u32::from(len) <= BUFFER, "{}: sent too long", self.at);
                self.log(who, conn).sends += 1;
            }
            Err(ConnError::MessageTooLarge { len, max }) => assert!(len > max),
            // The peer's QP is gone (the simulation refuses the post).
            Err(ConnError::Cm(_))
            | Err(ConnError::UnknownConnection(_))
            | Err(ConnError::Closed { .. })
            | Err(ConnError::WrongState { .. })
            | Err(ConnError::SendQueueFull(_)) => {}
            Err(other) => panic!("{}: send answered {other:?}", self.at),
        }
        self.after_call(who, conn, was_gone, &result);
    }

    pub(super) fn recv(&mut self, who: Who, pick: u8, timeout: Option<Duration>) {
        let Some((conn, was_gone, result)) =
            self.call_on(who, pick, |ep, conn| ep.recv(conn, timeout))
        else {
            return;
        };
        match &result {
            Err(ConnError::Closed { .. }) => {
                self.after_call(who, conn, was_gone, &result);
                self.closed_for_good(who, conn);
                return;
            }
            Ok(_) | Err(ConnError::UnknownConnection(_)) | Err(ConnError::Timeout) => {}
            Err(other) => panic!("{}: recv answered {other:?}", self.at),
        }
        // Asking for a message of an established connection (or of a closed one
        // holding messages) takes its ESTABLISHED too, message or not.
        let established = matches!(
            self.ep(who).info(conn),
            Ok(info) if info.state == cm_verbs::ConnState::Established
        ) || matches!(self.ep(who).info(conn), Err(ConnError::Closed { .. }));
        if established {
            self.side(who).established.insert(conn);
        }
        self.after_call(who, conn, was_gone, &result);
    }

    pub(super) fn established(&mut self, who: Who, pick: u8, timeout: Option<Duration>) {
        let Some((conn, was_gone, result)) =
            self.call_on(who, pick, |ep, conn| ep.established(conn, timeout))
        else {
            return;
        };
        match &result {
            // Asking again is no second report.
            Ok(_) => {
                self.side(who).established.insert(conn);
            }
            Err(ConnError::Closed { .. })
            | Err(ConnError::UnknownConnection(_))
            | Err(ConnError::Timeout) => {}
            Err(other) => panic!("{}: established answered {other:?}", self.at),
        }
        self.after_call(who, conn, was_gone, &result);
    }

    pub(super) fn accept(&mut self, timeout: Option<Duration>) {
        let result = self.ep(Who::Server).accept(timeout);
        match result {
            Ok(conn) => {
                let at = self.at.clone();
                let side = self.side(Who::Server);
                assert!(!side.gone.contains(&conn), "{at}: accepted a closed {conn}");
                assert!(
                    side.established.insert(conn),
                    "{at}: {conn} accepted after it was reported established"
                );
                self.learn(Who::Server, conn);
            }
            Err(ConnError::Timeout) | Err(ConnError::ListenerClosed { .. }) => {}
            Err(other) => panic!("{}: accept answered {other:?}", self.at),
        }
    }

    pub(super) fn disconnect(&mut self, who: Who, pick: u8) {
        let Some((conn, was_gone, result)) =
            self.call_on(who, pick, |ep, conn| ep.disconnect(conn))
        else {
            return;
        };
        self.requests.retain(|c| who == Who::Client || *c != conn);
        match &result {
            Ok(()) => {
                assert!(!was_gone, "{}: disconnected a closed {conn}", self.at);
                self.closed_for_good(who, conn);
            }
            Err(ConnError::UnknownConnection(_)) => {}
            Err(other) => panic!("{}: disconnect answered {other:?}", self.at),
        }
        self.after_call(who, conn, was_gone, &result);
    }

    /// Checks one reported event against what the side saw before.
    pub(super) fn observe(&mut self, who: Who, event: Event) {
        let at = self.at.clone();
        if let Some(conn) = event.conn() {
            assert!(
                !self.sides[who as usize].gone.contains(&conn),
                "{at}: {who:?} reported {event:?} of a closed handle"
            );
            self.learn(who, conn);
        }
        match event {
            Event::Request { conn, .. } => {
                assert_eq!(who, Who::Server, "{at}: a request on the client");
                self.requests.push(conn);
            }
            Event::Established { conn, role, .. } => {
                let side = self.side(who);
                assert_eq!(role, side.role, "{at}: {conn} established in another role");
                assert!(
                    side.established.insert(conn),
                    "{at}: {who:?} {conn} reported established twice"
                );
            }
            Event::Closed { conn, reason } => {
                self.work_closed(who, conn, &reason);
                self.requests.retain(|c| who == Who::Client || *c != conn);
                self.closed_for_good(who, conn);
            }
            // Messages and completed sends come after the connection's ESTABLISHED, and
            // no completion of the application's own work counts as a send.
            Event::Received { conn, .. } | Event::Sent { conn, .. } => {
                assert!(
                    self.sides[who as usize].established.contains(&conn),
                    "{at}: {who:?} reported {conn}'s data before it was established"
                );
                if let Event::Sent { completed, .. } = event {
                    let log = self.log(who, conn);
                    log.sent += u64::from(completed);
                    assert!(
                        log.sent <= log.sends,
                        "{at}: {who:?} {conn}: more sends completed than were made ({log:?})"
                    );
                }
            }
            _ => {}
        }
    }
}
