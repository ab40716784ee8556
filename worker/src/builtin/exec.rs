//! `exec`: runs a program with the payload on stdin and the run's facts in the environment.
//!
//! Exit 0 = success; an exit code in `permanent_exit_codes` (default 100) = permanent
//! failure; one in `rate_limited_exit_codes` (default none) = the downstream pushed back
//! (`JobError::rate_limited` for [`PUSHBACK_WAIT`]: the run is parked, not counted);
//! anything else (or a signal) = transient.
//!
//! Environment: a clean one. The program gets `PATH`, `HOME`, `USER`, `LOGNAME`, the locale
//! (`LANG`, `LANGUAGE`, `LC_*`), `TZ` and `TMPDIR` from the worker, the variables named in
//! `worker.pass_env` and the job's `pass_env`, and the run's `CHIME_*` facts — never the rest
//! of the worker's environment (its broker and Redis URLs with their passwords).
//!
//! Output: stdout goes to the worker's stdout; stderr is read as it comes and only its last
//! 2 KiB are kept (for the error message), so a program writing gigabytes costs no memory.
//!
//! Checkpoint and result: `CHIME_CHECKPOINT_FILE` names a file that holds the key's last
//! checkpoint when the program starts (empty when there is none); whatever the program writes
//! there is read back every `checkpoints.poll` and when it exits, and saved under the key, so
//! a retry or a copy redelivered after a crash starts from it. `CHIME_RESULT_FILE` names an
//! empty file; what the program leaves in it when it exits 0 is the run's result (JSON if it
//! parses as JSON, else the text). Both files are removed after the run.
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

/// How long a run that exited with one of its `rate_limited_exit_codes` waits (a program
/// cannot say how long), and its job's rate limit with it.
pub const PUSHBACK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Keep at most this much of the program's stderr for the error message.
const STDERR_TAIL: usize = 2048;

/// The guard: SIGTERM (the worker died: `PR_SET_PDEATHSIG`), SIGHUP or SIGINT kill the whole
/// group at once; SIGUSR1 (the run's cancellation: timeout, `chime cancel`, drain deadline)
/// passes SIGTERM on to the program, which then has `worker.cancel_grace` before the group is
/// killed. It waits for the program (once at least, so a program that is already gone still
/// gives its status; again while it lives, as a trapped signal interrupts `wait`) and exits
/// with its status.
const GUARD: &str = r#"exec 3<&0; trap 'kill -KILL 0' TERM HUP INT; trap 'kill -TERM $p 2>/dev/null' USR1; "$@" <&3 3<&- & p=$!; wait $p; s=$?; while kill -0 $p 2>/dev/null; do wait $p; s=$?; done; exit $s"#;

/// Runs a program per job (`handler = "exec"`), payload on stdin; see the module docs.
pub struct ExecHandler {
    command: Vec<String>,
    permanent: Vec<i32>,
    /// Exit codes meaning "the downstream pushed back".
    rate_limited: Vec<i32>,
    /// What the program's environment starts from (see the module docs).
    env: Vec<(String, String)>,
}

impl ExecHandler {
    /// `command` is argv; exit codes in `permanent_exit_codes` dead-letter at once; `env` is
    /// the program's whole environment (chime's own variables are added per run).
    pub fn new(command: Vec<String>, permanent_exit_codes: Vec<i32>, env: Vec<(String, String)>) -> Self {
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| {
            sweep_orphaned_run_files(&std::env::temp_dir());
        });
        Self { command, permanent: permanent_exit_codes, rate_limited: Vec::new(), env }
    }

    /// Exit codes that mean the downstream pushed back (`jobs[].rate_limited_exit_codes`).
    pub fn with_rate_limited_exit_codes(mut self, codes: Vec<i32>) -> Self {
        self.rate_limited = codes;
        self
    }
}

/// Removes the run files (`chime-<pid>-<key>-….checkpoint`, `.result` and `.upstream`) that workers which
/// died mid-run left in `dir`: a SIGKILLed worker never drops its [`RunFiles`]. A file is
/// left when its pid is alive (or when this system has no `/proc` to tell); returns how many
/// were removed. Runs once per process, when the first `exec` handler is built.
pub(crate) fn sweep_orphaned_run_files(dir: &std::path::Path) -> usize {
    if !std::path::Path::new("/proc/self").exists() {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if ![".checkpoint", ".result", ".upstream"].iter().any(|ext| name.ends_with(ext)) {
            continue;
        }
        let Some(pid) = name.strip_prefix("chime-").and_then(|rest| rest.split('-').next()) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists()
            && std::fs::remove_file(entry.path()).is_ok()
        {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(removed, dir = %dir.display(), "removed run files of exec jobs whose worker had died");
    }
    removed
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
        Box::pin(run(self, ctx, payload))
    }
}

/// Creates `path` readable by the worker's user alone (`0600`: `$TMPDIR` may be shared, and a
/// checkpoint or result can hold anything a job saves) and writes `bytes`; fails if the path
/// exists (nothing planted there is followed or reused).
fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(bytes)
}

/// The run's checkpoint and result files (removed when dropped).
struct RunFiles {
    checkpoint: std::path::PathBuf,
    result: std::path::PathBuf,
    /// A workflow step's upstream runs, all of them, as JSON (`[]` for a job that waited for
    /// nothing).
    upstream: std::path::PathBuf,
    /// What the checkpoint file held when last read (or written).
    seen: std::sync::Mutex<Option<Vec<u8>>>,
}

impl RunFiles {
    fn create(ctx: &JobContext) -> std::io::Result<Self> {
        let base = std::env::temp_dir().join(format!(
            "chime-{}-{}-{}-{}",
            std::process::id(),
            ctx.key,
            ctx.attempt,
            uuid::Uuid::new_v4().simple()
        ));
        let checkpoint = base.with_extension("checkpoint");
        let result = base.with_extension("result");
        // An exec job's checkpoint is its file's text (a JSON string); another handler's, its JSON.
        let text = ctx.checkpoint_text().map(|json| match serde_json::from_str::<serde_json::Value>(&json) {
            Ok(serde_json::Value::String(s)) => s,
            _ => json,
        });
        let start = text.unwrap_or_default().into_bytes();
        write_private(&checkpoint, &start)?;
        write_private(&result, b"")?;
        let upstream = base.with_extension("upstream");
        write_private(&upstream, &serde_json::to_vec(ctx.upstream()).unwrap_or_else(|_| b"[]".to_vec()))?;
        Ok(Self { checkpoint, result, upstream, seen: std::sync::Mutex::new(Some(start)) })
    }

    /// Reads at most `max + 1` bytes of `path`.
    fn read_bounded(path: &std::path::Path, max: usize) -> std::io::Result<Vec<u8>> {
        use std::io::Read;
        let mut out = Vec::new();
        std::fs::File::open(path)?.take(max as u64 + 1).read_to_end(&mut out)?;
        Ok(out)
    }

    /// Saves the checkpoint file's text when it changed since last read.
    async fn save_checkpoint(&self, ctx: &JobContext) {
        let Ok(bytes) = Self::read_bounded(&self.checkpoint, ctx.run.max_bytes) else { return };
        if self.seen.lock().ok().is_some_and(|seen| seen.as_deref() == Some(&bytes[..])) {
            return;
        }
        if let Ok(mut seen) = self.seen.lock() {
            *seen = Some(bytes.clone());
        }
        let Ok(text) = String::from_utf8(bytes) else {
            tracing::warn!("the checkpoint file is not UTF-8 text; not saved");
            return;
        };
        if let Err(e) = ctx.save_checkpoint(serde_json::Value::String(text).to_string()).await {
            tracing::warn!(error = %e, "checkpoint not saved");
        }
    }

    /// The result file's content as the run's result, when there is one.
    fn take_result(&self, ctx: &JobContext) {
        let max = ctx.run.result_max_bytes;
        match Self::read_bounded(&self.result, max) {
            Ok(bytes) if bytes.is_empty() => {}
            Ok(bytes) if bytes.len() > max => ctx.set_result_error(format!(
                "the result file holds more than results.max_bytes ({max}); not kept"
            )),
            Ok(bytes) => match serde_json::from_slice::<serde_json::Value>(&bytes) {
                Ok(v) => ctx.set_result(&v),
                Err(_) => ctx.set_result(String::from_utf8_lossy(&bytes).trim_end_matches('\n')),
            },
            Err(e) => ctx.set_result_error(format!("cannot read the result file: {e}")),
        }
    }
}

impl Drop for RunFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.checkpoint);
        let _ = std::fs::remove_file(&self.result);
        let _ = std::fs::remove_file(&self.upstream);
    }
}

/// Largest `CHIME_UPSTREAM` passed with the upstream results (Linux caps one environment
/// string at 128 KiB, and a spawn past it fails); past it, the runs go without their results,
/// and past it even so, the variable is empty: `CHIME_UPSTREAM_FILE` always holds them all.
const UPSTREAM_ENV_BYTES: usize = 100_000;

async fn run(exec: &ExecHandler, ctx: JobContext, payload: serde_json::Value) -> Result<(), JobError> {
    let (command, permanent, env) = (&exec.command, &exec.permanent, &exec.env);
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
        .env("CHIME_SHARD", ctx.shard.map(|(s, _)| s.to_string()).unwrap_or_default())
        .env("CHIME_SHARDS", ctx.shard.map(|(_, n)| n.to_string()).unwrap_or_default())
        .env("CHIME_GROUP", ctx.group.map(|g| g.to_string()).unwrap_or_default())
        .env(
            "CHIME_UPSTREAM",
            chime_shared::workflow::upstream_json(ctx.upstream(), UPSTREAM_ENV_BYTES).unwrap_or_default(),
        )
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
    let files = RunFiles::create(&ctx)
        .map_err(|e| JobError::transient(format!("cannot create the run's files: {e}")))?;
    cmd.env("CHIME_CHECKPOINT_FILE", &files.checkpoint)
        .env("CHIME_RESULT_FILE", &files.result)
        .env("CHIME_UPSTREAM_FILE", &files.upstream);
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
    let watch = async {
        let mut tick = tokio::time::interval(ctx.run.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            files.save_checkpoint(&ctx).await;
        }
    };
    // The run's cancellation: the program gets SIGTERM (through the guard), and the grace to
    // stop before the group is killed with SIGKILL (when this future is dropped).
    let leader = guard.0;
    let term = async {
        ctx.cancel.cancelled().await;
        if let Some(pid) = leader {
            // SAFETY: kill only sends a signal; a stale pid fails with ESRCH.
            unsafe {
                libc::kill(pid, libc::SIGUSR1);
            }
        }
        loop {
            std::future::pending::<()>().await;
        }
    };
    let waited = async {
        tokio::select! {
            status = child.wait() => status,
            never = watch => never,
            never = term => never,
        }
    };
    // stderr is read while the program runs; once it has exited, what it left behind (a
    // background child still holding stderr) is killed, so the run ends with its program.
    let mut read = std::pin::pin!(read);
    let (_, (status, early)) = tokio::join!(write, async {
        let mut waited = std::pin::pin!(waited);
        tokio::select! {
            status = &mut waited => (status, None),
            tail = &mut read => (waited.await, Some(tail)),
        }
    });
    drop(guard); // the group leader exited; kill stragglers it left behind
    let tail = match early {
        Some(tail) => tail,
        None => read.await,
    };
    let status = status.map_err(|e| JobError::transient(format!("waiting for the program: {e}")))?;
    // What the program wrote last before it exited.
    files.save_checkpoint(&ctx).await;
    if status.code() == Some(0) {
        files.take_result(&ctx);
    }
    let detail = if tail.is_empty() { String::new() } else { format!(": {tail}") };
    match status.code() {
        Some(0) => Ok(()),
        Some(code) if permanent.contains(&code) => {
            Err(JobError::permanent(format!("exit code {code} (permanent){detail}")))
        }
        Some(code) if exec.rate_limited.contains(&code) => {
            Err(JobError::rate_limited(PUSHBACK_WAIT, format!("exit code {code} (rate limited){detail}")))
        }
        Some(code) => Err(JobError::transient(format!("exit code {code}{detail}"))),
        None => Err(JobError::transient(format!("killed by a signal{detail}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Files of a dead worker go; those of a live one (this process), and files that only look
    /// alike, stay.
    #[test]
    fn run_files_of_dead_workers_are_swept() {
        let dir = std::env::temp_dir().join(format!("chime-sweep-test-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let me = std::process::id();
        // Above any pid_max Linux allows (2^22): never alive.
        let dead = 999_999_999u32;
        let files = [
            (format!("chime-{dead}-key-1-abc.checkpoint"), false),
            (format!("chime-{dead}-key-1-abc.result"), false),
            (format!("chime-{me}-key-1-def.checkpoint"), true),
            (format!("chime-{me}-key-1-def.result"), true),
            (format!("chime-{dead}-notes.txt"), true),
            ("chime-x-key.result".to_string(), true),
            ("other.checkpoint".to_string(), true),
        ];
        for (name, _) in &files {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        assert_eq!(sweep_orphaned_run_files(&dir), 2);
        for (name, stays) in &files {
            assert_eq!(dir.join(name).exists(), *stays, "{name}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn run_files_are_private_and_never_reuse_a_planted_path() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("chime-private-test-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("run.checkpoint");
        write_private(&path, b"state").unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(write_private(&path, b"again").is_err(), "an existing path is never reused");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
