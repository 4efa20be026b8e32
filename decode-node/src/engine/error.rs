//! Why a request could not run, by layer: the service maps each to one gRPC code.

use crate::backend::BackendError;
use crate::model::ModelError;

/// Why a job failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// Host or device KV cannot hold the request: it can never fit, or waited too long.
    #[error("{0}")]
    Exhausted(String),
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// The model refused the request's input (a token id out of range, the context full).
    #[error("{0}")]
    Input(String),
    /// The device or one of its libraries failed: this node cannot serve the step.
    #[error("device error: {0}")]
    Device(String),
    /// The device is lost for good: this node serves nothing more until it restarts.
    #[error("{0}")]
    DeviceLost(String),
    /// The attention engine failed (a CPU part lost, KV that could not be appended).
    #[error("attention failed: {0}")]
    Attention(String),
    /// The model's output turned NaN or infinite: the pushed KV (or the weights) hold values
    /// no model produces. Streaming tokens sampled from it would be garbage.
    #[error("{0}")]
    NonFinite(String),
    /// A bug in the node; the request cannot go on.
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<ModelError> for EngineError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Input(m) => EngineError::Input(m),
            ModelError::Attention(m) => EngineError::Attention(m),
            // Both may pass once other requests finish: RESOURCE_EXHAUSTED, each saying
            // which memory it was.
            ModelError::Backend(
                b @ (BackendError::DeviceFull(_) | BackendError::OutOfMemory(_)),
            ) => EngineError::Exhausted(b.to_string()),
            ModelError::Backend(b @ (BackendError::Device(_) | BackendError::Unsupported(_))) => {
                EngineError::Device(b.to_string())
            }
            ModelError::Backend(b @ BackendError::DeviceLost(_)) => {
                EngineError::DeviceLost(b.to_string())
            }
            // Loading errors cannot happen in a step; if one does, it is ours.
            e @ (ModelError::Io(..) | ModelError::Config(_) | ModelError::Weights(_)) => {
                EngineError::Internal(e.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_errors_keep_their_layer() {
        let cases = [
            (ModelError::Input("token 99999".into()), "Input"),
            (ModelError::Attention("lost".into()), "Attention"),
            (
                ModelError::Backend(BackendError::Device("ECC".into())),
                "Device",
            ),
            (
                ModelError::Backend(BackendError::Unsupported("hd 512".into())),
                "Device",
            ),
            (
                ModelError::Backend(BackendError::DeviceFull("arena".into())),
                "Exhausted",
            ),
            (
                ModelError::Backend(BackendError::OutOfMemory("scratch".into())),
                "Exhausted",
            ),
            (
                ModelError::Backend(BackendError::DeviceLost("Xid 79".into())),
                "DeviceLost",
            ),
            (ModelError::Weights("w".into()), "Internal"),
        ];
        for (m, want) in cases {
            let e = EngineError::from(m);
            assert!(format!("{e:?}").starts_with(want), "{e:?} is not {want}");
        }
        // An allocation that failed is not said to be the KV slots.
        let oom = EngineError::from(ModelError::Backend(BackendError::OutOfMemory(
            "4096 bytes of scratch".into(),
        )));
        assert_eq!(
            oom.to_string(),
            "device memory ran out: 4096 bytes of scratch"
        );
    }
}
