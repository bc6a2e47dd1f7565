//! mockall mocks of every cm-core backend trait, for unit tests of code written against
//! the traits (the notify pump, event loops).

use cm_core::{
    AsyncEvent, AsyncEventType, CmBackend, CmError, CmEventType, NotifyError, NotifyOutcome, QpNum,
};

mockall::mock! {
    /// A mock [`cm_core::CmId`]: set expectations on `notify` and `qp_num`.
    pub CmId {}

    impl cm_core::CmId for CmId {
        fn notify(&self, event: AsyncEventType) -> Result<NotifyOutcome, NotifyError>;
        fn qp_num(&self) -> Option<QpNum>;
    }
}

mockall::mock! {
    /// A mock [`cm_core::CmEvent`]: set expectations on its accessors and on `ack`.
    pub CmEvent {}

    impl cm_core::CmEvent for CmEvent {
        fn event_type(&self) -> CmEventType;
        fn status(&self) -> i32;
        fn qp_num(&self) -> Option<QpNum>;
        fn private_data(&self) -> &[u8];
        fn ack(self) -> Result<(), CmError>;
    }
}

mockall::mock! {
    /// A mock [`cm_core::CmEventSource`] yielding [`MockCmEvent`]s.
    pub CmEventSource {}

    impl cm_core::CmEventSource for CmEventSource {
        type Event = MockCmEvent;
        fn try_next_event(&mut self) -> Result<Option<MockCmEvent>, CmError>;
    }
}

mockall::mock! {
    /// A mock [`cm_core::AsyncEventSource`].
    pub AsyncEventSource {}

    impl cm_core::AsyncEventSource for AsyncEventSource {
        fn try_next_async_event(&mut self) -> Result<Option<AsyncEvent>, CmError>;
    }
}

/// The [`CmBackend`] made of the mocks, for code generic over a backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MockBackend;

impl CmBackend for MockBackend {
    type Id = MockCmId;
    type Event = MockCmEvent;
    type Events = MockCmEventSource;
    type AsyncEvents = MockAsyncEventSource;
}

#[cfg(test)]
mod tests {
    use super::*;
    use cm_core::{AsyncEventSource as _, CmEvent as _, CmEventSource as _, CmId as _};
    use mockall::predicate::eq;

    #[test]
    fn mock_id_answers_as_programmed() {
        let mut id = MockCmId::new();
        id.expect_notify()
            .with(eq(AsyncEventType::CommEst))
            .times(1)
            .returning(|_| Ok(NotifyOutcome::AlreadyEstablished));
        id.expect_qp_num().return_const(Some(QpNum(7)));
        assert_eq!(
            id.notify(AsyncEventType::CommEst),
            Ok(NotifyOutcome::AlreadyEstablished)
        );
        assert_eq!(id.qp_num(), Some(QpNum(7)));
    }

    #[test]
    fn mock_event_source_yields_events_then_none() {
        let mut events = MockCmEventSource::new();
        let mut seq = mockall::Sequence::new();
        events
            .expect_try_next_event()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|| {
                let mut event = MockCmEvent::new();
                event
                    .expect_event_type()
                    .return_const(CmEventType::Established);
                event.expect_private_data().return_const(vec![1u8, 2]);
                event.expect_ack().times(1).returning(|| Ok(()));
                Ok(Some(event))
            });
        events
            .expect_try_next_event()
            .times(1)
            .in_sequence(&mut seq)
            .returning(|| Ok(None));
        let event = events.try_next_event().unwrap().unwrap();
        assert_eq!(event.event_type(), CmEventType::Established);
        assert_eq!(event.private_data(), &[1, 2]);
        event.ack().unwrap();
        assert!(events.try_next_event().unwrap().is_none());
    }

    #[test]
    fn mock_async_source_passes_errors_through() {
        let mut source = MockAsyncEventSource::new();
        source.expect_try_next_async_event().returning(|| {
            Err(CmError::from_errno(
                "ibv_get_async_event",
                cm_core::errno::ENODEV,
            ))
        });
        assert!(source.try_next_async_event().unwrap_err().is_no_device());
    }
}
