//! A NATS server with JetStream for one test: Debian's `nats-server`, started on a free port with
//! its data in a folder of its own, stopped and removed when the test is done.
//!
//! `DISPATCH_TEST_NATS` names the binary (else `nats-server` on the PATH or in /usr/sbin, where
//! Debian puts it). Without one the tests that need it are skipped with a line saying so, unless
//! `DISPATCH_REQUIRE_NATS=1` asks for them, which makes a missing server a failure.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct NatsServer {
    /// `nats://127.0.0.1:<port>` (`tls://` when the server requires TLS).
    pub url: String,
    child: Child,
    dir: PathBuf,
    binary: PathBuf,
    /// The arguments besides the address and port.
    args: Vec<std::ffi::OsString>,
}

fn binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("DISPATCH_TEST_NATS") {
        return Some(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|dir| dir.join("nats-server"))
        .find(|p| p.is_file())
}

/// A running server, or `None` when none is installed (see the module's note).
pub fn nats_server() -> Option<NatsServer> {
    nats_server_with(&[])
}

/// A running server started with `args` besides the test's own (authentication, TLS), or
/// `None` when none is installed.
pub fn nats_server_with(args: &[&str]) -> Option<NatsServer> {
    start(|dir| {
        let own = ["--jetstream".into(), "--store_dir".into(), dir.join("data").into_os_string()];
        own.into_iter().chain(args.iter().map(Into::into)).collect()
    })
}

/// A running server whose configuration file says `config` (its users, accounts), JetStream
/// included: the file, unlike flags, is what the server reads again on [`NatsServer::reconfigure`].
pub fn nats_server_configured(config: &str) -> Option<NatsServer> {
    start(|dir| {
        write_config(dir, config);
        vec!["-c".into(), dir.join(CONFIG).into_os_string()]
    })
}

const CONFIG: &str = "server.conf";

fn write_config(dir: &Path, config: &str) {
    let store = dir.join("data");
    let text = format!("{config}\njetstream {{ store_dir: {:?} }}\n", store.to_str().expect("a UTF-8 path"));
    std::fs::write(dir.join(CONFIG), text).expect("the NATS server's configuration is written");
}

/// Starts the server with a folder of its own, and the arguments `args` gives for that folder.
fn start(args: impl FnOnce(&Path) -> Vec<std::ffi::OsString>) -> Option<NatsServer> {
    let Some(binary) = binary() else {
        assert!(
            std::env::var("DISPATCH_REQUIRE_NATS").as_deref() != Ok("1"),
            "DISPATCH_REQUIRE_NATS=1 but no nats-server was found (DISPATCH_TEST_NATS, PATH, /usr/sbin)"
        );
        eprintln!("no nats-server installed: skipping what needs NATS");
        return None;
    };
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let dir = std::env::temp_dir().join(format!("dispatch-nats-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(dir.join("ports")).expect("a folder for the NATS server");
    let args = args(&dir);
    let (child, url) = spawn(&binary, &dir, "-1", &args);
    Some(NatsServer { url, child, dir, binary, args })
}

/// The server on `port` (-1: a free one), and its URL once it listens.
fn spawn(binary: &Path, dir: &Path, port: &str, args: &[std::ffi::OsString]) -> (Child, String) {
    let child = Command::new(binary)
        .args(["--addr", "127.0.0.1", "--port", port])
        .arg("--ports_file_dir")
        .arg(dir.join("ports"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{} does not start: {e}", binary.display()));
    let url = wait_for_port(&dir.join("ports"), Duration::from_secs(20)).expect("nats-server writes its port");
    (child, url)
}

/// The client URL from the ports file the server writes once it listens.
fn wait_for_port(dir: &Path, within: Duration) -> Option<String> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            // {"nats":["nats://127.0.0.1:PORT"], ...} (or "tls://...")
            if let Some(start) = text.find("nats://").or_else(|| text.find("tls://")) {
                let rest = &text[start..];
                if let Some(end) = rest.find('"') {
                    return Some(rest[..end].to_owned());
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

impl NatsServer {
    /// Stops the server and starts it again on the same port without its data (its streams
    /// gone), as a server without a persistent volume comes back.
    pub fn restart_empty(&mut self) {
        self.stop();
        self.wipe();
        self.start();
    }

    /// Stops the server and starts it again on the same port, with its data.
    pub fn restart(&mut self) {
        self.stop();
        self.start();
    }

    /// Stops the server (its clients see it gone until [`NatsServer::start`]).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Removes a stopped server's data.
    pub fn wipe(&self) {
        let _ = std::fs::remove_dir_all(self.dir.join("data"));
    }

    /// Starts a stopped server again on its port.
    pub fn start(&mut self) {
        for entry in std::fs::read_dir(self.dir.join("ports")).into_iter().flatten().flatten() {
            let _ = std::fs::remove_file(entry.path());
        }
        let port = self.url.rsplit(':').next().expect("the URL ends with the port").to_owned();
        let (child, url) = spawn(&self.binary, &self.dir, &port, &self.args);
        assert_eq!(url, self.url, "the server is back on its port");
        self.child = child;
    }

    /// Replaces the configuration of a [`nats_server_configured`] server with `config` and has
    /// it read the file again (SIGHUP), as an operator changing its users does: clients whose
    /// credentials it no longer accepts are disconnected.
    pub fn reconfigure(&self, config: &str) {
        write_config(&self.dir, config);
        let pid = self.child.id().to_string();
        let status = Command::new("kill").args(["-HUP", &pid]).status().expect("kill runs");
        assert!(status.success(), "nats-server {pid} takes SIGHUP");
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
