//! The HTTP side of the metrics endpoint (hyper 1, HTTP/1.1): `GET /metrics` and clear errors for anything
//! else, with bounds so that a flood costs the agent a fixed amount: at most [`MAX_CONNECTIONS`] at once (one
//! more is answered 503 and closed at once), headers within [`HEADER_TIMEOUT`], a whole connection within
//! [`CONNECTION_TIMEOUT`], one request per connection, request heads of at most [`MAX_HEAD_BYTES`].
use std::{
    convert::Infallible,
    sync::Arc,
    time::{Duration, Instant},
};

use http_body_util::Full;
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Bytes, Incoming},
    header::{ALLOW, CONTENT_TYPE, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::{Mutex, Semaphore},
};

use super::{encode, snapshot::Source};

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// A client has this long to send its request head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection ends after this long whatever it does (a client that never reads its answer).
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// The request line and headers (hyper's smallest buffer limit).
pub const MAX_HEAD_BYTES: usize = 8192;

/// The content type of the OpenMetrics text format `prometheus-client` writes.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// An exposition and when it was made.
type Made = Option<(Instant, Arc<String>)>;

/// The last exposition, reused within [`super::snapshot::MIN_INTERVAL`].
#[derive(Clone)]
struct Endpoint {
    source: Source,
    last: Arc<Mutex<Made>>,
}

impl Endpoint {
    /// The exposition at most MIN_INTERVAL old; concurrent scrapes wait for the one being made.
    async fn exposition(&self) -> Result<Arc<String>, String> {
        let mut last = self.last.lock().await;
        if let Some((t, text)) = last.as_ref()
            && t.elapsed() < super::snapshot::MIN_INTERVAL
        {
            return Ok(text.clone());
        }
        let snapshot = self.source.snapshot().await?;
        // Encoding runs off the agent's one runtime thread, which the core shares.
        let text = tokio::task::spawn_blocking(move || encode::exposition(&snapshot))
            .await
            .map_err(|e| format!("encoding the metrics failed: {e}"))?
            .map_err(|e| format!("encoding the metrics failed: {e}"))?;
        let text = Arc::new(text);
        *last = Some((Instant::now(), text.clone()));
        Ok(text)
    }
}

/// Serves `listener` until the agent stops.
pub async fn serve(listener: TcpListener, source: Source) {
    let endpoint = Endpoint {
        source,
        last: Arc::new(Mutex::new(None)),
    };
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of fds, most likely: the connections end within CONNECTION_TIMEOUT.
                tracing::warn!("agent: metrics endpoint cannot accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            refuse(&stream);
            continue;
        };
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            let _slot = slot;
            connection(stream, endpoint).await;
        });
    }
}

/// Answers 503 without reading (the write cannot wait: the socket buffer of a new connection is empty)
/// and closes.
fn refuse(stream: &TcpStream) {
    let body = format!(
        "the baton agent serves at most {MAX_CONNECTIONS} metrics connections at once: retry later\n"
    );
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.try_write(format!("{head}{body}").as_bytes());
}

async fn connection(stream: TcpStream, endpoint: Endpoint) {
    let service = service_fn(move |req| {
        let endpoint = endpoint.clone();
        async move { Ok::<_, Infallible>(respond(&req, &endpoint).await) }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(false)
        .max_buf_size(MAX_HEAD_BYTES)
        .serve_connection(TokioIo::new(stream), service);
    match tokio::time::timeout(CONNECTION_TIMEOUT, conn).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!("agent: metrics connection: {e}"),
        Err(_) => tracing::debug!("agent: metrics connection closed after {CONNECTION_TIMEOUT:?}"),
    }
}

async fn respond(req: &Request<Incoming>, endpoint: &Endpoint) -> Response<Full<Bytes>> {
    if req.uri().path() != "/metrics" {
        return text(
            StatusCode::NOT_FOUND,
            format!("no {}: the metrics are at /metrics\n", req.uri().path()),
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{} /metrics: only GET is served\n", req.method()),
        );
        r.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match endpoint.exposition().await {
        Ok(body) => {
            let mut r = Response::new(Full::new(Bytes::from(body.as_bytes().to_vec())));
            r.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(OPENMETRICS));
            r
        }
        Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}
