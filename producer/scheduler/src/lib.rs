//! chime's scheduler as a library: the ticker that turns cron schedules into exactly one
//! message per due slot (one leader among replicas by a Redis lease, catch-up from shared
//! watermarks, the overlap policy, fan-out of sharded and broadcast jobs), and the DLQ depth
//! monitor that raises alerts. `chime tick` is a thin binary over it; a service can embed a
//! ticker the same way:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use chime_scheduler::ticker::Ticker;
//! let config = chime_shared::Config::load(None)?;
//! let (_tx, rx) = tokio::sync::watch::channel(config);   // send a new config to reload
//! let token = tokio_util::sync::CancellationToken::new();
//! let ticker = Ticker::new(rx, chime_shared::names::process_name(), Default::default())?;
//! ticker.run(token).await; // until the token is cancelled
//! # Ok(()) }
//! ```
//!
//! It installs no signal handler, log subscriber or metrics recorder; the alert monitor's
//! webhook sink is the `webhook` feature (reqwest).

pub mod lease;
pub mod monitor;
pub mod overlap;
pub mod ticker;
