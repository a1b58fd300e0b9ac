//! The JetStream stream every gateway's turn events go to: created by the first gateway that
//! starts and used as it is by the others (its limits checked against theirs), created again
//! when it is lost. Which stream it is (its creation time) is checked when the connection comes
//! back and when NATS announces its creation; then an epoch moves, which the followers start
//! over on (`follow.rs`) and the turns' publishers check what the stream holds on (`publish.rs`).

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_nats::jetstream::{self, ErrorCode, stream};
use futures_util::StreamExt;
use tokio::sync::watch;

use super::{BusError, BusOptions, RETRY, STREAM};

pub(super) struct SharedStream {
    pub(super) stream: stream::Stream,
    /// This gateway's configuration of it, to create it again.
    config: stream::Config,
    /// Its creation time as last seen (unix nanoseconds): a stream created again has another.
    created: Arc<AtomicI64>,
    epoch: watch::Sender<u64>,
    /// When `restore` last asked NATS about the stream.
    checked: Mutex<Option<Instant>>,
}

impl SharedStream {
    /// The stream, created when it does not exist yet. `connections` moves with every
    /// connection the client makes.
    pub(super) async fn open(
        client: &async_nats::Client,
        js: &jetstream::Context,
        options: &BusOptions,
        mut connections: watch::Receiver<u64>,
    ) -> Result<SharedStream, BusError> {
        let config = stream::Config {
            name: STREAM.to_owned(),
            subjects: vec!["dispatch.events.>".to_owned()],
            max_age: options.max_age,
            max_bytes: options.max_bytes,
            storage: stream::StorageType::File,
            discard: stream::DiscardPolicy::Old,
            ..Default::default()
        };
        let advisory = format!("$JS.EVENT.ADVISORY.STREAM.CREATED.{STREAM}");
        let mut announced = client.subscribe(advisory).await.map_err(BusError::js)?;
        connections.mark_unchanged();
        let stream = js.get_or_create_stream(config.clone()).await.map_err(BusError::js)?;
        check_limits(&stream, &config);
        let created = Arc::new(AtomicI64::new(nanos(stream.cached_info())));
        let epoch = watch::Sender::new(0);
        let (current, seen, news) = (stream.clone(), created.clone(), epoch.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    changed = connections.changed() => if changed.is_err() { return },
                    creation = announced.next() => if creation.is_none() { return },
                }
                // Which stream it is now (none: the followers fail, and `restore` brings it back).
                if let Ok(info) = current.get_info().await {
                    seen.store(nanos(&info), Relaxed);
                }
                news.send_modify(|e| *e += 1);
            }
        });
        Ok(SharedStream { stream, config, created, epoch, checked: Mutex::new(None) })
    }

    /// The stream's creation time as last seen.
    pub(super) fn created(&self) -> i64 {
        self.created.load(Relaxed)
    }

    /// Moves on when the connection or the stream comes back.
    pub(super) fn epoch(&self) -> watch::Receiver<u64> {
        self.epoch.subscribe()
    }

    /// Creates the stream again when it is gone (removed by hand, or a NATS server back without
    /// its data): the turns after that reach the other gateways again, with no restart. At most
    /// one request a second, however many followers fail at once.
    pub(super) async fn restore(&self, js: &jetstream::Context) -> Result<(), BusError> {
        {
            let mut checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            if checked.is_some_and(|at| now - at < RETRY) {
                return Ok(());
            }
            *checked = Some(now);
        }
        let found = match js.get_stream(STREAM).await {
            Ok(found) => found,
            Err(e) if matches!(e.kind(), GetStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_NOT_FOUND) =>
            {
                // Creating a stream that another gateway just created, with the same
                // configuration, succeeds.
                let created = js.create_stream(self.config.clone()).await.map_err(BusError::js)?;
                tracing::warn!(stream = STREAM, "the bus's stream was gone: created it again");
                created
            }
            Err(e) => return Err(BusError::js(e)),
        };
        // Known at once, for a publisher about to send into it (NATS's news of a creation
        // comes later, or not at all to a gateway that was away).
        self.created.store(nanos(found.cached_info()), Relaxed);
        Ok(())
    }

    /// The stream's last message on `subject`, if any.
    pub(super) async fn last_message(&self, subject: &str) -> Result<Option<StreamMessage>, BusError> {
        match self.stream.get_last_raw_message_by_subject(subject).await {
            Ok(m) => Ok(Some(m)),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(BusError::js(e)),
        }
    }
}

fn nanos(info: &stream::Info) -> i64 {
    i64::try_from(info.created.unix_timestamp_nanos()).unwrap_or(i64::MAX)
}

/// Says when the stream's retention limits are not this gateway's: a stream that exists keeps
/// the configuration it was created with or an operator gave it (docs/cluster.md), so a changed
/// `--bus-max-age-secs` or `--bus-max-bytes` does not apply to it, and should not pass unsaid.
fn check_limits(stream: &stream::Stream, ours: &stream::Config) {
    let current = &stream.cached_info().config;
    if (current.max_age, current.max_bytes) != (ours.max_age, ours.max_bytes) {
        tracing::warn!(
            stream = STREAM,
            max_age_secs = current.max_age.as_secs(),
            max_bytes = current.max_bytes,
            flag_max_age_secs = ours.max_age.as_secs(),
            flag_max_bytes = ours.max_bytes,
            "the bus's stream keeps its own retention limits, not this gateway's flags (change them with the nats tool)"
        );
    }
}
