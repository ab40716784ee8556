//! chime and chime-worker processes of a test's own, their ledgers and signals.

use super::*;

/// Path of a workspace binary (`chime`, `chime-worker`) next to the test executable.
pub fn bin(name: &str) -> PathBuf {
    // Test executables live in target/<profile>/deps, binaries such as chime-reliability in
    // target/<profile>: look beside the executable, then one level up.
    let exe = std::env::current_exe().unwrap();
    let here = exe.parent().unwrap();
    let path = [here.join(name), here.parent().unwrap().join(name)]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| here.join(name));
    assert!(
        path.exists(),
        "{} not found: build the binaries first (`cargo build --workspace --bins`, done by scripts/test)",
        path.display()
    );
    path
}

/// A child process killed (SIGKILL) on drop unless it already exited.
pub struct Child {
    pub child: tokio::process::Child,
    pub log: PathBuf,
}

impl Child {
    /// Spawns `chime-worker --config CONFIG args…`, logging to a file in `dir`.
    pub fn worker(dir: &Path, config: &Path, args: &[&str], tag: &str) -> Self {
        Self::spawn("chime-worker", dir, config, args, &format!("worker-{tag}"))
    }

    /// Like `worker`, with extra environment variables.
    pub fn worker_env(dir: &Path, config: &Path, tag: &str, envs: &[(&str, &str)]) -> Self {
        let mut cmd = tokio::process::Command::new(bin("chime-worker"));
        cmd.envs(envs.iter().copied());
        Self::run(cmd, dir, config, &[], &format!("worker-{tag}"))
    }

    /// Spawns `chime --config CONFIG args…` (a daemon such as `watch`).
    pub fn chime(dir: &Path, config: &Path, args: &[&str], tag: &str) -> Self {
        Self::spawn("chime", dir, config, args, tag)
    }

    /// Peak resident memory of the process so far (`VmHWM`), in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Whether the process has exited (reaps it if so).
    pub fn child_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Open file descriptors of the process.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).map(|d| d.count()).unwrap_or(0)
    }

    /// Spawns `chime --config CONFIG tick args…`.
    pub fn ticker(dir: &Path, config: &Path, args: &[&str], tag: &str) -> Self {
        let mut all = vec!["tick"];
        all.extend_from_slice(args);
        Self::spawn("chime", dir, config, &all, &format!("ticker-{tag}"))
    }

    /// Spawns `chime tick` with its wall clock `offset` away from the real one (see
    /// [`Child::with_clock`]).
    pub fn skewed_ticker(dir: &Path, config: &Path, offset: &str, tag: &str) -> Self {
        Self::with_clock("chime", dir, config, &["tick"], offset, &format!("ticker-{tag}"), &[])
    }

    /// Spawns `program --config CONFIG args…` with its wall clock `offset` (libfaketime's
    /// `FAKETIME`, e.g. `+3s` or `-3456000`) away from the real one: libfaketime is preloaded
    /// into the process itself — the `faketime` wrapper forks, so killing it would leave the
    /// program running; the monotonic clock is left alone, as a skewed NTP client would.
    /// Children it starts (an `exec` job) inherit the clock.
    pub fn with_clock(
        program: &str,
        dir: &Path,
        config: &Path,
        args: &[&str],
        offset: &str,
        tag: &str,
        envs: &[(&str, &str)],
    ) -> Self {
        let mut cmd = tokio::process::Command::new(bin(program));
        cmd.envs(faked_clock(offset)).envs(envs.iter().copied());
        Self::run(cmd, dir, config, args, tag)
    }

    fn spawn(program: &str, dir: &Path, config: &Path, args: &[&str], tag: &str) -> Self {
        Self::run(tokio::process::Command::new(bin(program)), dir, config, args, tag)
    }

    /// Runs `cmd --config CONFIG args…` with debug logs into `dir/TAG.log`.
    /// Spawns `cmd --config CONFIG args…`, logging to a file in `dir`.
    pub fn run(
        mut cmd: tokio::process::Command,
        dir: &Path,
        config: &Path,
        args: &[&str],
        tag: &str,
    ) -> Self {
        let log = dir.join(format!("{tag}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = cmd
            .arg("--config")
            .arg(config)
            .args(args)
            .env("RUST_LOG", "info,chime_worker=debug,chime_producer=debug")
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self { child, log }
    }

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id().unwrap_or(0)).unwrap()
    }

    pub fn signal(&self, sig: i32) {
        signal_pid(u32::try_from(self.pid()).unwrap_or(0), sig);
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Lines of a ledger file (one line per event, appended by exec jobs).
pub fn ledger(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_string).collect()
}

/// Counts of lines equal to `line` in a ledger.
pub fn count(lines: &[String], line: &str) -> usize {
    lines.iter().filter(|l| l.as_str() == line).count()
}

/// Sends `sig` to `pid` through the `kill` program (the test crate has no unsafe code).
pub fn signal_pid(pid: u32, sig: i32) {
    let status =
        std::process::Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status().unwrap();
    assert!(status.success(), "kill -{sig} {pid} failed");
}

/// The environment that runs a program with its wall clock `offset` (libfaketime's `FAKETIME`)
/// away from the real one, the monotonic clock left alone (see [`Child::with_clock`]).
pub fn faked_clock(offset: &str) -> [(&'static str, String); 3] {
    let lib =
        ["/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1", "/usr/lib/faketime/libfaketimeMT.so.1"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .unwrap_or_else(|| {
                panic!("libfaketime is needed for faked clocks (scripts/services installs faketime)")
            });
    [
        ("LD_PRELOAD", lib.to_string()),
        ("FAKETIME", offset.to_string()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()),
    ]
}
