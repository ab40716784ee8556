//! Measuring helpers: medians, latency histograms, RSS and CPU time from `/proc`.

use hdrhistogram::Histogram;
use std::io::Write;
use std::sync::Arc;

pub fn progress(what: &str) {
    eprint!("\r\x1b[2K{what}");
    let _ = std::io::stderr().flush();
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Latencies in µs (1 µs to 1 h, 3 significant digits).
pub fn latencies() -> Arc<std::sync::Mutex<Histogram<u64>>> {
    Arc::new(std::sync::Mutex::new(Histogram::new_with_bounds(1, 3_600_000_000, 3).unwrap()))
}

/// The `q` quantile of a latency histogram, in ms.
pub fn quantile_ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

pub fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU seconds (user + system) of a process.
pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Pids of the processes whose command name is `comm` (e.g. `beam.smp`, `redis-server`).
pub fn pids_named(comm: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm))
        .collect()
}

/// CPU time of the broker, Redis and the consumer during one measured window.
pub struct CpuWindow {
    pub broker: Vec<u32>,
    pub redis: Vec<u32>,
    pub consumers: Vec<u32>,
    pub start: [f64; 3],
}

impl CpuWindow {
    pub fn start(consumers: Vec<u32>) -> Self {
        let broker = pids_named("beam.smp");
        let redis = pids_named("redis-server");
        let mut w = Self { broker, redis, consumers, start: [0.0; 3] };
        w.start = w.now();
        w
    }
    pub fn now(&self) -> [f64; 3] {
        let sum = |pids: &[u32]| pids.iter().map(|p| cpu_secs(*p)).sum::<f64>();
        [sum(&self.broker), sum(&self.redis), sum(&self.consumers)]
    }
    /// µs of CPU per message for broker, Redis and the consumer process(es).
    pub fn per_message(&self, n: u64) -> [f64; 3] {
        let end = self.now();
        std::array::from_fn(|i| (end[i] - self.start[i]) * 1e6 / n as f64)
    }
}

/// Median of each component of several `[broker, redis, consumer]` CPU figures.
pub fn median3(v: &[[f64; 3]]) -> [f64; 3] {
    std::array::from_fn(|i| median(v.iter().map(|x| x[i]).collect()))
}

pub fn cpu_text(c: [f64; 3]) -> String {
    format!("CPU/msg: broker {:.0} µs, redis {:.0} µs, consumer {:.0} µs", c[0], c[1], c[2])
}

/// User and system CPU seconds of a process, apart.
pub fn cpu_user_sys(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) / 100.0;
    (ticks(11), ticks(12))
}

/// Counts the system calls of a running process with `perf stat` (every thread of it), from
/// `start` to `stop`; `None` where perf is missing or may not trace.
pub struct Syscalls {
    perf: Option<std::process::Child>,
    out: std::path::PathBuf,
}

impl Syscalls {
    pub fn start(pid: u32) -> Self {
        let s = Self::spawn(pid);
        s.wait_attached();
        s
    }

    /// Starts `perf stat` on `pid` without waiting for it to attach (the system calls `pid`
    /// makes meanwhile are not counted).
    pub fn spawn(pid: u32) -> Self {
        let out =
            std::env::temp_dir().join(format!("chime-bench-perf-{pid}-{}", uuid::Uuid::new_v4().simple()));
        let perf = std::process::Command::new("perf")
            .args(["stat", "-e", "raw_syscalls:sys_enter", "-x,", "-o"])
            .arg(&out)
            .args(["-p", &pid.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok();
        Self { perf, out }
    }

    /// Waits (up to 5 s) until perf has attached: it writes its header then.
    fn wait_attached(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while self.perf.is_some()
            && std::time::Instant::now() < deadline
            && !std::fs::read_to_string(&self.out).is_ok_and(|s| s.contains("started on"))
        {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    pub fn stop(mut self) -> Option<u64> {
        let mut perf = self.perf.take()?;
        let _ = std::process::Command::new("kill").args(["-INT", &perf.id().to_string()]).status();
        let _ = perf.wait();
        let text = std::fs::read_to_string(&self.out).ok()?;
        let _ = std::fs::remove_file(&self.out);
        text.lines().find(|l| l.contains("raw_syscalls:sys_enter"))?.split(',').next()?.trim().parse().ok()
    }
}

/// Context switches (voluntary and not) of every thread a process has now.
pub fn ctx_switches(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("status")).ok())
        .flat_map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// System calls and context switches of consumer processes over a window (what a job costs
/// in wake-ups, beside its CPU time).
pub struct Wakeups {
    syscalls: Vec<Syscalls>,
    pids: Vec<u32>,
    switches: u64,
}

impl Wakeups {
    /// Counts system calls only with `BENCH_SYSCALLS=1`: attaching perf to a busy process can
    /// take seconds, in which ready workers drain a good part of their backlog, and a traced
    /// process runs slower (context switches cost nothing to count).
    pub fn start(pids: &[u32]) -> Self {
        let trace = std::env::var("BENCH_SYSCALLS").is_ok_and(|v| v == "1");
        // Every perf attaches at once (one after the other took seconds with 4 workers).
        let syscalls: Vec<Syscalls> =
            if trace { pids.iter().map(|p| Syscalls::spawn(*p)).collect() } else { Vec::new() };
        syscalls.iter().for_each(Syscalls::wait_attached);
        Self { syscalls, pids: pids.to_vec(), switches: pids.iter().map(|p| ctx_switches(*p)).sum() }
    }
    /// `[syscalls, context switches]` per message (syscalls NaN without perf).
    pub fn per_message(self, n: u64) -> [f64; 2] {
        let switches = self.pids.iter().map(|p| ctx_switches(*p)).sum::<u64>().saturating_sub(self.switches);
        let calls: Option<u64> =
            if self.syscalls.is_empty() { None } else { self.syscalls.into_iter().map(Syscalls::stop).sum() };
        let n = n as f64;
        [calls.map(|c| c as f64 / n).unwrap_or(f64::NAN), switches as f64 / n]
    }
}

/// Medians of [`Wakeups`] figures, as the consume lines print them.
pub fn wakeup_text(v: &[[f64; 2]]) -> String {
    let m = |i: usize| median(v.iter().map(|w| w[i]).collect());
    if m(0).is_nan() {
        format!("consumer {:.2} context switches per msg", m(1))
    } else {
        format!("consumer {:.2} syscalls, {:.2} context switches per msg", m(0), m(1))
    }
}

/// CPU (user and system, µs) and system calls per message of one process over a window.
pub struct ProcCost {
    pid: u32,
    cpu: (f64, f64),
    syscalls: Syscalls,
}

/// What a [`ProcCost`] window measured, per message.
#[derive(Clone, Copy, Default)]
pub struct Cost {
    pub user_us: f64,
    pub sys_us: f64,
    pub syscalls: f64,
}

impl ProcCost {
    pub fn start(pid: u32) -> Self {
        let syscalls = Syscalls::start(pid);
        Self { pid, cpu: cpu_user_sys(pid), syscalls }
    }
    pub fn per_message(self, n: u64) -> Cost {
        let (u, s) = cpu_user_sys(self.pid);
        let calls = self.syscalls.stop().map(|c| c as f64 / n as f64).unwrap_or(f64::NAN);
        let n = n as f64;
        Cost { user_us: (u - self.cpu.0) * 1e6 / n, sys_us: (s - self.cpu.1) * 1e6 / n, syscalls: calls }
    }
}

impl Cost {
    pub fn median(v: &[Cost]) -> Cost {
        Cost {
            user_us: median(v.iter().map(|c| c.user_us).collect()),
            sys_us: median(v.iter().map(|c| c.sys_us).collect()),
            syscalls: median(v.iter().map(|c| c.syscalls).collect()),
        }
    }
    pub fn text(&self) -> String {
        format!(
            "CPU/msg user {:.1} µs, sys {:.1} µs; {:.2} syscalls/msg",
            self.user_us, self.sys_us, self.syscalls
        )
    }
}
