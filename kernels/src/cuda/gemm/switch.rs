//! The on/off variables of the default path's rules.

use super::error::GemmError;

/// An on/off variable's value: `1`, `0`, or unset / empty for `default`; anything else an
/// error naming the variable.
pub(super) fn switch(
    var: &'static str,
    value: Option<&str>,
    default: bool,
    msg: &'static str,
) -> Result<bool, GemmError> {
    match value.map(str::trim) {
        None | Some("") => Ok(default),
        Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(v) => Err(GemmError::Env {
            var,
            value: v.to_string(),
            msg,
        }),
    }
}
