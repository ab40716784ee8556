# The Sidekiq side of scripts/bench-peers: one no-op job that counts itself in Redis.
require "sidekiq"

# redis-rb 4.6+ warns about Sidekiq 6.4's `sadd` on every push_bulk.
Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=)

KEY = ENV.fetch("PEERS_KEY")
N = Integer(ENV.fetch("PEERS_N"))
QUEUE = ENV.fetch("PEERS_QUEUE")

Sidekiq.configure_server { |c| c.redis = { url: ENV.fetch("PEERS_REDIS") } }
Sidekiq.configure_client { |c| c.redis = { url: ENV.fetch("PEERS_REDIS") } }

class Noop
  include Sidekiq::Worker
  sidekiq_options queue: QUEUE

  def perform(_i)
    Sidekiq.redis do |r|
      n = r.incr(KEY)
      r.set("#{KEY}:t0", Time.now.to_f) if n == 1
      r.set("#{KEY}:t1", Time.now.to_f) if n == N
    end
  end
end

# `ruby sidekiq_app.rb publish`: N jobs with push_bulk, 1,000 per call.
if $PROGRAM_NAME == __FILE__ && ARGV.first == "publish"
  (0...N).each_slice(1000) { |s| Sidekiq::Client.push_bulk("class" => Noop, "args" => s.map { |i| [i] }) }
end
