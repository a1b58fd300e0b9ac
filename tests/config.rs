//! The configuration file, its environment variables and flags, and its errors.

use std::ffi::OsString;

use dispatch_gateway::Config;
use dispatch_gateway::config::{Credential, Dialect};
use dispatch_gateway::server::registry;

fn load(args: &[&str], env: &[(&str, &str)]) -> Result<Config, String> {
    let args: Vec<OsString> =
        std::iter::once("dispatch-gateway").chain(args.iter().copied()).map(OsString::from).collect();
    Config::load_from(args, env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
        .map_err(|e| e.to_string())
}

fn write(dir: &std::path::Path, text: &str) -> String {
    let path = dir.join("gateway.toml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn the_example_file_is_valid_and_a_missing_key_variable_is_reported() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/dispatch-gateway.example.toml");
    let config = load(&["--config", example], &[]).unwrap();
    assert_eq!(config.default_model.as_deref(), Some("local/qwen2.5-7b-instruct"));
    assert_eq!(config.credentials.len(), 5);
    match &config.credentials["claude"] {
        Credential::Command(c) => assert_eq!(c.dialect, Dialect::ClaudeStreamJson),
        other => panic!("{other:?}"),
    }
    if std::env::var_os("OPENAI_API_KEY").is_none() {
        let err = registry(&config).err().map(|e| e.to_string()).expect("the key variable is missing");
        assert!(err.contains("OPENAI_API_KEY") && err.contains("credentials.openai"), "{err}");
    }
}

#[test]
fn list_flags_in_the_file_take_numbers_and_booleans_as_their_flags_spell_them() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "api_keys = [\"k1\", 12345678901234567]\n");
    let config = load(&["--config", &file], &[]).unwrap();
    assert_eq!(config.api_keys, ["k1", "12345678901234567"]);
}

#[test]
fn flags_beat_the_environment_which_beats_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "max_streams = 7\nkeepalive_secs = 3\napi_keys = [\"a\", \"b\"]\nscripted_pace = 0\n");
    let config = load(&["--config", &file], &[]).unwrap();
    assert_eq!((config.max_streams, config.keepalive_secs), (7, 3));
    assert_eq!(config.api_keys, vec!["a".to_owned(), "b".to_owned()]);
    assert_eq!(config.scripted_pace, 0.0);
    // The environment applies through clap only when the process has it; a flag always wins.
    let config = load(&["--config", &file, "--max-streams", "9"], &[]).unwrap();
    assert_eq!((config.max_streams, config.keepalive_secs), (9, 3));
    // With no credentials the demo credential runs, on the scripted pace of the file.
    let models: Vec<String> = registry(&config).unwrap().names().map(str::to_owned).collect();
    assert_eq!(models, vec!["demo/scripted"]);
}

#[test]
fn credentials_come_from_the_file_and_from_variables() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        r#"
default_model = "up/m1"
[credentials.up]
kind = "openai"
base_url = "http://127.0.0.1:1/v1"
models = ["m1", "m2"]
"#,
    );
    let env = [
        ("DISPATCH_CREDENTIALS__UP__IDLE_TIMEOUT_SECS", "5"),
        ("DISPATCH_CREDENTIALS__BOT__KIND", "command"),
        ("DISPATCH_CREDENTIALS__BOT__PROGRAM", "python3"),
        ("DISPATCH_CREDENTIALS__BOT__MODELS", "[\"echo\"]"),
    ];
    let config = load(&["--config", &file], &env).unwrap();
    match &config.credentials["up"] {
        Credential::Openai(c) => assert_eq!((c.idle_timeout_secs, c.models.len()), (5, 2)),
        other => panic!("{other:?}"),
    }
    let registry = registry(&config).unwrap();
    let names: Vec<&str> = registry.names().collect();
    assert_eq!(names, vec!["bot/echo", "up/m1", "up/m2"]);
    assert_eq!(registry.default_model(), "up/m1");
}

#[test]
fn a_bad_file_names_the_key_and_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("listen = \"127.0.0.1:1\"\nmax_stream = 4\n", vec!["line 2", "max_stream"]),
        ("max_streams = \"many\"\n", vec!["max-streams", "many"]),
        // A value that starts with a dash is the key's value, not read as a flag.
        ("max_streams = -1\n", vec!["invalid value '-1' for '--max-streams"]),
        // The caps on turns, their time and connections have a floor: 0 would refuse everything.
        ("max_turns = 0\n", vec!["invalid value '0' for '--max-turns"]),
        ("max_turn_secs = 0\n", vec!["invalid value '0' for '--max-turn-secs"]),
        ("max_connections = 0\n", vec!["invalid value '0' for '--max-connections"]),
        (
            "[credentials.x]\nkind = \"openai\"\nbase_url = \"u\"\nmodels = [\"m\"]\nbase_urll = \"v\"\n",
            vec!["line 5", "base_urll"],
        ),
        ("[credentials.x]\nkind = \"telepathy\"\nmodels = [\"m\"]\n", vec!["telepathy"]),
        ("[credentials.x]\nkind = \"openai\"\nmodels = [\"m\"]\n", vec!["base_url"]),
        ("listen = [\n", vec!["line 1"]),
        // A list flag takes scalars only: a nested list or a table is refused, not spelled out.
        ("api_keys = [\"k\", [\"a\"]]\n", vec!["line 1", "api_keys", "cannot be array"]),
        ("listen = { host = \"h\" }\n", vec!["line 1", "listen", "cannot be table"]),
        (
            "listen = \"127.0.0.1:1\"\ndatabase = [\"a.db\", \"b.db\"]\n",
            vec!["line 2", "database", "one value, not a list"],
        ),
        // An action is the command line's: in the file it would run at every start.
        ("listen = \"127.0.0.1:1\"\nbackup = \"copy.db\"\n", vec!["line 2", "backup", "not a setting"]),
        ("print_openapi = true\n", vec!["line 1", "print_openapi", "not a setting"]),
    ];
    for (text, needles) in cases {
        let file = write(dir.path(), text);
        let err = load(&["--config", &file], &[]).err().unwrap_or_else(|| panic!("{text:?} should fail"));
        for needle in needles {
            assert!(err.contains(needle), "{text:?}: {err:?} should name {needle:?}");
        }
    }
    let err = load(&["--config", "/no/such/file.toml"], &[]).err().unwrap();
    assert!(err.contains("/no/such/file.toml"), "{err}");
    let file = write(dir.path(), "default_model = \"nope/x\"\n");
    let err = registry(&load(&["--config", &file], &[]).unwrap()).err().unwrap().to_string();
    assert!(err.contains("nope/x"), "{err}");
}

#[test]
fn the_database_is_a_file_or_a_postgres_url_and_the_lease_has_a_floor() {
    use dispatch_gateway::config::Database;
    let config = load(&["--database", "postgres://u:secret@db:5432/dispatch"], &[]).unwrap();
    assert_eq!(config.database, Database::Postgres("postgres://u:secret@db:5432/dispatch".into()));
    let config = load(&["--database", "sqlite:///srv/x.db"], &[]).unwrap();
    assert_eq!(config.database, Database::Sqlite("/srv/x.db".into()));
    for (args, needles) in [
        (vec!["--database", "mysql://h/db"], vec!["--database", "\"mysql\""]),
        (vec!["--database", ""], vec!["--database", "empty"]),
        (vec!["--lease-ttl-ms", "50"], vec!["--lease-ttl-ms", "50"]),
    ] {
        let err = load(&args, &[]).err().unwrap_or_else(|| panic!("{args:?} should fail"));
        for needle in needles {
            assert!(err.contains(needle), "{args:?}: {err:?} should name {needle:?}");
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "lease_ttl_ms = 0\n");
    let err = load(&["--config", &file], &[]).expect_err("a lease of 0 ms is refused");
    assert!(err.contains("lease-ttl-ms"), "{err}");
}

#[test]
fn request_head_and_read_page_limits_have_a_floor_and_a_ceiling() {
    let config = load(&[], &[]).unwrap();
    assert_eq!((config.max_head_bytes, config.max_headers), (64 * 1024, 100));
    let config = load(&["--max-head-bytes", "8192", "--max-headers", "1000"], &[]).unwrap();
    assert_eq!((config.max_head_bytes, config.max_headers), (8192, 1000));
    for args in [
        ["--max-head-bytes", "4096"],
        ["--max-head-bytes", "2000000"],
        ["--max-headers", "0"],
        ["--max-headers", "1001"],
        ["--history-page-chunks", "0"],
        ["--history-page-chunks", "1000001"],
        ["--metrics-page-turns", "0"],
        ["--metrics-page-turns", "1000001"],
        ["--delete-batch-rows", "0"],
        ["--delete-batch-rows", "1000001"],
        ["--max-runtime-request-bytes", "1023"],
        ["--max-runtime-request-bytes", "1073741825"],
    ] {
        let err = load(&args, &[]).err().unwrap_or_else(|| panic!("{args:?} should fail"));
        assert!(err.contains(args[0]) && err.contains(args[1]), "{args:?}: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "max_head_bytes = 1024\n");
    let err = load(&["--config", &file], &[]).expect_err("a 1 KiB head limit is refused");
    assert!(err.contains("max-head-bytes"), "{err}");
}

#[cfg(feature = "cluster")]
#[test]
fn a_bus_is_a_nats_url_beside_a_postgres_database_and_its_limits_have_floors() {
    let mut config = load(&["--bus", "nats://127.0.0.1:4222"], &[]).unwrap();
    let err = config.check().unwrap_err().to_string();
    assert!(err.contains("bus") && err.contains("postgres://"), "{err}");
    let mut config = load(&["--bus", "redis://h:6379", "--database", "postgres://h/db"], &[]).unwrap();
    let err = config.check().unwrap_err().to_string();
    assert!(err.contains("nats://") && err.contains("redis://h:6379"), "{err}");
    let mut config = load(&["--bus", "nats://h:4222", "--database", "postgres://h/db"], &[]).unwrap();
    config.check().expect("a bus beside PostgreSQL");
    assert_eq!(config.bus.as_deref(), Some("nats://h:4222"));
    assert_eq!((config.bus_max_age_secs, config.bus_max_bytes, config.bus_timeout_ms), (3600, 1 << 30, 5000));
    for flag in ["--bus-max-age-secs", "--bus-max-bytes", "--bus-timeout-ms"] {
        let err = load(&[flag, "0"], &[]).err().unwrap_or_else(|| panic!("{flag} 0 should fail"));
        assert!(err.contains(flag), "{err}");
    }
    // A refused bus URL is named without its password; TLS files need a bus, a certificate
    // its key.
    let mut config = load(&["--bus", "nats://h:1,http://u:s3cret@h:2", "--database", "postgres://h/db"], &[]).unwrap();
    let err = config.check().unwrap_err().to_string();
    assert!(err.contains("http://u:***@h:2") && !err.contains("s3cret"), "{err}");
    let mut config = load(&["--bus-ca-file", "/ca.pem", "--database", "postgres://h/db"], &[]).unwrap();
    assert!(config.check().unwrap_err().to_string().contains("no --bus"));
    let err = load(&["--bus", "nats://h:1", "--bus-client-cert", "/c.pem"], &[]).unwrap_err();
    assert!(err.contains("--bus-client-key"), "{err}");
    // A key file needs a bus, is one of two kinds, and is the client's one identity: not beside
    // a user or token in any of the URLs.
    let mut config = load(&["--bus-nkey", "/gw.nk", "--database", "postgres://h/db"], &[]).unwrap();
    assert!(config.check().unwrap_err().to_string().contains("no --bus"));
    let err = load(&["--bus", "nats://h:1", "--bus-creds", "/gw.creds", "--bus-nkey", "/gw.nk"], &[]).unwrap_err();
    assert!(err.contains("--bus-creds") && err.contains("--bus-nkey"), "{err}");
    for bus in ["nats://gw:s3cret@h:1", "nats://h:1,nats://t0ken@h:2"] {
        let mut config =
            load(&["--bus", bus, "--bus-creds", "/gw.creds", "--database", "postgres://h/db"], &[]).unwrap();
        let err = config.check().unwrap_err().to_string();
        assert!(err.contains("NATS takes one") && !err.contains("s3cret") && !err.contains("t0ken"), "{bus}: {err}");
    }
    let mut config =
        load(&["--bus", "nats://h:1", "--bus-creds", "/gw.creds", "--database", "postgres://h/db"], &[]).unwrap();
    config.check().expect("a credentials file beside a bus URL without a user");
}

#[cfg(not(feature = "cluster"))]
#[test]
fn a_build_without_the_cluster_feature_refuses_postgres_and_a_bus_and_says_how_to_get_them() {
    for args in [
        vec!["--database", "postgres://h/db"],
        vec!["--bus", "nats://h:4222"],
        vec!["--bus", "nats://h:4222", "--database", "postgres://h/db"],
    ] {
        let mut config = load(&args, &[]).unwrap();
        let err = config.check().expect_err("refused without the cluster feature").to_string();
        assert!(err.contains("--features cluster"), "{args:?}: {err}");
    }
    load(&[], &[]).unwrap().check().expect("SQLite alone needs nothing more");
}

#[cfg(not(feature = "cluster"))]
#[test]
fn the_binary_without_the_cluster_feature_stops_at_a_postgres_url_and_says_how_to_build_one() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
        .args(["--listen", "127.0.0.1:0", "--database", "postgres://u@127.0.0.1:1/db"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("postgres://") && err.contains("--features cluster"), "{err}");
}

/// `--otlp-endpoint` on a build without the `otlp` feature stops the start and says how to build
/// one; on a build with it, an endpoint that is not an http(s) URL stops the start.
#[test]
fn an_otlp_endpoint_is_refused_where_it_cannot_be_used() {
    let start = |endpoint: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
            .args(["--listen", "127.0.0.1:0", "--otlp-endpoint", endpoint])
            .env("DISPATCH_DATABASE", std::env::temp_dir().join("otlp-refused.db"))
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    if cfg!(feature = "otlp") {
        let (code, err) = start("ftp://collector:4318");
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains("must be an http:// or https:// URL"), "{err}");
    } else {
        let (code, err) = start("http://127.0.0.1:4318");
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains("--otlp-endpoint") && err.contains("`otlp` feature"), "{err}");
    }
}

/// An `openai` credential's URL and headers are checked at start, not at its first turn.
#[test]
fn a_bad_upstream_url_or_header_stops_the_start_and_names_its_credential() {
    let cases = [
        ("base_url = \"ftp://example.com/v1\"", "not an http:// or https:// URL"),
        ("base_url = \"just words\"", "is not a URL"),
        ("base_url = \"http://127.0.0.1:1/v1\"\nheaders = { \"Bad Name\" = \"x\" }", "bad header name"),
        ("base_url = \"http://127.0.0.1:1/v1\"\nheaders = { X-Title = \"a\\nb\" }", "bad value for header"),
    ];
    for (lines, says) in cases {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path(), &format!("[credentials.up]\nkind = \"openai\"\nmodels = [\"m1\"]\n{lines}\n"));
        let config = load(&["--config", &file], &[]).unwrap();
        let err = registry(&config).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{lines}: started"));
        assert!(err.contains("credentials.up") && err.contains(says), "{lines}: {err}");
    }
}

/// MCP servers are checked at start: a bad one stops it, naming the server (or the credential
/// that names a server that is not there); a good one starts.
#[test]
fn a_bad_mcp_server_stops_the_start_and_names_it() {
    let openai = "[credentials.up]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:1/v1\"\nmodels = [\"m\"]\n";
    let cases = [
        ("mcp = [\"x\"]\n[mcp.\"a b\"]\ncommand = \"true\"", "mcp.a b", "a server name of letters"),
        ("mcp = [\"x\"]\n[mcp.x]\ncommand = \"true\"\nurl = \"http://h/mcp\"", "mcp.x", "both set"),
        ("mcp = [\"x\"]\n[mcp.x]\nargs = []", "mcp.x", "set `command`"),
        ("mcp = [\"x\"]\n[mcp.x]\nurl = \"ftp://h\"", "mcp.x", "not an http:// or https:// URL"),
        ("mcp = [\"x\"]\n[mcp.x]\nurl = \"http://h/mcp\"\nscope = \"conversation\"", "mcp.x", "is `shared`"),
        (
            "mcp = [\"x\"]\n[mcp.x]\nurl = \"http://h/mcp\"\ntoken_env = \"DISPATCH_TEST_NO_SUCH_VAR\"",
            "mcp.x",
            "is not set",
        ),
        ("mcp = [\"nobody\"]\n[mcp.x]\ncommand = \"true\"", "credentials.up", "which is no [mcp.nobody] server"),
        (
            &format!("mcp = [\"x\"]\n[mcp.x]\ncommand = \"true\"\ntools = [\"{}\"]", "t".repeat(62)),
            "mcp.x",
            "does not fit",
        ),
    ];
    for (lines, names, says) in cases {
        let dir = tempfile::tempdir().unwrap();
        let file = write(dir.path(), &format!("{openai}{lines}\n"));
        let config = load(&["--config", &file], &[]).unwrap();
        let err = registry(&config).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{lines}: started"));
        assert!(err.contains(names) && err.contains(says), "{lines}: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), &format!("{openai}mcp = [\"x\"]\n[mcp.x]\ncommand = \"true\"\n"));
    registry(&load(&["--config", &file], &[]).unwrap()).expect("a good server starts");
}

/// A `command` credential's grace is bounded (shutdown waits for it): past the bound the start
/// stops, naming the credential and the key; at the bound it starts.
#[test]
fn an_agents_grace_past_its_bound_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let credential = |grace: u64| {
        format!(
            "[credentials.agent]\nkind = \"command\"\nprogram = \"python3\"\nmodels = [\"m\"]\ngrace_secs = {grace}\n"
        )
    };
    let file = write(dir.path(), &credential(61));
    let config = load(&["--config", &file], &[]).unwrap();
    let err = registry(&config).err().map(|e| e.to_string()).expect("refused");
    assert!(err.contains("credentials.agent") && err.contains("`grace_secs` is at most 60, got 61"), "{err}");
    let file = write(dir.path(), &credential(60));
    registry(&load(&["--config", &file], &[]).unwrap()).expect("60 is allowed");
}

/// The start says where the console is, and when the gateway is open to more than this
/// machine's pages: listening beyond loopback with any Host served or no keys, or `*` origins;
/// the defaults say nothing of the kind.
#[test]
fn the_start_says_when_pages_or_hosts_are_let_in_beyond_this_machine() {
    use std::io::BufRead;
    let lines_until_listening = |args: &[&str]| -> String {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("g.db");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_dispatch-gateway"))
            .args(["--database", db.to_str().unwrap()])
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut seen = String::new();
        for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
            // Without the colours a terminal would get.
            let mut line = line.unwrap();
            while let Some(start) = line.find('\x1b') {
                let end = line[start..].find('m').map_or(line.len(), |m| start + m + 1);
                line.replace_range(start..end, "");
            }
            seen += &line;
            seen.push('\n');
            if line.contains("the console") {
                break;
            }
        }
        child.kill().unwrap();
        child.wait().unwrap();
        seen
    };
    let quiet = lines_until_listening(&["--listen", "127.0.0.1:0"]);
    assert!(quiet.contains("dispatch-gateway listening"), "{quiet}");
    // And where the console is (a listener on every address: at localhost).
    assert!(quiet.contains("url=http://127.0.0.1:"), "{quiet}");
    assert!(!quiet.contains("WARN"), "{quiet}");
    let wide = lines_until_listening(&["--listen", "0.0.0.0:0"]);
    assert!(wide.contains("no --allowed-hosts") && wide.contains("with no API keys"), "{wide}");
    assert!(wide.contains("url=http://localhost:"), "{wide}");
    let named = lines_until_listening(&["--listen", "0.0.0.0:0", "--allowed-hosts", "gw.example", "--api-keys", "k"]);
    assert!(!named.contains("WARN"), "{named}");
    let any = lines_until_listening(&["--listen", "127.0.0.1:0", "--cors-origins", "*"]);
    assert!(any.contains("--cors-origins is *") && any.contains("no key is needed"), "{any}");
}

/// docs/configuration.md is the reference the flags' own docs generate: a flag added, renamed or
/// redescribed without regenerating it fails here, so the reference never says what the code
/// does not.
#[test]
fn the_configuration_reference_is_the_one_the_flags_generate() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md");
    let written = std::fs::read_to_string(&path).expect("docs/configuration.md");
    let generated = dispatch_gateway::config::reference();
    assert!(
        written == generated,
        "docs/configuration.md differs from the flags' docs: run `cargo run -- --print-configuration > docs/configuration.md`"
    );
}

/// The README stays an introduction (at most 2,500 words, as `wc -w` counts them): the flag
/// reference is docs/configuration.md, each subject's detail its own file under docs/.
#[test]
fn the_readme_stays_an_introduction() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let words = std::fs::read_to_string(path).expect("README.md").split_whitespace().count();
    assert!(words <= 2_500, "README.md has {words} words: move detail to docs/");
}
