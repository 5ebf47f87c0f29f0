//! Sync mode: waiting for a delegation's completions.

use std::collections::BTreeMap;

use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;

use super::{DelegateError, Delegator};
use crate::protocol::{CompletionEvent, TaskRequest};

impl Delegator {
    /// Reads the delegation's completions from the events stream (stored or
    /// future) until every task has one; returns them by task index.
    pub(super) async fn wait_for(
        &self,
        first: &TaskRequest,
        tasks: usize,
    ) -> Result<Vec<CompletionEvent>, DelegateError> {
        let token = crate::worker::token_for(first.origin_session_id.as_deref());
        let subject = format!(
            "{}.evt.{token}.{}.*.done",
            self.bus.subjects.prefix(),
            first.delegation_id
        );
        // Outside the wait, so that a timeout can say how many arrived.
        let mut done = BTreeMap::new();
        let wait = async {
            let failed = |e: &dyn std::fmt::Display| DelegateError::Wait {
                delegation_id: first.delegation_id.clone(),
                reason: e.to_string(),
            };
            let stream = self
                .bus
                .js
                .get_stream(self.bus.subjects.events_stream())
                .await
                .map_err(|e| failed(&e))?;
            let consumer = stream
                .create_consumer(OrderedConfig {
                    // Named, so that the name and filter are in the API
                    // subject and NATS permissions can check them; unique,
                    // so that two waiters never share one.
                    name: Some(format!(
                        "wait-{}-{}",
                        first.delegation_id,
                        ulid::Ulid::new()
                    )),
                    filter_subject: subject,
                    deliver_policy: DeliverPolicy::All,
                    ..Default::default()
                })
                .await
                .map_err(|e| failed(&e))?;
            let mut messages = consumer.messages().await.map_err(|e| failed(&e))?;
            while done.len() < tasks {
                match messages.next().await {
                    // Garbage on the subject (anyone may publish there)
                    // neither ends the wait early nor fails it.
                    Some(Ok(message)) => match CompletionEvent::decode(&message.payload) {
                        // What the wake checks of a batch's completion: its
                        // delegation, task count and the task its subject
                        // names (a first completion is kept for good). The
                        // error of an unreadable request, which could not
                        // name its batch, counts as its task's too.
                        Ok(event)
                            if !event.is_task_of(
                                &first.delegation_id,
                                event.task_index,
                                u32::try_from(tasks).unwrap_or(u32::MAX),
                            ) || self
                                .bus
                                .subjects
                                .parse_event(&message.subject)
                                .is_none_or(|on| on.task_index != event.task_index) =>
                        {
                            tracing::warn!(subject = %message.subject, delegation_id = %event.delegation_id, task_index = event.task_index, "A completion on this delegation's subject is not one of its tasks' (another delegation, task count or task, or an index beyond its tasks); ignoring it.");
                        }
                        // The first of a task's completions: one run twice
                        // (a stall) has two, stored in the order they ended.
                        Ok(event) => {
                            done.entry(event.task_index).or_insert(event);
                        }
                        Err(error) => {
                            tracing::warn!(subject = %message.subject, %error, "A completion cannot be read; ignoring it.");
                        }
                    },
                    Some(Err(error)) => {
                        tracing::debug!(%error, "Ordered consumer hiccup; it recreates itself.");
                    }
                    None => return Err(failed(&"the event stream ended")),
                }
            }
            Ok(())
        };
        let waited = match self.wait_timeout {
            Some(limit) => tokio::time::timeout(limit, wait).await.map_err(|_| limit),
            None => Ok(wait.await),
        };
        match waited {
            Ok(Ok(())) => Ok(done.into_values().collect()),
            Ok(Err(error)) => Err(error),
            Err(limit) => Err(DelegateError::WaitTimeout {
                delegation_id: first.delegation_id.clone(),
                limit,
                received: done.len(),
                tasks,
            }),
        }
    }
}
