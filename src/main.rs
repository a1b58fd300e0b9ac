use dispatch_gateway::Gateway;
use dispatch_gateway::config::{Config, LogFormat};
use tracing_subscriber::EnvFilter;

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
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
        LogFormat::Json => tracing_subscriber::fmt().json().with_env_filter(filter).init(),
    }
    let gateway = Gateway::build(config).await?;
    let listener = gateway.bind().await?;
    let ws_listener = gateway.bind_ws().await?;
    tracing::info!(addr = %listener.local_addr()?, "dispatch-gateway listening");
    if let Some(ws) = &ws_listener {
        tracing::info!(addr = %ws.local_addr()?, "WebSocket listener (any path)");
    }
    gateway.serve(listener, ws_listener, shutdown_signal()).await?;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
