//! The table of live session actors: which inbox a session's completions go
//! to. The `wakebus_wake_sessions_active` gauge follows its entries, so an
//! entry that outlives its actor shows on the gauge.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

/// What an inbox carries: something addressed to one session.
pub(super) trait Routed {
    /// The raw session id it is for.
    fn session(&self) -> &str;
}

/// Inboxes of live actors, by raw session id. Generic over what an inbox
/// carries so that its rules can be tested without NATS.
#[derive(Debug)]
pub(super) struct Actors<T> {
    /// Senders to live actors. An actor that stops closes its receiver
    /// first, so a closed sender here means its actor is gone or going.
    senders: Mutex<HashMap<String, UnboundedSender<T>>>,
}

impl<T: Routed> Actors<T> {
    pub(super) fn new() -> Self {
        Self {
            senders: Mutex::new(HashMap::new()),
        }
    }

    /// Hands `item` to its session's live actor. If there is none (or it
    /// has closed its inbox), a new inbox holding `item` is entered for the
    /// session and returned with the session id: the caller starts its
    /// actor. (The id is copied only then, not for every item.)
    pub(super) fn route(&self, item: T) -> Option<(String, UnboundedReceiver<T>)> {
        let mut senders = self.senders.lock().expect("actor table poisoned");
        let item = match senders.get(item.session()) {
            Some(tx) => match tx.send(item) {
                Ok(()) => return None,
                Err(returned) => returned.0,
            },
            None => item,
        };
        let session = item.session().to_owned();
        let (tx, rx) = unbounded_channel();
        tx.send(item).expect("receiver is alive");
        if senders.insert(session.clone(), tx).is_none() {
            crate::ops::metrics::wake_session_opened();
        }
        Some((session, rx))
    }

    /// Removes an idle actor's entry, unless something arrived for it
    /// meanwhile (checked under the table's lock, so nothing routed to the
    /// actor is stranded). Returns whether the actor may end.
    pub(super) fn retire(&self, session: &str, rx: &UnboundedReceiver<T>) -> bool {
        let mut senders = self.senders.lock().expect("actor table poisoned");
        if !rx.is_empty() {
            return false;
        }
        if senders.remove(session).is_some() {
            crate::ops::metrics::wake_session_closed();
        }
        true
    }

    /// Removes the entry of an actor that has closed its inbox (at
    /// shutdown), unless a new actor already took its place.
    pub(super) fn forget(&self, session: &str) {
        let mut senders = self.senders.lock().expect("actor table poisoned");
        if senders.get(session).is_some_and(UnboundedSender::is_closed) {
            senders.remove(session);
            crate::ops::metrics::wake_session_closed();
        }
    }

    /// How many sessions have an entry (what the gauge shows).
    pub(super) fn len(&self) -> usize {
        self.senders.lock().expect("actor table poisoned").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A numbered item for a session.
    type Item = (&'static str, u32);

    impl Routed for Item {
        fn session(&self) -> &str {
            self.0
        }
    }

    /// Routes item `n` for `session`; the new inbox if an actor must start.
    fn route(
        actors: &Actors<Item>,
        session: &'static str,
        n: u32,
    ) -> Option<UnboundedReceiver<Item>> {
        actors.route((session, n)).map(|(id, rx)| {
            assert_eq!(id, session);
            rx
        })
    }

    #[test]
    fn a_session_with_a_live_actor_gets_no_second_one() {
        let actors = Actors::new();
        let mut rx = route(&actors, "s1", 1).expect("a first actor");
        assert!(route(&actors, "s1", 2).is_none());
        assert_eq!(
            (rx.try_recv(), rx.try_recv()),
            (Ok(("s1", 1)), Ok(("s1", 2)))
        );
        assert_eq!(actors.len(), 1);
    }

    #[test]
    fn an_idle_actor_retires_but_not_with_something_in_its_inbox() {
        let actors = Actors::new();
        let mut rx = route(&actors, "s1", 1).unwrap();
        assert!(!actors.retire("s1", &rx), "an item is waiting");
        assert_eq!(actors.len(), 1);
        rx.try_recv().unwrap();
        assert!(actors.retire("s1", &rx));
        assert_eq!(actors.len(), 0);
    }

    #[test]
    fn an_actor_that_closed_its_inbox_at_shutdown_leaves_no_entry() {
        let actors = Actors::new();
        let mut rx = route(&actors, "s1", 1).unwrap();
        let _other = route(&actors, "s2", 1).unwrap();
        rx.close();
        actors.forget("s1");
        assert_eq!(actors.len(), 1, "only s2 is left");
    }

    #[test]
    fn a_closed_actor_is_replaced_and_its_successor_is_not_forgotten() {
        let actors = Actors::new();
        let mut old = route(&actors, "s1", 1).unwrap();
        old.close();
        let mut new = route(&actors, "s1", 2).expect("a new actor for the closed one");
        assert_eq!(new.try_recv(), Ok(("s1", 2)));
        actors.forget("s1");
        assert_eq!(actors.len(), 1, "the live successor keeps its entry");
        assert_eq!(
            old.try_recv(),
            Ok(("s1", 1)),
            "the old actor still hands its item back"
        );
    }
}
