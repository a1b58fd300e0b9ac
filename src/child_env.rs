//! What a child process (an agent program, an MCP server) inherits of the gateway's
//! environment: `PATH`, `HOME`, `LANG` and `TMPDIR`, nothing else. The gateway's own variables
//! hold its secrets (upstream keys, `DISPATCH_*` settings, a bus's credentials): a tool that
//! prints its environment, or a model that asks an agent to, must find none of them. What a
//! child needs beyond these, its configuration names (`env`; `token_env` for a url server,
//! which the gateway sends itself).

/// The variables a child keeps, when the gateway has them.
pub const KEPT: [&str; 4] = ["PATH", "HOME", "LANG", "TMPDIR"];

/// Clears `command`'s environment to [`KEPT`]; the caller adds what the configuration names.
pub fn clean(command: &mut tokio::process::Command) {
    command.env_clear();
    for name in KEPT {
        if let Some(value) = std::env::var_os(name) {
            command.env(name, value);
        }
    }
}
