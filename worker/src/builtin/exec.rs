//! `exec`: runs a program with the payload on stdin and the run's facts in the environment.
//!
//! Exit 0 = success; an exit code in `permanent_exit_codes` (default 100) = permanent
//! failure; anything else (or a signal) = transient.
//!
//! Environment: a clean one. The program gets `PATH`, `HOME`, `USER`, `LOGNAME`, the locale
//! (`LANG`, `LANGUAGE`, `LC_*`), `TZ` and `TMPDIR` from the worker, the variables named in
//! `worker.pass_env` and the job's `pass_env`, and the run's `CHIME_*` facts — never the rest
//! of the worker's environment (its broker and Redis URLs with their passwords).
//!
//! Output: stdout goes to the worker's stdout; stderr is read as it comes and only its last
//! 2 KiB are kept (for the error message), so a program writing gigabytes costs no memory.
//!
//! Process hygiene: the program runs under a tiny `/bin/sh` guard that leads its own
//! process group and has `PR_SET_PDEATHSIG = SIGTERM`. On timeout or cancellation the
//! worker kills the whole group; if the worker itself dies (even by SIGKILL) the kernel
//! sends the guard SIGTERM and its trap kills the group. So no orphan keeps running a job
//! that the broker is about to redeliver elsewhere.
#![allow(unsafe_code)]

use futures_util::future::BoxFuture;
use std::process::Stdio;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use crate::handler::{Handler, JobContext, JobError};

/// Keep at most this much of the program's stderr for the error message.
const STDERR_TAIL: usize = 2048;

const GUARD: &str = r#"exec 3<&0; trap 'kill -KILL 0' TERM HUP INT; "$@" <&3 3<&- & wait $!"#;

/// Runs a program per job (`handler = "exec"`), payload on stdin; see the module docs.
pub struct ExecHandler {
    command: Vec<String>,
    permanent: Vec<i32>,
    /// What the program's environment starts from (see the module docs).
    env: Vec<(String, String)>,
}

impl ExecHandler {
    /// `command` is argv; exit codes in `permanent_exit_codes` dead-letter at once; `env` is
    /// the program's whole environment (chime's own variables are added per run).
    pub fn new(command: Vec<String>, permanent_exit_codes: Vec<i32>, env: Vec<(String, String)>) -> Self {
        Self { command, permanent: permanent_exit_codes, env }
    }
}

/// Variables every program gets from the worker's environment, when set there.
const SAFE: [&str; 8] = ["PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR"];

/// The worker's variables a program starts with: the safe ones, locale (`LC_*`), and `extra`.
pub fn environment<'a>(extra: impl Iterator<Item = &'a str>) -> Vec<(String, String)> {
    let extra: Vec<&str> = extra.collect();
    std::env::vars()
        .filter(|(k, _)| SAFE.contains(&k.as_str()) || k.starts_with("LC_") || extra.contains(&k.as_str()))
        .collect()
}

/// Kills the process group when dropped (timeout, cancellation, panic, abort).
struct GroupGuard(Option<i32>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(pgid) = self.0.take() {
            // SAFETY: killpg only sends a signal; a stale pgid fails with ESRCH.
            unsafe {
                libc::killpg(pgid, libc::SIGKILL);
            }
        }
    }
}

impl Handler for ExecHandler {
    fn call<'a>(
        &'a self,
        ctx: JobContext,
        payload: serde_json::Value,
    ) -> BoxFuture<'a, Result<(), JobError>> {
        Box::pin(run(&self.command, &self.permanent, &self.env, ctx, payload))
    }
}

async fn run(
    command: &[String],
    permanent: &[i32],
    env: &[(String, String)],
    ctx: JobContext,
    payload: serde_json::Value,
) -> Result<(), JobError> {
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c").arg(GUARD).arg("chime-exec").args(command);
    cmd.env_clear().envs(env.iter().map(|(k, v)| (k, v)));
    cmd.env("CHIME_JOB", &ctx.job)
        .env("CHIME_QUEUE", &ctx.queue)
        .env("CHIME_KEY", ctx.key.to_string())
        .env("CHIME_ID", ctx.id.to_string())
        .env("CHIME_ATTEMPT", ctx.attempt.to_string())
        .env("CHIME_MAX_ATTEMPTS", ctx.max_attempts.to_string())
        .env("CHIME_SLOT", ctx.slot.map(|s| s.to_rfc3339()).unwrap_or_default())
        .env("CHIME_FENCE", ctx.fence.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let parent = std::process::id();
    // SAFETY: only async-signal-safe calls (prctl, getppid, _exit) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            // The worker may have died between fork and prctl: then nobody would signal us.
            if libc::getppid() != i32::try_from(parent).unwrap_or(-1) {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let mut child =
        cmd.spawn().map_err(|e| JobError::transient(format!("cannot start {:?}: {e}", command.first())))?;
    let guard = GroupGuard(child.id().and_then(|id| i32::try_from(id).ok()));

    let body = serde_json::to_vec(&payload).unwrap_or_default();
    let mut stdin = child.stdin.take();
    let write = async move {
        if let Some(s) = stdin.as_mut() {
            // A program that does not read stdin closes the pipe: not an error.
            let _ = s.write_all(&body).await;
            let _ = s.shutdown().await;
        }
    };
    let mut stderr = child.stderr.take();
    let read = async move {
        // Read as it comes, keep only the tail: memory stays bounded whatever the program writes.
        let mut tail: Vec<u8> = Vec::with_capacity(2 * STDERR_TAIL);
        let mut chunk = [0u8; 8192];
        if let Some(s) = stderr.as_mut() {
            while let Ok(n) = s.read(&mut chunk).await {
                if n == 0 {
                    break;
                }
                tail.extend_from_slice(&chunk[..n]);
                if tail.len() > 2 * STDERR_TAIL {
                    tail.drain(..tail.len() - STDERR_TAIL);
                }
            }
        }
        let start = tail.len().saturating_sub(STDERR_TAIL);
        String::from_utf8_lossy(&tail[start..]).trim().to_string()
    };
    let (_, tail, status) = tokio::join!(write, read, child.wait());
    let status = status.map_err(|e| JobError::transient(format!("waiting for the program: {e}")))?;
    drop(guard); // the group leader exited; kill stragglers it left behind
    let detail = if tail.is_empty() { String::new() } else { format!(": {tail}") };
    match status.code() {
        Some(0) => Ok(()),
        Some(code) if permanent.contains(&code) => {
            Err(JobError::permanent(format!("exit code {code} (permanent){detail}")))
        }
        Some(code) => Err(JobError::transient(format!("exit code {code}{detail}"))),
        None => Err(JobError::transient(format!("killed by a signal{detail}"))),
    }
}
