//! A raw NATS client over TCP, for publishing bytes no well-behaved client
//! library would produce (headers that are not UTF-8, say).

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Publishes `payload` with the raw header block `headers` (which must start
/// with `NATS/1.0\r\n` and end with `\r\n\r\n`), then waits for the server's
/// PONG so the message has been processed. Returns the server's `-ERR` line,
/// if it sent one.
pub async fn hpub(port: u16, subject: &str, headers: &[u8], payload: &[u8]) -> Option<String> {
    let stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let mut stream = BufReader::new(stream);
    let mut line = String::new();
    stream.read_line(&mut line).await.expect("INFO");
    assert!(line.starts_with("INFO "), "{line}");
    let mut out = Vec::new();
    out.extend_from_slice(
        b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"no_responders\":false,\"protocol\":1}\r\n",
    );
    out.extend_from_slice(
        format!(
            "HPUB {subject} {} {}\r\n",
            headers.len(),
            headers.len() + payload.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(headers);
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\nPING\r\n");
    stream.get_mut().write_all(&out).await.expect("write");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        line.clear();
        let read = tokio::time::timeout_at(deadline, stream.read_line(&mut line))
            .await
            .expect("server answers PING")
            .expect("read");
        assert!(read > 0, "server closed the connection");
        if line.starts_with("-ERR") {
            return Some(line.trim().to_owned());
        }
        if line.starts_with("PONG") {
            return None;
        }
    }
}
