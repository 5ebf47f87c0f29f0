//! Keeping a follow going: opening the read again after it failed, and
//! noticing a stream that was deleted or created again.
//!
//! The client recreates a lost ordered consumer by itself, retrying
//! forever and starting after the last sequence it delivered. That covers a
//! restart, but not a stream that is deleted (it would retry silently) or
//! created again under the same name (its sequences start over, so its
//! first events would be skipped). A follow therefore looks the stream up
//! between messages, and before showing the first message of a consumer
//! the client created in place of its own, and compares its creation time.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::context::GetStreamError;
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tracing::{debug, info, warn};

use super::{HistoryReader, read};

/// How often a follow looks its stream up between messages.
const STREAM_CHECK_PERIOD: Duration = Duration::from_secs(5);

/// The first check one period after the read opens.
pub(super) fn stream_check() -> Interval {
    let mut interval =
        tokio::time::interval_at(Instant::now() + STREAM_CHECK_PERIOD, STREAM_CHECK_PERIOD);
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    interval
}

/// What looking the stream up found.
#[derive(Debug, PartialEq, Eq)]
enum Lookup {
    /// The stream being read.
    Same,
    /// A stream of the same name created since: the read starts over.
    New,
    /// No such stream.
    Gone,
}

impl HistoryReader {
    /// Whether the follow's `--until` (plus its margin) has passed, or the
    /// stream as last seen had passed its `--to-seq`.
    fn bound_passed(&self) -> bool {
        self.selection
            .until
            .is_some_and(|until| time::OffsetDateTime::now_utc() > until + super::UNTIL_MARGIN)
            || self
                .end
                .is_some_and(|end| self.handle.cached_info().state.last_sequence >= end)
    }

    /// Between messages of a follow: a stream created again is read from
    /// the selection's start. A missing one is said once and waited for
    /// without reading the old consumer further: the client would recreate
    /// that on the new stream after the last sequence shown, and its first
    /// messages would come again once the new stream is read from its
    /// start.
    pub(super) async fn check_stream(&mut self) {
        match self.refresh_stream().await {
            Ok(Lookup::New | Lookup::Gone) => self.reopen().await,
            Ok(Lookup::Same) => {}
            // The read's own error, if any, says more; checked again later.
            Err(error) => debug!(stream = %self.stream, %error, "Cannot look the stream up."),
        }
    }

    /// Whether `message` is to be shown. The first message of a consumer
    /// the client created by itself (a new name: after a restart, or a
    /// stream deleted and created again) is checked before it is shown: if
    /// the stream is a new one, the message is dropped and the new stream
    /// is read from the selection's start, where the message comes again in
    /// its place, instead of going on after the last sequence shown and
    /// then starting over at the next periodic check, which would show it
    /// twice. The new consumer becomes the one deleted at the end.
    pub(super) async fn same_read(&mut self, message: &jetstream::Message) -> bool {
        let Ok(info) = message.info() else {
            return true;
        };
        if self.cleanup.as_deref() == Some(info.consumer) {
            return true;
        }
        let consumer = info.consumer.to_owned();
        if self.follow {
            match self.refresh_stream().await {
                Ok(Lookup::New) => {
                    // Deleted with the rest at the reopen.
                    self.cleanup = Some(consumer);
                    self.reopen().await;
                    return false;
                }
                // Shown: from the same stream, or from one gone since (the
                // periodic check waits for its successor); a stream that
                // cannot be looked up is looked at again periodically.
                Ok(Lookup::Same | Lookup::Gone) => {}
                Err(error) => {
                    debug!(stream = %self.stream, %error, "Cannot look the stream up.");
                }
            }
        }
        self.cleanup = Some(consumer);
        true
    }

    /// Opens the follow again after the last message read, retrying until
    /// the server takes it (the caller's shutdown ends the wait). A stream
    /// that was deleted is waited for; one created again is read from its
    /// start.
    pub(super) async fn reopen(&mut self) {
        loop {
            if let Some(delay) = self.reopen_delay {
                tokio::time::sleep(delay).await;
            }
            let delay = self.reopen_delay.map_or(Duration::from_millis(250), |d| {
                (d * 2).min(STREAM_CHECK_PERIOD)
            });
            self.reopen_delay = Some(delay);
            match self.refresh_stream().await {
                Ok(Lookup::Same | Lookup::New) => {}
                // Said once by `refresh_stream`; looked for again quietly,
                // unless the follow's end has passed: a follow bounded by
                // `--until` or `--to-seq` ends as it would with the stream
                // there (a stream made again holds only later messages).
                Ok(Lookup::Gone) => {
                    if self.bound_passed() {
                        self.finished = true;
                        return;
                    }
                    continue;
                }
                Err(error) => {
                    warn!(stream = %self.stream, %error, retry_in = ?delay, "Cannot follow again yet; will retry.");
                    continue;
                }
            }
            let policy = match self.last_sequence {
                Some(last) => DeliverPolicy::ByStartSequence {
                    start_sequence: last + 1,
                },
                None => self.selection.deliver_policy(),
            };
            let opened = read(
                &self.handle,
                &self.stream,
                &self.filter_subject,
                policy,
                self.batch,
            );
            match opened.await {
                Ok((messages, name, _, start_floor)) => {
                    self.close().await;
                    self.messages = messages;
                    self.cleanup = Some(name);
                    self.start_floor = start_floor;
                    return;
                }
                Err(error) => {
                    warn!(stream = %self.stream, %error, retry_in = ?delay, "Cannot follow again yet; will retry.");
                }
            }
        }
    }

    /// Looks the stream up again and brings the reader's view of it up to
    /// date: says once per absence that it is gone, takes the fresh handle,
    /// and, for a stream created since the read began, records its creation
    /// time and forgets the last sequence read (so the next read starts at
    /// the selection's start).
    async fn refresh_stream(&mut self) -> Result<Lookup, GetStreamError> {
        let stream = match self.js.get_stream(&self.stream).await {
            Ok(stream) => stream,
            Err(error) if crate::bus::is_stream_not_found(&error) => {
                if !self.told_gone {
                    warn!(stream = %self.stream, "The stream no longer exists; waiting for it to be created again.");
                    self.told_gone = true;
                }
                return Ok(Lookup::Gone);
            }
            Err(error) => return Err(error),
        };
        self.told_gone = false;
        let created = stream.cached_info().created;
        self.handle = stream;
        if created == self.created {
            return Ok(Lookup::Same);
        }
        info!(stream = %self.stream, "The stream was created again; following it from its start.");
        self.created = created;
        self.last_sequence = None;
        Ok(Lookup::New)
    }
}
