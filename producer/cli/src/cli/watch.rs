//! `chime watch`: the DLQ monitor alone, for deployments without a ticker.

use anyhow::Context as _;
use chime_shared::config::ValidConfig;

use super::failure::{Failure, usage};

/// Watches DLQ depths and raises alerts until SIGTERM/SIGINT.
pub async fn run(config: ValidConfig, listen: Option<String>) -> Result<(), Failure> {
    use chime_shared::health::Health;
    let health = Health::new(&["amqp"]);
    let token = tokio_util::sync::CancellationToken::new();
    if let Some(addr) = listen {
        chime_shared::config::check_listen(&addr).map_err(|e| usage(anyhow::anyhow!("--listen {e}")))?;
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))
            .map_err(usage)?;
        let recorder = chime_daemon::telemetry::install_recorder().ok();
        tokio::spawn(chime_daemon::server::serve(listener, health.clone(), recorder, token.clone()));
    }
    let t = token.clone();
    tokio::spawn(async move {
        let _ = chime_daemon::signals::next_stop().await;
        t.cancel();
    });
    chime_scheduler::monitor::run(config, health, token).await;
    Ok(())
}
