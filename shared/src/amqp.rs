//! AMQP connections: several URLs tried in turn, heartbeats on, a connect timeout, and a
//! publish helper that treats a returned (unroutable) message as a failure.

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use lapin::{Confirmation, PublisherConfirm};
use std::time::Duration;

use crate::config::AmqpConfig;
use crate::redact::redact;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What can go wrong talking to RabbitMQ.
#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    /// No URL of `amqp.url` answered.
    #[error("cannot connect to RabbitMQ ({urls}): {last}")]
    Connect {
        /// The URLs tried, passwords redacted.
        urls: String,
        /// Why the last one failed.
        last: String,
    },
    /// The publish itself failed (channel or connection closed).
    #[error("publish to {exchange}/{routing_key} failed: {source}")]
    Publish {
        /// Exchange published to.
        exchange: String,
        /// Routing key used.
        routing_key: String,
        /// lapin's error.
        source: Box<lapin::Error>,
    },
    /// The broker could route the (mandatory) message to no queue and returned it.
    #[error(
        "broker returned the message to {exchange}/{routing_key} as unroutable ({reply}): no queue is bound"
    )]
    Returned {
        /// Exchange published to.
        exchange: String,
        /// Routing key used.
        routing_key: String,
        /// The broker's reply code and text.
        reply: String,
    },
    /// The broker refused the message (negative confirm).
    #[error("broker nacked the message to {exchange}/{routing_key}")]
    Nacked {
        /// Exchange published to.
        exchange: String,
        /// Routing key used.
        routing_key: String,
    },
    /// No confirm within `amqp.publish_timeout`: the message may or may not be in a queue.
    #[error(
        "no publisher confirm within {} (amqp.publish_timeout): the broker may be blocking publishers \
         (memory or disk alarm) or be unreachable; the message may still arrive, so retry with the same key",
        crate::duration::format(*.0)
    )]
    ConfirmTimeout(Duration),
    /// A publish channel could not be opened (or put in confirm mode).
    #[error("cannot open a publish channel: {0}")]
    Channel(String),
    /// The broker returned a message on this channel that was not this publish: the channel
    /// had several publishers, and which message was returned cannot be told apart.
    #[error(
        "the broker returned another publish's message on the channel of the publish to {exchange}/{routing_key}: \
         whether this one was routed is unknown"
    )]
    ForeignReturn {
        /// Exchange published to.
        exchange: String,
        /// Routing key used.
        routing_key: String,
    },
    /// The message shared one publish with others (a pack of parked copies), which failed.
    #[error("the pack this message was sent in was not published: {0}")]
    Shared(String),
    /// The channel was not in confirm mode, so nothing proves delivery.
    #[error("publish to {exchange}/{routing_key} was not confirmed: the channel is not in confirm mode")]
    NotConfirmed {
        /// Exchange published to.
        exchange: String,
        /// Routing key used.
        routing_key: String,
    },
}

impl AmqpError {
    /// Everything here may succeed on a retry, except a message the broker could not route.
    pub fn is_transient(&self) -> bool {
        !matches!(self, AmqpError::Returned { .. })
    }
}

fn with_heartbeat(url: &str, heartbeat: Duration) -> String {
    if url.contains("heartbeat=") {
        return url.to_string();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}heartbeat={}", heartbeat.as_secs().max(1))
}

/// Explains a connect that timed out: a broker that accepts TCP but never completes the AMQP
/// handshake is usually out of file handles (every queue reserves some) or memory.
async fn handshake_timeout(url: &str) -> String {
    let authority = url.split("://").nth(1).unwrap_or(url);
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    let hostport = authority.split(['/', '?']).next().unwrap_or(authority);
    let default = if url.starts_with("amqps://") { 5671 } else { 5672 };
    let addr = if hostport.contains(':') { hostport.to_string() } else { format!("{hostport}:{default}") };
    let tcp = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(&addr)).await;
    if matches!(tcp, Ok(Ok(_))) {
        format!(
            "the broker accepts TCP connections but did not complete the AMQP handshake within \
             {CONNECT_TIMEOUT:?}: it may be out of file handles (every queue reserves some; see README, \
             \"What chime needs from the broker\") or blocked by a resource alarm"
        )
    } else {
        format!("no TCP connection to {addr} within {CONNECT_TIMEOUT:?}")
    }
}

/// The TLS connector of `amqps://` URLs (none in a build without the `tls` feature).
#[cfg(feature = "tls")]
type Tls = std::sync::Arc<lapin::tcp::RustlsConnector>;
#[cfg(not(feature = "tls"))]
type Tls = NoTls;

/// No TLS connector can exist in a build without TLS.
#[cfg(not(feature = "tls"))]
#[derive(Clone)]
enum NoTls {}

/// One connection to `url` over TCP, or over TLS with `tls` for `amqps://`.
async fn connect_one(url: &str, props: ConnectionProperties, tls: Option<Tls>) -> lapin::Result<Connection> {
    use lapin::tcp::AsyncTcpStream;
    use lapin::uri::{AMQPScheme, AMQPUri};
    let uri: AMQPUri =
        url.parse().map_err(|e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let runtime = lapin::runtime::default_runtime()?;
    let connect = async move |uri: AMQPUri, runtime| {
        let host = uri.authority.host.clone();
        let addrs: Vec<std::net::SocketAddr> =
            tokio::net::lookup_host((host.as_str(), uri.authority.port)).await?.collect();
        let stream = AsyncTcpStream::connect(&runtime, addrs).await?;
        match (uri.scheme, &tls) {
            (AMQPScheme::AMQP, _) => Ok(stream),
            #[cfg(feature = "tls")]
            (AMQPScheme::AMQPS, Some(tls)) => Ok(stream.into_rustls(tls, &host).await?),
            // Never plaintext for amqps:// (the connector exists whenever a URL is amqps://
            // in a build with TLS; without it, validation refuses such a URL).
            (AMQPScheme::AMQPS, _) => Err(std::io::Error::other("amqps:// without a TLS connector").into()),
        }
    };
    Connection::connector(uri, runtime, connect, props).await
}

/// Connects to the first URL of `config.url` that answers.
pub async fn connect(config: &AmqpConfig, connection_name: &str) -> Result<Connection, AmqpError> {
    let urls = config.url.list();
    let joined = || urls.iter().map(|u| redact(u)).collect::<Vec<_>>().join(", ");
    // TLS files are read at every connect, so renewed certificates are picked up on reconnect.
    #[cfg(feature = "tls")]
    let tls = if urls.iter().any(|u| u.starts_with("amqps://")) {
        crate::tls::install_crypto_provider();
        let connector = crate::tls::amqp_tls(&config.tls)
            .map_err(|e| AmqpError::Connect { urls: joined(), last: e.to_string() })?;
        Some(std::sync::Arc::new(connector))
    } else {
        None
    };
    #[cfg(not(feature = "tls"))]
    let tls: Option<Tls> = None;
    let mut last = String::from("no URL configured");
    for url in &urls {
        let props = ConnectionProperties::default().with_connection_name(connection_name.into());
        let full = with_heartbeat(url, config.heartbeat);
        match tokio::time::timeout(CONNECT_TIMEOUT, connect_one(&full, props, tls.clone())).await {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(e)) => {
                let text = format!("{}: {e}", redact(url));
                last = if url.starts_with("amqps://")
                    && crate::tls::explain(&text).is_none()
                    && text.contains("reset by peer")
                {
                    format!(
                        "{text} (TLS: the broker closed the connection during the handshake: it may require a \
                         client certificate (amqp.tls.client_cert) or refuse the one sent)"
                    )
                } else {
                    crate::tls::with_explanation(text)
                };
            }
            Err(_) => last = format!("{}: {}", redact(url), handshake_timeout(url).await),
        }
    }
    Err(AmqpError::Connect { urls: joined(), last })
}

/// Publishes one message with `mandatory` set on a channel in confirm mode and waits for
/// its confirm. A returned message or a nack is an error: the message is not in a queue.
///
/// The channel must have no other publish outstanding (a [`ChannelPool`] lends it so, or one
/// task uses it one message at a time): see [`Returns`].
pub async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
    timeout: Duration,
) -> Result<(), AmqpError> {
    let pending = publish(channel, exchange, routing_key, body, props).await?;
    check_confirm(pending, exchange, routing_key, body, timeout).await
}

/// Awaits the confirm of the only publish outstanding on its channel.
pub async fn check_confirm(
    pending: PublisherConfirm,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<(), AmqpError> {
    let mut returns = Returns::default();
    returns.confirm(pending, exchange, routing_key, timeout).await?;
    if let Some(e) = returns.take(exchange, routing_key, body) {
        return Err(e);
    }
    if returns.is_empty() {
        Ok(())
    } else {
        Err(AmqpError::ForeignReturn { exchange: exchange.to_string(), routing_key: routing_key.to_string() })
    }
}

/// Returned (unroutable) messages seen among one caller's confirms, matched to their
/// publishes by content.
///
/// The broker sends `basic.return` before the ack of the returned message, and often acks
/// several messages with one `multiple` ack; AMQP does not say which of them came back. lapin
/// hands each returned message to whichever publish of that ack it resolves first (hash-map
/// order), so on a channel with several outstanding publishes the return may reach the wrong
/// one: the unroutable message would count as confirmed. Here every confirm's returned
/// message goes into a pool, and each publish asks, once all of its channel's confirms are in,
/// whether its own exchange, routing key and body came back. A channel's outstanding publishes
/// must all belong to one caller ([`ChannelPool`]), so that "all confirms are in" is known.
#[derive(Debug, Default)]
pub struct Returns(Vec<lapin::message::BasicReturnMessage>);

impl Returns {
    /// Awaits one confirm. `Ok` when the broker acked it; a returned message it carries (maybe
    /// another publish's) goes into the pool.
    pub async fn confirm(
        &mut self,
        pending: PublisherConfirm,
        exchange: &str,
        routing_key: &str,
        timeout: Duration,
    ) -> Result<(), AmqpError> {
        self.confirm_named(pending, timeout, || (exchange.to_string(), routing_key.to_string())).await
    }

    /// [`Self::confirm`], with the publish's exchange and routing key made by `names` only for
    /// an error (a batch keeps no names for its thousands of outstanding publishes).
    pub async fn confirm_named(
        &mut self,
        pending: PublisherConfirm,
        timeout: Duration,
        names: impl FnOnce() -> (String, String),
    ) -> Result<(), AmqpError> {
        let mut pending = std::pin::pin!(pending);
        // Most confirms of a pipelined batch are in when they are awaited: no timer for those.
        let ready = std::future::poll_fn(|cx| std::task::Poll::Ready(pending.as_mut().poll(cx))).await;
        let confirmation = match ready {
            std::task::Poll::Ready(c) => c,
            std::task::Poll::Pending => tokio::time::timeout(timeout, pending)
                .await
                .map_err(|_| AmqpError::ConfirmTimeout(timeout))?,
        };
        let confirmation = match confirmation {
            Ok(c) => c,
            Err(source) => {
                let (exchange, routing_key) = names();
                return Err(AmqpError::Publish { exchange, routing_key, source: Box::new(source) });
            }
        };
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) => {
                self.0.push(returned);
                Ok(())
            }
            // A channel without confirm mode proves nothing: never count it as delivered.
            Confirmation::NotRequested => {
                let (exchange, routing_key) = names();
                Err(AmqpError::NotConfirmed { exchange, routing_key })
            }
            Confirmation::Nack(returned) => {
                self.0.extend(returned);
                let (exchange, routing_key) = names();
                Err(AmqpError::Nacked { exchange, routing_key })
            }
        }
    }

    /// The publish of `body` to `exchange`/`routing_key` came back: its return is removed from
    /// the pool and reported as [`AmqpError::Returned`].
    pub fn take(&mut self, exchange: &str, routing_key: &str, body: &[u8]) -> Option<AmqpError> {
        let i = self.0.iter().position(|r| {
            r.delivery.exchange.as_str() == exchange
                && r.delivery.routing_key.as_str() == routing_key
                && r.delivery.data == body
        })?;
        let r = self.0.swap_remove(i);
        Some(AmqpError::Returned {
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            reply: format!("{} {}", r.reply_code, r.reply_text.as_str()),
        })
    }

    /// No returned message is waiting for its publish.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Confirm-mode channels on one connection, each lent to one caller at a time (one publish,
/// or one batch), so that a channel's outstanding publishes all belong to one caller (see
/// [`Returns`]). Channels are opened on demand, up to a limit, and kept while they are clean.
pub struct ChannelPool {
    conn: std::sync::Arc<Connection>,
    idle: std::sync::Mutex<Vec<Channel>>,
    permits: tokio::sync::Semaphore,
}

impl std::fmt::Debug for ChannelPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelPool").field("available", &self.permits.available_permits()).finish()
    }
}

/// A channel lent by a [`ChannelPool`]: it goes back to the pool when dropped after
/// [`Lent::settled`], and is closed otherwise (a cancelled caller may have left a publish
/// outstanding on it).
pub struct Lent<'a> {
    pool: &'a ChannelPool,
    channel: Option<Channel>,
    settled: bool,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl Lent<'_> {
    /// The lent channel (in confirm mode).
    pub fn channel(&self) -> &Channel {
        // Present until drop.
        self.channel.as_ref().unwrap_or_else(|| unreachable!("a lent channel is present until dropped"))
    }

    /// Every publish made on the channel has its confirm (or its error): it may be lent again.
    pub fn settled(mut self) {
        self.settled = true;
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let Some(channel) = self.channel.take() else { return };
        if self.settled && channel.status().connected() {
            if let Ok(mut idle) = self.pool.idle.lock() {
                idle.push(channel);
            }
        } else if channel.status().connected()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move {
                let _ = channel.close(200, "abandoned publish".into()).await;
            });
        }
    }
}

impl ChannelPool {
    /// A pool of at most `limit` channels on `conn`.
    pub fn new(conn: std::sync::Arc<Connection>, limit: usize) -> Self {
        Self {
            conn,
            idle: std::sync::Mutex::new(Vec::new()),
            permits: tokio::sync::Semaphore::new(limit.max(1)),
        }
    }

    /// The connection the channels are on.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// Lends a channel, waiting while all `limit` are lent.
    pub async fn lend(&self) -> Result<Lent<'_>, AmqpError> {
        let permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| AmqpError::Channel("the channel pool is closed".into()))?;
        let idle = self.idle.lock().ok().and_then(|mut idle| {
            idle.retain(|c| c.status().connected());
            idle.pop()
        });
        let channel = match idle {
            Some(c) => c,
            None => {
                let c = self.conn.create_channel().await.map_err(|e| AmqpError::Channel(e.to_string()))?;
                c.confirm_select(lapin::options::ConfirmSelectOptions::default())
                    .await
                    .map_err(|e| AmqpError::Channel(e.to_string()))?;
                c
            }
        };
        Ok(Lent { pool: self, channel: Some(channel), settled: false, _permit: permit })
    }

    /// Publishes one message on a lent channel and waits for its confirm (see
    /// [`publish_confirmed`]).
    pub async fn publish_confirmed(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
        timeout: Duration,
    ) -> Result<(), AmqpError> {
        let lent = self.lend().await?;
        let r = publish_confirmed(lent.channel(), exchange, routing_key, body, props, timeout).await;
        // Without a confirm, the publish is still outstanding on the channel: do not lend it again.
        if !matches!(r, Err(AmqpError::ConfirmTimeout(_))) {
            lent.settled();
        }
        r
    }

    /// Closes every idle channel (the lent ones close with their lenders or the connection).
    pub async fn close(&self) {
        let idle: Vec<Channel> = self.idle.lock().map(|mut i| std::mem::take(&mut *i)).unwrap_or_default();
        for c in idle {
            let _ = c.close(200, "closing".into()).await;
        }
    }
}

/// Sends a mandatory publish and returns its pending confirm (for pipelining).
pub async fn publish(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
) -> Result<PublisherConfirm, AmqpError> {
    let mut sent =
        publish_group(channel, std::iter::once(Outgoing { exchange, routing_key, body, props })).await;
    sent.pop().unwrap_or_else(|| {
        Err(AmqpError::NotConfirmed { exchange: exchange.to_string(), routing_key: routing_key.to_string() })
    })
}

/// One message for [`publish_group`].
#[derive(Debug)]
pub struct Outgoing<'a> {
    /// Exchange to publish to.
    pub exchange: &'a str,
    /// Routing key.
    pub routing_key: &'a str,
    /// The body.
    pub body: &'a [u8],
    /// Its properties.
    pub props: BasicProperties,
}

/// Publishes worth handing to [`publish_group`] at once: 256 in a group with 4,096 confirms
/// outstanding was the fastest shape of a raw lapin publisher on the development machine
/// (`chime-bench --only baseline`).
pub const PUBLISH_GROUP: usize = 256;

/// Polls each of `futures` once, in order, holding what `guard` returns meanwhile, and returns
/// the outputs of those that finished at once. A lapin method sends its frames at its first
/// poll: they go out in this order, back to back, none waiting for an earlier reply.
pub async fn poll_each_once<F: Future + Unpin, G>(
    futures: &mut [F],
    guard: impl Fn() -> G,
) -> Vec<Option<F::Output>> {
    let mut done: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let _held = guard();
        for (f, slot) in futures.iter_mut().zip(done.iter_mut()) {
            if let std::task::Poll::Ready(r) = std::pin::Pin::new(&mut *f).poll(cx) {
                *slot = Some(r);
            }
        }
        std::task::Poll::Ready(())
    })
    .await;
    done
}

/// Serialises the first step of every publish in this process (see [`publish_group`]).
static PUBLISH_ORDER: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Hands a group of mandatory publishes to lapin at once and returns their pending confirms,
/// in order.
///
/// Two things happen here that a plain `basic_publish(..).await` per message does not do:
/// - **The frames of the whole group are queued before any write is awaited**, so lapin's I/O
///   thread writes them in a few socket writes instead of one write and one wake-up per
///   message (measured: 5.2 system calls per message one by one, 0.4 in groups of 256).
/// - **Each publish takes its delivery tag and queues its frames in one step**, under a
///   process-wide lock. lapin numbers a publish before it queues the frames, so two tasks
///   publishing on one channel from two threads could queue their frames in the opposite
///   order of their numbers; the broker numbers by arrival, and a confirm (or a returned,
///   unroutable message) would then resolve the other task's publish: an unroutable message
///   reported as confirmed. The lock covers only the synchronous first poll of each publish.
pub async fn publish_group<'a>(
    channel: &Channel,
    group: impl IntoIterator<Item = Outgoing<'a>>,
) -> Vec<Result<PublisherConfirm, AmqpError>> {
    let (mut sends, names): (Vec<std::pin::Pin<Box<_>>>, Vec<(&str, &str)>) = group
        .into_iter()
        .map(|m| {
            let send = channel.basic_publish(
                m.exchange.into(),
                m.routing_key.into(),
                BasicPublishOptions { mandatory: true, ..Default::default() },
                m.body,
                m.props,
            );
            (Box::pin(send), (m.exchange, m.routing_key))
        })
        .unzip();
    // A poisoned lock only means another publish panicked mid-poll; the order still holds.
    let done = poll_each_once(&mut sends, || {
        PUBLISH_ORDER.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    })
    .await;
    let mut out = Vec::with_capacity(sends.len());
    for ((send, (exchange, routing_key)), slot) in sends.into_iter().zip(names).zip(done) {
        let r = match slot {
            Some(r) => r,
            None => send.await,
        };
        out.push(r.map_err(|source| AmqpError::Publish {
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            source: Box::new(source),
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_is_added_once() {
        let hb = Duration::from_secs(10);
        assert_eq!(with_heartbeat("amqp://h/%2f", hb), "amqp://h/%2f?heartbeat=10");
        assert_eq!(
            with_heartbeat("amqp://h/%2f?frame_max=8192", hb),
            "amqp://h/%2f?frame_max=8192&heartbeat=10"
        );
        assert_eq!(with_heartbeat("amqp://h/%2f?heartbeat=3", hb), "amqp://h/%2f?heartbeat=3");
    }
}
