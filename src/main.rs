//! The `wakebus` command: parses arguments and calls the library's `run` functions.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
