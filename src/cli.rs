//! The gateway as a program: configuration, logs, signals, serving until shutdown.
//!
//! All of it lives in the library, not in `main.rs`: a binary crate re-instantiates every
//! generic it reaches (the serving futures' drop glue, the log layers), so a `main` with a
//! body of its own doubled a release build's last, serial step (docs/operations.md, "Build").

use std::process::ExitCode;

use tracing_subscriber::Layer;
use tracing_subscriber::Registry;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::Gateway;
use crate::config::{Config, LogFormat, log_filter};

/// Runs the gateway the command line and environment describe: exit 2 on a bad
/// configuration, 1 when it cannot start or serve, 0 after a graceful shutdown.
pub fn run() -> ExitCode {
    let config = match Config::load() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if config.print_openapi {
        #[cfg(feature = "openapi")]
        print!("{}", crate::http::generated_openapi_json());
        #[cfg(not(feature = "openapi"))]
        print!("{}", crate::http::OPENAPI_JSON);
        return ExitCode::SUCCESS;
    }
    if config.print_configuration {
        print!("{}", crate::config::reference());
        return ExitCode::SUCCESS;
    }
    if let Some(to) = &config.backup {
        let busy_timeout = std::time::Duration::from_millis(config.sqlite_busy_timeout_ms);
        return match crate::store::backup(&config.database, to, busy_timeout) {
            Ok(bytes) => {
                println!("{}", serde_json::json!({"backup": to, "bytes": bytes}));
                ExitCode::SUCCESS
            }
            Err(e) => failed(&e),
        };
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => return failed(&e),
    };
    match runtime.block_on(serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => failed(&*e),
    }
}

async fn serve(config: Config) -> Result<(), Box<dyn std::error::Error>> {
    // One filter for every layer (`RUST_LOG`): a filter per layer dropped some events of the
    // log's (a `warn!` of the bus's, at start). With an exporter, the turns' spans stay enabled
    // whatever the level asked.
    #[cfg_attr(not(feature = "otlp"), allow(unused_mut))]
    let mut filter = log_filter();
    #[cfg_attr(not(feature = "otlp"), allow(unused_mut))]
    let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> = vec![match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer().boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer().json().boxed(),
    }];
    #[cfg(feature = "otlp")]
    let exporting = match &config.otlp_endpoint {
        Some(endpoint) => {
            let (spans, exporting) = crate::otlp::layer(endpoint)?;
            layers.push(spans.boxed());
            filter = filter.with_target(crate::turn::trace::TARGET, tracing_subscriber::filter::LevelFilter::INFO);
            Some(exporting)
        }
        None => None,
    };
    #[cfg(not(feature = "otlp"))]
    if config.otlp_endpoint.is_some() {
        return Err("--otlp-endpoint needs a gateway built with the `otlp` feature (cargo build --release --features otlp; the Docker image has it)".into());
    }
    tracing_subscriber::registry().with(layers).with(filter).init();
    // Installed before anything is announced: a SIGTERM right after "listening" must stop the
    // gateway gracefully, not kill it with the signal's default action.
    let shutdown = crate::shutdown::signal()?;
    crate::open_files::raise(config.max_streams);
    let gateway = Gateway::build(config).await?;
    let listener = gateway.bind().await?;
    let ws_listener = gateway.bind_ws().await?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "dispatch-gateway listening");
    tracing::info!(url = %console_url(addr), "the console");
    if let Some(ws) = &ws_listener {
        tracing::info!(addr = %ws.local_addr()?, "WebSocket listener (any path)");
    }
    gateway.serve(listener, ws_listener, shutdown).await?;
    #[cfg(feature = "otlp")]
    if let Some(exporting) = exporting {
        exporting.shutdown().await;
    }
    Ok(())
}

/// Prints the error and what caused it, one line each.
fn failed(e: &dyn std::error::Error) -> ExitCode {
    eprintln!("Error: {e}");
    let mut source = e.source();
    while let Some(cause) = source {
        eprintln!("  caused by: {cause}");
        source = cause.source();
    }
    ExitCode::FAILURE
}

/// Where a browser on this machine opens the console: the listener's address, or `localhost`
/// for a listener on every address (which a browser cannot open, and which answers to
/// `localhost` by default).
fn console_url(addr: std::net::SocketAddr) -> String {
    if addr.ip().is_unspecified() {
        return format!("http://localhost:{}/", addr.port());
    }
    format!("http://{addr}/")
}
