//! A key file the bus knows a gateway by: the server sends a nonce, the gateway signs it with
//! the file's seed. The file is read at every connection, not once: a `.creds` file whose JWT
//! expired, or a key the server stopped listing, is replaced on disk and the client's next
//! reconnect uses the new one, with no restart (docs/cluster.md, "Securing the bus").

use std::path::{Path, PathBuf};

use async_nats::{Auth, AuthError, ConnectOptions};

/// A key file the bus authenticates a gateway by.
#[derive(Debug, Clone)]
pub enum BusKey {
    /// A `.creds` file: a user JWT (operator mode) and its NKEY seed.
    Creds(PathBuf),
    /// A file holding a user NKEY seed.
    Nkey(PathBuf),
}

impl BusKey {
    /// Options that sign every connection's nonce with the file as it is then. The file is read
    /// once here too, so that a missing or malformed one stops the start with its name.
    pub(super) fn connect_options(&self) -> Result<ConnectOptions, String> {
        self.auth(b"")?;
        let key = self.clone();
        Ok(ConnectOptions::with_auth_callback(move |nonce| {
            let key = key.clone();
            // A small local file, read at a (re)connection: blocking for it costs nothing.
            async move {
                key.auth(&nonce).map_err(|e| {
                    tracing::error!(error = %e, "cannot sign in to the bus");
                    AuthError::new(e)
                })
            }
        }))
    }

    /// What the gateway signs in with: the nonce signed by the file's seed, and the user's JWT
    /// (`.creds`) or public key (NKEY). The errors name the file, never its text.
    fn auth(&self, nonce: &[u8]) -> Result<Auth, String> {
        let mut auth = Auth::new();
        let pair = match self {
            BusKey::Creds(path) => {
                let text = read(path, "credentials")?;
                let mut framed = framed_values(&text);
                let jwt = framed
                    .next()
                    .ok_or_else(|| format!("the credentials file {} holds no user JWT", path.display()))?;
                let seed = framed
                    .next()
                    .ok_or_else(|| format!("the credentials file {} holds no NKEY seed", path.display()))?;
                auth.jwt = Some(jwt.to_owned());
                user_key(seed, path, "credentials")?
            }
            BusKey::Nkey(path) => {
                let pair = user_key(read(path, "NKEY")?.trim(), path, "NKEY")?;
                auth.nkey = Some(pair.public_key());
                pair
            }
        };
        auth.signature = Some(pair.sign(nonce).map_err(|e| format!("signing with {}: {e}", self.path().display()))?);
        Ok(auth)
    }

    fn path(&self) -> &Path {
        match self {
            BusKey::Creds(path) | BusKey::Nkey(path) => path,
        }
    }
}

fn read(path: &Path, kind: &str) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("reading the {kind} file {}: {e}", path.display()))
}

/// The key pair of a user's seed; an account's or operator's seed, or no seed, is refused.
fn user_key(seed: &str, path: &Path, kind: &str) -> Result<nkeys::KeyPair, String> {
    match nkeys::KeyPair::from_seed(seed) {
        Ok(pair) if pair.key_pair_type() == nkeys::KeyPairType::User => Ok(pair),
        Ok(_) => Err(format!("the {kind} file {} holds a seed, but not a user's (SU...)", path.display())),
        Err(_) => Err(format!("the {kind} file {} does not hold an NKEY seed", path.display())),
    }
}

/// The values a `.creds` file frames between dashed lines, in order (the JWT, then the seed),
/// as NATS clients read them: a value line between a `---...---` line before and after it.
fn framed_values(text: &str) -> impl Iterator<Item = &str> {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let dashed = |line: &str| line.len() >= 6 && line.starts_with("---") && line.ends_with("---");
    let value = |line: &str| {
        !line.is_empty() && line.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'='))
    };
    let mut found = Vec::new();
    let mut i = 0;
    while i + 2 < lines.len() {
        if dashed(lines[i]) && value(lines[i + 1]) && !dashed(lines[i + 1]) && dashed(lines[i + 2]) {
            found.push(lines[i + 1]);
            i += 3;
        } else {
            i += 1;
        }
    }
    found.into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_creds_file_gives_its_jwt_then_its_seed() {
        let text = "-----BEGIN NATS USER JWT-----\neyJ0.eyJ-x_y.sig\n------END NATS USER JWT------\n\n\
                    ************************* IMPORTANT *************************\n\
                    NKEYs are sensitive.\n\n\
                    -----BEGIN USER NKEY SEED-----\r\nSUAIO3FH\r\n------END USER NKEY SEED------\n";
        assert_eq!(framed_values(text).collect::<Vec<_>>(), ["eyJ0.eyJ-x_y.sig", "SUAIO3FH"]);
        assert_eq!(framed_values("").count(), 0);
        assert_eq!(framed_values("-----A-----\n\n-----B-----\n").count(), 0, "an empty frame holds nothing");
    }

    /// Files that cannot sign a gateway in are refused naming the file and what is wrong,
    /// never with their text; a good one signs the nonce.
    #[test]
    fn a_key_file_that_cannot_sign_is_refused_by_name_without_its_text() {
        let dir = tempfile::tempdir().unwrap();
        let frame = |jwt: &str, seed: &str| {
            format!(
                "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
            )
        };
        let user = nkeys::KeyPair::new_user().seed().unwrap();
        let account = nkeys::KeyPair::new_account().seed().unwrap();
        let jwt_only = "-----BEGIN NATS USER JWT-----\neyJsecret.jwt\n------END NATS USER JWT------\n";
        let cases = [
            (BusKey::Creds(dir.path().join("missing.creds")), None, "reading the credentials file"),
            (BusKey::Creds(dir.path().join("jwt-only.creds")), Some(jwt_only.to_owned()), "holds no NKEY seed"),
            (BusKey::Creds(dir.path().join("account.creds")), Some(frame("eyJa.b", &account)), "not a user's"),
            (
                BusKey::Creds(dir.path().join("garbage.creds")),
                Some(frame("eyJa.b", "SUsecret")),
                "does not hold an NKEY seed",
            ),
            (BusKey::Nkey(dir.path().join("garbage.nk")), Some("SUsecret\n".to_owned()), "does not hold an NKEY seed"),
            (BusKey::Nkey(dir.path().join("account.nk")), Some(account.clone()), "not a user's"),
        ];
        for (key, text, says) in cases {
            if let Some(text) = &text {
                std::fs::write(key.path(), text).unwrap();
            }
            let Err(said) = key.auth(b"nonce") else { panic!("{} signed", key.path().display()) };
            assert!(said.contains(says) && said.contains(&key.path().display().to_string()), "{said}");
            for secret in ["SUsecret", "eyJsecret", account.as_str()] {
                assert!(!said.contains(secret), "{said}");
            }
        }
        let good = dir.path().join("good.creds");
        std::fs::write(&good, frame("eyJa.b", &user)).unwrap();
        let auth = BusKey::Creds(good).auth(b"nonce").expect("a user's creds sign");
        let pair = nkeys::KeyPair::from_seed(&user).unwrap();
        assert_eq!(auth.jwt.as_deref(), Some("eyJa.b"));
        assert!(pair.verify(b"nonce", auth.signature.as_deref().unwrap()).is_ok(), "the nonce is signed by the seed");
    }
}
