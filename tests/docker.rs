//! No Docker engine runs here, so the Docker files are checked against the code: the port,
//! the health path, the binary and every environment variable they name must be real.

use clap::CommandFactory;
use dispatch_gateway::Config;

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

fn dispatch_vars(text: &str) -> Vec<String> {
    let mut vars: Vec<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("DISPATCH_") && w.len() > "DISPATCH_".len())
        .map(str::to_owned)
        .collect();
    vars.sort();
    vars.dedup();
    vars
}

#[test]
fn docker_files_name_what_the_code_uses() {
    let dockerfile = read("docker/Dockerfile");
    let compose = read("docker/compose.yaml");
    let port = Config::defaults().listen.port();
    assert_eq!(port, 24203);
    assert!(dockerfile.contains(&format!("EXPOSE {port}")));
    assert!(dockerfile.contains(&format!("DISPATCH_LISTEN=0.0.0.0:{port}")));
    assert!(compose.contains(&format!(":{port}:{port}")));

    let health = dockerfile.lines().find(|l| l.contains("curl") && l.contains("CMD")).expect("a HEALTHCHECK command");
    assert!(health.contains(&format!("http://127.0.0.1:{port}/health")), "{health}");
    let doc: serde_json::Value = serde_json::from_str(dispatch_gateway::http::OPENAPI_JSON).unwrap();
    assert!(doc["paths"]["/health"]["get"].is_object());

    let binary = env!("CARGO_BIN_EXE_dispatch-gateway").rsplit('/').next().unwrap();
    assert!(dockerfile.contains(&format!("target/release/{binary}")));
    assert!(dockerfile.contains(&format!("ENTRYPOINT [\"{binary}\"]")));
    assert!(dockerfile.contains("USER dispatch") && dockerfile.contains("VOLUME /data"));
    assert!(dockerfile.contains("DISPATCH_DATABASE=/data/"));

    let known: Vec<String> = Config::command()
        .get_arguments()
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .collect();
    for var in dispatch_vars(&dockerfile).into_iter().chain(dispatch_vars(&compose)) {
        assert!(known.contains(&var), "{var} is not a configuration variable; known: {known:?}");
    }
    // And the configuration reference documents every variable.
    let reference = read("docs/configuration.md");
    for var in &known {
        assert!(reference.contains(var.as_str()), "docs/configuration.md does not document {var}");
    }
}

/// The image's build stage copies every folder the code compiles in (`include_str!`,
/// `include_bytes!`): a file the build reads from a folder it was not given fails only in a
/// Docker build, which no test here runs.
#[test]
fn the_build_stage_copies_every_folder_the_code_compiles_in() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dockerfile = read("docker/Dockerfile");
    let mut folders = std::collections::BTreeSet::new();
    let mut pending = vec![root.join("src")];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for (at, _) in text.match_indices("include_") {
                let rest = &text[at..];
                let Some(arg) = rest.strip_prefix("include_str!(\"").or_else(|| rest.strip_prefix("include_bytes!(\""))
                else {
                    continue;
                };
                let relative = &arg[..arg.find('"').unwrap()];
                let file = path.parent().unwrap().join(relative).canonicalize().unwrap();
                let inside = file.strip_prefix(root.canonicalize().unwrap()).unwrap();
                folders.insert(inside.components().next().unwrap().as_os_str().to_string_lossy().into_owned());
            }
        }
    }
    assert!(folders.contains("migrations") && folders.contains("openapi"), "{folders:?}");
    for folder in &folders {
        assert!(dockerfile.contains(&format!("COPY {folder} {folder}")), "docker/Dockerfile does not copy {folder}/");
    }
}
