"""chime against Celery, Dramatiq, Sidekiq and BullMQ, in one run.

Each system drains the same number of pre-published no-op jobs, in rounds whose order rotates;
medians are printed with chime's ratio to each. chime, Celery and Dramatiq use the shared
RabbitMQ (a virtual host of their own, deleted at the end) and Redis (keys of their own,
deleted at the end); Sidekiq and BullMQ, whose queues live in Redis, a private redis-server
without persistence on a spare port (stopped at the end). Run through scripts/bench-peers,
which installs the peers.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import redis

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CLK = os.sysconf("SC_CLK_TCK")


def sh(*args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, **kw).stdout


def ctl(*args):
    return sh("rabbitmqctl", "-q", *args)


def cpu_of(pid):
    """CPU seconds of a process and all its descendants."""
    total = 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLK
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    total += cpu_of(int(child))
    except (FileNotFoundError, ProcessLookupError, IndexError):
        pass
    return total


def pids_named(name):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    if f.read().strip() == name:
                        out.append(int(d))
            except OSError:
                pass
    return out


class Cpu:
    """CPU of the broker, Redis and one worker (with its children) over a window."""

    def __init__(self, worker_pid):
        self.worker = worker_pid
        self.broker = pids_named("beam.smp")
        self.redis = pids_named("redis-server")
        self.start = self.now()

    def now(self):
        return (
            sum(cpu_of(p) for p in self.broker),
            sum(cpu_of(p) for p in self.redis),
            cpu_of(self.worker),
        )

    def per_job(self, n):
        end = self.now()
        return [(e - s) * 1e6 / n for s, e in zip(self.start, end)]


def wait(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise SystemExit(f"bench-peers: timed out after {timeout}s waiting for {what}")


class Run:
    def __init__(self, args, vhost):
        self.args = args
        self.vhost = vhost
        self.amqp = f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
        self.redis_url = args.redis
        self.r = redis.Redis.from_url(self.redis_url)
        self.tmp = tempfile.mkdtemp(prefix="chime-peers-")
        self.bin = os.path.join(ROOT, "target", "release")

    def env(self, queue, key):
        e = dict(os.environ)
        e.update(PEERS_AMQP=self.amqp, PEERS_QUEUE=queue, PEERS_REDIS=self.redis_url,
                 PEERS_KEY=key, PEERS_N=str(self.args.jobs), PYTHONPATH=HERE)
        return e

    def python_peer(self, system, pool, rnd):
        """Publishes N jobs with the peer's own API, then drains them with its worker."""
        n = self.args.jobs
        queue = f"peers-{system}-{rnd}"
        key = f"{self.vhost}:{system}:{pool}:{rnd}"
        env = self.env(queue, key)
        if system == "celery":
            publish = "import celery_app as a\nfor _ in range(%d): a.noop.delay()" % n
        else:
            publish = "import dramatiq_app as a\nfor _ in range(%d): a.noop.send()" % n
        t = time.time()
        subprocess.run([sys.executable, "-c", publish], check=True, env=env, cwd=HERE)
        published = n / (time.time() - t)
        if system == "celery":
            cmd = [os.path.join(os.path.dirname(sys.executable), "celery"), "-A", "celery_app", "worker",
                   "-Q", queue, "--loglevel=WARNING", "--without-gossip", "--without-mingle",
                   "--without-heartbeat"]
            if pool == "threads":
                cmd += ["--pool", "threads", "--concurrency", "32"]
        else:
            cmd = [os.path.join(os.path.dirname(sys.executable), "dramatiq"), "dramatiq_app"]
            if pool == "threads":
                cmd += ["--threads", "32"]
        w = subprocess.Popen(cmd, env=env, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait(lambda: self.r.exists(key + ":t0"), 120, f"{system}'s first job")
            cpu = Cpu(w.pid)
            wait(lambda: self.r.exists(key + ":t1"), 1200, f"{system} to drain {n} jobs")
            costs = cpu.per_job(n)
        finally:
            w.terminate()
            try:
                w.wait(timeout=60)
            except subprocess.TimeoutExpired:
                w.kill()
        t0, t1 = float(self.r.get(key + ":t0")), float(self.r.get(key + ":t1"))
        self.r.delete(key, key + ":t0", key + ":t1")
        return published, (n - 1) / (t1 - t0), costs

    def redis_peer(self, system, procs, concurrency, rnd):
        """Sidekiq or BullMQ: publishes N jobs in bulk (push_bulk, addBulk; 1,000 per call)
        to the private Redis, then drains them with `procs` worker processes of `concurrency`
        each (under one shell, so that the CPU figure covers them all)."""
        n = self.args.jobs
        queue = f"peers-{system}-{procs}x{concurrency}-{rnd}"
        key = f"{self.vhost}:{system}:{procs}x{concurrency}:{rnd}"
        env = self.env(queue, key)
        env["PEERS_REDIS"] = self.private_redis
        if system == "sidekiq":
            app = os.path.join(HERE, "sidekiq_app.rb")
            publish = ["ruby", app, "publish"]
            one = f"sidekiq -r {app} -q {queue} -c {concurrency} >/dev/null 2>&1"
        else:
            app = os.path.join(HERE, "bullmq_app.js")
            env["NODE_PATH"] = os.path.join(os.environ.get("CHIME_PEERS_NODE", ""), "node_modules")
            publish = ["node", app, "publish"]
            one = f"node {app} work {concurrency} >/dev/null 2>&1"
        t = time.time()
        subprocess.run(publish, check=True, env=env, cwd=HERE)
        published = n / (time.time() - t)
        r = redis.Redis.from_url(self.private_redis)
        w = subprocess.Popen(["sh", "-c", " & ".join([one] * procs) + " & wait"], env=env, cwd=HERE,
                             start_new_session=True)
        try:
            wait(lambda: r.exists(key + ":t0"), 120, f"{system}'s first job")
            cpu = Cpu(w.pid)
            wait(lambda: r.exists(key + ":t1"), 1200, f"{system} to drain {n} jobs")
            costs = cpu.per_job(n)
        finally:
            os.killpg(w.pid, 15)
            try:
                w.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(w.pid, 9)
        t0, t1 = float(r.get(key + ":t0")), float(r.get(key + ":t1"))
        r.flushall()
        return published, (n - 1) / (t1 - t0), costs

    def chime(self, queue_type, rnd, pack=None):
        """chime enqueue --batch (--pack N), then one chime-worker with the default [worker]
        settings. The enqueue rate is the whole `chime enqueue` process, as a user times it."""
        n = self.args.jobs
        prefix = f"{self.vhost}-chime-{queue_type}-{pack or 1}-{rnd}"
        cfg = os.path.join(self.tmp, f"{prefix}.toml")
        with open(cfg, "w") as f:
            f.write(f'prefix = "{prefix}"\n[amqp]\nurl = "{self.amqp}"\nqueue_type = "{queue_type}"\n'
                    f'[redis]\nurl = "{self.redis_url}"\n[[jobs]]\nname = "noop"\nhandler = "noop"\n')
        lines = os.path.join(self.tmp, "batch.jsonl")
        with open(lines, "w") as f:
            for i in range(n):
                f.write('{"payload":{"i":%d}}\n' % i)
        packing = ["--pack", str(pack)] if pack else []
        t = time.time()
        out = sh(os.path.join(self.bin, "chime"), "--config", cfg, "enqueue", "noop", "--batch", lines, "--json",
                 *packing)
        elapsed = time.time() - t
        report = json.loads(out)
        published = report["confirmed"] / elapsed
        port = 20000 + os.getpid() % 20000
        w = subprocess.Popen([os.path.join(self.bin, "chime-worker"), "--config", cfg, "--listen",
                              f"127.0.0.1:{port}"], env=dict(os.environ, RUST_LOG="warn"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def get(path):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
                    return resp.status, resp.read().decode()
            except Exception:
                return 0, ""

        def completed():
            _, text = get("/metrics")
            return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
                       if l.startswith("chime_jobs_completed_total{"))

        try:
            wait(lambda: get("/readyz")[0] == 200, 60, "chime-worker consuming")
            t0 = time.time()
            cpu = Cpu(w.pid)
            wait(lambda: completed() >= n, 1200, f"chime to drain {n} jobs")
            t1 = time.time()
            costs = cpu.per_job(n)
        finally:
            w.terminate()
            w.wait(timeout=60)
        for k in self.r.scan_iter(f"{prefix}:*", count=10000):
            self.r.unlink(k)
        return published, n / (t1 - t0), costs


SYSTEMS = [
    ("chime, quorum queue (its default), default [worker]", lambda run, r: run.chime("quorum", r)),
    ("chime, classic queue, default [worker]", lambda run, r: run.chime("classic", r)),
    ("chime, quorum queue, --pack 100, default [worker]", lambda run, r: run.chime("quorum", r, 100)),
    ("Celery, defaults (prefork, 1 process per core)", lambda run, r: run.python_peer("celery", "default", r)),
    ("Celery, threads pool, concurrency 32", lambda run, r: run.python_peer("celery", "threads", r)),
    ("Dramatiq, defaults (1 process per core, 8 threads each)", lambda run, r: run.python_peer("dramatiq", "default", r)),
    ("Dramatiq, 32 threads per process", lambda run, r: run.python_peer("dramatiq", "threads", r)),
    ("Sidekiq 6.4, defaults (1 process, concurrency 10)", lambda run, r: run.redis_peer("sidekiq", 1, 10, r)),
    ("Sidekiq 6.4, tuned (2 processes x 25)", lambda run, r: run.redis_peer("sidekiq", 2, 25, r)),
    ("BullMQ 6.7, defaults (1 process, concurrency 1)", lambda run, r: run.redis_peer("bullmq", 1, 1, r)),
    ("BullMQ 6.7, tuned (2 processes x 50)", lambda run, r: run.redis_peer("bullmq", 2, 50, r)),
]


def start_private_redis():
    """A redis-server without persistence on a spare port: (process, URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                          "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(port=port)

    def up():
        try:
            return r.ping()
        except redis.exceptions.ConnectionError:
            return False

    wait(up, 30, "the private redis-server")
    return p, f"redis://127.0.0.1:{port}/0"


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--jobs", type=int, default=20000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--redis", default=os.environ.get("CHIME_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--only", default="", help="comma-separated words: systems whose name has one (chime is always run)")
    args = p.parse_args()
    words = [w.strip().lower() for w in args.only.split(",") if w.strip()]
    systems = [s for s in SYSTEMS if s[0].startswith("chime") or not words or any(w in s[0].lower() for w in words)]
    vhost = f"chime-peers-{os.getpid()}"
    ctl("add_vhost", vhost)
    ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    rates = {name: [] for name, _ in systems}
    pubs = {name: [] for name, _ in systems}
    costs = {name: [] for name, _ in systems}
    private, private_url = start_private_redis()
    try:
        run = Run(args, vhost)
        run.private_redis = private_url
        for rnd in range(args.runs):
            for k in range(len(systems)):
                name, f = systems[(k + rnd) % len(systems)]
                print(f"  round {rnd + 1}/{args.runs}: {name} ...", file=sys.stderr, flush=True)
                published, drained, cost = f(run, rnd)
                pubs[name].append(published)
                rates[name].append(drained)
                costs[name].append(cost)
    finally:
        ctl("delete_vhost", vhost)
        private.terminate()
        private.wait(timeout=30)
    versions = sh(sys.executable, "-m", "pip", "list", "--format=freeze")
    wanted = [v for v in versions.split() if v.split("==")[0].lower() in ("celery", "kombu", "dramatiq", "pika")]
    print(f"peers    {args.jobs} no-op jobs per drain, {args.runs} rounds, medians ({', '.join(wanted)})")
    med = {name: (statistics.median(rates[name]), statistics.median(pubs[name])) for name, _ in systems}
    (q, qe), (c, _), (pk, pke) = (med[systems[i][0]] for i in range(3))
    for name, _ in systems:
        drained, enqueued = med[name]
        cpu = [statistics.median(x[i] for x in costs[name]) for i in range(3)]
        ratio = "" if name.startswith("chime") else \
            (f"   chime drains {q / drained:.2f}x (quorum), {c / drained:.2f}x (classic), {pk / drained:.2f}x (packed);"
             f" enqueues {qe / enqueued:.2f}x, packed {pke / enqueued:.2f}x")
        print(f"peers    {name:<52} drain {drained:>7.0f} jobs/s   enqueue {enqueued:>7.0f}/s"
              f"   CPU/job: broker {cpu[0]:.0f} µs, redis {cpu[1]:.0f} µs, workers {cpu[2]:.0f} µs{ratio}")


if __name__ == "__main__":
    main()
