//! The `turnstile` binary: everything it does lives in the library's `cli` module.

fn main() {
    std::process::exit(turnstile::cli::main());
}
