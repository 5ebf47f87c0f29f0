//! A raw NATS client over TCP, for bytes no well-behaved client library
//! would produce (headers that are not UTF-8, say) and for reading the
//! server's `-ERR` answers (permission violations) directly.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub struct RawClient {
    stream: BufReader<TcpStream>,
}

impl RawClient {
    /// Connects, authenticating as `user`/`password` if given; panics if refused.
    pub async fn connect(port: u16, credentials: Option<(&str, &str)>) -> Self {
        match Self::open(port, credentials).await {
            Ok(client) => client,
            Err(refused) => panic!("connection refused: {refused}"),
        }
    }

    /// Connects and returns the server's `-ERR` if it refused the connection.
    pub async fn try_connect(port: u16, credentials: Option<(&str, &str)>) -> Option<String> {
        Self::open(port, credentials).await.err()
    }

    async fn open(port: u16, credentials: Option<(&str, &str)>) -> Result<Self, String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let stream = tokio::time::timeout_at(deadline, TcpStream::connect(("127.0.0.1", port)))
            .await
            .expect("the server accepts within 10 s")
            .expect("connect");
        let mut client = Self {
            stream: BufReader::new(stream),
        };
        let mut line = String::new();
        tokio::time::timeout_at(deadline, client.stream.read_line(&mut line))
            .await
            .expect("the server sends its INFO within 10 s")
            .expect("INFO");
        assert!(line.starts_with("INFO "), "{line}");
        let mut connect = serde_json::json!({
            "verbose": false, "pedantic": false, "headers": true,
            "no_responders": false, "protocol": 1,
        });
        if let Some((user, password)) = credentials {
            connect["user"] = user.into();
            connect["pass"] = password.into();
        }
        client
            .send(format!("CONNECT {connect}\r\n").as_bytes())
            .await;
        match client.ping().await {
            None => Ok(client),
            Some(err) => Err(err),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream.get_mut().write_all(bytes).await.expect("write");
    }

    /// Sends PING and reads until PONG; returns the first `-ERR` line before it.
    async fn ping(&mut self) -> Option<String> {
        self.send(b"PING\r\n").await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut error = None;
        loop {
            let mut line = String::new();
            let read = tokio::time::timeout_at(deadline, self.stream.read_line(&mut line))
                .await
                .expect("server answers PING")
                .unwrap_or(0);
            if read == 0 {
                // Closed by the server (after an authorization error, say).
                return error.or(Some("connection closed".to_owned()));
            }
            if line.starts_with("-ERR") && error.is_none() {
                error = Some(line.trim().to_owned());
            }
            if line.starts_with("PONG") {
                return error;
            }
        }
    }

    /// Publishes `payload` with the raw header block `headers` (which must
    /// start with `NATS/1.0\r\n` and end with `\r\n\r\n`). Returns the
    /// server's `-ERR` if it refused.
    pub async fn hpub(&mut self, subject: &str, headers: &[u8], payload: &[u8]) -> Option<String> {
        let mut out = format!(
            "HPUB {subject} {} {}\r\n",
            headers.len(),
            headers.len() + payload.len()
        )
        .into_bytes();
        out.extend_from_slice(headers);
        out.extend_from_slice(payload);
        out.extend_from_slice(b"\r\n");
        self.send(&out).await;
        self.ping().await
    }

    /// Publishes `payload` without headers on `subject`, given as bytes (so
    /// it need not be UTF-8). Returns the server's `-ERR` if it refused.
    pub async fn pub_bytes(&mut self, subject: &[u8], payload: &[u8]) -> Option<String> {
        let mut out = b"PUB ".to_vec();
        out.extend_from_slice(subject);
        out.extend_from_slice(format!(" {}\r\n", payload.len()).as_bytes());
        out.extend_from_slice(payload);
        out.extend_from_slice(b"\r\n");
        self.send(&out).await;
        self.ping().await
    }

    /// Subscribes to `subject`. Returns the server's `-ERR` if it refused.
    pub async fn sub(&mut self, subject: &str) -> Option<String> {
        self.send(format!("SUB {subject} 1\r\n").as_bytes()).await;
        self.ping().await
    }
}

/// Publishes once on a fresh unauthenticated connection; see [`RawClient::hpub`].
pub async fn hpub(port: u16, subject: &str, headers: &[u8], payload: &[u8]) -> Option<String> {
    RawClient::connect(port, None)
        .await
        .hpub(subject, headers, payload)
        .await
}
