//! AMQP connections: several URLs tried in turn, heartbeats on, a connect timeout, and a
//! publish helper that treats a returned (unroutable) message as a failure.

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use lapin::{Confirmation, PublisherConfirm};
use std::time::Duration;

use crate::config::{AmqpConfig, redact};

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
        "no publisher confirm within {0:?} (amqp.publish_timeout): the broker may be blocking publishers \
         (memory or disk alarm) or be unreachable; the message may still arrive, so retry with the same key"
    )]
    ConfirmTimeout(Duration),
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

/// Connects to the first URL of `config.url` that answers.
pub async fn connect(config: &AmqpConfig, connection_name: &str) -> Result<Connection, AmqpError> {
    let urls = config.url.list();
    let joined = || urls.iter().map(|u| redact(u)).collect::<Vec<_>>().join(", ");
    // TLS files are read at every connect, so renewed certificates are picked up on reconnect.
    let tls = crate::tls::amqp_tls(config)
        .map_err(|e| AmqpError::Connect { urls: joined(), last: e.to_string() })?;
    crate::tls::install_crypto_provider();
    let mut last = String::from("no URL configured");
    for url in &urls {
        let props = ConnectionProperties::default().with_connection_name(connection_name.into());
        let full = with_heartbeat(url, config.heartbeat);
        let builder = lapin::ConnectionBuilder::new()
            .map_err(|e| AmqpError::Connect { urls: joined(), last: e.to_string() })?
            .with_uri_str(full)
            .with_properties(props)
            .with_tls_config(tls.clone());
        match tokio::time::timeout(CONNECT_TIMEOUT, builder.connect()).await {
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
pub async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
    timeout: Duration,
) -> Result<(), AmqpError> {
    let pending = publish(channel, exchange, routing_key, body, props).await?;
    check_confirm(pending, exchange, routing_key, timeout).await
}

/// Sends a mandatory publish and returns its pending confirm (for pipelining).
pub async fn publish(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
) -> Result<PublisherConfirm, AmqpError> {
    channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions { mandatory: true, ..Default::default() },
            body,
            props,
        )
        .await
        .map_err(|source| AmqpError::Publish {
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            source: Box::new(source),
        })
}

/// Awaits a pending confirm; `Ack(Some(returned))` counts as a failure (lapin reports a
/// returned mandatory message as an ack carrying the message).
pub async fn check_confirm(
    pending: PublisherConfirm,
    exchange: &str,
    routing_key: &str,
    timeout: Duration,
) -> Result<(), AmqpError> {
    let confirmation = tokio::time::timeout(timeout, pending)
        .await
        .map_err(|_| AmqpError::ConfirmTimeout(timeout))?
        .map_err(|source| AmqpError::Publish {
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            source: Box::new(source),
        })?;
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        // A channel without confirm mode proves nothing: never count it as delivered.
        Confirmation::NotRequested => Err(AmqpError::NotConfirmed {
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
        }),
        Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => Err(AmqpError::Returned {
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            reply: format!("{} {}", returned.reply_code, returned.reply_text.as_str()),
        }),
        Confirmation::Nack(None) => {
            Err(AmqpError::Nacked { exchange: exchange.to_string(), routing_key: routing_key.to_string() })
        }
    }
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
