//! `chime`: parses flags, sets up logging, runs the command, exits with its code.

use clap::Parser;

#[tokio::main]
async fn main() {
    let cli = chime_cli::cli::Cli::parse();
    chime_daemon::telemetry::init_tracing();
    std::process::exit(chime_cli::cli::main_exit_code(cli).await);
}
