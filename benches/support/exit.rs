//! How every bench ends, with `nnfuse`'s exit statuses: 0 measured, 2 an error, 3 no GPU (no
//! driver, no device, or a CUDA library missing), so that a script can tell "cannot run here"
//! from a failure.

use std::process::ExitCode;

/// The exit status of a bench that cannot run on this machine.
const EXIT_NO_GPU: u8 = 3;

/// The exit status for `result`, the error (if any) printed on stderr after `bench`'s name.
pub fn finish(bench: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{bench} bench: {e:#}");
            let no_gpu = matches!(
                e.downcast_ref::<nnfuse::Error>(),
                Some(nnfuse::Error::NoDevice(_) | nnfuse::Error::LibraryMissing { .. })
            );
            ExitCode::from(if no_gpu { EXIT_NO_GPU } else { 2 })
        }
    }
}
