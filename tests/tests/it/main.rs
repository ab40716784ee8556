//! chime's integration tests: one binary, real RabbitMQ and Redis, a prefix per test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod broker_restart;
mod cli;
mod common;
mod dead_letters;
mod deployments;
mod dlq_ops;
mod examples;
mod hostile;
mod idempotency;
mod loss_windows;
mod pipeline;
mod priorities;
mod processes;
mod project;
mod publish;
mod redis_outage;
mod reliability;
mod results;
mod retries;
mod runtime;
mod steer;
mod ticker;
mod tls;
mod topology;
mod web;
