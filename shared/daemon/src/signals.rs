//! For the daemons' `main`s (libraries install no signal handlers): wait for a stop signal
//! while reloading on SIGHUP and when the config file changes.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use tokio::signal::unix::{SignalKind, signal};

/// How often the config file's modification time is checked. Polling `metadata` (which
/// follows symlinks) rather than inotify (`notify`): a Kubernetes ConfigMap is updated by
/// swapping a `..data` symlink and editors save by renaming over the file, and both replace
/// the inode a file watch is attached to; one `stat` every 2 s sees every kind of change.
const POLL: Duration = Duration::from_secs(2);

/// Returns at the first SIGTERM or SIGINT. Calls `reload` on SIGHUP and whenever the
/// modification time of `config_file` changes (checked every 2 s). Returns at once, with an
/// error, if the handlers cannot be installed.
pub async fn until_stopped(config_file: &Path, reload: impl FnMut()) -> std::io::Result<()> {
    let file = config_file.to_path_buf();
    until_stopped_watching(move || vec![file.clone()], reload).await
}

/// [`until_stopped`] watching every file `files` names (asked again at each check: the config
/// file and the files it points to, such as a calendar's `.ics`, which a reload may change).
pub async fn until_stopped_watching(
    files: impl Fn() -> Vec<PathBuf>,
    mut reload: impl FnMut(),
) -> std::io::Result<()> {
    let (mut term, mut int, mut hup) =
        (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?, signal(SignalKind::hangup())?);
    let mtimes = || -> Vec<(PathBuf, Option<SystemTime>)> {
        files()
            .into_iter()
            .map(|p| {
                let m = std::fs::metadata(&p).and_then(|m| m.modified()).ok();
                (p, m)
            })
            .collect()
    };
    let mut seen = mtimes();
    let mut poll = tokio::time::interval(POLL);
    loop {
        let changed = tokio::select! {
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
            _ = hup.recv() => true,
            _ = poll.tick() => {
                let now = mtimes();
                let changed = now != seen;
                seen = now;
                changed
            }
        };
        if changed {
            reload();
        }
    }
}

/// Returns at the next SIGTERM or SIGINT (the "second signal: exit at once" of a draining
/// daemon).
pub async fn next_stop() -> std::io::Result<()> {
    let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    Ok(())
}

/// The next SIGINT or SIGTERM, by its number (2 or 15): for a command that stops in order on
/// the first (the shell's exit status is then 128 + it).
pub async fn next_stop_signal() -> std::io::Result<i32> {
    let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
    Ok(tokio::select! { _ = term.recv() => libc::SIGTERM, _ = int.recv() => libc::SIGINT })
}

/// Makes a write to a closed pipe end the process quietly, as it does for other Unix tools
/// (`chime dlq list | head`): Rust ignores `SIGPIPE`, so `println!` would otherwise panic with
/// a backtrace on `EPIPE`. For commands that run and exit only (sockets are not concerned:
/// Rust writes to them with `MSG_NOSIGNAL`); daemons keep it ignored.
#[allow(unsafe_code)]
pub fn default_sigpipe() {
    // SAFETY: restoring a signal's default disposition at startup, before any thread runs
    // that could rely on it being ignored; `signal` is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
