// Included (`include!`) by `common/gateway.rs` and `child_support/mod.rs`: one definition for
// the test targets that mount either. The includer imports `std::os::unix::process::CommandExt`
// and `std::process::Command`.

/// Children die with the test thread that started them (`PR_SET_PDEATHSIG`).
pub fn die_with_parent(command: &mut Command) -> &mut Command {
    // SAFETY: prctl(2) only, which is async-signal-safe, between fork and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}
