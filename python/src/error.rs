//! Every way a call into the native core can fail, and the Python exception each becomes.
//! A bad input or checkpoint is a `ValueError` subclass (`InvalidInput`, `CheckpointError`),
//! a wrong tensor type a `TypeError`, what the package does not do yet
//! `NotImplementedError`, anything else `ArborError`.

use arbor_model::runner::weights_update::{ControlError, FailureKind};
use arbor_model::ModelError;
use pyo3::exceptions::{PyException, PyNotImplementedError, PyTypeError, PyValueError};
use pyo3::{create_exception, PyErr};

create_exception!(
    _native,
    ArborError,
    PyException,
    "arbor failed in a way that is not the input's fault (the backend, a broken state)."
);
create_exception!(
    _native,
    CheckpointError,
    PyValueError,
    "The checkpoint (an HF directory or a GGUF file) cannot be read, or is not a model arbor runs."
);
create_exception!(
    _native,
    InvalidInput,
    PyValueError,
    "A request arbor refuses: ids outside the vocabulary, a sequence longer than the context, \
     tensors that are not the model's."
);

#[derive(Debug, thiserror::Error)]
pub enum NativeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The GPU backend of `arbor.torch`'s CUDA operations.
    #[error(transparent)]
    Backend(#[from] arbor_model::backend::BackendError),
    /// A weight update refused (nothing changed).
    #[error("{}", one_rank(.0))]
    Control(#[from] ControlError),
    /// A value the caller gave that arbor refuses before running anything.
    #[error("{0}")]
    Input(String),
    /// An argument of the wrong Python or torch type.
    #[error("{0}")]
    Type(String),
    #[error("{0}")]
    NotYet(String),
    /// A previous call panicked while holding the model: its state is unknown.
    #[error("the model is unusable: a previous call failed inside arbor ({0}); load it again")]
    Poisoned(String),
}

pub type NResult<T> = Result<T, NativeError>;

/// A refused update's message; the group here is one rank, so "rank 0: " says nothing.
fn one_rank(e: &ControlError) -> String {
    match e.failures.as_slice() {
        [(_, msg)] => msg.clone(),
        _ => e.to_string(),
    }
}

/// Whether a model error is about the checkpoint (its files, config or tensors).
fn is_checkpoint(e: &ModelError) -> bool {
    matches!(
        e,
        ModelError::Io { .. }
            | ModelError::Config { .. }
            | ModelError::UnknownArch { .. }
            | ModelError::Gguf { .. }
            | ModelError::Safetensors { .. }
            | ModelError::MissingTensor { .. }
            | ModelError::ShapeMismatch { .. }
            | ModelError::DtypeUnsupported { .. }
            | ModelError::Tokenizer { .. }
            | ModelError::Sharding { .. }
    )
}

impl From<NativeError> for PyErr {
    fn from(e: NativeError) -> PyErr {
        let msg = e.to_string();
        match e {
            NativeError::Model(ref m) if is_checkpoint(m) => CheckpointError::new_err(msg),
            NativeError::Model(
                ModelError::TokenOutOfVocab { .. }
                | ModelError::ContextTooLong { .. }
                | ModelError::BadRequest { .. },
            ) => InvalidInput::new_err(msg),
            NativeError::Control(ref c) if c.kind == FailureKind::Input => {
                InvalidInput::new_err(msg)
            }
            NativeError::Input(_) => InvalidInput::new_err(msg),
            NativeError::Type(_) => PyTypeError::new_err(msg),
            NativeError::NotYet(_) => PyNotImplementedError::new_err(msg),
            _ => ArborError::new_err(msg),
        }
    }
}
