//! The model: HF config and safetensors loading, the embedded `tiny` model, the Llama-family
//! forward pass over a [`crate::backend::Backend`], tokenizers and sampling.

pub mod config;
pub mod gguf;
pub mod llama;
pub mod logits;
pub mod pick;
pub mod random;
pub mod rope;
pub mod sampling;
pub mod tokenizer;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

pub use config::{Arch, ModelConfig};
pub use llama::{DecodeAttention, Model, PrefillOutput, SelfAttention};
pub use sampling::{Sampler, Sampling};
pub use tokenizer::Tokenizer;

use crate::backend::Backend;

/// Errors of loading and running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read.
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    /// `config.json` (or `tokenizer.json`) is invalid or unsupported.
    #[error("{0}")]
    Config(String),
    /// A weight is missing, misshapen or of an unsupported dtype.
    #[error("{0}")]
    Weights(String),
    /// Input the model cannot take (token id out of range, prompt too long).
    #[error("{0}")]
    Input(String),
    /// The attention engine failed (a CPU part was lost).
    #[error("{0}")]
    Attention(String),
    /// The backend failed (a device error).
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
}

/// A model with its tokenizer.
#[derive(Debug)]
pub struct LoadedModel {
    /// The executor.
    pub model: Model,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
}

/// Loads `tiny` (embedded), a HF model directory or a GGUF file onto `backend`.
pub fn load(spec: &str, backend: Arc<dyn Backend>) -> Result<LoadedModel, ModelError> {
    if spec == "tiny" {
        let (cfg, wm) = random::tiny();
        let model = Model::from_weights(cfg, "tiny", wm, backend)?;
        return Ok(LoadedModel {
            model,
            tokenizer: Tokenizer::Bytes,
        });
    }
    let path = Path::new(spec);
    if gguf::is_gguf(path) {
        let g = gguf::load(path)?;
        let name = path.file_stem().and_then(|n| n.to_str()).unwrap_or("model");
        let model = Model::from_weights(g.cfg, name, g.weights, backend)?;
        return Ok(LoadedModel {
            model,
            tokenizer: g.tokenizer,
        });
    }
    let dir = path;
    let cfg = ModelConfig::from_dir(dir)?;
    let wm = weights::WeightMap::open(dir)?;
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("model");
    let model = Model::from_weights(cfg, name, wm, backend)?;
    let tokenizer = Tokenizer::from_dir(dir)?;
    Ok(LoadedModel { model, tokenizer })
}
