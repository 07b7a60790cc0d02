//! Why a serving loop stopped: the group broke (a rank is gone) or a step failed. A command
//! that could not apply is not one of these: it is answered with a `Refusal` and the loop
//! goes on.

use arbor_collective::CommError;
use arbor_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A broadcast to (or from) the other ranks failed: one of them is gone.
    #[error("{context}")]
    Collective {
        context: String,
        #[source]
        source: Box<CommError>,
    },
    /// A step or a command failed on this rank, or the ranks could not exchange outcomes.
    #[error("{context}")]
    Model {
        context: String,
        #[source]
        source: Box<ModelError>,
    },
    /// A plan that could not be encoded, decoded or applied.
    #[error(transparent)]
    Plan(Box<ModelError>),
}

impl From<ModelError> for ServeError {
    fn from(e: ModelError) -> Self {
        ServeError::Plan(Box::new(e))
    }
}

impl ServeError {
    pub(crate) fn collective(context: impl Into<String>) -> impl FnOnce(CommError) -> Self {
        let context = context.into();
        move |source| ServeError::Collective {
            context,
            source: Box::new(source),
        }
    }

    pub(crate) fn model(context: impl Into<String>) -> impl FnOnce(ModelError) -> Self {
        let context = context.into();
        move |source| ServeError::Model {
            context,
            source: Box::new(source),
        }
    }
}

/// The error and its causes on one line (`a: b: c`), as the binary's edge prints them:
/// what a request still waiting is told when the loop stops.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}
