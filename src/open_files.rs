//! The process's limit on open files, raised at start to the most the system allows it: every
//! stream holds a socket, and the soft limit many environments start a process with (1024 under
//! systemd and in most shells) would stop `accept` near a thousand watchers, far below
//! `--max-streams`. Agent programs the gateway starts get the limit it started with back.

use std::sync::OnceLock;

/// The limit the process started with, when it was raised: what agent programs get.
static STARTED_WITH: OnceLock<libc::rlimit> = OnceLock::new();

/// Descriptors the gateway needs besides its streams' sockets: the database's files or
/// connections, the listeners, the runtime's own, agent programs' pipes, upstream connections.
const HEADROOM: u64 = 256;

/// The limit on open files: soft (what `accept` runs into) and hard.
pub(crate) fn limit() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit fills the struct it is given.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit)
}

/// Raises the soft limit to the hard one, and warns when even that leaves no room for
/// `max_streams` streams.
pub fn raise(max_streams: usize) {
    let Some(mut limit) = limit() else { return };
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
        // SAFETY: setrlimit reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            tracing::info!(from = limit.rlim_cur, to = raised.rlim_cur, "raised the open-file limit to the hard limit");
            let _ = STARTED_WITH.set(limit);
            limit = raised;
        } else {
            let error = std::io::Error::last_os_error();
            tracing::warn!(limit = limit.rlim_cur, %error, "cannot raise the open-file limit");
        }
    }
    let needed = max_streams as u64 + HEADROOM;
    if limit.rlim_cur < needed {
        tracing::warn!(
            limit = limit.rlim_cur,
            max_streams,
            "the open-file limit is below what --max-streams needs: past it new connections wait unanswered; raise the hard limit (ulimit -Hn, systemd's LimitNOFILE=, docker run --ulimit nofile=) or lower --max-streams"
        );
    }
}

/// The limit to give a program this process starts: the one it started with, when it was
/// raised (as Go does for its children: a program may size a table by it or use select(2)).
pub(crate) fn for_children() -> Option<libc::rlimit> {
    STARTED_WITH.get().copied()
}
