//! The NVLS (NVLink multicast) path: refused unless every condition holds.
//!
//! Multicast objects on these shared machines can take a host's GPUs out of service, so the
//! path is never chosen automatically, and is refused unless (1) the user asked for it by
//! name (`--algo nvls`), (2) `NCCL_NVLS_ENABLE` is not `0`, and (3) the device reports
//! multicast support. The checks run in that order, the environment before the device is
//! even queried. Past them, the multicast transport itself is not implemented in arbor:
//! the call ends in [`GpuError::NotImplemented`], so no multicast object is ever created.

use super::GpuError;

/// Environment variable that, when `0`, forbids NVLink multicast (NCCL's own switch).
pub const NVLS_ENV: &str = "NCCL_NVLS_ENABLE";

/// Runs the three checks. `env_value` is `NCCL_NVLS_ENABLE`'s value (None when unset);
/// `device_multicast` asks the device (only called when the first two checks pass).
pub fn check_nvls(
    explicitly_requested: bool,
    env_value: Option<&str>,
    device_multicast: impl FnOnce() -> Result<bool, GpuError>,
) -> Result<(), GpuError> {
    if !explicitly_requested {
        return Err(GpuError::NvlsRefused(
            "NVLS (NVLink multicast) is never selected automatically; ask for it by name \
             (--algo nvls) to use it"
                .into(),
        ));
    }
    if let Some(v) = env_value {
        if v.trim() == "0" {
            return Err(GpuError::NvlsRefused(format!(
                "{NVLS_ENV}=0 in the environment forbids NVLink multicast on this machine; \
                 arbor will not override it"
            )));
        }
    }
    if !device_multicast()? {
        return Err(GpuError::NvlsRefused(
            "the device does not report NVLink multicast support \
             (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0)"
                .into(),
        ));
    }
    Ok(())
}

/// The checks with this process's environment, then the honest end of the path.
pub fn nvls_all_reduce(
    explicitly_requested: bool,
    device_multicast: impl FnOnce() -> Result<bool, GpuError>,
) -> Result<(), GpuError> {
    let env = std::env::var(NVLS_ENV).ok();
    check_nvls(explicitly_requested, env.as_deref(), device_multicast)?;
    Err(GpuError::NotImplemented(
        "the NVLS multicast transport is not implemented in arbor; use --algo oneshot, \
         twoshot or allgather-tree"
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn never_asked() -> Result<bool, GpuError> {
        panic!("the device must not be queried when an earlier check refuses")
    }

    #[test]
    fn refused_when_not_requested_explicitly() {
        let e = check_nvls(false, None, never_asked).unwrap_err();
        assert!(matches!(e, GpuError::NvlsRefused(_)));
        assert!(e.to_string().contains("--algo nvls"), "{e}");
    }

    #[test]
    fn refused_when_env_forbids_it() {
        for v in ["0", " 0 "] {
            let e = check_nvls(true, Some(v), never_asked).unwrap_err();
            assert!(matches!(e, GpuError::NvlsRefused(_)));
            assert!(e.to_string().contains("NCCL_NVLS_ENABLE=0"), "{e}");
        }
    }

    #[test]
    fn refused_without_device_support() {
        let e = check_nvls(true, Some("1"), || Ok(false)).unwrap_err();
        assert!(
            e.to_string().contains("does not report NVLink multicast"),
            "{e}"
        );
        let e = check_nvls(true, None, || Ok(false)).unwrap_err();
        assert!(
            e.to_string().contains("does not report NVLink multicast"),
            "{e}"
        );
    }

    #[test]
    fn device_errors_pass_through() {
        let e = check_nvls(true, None, || {
            Err(GpuError::Unavailable("no driver".into()))
        })
        .unwrap_err();
        assert!(e.to_string().contains("no driver"), "{e}");
    }

    #[test]
    fn all_checks_pass_then_not_implemented() {
        assert!(check_nvls(true, Some("1"), || Ok(true)).is_ok());
        // With the process environment: the lent machines set NCCL_NVLS_ENABLE=0, so this
        // is refused there; elsewhere the path stops at "not implemented". Never Ok.
        let e = nvls_all_reduce(true, || Ok(true)).unwrap_err();
        match std::env::var(NVLS_ENV).ok().as_deref().map(str::trim) {
            Some("0") => assert!(matches!(e, GpuError::NvlsRefused(_)), "{e}"),
            _ => assert!(matches!(e, GpuError::NotImplemented(_)), "{e}"),
        }
    }
}
