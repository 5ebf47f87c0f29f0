//! A TCP forwarder between one client and a server that a test can cut
//! (every open connection closed, new ones refused) and restore, as a
//! network outage between that client and NATS would, while other clients
//! keep talking to the server directly.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The forwarder; stops accepting when dropped.
pub struct Proxy {
    /// Where clients connect.
    pub port: u16,
    /// Whether connections are forwarded (false: refused).
    up: Arc<AtomicBool>,
    /// Bumped by each cut: the connections open at the time end.
    cuts: Arc<watch::Sender<u64>>,
    /// The accept loop.
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Forwards to `127.0.0.1:<target>`.
    pub async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        let up = Arc::new(AtomicBool::new(true));
        let cuts = Arc::new(watch::channel(0_u64).0);
        let task = tokio::spawn({
            let (up, cuts) = (up.clone(), cuts.clone());
            async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    if !up.load(Ordering::SeqCst) {
                        continue;
                    }
                    let mut cut = cuts.subscribe();
                    tokio::spawn(async move {
                        let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", target)).await
                        else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = cut.changed() => {}
                        }
                    });
                }
            }
        });
        Self {
            port,
            up,
            cuts,
            task,
        }
    }

    /// `bus` for a service whose connection goes through this proxy (and
    /// comes back 100 ms after the proxy does).
    pub async fn bus(&self, bus: &wakebus::bus::Bus) -> wakebus::bus::Bus {
        let client = async_nats::ConnectOptions::new()
            .reconnect_delay_callback(|_| std::time::Duration::from_millis(100))
            .connect(format!("nats://127.0.0.1:{}", self.port))
            .await
            .expect("connect through the proxy");
        wakebus::bus::Bus::new(client, bus.subjects.clone())
    }

    /// Closes every forwarded connection and refuses new ones.
    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.cuts.send_modify(|cuts| *cuts += 1);
    }

    /// Forwards new connections again.
    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.cut();
    }
}
