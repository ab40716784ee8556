//! A TCP forwarder on a loopback port whose target can be switched: a stand-in for the proxy or
//! virtual IP that follows a Redis failover to the new master. Switching closes every open
//! connection, as a failover does.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct TcpSwitch {
    pub port: u16,
    target: Arc<AtomicU16>,
    generation: watch::Sender<u64>,
    task: JoinHandle<()>,
}

impl TcpSwitch {
    pub async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(AtomicU16::new(target));
        let (generation, _) = watch::channel(0u64);
        let (t, g) = (target.clone(), generation.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let to = t.load(Ordering::SeqCst);
                let mut changed = g.subscribe();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", to)).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = changed.changed() => {}
                    }
                });
            }
        });
        Self { port, target, generation, task }
    }

    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// New connections go to `target`; open ones are closed.
    pub fn switch(&self, target: u16) {
        self.target.store(target, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }
}

impl Drop for TcpSwitch {
    fn drop(&mut self) {
        self.task.abort();
        self.generation.send_modify(|g| *g += 1);
    }
}
