//! The `command` runtime: a resident agent process per conversation, spoken to in NDJSON over
//! stdin/stdout, in the gateway's own dialect (`docs/command-protocol.md`) or Claude Code's
//! `stream-json`.
//!
//! Supervision: each process is the leader of its own process group (so a stop kills what it
//! spawned too), its stderr goes to the log, it is interrupted when a turn is stopped and killed
//! when it does not settle, restarted (with backoff) when it died between turns, and stopped
//! after an idle timeout. Admission: stdin written = submitted; a process gone before the write
//! = failed (retried); a write that breaks part-way = ambiguous (never retried).

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::DEFAULT_REASONING_EFFORT;
use super::claude::{ClaudeMapper, Mapped};
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::lines::{self, BoundedLines};
use super::{EventSink, RawEvent, Runtime, RuntimeError, RuntimeFuture, TurnRequest};
use crate::config::{CommandCredential, Dialect};
use crate::wire::{ErrorCode, OutputStream};

/// Longest session id kept: it goes back to the next process as an argument and a variable.
const MAX_SESSION_ID: usize = 256;

/// Backoff before restarting a process that died, doubling up to the cap.
const RESTART_BASE: Duration = Duration::from_millis(250);
const RESTART_CAP: Duration = Duration::from_secs(10);

/// A running agent process.
struct Agent {
    child: Child,
    stdin: ChildStdin,
    stdout: BoundedLines<ChildStdout>,
    pgid: Option<i32>,
    /// What it was started for: a turn on another model, in another folder or (Claude Code)
    /// with another effort needs a new one.
    started_for: StartedFor,
    /// The session it holds: the one it resumed, or the last it reported. A turn that
    /// resumes another (or none: the conversation's session was forgotten) needs a new one.
    session: Option<String>,
    /// The last turn it was given: a turn whose conversation went on without it (another
    /// gateway or runtime ran the turn before) needs a new one.
    last_turn: Option<String>,
    /// How long it has to wind down before it is killed, to finish an interrupted turn or to
    /// exit once its input is closed (the credential's `grace_secs`).
    grace: Duration,
    /// Its place among the credential's `max_processes`, given back when it is dropped.
    _place: OwnedSemaphorePermit,
}

impl Agent {
    /// Whether it can take this turn: started for its model, folder and effort, holding the
    /// session the turn resumes, and given the conversation's turn before it.
    fn fits(&self, started_for: &StartedFor, req: &TurnRequest) -> bool {
        self.started_for == *started_for && self.session == req.session_id && self.last_turn == req.previous_turn_id
    }

    /// Kills the whole process group, then reaps the leader.
    async fn kill(mut self) {
        kill_group(self.pgid, &mut self.child).await;
    }

    /// Ends an idle process as the end of its input does, so that it writes what it keeps
    /// (Claude Code its session's transcript, which a kill right after a turn cut short:
    /// the next process resumed without the last turns); its group is killed after its
    /// grace or once it exits.
    async fn stop(self) {
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
struct StartedFor {
    model: String,
    cwd: Option<std::path::PathBuf>,
    effort: Option<String>,
}

/// One conversation's agent (when alive) and its restart bookkeeping.
#[derive(Default)]
struct AgentState {
    agent: Option<Agent>,
    failures: u32,
    last_death: Option<Instant>,
    /// When its last turn ended: the longest idle process is the first stopped for a new one.
    idle_since: Option<Instant>,
    /// Turns so far, so that an idle timer knows whether one came since it was armed.
    turns: u64,
}

pub struct CommandRuntime {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    /// The folders its agents may work in, canonical (`cwd_roots`).
    roots: Vec<std::path::PathBuf>,
    settings: CommandCredential,
    /// The longest line the program may print (`--max-runtime-line-bytes`).
    max_line: usize,
    /// Places for the credential's processes (`max_processes`).
    places: Arc<Semaphore>,
    /// Per conversation, while it has a process or had a turn within the idle timeout (the
    /// idle timer forgets it after that: conversation ids are unbounded).
    agents: Mutex<HashMap<String, Arc<tokio::sync::Mutex<AgentState>>>>,
    fence: CancellationToken,
    turns: TaskTracker,
    /// Processes started so far (`dispatch_agent_starts_total`).
    started: std::sync::atomic::AtomicU64,
    /// The credential's MCP servers as an MCP client's configuration (`{"mcpServers": ...}`):
    /// Claude Code gets it as `--mcp-config`, the gateway's own dialect as `DISPATCH_MCP_CONFIG`.
    mcp_config: Option<String>,
}

impl CommandRuntime {
    /// `mcp_config`: see [`Inner::mcp_config`].
    pub fn new(
        name: &str,
        mut settings: CommandCredential,
        max_line: usize,
        mcp_config: Option<String>,
    ) -> CommandRuntime {
        settings.max_processes = settings.max_processes.max(1);
        // The folders its agents may work in, as they are now (symlinks followed): its
        // `cwd_roots`, else its `cwd`, else the gateway's working directory.
        let mut roots = settings.cwd_roots.clone();
        if roots.is_empty() {
            roots.extend(settings.cwd.clone().or_else(|| std::env::current_dir().ok()));
        }
        let roots = crate::folders::canonical_roots(&roots, name);
        CommandRuntime {
            inner: Arc::new(Inner {
                roots,
                name: name.to_owned(),
                places: Arc::new(Semaphore::new(settings.max_processes)),
                settings,
                max_line,
                agents: Mutex::default(),
                fence: CancellationToken::new(),
                turns: TaskTracker::new(),
                started: std::sync::atomic::AtomicU64::new(0),
                mcp_config,
            }),
        }
    }
}

impl Inner {
    fn agent_state(&self, conversation_id: &str) -> Arc<tokio::sync::Mutex<AgentState>> {
        self.agents.lock().unwrap_or_else(|p| p.into_inner()).entry(conversation_id.to_owned()).or_default().clone()
    }

    /// Drops a conversation's entry when it has no process and nothing else holds it (a turn
    /// takes its entry under the map's lock, so the count cannot rise meanwhile).
    fn forget(&self, conversation_id: &str) {
        let mut agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = agents.get(conversation_id)
            && Arc::strong_count(slot) == 1
            && slot.try_lock().is_ok_and(|state| state.agent.is_none())
        {
            agents.remove(conversation_id);
        }
    }

    /// A place for a new process: a free one, else the one of the process idle longest, which
    /// is stopped; when every process is in a turn, the turn fails.
    async fn place(&self) -> Result<OwnedSemaphorePermit, RuntimeError> {
        if let Ok(place) = self.places.clone().try_acquire_owned() {
            return Ok(place);
        }
        // Chosen under the map's lock, cloning only the one chosen: a `forget` meanwhile must
        // not find other entries held. A slot locked is in a turn (or being started): not
        // idle. This conversation's own slot is locked by its turn.
        let idle = {
            let agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
            agents
                .iter()
                .filter_map(|(id, slot)| {
                    let state = slot.try_lock().ok()?;
                    state.agent.as_ref()?;
                    Some((state.idle_since, id, slot))
                })
                .min_by_key(|(since, _, _)| *since)
                .map(|(_, id, slot)| (id.clone(), slot.clone()))
        };
        if let Some((id, slot)) = idle {
            let stopped = match slot.try_lock() {
                Ok(mut state) => state.agent.take(),
                Err(_) => None,
            };
            drop(slot);
            if let Some(agent) = stopped {
                tracing::info!(credential = %self.name, "stopping the agent process idle longest for a new one");
                agent.stop().await;
            }
            // Its idle timer may have fired while this held the entry.
            self.forget(&id);
        }
        self.places.clone().try_acquire_owned().map_err(|_| {
            RuntimeError::turn(
                format!(
                    "every one of the credential's {} agent processes is in a turn (max_processes)",
                    self.settings.max_processes
                ),
                ErrorCode::AgentBusy,
            )
        })
    }

    /// What a process for this turn is started with: the turn's folder, else the credential's.
    fn started_for(&self, req: &TurnRequest) -> StartedFor {
        let cwd = req.cwd.as_ref().map(std::path::PathBuf::from).or_else(|| self.settings.cwd.clone());
        let effort = req.reasoning_effort.clone().filter(|_| self.settings.dialect == Dialect::ClaudeStreamJson);
        StartedFor { model: req.model.clone(), cwd, effort }
    }

    fn spawn(&self, req: &TurnRequest, place: OwnedSemaphorePermit) -> Result<Agent, RuntimeError> {
        let s = &self.settings;
        let started_for = self.started_for(req);
        let mut command = tokio::process::Command::new(&s.program);
        command.args(&s.args);
        if s.dialect == Dialect::ClaudeStreamJson {
            command.args(claude_args(&started_for, req.session_id.as_deref(), s.unattended));
            // Only the gateway's servers: the agent sees the tool set every runtime sees.
            if let Some(mcp) = &self.mcp_config {
                command.args(["--mcp-config", mcp, "--strict-mcp-config"]);
            }
        } else if let Some(mcp) = &self.mcp_config {
            command.env("DISPATCH_MCP_CONFIG", mcp);
        }
        if let Some(session) = &req.session_id {
            command.env("DISPATCH_SESSION_ID", session);
        }
        command
            .envs(&s.env)
            .env("DISPATCH_CONVERSATION_ID", &req.conversation_id)
            .env("DISPATCH_MODEL", &req.model)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0);
        if let Some(cwd) = &started_for.cwd {
            command.current_dir(cwd);
        }
        if let Some(limit) = crate::open_files::for_children() {
            // SAFETY: runs in the child between fork and exec, where only async-signal-safe
            // calls are allowed: setrlimit(2) is one, and nothing is allocated.
            unsafe {
                command.pre_exec(move || {
                    libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
                    Ok(())
                });
            }
        }
        let mut child = command.spawn().map_err(|e| {
            // A missing folder fails the spawn as a missing program would: say which it is.
            let message = match &started_for.cwd {
                Some(cwd) if !cwd.is_dir() => "the agent's working directory is no longer a folder".to_owned(),
                _ => format!("cannot start the agent program {:?}: {e}", s.program),
            };
            RuntimeError::turn(message, ErrorCode::AgentSpawn)
        })?;
        let stdin =
            child.stdin.take().ok_or_else(|| RuntimeError::turn("the agent has no stdin", ErrorCode::AgentSpawn))?;
        let stdout =
            child.stdout.take().ok_or_else(|| RuntimeError::turn("the agent has no stdout", ErrorCode::AgentSpawn))?;
        if let Some(stderr) = child.stderr.take() {
            let (credential, conversation) = (self.name.clone(), req.conversation_id.clone());
            let mut lines = BoundedLines::new(stderr, self.max_line);
            tokio::spawn(async move {
                // Read to the end whatever comes: a program blocked on a full stderr pipe
                // would stop answering.
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
        self.started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pgid = child.id().map(|id| id as i32);
        let stdout = BoundedLines::new(stdout, self.max_line);
        let grace = Duration::from_secs(s.grace_secs);
        let (session, last_turn) = (req.session_id.clone(), req.previous_turn_id.clone());
        Ok(Agent { child, stdin, stdout, pgid, started_for, session, last_turn, grace, _place: place })
    }

    /// The line that submits a turn.
    fn user_line(&self, req: &TurnRequest) -> String {
        let value = match self.settings.dialect {
            Dialect::Ndjson => json!({
                "type": "user",
                "turnId": req.turn_id,
                "text": req.prompt,
                "model": req.model,
                "sessionId": req.session_id,
                "cwd": req.cwd,
                "reasoningEffort": req.reasoning_effort.as_deref().unwrap_or(DEFAULT_REASONING_EFFORT),
            }),
            Dialect::ClaudeStreamJson => json!({
                "type": "user",
                "message": {"role": "user", "content": [{"type": "text", "text": req.prompt}]},
                "uuid": uuid::Uuid::new_v4().to_string(),
            }),
        };
        value.to_string() + "\n"
    }

    fn interrupt_line(&self) -> String {
        let value = match self.settings.dialect {
            Dialect::Ndjson => json!({"type": "interrupt"}),
            Dialect::ClaudeStreamJson => json!({
                "type": "control_request",
                "request_id": uuid::Uuid::new_v4().to_string(),
                "request": {"subtype": "interrupt"},
            }),
        };
        value.to_string() + "\n"
    }

    /// One turn on the conversation's process; whatever its end, the idle timer is armed.
    async fn turn(
        self: &Arc<Self>,
        req: TurnRequest,
        sink: EventSink,
        cancel: CancellationToken,
    ) -> Result<(), RuntimeError> {
        let slot = self.agent_state(&req.conversation_id);
        let mut state = slot.lock().await;
        state.turns += 1;
        let seen = state.turns;
        let result = self.run(&mut state, &req, sink, cancel).await;
        drop(state);
        self.arm_idle_timer(&req.conversation_id, slot, seen);
        result
    }

    async fn run(
        &self,
        slot: &mut AgentState,
        req: &TurnRequest,
        sink: EventSink,
        cancel: CancellationToken,
    ) -> Result<(), RuntimeError> {
        let alive = match slot.agent.as_mut() {
            Some(agent) => agent.child.try_wait().ok().flatten().is_none(),
            None => false,
        };
        // The conversation moved to another model, folder or effort, its session was
        // forgotten, or it went on elsewhere: the process goes (not a death: no backoff), and
        // one started for the turn resumes the session, if any.
        if alive
            && slot.agent.as_ref().is_some_and(|agent| !agent.fits(&self.started_for(req), req))
            && let Some(agent) = slot.agent.take()
        {
            tracing::info!(credential = %self.name, conversation = %req.conversation_id, "a new agent process for another model, folder, effort or session, or turns run elsewhere");
            agent.stop().await;
        }
        let mut agent = match slot.agent.take() {
            Some(agent) if alive => agent,
            dead => {
                if let Some(agent) = dead {
                    agent.kill().await;
                    slot.failures += 1;
                    slot.last_death = Some(Instant::now());
                }
                // A process that keeps dying is restarted ever more slowly.
                if slot.failures > 0 && slot.last_death.is_some() {
                    let wait = (RESTART_BASE * 2u32.pow(slot.failures.min(8) - 1)).min(RESTART_CAP);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = cancel.cancelled() => return Ok(()),
                    }
                }
                let place = self.place().await?;
                self.spawn(req, place)?
            }
        };

        // Admission: the write of the user line.
        if agent.child.try_wait().ok().flatten().is_some() {
            slot.failures += 1;
            slot.last_death = Some(Instant::now());
            return Err(RuntimeError::Failed("the agent process exited before the turn was written".into()));
        }
        // Claude Code may run turns of its own between ours (a background task's completion):
        // what it printed meanwhile is not this turn's, and a turn of its own still running
        // ends with a result that is not this turn's either.
        let mut foreign_open = false;
        if self.settings.dialect == Dialect::ClaudeStreamJson {
            use futures_util::FutureExt;
            let mut dropped = 0;
            while let Some(Ok(Some(line))) = agent.stdout.next_line().now_or_never() {
                foreign_open = foreign_turn_line(&line, foreign_open);
                dropped += 1;
            }
            if dropped > 0 {
                tracing::info!(dropped, "dropped the lines of a turn the agent started itself");
            }
        }
        let line = self.user_line(req);
        let mut written = 0;
        while written < line.len() {
            match agent.stdin.write(&line.as_bytes()[written..]).await {
                Ok(0) | Err(_) if written == 0 => {
                    agent.kill().await;
                    slot.failures += 1;
                    slot.last_death = Some(Instant::now());
                    return Err(RuntimeError::Failed("the agent process closed its input".into()));
                }
                Ok(0) | Err(_) => {
                    agent.kill().await;
                    slot.failures += 1;
                    slot.last_death = Some(Instant::now());
                    return Err(RuntimeError::Ambiguous("the write of the turn to the agent broke part-way".into()));
                }
                Ok(n) => written += n,
            }
        }
        if agent.stdin.flush().await.is_err() {
            agent.kill().await;
            return Err(RuntimeError::Ambiguous("the write of the turn to the agent broke part-way".into()));
        }
        agent.last_turn = Some(req.turn_id.clone());

        let mut mapper = Mapper::new(self.settings.dialect, self.settings.unattended);
        let mut interrupted: Option<tokio::time::Instant> = None;
        let outcome = loop {
            let line = if let Some(deadline) = interrupted {
                match tokio::time::timeout_at(deadline, agent.stdout.next_line()).await {
                    Ok(line) => line,
                    Err(_) => break Outcome::Kill,
                }
            } else {
                tokio::select! {
                    line = agent.stdout.next_line() => line,
                    _ = cancel.cancelled() => {
                        // Interrupt at once; the turn is already ending `aborted`.
                        let _ = agent.stdin.write_all(self.interrupt_line().as_bytes()).await;
                        let _ = agent.stdin.flush().await;
                        interrupted = Some(tokio::time::Instant::now() + agent.grace);
                        continue;
                    }
                }
            };
            let line = match line {
                Ok(Some(line)) => line,
                Err(e) if lines::too_long(&e) => break Outcome::Protocol(format!("the agent printed {e}")),
                Ok(None) | Err(_) => {
                    let status = agent.child.try_wait().ok().flatten();
                    break Outcome::Died(format!(
                        "the agent process exited mid-turn{}",
                        status.map(|s| format!(" ({s})")).unwrap_or_default()
                    ));
                }
            };
            if line.trim().is_empty() {
                continue;
            }
            if foreign_open {
                foreign_open = foreign_turn_line(&line, true);
                continue;
            }
            let value: Value = match serde_json::from_str(&line) {
                Ok(v) => v,
                Err(_) => {
                    let shown: String = line.chars().take(200).collect();
                    break Outcome::Protocol(format!("the agent printed a line that is not JSON: {shown:?}"));
                }
            };
            let mapped = mapper.map(&value);
            for reply in mapped.replies {
                let _ = agent.stdin.write_all((reply.to_string() + "\n").as_bytes()).await;
                let _ = agent.stdin.flush().await;
            }
            let mut terminal = false;
            for event in mapped.events {
                terminal |= matches!(event, RawEvent::Finish { .. } | RawEvent::Error { .. });
                if let RawEvent::SessionId(id) = &event {
                    if !usable_session(id) {
                        tracing::warn!(credential = %self.name, conversation = %req.conversation_id,
                            "the agent reported a session id that cannot be passed back (empty, over {MAX_SESSION_ID} bytes, or with a control character): not kept");
                        continue;
                    }
                    agent.session = Some(id.clone());
                }
                if interrupted.is_none() && sink.send(event).await.is_err() {
                    // The turn went away (stopped): keep draining to the agent's terminal.
                    interrupted = Some(tokio::time::Instant::now() + agent.grace);
                }
            }
            if terminal {
                break Outcome::Settled;
            }
        };
        match outcome {
            Outcome::Settled => {
                slot.failures = 0;
                slot.idle_since = Some(Instant::now());
                slot.agent = Some(agent);
                Ok(())
            }
            Outcome::Kill => {
                agent.kill().await;
                Ok(())
            }
            Outcome::Died(message) => {
                agent.kill().await;
                slot.failures += 1;
                slot.last_death = Some(Instant::now());
                if interrupted.is_some() { Ok(()) } else { Err(RuntimeError::turn(message, ErrorCode::AgentExit)) }
            }
            Outcome::Protocol(message) => {
                agent.kill().await;
                Err(RuntimeError::turn(message, ErrorCode::AgentProtocol))
            }
        }
    }

    /// After the idle timeout with no turn since this one: stops the conversation's process
    /// and forgets the conversation.
    fn arm_idle_timer(self: &Arc<Self>, conversation_id: &str, slot: Arc<tokio::sync::Mutex<AgentState>>, seen: u64) {
        let idle = Duration::from_secs(self.settings.idle_timeout_secs.max(1));
        let (inner, conversation_id) = (self.clone(), conversation_id.to_owned());
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(idle) => {}
                _ = inner.fence.cancelled() => return,
            }
            {
                let mut state = slot.lock().await;
                if state.turns != seen {
                    return;
                }
                if let Some(agent) = state.agent.take() {
                    tracing::info!("stopping an idle agent process");
                    agent.stop().await;
                }
            }
            drop(slot);
            inner.forget(&conversation_id);
        });
    }
}

enum Outcome {
    Settled,
    Kill,
    Died(String),
    Protocol(String),
}

impl Runtime for CommandRuntime {
    fn folder(&self, cwd: &str) -> Option<String> {
        crate::folders::inside(&self.inner.roots, cwd).map(|path| path.to_string_lossy().into_owned())
    }

    fn processes(&self) -> Option<crate::metrics::Processes> {
        let inner = &self.inner;
        Some(crate::metrics::Processes {
            credential: inner.name.clone(),
            // A place is held from a process's start until it is gone.
            running: inner.settings.max_processes - inner.places.available_permits(),
            started: inner.started.load(std::sync::atomic::Ordering::Relaxed),
        })
    }

    fn run_turn(&self, request: TurnRequest, sink: EventSink, cancel: CancellationToken) -> RuntimeFuture {
        let inner = self.inner.clone();
        if inner.fence.is_cancelled() {
            return Box::pin(async { Err(RuntimeError::Failed("the runtime is stopping".into())) });
        }
        let tracked = inner.turns.track_future({
            let inner = inner.clone();
            async move { inner.turn(request, sink, cancel).await }
        });
        Box::pin(tracked)
    }

    fn release(&self, conversation_id: &str) {
        let inner = self.inner.clone();
        let Some(slot) = inner.agents.lock().unwrap_or_else(|p| p.into_inner()).get(conversation_id).cloned() else {
            return;
        };
        let conversation_id = conversation_id.to_owned();
        tokio::spawn(async move {
            // Should a conversation made again under the id have run a turn first, its process
            // goes too: its next turn starts another, which resumes its session.
            let agent = slot.lock().await.agent.take();
            if let Some(agent) = agent {
                tracing::info!(credential = %inner.name, conversation = %conversation_id, "stopping the agent process of a deleted conversation");
                agent.stop().await;
            }
            drop(slot);
            inner.forget(&conversation_id);
        });
    }

    fn shutdown(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        let inner = &self.inner;
        Box::pin(async move {
            inner.fence.cancel();
            inner.turns.close();
            inner.turns.wait().await;
            let agents: Vec<_> =
                inner.agents.lock().unwrap_or_else(|p| p.into_inner()).drain().map(|(_, s)| s).collect();
            // Every turn has settled: the processes are idle, stopped all at once.
            let stops = agents.into_iter().map(|slot| async move {
                if let Some(agent) = slot.lock().await.agent.take() {
                    agent.stop().await;
                }
            });
            futures_util::future::join_all(stops).await;
        })
    }
}

/// Maps agent lines to raw events, keeping what a dialect needs across lines.
pub enum Mapper {
    Ndjson,
    Claude(ClaudeMapper),
}

impl Mapper {
    pub fn new(dialect: Dialect, unattended: bool) -> Mapper {
        match dialect {
            Dialect::Ndjson => Mapper::Ndjson,
            Dialect::ClaudeStreamJson => Mapper::Claude(ClaudeMapper::new(unattended)),
        }
    }

    /// The raw events one line stands for (used directly by tests of recorded transcripts).
    pub fn events(&mut self, line: &Value) -> Vec<RawEvent> {
        self.map(line).events
    }

    fn map(&mut self, v: &Value) -> Mapped {
        match self {
            Mapper::Ndjson => Mapped { events: ndjson_event(v).into_iter().collect(), replies: Vec::new() },
            Mapper::Claude(claude) => claude.map(v),
        }
    }
}

/// Whether a turn the agent started itself is still open after `line`: its `result` closes
/// it, any other line of a turn opens it.
fn foreign_turn_line(line: &str, open: bool) -> bool {
    let kind =
        serde_json::from_str::<Value>(line).ok().and_then(|v| v.get("type").and_then(Value::as_str).map(str::to_owned));
    match kind.as_deref() {
        Some("result") => false,
        Some("assistant" | "user" | "stream_event") => true,
        _ => open,
    }
}

/// The gateway's own dialect: one raw event per line (unknown types are skipped).
fn ndjson_event(v: &Value) -> Option<RawEvent> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    Some(match v.get("type")?.as_str()? {
        "step_start" => RawEvent::StepStart,
        "text" => RawEvent::TextDelta(s("delta")?),
        "reasoning" => RawEvent::ReasoningDelta(s("delta")?),
        "tool_call" => {
            RawEvent::ToolCall { id: s("id")?, name: s("name")?, input: v.get("input").cloned().unwrap_or(Value::Null) }
        }
        "tool_output" => RawEvent::ToolOutput {
            id: s("id")?,
            data: s("data")?,
            stream: if s("stream").as_deref() == Some("stderr") { OutputStream::Stderr } else { OutputStream::Stdout },
        },
        "tool_result" => RawEvent::ToolResult {
            id: s("id")?,
            name: s("name").unwrap_or_default(),
            content: s("content").unwrap_or_default(),
            is_error: v.get("isError").and_then(Value::as_bool).unwrap_or(false),
            duration_ms: v.get("durationMs").and_then(Value::as_u64),
        },
        "usage" => RawEvent::Usage(serde_json::from_value(v.get("usage")?.clone()).ok()?),
        "step_end" => RawEvent::StepEnd,
        "done" => RawEvent::Finish { reason: s("reason").unwrap_or_else(|| "stop".into()) },
        "error" => RawEvent::Error {
            message: s("message").unwrap_or_else(|| "the agent failed".into()),
            code: s("code").map(|c| ErrorCode::parse(&c)),
        },
        "session" => RawEvent::SessionId(s("id")?),
        _ => return None,
    })
}

/// The arguments the gateway adds for Claude Code's stream-json mode. Permission requests come
/// over stdio only with `--permission-prompt-tool stdio` (else `unattended` would have nothing
/// to answer); the session is resumed as one argument (`--resume=<id>`), so an id that starts
/// with a dash is not read as a flag. The effort is passed only when the conversation has one
/// (else Claude Code's default), so a CLI older than `--effort` still starts.
/// Whether a session id an agent reported can be given back to a process (an argument, an
/// environment variable): not empty, at most `MAX_SESSION_ID` bytes, no control character
/// (a NUL would fail every start of the conversation's processes, a long one the system's
/// limit on an argument).
fn usable_session(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_SESSION_ID && !id.chars().any(char::is_control)
}

fn claude_args(started_for: &StartedFor, session: Option<&str>, unattended: bool) -> Vec<String> {
    // Partial messages: the CLI streams tokens (`stream_event` lines) instead of whole blocks.
    let mut args: Vec<String> = [
        "--print",
        "--input-format",
        "stream-json",
        "--output-format",
        "stream-json",
        "--verbose",
        "--include-partial-messages",
        "--model",
        &started_for.model,
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    if let Some(effort) = &started_for.effort {
        args.extend(["--effort".to_owned(), effort.clone()]);
    }
    if unattended {
        args.extend(["--permission-prompt-tool".to_owned(), "stdio".to_owned()]);
    }
    if let Some(session) = session {
        args.push(format!("--resume={session}"));
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent that answers every turn at once.
    const ECHO: &str = r#"
import json, sys
for line in sys.stdin:
    if json.loads(line).get("type") == "user":
        print(json.dumps({"type": "text", "delta": "hi"}), flush=True)
        print(json.dumps({"type": "done", "reason": "stop"}), flush=True)
"#;

    fn request(conversation_id: &str) -> TurnRequest {
        TurnRequest {
            conversation_id: conversation_id.to_owned(),
            turn_id: uuid::Uuid::now_v7().to_string(),
            model: "echo".into(),
            prompt: "hello".into(),
            cwd: None,
            reasoning_effort: None,
            history: None,
            session_id: None,
            previous_turn_id: None,
            tokens_per_estimate: None,
            inbox: Arc::default(),
        }
    }

    /// Real processes: every conversation id that ever had a turn must not keep an entry.
    #[tokio::test]
    async fn an_idle_conversation_is_forgotten_with_its_process() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("echo.py");
        std::fs::write(&script, ECHO).unwrap();
        let credential = CommandCredential {
            program: "python3".into(),
            args: vec![script.to_string_lossy().into_owned()],
            dialect: Dialect::Ndjson,
            models: vec!["echo".into()],
            cwd: None,
            cwd_roots: Vec::new(),
            env: Default::default(),
            idle_timeout_secs: 1,
            unattended: false,
            max_processes: 8,
            grace_secs: 3,
            mcp: Vec::new(),
        };
        let runtime = CommandRuntime::new("agent", credential, 1 << 16, None);
        let mut pids = Vec::new();
        for conversation in ["c1", "c2", "c3"] {
            let (sink, mut events) = crate::runtime::event_queue(16, 1 << 20);
            runtime.run_turn(request(conversation), sink, CancellationToken::new()).await.unwrap();
            assert!(matches!(events.recv().await, Some(RawEvent::TextDelta(_))));
            let state = runtime.inner.agent_state(conversation);
            pids.push(state.lock().await.agent.as_ref().and_then(|a| a.child.id()).expect("a live process"));
        }
        let inner = &runtime.inner;
        for _ in 0..200 {
            if inner.agents.lock().unwrap().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(inner.agents.lock().unwrap().is_empty(), "entries left after the idle timeout");
        for pid in pids {
            assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "process {pid} still runs");
        }
        // A forgotten conversation starts afresh.
        let (sink, _events) = crate::runtime::event_queue(16, 1 << 20);
        runtime.run_turn(request("c1"), sink, CancellationToken::new()).await.unwrap();
        assert_eq!(inner.agents.lock().unwrap().len(), 1);
        runtime.shutdown().await;
    }

    #[test]
    fn claude_code_gets_its_permission_tool_when_unattended_and_its_session_as_one_argument() {
        let sonnet =
            |effort: Option<&str>| StartedFor { model: "sonnet".into(), cwd: None, effort: effort.map(Into::into) };
        let args = claude_args(&sonnet(Some("low")), Some("-odd-id"), true);
        assert!(args.windows(2).any(|w| w == ["--permission-prompt-tool", "stdio"]), "{args:?}");
        assert!(args.windows(2).any(|w| w == ["--effort", "low"]), "{args:?}");
        assert_eq!(args.last().unwrap(), "--resume=-odd-id");
        let args = claude_args(&sonnet(None), None, false);
        assert!(!args.iter().any(|a| a.starts_with("--permission-prompt-tool") || a.starts_with("--resume")));
        assert!(!args.iter().any(|a| a == "--effort"), "no effort asked: Claude Code's default");
        assert!(args.windows(2).any(|w| w == ["--model", "sonnet"]));
    }
}
