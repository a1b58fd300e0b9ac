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

use serde_json::Value;

use tokio::io::AsyncWriteExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::lines::{self, BoundedLines};
use super::{EventSink, RawEvent, Runtime, RuntimeError, RuntimeFuture, TurnRequest};
use crate::config::{CommandCredential, Dialect};

mod agent;
mod dialect;

use agent::{Agent, StartedFor, log_stderr};

use crate::wire::ErrorCode;
pub use dialect::Mapper;
use dialect::{claude_args, foreign_turn_line, interrupt_line, usable_session, user_line};

/// Longest session id kept: it goes back to the next process as an argument and a variable.
const MAX_SESSION_ID: usize = 256;

/// Backoff before restarting a process that died, doubling up to the cap.
const RESTART_BASE: Duration = Duration::from_millis(250);
const RESTART_CAP: Duration = Duration::from_secs(10);

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

impl AgentState {
    /// Its process died (or was killed for breaking the protocol of admission): the next
    /// start waits longer.
    fn died(&mut self) {
        self.failures += 1;
        self.last_death = Some(Instant::now());
    }
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
    /// The credential's MCP servers, reached through the gateway's MCP endpoint: each process
    /// gets a pass (Claude Code as `--mcp-config`, the gateway's own dialect as
    /// `DISPATCH_MCP_CONFIG`), so that it sees the tools the `openai` loop sees and no more.
    tools: Option<AgentTools>,
}

/// A credential's MCP servers (`mcp`) and the toolbox that runs them.
pub struct AgentTools {
    pub toolbox: Arc<crate::tools::Toolbox>,
    pub servers: Vec<String>,
}

impl CommandRuntime {
    /// `tools`: see [`Inner::tools`].
    pub fn new(
        name: &str,
        mut settings: CommandCredential,
        max_line: usize,
        tools: Option<AgentTools>,
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
                tools,
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
        if let Some(entry) = agents.get(conversation_id)
            && Arc::strong_count(entry) == 1
            && entry.try_lock().is_ok_and(|state| state.agent.is_none())
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
        // not find other entries held. An entry locked is in a turn (or being started): not
        // idle. This conversation's own entry is locked by its turn.
        let idle = {
            let agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
            agents
                .iter()
                .filter_map(|(id, entry)| {
                    let state = entry.try_lock().ok()?;
                    state.agent.as_ref()?;
                    Some((state.idle_since, id, entry))
                })
                .min_by_key(|(since, _, _)| *since)
                .map(|(_, id, entry)| (id.clone(), entry.clone()))
        };
        if let Some((id, entry)) = idle {
            let stopped = match entry.try_lock() {
                Ok(mut state) => state.agent.take(),
                Err(_) => None,
            };
            drop(entry);
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
        // The gateway's secrets stay home: the agent gets the basics and its credential's `env`.
        crate::child_env::clean(&mut command);
        command.args(&s.args);
        let pass = match &self.tools {
            Some(tools) => {
                let folder = started_for
                    .cwd
                    .as_ref()
                    .and_then(|cwd| tools.toolbox.folder(&tools.servers, &cwd.to_string_lossy()));
                let pass = tools
                    .toolbox
                    .pass(&tools.servers, &req.conversation_id, folder)
                    .map_err(|e| RuntimeError::turn(e, ErrorCode::AgentSpawn))?;
                command.env(crate::tools::TOKEN_VARIABLE, pass.token());
                Some(pass)
            }
            None => None,
        };
        let mcp = pass.as_ref().map(|p| p.config().to_string());
        if s.dialect == Dialect::ClaudeStreamJson {
            command.args(claude_args(&started_for, req.session_id.as_deref(), s.unattended));
            // Only the gateway's servers: the agent sees the tool set every runtime sees.
            if let Some(mcp) = &mcp {
                command.args(["--mcp-config", mcp, "--strict-mcp-config"]);
            }
        } else if let Some(mcp) = &mcp {
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
            log_stderr(BoundedLines::new(stderr, self.max_line), self.name.clone(), req.conversation_id.clone());
        }
        self.started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pgid = child.id().map(|id| id as i32);
        let stdout = BoundedLines::new(stdout, self.max_line);
        let grace = Duration::from_secs(s.grace_secs);
        let (session, last_turn) = (req.session_id.clone(), req.previous_turn_id.clone());
        Ok(Agent { child, stdin, stdout, pgid, started_for, session, last_turn, grace, _place: place, _pass: pass })
    }

    /// One turn on the conversation's process; whatever its end, the idle timer is armed.
    async fn turn(
        self: &Arc<Self>,
        req: TurnRequest,
        sink: EventSink,
        cancel: CancellationToken,
    ) -> Result<(), RuntimeError> {
        let state = self.agent_state(&req.conversation_id);
        let mut held = state.lock().await;
        held.turns += 1;
        let seen = held.turns;
        let result = self.run(&mut held, &req, sink, cancel).await;
        drop(held);
        self.arm_idle_timer(&req.conversation_id, state, seen);
        result
    }

    /// A turn in four phases: a live process for it, the turn written to it (admission), its
    /// lines read to the turn's end, and what the end leaves of the process.
    async fn run(
        &self,
        state: &mut AgentState,
        req: &TurnRequest,
        sink: EventSink,
        cancel: CancellationToken,
    ) -> Result<(), RuntimeError> {
        let Some(mut agent) = self.ready_agent(state, req, &cancel).await? else { return Ok(()) };
        let foreign_open = self.admit(state, &mut agent, req).await?;
        let (outcome, interrupted) = self.stream(&mut agent, req, sink, cancel, foreign_open).await;
        match outcome {
            Outcome::Settled => {
                state.failures = 0;
                state.idle_since = Some(Instant::now());
                state.agent = Some(agent);
                Ok(())
            }
            Outcome::Kill => {
                agent.kill().await;
                Ok(())
            }
            Outcome::Died(message) => {
                agent.kill().await;
                state.died();
                if interrupted { Ok(()) } else { Err(RuntimeError::turn(message, ErrorCode::AgentExit)) }
            }
            Outcome::Protocol(message) => {
                agent.kill().await;
                Err(RuntimeError::turn(message, ErrorCode::AgentProtocol))
            }
        }
    }

    /// The conversation's process if it is alive and fits the turn, else a new one (after a
    /// backoff when processes keep dying); `None` when the turn was stopped during the backoff.
    async fn ready_agent(
        &self,
        state: &mut AgentState,
        req: &TurnRequest,
        cancel: &CancellationToken,
    ) -> Result<Option<Agent>, RuntimeError> {
        let alive = match state.agent.as_mut() {
            Some(agent) => agent.child.try_wait().ok().flatten().is_none(),
            None => false,
        };
        // The conversation moved to another model, folder or effort, its session was
        // forgotten, or it went on elsewhere: the process goes (not a death: no backoff), and
        // one started for the turn resumes the session, if any.
        if alive
            && state.agent.as_ref().is_some_and(|agent| !agent.fits(&self.started_for(req), req))
            && let Some(agent) = state.agent.take()
        {
            tracing::info!(credential = %self.name, conversation = %req.conversation_id, "a new agent process for another model, folder, effort or session, or turns run elsewhere");
            agent.stop().await;
        }
        match state.agent.take() {
            Some(agent) if alive => Ok(Some(agent)),
            dead => {
                if let Some(mut agent) = dead {
                    agent.kill().await;
                    state.died();
                }
                // A process that keeps dying is restarted ever more slowly.
                if state.failures > 0 && state.last_death.is_some() {
                    let wait = (RESTART_BASE * 2u32.pow(state.failures.min(8) - 1)).min(RESTART_CAP);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = cancel.cancelled() => return Ok(None),
                    }
                }
                let place = self.place().await?;
                self.spawn(req, place).map(Some)
            }
        }
    }

    /// Admission: the write of the user line. Whether a turn the agent started itself is still
    /// open (its lines are not this turn's).
    async fn admit(&self, state: &mut AgentState, agent: &mut Agent, req: &TurnRequest) -> Result<bool, RuntimeError> {
        if agent.child.try_wait().ok().flatten().is_some() {
            state.died();
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
        let line = user_line(self.settings.dialect, req);
        let mut written = 0;
        while written < line.len() {
            match agent.stdin.write(&line.as_bytes()[written..]).await {
                Ok(0) | Err(_) => {
                    agent.kill().await;
                    state.died();
                    return Err(if written == 0 {
                        RuntimeError::Failed("the agent process closed its input".into())
                    } else {
                        RuntimeError::Ambiguous("the write of the turn to the agent broke part-way".into())
                    });
                }
                Ok(n) => written += n,
            }
        }
        if agent.stdin.flush().await.is_err() {
            agent.kill().await;
            return Err(RuntimeError::Ambiguous("the write of the turn to the agent broke part-way".into()));
        }
        agent.last_turn = Some(req.turn_id.clone());
        Ok(foreign_open)
    }

    /// Reads the agent's lines into the turn until it ends; how it ended, and whether the
    /// turn was stopped (the agent interrupted) meanwhile.
    async fn stream(
        &self,
        agent: &mut Agent,
        req: &TurnRequest,
        sink: EventSink,
        cancel: CancellationToken,
        mut foreign_open: bool,
    ) -> (Outcome, bool) {
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
                        let _ = agent.stdin.write_all(interrupt_line(self.settings.dialect).as_bytes()).await;
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
        (outcome, interrupted.is_some())
    }

    /// After the idle timeout with no turn since this one: stops the conversation's process
    /// and forgets the conversation.
    fn arm_idle_timer(self: &Arc<Self>, conversation_id: &str, entry: Arc<tokio::sync::Mutex<AgentState>>, seen: u64) {
        let idle = Duration::from_secs(self.settings.idle_timeout_secs.max(1));
        let (inner, conversation_id) = (self.clone(), conversation_id.to_owned());
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(idle) => {}
                _ = inner.fence.cancelled() => return,
            }
            {
                let mut state = entry.lock().await;
                if state.turns != seen {
                    return;
                }
                if let Some(agent) = state.agent.take() {
                    tracing::info!("stopping an idle agent process");
                    agent.stop().await;
                }
            }
            drop(entry);
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
    /// Inside the credential's roots, and inside its conversation servers' roots when it has
    /// any (they start in the agent's folder).
    fn folder(&self, cwd: &str) -> Option<String> {
        let inside = crate::folders::inside(&self.inner.roots, cwd)?.to_string_lossy().into_owned();
        match &self.inner.tools {
            Some(t) if t.toolbox.uses_folders(&t.servers) => t.toolbox.folder(&t.servers, &inside).map(|_| inside),
            _ => Some(inside),
        }
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
        let Some(entry) = inner.agents.lock().unwrap_or_else(|p| p.into_inner()).get(conversation_id).cloned() else {
            return;
        };
        let conversation_id = conversation_id.to_owned();
        tokio::spawn(async move {
            // Should a conversation made again under the id have run a turn first, its process
            // goes too: its next turn starts another, which resumes its session.
            let agent = entry.lock().await.agent.take();
            if let Some(agent) = agent {
                tracing::info!(credential = %inner.name, conversation = %conversation_id, "stopping the agent process of a deleted conversation");
                agent.stop().await;
            }
            drop(entry);
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
            let stops = agents.into_iter().map(|entry| async move {
                if let Some(agent) = entry.lock().await.agent.take() {
                    agent.stop().await;
                }
            });
            futures_util::future::join_all(stops).await;
        })
    }
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
