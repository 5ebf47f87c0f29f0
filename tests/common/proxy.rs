//! A TCP forwarder between one client and a server that a test can cut
//! (every open connection closed, new ones refused) and restore, as a
//! network outage between that client and NATS would, while other clients
//! keep talking to the server directly.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
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
    /// Bumped by each silencing: the connections open at the time stay
    /// open, but nothing more goes through them either way.
    silences: Arc<watch::Sender<u64>>,
    /// The accept loop.
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Forwards to `127.0.0.1:<target>`.
    pub async fn start(target: u16) -> Self {
        Self::start_delayed(target, Duration::ZERO).await
    }

    /// Forwards to `127.0.0.1:<target>`, every byte `delay` late in each
    /// direction, as a distant client's would be.
    pub async fn start_delayed(target: u16, delay: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        let up = Arc::new(AtomicBool::new(true));
        let cuts = Arc::new(watch::channel(0_u64).0);
        let silences = Arc::new(watch::channel(0_u64).0);
        let task = tokio::spawn({
            let (up, cuts, silences) = (up.clone(), cuts.clone(), silences.clone());
            async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    if !up.load(Ordering::SeqCst) {
                        continue;
                    }
                    let mut cut = cuts.subscribe();
                    let mut silenced = silences.subscribe();
                    tokio::spawn(async move {
                        let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", target)).await
                        else {
                            return;
                        };
                        let forwarding = async {
                            if delay.is_zero() {
                                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound)
                                    .await;
                                return;
                            }
                            let (from_client, to_client) = inbound.split();
                            let (from_server, to_server) = outbound.split();
                            tokio::select! {
                                () = forward_late(from_client, to_server, delay) => {}
                                () = forward_late(from_server, to_client, delay) => {}
                            }
                        };
                        tokio::select! {
                            () = forwarding => return,
                            _ = cut.changed() => return,
                            _ = silenced.changed() => {}
                        }
                        // Silent: both sockets stay open, unread, until a cut.
                        let _ = cut.changed().await;
                        drop((inbound, outbound));
                    });
                }
            }
        });
        Self {
            port,
            up,
            cuts,
            silences,
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

    /// Makes every forwarded connection go silent without closing, as one
    /// to a host that lost power does: nothing more goes through it either
    /// way, and the client learns of it only by its own pings. New
    /// connections are forwarded as before.
    pub fn silence(&self) {
        self.silences.send_modify(|silences| *silences += 1);
    }

    /// Forwards new connections again.
    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to`, each chunk written `delay` after it was read,
/// until either side closes.
async fn forward_late(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    delay: Duration,
) {
    let (chunks, mut due) = tokio::sync::mpsc::unbounded_channel();
    let reading = async move {
        let mut buffer = vec![0_u8; 64 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buffer).await {
            let at = tokio::time::Instant::now() + delay;
            if chunks.send((at, buffer[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    let writing = async move {
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    // Reading ends first when the sender closes; what it read still goes out.
    tokio::join!(reading, writing);
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.cut();
    }
}
