// The BullMQ side of scripts/bench-peers: one no-op job that counts itself in Redis.
// `node bullmq_app.js publish`: N jobs with addBulk, 1,000 per call (removeOnComplete).
// `node bullmq_app.js work CONCURRENCY`: a worker.
const { Queue, Worker } = require("bullmq");
const IORedis = require("ioredis");

const KEY = process.env.PEERS_KEY;
const N = Number(process.env.PEERS_N);
const QUEUE = process.env.PEERS_QUEUE;
const url = process.env.PEERS_REDIS;
const u = new URL(url);
// BullMQ opens its connections from these options (with its own ioredis).
const connection = () => ({ host: u.hostname, port: Number(u.port || 6379), maxRetriesPerRequest: null });

async function publish() {
  const queue = new Queue(QUEUE, { connection: connection() });
  for (let i = 0; i < N; i += 1000) {
    const jobs = [];
    for (let j = i; j < Math.min(i + 1000, N); j++) {
      jobs.push({ name: "noop", data: { i: j }, opts: { removeOnComplete: true } });
    }
    await queue.addBulk(jobs);
  }
  await queue.close();
}

function work(concurrency) {
  const r = new IORedis(url);
  new Worker(
    QUEUE,
    async () => {
      const n = await r.incr(KEY);
      if (n === 1) await r.set(KEY + ":t0", String(Date.now() / 1000));
      if (n === N) await r.set(KEY + ":t1", String(Date.now() / 1000));
    },
    { connection: connection(), concurrency },
  );
}

if (process.argv[2] === "publish") {
  publish().then(() => process.exit(0), (e) => { console.error(e); process.exit(1); });
} else {
  work(Number(process.argv[3] || 1));
}
