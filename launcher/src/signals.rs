//! SIGINT/SIGTERM/SIGHUP to arbor-launch are noted here and forwarded by the supervisor
//! loop (a handler may do almost nothing, so it only records the signal).

use std::sync::atomic::{AtomicI32, Ordering};

static PENDING: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    PENDING.store(sig, Ordering::SeqCst);
}

/// The signals arbor-launch forwards to its ranks.
pub const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Installs the recording handler for [`FORWARDED`].
pub fn install() -> std::io::Result<()> {
    for sig in FORWARDED {
        // SAFETY: a zeroed sigaction is a valid starting value; the handler only performs
        // an atomic store, which is async-signal-safe.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The signal received since the last call, if any.
pub fn take() -> Option<i32> {
    let s = PENDING.swap(0, Ordering::SeqCst);
    (s != 0).then_some(s)
}

/// Sends `sig` to the process group `pgid` (each rank leads its own group, so its
/// children, e.g. those of `sh -c`, are reached too). A group that is gone is fine.
pub fn signal_group(pgid: u32, sig: i32) {
    if let Ok(pgid) = libc::pid_t::try_from(pgid) {
        if pgid > 0 {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe {
                libc::kill(-pgid, sig);
            }
        }
    }
}

/// "SIGTERM" for 15, and so on.
pub fn name(sig: i32) -> String {
    let n = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    n.to_string()
}
