//! The writer connection on a thread of its own: every write is a job sent to it, run to its
//! end there (a whole transaction of turns' writes is one job), and answered through a
//! oneshot. One hand-off per job, whatever the statements in it; the async side never waits
//! on SQLite's locks or its fsync.

use std::sync::Mutex;
use std::sync::mpsc;
use std::thread::JoinHandle;

use rusqlite::Connection;
use tokio::sync::oneshot;

use super::{StoreError, StoreResult};

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

pub(crate) struct Writer {
    /// `None` once closed.
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Writer {
    /// Starts the thread that owns `connection`.
    pub(super) fn start(mut connection: Connection) -> StoreResult<Writer> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("sqlite-writer".into())
            .spawn(move || {
                for job in queue {
                    job(&mut connection);
                }
                // Dropped here, after the last job: the last connection to close checkpoints
                // the WAL into the file.
            })
            .map_err(|e| StoreError::Unwritable(format!("could not start the database writer: {e}")))?;
        Ok(Writer { jobs: Mutex::new(Some(jobs)), thread: Mutex::new(Some(thread)) })
    }

    /// Runs `job` on the writer connection.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut Connection) -> StoreResult<T> + Send + 'static,
    ) -> StoreResult<T> {
        let (reply, answer) = oneshot::channel();
        let sent = match self.jobs.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(jobs) => jobs
                .send(Box::new(move |c: &mut Connection| {
                    let _ = reply.send(job(c));
                }))
                .is_ok(),
            None => false,
        };
        if !sent {
            return Err(StoreError::Unwritable("the database writer is closed".into()));
        }
        answer.await.unwrap_or_else(|_| Err(StoreError::Unwritable("the database writer stopped".into())))
    }

    /// Lets the jobs sent so far finish, then closes the connection.
    pub(super) async fn close(&self) {
        drop(self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take());
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(thread) = thread {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}
