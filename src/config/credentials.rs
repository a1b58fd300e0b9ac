//! What the configuration file's tables hold: credentials (`[credentials.<name>]`, each a
//! runtime kind with its models), MCP servers (`[mcp.<name>]`) and quotas (`[quotas]`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

/// Where an MCP server's tools are served from, and how it is run (docs/tools.md).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServer {
    /// A stdio server: the program to run (found on `PATH` when it has no `/`).
    pub command: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    /// Variables set for a stdio server, over the gateway's own environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// A Streamable HTTP server's endpoint.
    pub url: Option<String>,
    /// The environment variable holding the bearer token sent to a url server.
    pub token_env: Option<String>,
    /// `shared` (one client for the gateway; the default for url servers) or `conversation`
    /// (one process per conversation, in its folder; the default for stdio servers).
    pub scope: Option<McpScope>,
    /// The tools it lists that models get (default: all of them).
    pub tools: Option<Vec<String>>,
    /// Seconds to start and finish `initialize` before the server counts as failed.
    #[serde(default = "default_mcp_startup")]
    pub startup_timeout_secs: u64,
    /// Seconds a call may take before it is cancelled and answered with an error.
    #[serde(default = "default_mcp_call")]
    pub call_timeout_secs: u64,
    /// Seconds a conversation's server may sit without a call before it is stopped.
    #[serde(default = "default_process_idle")]
    pub idle_timeout_secs: u64,
    /// Conversation servers of this name running at once at most: past it the one idle longest
    /// is stopped (its conversation starts it again when it next needs it).
    #[serde(default = "default_max_processes")]
    pub max_processes: usize,
    /// The folders a conversation's server may be started in (`cwd_roots`, docs/security.md); default:
    /// the gateway's working directory.
    #[serde(default)]
    pub cwd_roots: Vec<PathBuf>,
}

/// How many clients of an MCP server the gateway keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum McpScope {
    Shared,
    Conversation,
}

impl McpServer {
    pub fn scope(&self) -> McpScope {
        self.scope.unwrap_or(if self.url.is_some() { McpScope::Shared } else { McpScope::Conversation })
    }
}

fn default_mcp_startup() -> u64 {
    20
}

fn default_mcp_call() -> u64 {
    60
}

fn default_max_steps() -> u32 {
    32
}

fn default_max_parallel_tools() -> usize {
    4
}

fn default_max_tool_calls() -> usize {
    16
}

/// Per-subject limits, checked before a turn starts (and a stream opens), counted in the
/// database so that every gateway of a cluster shares them. Absent: no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Quotas {
    /// Turns running at once.
    pub concurrent_turns: Option<u32>,
    /// Turns started in the last 60 seconds.
    pub turns_per_minute: Option<u32>,
    /// Live streams (SSE, NDJSON, WebSocket sessions, `/last` waits) open at once.
    pub streams: Option<u32>,
    /// Tokens (`usage` input + output) of turns started in the last 24 hours.
    pub tokens_per_day: Option<u64>,
}

impl Quotas {
    pub fn any(&self) -> bool {
        *self != Quotas::default()
    }
}

/// One credential: a provider kind with its settings and models.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Credential {
    Scripted(ScriptedCredential),
    Openai(OpenAiCredential),
    Command(CommandCredential),
}

impl Credential {
    pub fn models(&self) -> &[String] {
        match self {
            Credential::Scripted(c) => &c.models,
            Credential::Openai(c) => &c.models,
            Credential::Command(c) => &c.models,
        }
    }
}

fn scripted_models() -> Vec<String> {
    vec!["scripted".to_owned()]
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedCredential {
    #[serde(default = "scripted_models")]
    pub models: Vec<String>,
    /// Tokens per second (default: `--scripted-pace`).
    pub pace: Option<f64>,
    pub reasoning: Option<bool>,
    pub script: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiCredential {
    pub base_url: String,
    /// The environment variable holding the API key (none: no `Authorization` header).
    pub api_key_env: Option<String>,
    pub models: Vec<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_secs: u64,
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout_secs: u64,
    pub system_prompt: Option<String>,
    /// The models' context in tokens: the oldest turns of a long conversation are left out
    /// of a request so that it fits.
    pub context_window: Option<u64>,
    /// Request parameters for every model of the credential.
    #[serde(default)]
    pub params: RequestParams,
    /// Request parameters per model, over the credential's (field by field; `extra_body`
    /// key by key).
    #[serde(default)]
    pub model_params: BTreeMap<String, RequestParams>,
    /// The MCP servers (`[mcp.<name>]`) whose tools its models get: the gateway runs the agent
    /// loop (docs/tools.md).
    #[serde(default)]
    pub mcp: Vec<String>,
    /// Model round trips a turn may take at most (with tools).
    #[serde(default = "default_max_steps")]
    pub max_steps: u32,
    /// Tool calls of one turn running at once at most.
    #[serde(default = "default_max_parallel_tools")]
    pub max_parallel_tools: usize,
    /// Tool calls one step runs at most: the calls past it are answered with an error result.
    #[serde(default = "default_max_tool_calls")]
    pub max_tool_calls: usize,
}

/// Parameters an `openai` request carries (absent: not sent, the upstream's default).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestParams {
    pub max_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub stop: Option<Vec<String>>,
    /// Merged into the request body last (upstream-specific fields such as `top_k`).
    pub extra_body: Option<serde_json::Map<String, serde_json::Value>>,
    /// Send `stream_options.include_usage` (default true; some APIs answer 422 to it).
    pub include_usage: Option<bool>,
}

impl RequestParams {
    /// These parameters with `over`'s laid on top.
    pub fn overlaid(&self, over: &RequestParams) -> RequestParams {
        let mut extra_body = self.extra_body.clone();
        if let Some(more) = &over.extra_body {
            extra_body.get_or_insert_with(Default::default).extend(more.clone());
        }
        RequestParams {
            max_tokens: over.max_tokens.or(self.max_tokens),
            temperature: over.temperature.or(self.temperature),
            top_p: over.top_p.or(self.top_p),
            stop: over.stop.clone().or_else(|| self.stop.clone()),
            extra_body,
            include_usage: over.include_usage.or(self.include_usage),
        }
    }
}

fn default_connect_timeout() -> u64 {
    10
}

fn default_idle_timeout() -> u64 {
    120
}

/// How the gateway and an agent program talk over stdin/stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Dialect {
    /// The gateway's own line protocol (docs/command-protocol.md).
    #[default]
    Ndjson,
    /// Claude Code's `--input-format stream-json --output-format stream-json`.
    ClaudeStreamJson,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandCredential {
    pub program: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub dialect: Dialect,
    pub models: Vec<String>,
    pub cwd: Option<PathBuf>,
    /// The folders a turn's agent may work in (a request's or conversation's `cwd` must lie
    /// inside one, symlinks followed). Default: `cwd`, else the gateway's working directory.
    #[serde(default)]
    pub cwd_roots: Vec<PathBuf>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Seconds a process may sit without a turn before it is stopped.
    #[serde(default = "default_process_idle")]
    pub idle_timeout_secs: u64,
    /// Answer the program's tool-permission requests with "allow" (claude-stream-json).
    #[serde(default)]
    pub unattended: bool,
    /// Processes the credential runs at once at most (one per conversation): a conversation
    /// that needs one past it stops the one idle longest, or fails while every one is in a turn.
    #[serde(default = "default_max_processes")]
    pub max_processes: usize,
    /// Seconds a process has to finish an interrupted turn, or to exit once its input is
    /// closed (stopped for idleness, for another model, folder or session, for room, at
    /// shutdown), before its process group is killed; at most `MAX_GRACE_SECS`.
    #[serde(default = "default_grace")]
    pub grace_secs: u64,
    /// The MCP servers (`[mcp.<name>]`) passed to the agent (Claude Code: `--mcp-config`).
    #[serde(default)]
    pub mcp: Vec<String>,
}

/// The longest `grace_secs`: shutdown waits for it too.
pub const MAX_GRACE_SECS: u64 = 60;

fn default_grace() -> u64 {
    3
}

fn default_process_idle() -> u64 {
    600
}

fn default_max_processes() -> usize {
    32
}
