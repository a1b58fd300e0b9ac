//! A running agent process: its pipes, what it was started for, and how it ends (killed with
//! its process group, or stopped as the end of its input stops it).

use std::time::Duration;

use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::sync::OwnedSemaphorePermit;

use crate::runtime::TurnRequest;
use crate::runtime::lines::BoundedLines;

/// A running agent process.
pub(super) struct Agent {
    pub(super) child: Child,
    pub(super) stdin: ChildStdin,
    pub(super) stdout: BoundedLines<ChildStdout>,
    pub(super) pgid: Option<i32>,
    /// What it was started for: a turn on another model, in another folder or (Claude Code)
    /// with another effort needs a new one.
    pub(super) started_for: StartedFor,
    /// The session it holds: the one it resumed, or the last it reported. A turn that
    /// resumes another (or none: the conversation's session was forgotten) needs a new one.
    pub(super) session: Option<String>,
    /// The last turn it was given: a turn whose conversation went on without it (another
    /// gateway or runtime ran the turn before) needs a new one.
    pub(super) last_turn: Option<String>,
    /// How long it has to wind down before it is killed, to finish an interrupted turn or to
    /// exit once its input is closed (the credential's `grace_secs`).
    pub(super) grace: Duration,
    /// Its place among the credential's `max_processes`, given back when it is dropped.
    pub(super) _place: OwnedSemaphorePermit,
    /// Its way to the gateway's MCP servers, withdrawn when it is dropped.
    pub(super) _pass: Option<crate::tools::Pass>,
}

impl Agent {
    /// Whether it can take this turn: started for its model, folder and effort, holding the
    /// session the turn resumes, and given the conversation's turn before it.
    pub(super) fn fits(&self, started_for: &StartedFor, req: &TurnRequest) -> bool {
        self.started_for == *started_for && self.session == req.session_id && self.last_turn == req.previous_turn_id
    }

    /// Kills the whole process group, then reaps the leader.
    pub(super) async fn kill(&mut self) {
        kill_group(self.pgid, &mut self.child).await;
    }

    /// Ends an idle process as the end of its input does, so that it writes what it keeps
    /// (Claude Code its session's transcript, which a kill right after a turn cut short:
    /// the next process resumed without the last turns); its group is killed after its
    /// grace or once it exits.
    pub(super) async fn stop(self) {
        let Agent { mut child, stdin, stdout, pgid, grace, .. } = self;
        drop(stdin);
        // Its output stays open, unread: a closed pipe could end it before it wrote.
        let _ = tokio::time::timeout(grace, child.wait()).await;
        kill_group(pgid, &mut child).await;
        drop(stdout);
    }
}

async fn kill_group(pgid: Option<i32>, child: &mut Child) {
    if let Some(pgid) = pgid {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory involved.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
    let _ = child.kill().await;
}

/// The model and working directory a process was started with (its arguments, environment
/// and folder), and Claude Code's effort (an argument too; the gateway's own dialect gets it
/// with each turn): a process cannot move to others.
#[derive(PartialEq)]
pub(super) struct StartedFor {
    pub(super) model: String,
    pub(super) cwd: Option<std::path::PathBuf>,
    pub(super) effort: Option<String>,
}

/// Logs the agent's stderr, a line at a time, to its end: a program blocked on a full stderr
/// pipe would stop answering.
pub(super) fn log_stderr(
    mut lines: BoundedLines<tokio::process::ChildStderr>,
    credential: String,
    conversation: String,
) {
    tokio::spawn(async move {
        loop {
            match lines.next_line().await {
                Ok(Some(line)) => {
                    tracing::info!(credential = %credential, conversation = %conversation, "agent stderr: {line}")
                }
                Ok(None) => break,
                // Over the limit, or not UTF-8: that line only.
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    tracing::warn!(credential = %credential, conversation = %conversation, "agent stderr: {e}, left out")
                }
                Err(_) => break,
            }
        }
    });
}
