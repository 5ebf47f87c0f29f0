//! Creating and updating the streams and KV buckets: idempotent, retried
//! while NATS is not up yet, never deleting anything, and keeping the
//! settings an operator set by hand.

use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};
use backon::{ExponentialBuilder, Retryable};
use tracing::{info, warn};

use super::{AgeChange, Bus, BusSettings, ProvisionError, Store, Streams, WakeState};
use crate::protocol::Subjects;

/// Where a KV bucket's reads may be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direct {
    /// Any replica (fast, possibly a little behind).
    AnyReplica,
    /// The stream leader only (sees every acknowledged write).
    LeaderOnly,
}

impl Bus {
    /// Replicas for new streams and buckets when none are configured: 1 on a
    /// single server; on a cluster, the number of servers it advertises to
    /// clients, at most 3 (3 when it advertises none).
    pub async fn default_replicas(&self) -> usize {
        // The client may still be connecting (it retries its first
        // connect); the server's INFO is only known once it is connected.
        if let Err(error) = self.client.flush().await {
            warn!(%error, "Could not reach NATS to read its cluster size.");
        }
        let info = self.client.server_info();
        replicas_for_cluster(info.cluster.as_deref(), &info.connect_urls)
    }

    /// The replicas `name` gets: the configured number, else those it
    /// already has (so a node being down at start never scales a stream
    /// down), else [`Self::default_replicas`].
    async fn replicas_for(
        &self,
        settings: &BusSettings,
        name: &str,
    ) -> Result<usize, ProvisionError> {
        if let Some(replicas) = settings.replicas {
            return Ok(replicas);
        }
        let get_error = |source| ProvisionError::GetStream {
            name: name.to_owned(),
            source,
        };
        match self.js.get_stream(name).await {
            Ok(mut stream) => {
                let info = stream.info().await.map_err(|error| {
                    get_error(jetstream::context::GetStreamError::with_source(
                        jetstream::context::GetStreamErrorKind::Request,
                        error,
                    ))
                })?;
                Ok(info.config.num_replicas.max(1))
            }
            Err(error) if is_stream_not_found(&error) => {
                let replicas = self.default_replicas().await;
                if replicas == 2 {
                    warn!(
                        stream = name,
                        "Creating the stream with 2 replicas, as NATS shows a cluster of 2 servers: it stops taking writes while either is down. If a third node is only down for now, set --replicas 3."
                    );
                }
                Ok(replicas)
            }
            Err(error) => Err(get_error(error)),
        }
    }

    /// Creates or updates the three streams, retrying while NATS is
    /// unreachable (services may start before the server).
    pub async fn provision(&self, settings: &BusSettings) -> Result<Streams, ProvisionError> {
        let attempt = || self.provision_streams(settings);
        Self::patiently(settings, attempt).await
    }

    /// Checks, before anything is changed, that no existing stream or
    /// bucket holds more than the byte limit `settings` asks for it, so
    /// that `init --max-bytes` refused for one part changes none (the same
    /// check is made again as each is updated).
    pub async fn check_max_bytes(&self, settings: &BusSettings) -> Result<(), ProvisionError> {
        for store in Store::ALL {
            let asked = settings.max_bytes.of(store);
            if asked <= 0 {
                continue;
            }
            let name = store.stream(&self.subjects);
            let attempt = || self.js.get_stream(&name);
            let found = attempt.retry(setup_backoff()).when(is_transient).await;
            let stream = match found {
                Ok(stream) => stream,
                Err(error) if is_stream_not_found(&error) => continue,
                Err(source) => return Err(ProvisionError::GetStream { name, source }),
            };
            if let Some(refused) = below_size(&self.subjects, stream.cached_info(), asked) {
                return Err(refused);
            }
        }
        Ok(())
    }

    /// Creates or updates the wake service's KV buckets (ledger and session
    /// locks). Only the wake service and `init` do this, so that the lock
    /// TTL comes from the wake's own settings.
    pub async fn provision_wake_state(
        &self,
        settings: &BusSettings,
    ) -> Result<WakeState, ProvisionError> {
        let attempt = || self.provision_buckets(settings);
        Self::patiently(settings, attempt).await
    }

    /// What a worker provisions: the streams and the cancel bucket, except
    /// that an existing events stream is left alone. A worker may not read
    /// the events stream's info (with a subject filter it lists every
    /// delegation id), so it only checks, by a probe publish, that the
    /// stream exists; a missing one is created as by [`Bus::provision`].
    /// Returns the cancel bucket.
    pub async fn provision_for_worker(
        &self,
        settings: &BusSettings,
    ) -> Result<kv::Store, ProvisionError> {
        let attempt = || async {
            let probe = self
                .subjects
                .event("probe", "probe", 0, crate::protocol::EventKind::Done);
            match crate::worker::probe::last_sequence_on(self, &probe).await {
                Ok(_) => self.provision_worker_streams(settings).await,
                Err(crate::worker::probe::ProbeError::NoStream) => {
                    Ok(self.provision_streams(settings).await?.cancels)
                }
                Err(error) => {
                    warn!(%error, "Could not check the events stream; provisioning as usual.");
                    Ok(self.provision_streams(settings).await?.cancels)
                }
            }
        };
        Self::patiently(settings, attempt).await
    }

    /// Runs `attempt` until it succeeds or fails in a way that does not
    /// pass. A worker or wake (`wait_for_byte_limits`) also waits out an
    /// account's refusal of streams without a byte limit: only `init
    /// --max-bytes` gives them one, and a service started beside it (as a
    /// compose stack starts them) must not exit before it has.
    async fn patiently<T, F, Fut>(settings: &BusSettings, attempt: F) -> Result<T, ProvisionError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ProvisionError>>,
    {
        let waits_for_init = |err: &ProvisionError| {
            settings.wait_for_byte_limits && matches!(err, ProvisionError::MaxBytesRequired { .. })
        };
        attempt
            .retry(setup_backoff())
            .when(|err| may_pass(err) || waits_for_init(err))
            .notify(|err, delay| {
                if waits_for_init(err) {
                    warn!(error = %err, retry_in = ?delay, "Waiting for `wakebus init --max-bytes` to make the deployment's streams: the NATS account requires a byte limit on each, and services never set one; will retry.");
                } else if too_few_servers(err) {
                    warn!(error = %err, retry_in = ?delay, "Provisioning failed: fewer JetStream servers are up than the replicas asked for (--replicas, WAKEBUS_REPLICAS), or their JetStream API or storage is at its limit (a --max-bytes larger than the servers' free storage, say); start the missing servers, ask for fewer replicas or fewer bytes, or see the servers' logs; will retry.");
                } else {
                    warn!(error = %err, retry_in = ?delay, "Provisioning failed: NATS may not be up yet, or this NATS user may not create what is missing (run `wakebus init` as operator); will retry.");
                }
            })
            .await
    }

    async fn provision_streams(&self, settings: &BusSettings) -> Result<Streams, ProvisionError> {
        let s = &self.subjects;
        self.ensure_queue_streams(settings).await?;
        let events = self
            .ensure_stream(
                stream::Config {
                    num_replicas: self.replicas_for(settings, &s.events_stream()).await?,
                    name: s.events_stream(),
                    subjects: vec![s.events_all()],
                    retention: stream::RetentionPolicy::Limits,
                    storage: stream::StorageType::File,
                    max_age: settings.history_max_age,
                    max_bytes: settings.max_bytes.of(Store::Events),
                    // At most the max age: `ensure_stream` sees to it.
                    duplicate_window: settings.duplicate_window,
                    discard: REFUSE_AT_LIMITS,
                    ..Default::default()
                },
                settings.history_change,
                settings,
            )
            .await?;
        let cancels = self.ensure_cancels(settings).await?;
        Ok(Streams { events, cancels })
    }

    /// The requests stream's settings.
    async fn tasks_config(&self, settings: &BusSettings) -> Result<stream::Config, ProvisionError> {
        let s = &self.subjects;
        Ok(stream::Config {
            num_replicas: self.replicas_for(settings, &s.tasks_stream()).await?,
            name: s.tasks_stream(),
            subjects: vec![s.tasks_all()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            max_bytes: settings.max_bytes.of(Store::Tasks),
            duplicate_window: settings.duplicate_window,
            discard: REFUSE_AT_LIMITS,
            ..Default::default()
        })
    }

    /// The dead-letter stream's settings.
    async fn dead_letters_config(
        &self,
        settings: &BusSettings,
    ) -> Result<stream::Config, ProvisionError> {
        let s = &self.subjects;
        Ok(stream::Config {
            num_replicas: self.replicas_for(settings, &s.dead_letter_stream()).await?,
            name: s.dead_letter_stream(),
            subjects: vec![s.dead_letters_all()],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            max_age: settings.dead_letter_max_age,
            max_bytes: settings.max_bytes.of(Store::DeadLetters),
            duplicate_window: settings.duplicate_window,
            // Not REFUSE_AT_LIMITS: a dead letter refused would bring its
            // original back for ever; a capped dead-letter stream drops its
            // oldest instead.
            discard: stream::DiscardPolicy::Old,
            ..Default::default()
        })
    }

    /// The cancel bucket, created or updated.
    async fn ensure_cancels(&self, settings: &BusSettings) -> Result<kv::Store, ProvisionError> {
        let s = &self.subjects;
        self.ensure_bucket(
            kv::Config {
                bucket: s.cancel_bucket(),
                description: "Cancel records: delegations and sessions whose tasks must not run"
                    .to_owned(),
                history: 1,
                max_age: settings.history_max_age,
                max_bytes: settings.max_bytes.of(Store::Cancels),
                storage: stream::StorageType::File,
                num_replicas: self
                    .replicas_for(settings, &Subjects::bucket_stream(&s.cancel_bucket()))
                    .await?,
                ..Default::default()
            },
            Direct::AnyReplica,
            settings.history_change,
            settings,
        )
        .await
    }

    /// [`Bus::provision_streams`] without the events stream.
    async fn provision_worker_streams(
        &self,
        settings: &BusSettings,
    ) -> Result<kv::Store, ProvisionError> {
        self.ensure_queue_streams(settings).await?;
        self.ensure_cancels(settings).await
    }

    /// The requests and dead-letter streams, which every service needs;
    /// their ages are not settings, so existing ones keep theirs.
    async fn ensure_queue_streams(&self, settings: &BusSettings) -> Result<(), ProvisionError> {
        self.ensure_stream(
            self.tasks_config(settings).await?,
            AgeChange::Keep,
            settings,
        )
        .await?;
        self.ensure_stream(
            self.dead_letters_config(settings).await?,
            AgeChange::Keep,
            settings,
        )
        .await?;
        Ok(())
    }

    async fn provision_buckets(&self, settings: &BusSettings) -> Result<WakeState, ProvisionError> {
        let s = &self.subjects;
        let wake_ledger = self
            .ensure_bucket(
                kv::Config {
                    bucket: s.wake_ledger_bucket(),
                    description:
                        "Completions already woken (the wake service's idempotency record)"
                            .to_owned(),
                    history: 1,
                    max_age: settings.history_max_age,
                    max_bytes: settings.max_bytes.of(Store::WakeLedger),
                    storage: stream::StorageType::File,
                    num_replicas: self
                        .replicas_for(settings, &Subjects::bucket_stream(&s.wake_ledger_bucket()))
                        .await?,
                    ..Default::default()
                },
                Direct::LeaderOnly,
                settings.history_change,
                settings,
            )
            .await?;
        let session_locks = self
            .ensure_bucket(
                kv::Config {
                    bucket: s.session_lock_bucket(),
                    description: "Per-session wake locks: one wake post in flight per session"
                        .to_owned(),
                    history: 1,
                    max_age: settings.session_lock_ttl,
                    max_bytes: settings.max_bytes.of(Store::SessionLocks),
                    storage: stream::StorageType::File,
                    num_replicas: self
                        .replicas_for(settings, &Subjects::bucket_stream(&s.session_lock_bucket()))
                        .await?,
                    ..Default::default()
                },
                Direct::LeaderOnly,
                settings.session_lock_ttl_change,
                settings,
            )
            .await?;
        Ok(WakeState {
            wake_ledger,
            session_locks,
        })
    }

    /// Makes sure a stream exists with `config`, its max age changed as
    /// `age_change` allows.
    ///
    /// Reads it first: when it already has these settings (the usual case
    /// once `wakebus init` has run), nothing is written, so a service whose
    /// NATS user may only read stream info starts as well. A stream with
    /// other settings is updated; if that fails (this user may not manage
    /// streams) the stream is used as it is, with a warning. A missing stream
    /// is created; if this user may not, the caller retries until an
    /// operator has run `wakebus init`. A create that another creator beat
    /// (a service starting beside `init`) reads the stream it made and
    /// goes on as for an existing one, so that this one's settings (an
    /// `init --history 30d`, say) are applied, or their refusal reported;
    /// but for its replicas, unless given (`settings.replicas`): a service
    /// that lost the race to `init --replicas 3` must not scale the stream
    /// down to the count it guessed.
    async fn ensure_stream(
        &self,
        config: stream::Config,
        age_change: AgeChange,
        settings: &BusSettings,
    ) -> Result<stream::Stream, ProvisionError> {
        match self
            .ensure_stream_once(config.clone(), age_change, settings)
            .await?
        {
            Some(stream) => Ok(stream),
            None => match self
                .ensure_stream_once(config.clone(), age_change, settings)
                .await?
            {
                Some(stream) => Ok(stream),
                // Deleted again since: as it is now.
                None => self.js.get_stream(&config.name).await.map_err(|source| {
                    ProvisionError::GetStream {
                        name: config.name,
                        source,
                    }
                }),
            },
        }
    }

    /// One pass of [`Self::ensure_stream`]; `None` when another creator
    /// made the stream first (its settings are not checked yet).
    async fn ensure_stream_once(
        &self,
        mut config: stream::Config,
        age_change: AgeChange,
        settings: &BusSettings,
    ) -> Result<Option<stream::Stream>, ProvisionError> {
        let require_update = settings.require_update;
        let name = config.name.clone();
        let existing = self.js.get_stream(&name).await;
        // The server refuses a window longer than the max age; the window
        // asked for is kept to clamp it again to the age the stream keeps.
        let mut window = config.duplicate_window;
        if let Ok(existing) = &existing {
            // A service keeps a shorter window the stream has (the
            // server's limit, which `init` met, or one set by hand, which
            // `init` sets back; workers read the window the stream has):
            // without the permission to update streams, every start would
            // wait out a refused update for nothing.
            // (Not a window that follows a max age below it, as wakebus
            // sets it: that one follows the age this service keeps.)
            let current = &existing.cached_info().config;
            let kept = current.duplicate_window;
            let follows_age = kept == window_within_age(window, current.max_age);
            if !require_update && !kept.is_zero() && kept < window && !follows_age {
                info!(stream = %name, window = ?kept, asked = ?window, "The stream keeps its duplicate window, shorter than the one wakebus asks for: the server's limit, or one set by hand (`wakebus init` sets that back).");
                window = kept;
            }
        }
        config.duplicate_window = window_within_age(window, config.max_age);
        if let (Ok(existing), None) = (&existing, settings.replicas) {
            // The replicas it has, as `replicas_for` would have found had
            // the stream existed then.
            config.num_replicas = existing.cached_info().config.num_replicas;
        }
        match existing {
            Ok(existing) if stream_matches(&existing.cached_info().config, &config) => {
                return Ok(Some(existing));
            }
            Ok(existing) if existing.cached_info().config.subjects != config.subjects => {
                return Err(ProvisionError::SubjectsTaken {
                    name,
                    existing: existing.cached_info().config.subjects.clone(),
                    wanted: config.subjects,
                });
            }
            Ok(existing) => {
                let kept = existing.cached_info().config.max_age;
                let keep_age = match age_change {
                    AgeChange::Keep => true,
                    AgeChange::Lengthen => shortens(kept, config.max_age),
                    AgeChange::Set => false,
                };
                if keep_age && kept != config.max_age {
                    if age_change == AgeChange::Lengthen {
                        warn!(stream = %name, kept = ?kept, asked = ?config.max_age, "This service keeps history for less time than the stream does; the stream keeps its max age, as shortening it deletes what is older at once. Run `wakebus init` with the shorter setting to shorten it on purpose.");
                    } else {
                        info!(stream = %name, kept = ?kept, default = ?config.max_age, "The stream keeps the deployment's max age; this service was given none.");
                    }
                    config.max_age = kept;
                    // The window asked for, within the age kept (not
                    // within the shorter age this service asked for).
                    config.duplicate_window = window_within_age(window, kept);
                    if stream_matches(&existing.cached_info().config, &config) {
                        return Ok(Some(existing));
                    }
                }
                let current = &existing.cached_info().config;
                if let Some(refused) =
                    below_size(&self.subjects, existing.cached_info(), config.max_bytes)
                {
                    return Err(refused);
                }
                let bytes_change = (config.max_bytes > 0 && current.max_bytes != config.max_bytes)
                    .then_some((current.max_bytes, config.max_bytes));
                // Which messages the stream takes and when it lets them go:
                // with these different, the service would not work as
                // documented (storage, say, is the operator's choice).
                let unusable = current.retention != config.retention;
                let asked_age = config.max_age;
                let replicas = (current.num_replicas.max(1), config.num_replicas.max(1));
                let mut update = managed_update(current, config);
                // `init` tries a passing failure (a leader election) a few
                // times before it reports it; a service goes on either way.
                let mut tries = if require_update { UPDATE_TRIES } else { 1 };
                let updated = loop {
                    tries -= 1;
                    match self.js.update_stream(&update).await {
                        Err(source) if tries > 0 && is_transient(&source) => {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(source) => match within_window_limit(&source, &mut update) {
                            // Not a try: it can happen once.
                            Some(limit) => {
                                info!(stream = %name, ?limit, "The server limits the duplicate window (jetstream.limits.duplicate_window) below the one wakebus asks for; the stream keeps the limit.");
                                tries += 1;
                            }
                            None => break Err(source),
                        },
                        Ok(updated) => break Ok(updated),
                    }
                };
                if let Err(source) = updated {
                    // An account that came to require byte limits after the
                    // stream was made refuses any change to it without one.
                    if require_update && is_max_bytes_required(&source) {
                        let part = part_name(&self.subjects, &name);
                        return Err(ProvisionError::MaxBytesRequired { name, part });
                    }
                    if require_update {
                        return Err(ProvisionError::Update { name, source });
                    }
                    if unusable {
                        return Err(ProvisionError::Stream { name, source });
                    }
                    warn!(stream = %name, error = %source, "Stream settings differ from this service's and could not be updated (the server's reason is given; `wakebus init` as operator makes them right); using it as it is.");
                    return Ok(Some(existing));
                }
                let reset = hand_edits_reset(current, &update, window);
                if !reset.is_empty() {
                    warn!(stream = %name, settings = ?reset, "Stream settings that wakebus manages differed from its own and were set back (a change made by hand is undone at every start).");
                }
                match replicas {
                    (was, now) if now < was => {
                        warn!(stream = %name, was, now, "Stream replicas lowered (--replicas): it now survives the loss of fewer nodes.");
                    }
                    (was, now) if now > was => {
                        info!(stream = %name, was, now, "Stream replicas raised (--replicas).");
                    }
                    _ => {}
                }
                if let Some((was, now)) = bytes_change {
                    info!(stream = %name, was, now, "Stream byte limit changed (--max-bytes).");
                }
                if shortens(kept, asked_age) {
                    warn!(stream = %name, was = ?kept, now = ?asked_age, "Stream max age shortened: what was older is deleted.");
                } else if asked_age != kept {
                    info!(stream = %name, was = ?kept, now = ?asked_age, "Stream max age changed.");
                }
            }
            Err(error) if is_stream_not_found(&error) => {
                let subjects = config.subjects.clone();
                let created = match self.js.create_stream(config.clone()).await {
                    Err(error) => match within_window_limit(&error, &mut config) {
                        Some(limit) => {
                            warn!(stream = %name, ?limit, "The server limits the duplicate window (jetstream.limits.duplicate_window) below the one wakebus asks for: the stream is made with its limit. A request or completion sent again after that long is stored again, and is then kept from running or waking twice as after the usual window (docs/GUARANTEES.md, \"The duplicate window is finite\").");
                            self.js.create_stream(config).await
                        }
                        None => Err(error),
                    },
                    created => created,
                };
                match created {
                    Ok(_) => {}
                    // On a cluster, another service may just have created it.
                    Err(error) if is_creation_clash(&error) => return Ok(None),
                    // Also answered to a second create of the same stream on
                    // a cluster, before the first one shows: only another
                    // stream taking the subjects is an error.
                    Err(error) if is_subject_overlap(&error) => {
                        let owner = self.js.stream_by_subject(subjects[0].clone()).await;
                        if let Some(owner) = owner.ok().filter(|owner| *owner != name) {
                            return Err(ProvisionError::SubjectsOverlap {
                                name,
                                subjects,
                                owner,
                            });
                        }
                        return Ok(None);
                    }
                    Err(error) if is_max_bytes_required(&error) => {
                        let part = part_name(&self.subjects, &name);
                        return Err(ProvisionError::MaxBytesRequired { name, part });
                    }
                    Err(source) => {
                        return Err(ProvisionError::Stream {
                            name: name.clone(),
                            source,
                        });
                    }
                }
            }
            Err(source) => return Err(ProvisionError::GetStream { name, source }),
        }
        self.js
            .get_stream(&name)
            .await
            .map(Some)
            .map_err(|source| ProvisionError::GetStream { name, source })
    }

    /// Creates or updates a KV bucket through its backing stream.
    ///
    /// async-nats's own `create_or_update_key_value` first reads the account
    /// info, which it cannot parse from nats-server 2.9; the stream settings
    /// below are the standard KV layout, so any KV client can use the bucket.
    ///
    /// `direct` allows reads from any replica. The wake ledger and the
    /// session locks refuse it: their check-then-act logic needs to read the
    /// latest write, which only the stream leader is sure to have.
    async fn ensure_bucket(
        &self,
        config: kv::Config,
        direct: Direct,
        age_change: AgeChange,
        settings: &BusSettings,
    ) -> Result<kv::Store, ProvisionError> {
        let name = config.bucket.clone();
        self.ensure_stream(
            stream::Config {
                name: format!("KV_{name}"),
                description: Some(config.description),
                subjects: vec![format!("$KV.{name}.>")],
                max_messages_per_subject: config.history.max(1),
                max_age: config.max_age,
                max_bytes: config.max_bytes,
                storage: config.storage,
                allow_rollup: true,
                deny_delete: true,
                deny_purge: false,
                allow_direct: direct == Direct::AnyReplica,
                num_replicas: config.num_replicas.max(1),
                discard: stream::DiscardPolicy::New,
                ..Default::default()
            },
            age_change,
            settings,
        )
        .await?;
        self.js
            .get_key_value(&name)
            .await
            .map_err(|source| ProvisionError::Bucket { name, source })
    }
}

/// How set-up steps retry while NATS is not up yet or what they need is
/// missing: from 200 ms up to every 5 s, for as long as it takes.
pub(crate) fn setup_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(5))
        .with_max_times(usize::MAX)
}

/// How many times `init` tries an update that fails in a way that may
/// pass, before it reports the failure.
const UPDATE_TRIES: u32 = 3;

/// What a new task or events stream does at a limit an operator sets (`max_bytes`,
/// `max_msgs`): refuse the write, which the publisher sees and retries (a
/// worker keeps its result until the completion is stored), rather than
/// delete the oldest messages, stored work among them. The policy of an
/// existing stream is the operator's, and never changed.
const REFUSE_AT_LIMITS: stream::DiscardPolicy = stream::DiscardPolicy::New;

/// Whether `existing` already has every setting wakebus asks for in `wanted`
/// (but for the discard policy: see [`REFUSE_AT_LIMITS`]).
fn stream_matches(existing: &stream::Config, wanted: &stream::Config) -> bool {
    existing.subjects == wanted.subjects
        && existing.retention == wanted.retention
        && existing.max_age == wanted.max_age
        && existing.num_replicas.max(1) == wanted.num_replicas.max(1)
        && unlimited_as_minus_one(existing.max_messages_per_subject)
            == unlimited_as_minus_one(wanted.max_messages_per_subject)
        && existing.allow_rollup == wanted.allow_rollup
        // One-way flags: the server never turns them off, and an operator
        // protecting a stream with them loses nothing wakebus needs.
        && (existing.deny_delete || !wanted.deny_delete)
        && (existing.deny_purge || !wanted.deny_purge)
        && existing.allow_direct == wanted.allow_direct
        // Zero means "server default", which the server fills in.
        && (wanted.duplicate_window.is_zero()
            || existing.duplicate_window == wanted.duplicate_window)
        // None asked for: the stream keeps its own.
        && (wanted.max_bytes <= 0 || existing.max_bytes == wanted.max_bytes)
}

/// `wanted`'s settings on top of the stream's `current` ones: the fields
/// wakebus manages (those [`stream_matches`] compares, and the description)
/// from `wanted`, every other one (limits an operator set by hand, such as
/// `max_msgs`, or `max_bytes` unless `init --max-bytes` names the part,
/// and what the stream does at them) as it is.
fn managed_update(current: &stream::Config, wanted: stream::Config) -> stream::Config {
    stream::Config {
        name: wanted.name,
        description: wanted.description,
        subjects: wanted.subjects,
        retention: wanted.retention,
        max_age: wanted.max_age,
        num_replicas: wanted.num_replicas,
        max_messages_per_subject: wanted.max_messages_per_subject,
        allow_rollup: wanted.allow_rollup,
        deny_delete: current.deny_delete || wanted.deny_delete,
        deny_purge: current.deny_purge || wanted.deny_purge,
        allow_direct: wanted.allow_direct,
        max_bytes: if wanted.max_bytes > 0 {
            wanted.max_bytes
        } else {
            current.max_bytes
        },
        // The server refuses a duplicate window longer than the max age.
        duplicate_window: match (wanted.duplicate_window, wanted.max_age) {
            (asked, _) if !asked.is_zero() => asked,
            (_, age) if !age.is_zero() => current.duplicate_window.min(age),
            _ => current.duplicate_window,
        },
        ..current.clone()
    }
}

/// The settings an update to `wanted` sets back, besides the max age and
/// replicas (which are the deployment's settings, set on purpose):
/// what an operator may have changed by hand, for the warning. A duplicate
/// window that followed the stream's max age (`window` within it, as
/// wakebus sets it) and now follows a new one is no hand edit.
fn hand_edits_reset(
    current: &stream::Config,
    wanted: &stream::Config,
    window: Duration,
) -> Vec<&'static str> {
    let mut reset = Vec::new();
    if unlimited_as_minus_one(current.max_messages_per_subject)
        != unlimited_as_minus_one(wanted.max_messages_per_subject)
    {
        reset.push("max_msgs_per_subject");
    }
    if current.allow_rollup != wanted.allow_rollup {
        reset.push("allow_rollup");
    }
    if current.allow_direct != wanted.allow_direct {
        reset.push("allow_direct");
    }
    if !wanted.duplicate_window.is_zero()
        && current.duplicate_window != wanted.duplicate_window
        && current.duplicate_window != window_within_age(window, current.max_age)
    {
        reset.push("duplicate_window");
    }
    reset
}

/// The duplicate window wakebus gives a stream keeping messages for
/// `max_age` (zero is unlimited): `window`, or the age if shorter, as the
/// server refuses a window longer than the age.
fn window_within_age(window: Duration, max_age: Duration) -> Duration {
    if max_age.is_zero() {
        window
    } else {
        window.min(max_age)
    }
}

/// Whether a stream keeping messages for `kept` would lose some with a max
/// age of `asked` (zero is unlimited).
fn shortens(kept: Duration, asked: Duration) -> bool {
    !asked.is_zero() && (kept.is_zero() || asked < kept)
}

/// Limits of 0 (client default) and -1 (server's "unlimited") mean the same.
fn unlimited_as_minus_one(limit: i64) -> i64 {
    if limit <= 0 { -1 } else { limit }
}

/// Replicas for a server in `cluster` advertising `connect_urls` (its own
/// client URL and its peers'); see [`Bus::default_replicas`].
fn replicas_for_cluster(cluster: Option<&str>, connect_urls: &[String]) -> usize {
    if cluster.is_none() {
        return 1;
    }
    let mut servers: Vec<&str> = connect_urls.iter().map(String::as_str).collect();
    servers.sort_unstable();
    servers.dedup();
    match servers.len() {
        0 => 3,
        n => n.min(3),
    }
}

/// Whether creating a stream failed because one with that name already
/// exists (another service may just have created it).
fn is_creation_clash(error: &jetstream::context::CreateStreamError) -> bool {
    match error.kind() {
        // Not a subject overlap: that is another stream taking these
        // subjects (an archive on `wakebus.>`, a nested prefix), which the
        // create error names and an operator must resolve.
        jetstream::context::CreateStreamErrorKind::JetStream(error) => {
            error.error_code() == jetstream::ErrorCode::STREAM_NAME_EXIST
        }
        _ => false,
    }
}

/// Whether creating a stream failed because another one takes its subjects.
fn is_subject_overlap(error: &jetstream::context::CreateStreamError) -> bool {
    matches!(
        error.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(error)
            if error.error_code() == jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP
    )
}

/// When `refused` says the server limits the duplicate window below
/// `config`'s (`jetstream { limits { duplicate_window } }`, named only in
/// the refusal), lowers it to that limit and returns it: the caller asks
/// again.
fn within_window_limit(
    refused: &impl std::fmt::Display,
    config: &mut stream::Config,
) -> Option<Duration> {
    const SAID: &str = "duplicates window can not be larger then server limit of ";
    let text = refused.to_string();
    let limit = text
        .split_once(SAID)
        .and_then(|(_, after)| after.split_whitespace().next())
        .and_then(|limit| humantime::parse_duration(limit).ok())
        .filter(|limit| !limit.is_zero() && *limit < config.duplicate_window)?;
    config.duplicate_window = limit;
    Some(limit)
}

/// The refusal of a byte limit `asked` for the stream `info` describes, if
/// it is a change and the stream already holds more (at that limit it
/// would refuse every new message, or drop its oldest).
fn below_size(subjects: &Subjects, info: &stream::Info, asked: i64) -> Option<ProvisionError> {
    let holds = info.state.bytes;
    let changes = asked > 0 && info.config.max_bytes != asked;
    (changes && u64::try_from(asked).is_ok_and(|asked| holds > asked)).then(|| {
        ProvisionError::MaxBytesBelowSize {
            name: info.config.name.clone(),
            part: part_name(subjects, &info.config.name),
            holds,
            asked,
        }
    })
}

/// The part of the deployment `stream` holds, as `--max-bytes` names it.
fn part_name(subjects: &Subjects, stream: &str) -> String {
    Store::of_stream(subjects, stream)
        .map_or("PART", Store::name)
        .to_owned()
}

/// Whether a create or update was refused for having no byte limit, in an
/// account that requires one.
fn is_max_bytes_required(error: &jetstream::context::CreateStreamError) -> bool {
    matches!(
        error.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(error)
            if error.error_code() == jetstream::ErrorCode::STREAM_MAX_BYTES_REQUIRED
    )
}

/// Whether opening a KV bucket failed because it does not exist.
pub(crate) fn is_bucket_missing(error: &async_nats::jetstream::context::KeyValueError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<async_nats::jetstream::context::GetStreamError>())
        .is_some_and(is_stream_not_found)
}

/// Whether a stream lookup failed only because the stream does not exist yet.
pub(crate) fn is_stream_not_found(error: &jetstream::context::GetStreamError) -> bool {
    match error.kind() {
        jetstream::context::GetStreamErrorKind::JetStream(error) => {
            error.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
        }
        _ => false,
    }
}

/// Whether a provisioning error may go away by itself, judged by its kind
/// where async-nats gives one and otherwise by the text of the server's or
/// client's error alone (never by ours, which holds names made from the
/// prefix: a prefix `peers` must not make every error look passing).
pub(crate) fn may_pass(err: &ProvisionError) -> bool {
    use jetstream::context::ConsumerInfoErrorKind as Info;
    match err {
        // The operator's to resolve: retrying changes nothing.
        ProvisionError::SubjectsTaken { .. }
        | ProvisionError::SubjectsOverlap { .. }
        | ProvisionError::MaxBytesRequired { .. }
        | ProvisionError::MaxBytesBelowSize { .. } => false,
        // A JetStream that cannot answer yet (a leader election, a cluster
        // still forming, as `docker compose up` restarts it) passes. A
        // timeout does not: the server drops a request the user may not
        // make, and waiting does not give it the permission.
        ProvisionError::Update { source, .. } => {
            use jetstream::context::UpdateStreamErrorKind as Update;
            match source.kind() {
                Update::JetStreamUnavailable => true,
                Update::JetStream(error) => is_transient(&error),
                _ => false,
            }
        }
        ProvisionError::ConsumerInfo { source, .. } => match source.kind() {
            Info::TimedOut | Info::NoResponders | Info::Request | Info::Offline => true,
            Info::JetStream(error) => is_transient(&error),
            _ => false,
        },
        ProvisionError::Stream { source, .. } => is_transient(source),
        ProvisionError::Bucket { source, .. } => is_transient(source),
        ProvisionError::Consumer { source, .. } => is_transient(source),
        // Refused as existing after all (a node that said it did not had
        // not caught up): the next attempt reads it.
        ProvisionError::CreateConsumer { source, .. } => {
            use jetstream::stream::ConsumerCreateStrictErrorKind as Create;
            match source.kind() {
                Create::AlreadyExists | Create::TimedOut | Create::Request => true,
                Create::JetStream(error) => is_transient(&error),
                _ => false,
            }
        }
        // A stream not there (yet): one another instance is creating on a
        // cluster shows a moment later, and one nobody may create here
        // waits for an operator's `init`.
        ProvisionError::GetStream { source, .. } => {
            is_stream_not_found(source) || is_transient(source)
        }
    }
}

/// Whether an error's text says it may go away by itself (server not up,
/// leader election, timeouts) as opposed to a configuration conflict an
/// operator must fix.
pub(crate) fn is_transient(err: &(impl std::fmt::Display + ?Sized)) -> bool {
    let lower = err.to_string().to_ascii_lowercase();
    [
        "timed out",
        "timeout",
        "no responders",
        "not connected",
        "connection",
        "leader",
        "unavailable",
        "temporarily",
        // A replica set without quorum, in a rolling restart.
        "offline",
        // A cluster still forming: not every peer is known yet.
        "peers",
        "insufficient resources",
    ]
    .iter()
    .any(|needle| lower.contains(needle))
}

/// A stream or bucket asked for more replicas than there are JetStream
/// servers up to place them on ("no suitable peers for placement", or
/// "insufficient resources" from older servers, which also say so when
/// their JetStream API is overloaded or a stream's storage does not fit):
/// passing once a node returns, but the usual "not up yet, or not allowed"
/// advice would send an operator the wrong way.
fn too_few_servers(err: &ProvisionError) -> bool {
    let text = err.to_string().to_ascii_lowercase();
    text.contains("insufficient resources") || text.contains("no suitable peers")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duplicate_window_refusal_lowers_the_window_to_the_servers_limit_only_when_shorter() {
        let config = || stream::Config {
            name: "T".to_owned(),
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        };
        let said = |limit: &str| {
            format!(
                "jetstream error: duplicates window can not be larger then server limit of {limit} (code 400, error code 10052)"
            )
        };
        for (limit, expected) in [("1m0s", 60_000), ("1m30.5s", 90_500), ("500ms", 500)] {
            let mut asked = config();
            let lowered = within_window_limit(&said(limit), &mut asked);
            assert_eq!(lowered, Some(Duration::from_millis(expected)), "{limit}");
            assert_eq!(asked.duplicate_window, Duration::from_millis(expected));
        }
        for refused in [
            said("2m0s"),
            said("5m0s"),
            "stream name already in use".to_owned(),
        ] {
            let mut asked = config();
            assert_eq!(within_window_limit(&refused, &mut asked), None, "{refused}");
            assert_eq!(asked.duplicate_window, Duration::from_secs(120));
        }
    }

    fn urls(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("10.0.0.{i}:4222")).collect()
    }

    #[test]
    fn errors_pass_by_their_kind_not_by_names_made_from_the_prefix() {
        use jetstream::context::{ConsumerInfoError, ConsumerInfoErrorKind};
        // A prefix that happens to hold a word of a passing error.
        let taken = ProvisionError::SubjectsTaken {
            name: "PEERS_TIMEOUT_TASKS".to_owned(),
            existing: vec!["peers.timeout.x.>".to_owned()],
            wanted: vec!["peers.timeout.task.>".to_owned()],
        };
        assert!(!may_pass(&taken));
        let info = |kind| ProvisionError::ConsumerInfo {
            name: "wake".to_owned(),
            stream: "LEADERBOARD_EVENTS".to_owned(),
            source: ConsumerInfoError::new(kind),
        };
        assert!(may_pass(&info(ConsumerInfoErrorKind::TimedOut)));
        assert!(may_pass(&info(ConsumerInfoErrorKind::Offline)));
        assert!(!may_pass(&info(ConsumerInfoErrorKind::InvalidName)));
    }

    /// `init`'s stream update is tried again while JetStream cannot answer
    /// (it gave up after three tries, and compose started nothing), but
    /// not after a timeout, which is how a user without the permission
    /// sees it.
    #[test]
    fn an_update_passes_while_jetstream_is_unavailable_but_not_after_a_timeout() {
        use jetstream::context::{UpdateStreamError, UpdateStreamErrorKind};
        let update = |kind| ProvisionError::Update {
            name: "P_TASKS".to_owned(),
            source: UpdateStreamError::new(kind),
        };
        assert!(may_pass(&update(
            UpdateStreamErrorKind::JetStreamUnavailable
        )));
        assert!(!may_pass(&update(UpdateStreamErrorKind::TimedOut)));
        assert!(!may_pass(&update(UpdateStreamErrorKind::InvalidStreamName)));
    }

    #[test]
    fn an_update_names_the_hand_made_settings_it_sets_back() {
        let wanted = stream::Config {
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        };
        let window = Duration::from_secs(120);
        let mut edited = wanted.clone();
        assert!(hand_edits_reset(&edited, &wanted, window).is_empty());
        edited.allow_direct = true;
        edited.max_messages_per_subject = 5;
        edited.duplicate_window = Duration::from_secs(600);
        edited.max_age = Duration::from_secs(60);
        assert_eq!(
            hand_edits_reset(&edited, &wanted, window),
            ["max_msgs_per_subject", "allow_direct", "duplicate_window"]
        );
    }

    #[test]
    fn a_window_that_followed_the_max_age_is_no_hand_edit() {
        let window = Duration::from_secs(120);
        let stream = |age: u64, window: u64| stream::Config {
            max_age: Duration::from_secs(age),
            duplicate_window: Duration::from_secs(window),
            ..Default::default()
        };
        // `init --history 30s`, then 1h, then 30s again.
        assert!(hand_edits_reset(&stream(30, 30), &stream(3600, 120), window).is_empty());
        assert!(hand_edits_reset(&stream(3600, 120), &stream(30, 30), window).is_empty());
        // A window set apart from the age is one.
        assert_eq!(
            hand_edits_reset(&stream(30, 10), &stream(3600, 120), window),
            ["duplicate_window"]
        );
    }

    #[test]
    fn a_single_server_gets_one_replica() {
        assert_eq!(replicas_for_cluster(None, &[]), 1);
        assert_eq!(replicas_for_cluster(None, &urls(1)), 1);
    }

    #[test]
    fn a_cluster_gets_its_size_in_replicas_at_most_three() {
        assert_eq!(replicas_for_cluster(Some("c"), &urls(2)), 2);
        assert_eq!(replicas_for_cluster(Some("c"), &urls(3)), 3);
        assert_eq!(replicas_for_cluster(Some("c"), &urls(5)), 3);
    }

    #[test]
    fn a_cluster_that_advertises_no_urls_gets_three_replicas() {
        assert_eq!(replicas_for_cluster(Some("c"), &[]), 3);
    }

    #[test]
    fn a_url_advertised_twice_counts_once() {
        let twice = vec!["10.0.0.1:4222".to_owned(), "10.0.0.1:4222".to_owned()];
        assert_eq!(replicas_for_cluster(Some("c"), &twice), 1);
    }
}
