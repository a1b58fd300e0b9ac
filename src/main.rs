fn main() -> std::process::ExitCode {
    dispatch_gateway::cli::run()
}
