//! Reading the configuration: flags over `DISPATCH_*` variables over the TOML file over the
//! defaults, credentials' variables laid over their tables, and the errors that name what is
//! wrong (the flag, the file and line, the credential, the variable).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use serde::Deserialize;

use super::{ACTIONS, Config, Credential, McpServer, Quotas};

/// The file: top-level keys are the flags' names with underscores; credentials in tables.
#[derive(Debug, Deserialize)]
struct FileConfig {
    #[serde(default)]
    credentials: BTreeMap<String, Credential>,
    #[serde(default)]
    quotas: Quotas,
    #[serde(default)]
    mcp: BTreeMap<String, McpServer>,
    #[serde(flatten)]
    settings: toml::Table,
}

/// The environment prefix of credential keys: `DISPATCH_CREDENTIALS__OPENAI__BASE_URL`.
const CREDENTIAL_ENV: &str = "DISPATCH_CREDENTIALS__";

/// Why a configuration stops the start. Each message names what is at fault: the flag, the
/// file and line, the credential, the variable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Flags or `DISPATCH_*` variables that do not parse (the parser's own message).
    #[error("{0}")]
    Arguments(String),
    /// The configuration file: unreadable, not TOML, an unknown key, a value of the wrong type.
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    /// A `DISPATCH_CREDENTIALS__*` variable whose name is not `<NAME>__<KEY>`.
    #[error("{0}: expected {CREDENTIAL_ENV}<NAME>__<KEY>")]
    CredentialVariable(String),
    /// One credential, from the file or its variables: what is wrong with it.
    #[error("credentials.{name}: {message}")]
    Credential { name: String, message: String },
    /// `--api-keys "k,"`: an empty entry would let requests without a key in.
    #[error("api_keys: an empty key is not a key (a stray comma?); list only non-empty keys, or none to turn auth off")]
    EmptyApiKey,
    /// One MCP server: what is wrong with it.
    #[error("mcp.{name}: {message}")]
    Mcp { name: String, message: String },
    #[error("no credential lists a model")]
    NoModel,
    #[error("default_model {0:?} is not a configured model")]
    UnknownDefaultModel(String),
    #[error("bus: {0}")]
    Bus(String),
    /// A PostgreSQL database or a bus in a build without them.
    #[error("{0} needs the `cluster` build: `cargo build --release --features cluster` (the Docker image is one)")]
    NotBuilt(&'static str),
}

impl ConfigError {
    fn file(path: &Path, message: impl std::fmt::Display) -> ConfigError {
        ConfigError::File { path: path.to_owned(), message: message.to_string() }
    }

    /// What is wrong with credential `name`.
    pub fn credential(name: &str, message: impl std::fmt::Display) -> ConfigError {
        ConfigError::Credential { name: name.to_owned(), message: message.to_string() }
    }
}

impl Config {
    /// Reads flags, environment and the configuration file. A bad file is an error naming the
    /// key and its line.
    pub fn load() -> Result<Config, ConfigError> {
        Self::load_from(std::env::args_os().collect(), std::env::vars().collect())
    }

    /// [`Config::load`] with the arguments and environment given (for tests).
    pub fn load_from(args: Vec<std::ffi::OsString>, env: Vec<(String, String)>) -> Result<Config, ConfigError> {
        let matches = match Config::command().try_get_matches_from(&args) {
            Ok(m) => m,
            Err(e)
                if matches!(e.kind(), clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion) =>
            {
                e.exit()
            }
            Err(e) => return Err(ConfigError::Arguments(e.to_string())),
        };
        let config = Config::from_arg_matches(&matches).map_err(|e| ConfigError::Arguments(e.to_string()))?;
        let path = match &config.config {
            Some(path) => Some(path.clone()),
            None => Some(PathBuf::from("dispatch-gateway.toml")).filter(|p| p.exists()),
        };
        let credential_env: Vec<(String, String)> =
            env.into_iter().filter(|(k, _)| k.starts_with(CREDENTIAL_ENV)).collect();
        let Some(path) = path else {
            let mut config = config;
            config.credentials = credentials_from(toml::Table::new(), &credential_env, None)?;
            return Ok(config);
        };
        let text =
            std::fs::read_to_string(&path).map_err(|e| ConfigError::file(&path, format!("cannot be read: {e}")))?;
        let file: FileConfig = toml::from_str(&text).map_err(|e| {
            // Errors inside a tagged table point at the table; name the key's own line too.
            let message = e.to_string();
            let key = message.split("unknown field `").nth(1).and_then(|rest| rest.split('`').next());
            match key.map(|k| (k, line_of(&text, k))) {
                Some((k, line)) if line > 0 => ConfigError::file(&path, format!("{message}(`{k}` is on line {line})")),
                _ => ConfigError::file(&path, message),
            }
        })?;

        // File settings go in as flags placed before the real ones, and only for what neither
        // a flag nor the environment set.
        let command = Config::command();
        let mut argv: Vec<std::ffi::OsString> =
            vec![args.first().cloned().unwrap_or_else(|| "dispatch-gateway".into())];
        for (key, value) in &file.settings {
            let at = line_of(&text, key);
            let Some(arg) = command.get_arguments().find(|a| a.get_id() == key.as_str() && a.get_long().is_some())
            else {
                return Err(ConfigError::file(&path, format!("line {at}: unknown key `{key}`")));
            };
            if ACTIONS.contains(&key.as_str()) {
                return Err(ConfigError::file(
                    &path,
                    format!("line {at}: `{key}` is an action of the command line, not a setting"),
                ));
            }
            if matches!(matches.value_source(key), Some(ValueSource::CommandLine | ValueSource::EnvVariable)) {
                continue;
            }
            let cannot =
                |v: &toml::Value| ConfigError::file(&path, format!("line {at}: `{key}` cannot be {}", v.type_str()));
            let text_value = match value {
                // Joined, a list would pass for one value (`database = ["a", "b"]`: the file "a,b").
                toml::Value::Array(_) if arg.get_value_delimiter().is_none() => {
                    return Err(ConfigError::file(&path, format!("line {at}: `{key}` takes one value, not a list")));
                }
                toml::Value::Array(items) => items
                    .iter()
                    .map(|v| scalar_text(v).ok_or_else(|| cannot(v)))
                    .collect::<Result<Vec<_>, _>>()?
                    .join(","),
                other => scalar_text(other).ok_or_else(|| cannot(other))?,
            };
            // One `--flag=value` word: a value starting with `-` is still the flag's value,
            // not read as another flag (`max_streams = -1` is an invalid number, said so).
            argv.push(format!("--{}={text_value}", arg.get_long().unwrap_or(key)).into());
        }
        argv.extend(args.into_iter().skip(1));
        let mut config = Config::command()
            .args_override_self(true)
            .try_get_matches_from(&argv)
            .and_then(|m| Config::from_arg_matches(&m))
            .map_err(|e| ConfigError::file(&path, e))?;
        let raw: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::file(&path, e))?;
        let table = raw.get("credentials").and_then(|c| c.as_table()).cloned().unwrap_or_default();
        config.quotas = file.quotas;
        config.mcp = file.mcp;
        config.credentials = if credential_env.is_empty() {
            file.credentials
        } else {
            credentials_from(table, &credential_env, Some(&path))?
        };
        Ok(config)
    }
}

/// Credentials from a `[credentials]` table with `DISPATCH_CREDENTIALS__<NAME>__<KEY>`
/// variables laid over it.
fn credentials_from(
    mut table: toml::Table,
    env: &[(String, String)],
    path: Option<&Path>,
) -> Result<BTreeMap<String, Credential>, ConfigError> {
    for (name, value) in env {
        let rest = &name[CREDENTIAL_ENV.len()..];
        let Some((credential, key)) = rest.split_once("__") else {
            return Err(ConfigError::CredentialVariable(name.clone()));
        };
        let (credential, key) = (credential.to_lowercase(), key.to_lowercase());
        // A value that reads as TOML (a number, a list, a table) is taken as such.
        let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(value.clone()));
        let entry = table.entry(credential.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let Some(entry) = entry.as_table_mut() else { return Err(ConfigError::credential(&credential, "not a table")) };
        entry.insert(key, parsed);
    }
    let mut out = BTreeMap::new();
    for (name, value) in table {
        let credential: Credential = value.try_into().map_err(|e| match path {
            Some(p) => {
                ConfigError::credential(&name, format!("{e} (in {} with {CREDENTIAL_ENV}* variables)", p.display()))
            }
            None => ConfigError::credential(&name, format!("{e} (from {CREDENTIAL_ENV}* variables)")),
        })?;
        out.insert(name, credential);
    }
    Ok(out)
}

/// `urls` (comma-separated) with each one's password shown as `***` (`user:***@host`), for
/// errors and logs. A bare `name@host` is hidden whole when `bare_is_secret` (a NATS token),
/// kept otherwise (a PostgreSQL user).
pub fn redacted(urls: &str, bare_is_secret: bool) -> String {
    let one = |url: &str| -> String {
        let (scheme, rest, authority) = url_parts(url);
        let Some(at) = authority.rfind('@') else { return url.to_owned() };
        match rest[..at].split_once(':') {
            Some((user, _)) => format!("{scheme}{user}:***{}", &rest[at..]),
            None if bare_is_secret => format!("{scheme}***{}", &rest[at..]),
            None => url.to_owned(),
        }
    };
    urls.split(',').map(one).collect::<Vec<_>>().join(",")
}

/// A URL's `scheme://`, what follows it, and its authority (`user:password@host:port`).
pub(super) fn url_parts(url: &str) -> (&str, &str, &str) {
    let (scheme, rest) = url.split_once("://").map_or(("", url), |(s, r)| (&url[..s.len() + 3], r));
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    (scheme, rest, authority)
}

/// A scalar value of the file as its flag would spell it; `None` for a table, an array or a date.
fn scalar_text(value: &toml::Value) -> Option<String> {
    Some(match value {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        _ => return None,
    })
}

/// The 1-based line where `key` is set in a TOML text (for error messages).
fn line_of(text: &str, key: &str) -> usize {
    text.lines()
        .position(|l| l.trim_start().strip_prefix(key).is_some_and(|rest| rest.trim_start().starts_with('=')))
        .map_or(0, |i| i + 1)
}
