//! Whether anyone wants the crate's debug events, in a few loads. A tracing callsite
//! checks more than `log`'s level check did (the callsite's interest, then the log
//! bridge's), and a disabled span under the log bridge still records its fields: the
//! event and setup paths ask here first and call their (out-of-line) tracing only when
//! the answer is yes.

/// Whether a debug event would go anywhere: to a tracing subscriber whose level takes
/// debug, or, with no subscriber in the process, to a `log` logger at debug (tracing's
/// log bridge).
#[inline]
pub(crate) fn debug_wanted() -> bool {
    if tracing::dispatcher::has_been_set() {
        tracing::level_filters::LevelFilter::current() >= tracing::Level::DEBUG
    } else {
        log::max_level() >= log::LevelFilter::Debug
    }
}
