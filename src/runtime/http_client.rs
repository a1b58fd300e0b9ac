//! The `openai` runtime's HTTP client: hyper's pooled HTTP/1.1 client, TLS by rustls (ring, the
//! platform's roots, `SSL_CERT_FILE`/`SSL_CERT_DIR` too), and the proxies of the environment
//! (`HTTP_PROXY`, `HTTPS_PROXY`, `ALL_PROXY`, `NO_PROXY`, read as curl reads them, once at
//! start). A plain-HTTP upstream is asked through its HTTP proxy (the request in absolute form,
//! with the proxy's credentials); an HTTPS one through a CONNECT tunnel, verified end to end;
//! an `https://` proxy over TLS; either upstream through a SOCKS5 proxy's tunnel.
//! Redirects are not followed: an API endpoint that moved is a configuration to fix.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Uri;
use http::uri::Scheme;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_rustls::MaybeHttpsStream;
use hyper_util::client::legacy::connect::proxy::{SocksV5, Tunnel};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::legacy::{Client, Error};
use hyper_util::client::proxy::matcher::{Intercept, Matcher};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tower_service::Service;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Clone)]
pub struct HttpClient {
    client: Client<hyper_rustls::HttpsConnector<ProxyConnector>, Full<Bytes>>,
    proxies: Arc<Matcher>,
}

impl HttpClient {
    /// A client for requests to `endpoint`'s scheme: the platform's TLS roots are loaded (and
    /// must be there) only for an `https` one, or one reached through an `https://` proxy.
    pub fn new(endpoint: &Uri, connect_timeout: Duration) -> Result<HttpClient, String> {
        let proxies = Arc::new(Matcher::from_env());
        let proxy_scheme = proxies.intercept(endpoint).and_then(|p| p.uri().scheme().cloned());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("cannot set up TLS: {e}"))?;
        let tls = if endpoint.scheme() == Some(&Scheme::HTTPS) || proxy_scheme == Some(Scheme::HTTPS) {
            use rustls_platform_verifier::BuilderVerifierExt;
            builder.with_platform_verifier().map_err(|e| format!("cannot load the TLS roots: {e}"))?
        } else {
            // Never used: requests go to the endpoint only, and it is plain HTTP.
            builder.with_root_certificates(rustls::RootCertStore::empty())
        }
        .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(connect_timeout));
        http.set_nodelay(true);
        // To an HTTP proxy over TLS when its URL says `https://` (plain for `http://`).
        let to_proxy = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(http.clone());
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(ProxyConnector { http, to_proxy, proxies: proxies.clone(), connect_timeout });
        Ok(HttpClient { client: Client::builder(TokioExecutor::new()).build(connector), proxies })
    }

    pub async fn send(&self, mut request: http::Request<Full<Bytes>>) -> Result<http::Response<Incoming>, Error> {
        // Plain HTTP through a proxy: the proxy reads the request, so it carries the proxy's
        // credentials (a tunnel's go in its CONNECT).
        if request.uri().scheme() == Some(&Scheme::HTTP)
            && let Some(auth) = self.proxies.intercept(request.uri()).and_then(|p| p.basic_auth().cloned())
        {
            request.headers_mut().insert(http::header::PROXY_AUTHORIZATION, auth);
        }
        self.client.request(request).await
    }
}

/// Connects to the destination, or to its proxy: a tunnel for HTTPS, the proxy itself for HTTP.
#[derive(Clone)]
struct ProxyConnector {
    http: HttpConnector,
    /// To an HTTP proxy, over TLS for an `https://` one.
    to_proxy: hyper_rustls::HttpsConnector<HttpConnector>,
    proxies: Arc<Matcher>,
    /// How long the way through a proxy may take, its handshake included.
    connect_timeout: Duration,
}

impl Service<Uri> for ProxyConnector {
    type Response = Stream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Stream, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // The HTTP connector is always ready: each call clones it.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let (mut http, to_proxy) = (self.http.clone(), self.to_proxy.clone());
        let proxy = self.proxies.intercept(&dst);
        let within = self.connect_timeout;
        Box::pin(async move {
            let Some(proxy) = proxy else {
                return Ok(Stream { io: MaybeHttpsStream::Http(http.call(dst).await?), proxied: false });
            };
            // The whole way through the proxy (its handshake too) within the connect timeout: a
            // proxy that takes the connection and never answers is not an upstream at work.
            // Errors name the proxy: a turn that cannot reach it is not the upstream's fault.
            let uri = proxy.uri().clone();
            match tokio::time::timeout(within, via_proxy(proxy, dst, http, to_proxy)).await {
                Ok(Ok(stream)) => Ok(stream),
                Ok(Err(e)) => Err(format!("the proxy {uri}: {}", describe(&*e)).into()),
                Err(_) => Err(format!("the proxy {uri}: no way through within {} s", within.as_secs_f64()).into()),
            }
        })
    }
}

/// A connection to `dst` through `proxy`: a SOCKS5 tunnel, a CONNECT tunnel (HTTPS), or the
/// proxy itself (plain HTTP, whose requests name their whole URL).
async fn via_proxy(
    proxy: Intercept,
    dst: Uri,
    mut http: HttpConnector,
    mut to_proxy: hyper_rustls::HttpsConnector<HttpConnector>,
) -> Result<Stream, BoxError> {
    match proxy.uri().scheme_str() {
        Some("http" | "https") => {}
        Some(scheme @ ("socks5" | "socks5h")) => {
            // `socks5h`: the proxy resolves the host; `socks5`: the gateway does, as curl.
            let dst = if scheme == "socks5" { resolved(&dst).await? } else { dst };
            // Connected here, so that a proxy that cannot be reached is said with its cause
            // (the SOCKS connector's error only names the step).
            let mut connection = Some(http.call(proxy.uri().clone()).await?);
            let connected = tower::service_fn(move |_: Uri| {
                let io = connection.take();
                async move { io.ok_or("the SOCKS connector asked for a second connection") }
            });
            let mut socks = SocksV5::new(proxy.uri().clone(), connected);
            if let Some((user, password)) = proxy.raw_auth() {
                socks = socks.with_auth(user.to_owned(), password.to_owned());
            }
            return Ok(Stream { io: MaybeHttpsStream::Http(socks.call(dst).await?), proxied: false });
        }
        _ => return Err("not a kind the gateway speaks (http://, https://, socks5:// and socks5h:// are)".into()),
    }
    if dst.scheme() != Some(&Scheme::HTTPS) {
        return Ok(Stream { io: to_proxy.call(proxy.uri().clone()).await?, proxied: true });
    }
    let mut tunnel = Tunnel::new(proxy.uri().clone(), to_proxy);
    if let Some(auth) = proxy.basic_auth() {
        tunnel = tunnel.with_auth(auth.clone());
    }
    Ok(Stream { io: tunnel.call(dst).await?, proxied: false })
}

/// `dst` with its host resolved to an address (here, on tokio's resolver: the SOCKS connector's
/// own lookup would block a worker).
async fn resolved(dst: &Uri) -> Result<Uri, BoxError> {
    let host = dst.host().ok_or("a URL without a host")?.trim_start_matches('[').trim_end_matches(']');
    let port = dst.port_u16().unwrap_or(if dst.scheme() == Some(&Scheme::HTTPS) { 443 } else { 80 });
    let mut addresses = tokio::net::lookup_host((host, port)).await.map_err(|e| format!("resolving {host}: {e}"))?;
    let address = addresses.next().ok_or_else(|| format!("{host} resolves to no address"))?;
    Ok(Uri::builder()
        .scheme(dst.scheme_str().unwrap_or("http"))
        .authority(address.to_string())
        .path_and_query("/")
        .build()?)
}

/// A connection, and whether it is to an HTTP proxy (whose requests name their whole URL).
struct Stream {
    /// Over TLS only to an `https://` proxy (an HTTPS upstream's own TLS runs inside).
    io: MaybeHttpsStream<TokioIo<TcpStream>>,
    proxied: bool,
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        self.io.connected().proxy(self.proxied)
    }
}

impl Read for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: ReadBufCursor<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl Write for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// An error and its causes on one line: hyper's own say only which step failed.
pub fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
