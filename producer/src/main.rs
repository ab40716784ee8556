use clap::Parser;

#[tokio::main]
async fn main() {
    let cli = chime_producer::cli::Cli::parse();
    tracing_subscriber_init();
    let code = chime_producer::cli::main_exit_code(cli).await;
    std::process::exit(code);
}

fn tracing_subscriber_init() {
    chime_shared::telemetry::init_tracing();
}
