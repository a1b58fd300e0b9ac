use dispatch_gateway::Gateway;
use dispatch_gateway::config::{Config, LogFormat, log_filter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = match Config::load() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if config.print_openapi {
        print!("{}", dispatch_gateway::http::openapi_json_text());
        return Ok(());
    }
    let filter = log_filter();
    match config.log_format {
        LogFormat::Text => tracing_subscriber::registry().with(tracing_subscriber::fmt::layer()).with(filter).init(),
        LogFormat::Json => {
            tracing_subscriber::registry().with(tracing_subscriber::fmt::layer().json()).with(filter).init()
        }
    }
    // Installed before anything is announced: a SIGTERM right after "listening" must stop the
    // gateway gracefully, not kill it with the signal's default action.
    let shutdown = shutdown_signal()?;
    let gateway = Gateway::build(config).await?;
    let listener = gateway.bind().await?;
    let ws_listener = gateway.bind_ws().await?;
    tracing::info!(addr = %listener.local_addr()?, "dispatch-gateway listening");
    if let Some(ws) = &ws_listener {
        tracing::info!(addr = %ws.local_addr()?, "WebSocket listener (any path)");
    }
    gateway.serve(listener, ws_listener, shutdown).await?;
    Ok(())
}

/// Listens for SIGINT and SIGTERM from now on; the future resolves on the first of them.
#[cfg(unix)]
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    })
}

/// Resolves on Ctrl-C.
#[cfg(not(unix))]
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}
