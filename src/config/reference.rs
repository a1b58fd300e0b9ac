//! The configuration reference, `docs/configuration.md`, generated from the flags' own docs
//! (the doc comments on [`Config`]'s fields): one place says what a flag does, and a test
//! (`tests/config.rs`) fails when the file and the code part. Regenerate it with
//! `cargo run -- --print-configuration > docs/configuration.md`.

use clap::CommandFactory;

use super::Config;

/// What the reference says before its table.
const PREAMBLE: &str = "\
# Configuration reference

Generated from the gateway's flag docs (`src/config.rs`) by
`cargo run -- --print-configuration > docs/configuration.md`; a test fails when this file and the
code differ. The README's \"Configuration\" says how the parts fit together.

One TOML file (`--config FILE`, or `dispatch-gateway.toml` in the working directory when it
exists) holds everything; `dispatch-gateway.example.toml` shows every part. Every key below is
also a flag and an environment variable (flags win over the environment, the environment over
the file, the file over the defaults): the key is the flag's name with `_` for `-`
(`--max-turns` is `max_turns`). Credentials (`[credentials.<name>]`), MCP servers
(`[mcp.<name>]`), API keys (`[[keys]]`) and quotas (`[quotas]`) are tables of the file, their keys
in docs/upstreams.md, docs/tools.md and docs/identity.md; a credential's key is also a variable,
`DISPATCH_CREDENTIALS__<NAME>__<KEY>`. A file that does not parse, an unknown key, a model that
does not exist, or a missing API-key variable stops the gateway at start with a message naming
the key.

| flag | environment | default | what |
|---|---|---|---|
";

/// The reference as Markdown.
pub fn reference() -> String {
    let command = Config::command();
    let mut out = String::from(PREAMBLE);
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if arg.is_hide_set() || long == "help" || long == "version" {
            continue;
        }
        // A value's name only where the code gives one (`--backup FILE`), not clap's
        // upper-cased field name.
        let field = long.to_uppercase().replace('-', "_");
        let flag = match arg.get_value_names() {
            Some([name, ..]) if arg.get_action().takes_values() && name.as_str() != field => {
                format!("`--{long} {name}`")
            }
            _ => format!("`--{long}`"),
        };
        let env = arg.get_env().map_or_else(|| "none".to_owned(), |e| format!("`{}`", e.to_string_lossy()));
        let default = match arg.get_default_values() {
            [] if matches!(arg.get_action(), clap::ArgAction::SetTrue) => "off".to_owned(),
            [] => "none".to_owned(),
            values => {
                let values: Vec<String> = values.iter().map(|v| v.to_string_lossy().into_owned()).collect();
                match values.join(",").as_str() {
                    "false" => "off".to_owned(),
                    value => format!("`{value}`"),
                }
            }
        };
        let what = arg.get_long_help().or(arg.get_help()).map(|h| h.to_string()).unwrap_or_default();
        // One table cell: the doc's lines joined, its pipes escaped.
        let what = what.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|");
        out.push_str(&format!("| {flag} | {env} | {default} | {what} |\n"));
    }
    out
}
