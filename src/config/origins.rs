//! Which names and pages the gateway answers to: `--allowed-hosts` (the `Host` a request
//! names) and `--cors-origins` (the `Origin` of a page that changes state or opens a
//! WebSocket), with the loopback defaults (docs/security.md).

use super::Config;

/// The origins of pages on this machine: what `--cors-origins` allows by default.
pub const LOOPBACK_ORIGINS: [&str; 3] = ["http://localhost:*", "http://127.0.0.1:*", "http://[::1]:*"];

/// The names of this machine a loopback listener answers to by default.
const LOOPBACK_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// `host` (`name[:port]`, `[v6]:port`) without its port.
fn host_name(host: &[u8]) -> &[u8] {
    if host.starts_with(b"[") {
        return host.iter().position(|b| *b == b']').map_or(host, |end| &host[..=end]);
    }
    host.iter().position(|b| *b == b':').map_or(host, |colon| &host[..colon])
}

/// Whether an allowed-origin entry covers `origin`: equal (ASCII case aside), `*`, or
/// `scheme://host:*` and `origin` that host with any port or none.
fn origin_matches(entry: &[u8], origin: &[u8]) -> bool {
    if entry == b"*" || entry.eq_ignore_ascii_case(origin) {
        return true;
    }
    let Some(prefix) = entry.strip_suffix(b":*") else { return false };
    let Some(rest) =
        origin.get(..prefix.len()).filter(|p| p.eq_ignore_ascii_case(prefix)).map(|_| &origin[prefix.len()..])
    else {
        return false;
    };
    rest.is_empty()
        || rest.strip_prefix(b":").is_some_and(|port| !port.is_empty() && port.iter().all(u8::is_ascii_digit))
}

impl Config {
    /// Whether a browser page from `origin` may use the gateway (CORS, WebSocket handshakes,
    /// state changes): an entry equal to it, `*`, or `scheme://host:*` for any port of a host.
    pub fn allows_origin(&self, origin: &[u8]) -> bool {
        self.cors_origins.iter().any(|o| origin_matches(o.as_bytes(), origin))
    }

    /// Whether a request naming `host` (`name[:port]`, as its `Host` header) is served: the
    /// `--allowed-hosts` names (any port), or by default the loopback names while listening on
    /// loopback and any name beyond it.
    pub fn allows_host(&self, host: &[u8]) -> bool {
        let name = host_name(host);
        if self.allowed_hosts.is_empty() {
            return !self.listen.ip().is_loopback()
                || LOOPBACK_HOSTS.iter().any(|h| name.eq_ignore_ascii_case(h.as_bytes()));
        }
        self.allowed_hosts.iter().any(|h| h == "*" || name.eq_ignore_ascii_case(host_name(h.as_bytes())))
    }

    /// Whether a page from `origin` may change state or open a WebSocket on a request that
    /// names `host`: an allowed origin, or the gateway's own, which is the origin of a host it
    /// answers to by name (`--allowed-hosts` or a loopback name), never whatever `Host` the
    /// request says.
    pub fn admits_origin(&self, origin: &[u8], host: Option<&[u8]>) -> bool {
        self.allows_origin(origin) || self.own_origin(origin, host)
    }

    /// Whether a page from `origin` may use the session cookie alone to change state or open a
    /// WebSocket on a request that names `host`: the gateway's own origin, or one listed in
    /// `--session-origins`. Never `--cors-origins` (its default admits every loopback port, and
    /// SameSite ignores ports: a page on another port of this machine is same-site, so the
    /// browser sends it the cookie); those origins get in with a credential of their own.
    pub fn admits_session_origin(&self, origin: &[u8], host: Option<&[u8]>) -> bool {
        self.session_origins.iter().any(|o| origin_matches(o.as_bytes(), origin)) || self.own_origin(origin, host)
    }

    /// Whether `origin` is the gateway's own for a request naming `host`: the origin of a host
    /// it answers to by name (`--allowed-hosts` or a loopback name), never whatever `Host` the
    /// request says.
    fn own_origin(&self, origin: &[u8], host: Option<&[u8]>) -> bool {
        let authority = origin.strip_prefix(b"http://").or_else(|| origin.strip_prefix(b"https://"));
        let (Some(authority), Some(host)) = (authority, host) else { return false };
        if !authority.eq_ignore_ascii_case(host) {
            return false;
        }
        let name = host_name(host);
        LOOPBACK_HOSTS.iter().any(|h| name.eq_ignore_ascii_case(h.as_bytes()))
            || self.allowed_hosts.iter().any(|h| h != "*" && name.eq_ignore_ascii_case(host_name(h.as_bytes())))
    }

    /// Whether any origin may use the gateway (`--cors-origins *`).
    pub fn any_origin(&self) -> bool {
        self.cors_origins.iter().any(|o| o == "*")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_match_exactly_or_by_any_port_of_a_host() {
        let m = |entry: &str, origin: &str| origin_matches(entry.as_bytes(), origin.as_bytes());
        assert!(m("http://localhost:*", "http://localhost:5173"));
        assert!(m("http://localhost:*", "http://localhost"));
        assert!(m("http://127.0.0.1:*", "http://127.0.0.1:8080"));
        assert!(m("http://[::1]:*", "http://[::1]:3000"));
        assert!(m("https://app.example", "https://APP.example"));
        assert!(m("*", "http://evil.example"));
        assert!(!m("http://localhost:*", "http://localhost.evil.example"));
        assert!(!m("http://localhost:*", "http://localhost:80x"));
        assert!(!m("http://localhost:*", "http://localhost:"));
        assert!(!m("http://localhost:*", "https://localhost:5173"));
        assert!(!m("http://127.0.0.1:*", "http://127.0.0.10:80"));
        assert!(!m("https://app.example", "https://app.example.evil"));
        assert!(!m("http://localhost:*", "null"));
    }

    #[test]
    fn the_cookie_is_lent_to_the_gateways_own_origin_and_listed_session_origins_only() {
        let mut config = Config::defaults();
        let own = Some(&b"127.0.0.1:24203"[..]);
        assert!(config.admits_session_origin(b"http://127.0.0.1:24203", own));
        // Another loopback port: admitted by --cors-origins' default, never lent the cookie.
        assert!(config.admits_origin(b"http://127.0.0.1:5173", own));
        assert!(!config.admits_session_origin(b"http://127.0.0.1:5173", own));
        assert!(!config.admits_session_origin(b"http://localhost:24203", own), "another name is another origin");
        // A Host the gateway does not answer to by name makes no origin its own.
        assert!(!config.admits_session_origin(b"http://evil.example", Some(b"evil.example")));
        config.session_origins = vec!["http://127.0.0.1:5173".into()];
        assert!(config.admits_session_origin(b"http://127.0.0.1:5173", own));
        assert!(!config.admits_session_origin(b"http://127.0.0.1:5174", own));
    }

    #[test]
    fn a_loopback_listener_answers_to_loopback_names_only_unless_told() {
        let mut config = Config::defaults();
        for good in ["localhost", "localhost:24203", "127.0.0.1:1", "[::1]:24203", "LOCALHOST"] {
            assert!(config.allows_host(good.as_bytes()), "{good}");
        }
        for bad in ["evil.example", "evil.example:24203", "127.0.0.1.evil.example", "localhost.evil", "[::2]:1"] {
            assert!(!config.allows_host(bad.as_bytes()), "{bad}");
        }
        config.allowed_hosts = vec!["gateway.example".into()];
        assert!(config.allows_host(b"gateway.example:443"));
        assert!(!config.allows_host(b"localhost:24203"));
        config.allowed_hosts = vec!["*".into()];
        assert!(config.allows_host(b"anything.example"));
        config.allowed_hosts.clear();
        config.listen = "0.0.0.0:24203".parse().unwrap();
        assert!(config.allows_host(b"anything.example"), "beyond loopback a proxy in front decides");
    }
}
