//! What a backend reports: the device, the collective, or a shape that does not fit.

/// A backend's error; each names the rank or the shapes involved.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("device error on rank {rank}: {msg}")]
    Device { rank: usize, msg: String },
    #[error("collective error on rank {rank}: {source}")]
    Collective {
        rank: usize,
        #[source]
        source: arbor_collective::CommError,
    },
    #[error("shape error: {0}")]
    Shape(String),
    /// What this backend cannot do at all (a request to change that is the caller's).
    #[error("{0}")]
    Unsupported(String),
}

pub type BResult<T> = Result<T, BackendError>;
