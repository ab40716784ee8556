//! `chime`: parses flags, sets up logging, runs the command, exits with its code.

use clap::Parser;

#[tokio::main]
async fn main() {
    let cli = chime_cli::cli::Cli::parse();
    // `chime dlq list | head`: a closed pipe ends a command quietly, as for any Unix tool.
    if !cli.command.is_daemon() {
        chime_daemon::signals::default_sigpipe();
    }
    // Logging is set up once the config is read (it may export spans): `cli::run`.
    std::process::exit(chime_cli::cli::main_exit_code(cli).await);
}
