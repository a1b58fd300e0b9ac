//! Exporting the turns' spans (src/turn/trace.rs) over OTLP/HTTP with protobuf bodies, to the
//! receiver `--otlp-endpoint` names (`<endpoint>/v1/traces`): the OpenTelemetry SDK's batch
//! processor, fed from `tracing` by `tracing-opentelemetry`, posting through the gateway's own
//! HTTP client (hyper, rustls, the environment's proxies) instead of a second client stack.
//!
//! The batch processor exports from a thread of its own; a post runs on the gateway's tokio
//! runtime (the thread waits for it), so an export never blocks a runtime worker. Spans that a
//! slow or absent receiver cannot take are dropped by the processor past its queue (2,048 spans),
//! never held without bound. `Exporting::shutdown` flushes what is queued when the gateway stops.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;

use crate::runtime::http_client::HttpClient;

/// Most of a receiver's answer that is read (it is a small protobuf message, or an error).
const MOST_ANSWER_BYTES: usize = 64 * 1024;
/// How long one post may take, connection included.
const POST_TIMEOUT: Duration = Duration::from_secs(10);

/// The exporter behind the tracing layer; stopped (and flushed) with the gateway.
pub struct Exporting {
    provider: SdkTracerProvider,
}

/// The layer that turns the turns' spans into OTLP spans, and its exporter. `endpoint` is the
/// receiver's base URL (`http://collector:4318`).
pub fn layer<S>(endpoint: &str) -> Result<(impl tracing_subscriber::Layer<S>, Exporting), String>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
    let uri: http::Uri = url.parse().map_err(|e| format!("--otlp-endpoint {endpoint:?} is not a URL: {e}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        return Err(format!("--otlp-endpoint {endpoint:?} must be an http:// or https:// URL"));
    }
    let client = Poster {
        client: HttpClient::new(&uri, POST_TIMEOUT)?,
        runtime: tokio::runtime::Handle::try_current().map_err(|e| e.to_string())?,
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(POST_TIMEOUT)
        .with_http_client(client)
        .build()
        .map_err(|e| format!("cannot set up the OTLP exporter: {e}"))?;
    let resource = Resource::builder().with_service_name("dispatch-gateway").build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    let tracer = provider.tracer("dispatch-gateway");
    Ok((tracing_opentelemetry::layer().with_tracer(tracer), Exporting { provider }))
}

impl Exporting {
    /// Exports what is queued and stops the exporter's thread.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(e)) = done {
            tracing::warn!(error = %e, "the last spans could not be exported");
        }
    }
}

/// Posts the exporter's requests on the gateway's runtime.
#[derive(Clone)]
struct Poster {
    client: HttpClient,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for Poster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Poster")
    }
}

type Answer = Result<http::Response<Bytes>, opentelemetry_http::HttpError>;

// The trait is declared with `async_trait`; its method is written out as that macro would, so
// the gateway needs no proc macro for one impl.
impl opentelemetry_http::HttpClient for Poster {
    fn send_bytes<'a, 'b>(&'a self, request: http::Request<Bytes>) -> Pin<Box<dyn Future<Output = Answer> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        let client = self.client.clone();
        let post = self.runtime.spawn(async move {
            let (head, body) = request.into_parts();
            let request = http::Request::from_parts(head, Full::new(body));
            let response =
                tokio::time::timeout(POST_TIMEOUT, client.send(request)).await.map_err(|_| "timed out")??;
            let (head, body) = response.into_parts();
            let body = Limited::new(body, MOST_ANSWER_BYTES).collect().await?.to_bytes();
            Ok::<_, opentelemetry_http::HttpError>(http::Response::from_parts(head, body))
        });
        Box::pin(async move { post.await? })
    }
}
